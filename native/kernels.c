/*
 * gadei's update kernels (see kernels.h): portable loops, AVX2 versions picked at load time
 * when the CPU has AVX2 (and F16C for float16), and OpenMP threads for large arrays.
 */
#include "kernels.h"

#include <stdlib.h>
#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#define GD_HAVE_OPENMP 1
#else
#define GD_HAVE_OPENMP 0
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define GD_X86 1
#include <immintrin.h>
#else
#define GD_X86 0
#endif

/*
 * Elements each thread of a team must have before a kernel wakes one: a team is sized from
 * the work, never larger than the caller's `threads`. Waking a sleeping thread and joining it
 * costs tens of microseconds; one thread updates this many float32 elements in about as long
 * (`gadei bench kernel` and `gadei bench server` show both).
 */
#ifndef GD_THREAD_MIN
#define GD_THREAD_MIN 262144
#endif

static int gd_avx2; /* the CPU runs AVX2 (and F16C): set by gd_kernels_init */

void
gd_kernels_init(void)
{
#if GD_X86
    __builtin_cpu_init();
    gd_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
              getenv("GADEI_NO_AVX2") == NULL;
#endif
}

const char *
gd_kernel_isa(void)
{
    return gd_avx2 ? "avx2" : "generic";
}

int
gd_openmp_built(void)
{
    return GD_HAVE_OPENMP;
}

int
gd_processors(void)
{
#if GD_HAVE_OPENMP
    return omp_get_num_procs();
#else
    return 1;
#endif
}

/*
 * Teams of threads, only in a build with OpenMP; without it every kernel runs its one loop over
 * all n elements (GD_PARALLEL's second form, and gd_copy's and gd_nonfinite's fall-through).
 */
#if GD_HAVE_OPENMP
/* The size of a kernel's team for n float32 elements: 1 below two threads' worth. */
static int
gd_threads(int threads, size_t n)
{
    size_t by_size = n / GD_THREAD_MIN;
    if (threads <= 1 || by_size < 2) return 1;
    return (size_t)threads > by_size ? (int)by_size : threads; /* more than the cores only when asked for */
}

/*
 * The chunk [lo, hi) of n elements of `size` bytes at `base` for thread `tid` of `nt`:
 * inner boundaries fall on 64-byte addresses, so no two threads write one cache line.
 */
static void
gd_chunk(const void *base, size_t size, size_t n, int tid, int nt, size_t *lo, size_t *hi)
{
    size_t skew = ((64 - ((uintptr_t)base & 63)) & 63) / size; /* elements before the first line */
    size_t line = 64 / size;
    if (skew > n) skew = n;
    size_t blocks = (n - skew + line - 1) / line;
    size_t per = blocks / (size_t)nt, extra = blocks % (size_t)nt;
    size_t b0 = (size_t)tid * per + ((size_t)tid < extra ? (size_t)tid : extra);
    size_t b1 = b0 + per + ((size_t)tid < extra ? 1 : 0);
    *lo = tid == 0 ? 0 : skew + b0 * line;
    *hi = tid == nt - 1 ? n : skew + b1 * line;
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

/* Run span(lo, hi) over [0, n) on up to `threads` OpenMP threads, chunked by w's lines. */
#define GD_PARALLEL(w, n, threads, lo, hi, body)                                                 \
    do {                                                                                         \
        int nt_ = gd_threads((threads), (n));                                                    \
        if (nt_ == 1) {                                                                          \
            size_t lo = 0, hi = (n);                                                             \
            body;                                                                                \
        } else {                                                                                 \
            _Pragma("omp parallel num_threads(nt_)")                                             \
            {                                                                                    \
                size_t lo, hi;                                                                   \
                gd_chunk((w), sizeof(float), (n), omp_get_thread_num(), omp_get_num_threads(),   \
                         &lo, &hi);                                                              \
                body;                                                                            \
            }                                                                                    \
        }                                                                                        \
    } while (0)
#else
#define GD_PARALLEL(w, n, threads, lo, hi, body)                                                 \
    do {                                                                                         \
        size_t lo = 0, hi = (n);                                                                 \
        body;                                                                                    \
    } while (0)
#endif

/*
 * One naming scheme: the public gd_X splits the work over a team (GD_PARALLEL) and runs a loop
 * on each chunk. gd_X_generic is X's portable loop; where X has vector code (sgd, momentum,
 * adagrad, adam, nonfinite), gd_X_avx2 takes the same arguments and gives bit-identical
 * results, and GD_DISPATCH calls the one this CPU runs (gd_avx2 is set once, at load).
 */
#if GD_X86
#define GD_DISPATCH(kernel, ...) (gd_avx2 ? kernel##_avx2(__VA_ARGS__) : kernel##_generic(__VA_ARGS__))
#else
#define GD_DISPATCH(kernel, ...) kernel##_generic(__VA_ARGS__)
#endif

/* ------------------------------------------------------------------ conversions */

float
gd_bf16_to_f32(uint16_t b)
{
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

float
gd_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) {
                mant <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float
gd_load(const void *g, int dtype, size_t i)
{
    if (dtype == GD_F16) return gd_f16_to_f32(((const uint16_t *)g)[i]);
    if (dtype == GD_BF16) return gd_bf16_to_f32(((const uint16_t *)g)[i]);
    return ((const float *)g)[i];
}

static inline size_t
gd_itemsize(int dtype)
{
    return dtype == GD_F32 ? 4 : 2;
}

/* ------------------------------------------------------------------ rows of a table */

/* One row's update: the table row starting at element `at`, its gradient `gr` of `width`
 * elements, `ctx` the kernel's arrays and scalars. */
typedef void gd_row_fn(const void *ctx, size_t at, const void *gr, int dtype, size_t width);

/*
 * The one loop over a row-sparse gradient (gd_sgd_rows, gd_adagrad_rows, gd_adam_rows): for
 * r < count, idx[r] names a row of the n_rows x width table and rows + r * width elements its
 * gradient. Rows are taken in order, so an index repeated in one gradient adds up; an index
 * outside 0..n_rows-1 is counted and skipped. Inlined into each kernel, with its `row`.
 */
static inline int64_t
gd_each_row(size_t n_rows, size_t width, const int64_t *idx, const void *rows, int dtype, size_t count,
            gd_row_fn *row, const void *ctx)
{
    int64_t bad = 0;
    size_t stride = width * gd_itemsize(dtype);
    for (size_t r = 0; r < count; r++) {
        int64_t i = idx[r];
        if (i < 0 || (size_t)i >= n_rows) {
            bad++;
            continue;
        }
        row(ctx, (size_t)i * width, (const char *)rows + r * stride, dtype, width);
    }
    return bad;
}

/* ------------------------------------------------------------------ sgd */

static void
gd_sgd_generic(float *restrict w, void *restrict g, int dtype, size_t n, float lr, int clear)
{
    if (dtype == GD_F32) {
        float *restrict gf = g;
        for (size_t i = 0; i < n; i++) {
            w[i] -= lr * gf[i];
            if (clear) gf[i] = 0.0f;
        }
        return;
    }
    uint16_t *restrict gh = g;
    for (size_t i = 0; i < n; i++) {
        w[i] -= lr * gd_load(g, dtype, i);
        if (clear) gh[i] = 0;
    }
}

#if GD_X86
/* 16 gradient elements as two vectors of 8 floats; returns 0 when all their bits are zero. */
__attribute__((target("avx2,f16c"))) static inline int
gd_load16(const void *g, int dtype, size_t i, __m256 *lo, __m256 *hi)
{
    if (dtype == GD_F32) {
        const float *gf = g;
        *lo = _mm256_loadu_ps(gf + i);
        *hi = _mm256_loadu_ps(gf + i + 8);
        __m256i bits = _mm256_or_si256(_mm256_castps_si256(*lo), _mm256_castps_si256(*hi));
        return !_mm256_testz_si256(bits, bits);
    }
    __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i));
    if (_mm256_testz_si256(raw, raw)) return 0;
    __m128i a = _mm256_castsi256_si128(raw), b = _mm256_extracti128_si256(raw, 1);
    if (dtype == GD_F16) {
        *lo = _mm256_cvtph_ps(a);
        *hi = _mm256_cvtph_ps(b);
    } else {
        *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
        *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
    }
    return 1;
}

__attribute__((target("avx2,f16c"))) static inline void
gd_clear16(void *g, int dtype, size_t i)
{
    if (dtype == GD_F32) {
        _mm256_storeu_ps((float *)g + i, _mm256_setzero_ps());
        _mm256_storeu_ps((float *)g + i + 8, _mm256_setzero_ps());
    } else {
        _mm256_storeu_si256((__m256i *)((uint16_t *)g + i), _mm256_setzero_si256());
    }
}

/* Peel scalar elements until w sits on a 64-byte boundary (region arrays are page-aligned;
 * NumPy's start 16 bytes past a line): the vector body then never splits a cache line. */
static size_t
gd_peel(const float *w, size_t n)
{
    size_t head = ((64 - ((uintptr_t)w & 63)) & 63) / sizeof(float);
    if (head > n || ((uintptr_t)w & (sizeof(float) - 1))) head = n;
    return head;
}

/*
 * Lines of 16 gradient elements whose bits are all zero are skipped: w - lr * (+0.0) is w
 * exactly, and a zero line needs no clearing. Small-batch gradients of embedding tables are
 * mostly such lines. A dense gradient costs one OR and test per line more.
 */
__attribute__((target("avx2,f16c"))) static void
gd_sgd_avx2(float *restrict w, void *restrict g, int dtype, size_t n, float lr, int clear)
{
    size_t i = gd_peel(w, n);
    gd_sgd_generic(w, g, dtype, i, lr, clear);
    const __m256 vlr = _mm256_set1_ps(lr);
    for (; i + 16 <= n; i += 16) {
        __m256 g0, g1;
        if (!gd_load16(g, dtype, i, &g0, &g1)) continue;
        _mm256_store_ps(w + i, _mm256_sub_ps(_mm256_load_ps(w + i), _mm256_mul_ps(vlr, g0)));
        _mm256_store_ps(w + i + 8, _mm256_sub_ps(_mm256_load_ps(w + i + 8), _mm256_mul_ps(vlr, g1)));
        if (clear) gd_clear16(g, dtype, i);
    }
    gd_sgd_generic(w + i, (char *)g + i * gd_itemsize(dtype), dtype, n - i, lr, clear);
}

#endif

void
gd_sgd(float *w, void *g, int dtype, size_t n, float lr, int clear, int threads)
{
    size_t item = gd_itemsize(dtype);
    GD_PARALLEL(w, n, threads, lo, hi,
                GD_DISPATCH(gd_sgd, w + lo, (char *)g + lo * item, dtype, hi - lo, lr, clear));
}

/* ------------------------------------------------------------------ momentum */

static void
gd_momentum_generic(float *restrict w, float *restrict v, void *restrict g, int dtype, size_t n, float lr,
                    float mu, int clear)
{
    for (size_t i = 0; i < n; i++) {
        float gi = g ? gd_load(g, dtype, i) : 0.0f;
        v[i] = mu * v[i] + gi;
        w[i] -= lr * v[i];
    }
    if (g && clear) memset(g, 0, n * gd_itemsize(dtype));
}

#if GD_X86
__attribute__((target("avx2,f16c"))) static void
gd_momentum_avx2(float *restrict w, float *restrict v, void *restrict g, int dtype, size_t n, float lr,
                 float mu, int clear)
{
    size_t i = gd_peel(w, n);
    gd_momentum_generic(w, v, g, dtype, i, lr, mu, clear);
    const __m256 vlr = _mm256_set1_ps(lr), vmu = _mm256_set1_ps(mu);
    for (; i + 16 <= n; i += 16) {
        __m256 g0 = _mm256_setzero_ps(), g1 = _mm256_setzero_ps();
        if (g && gd_load16(g, dtype, i, &g0, &g1) && clear) gd_clear16(g, dtype, i);
        __m256 v0 = _mm256_add_ps(_mm256_mul_ps(vmu, _mm256_loadu_ps(v + i)), g0);
        __m256 v1 = _mm256_add_ps(_mm256_mul_ps(vmu, _mm256_loadu_ps(v + i + 8)), g1);
        _mm256_storeu_ps(v + i, v0);
        _mm256_storeu_ps(v + i + 8, v1);
        _mm256_store_ps(w + i, _mm256_sub_ps(_mm256_load_ps(w + i), _mm256_mul_ps(vlr, v0)));
        _mm256_store_ps(w + i + 8, _mm256_sub_ps(_mm256_load_ps(w + i + 8), _mm256_mul_ps(vlr, v1)));
    }
    gd_momentum_generic(w + i, v + i, g ? (char *)g + i * gd_itemsize(dtype) : NULL, dtype, n - i, lr, mu, clear);
}
#endif

void
gd_momentum(float *w, float *v, void *g, int dtype, size_t n, float lr, float mu, int clear, int threads)
{
    size_t item = gd_itemsize(dtype);
    GD_PARALLEL(w, n, threads, lo, hi,
                GD_DISPATCH(gd_momentum, w + lo, v + lo, g ? (char *)g + lo * item : NULL, dtype, hi - lo, lr, mu,
                            clear));
}

/* ------------------------------------------------------------------ adagrad */

/* One element of Adagrad; a zero gradient changes nothing (so it is skipped, exactly). */
static inline void
gd_adagrad_one(float *w, float *s, float g, float lr, float eps)
{
    if (g != 0.0f) {
        *s += g * g;
        *w -= lr * g / (sqrtf(*s) + eps);
    }
}

static void
gd_adagrad_generic(float *restrict w, float *restrict s, void *restrict g, int dtype, size_t n, float lr, float eps,
                   int clear)
{
    for (size_t i = 0; i < n; i++) gd_adagrad_one(w + i, s + i, gd_load(g, dtype, i), lr, eps);
    if (clear) memset(g, 0, n * gd_itemsize(dtype));
}

#if GD_X86
/* Eight elements of Adagrad, the same IEEE operations in the same order as gd_adagrad_one
 * (so the results are bit-identical); lanes whose gradient is zero keep w and s. */
__attribute__((target("avx2,f16c"))) static inline void
gd_adagrad8(float *w, float *s, __m256 g, __m256 vlr, __m256 veps)
{
    __m256 touched = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_NEQ_UQ);
    __m256 s0 = _mm256_loadu_ps(s), w0 = _mm256_load_ps(w);
    __m256 s1 = _mm256_add_ps(s0, _mm256_mul_ps(g, g));
    __m256 step = _mm256_div_ps(_mm256_mul_ps(vlr, g), _mm256_add_ps(_mm256_sqrt_ps(s1), veps));
    _mm256_storeu_ps(s, _mm256_blendv_ps(s0, s1, touched));
    _mm256_store_ps(w, _mm256_blendv_ps(w0, _mm256_sub_ps(w0, step), touched));
}

/* As gd_sgd_avx2: lines of 16 zero gradient elements (most of an embedding table's) are skipped. */
__attribute__((target("avx2,f16c"))) static void
gd_adagrad_avx2(float *restrict w, float *restrict s, void *restrict g, int dtype, size_t n, float lr, float eps,
                int clear)
{
    size_t i = gd_peel(w, n);
    gd_adagrad_generic(w, s, g, dtype, i, lr, eps, clear);
    const __m256 vlr = _mm256_set1_ps(lr), veps = _mm256_set1_ps(eps);
    for (; i + 16 <= n; i += 16) {
        __m256 g0, g1;
        if (!gd_load16(g, dtype, i, &g0, &g1)) continue;
        gd_adagrad8(w + i, s + i, g0, vlr, veps);
        gd_adagrad8(w + i + 8, s + i + 8, g1, vlr, veps);
        if (clear) gd_clear16(g, dtype, i);
    }
    gd_adagrad_generic(w + i, s + i, (char *)g + i * gd_itemsize(dtype), dtype, n - i, lr, eps, clear);
}
#endif

void
gd_adagrad(float *w, float *s, void *g, int dtype, size_t n, float lr, float eps, int clear, int threads)
{
    size_t item = gd_itemsize(dtype);
    GD_PARALLEL(w, n, threads, lo, hi,
                GD_DISPATCH(gd_adagrad, w + lo, s + lo, (char *)g + lo * item, dtype, hi - lo, lr, eps, clear));
}

struct gd_adagrad_row {
    float *w, *s;
    float lr, eps;
};

static void
gd_adagrad_row(const void *ctx, size_t at, const void *gr, int dtype, size_t width)
{
    const struct gd_adagrad_row *a = ctx;
    for (size_t j = 0; j < width; j++)
        gd_adagrad_one(a->w + at + j, a->s + at + j, gd_load(gr, dtype, j), a->lr, a->eps);
}

int64_t
gd_adagrad_rows(float *w, float *s, size_t n_rows, size_t width, const int64_t *idx, const void *rows, int dtype,
                size_t count, float lr, float eps)
{
    const struct gd_adagrad_row a = {w, s, lr, eps};
    return gd_each_row(n_rows, width, idx, rows, dtype, count, gd_adagrad_row, &a);
}

/* ------------------------------------------------------------------ adam */

/* Adam's per-update scalars, computed once (in double) from the step t >= 1. */
struct gd_adam {
    float b1, a1, b2, a2; /* beta1, 1 - beta1, beta2, 1 - beta2 */
    float step;           /* lr / (1 - beta1^t) */
    float c2;             /* 1 / sqrt(1 - beta2^t): a multiply, not a second division per element */
    float eps;
};

static struct gd_adam
gd_adam_scalars(double lr, double beta1, double beta2, double eps, uint64_t step)
{
    struct gd_adam c;
    double t = (double)(step ? step : 1);
    c.b1 = (float)beta1;
    c.a1 = (float)(1.0 - beta1);
    c.b2 = (float)beta2;
    c.a2 = (float)(1.0 - beta2);
    c.step = (float)(lr / (1.0 - pow(beta1, t)));
    c.c2 = (float)(1.0 / sqrt(1.0 - pow(beta2, t)));
    c.eps = (float)eps;
    return c;
}

/* One element of Adam (torch.optim.Adam's order of operations, float32, but for the bias
 * correction of v, a multiply by c2 = 1 / sqrt(1 - b2^t)):
 * m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; w -= step m / (sqrt(v) c2 + eps).
 * A zero gradient still decays m and v and moves w (dense Adam updates every weight). */
static inline void
gd_adam_one(float *w, float *m, float *v, float g, const struct gd_adam *c)
{
    float m1 = c->b1 * *m + c->a1 * g;
    float v1 = c->b2 * *v + c->a2 * (g * g);
    *m = m1;
    *v = v1;
    *w -= c->step * (m1 / (sqrtf(v1) * c->c2 + c->eps));
}

static void
gd_adam_generic(float *restrict w, float *restrict m, float *restrict v, void *restrict g, int dtype, size_t n,
                const struct gd_adam *c, int clear)
{
    for (size_t i = 0; i < n; i++) gd_adam_one(w + i, m + i, v + i, gd_load(g, dtype, i), c);
    if (clear) memset(g, 0, n * gd_itemsize(dtype));
}

#if GD_X86
/* Eight elements of Adam: the same IEEE operations in the same order as gd_adam_one (so the
 * results are bit-identical). */
__attribute__((target("avx2,f16c"))) static inline void
gd_adam8(float *w, float *m, float *v, __m256 g, __m256 b1, __m256 a1, __m256 b2, __m256 a2, __m256 step,
         __m256 c2, __m256 eps)
{
    __m256 m1 = _mm256_add_ps(_mm256_mul_ps(b1, _mm256_loadu_ps(m)), _mm256_mul_ps(a1, g));
    __m256 v1 = _mm256_add_ps(_mm256_mul_ps(b2, _mm256_loadu_ps(v)), _mm256_mul_ps(a2, _mm256_mul_ps(g, g)));
    _mm256_storeu_ps(m, m1);
    _mm256_storeu_ps(v, v1);
    __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v1), c2), eps);
    _mm256_store_ps(w, _mm256_sub_ps(_mm256_load_ps(w), _mm256_mul_ps(step, _mm256_div_ps(m1, denom))));
}

__attribute__((target("avx2,f16c"))) static void
gd_adam_avx2(float *restrict w, float *restrict m, float *restrict v, void *restrict g, int dtype, size_t n,
             const struct gd_adam *c, int clear)
{
    size_t i = gd_peel(w, n);
    gd_adam_generic(w, m, v, g, dtype, i, c, clear);
    const __m256 b1 = _mm256_set1_ps(c->b1), a1 = _mm256_set1_ps(c->a1), b2 = _mm256_set1_ps(c->b2),
                 a2 = _mm256_set1_ps(c->a2), step = _mm256_set1_ps(c->step), c2 = _mm256_set1_ps(c->c2),
                 eps = _mm256_set1_ps(c->eps);
    for (; i + 16 <= n; i += 16) {
        __m256 g0 = _mm256_setzero_ps(), g1 = _mm256_setzero_ps();
        if (gd_load16(g, dtype, i, &g0, &g1) && clear) gd_clear16(g, dtype, i);
        gd_adam8(w + i, m + i, v + i, g0, b1, a1, b2, a2, step, c2, eps);
        gd_adam8(w + i + 8, m + i + 8, v + i + 8, g1, b1, a1, b2, a2, step, c2, eps);
    }
    gd_adam_generic(w + i, m + i, v + i, (char *)g + i * gd_itemsize(dtype), dtype, n - i, c, clear);
}
#endif

void
gd_adam(float *w, float *m, float *v, void *g, int dtype, size_t n, double lr, double beta1, double beta2,
        double eps, uint64_t step, int clear, int threads)
{
    size_t item = gd_itemsize(dtype);
    const struct gd_adam c = gd_adam_scalars(lr, beta1, beta2, eps, step);
    GD_PARALLEL(w, n, threads, lo, hi,
                GD_DISPATCH(gd_adam, w + lo, m + lo, v + lo, (char *)g + lo * item, dtype, hi - lo, &c, clear));
}

struct gd_adam_row {
    float *w, *m, *v;
    struct gd_adam c;
};

static void
gd_adam_row(const void *ctx, size_t at, const void *gr, int dtype, size_t width)
{
    const struct gd_adam_row *a = ctx;
    for (size_t j = 0; j < width; j++)
        gd_adam_one(a->w + at + j, a->m + at + j, a->v + at + j, gd_load(gr, dtype, j), &a->c);
}

int64_t
gd_adam_rows(float *w, float *m, float *v, size_t n_rows, size_t width, const int64_t *idx, const void *rows,
             int dtype, size_t count, double lr, double beta1, double beta2, double eps, uint64_t step)
{
    const struct gd_adam_row a = {w, m, v, gd_adam_scalars(lr, beta1, beta2, eps, step)};
    return gd_each_row(n_rows, width, idx, rows, dtype, count, gd_adam_row, &a);
}

/* ------------------------------------------------------------------ non-finite check */

/* An element is NaN or infinite when its exponent bits are all ones; only the bits are
 * looked at (no float compare), so the check is exact for every dtype and cheap. */
static int64_t
gd_nonfinite_generic(const void *g, int dtype, size_t n)
{
    int64_t bad = 0;
    if (dtype == GD_F32) {
        const uint32_t *b = g;
        for (size_t i = 0; i < n; i++) bad += (b[i] & 0x7f800000u) == 0x7f800000u;
        return bad;
    }
    const uint16_t *h = g, mask = dtype == GD_F16 ? 0x7c00 : 0x7f80;
    for (size_t i = 0; i < n; i++) bad += (h[i] & mask) == mask;
    return bad;
}

#if GD_X86
/* 64 bytes per step (16 float32 or 32 half elements): mask the exponents, compare with the
 * mask, count the lanes that matched. */
__attribute__((target("avx2,f16c,popcnt"))) static int64_t
gd_nonfinite_avx2(const void *g, int dtype, size_t n)
{
    size_t item = gd_itemsize(dtype), per = 64 / item, i = 0;
    int64_t bad = 0;
    const char *base = g;
    if (dtype == GD_F32) {
        const __m256i mask = _mm256_set1_epi32(0x7f800000);
        for (; i + per <= n; i += per) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(base + i * item));
            __m256i b = _mm256_loadu_si256((const __m256i *)(base + i * item + 32));
            __m256i ea = _mm256_cmpeq_epi32(_mm256_and_si256(a, mask), mask);
            __m256i eb = _mm256_cmpeq_epi32(_mm256_and_si256(b, mask), mask);
            __m256i any = _mm256_or_si256(ea, eb);
            if (_mm256_testz_si256(any, any)) continue;
            bad += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(ea)));
            bad += __builtin_popcount((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(eb)));
        }
    } else {
        const __m256i mask = _mm256_set1_epi16((short)(dtype == GD_F16 ? 0x7c00 : 0x7f80));
        for (; i + per <= n; i += per) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(base + i * item));
            __m256i b = _mm256_loadu_si256((const __m256i *)(base + i * item + 32));
            __m256i ea = _mm256_cmpeq_epi16(_mm256_and_si256(a, mask), mask);
            __m256i eb = _mm256_cmpeq_epi16(_mm256_and_si256(b, mask), mask);
            __m256i any = _mm256_or_si256(ea, eb);
            if (_mm256_testz_si256(any, any)) continue;
            /* each 16-bit lane sets two bits of the byte mask */
            bad += __builtin_popcount((unsigned)_mm256_movemask_epi8(ea)) / 2;
            bad += __builtin_popcount((unsigned)_mm256_movemask_epi8(eb)) / 2;
        }
    }
    return bad + gd_nonfinite_generic(base + i * item, dtype, n - i);
}
#endif

/* As gd_copy: a team adds up its chunks' counts; one pass otherwise, and without OpenMP. */
int64_t
gd_nonfinite(const void *g, int dtype, size_t n, int threads)
{
#if GD_HAVE_OPENMP
    int nt = gd_threads(threads, n);
    if (nt > 1) {
        size_t item = gd_itemsize(dtype);
        int64_t bad = 0;
#pragma omp parallel num_threads(nt) reduction(+ : bad)
        {
            size_t lo, hi;
            gd_chunk(g, item, n, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            bad += GD_DISPATCH(gd_nonfinite, (const char *)g + lo * item, dtype, hi - lo);
        }
        return bad;
    }
#endif
    (void)threads;
    return GD_DISPATCH(gd_nonfinite, g, dtype, n);
}

/* ------------------------------------------------------------------ sgd rows, elastic, plain, copy */

struct gd_sgd_row {
    float *w, *v; /* v: the momentum buffer the rows are added to, or NULL */
    float lr;
};

static void
gd_sgd_row(const void *ctx, size_t at, const void *gr, int dtype, size_t width)
{
    const struct gd_sgd_row *a = ctx;
    float *wr = a->w + at;
    if (a->v) {
        float *vr = a->v + at;
        for (size_t j = 0; j < width; j++) {
            float gj = gd_load(gr, dtype, j);
            vr[j] += gj;
            wr[j] -= a->lr * gj;
        }
    } else {
        for (size_t j = 0; j < width; j++) wr[j] -= a->lr * gd_load(gr, dtype, j);
    }
}

int64_t
gd_sgd_rows(float *w, float *v, size_t n_rows, size_t width, const int64_t *idx, const void *rows, int dtype,
            size_t count, float lr)
{
    const struct gd_sgd_row a = {w, v, lr};
    return gd_each_row(n_rows, width, idx, rows, dtype, count, gd_sgd_row, &a);
}

static void
gd_elastic_generic(float *restrict c, const float *restrict w, size_t n, float alpha)
{
    for (size_t i = 0; i < n; i++) c[i] += alpha * (w[i] - c[i]);
}

void
gd_elastic(float *c, const float *w, size_t n, float alpha, int threads)
{
    GD_PARALLEL(c, n, threads, lo, hi, gd_elastic_generic(c + lo, w + lo, hi - lo, alpha));
}

__attribute__((noinline)) static void
gd_plain_sgd_generic(float *w, const float *g, size_t n, float lr)
{
    for (size_t i = 0; i < n; i++) w[i] -= lr * g[i];
}

void
gd_plain_sgd(float *w, const float *g, size_t n, float lr, int threads)
{
    if (threads <= 1) {
        gd_plain_sgd_generic(w, g, n, lr);
        return;
    }
#if GD_HAVE_OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n; i++) w[i] -= lr * g[i];
#else
    gd_plain_sgd_generic(w, g, n, lr);
#endif
}

/* A team copies chunks split at dst's 64-byte lines; without OpenMP, or when the size asks for
 * one thread, one memcpy does it all. */
void
gd_copy(void *dst, const void *src, size_t nbytes, int threads)
{
#if GD_HAVE_OPENMP
    int nt = gd_threads(threads, nbytes / 4);
    if (nt > 1) {
#pragma omp parallel num_threads(nt)
        {
            size_t lo, hi;
            gd_chunk(dst, 1, nbytes, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            memcpy((char *)dst + lo, (const char *)src + lo, hi - lo);
        }
        return;
    }
#endif
    (void)threads;
    memcpy(dst, src, nbytes);
}
