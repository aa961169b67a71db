/*
 * gadei's update kernels: the server's in-place updates of the shared weights.
 *
 * Weights and optimiser state are float32; gradients arrive as float32, float16 or
 * bfloat16 and are converted inside the kernels (no temporary float32 copy); every sum is
 * taken in float32. Functions take raw pointers the caller keeps valid and run without the
 * GIL; the Python layer checks arguments. Every function is prefixed gd_.
 */
#ifndef GADEI_KERNELS_H
#define GADEI_KERNELS_H

#include <stddef.h>
#include <stdint.h>

enum gd_dtype { GD_F32 = 1, GD_F16 = 2, GD_BF16 = 3 };

/* Detect the CPU's vector extensions (once, at module load). */
void gd_kernels_init(void);
/* "avx2" or "generic": which code the kernels run. */
const char *gd_kernel_isa(void);
/* Whether the library was built with OpenMP, and the processors it sees. */
int gd_openmp_built(void);
int gd_processors(void);

/* w[i] -= lr * g[i]; with clear, g[i] = 0. Where the CPU has AVX2, each run of 16 gradient elements
 * whose bits are all zero (64 bytes of float32, 32 of float16 or bfloat16) is skipped: w - lr * +0.0
 * is w, and a zero run needs no clearing. */
void gd_sgd(float *w, void *g, int dtype, size_t n, float lr, int clear, int threads);

/* v[i] = mu * v[i] + g[i]; w[i] -= lr * v[i]; with clear, g[i] = 0. g == NULL: g is zero. */
void gd_momentum(float *w, float *v, void *g, int dtype, size_t n, float lr, float mu, int clear, int threads);

/*
 * Row-sparse update of a table of n_rows x width weights: for r < count, row idx[r]:
 * w[row] -= lr * rows[r] (and v[row] += rows[r] when v is not NULL). Rows are taken in
 * order, so an index repeated in one gradient adds up. Returns how many indices fell
 * outside 0..n_rows-1 (those rows are skipped).
 */
int64_t gd_sgd_rows(float *w, float *v, size_t n_rows, size_t width, const int64_t *idx, const void *rows,
                    int dtype, size_t count, float lr);

/* Adagrad: where g[i] != 0, s[i] += g[i]^2; w[i] -= lr * g[i] / (sqrt(s[i]) + eps); with clear, g[i] = 0. */
void gd_adagrad(float *w, float *s, void *g, int dtype, size_t n, float lr, float eps, int clear, int threads);

/* Row-sparse Adagrad on a table (rows and indices as gd_sgd_rows; s is the table's sums). */
int64_t gd_adagrad_rows(float *w, float *s, size_t n_rows, size_t width, const int64_t *idx, const void *rows,
                        int dtype, size_t count, float lr, float eps);

/*
 * Adam at step t (>= 1; 0 is taken as 1), m and v its first and second moments, every element
 * updated (a zero gradient decays m and v and still moves w): m = b1 m + (1 - b1) g;
 * v = b2 v + (1 - b2) g^2; w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps); with
 * clear, g[i] = 0. The scalars are computed in double, the elements in float32.
 */
void gd_adam(float *w, float *m, float *v, void *g, int dtype, size_t n, double lr, double beta1, double beta2,
             double eps, uint64_t step, int clear, int threads);

/* Lazy Adam on a table (rows and indices as gd_sgd_rows; m and v are the table's moments): only
 * the rows a gradient carries update their moments and weights, as torch.optim.SparseAdam. */
int64_t gd_adam_rows(float *w, float *m, float *v, size_t n_rows, size_t width, const int64_t *idx,
                     const void *rows, int dtype, size_t count, double lr, double beta1, double beta2, double eps,
                     uint64_t step);

/* How many of g[0..n) are NaN or infinite (exponent bits all ones), read only: the server's
 * check of a gradient before it applies it. */
int64_t gd_nonfinite(const void *g, int dtype, size_t n, int threads);

/* c[i] += alpha * (w[i] - c[i]): the elastic centre moving towards one learner's weights. */
void gd_elastic(float *c, const float *w, size_t n, float alpha, int threads);

/* The plain loop w[i] -= lr * g[i] (float32), for benchmarks to compare gd_sgd against. */
void gd_plain_sgd(float *w, const float *g, size_t n, float lr, int threads);

/* memcpy of nbytes, split over up to `threads` OpenMP threads where each gets 1 MiB or more
 * (GD_THREAD_MIN float32 elements, kernels.c); one memcpy otherwise, and in a build without OpenMP. */
void gd_copy(void *dst, const void *src, size_t nbytes, int threads);

/* Scalar conversions (exact), shared with the tests' expectations. */
float gd_f16_to_f32(uint16_t h);
float gd_bf16_to_f32(uint16_t b);

#endif
