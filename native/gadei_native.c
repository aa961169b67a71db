/*
 * gadei._native: the small, dumb native core of gadei.
 *
 * Place in the data flow: every process of a job maps the same shared region; this module
 * gives them the atomics on its counters (ring head/tail, version), the futex waits that
 * let idle parts block instead of spin, and the in-place update kernel the server applies
 * each gradient with (OpenMP, GIL released).
 *
 * Python owns validation, types and errors (gadei/_nativeops.py); functions here take raw
 * addresses inside a mapping the caller keeps alive and trust their arguments. Every
 * function is prefixed gd_. Every loop runs with the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#define GD_HAVE_OPENMP 1
#else
#define GD_HAVE_OPENMP 0
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define GD_X86 1
#else
#define GD_X86 0
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GD_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define GD_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define GD_CPU_RELAX() ((void)0)
#endif

/* Below this many elements a kernel runs on the calling thread: waking a team costs more. */
#define GD_PARALLEL_MIN 65536

/* ------------------------------------------------------------------ argument helpers */

static int
gd_arg_u64(PyObject *obj, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static int
gd_arg_i64(PyObject *obj, int64_t *out)
{
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

static int
gd_nargs(const char *name, Py_ssize_t got, Py_ssize_t want)
{
    if (got != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, got);
        return -1;
    }
    return 0;
}

#define GD_ADDR(obj, var)                                                                    \
    uint64_t var##_raw;                                                                      \
    if (gd_arg_u64((obj), &var##_raw) < 0) {                                                 \
        return NULL;                                                                         \
    }

/* ------------------------------------------------------------------ atomics */

static PyObject *
gd_load64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (gd_nargs("load64", nargs, 1) < 0) return NULL;
    GD_ADDR(args[0], a);
    uint64_t v = __atomic_load_n((uint64_t *)(uintptr_t)a_raw, __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *
gd_store64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t v;
    if (gd_nargs("store64", nargs, 2) < 0) return NULL;
    GD_ADDR(args[0], a);
    if (gd_arg_u64(args[1], &v) < 0) return NULL;
    __atomic_store_n((uint64_t *)(uintptr_t)a_raw, v, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *
gd_add64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t d;
    if (gd_nargs("add64", nargs, 2) < 0) return NULL;
    GD_ADDR(args[0], a);
    if (gd_arg_i64(args[1], &d) < 0) return NULL;
    uint64_t old = __atomic_fetch_add((uint64_t *)(uintptr_t)a_raw, (uint64_t)d, __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLongLong(old);
}

static PyObject *
gd_cas64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t expected, desired;
    if (gd_nargs("cas64", nargs, 3) < 0) return NULL;
    GD_ADDR(args[0], a);
    if (gd_arg_u64(args[1], &expected) < 0 || gd_arg_u64(args[2], &desired) < 0) return NULL;
    int ok = __atomic_compare_exchange_n((uint64_t *)(uintptr_t)a_raw, &expected, desired, 0,
                                         __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return PyBool_FromLong(ok);
}

static PyObject *
gd_load32(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (gd_nargs("load32", nargs, 1) < 0) return NULL;
    GD_ADDR(args[0], a);
    uint32_t v = __atomic_load_n((uint32_t *)(uintptr_t)a_raw, __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLong(v);
}

static PyObject *
gd_store32(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t v;
    if (gd_nargs("store32", nargs, 2) < 0) return NULL;
    GD_ADDR(args[0], a);
    if (gd_arg_u64(args[1], &v) < 0) return NULL;
    __atomic_store_n((uint32_t *)(uintptr_t)a_raw, (uint32_t)v, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *
gd_add32(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t d;
    if (gd_nargs("add32", nargs, 2) < 0) return NULL;
    GD_ADDR(args[0], a);
    if (gd_arg_i64(args[1], &d) < 0) return NULL;
    uint32_t old = __atomic_fetch_add((uint32_t *)(uintptr_t)a_raw, (uint32_t)d, __ATOMIC_SEQ_CST);
    return PyLong_FromUnsignedLong(old);
}

static PyObject *
gd_cas32(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t expected, desired;
    if (gd_nargs("cas32", nargs, 3) < 0) return NULL;
    GD_ADDR(args[0], a);
    if (gd_arg_u64(args[1], &expected) < 0 || gd_arg_u64(args[2], &desired) < 0) return NULL;
    uint32_t e = (uint32_t)expected;
    int ok = __atomic_compare_exchange_n((uint32_t *)(uintptr_t)a_raw, &e, (uint32_t)desired, 0,
                                         __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return PyBool_FromLong(ok);
}

/* ------------------------------------------------------------------ futex waits */

static uint64_t
gd_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/*
 * futex_wait(addr, expected, timeout_s) -> 0 when woken or the word no longer holds
 * `expected`, 1 when the timeout passed. Shared (not PRIVATE) futex: waiters and wakers are
 * different processes mapping the same page. A signal returns 0 after Python's handlers ran
 * (callers always re-check their condition), or raises what a handler raised.
 */
static PyObject *
gd_futex_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t expected;
    double timeout;
    if (gd_nargs("futex_wait", nargs, 3) < 0) return NULL;
    GD_ADDR(args[0], a);
    if (gd_arg_u64(args[1], &expected) < 0) return NULL;
    timeout = PyFloat_AsDouble(args[2]);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    if (timeout < 0) timeout = 0;
    struct timespec ts;
    ts.tv_sec = (time_t)timeout;
    ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
    long rc;
    int err;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(SYS_futex, (uint32_t *)(uintptr_t)a_raw, FUTEX_WAIT, (uint32_t)expected, &ts,
                 NULL, 0);
    err = errno;
    Py_END_ALLOW_THREADS
    if (rc == 0) return PyLong_FromLong(0);
    if (err == ETIMEDOUT) return PyLong_FromLong(1);
    if (err == EAGAIN) return PyLong_FromLong(0);
    if (err == EINTR) {
        if (PyErr_CheckSignals() < 0) return NULL;
        return PyLong_FromLong(0);
    }
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *
gd_futex_wake(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t n;
    if (gd_nargs("futex_wake", nargs, 2) < 0) return NULL;
    GD_ADDR(args[0], a);
    if (gd_arg_i64(args[1], &n) < 0) return NULL;
    if (n <= 0 || n > INT_MAX) n = INT_MAX;
    long rc = syscall(SYS_futex, (uint32_t *)(uintptr_t)a_raw, FUTEX_WAKE, (int)n, NULL, NULL, 0);
    if (rc < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(rc);
}

/*
 * poll_rings(table, count, stride, head_off, tail_off, start, spin_ns) -> index or -1.
 * Spins (GIL released, with a pause hint) until some ring i, looked at round-robin from
 * `start`, has head != tail, or spin_ns passed. The entries are `count` records of
 * `stride` bytes at `table`, each with its 64-bit head and tail at the given offsets.
 */
static PyObject *
gd_poll_rings(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t count, stride, head_off, tail_off, start, spin_ns;
    if (gd_nargs("poll_rings", nargs, 7) < 0) return NULL;
    GD_ADDR(args[0], table);
    if (gd_arg_u64(args[1], &count) < 0 || gd_arg_u64(args[2], &stride) < 0 ||
        gd_arg_u64(args[3], &head_off) < 0 || gd_arg_u64(args[4], &tail_off) < 0 ||
        gd_arg_u64(args[5], &start) < 0 || gd_arg_u64(args[6], &spin_ns) < 0)
        return NULL;
    long found = -1;
    if (count == 0) return PyLong_FromLong(-1);
    Py_BEGIN_ALLOW_THREADS
    /* Orders this poll after the caller's earlier stores (the server's "sleeping" flag):
     * the doorbell protocol is a Dekker handshake and needs a full fence here. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    char *base = (char *)(uintptr_t)table_raw;
    uint64_t deadline = gd_now_ns() + spin_ns;
    for (uint64_t round = 0;; round++) {
        for (uint64_t k = 0; k < count; k++) {
            uint64_t i = (start + k) % count;
            char *entry = base + i * stride;
            uint64_t h = __atomic_load_n((uint64_t *)(entry + head_off), __ATOMIC_ACQUIRE);
            uint64_t t = __atomic_load_n((uint64_t *)(entry + tail_off), __ATOMIC_RELAXED);
            if (h != t) {
                found = (long)i;
                break;
            }
        }
        if (found >= 0) break;
        if ((round & 63) == 0 && gd_now_ns() >= deadline) break;
        GD_CPU_RELAX();
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(found);
}

/* ------------------------------------------------------------------ kernels */

static int
gd_threads(int64_t requested, size_t n)
{
    if (n < GD_PARALLEL_MIN || requested <= 1) return 1;
#if GD_HAVE_OPENMP
    int most = omp_get_num_procs();
    if (requested > most) requested = most;
#else
    requested = 1;
#endif
    size_t by_size = n / (GD_PARALLEL_MIN / 2);
    if ((size_t)requested > by_size) requested = (int64_t)(by_size ? by_size : 1);
    return (int)requested;
}

#if GD_HAVE_OPENMP
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
#endif

/*
 * The update over one span: w[i] -= lr * g[i], and g[i] = 0 with `clear`.
 *
 * Lines of 16 gradient elements whose bits are all zero are skipped: w - lr * (+0.0) is w
 * exactly, and a zero line needs no clearing. Small-batch gradients of embedding tables are
 * mostly such lines, so the server then reads the slot but writes only the rows a batch
 * touched. A dense gradient costs one OR and test per line more.
 */
static void
gd_sgd_f32_generic(float *restrict w, float *restrict g, size_t n, float lr, int clear)
{
    for (size_t i = 0; i < n; i++) {
        w[i] -= lr * g[i];
        if (clear) g[i] = 0.0f;
    }
}

#if GD_X86
__attribute__((target("avx2"))) static void
gd_sgd_f32_avx2(float *restrict w, float *restrict g, size_t n, float lr, int clear)
{
    /* Peel until w sits on a 64-byte boundary so the body never splits a cache line (region
     * arrays are page-aligned and need none; NumPy's start 16 bytes past a line). */
    size_t head = ((64 - ((uintptr_t)w & 63)) & 63) / sizeof(float);
    if (head > n || ((uintptr_t)w & (sizeof(float) - 1))) head = n;
    gd_sgd_f32_generic(w, g, head, lr, clear);
    size_t i = head;
    const __m256 vlr = _mm256_set1_ps(lr), zero = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m256 g0 = _mm256_loadu_ps(g + i), g1 = _mm256_loadu_ps(g + i + 8);
        __m256i bits = _mm256_or_si256(_mm256_castps_si256(g0), _mm256_castps_si256(g1));
        if (_mm256_testz_si256(bits, bits)) continue;
        _mm256_store_ps(w + i, _mm256_sub_ps(_mm256_load_ps(w + i), _mm256_mul_ps(vlr, g0)));
        _mm256_store_ps(w + i + 8, _mm256_sub_ps(_mm256_load_ps(w + i + 8), _mm256_mul_ps(vlr, g1)));
        if (clear) {
            _mm256_storeu_ps(g + i, zero);
            _mm256_storeu_ps(g + i + 8, zero);
        }
    }
    gd_sgd_f32_generic(w + i, g + i, n - i, lr, clear);
}
#endif

static int gd_avx2; /* set at module init: the CPU runs AVX2 */

static void
gd_sgd_f32_span(float *restrict w, float *restrict g, size_t n, float lr, int clear)
{
#if GD_X86
    if (gd_avx2) {
        gd_sgd_f32_avx2(w, g, n, lr, clear);
        return;
    }
#endif
    gd_sgd_f32_generic(w, g, n, lr, clear);
}

/*
 * sgd(w, g, n, lr, clear, threads): w[i] -= lr * g[i] for float32 arrays, in place; with
 * `clear`, g[i] = 0 in the same pass (the server hands a slot back zeroed, so a learner's
 * backward pass can accumulate straight into it).
 */
static PyObject *
gd_sgd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t n, clear;
    int64_t threads;
    double lr;
    if (gd_nargs("sgd", nargs, 6) < 0) return NULL;
    GD_ADDR(args[0], w);
    GD_ADDR(args[1], g);
    if (gd_arg_u64(args[2], &n) < 0) return NULL;
    lr = PyFloat_AsDouble(args[3]);
    if (lr == -1.0 && PyErr_Occurred()) return NULL;
    if (gd_arg_u64(args[4], &clear) < 0 || gd_arg_i64(args[5], &threads) < 0) return NULL;
    float *w = (float *)(uintptr_t)w_raw, *g = (float *)(uintptr_t)g_raw;
    float flr = (float)lr;
    int nt = gd_threads(threads, (size_t)n);
    Py_BEGIN_ALLOW_THREADS
    if (nt == 1) {
        gd_sgd_f32_span(w, g, (size_t)n, flr, (int)clear);
    } else {
#if GD_HAVE_OPENMP
#pragma omp parallel num_threads(nt)
        {
            size_t lo, hi;
            gd_chunk(w, sizeof(float), (size_t)n, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            gd_sgd_f32_span(w + lo, g + lo, hi - lo, flr, (int)clear);
        }
#endif
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/*
 * plain_sgd(w, g, n, lr, threads): the loop a C programmer would write first, compiled with
 * the extension's flags and nothing else; `gadei bench kernel` measures sgd against it.
 */
__attribute__((noinline)) static void
gd_plain_span(float *w, const float *g, size_t n, float lr)
{
    for (size_t i = 0; i < n; i++) w[i] -= lr * g[i];
}

static PyObject *
gd_plain_sgd(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t n;
    int64_t threads;
    double lr;
    if (gd_nargs("plain_sgd", nargs, 5) < 0) return NULL;
    GD_ADDR(args[0], w);
    GD_ADDR(args[1], g);
    if (gd_arg_u64(args[2], &n) < 0) return NULL;
    lr = PyFloat_AsDouble(args[3]);
    if (lr == -1.0 && PyErr_Occurred()) return NULL;
    if (gd_arg_i64(args[4], &threads) < 0) return NULL;
    float *w = (float *)(uintptr_t)w_raw;
    const float *g = (const float *)(uintptr_t)g_raw;
    float flr = (float)lr;
    int nt = threads > 1 ? (int)threads : 1;
    Py_BEGIN_ALLOW_THREADS
    if (nt == 1) {
        gd_plain_span(w, g, (size_t)n, flr);
    } else {
#if GD_HAVE_OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
        for (size_t i = 0; i < (size_t)n; i++) w[i] -= flr * g[i];
#else
        gd_plain_span(w, g, (size_t)n, flr);
#endif
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* copy(dst, src, nbytes, threads): memcpy with the GIL released (pulls, uploads). */
static PyObject *
gd_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t nbytes;
    int64_t threads;
    if (gd_nargs("copy", nargs, 4) < 0) return NULL;
    GD_ADDR(args[0], dst);
    GD_ADDR(args[1], src);
    if (gd_arg_u64(args[2], &nbytes) < 0 || gd_arg_i64(args[3], &threads) < 0) return NULL;
    char *d = (char *)(uintptr_t)dst_raw;
    const char *s = (const char *)(uintptr_t)src_raw;
    int nt = gd_threads(threads, (size_t)(nbytes / 4));
    Py_BEGIN_ALLOW_THREADS
    if (nt == 1) {
        memcpy(d, s, (size_t)nbytes);
    } else {
#if GD_HAVE_OPENMP
#pragma omp parallel num_threads(nt)
        {
            size_t lo, hi;
            gd_chunk(d, 1, (size_t)nbytes, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            memcpy(d + lo, s + lo, hi - lo);
        }
#endif
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* zero(addr, nbytes): memset 0 with the GIL released. */
static PyObject *
gd_zero(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t nbytes;
    if (gd_nargs("zero", nargs, 2) < 0) return NULL;
    GD_ADDR(args[0], a);
    if (gd_arg_u64(args[1], &nbytes) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    memset((void *)(uintptr_t)a_raw, 0, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
gd_openmp(PyObject *self, PyObject *unused)
{
#if GD_HAVE_OPENMP
    return Py_BuildValue("(Oi)", Py_True, omp_get_num_procs());
#else
    return Py_BuildValue("(Oi)", Py_False, 1);
#endif
}

static PyObject *
gd_kernel_isa(PyObject *self, PyObject *unused)
{
    return PyUnicode_FromString(gd_avx2 ? "avx2" : "generic");
}

static PyMethodDef gd_methods[] = {
    {"load64", (PyCFunction)(void (*)(void))gd_load64, METH_FASTCALL, "load64(addr) -> int"},
    {"store64", (PyCFunction)(void (*)(void))gd_store64, METH_FASTCALL, "store64(addr, v)"},
    {"add64", (PyCFunction)(void (*)(void))gd_add64, METH_FASTCALL, "add64(addr, d) -> old"},
    {"cas64", (PyCFunction)(void (*)(void))gd_cas64, METH_FASTCALL, "cas64(addr, e, d) -> bool"},
    {"load32", (PyCFunction)(void (*)(void))gd_load32, METH_FASTCALL, "load32(addr) -> int"},
    {"store32", (PyCFunction)(void (*)(void))gd_store32, METH_FASTCALL, "store32(addr, v)"},
    {"add32", (PyCFunction)(void (*)(void))gd_add32, METH_FASTCALL, "add32(addr, d) -> old"},
    {"cas32", (PyCFunction)(void (*)(void))gd_cas32, METH_FASTCALL, "cas32(addr, e, d) -> bool"},
    {"futex_wait", (PyCFunction)(void (*)(void))gd_futex_wait, METH_FASTCALL,
     "futex_wait(addr, expected, timeout_s) -> 0 woken / 1 timed out"},
    {"futex_wake", (PyCFunction)(void (*)(void))gd_futex_wake, METH_FASTCALL,
     "futex_wake(addr, n) -> woken"},
    {"poll_rings", (PyCFunction)(void (*)(void))gd_poll_rings, METH_FASTCALL,
     "poll_rings(table, count, stride, head_off, tail_off, start, spin_ns) -> index or -1"},
    {"sgd", (PyCFunction)(void (*)(void))gd_sgd, METH_FASTCALL,
     "sgd(w, g, n, lr, clear, threads): w -= lr * g in place (float32)"},
    {"plain_sgd", (PyCFunction)(void (*)(void))gd_plain_sgd, METH_FASTCALL,
     "plain_sgd(w, g, n, lr, threads): the reference loop for benchmarks"},
    {"copy", (PyCFunction)(void (*)(void))gd_copy, METH_FASTCALL, "copy(dst, src, nbytes, threads)"},
    {"zero", (PyCFunction)(void (*)(void))gd_zero, METH_FASTCALL, "zero(addr, nbytes)"},
    {"openmp", gd_openmp, METH_NOARGS, "openmp() -> (built with OpenMP, processors)"},
    {"kernel_isa", gd_kernel_isa, METH_NOARGS, "kernel_isa() -> 'avx2' or 'generic'"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef gd_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gadei._native",
    .m_doc = "Atomics, futex waits and update kernels on raw addresses of a gadei region.",
    .m_size = -1,
    .m_methods = gd_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
#if GD_X86
    __builtin_cpu_init();
    gd_avx2 = __builtin_cpu_supports("avx2") && getenv("GADEI_NO_AVX2") == NULL;
#endif
    return PyModule_Create(&gd_module);
}
