/*
 * gadei._native: the small, dumb native core of gadei.
 *
 * Place in the data flow: every process of a job maps the same shared region; this module
 * gives them the atomics on its counters (ring head/tail, version), the futex waits that
 * let idle parts block instead of spin, and the in-place update kernel the server applies
 * each gradient with (OpenMP, GIL released).
 *
 * Python owns validation, types and errors; functions here take raw addresses inside a
 * mapping the caller keeps alive and trust their arguments. The kernels live in kernels.c;
 * this file holds the atomics, the waits, a probe of how near two CPUs are (cross_cpu_ns),
 * a deadline for calls that hold the GIL (exit_after) and the Python bindings (py_ wrap a
 * kernel, gd_ do the work themselves).
 * Every loop runs with the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GD_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define GD_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define GD_CPU_RELAX() ((void)0)
#endif


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
 * poll_rings(table, count, stride, head_off, tail_off, start, spin_ns[, nap_ns]) -> index or -1.
 * Spins (GIL released, with a pause hint) until some ring i, looked at round-robin from
 * `start`, has head != tail, or spin_ns passed. The entries are `count` records of
 * `stride` bytes at `table`, each with its 64-bit head and tail at the given offsets.
 * With nap_ns > 0 it sleeps nap_ns between looks instead of spinning (a doze: a few
 * microseconds of CPU a look, and a vCPU halted that briefly wakes at once).
 */
static PyObject *
gd_poll_rings(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t count, stride, head_off, tail_off, start, spin_ns, nap_ns = 0;
    if (nargs != 8 && gd_nargs("poll_rings", nargs, 7) < 0) return NULL;
    GD_ADDR(args[0], table);
    if (gd_arg_u64(args[1], &count) < 0 || gd_arg_u64(args[2], &stride) < 0 ||
        gd_arg_u64(args[3], &head_off) < 0 || gd_arg_u64(args[4], &tail_off) < 0 ||
        gd_arg_u64(args[5], &start) < 0 || gd_arg_u64(args[6], &spin_ns) < 0 ||
        (nargs == 8 && gd_arg_u64(args[7], &nap_ns) < 0))
        return NULL;
    struct timespec nap = {(time_t)(nap_ns / 1000000000u), (long)(nap_ns % 1000000000u)};
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
        if (nap_ns) {
            if (gd_now_ns() >= deadline) break;
            nanosleep(&nap, NULL);
            __atomic_thread_fence(__ATOMIC_SEQ_CST);
            continue;
        }
        if ((round & 63) == 0 && gd_now_ns() >= deadline) break;
        GD_CPU_RELAX();
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(found);
}

/* ------------------------------------------------------------------ a cache line between two CPUs */

/*
 * How near two CPUs are: two threads, each pinned to one, pass a counter back and forth in
 * one cache line (what a ring's head and tail do between a learner and the server). On a
 * virtual machine the host may move the vCPUs between cores that share a cache and cores
 * that do not, and this round trip shows which (`gadei bench` records it around each run).
 */
struct gd_pingpong {
    uint64_t word __attribute__((aligned(64)));
    char pad[64 - sizeof(uint64_t)];
    uint64_t rounds;
    int cpu[2];
    int failed;       /* a thread could not pin itself, or waited past the deadline */
    int pin_error;    /* the errno of a failed pin */
    double deadline;  /* CLOCK_MONOTONIC seconds */
    double ns;        /* per round trip, from side 0 */
};

struct gd_pingpong_side {
    struct gd_pingpong *pp;
    int side;
};

static double
gd_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Spin until the word holds `want`; 0, or -1 once the other side failed or the deadline passed. */
static int
gd_pingpong_wait(struct gd_pingpong *pp, uint64_t want)
{
    for (uint64_t spins = 1;; spins++) {
        if (__atomic_load_n(&pp->word, __ATOMIC_ACQUIRE) == want) return 0;
        if ((spins & 4095) == 0 && (__atomic_load_n(&pp->failed, __ATOMIC_ACQUIRE) || gd_now() > pp->deadline)) {
            __atomic_store_n(&pp->failed, 1, __ATOMIC_RELEASE);
            return -1;
        }
        GD_CPU_RELAX();
    }
}

static void *
gd_pingpong_thread(void *arg)
{
    struct gd_pingpong_side *me = arg;
    struct gd_pingpong *pp = me->pp;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(pp->cpu[me->side], &set);
    int err = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    if (err) {
        pp->pin_error = err;
        __atomic_store_n(&pp->failed, 1, __ATOMIC_RELEASE);
        return NULL;
    }
    if (me->side == 1) {  /* ready: 1; then answers 2i + 2 with 2i + 3 */
        __atomic_store_n(&pp->word, 1, __ATOMIC_RELEASE);
        for (uint64_t i = 0; i < pp->rounds; i++) {
            if (gd_pingpong_wait(pp, 2 * i + 2) < 0) return NULL;
            __atomic_store_n(&pp->word, 2 * i + 3, __ATOMIC_RELEASE);
        }
        return NULL;
    }
    if (gd_pingpong_wait(pp, 1) < 0) return NULL;
    double start = gd_now();
    for (uint64_t i = 0; i < pp->rounds; i++) {
        __atomic_store_n(&pp->word, 2 * i + 2, __ATOMIC_RELEASE);
        if (gd_pingpong_wait(pp, 2 * i + 3) < 0) return NULL;
    }
    pp->ns = 1e9 * (gd_now() - start) / (double)pp->rounds;
    return NULL;
}

/*
 * cross_cpu_ns(cpu_a, cpu_b, rounds, timeout_s) -> nanoseconds per round trip of a cache line
 * between the two CPUs. OSError when a thread cannot be pinned to its CPU; TimeoutError when
 * the rounds take longer than timeout_s (the other CPU was not given to the thread).
 */
static PyObject *
gd_cross_cpu_ns(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t a, b;
    uint64_t rounds;
    if (gd_nargs("cross_cpu_ns", nargs, 4) < 0) return NULL;
    if (gd_arg_i64(args[0], &a) < 0 || gd_arg_i64(args[1], &b) < 0 || gd_arg_u64(args[2], &rounds) < 0) return NULL;
    double timeout = PyFloat_AsDouble(args[3]);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    if (a < 0 || b < 0 || a >= CPU_SETSIZE || b >= CPU_SETSIZE || rounds < 1 || !(timeout > 0.0 && timeout < 1e6)) {
        PyErr_Format(PyExc_ValueError, "cross_cpu_ns: CPUs must be in 0..%d, rounds >= 1, 0 < timeout_s < 1e6",
                     CPU_SETSIZE - 1);
        return NULL;
    }
    struct gd_pingpong *pp = aligned_alloc(64, sizeof *pp);
    if (!pp) return PyErr_NoMemory();
    memset(pp, 0, sizeof *pp);
    pp->rounds = rounds;
    pp->cpu[0] = (int)a;
    pp->cpu[1] = (int)b;
    struct gd_pingpong_side sides[2] = {{pp, 0}, {pp, 1}};
    pthread_t threads[2];
    int started = 0, err = 0;
    Py_BEGIN_ALLOW_THREADS
    pp->deadline = gd_now() + timeout;
    for (; started < 2; started++) {
        if ((err = pthread_create(&threads[started], NULL, gd_pingpong_thread, &sides[started])) != 0) {
            __atomic_store_n(&pp->failed, 1, __ATOMIC_RELEASE);
            break;
        }
    }
    for (int i = 0; i < started; i++) pthread_join(threads[i], NULL);
    Py_END_ALLOW_THREADS
    PyObject *result = NULL;
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else if (pp->pin_error) {
        PyErr_Format(PyExc_OSError, "cross_cpu_ns: cannot run a thread on CPU %d or %d: %s", pp->cpu[0], pp->cpu[1],
                     strerror(pp->pin_error));
    } else if (pp->failed) {
        PyErr_Format(PyExc_TimeoutError, "cross_cpu_ns: %llu round trips between CPUs %d and %d took over %g s",
                     (unsigned long long)rounds, pp->cpu[0], pp->cpu[1], timeout);
    } else {
        result = PyFloat_FromDouble(pp->ns);
    }
    free(pp);
    return result;
}

/* ------------------------------------------------------------------ kernels (kernels.c) */

/*
 * The kernels' bindings take the arguments of their C function in kernels.h, by the same
 * names and in the same order. The leading addresses may be positional; every argument after
 * them is keyword-only, so a call that swaps two integers is a TypeError rather than an update
 * computed with the wrong length, dtype or thread count. Addresses, sizes and counts are
 * unsigned 64-bit (a negative one is an OverflowError); dtype, clear and threads are C ints;
 * the scalars of the maths are float or double as in C (an int is taken as a float, as
 * PyArg's "f" and "d" take it).
 *
 * One hand-written parser serves them all (METH_FASTCALL | METH_KEYWORDS): it matches each
 * keyword against the binding's names, interned at module load, by pointer (first at the
 * position a caller in C's order puts it) and only then by string, and builds no dict and no
 * tuple. PyArg_ParseTupleAndKeywords cost each call 0.3-0.9 us more than a positional parse
 * with warm caches, and about 3 us more after a kernel that has streamed the L2 (1 MB of w and
 * 1 MB of g): its code and data, much more than this parser's, come back from L3 every call.
 */
enum { GD_MAX_PARAMS = 16 };

struct gd_param {
    const char *name;
    char kind; /* 'u' unsigned 64-bit, 'i' int, 'f' float, 'd' double */
};

struct gd_sig {
    const char *fn;
    int n_addr; /* the leading addresses: the only arguments that may be positional */
    int n;
    const struct gd_param *params;
    PyObject *names[GD_MAX_PARAMS]; /* params' names, interned by gd_sigs_init */
};

union gd_val {
    uint64_t u;
    int i;
    float f;
    double d;
};

#define GD_SIG(fname, naddr, ...)                                                             \
    static const struct gd_param gd_params_##fname[] = {__VA_ARGS__};                        \
    static struct gd_sig gd_sig_##fname = {#fname, (naddr),                                   \
                                           (int)(sizeof gd_params_##fname / sizeof(struct gd_param)), \
                                           gd_params_##fname, {NULL}}
#define U(name) {name, 'u'}
#define I(name) {name, 'i'}
#define F(name) {name, 'f'}
#define D(name) {name, 'd'}
#define GD_PTR(raw) ((void *)(uintptr_t)(raw))

static int
gd_convert(char kind, PyObject *obj, union gd_val *out)
{
    switch (kind) {
    case 'u':
        return gd_arg_u64(obj, &out->u);
    case 'i': {
        long v = PyLong_AsLong(obj); /* __index__, as PyArg's "i": a float is a TypeError */
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v > INT_MAX || v < INT_MIN) {
            PyErr_SetString(PyExc_OverflowError, v > 0 ? "signed integer is greater than maximum"
                                                       : "signed integer is less than minimum");
            return -1;
        }
        out->i = (int)v;
        return 0;
    }
    default: {
        double v = PyFloat_AsDouble(obj);
        if (v == -1.0 && PyErr_Occurred()) return -1;
        if (kind == 'f') out->f = (float)v;
        else out->d = v;
        return 0;
    }
    }
}

/* Which parameter `key` names, -1 when none; `hint` is where a caller in C's order puts it. */
static int
gd_find(const struct gd_sig *sig, PyObject *key, Py_ssize_t hint)
{
    if (hint < sig->n && sig->names[hint] == key) return (int)hint;
    for (int i = 0; i < sig->n; i++) {
        if (sig->names[i] == key) return i;
    }
    for (int i = 0; i < sig->n; i++) {
        if (PyUnicode_Compare(sig->names[i], key) == 0) return i;
    }
    if (PyErr_Occurred()) PyErr_Clear();
    return -1;
}

/* Fill out[0..sig->n) from a vectorcall's arguments; -1 with a TypeError or OverflowError set. */
static int
gd_parse(const struct gd_sig *sig, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames, union gd_val *out)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    PyObject *given[GD_MAX_PARAMS];
    if (nargs > sig->n_addr) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional argument%s (%zd given)", sig->fn,
                     sig->n_addr, sig->n_addr == 1 ? "" : "s", nargs);
        return -1;
    }
    for (int i = 0; i < sig->n; i++) given[i] = i < nargs ? args[i] : NULL;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int at = gd_find(sig, key, nargs + k);
        if (at < 0) {
            PyErr_Format(PyExc_TypeError, "'%U' is an invalid keyword argument for %s()", key, sig->fn);
            return -1;
        }
        if (given[at]) {
            if (at < nargs) {
                PyErr_Format(PyExc_TypeError, "argument for %s() given by name ('%s') and position (%d)", sig->fn,
                             sig->params[at].name, at + 1);
            } else {
                PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", sig->fn,
                             sig->params[at].name);
            }
            return -1;
        }
        given[at] = args[nargs + k];
    }
    for (int i = 0; i < sig->n; i++) {
        if (!given[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %d)", sig->fn,
                         sig->params[i].name, i + 1);
            return -1;
        }
        if (gd_convert(sig->params[i].kind, given[i], &out[i]) < 0) return -1;
    }
    return 0;
}

#define GD_PARSE(fname, args, nargsf, kwnames, out)                                          \
    do {                                                                                     \
        if (gd_parse(&gd_sig_##fname, (args), (nargsf), (kwnames), (out)) < 0) return NULL;  \
    } while (0)

/* sgd(w, g, *, dtype, n, lr, clear, threads): w -= lr * g in place; with clear, g = 0. */
GD_SIG(sgd, 2, U("w"), U("g"), I("dtype"), U("n"), F("lr"), I("clear"), I("threads"));
static PyObject *
py_sgd(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    union gd_val a[7];
    GD_PARSE(sgd, args, nargsf, kwnames, a);
    Py_BEGIN_ALLOW_THREADS
    gd_sgd(GD_PTR(a[0].u), GD_PTR(a[1].u), a[2].i, (size_t)a[3].u, a[4].f, a[5].i, a[6].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* momentum(w, v, g, *, dtype, n, lr, mu, clear, threads): v = mu v + g; w -= lr v (g == 0: zero). */
GD_SIG(momentum, 3, U("w"), U("v"), U("g"), I("dtype"), U("n"), F("lr"), F("mu"), I("clear"), I("threads"));
static PyObject *
py_momentum(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    union gd_val a[9];
    GD_PARSE(momentum, args, nargsf, kwnames, a);
    Py_BEGIN_ALLOW_THREADS
    gd_momentum(GD_PTR(a[0].u), GD_PTR(a[1].u), GD_PTR(a[2].u), a[3].i, (size_t)a[4].u, a[5].f, a[6].f, a[7].i,
                a[8].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* adagrad(w, s, g, *, dtype, n, lr, eps, clear, threads): s += g^2; w -= lr g / (sqrt(s) + eps). */
GD_SIG(adagrad, 3, U("w"), U("s"), U("g"), I("dtype"), U("n"), F("lr"), F("eps"), I("clear"), I("threads"));
static PyObject *
py_adagrad(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    union gd_val a[9];
    GD_PARSE(adagrad, args, nargsf, kwnames, a);
    Py_BEGIN_ALLOW_THREADS
    gd_adagrad(GD_PTR(a[0].u), GD_PTR(a[1].u), GD_PTR(a[2].u), a[3].i, (size_t)a[4].u, a[5].f, a[6].f, a[7].i,
               a[8].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* adagrad_rows(w, s, *, n_rows, width, idx, rows, dtype, count, lr, eps) -> indices out of range. */
GD_SIG(adagrad_rows, 2, U("w"), U("s"), U("n_rows"), U("width"), U("idx"), U("rows"), I("dtype"), U("count"),
       F("lr"), F("eps"));
static PyObject *
py_adagrad_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    union gd_val a[10];
    int64_t bad;
    GD_PARSE(adagrad_rows, args, nargsf, kwnames, a);
    Py_BEGIN_ALLOW_THREADS
    bad = gd_adagrad_rows(GD_PTR(a[0].u), GD_PTR(a[1].u), (size_t)a[2].u, (size_t)a[3].u, GD_PTR(a[4].u),
                          GD_PTR(a[5].u), a[6].i, (size_t)a[7].u, a[8].f, a[9].f);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(bad);
}

/* adam(w, m, v, g, *, dtype, n, lr, beta1, beta2, eps, step, clear, threads): Adam at step t. */
GD_SIG(adam, 4, U("w"), U("m"), U("v"), U("g"), I("dtype"), U("n"), D("lr"), D("beta1"), D("beta2"), D("eps"),
       U("step"), I("clear"), I("threads"));
static PyObject *
py_adam(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    union gd_val a[13];
    GD_PARSE(adam, args, nargsf, kwnames, a);
    Py_BEGIN_ALLOW_THREADS
    gd_adam(GD_PTR(a[0].u), GD_PTR(a[1].u), GD_PTR(a[2].u), GD_PTR(a[3].u), a[4].i, (size_t)a[5].u, a[6].d, a[7].d,
            a[8].d, a[9].d, a[10].u, a[11].i, a[12].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* adam_rows(w, m, v, *, n_rows, width, idx, rows, dtype, count, lr, beta1, beta2, eps, step) -> indices out
 * of range. */
GD_SIG(adam_rows, 3, U("w"), U("m"), U("v"), U("n_rows"), U("width"), U("idx"), U("rows"), I("dtype"), U("count"),
       D("lr"), D("beta1"), D("beta2"), D("eps"), U("step"));
static PyObject *
py_adam_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    union gd_val a[14];
    int64_t bad;
    GD_PARSE(adam_rows, args, nargsf, kwnames, a);
    Py_BEGIN_ALLOW_THREADS
    bad = gd_adam_rows(GD_PTR(a[0].u), GD_PTR(a[1].u), GD_PTR(a[2].u), (size_t)a[3].u, (size_t)a[4].u,
                       GD_PTR(a[5].u), GD_PTR(a[6].u), a[7].i, (size_t)a[8].u, a[9].d, a[10].d, a[11].d, a[12].d,
                       a[13].u);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(bad);
}

/* sgd_rows(w, v, *, n_rows, width, idx, rows, dtype, count, lr) -> indices out of range. */
GD_SIG(sgd_rows, 2, U("w"), U("v"), U("n_rows"), U("width"), U("idx"), U("rows"), I("dtype"), U("count"),
       F("lr"));
static PyObject *
py_sgd_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    union gd_val a[9];
    int64_t bad;
    GD_PARSE(sgd_rows, args, nargsf, kwnames, a);
    Py_BEGIN_ALLOW_THREADS
    bad = gd_sgd_rows(GD_PTR(a[0].u), GD_PTR(a[1].u), (size_t)a[2].u, (size_t)a[3].u, GD_PTR(a[4].u),
                      GD_PTR(a[5].u), a[6].i, (size_t)a[7].u, a[8].f);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(bad);
}

/* nonfinite(g, *, dtype, n, threads) -> how many of the n elements at g are NaN or infinite. */
GD_SIG(nonfinite, 1, U("g"), I("dtype"), U("n"), I("threads"));
static PyObject *
py_nonfinite(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    union gd_val a[4];
    int64_t bad;
    GD_PARSE(nonfinite, args, nargsf, kwnames, a);
    Py_BEGIN_ALLOW_THREADS
    bad = gd_nonfinite(GD_PTR(a[0].u), a[1].i, (size_t)a[2].u, a[3].i);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(bad);
}

/* elastic(c, w, *, n, alpha, threads): c += alpha * (w - c). */
GD_SIG(elastic, 2, U("c"), U("w"), U("n"), F("alpha"), I("threads"));
static PyObject *
py_elastic(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    union gd_val a[5];
    GD_PARSE(elastic, args, nargsf, kwnames, a);
    Py_BEGIN_ALLOW_THREADS
    gd_elastic(GD_PTR(a[0].u), GD_PTR(a[1].u), (size_t)a[2].u, a[3].f, a[4].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* plain_sgd(w, g, *, n, lr, threads): the reference loop `gadei bench kernel` compares sgd with. */
GD_SIG(plain_sgd, 2, U("w"), U("g"), U("n"), F("lr"), I("threads"));
static PyObject *
py_plain_sgd(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    union gd_val a[5];
    GD_PARSE(plain_sgd, args, nargsf, kwnames, a);
    Py_BEGIN_ALLOW_THREADS
    gd_plain_sgd(GD_PTR(a[0].u), GD_PTR(a[1].u), (size_t)a[2].u, a[3].f, a[4].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* copy(dst, src, *, nbytes, threads): memcpy with the GIL released (pulls, uploads). */
GD_SIG(copy, 2, U("dst"), U("src"), U("nbytes"), I("threads"));
static PyObject *
py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    union gd_val a[4];
    GD_PARSE(copy, args, nargsf, kwnames, a);
    Py_BEGIN_ALLOW_THREADS
    gd_copy(GD_PTR(a[0].u), GD_PTR(a[1].u), (size_t)a[2].u, a[3].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* zero(addr, *, nbytes): memset 0 with the GIL released. */
GD_SIG(zero, 1, U("addr"), U("nbytes"));
static PyObject *
py_zero(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    union gd_val a[2];
    GD_PARSE(zero, args, nargsf, kwnames, a);
    Py_BEGIN_ALLOW_THREADS
    memset(GD_PTR(a[0].u), 0, (size_t)a[1].u);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static struct gd_sig *const gd_sigs[] = {
    &gd_sig_sgd, &gd_sig_momentum, &gd_sig_adagrad, &gd_sig_adagrad_rows, &gd_sig_adam, &gd_sig_adam_rows,
    &gd_sig_sgd_rows, &gd_sig_nonfinite, &gd_sig_elastic, &gd_sig_plain_sgd, &gd_sig_copy, &gd_sig_zero,
};

/* Intern every binding's names once (kept for the life of the process, as the module is). */
static int
gd_sigs_init(void)
{
    for (size_t s = 0; s < sizeof gd_sigs / sizeof gd_sigs[0]; s++) {
        struct gd_sig *sig = gd_sigs[s];
        for (int i = 0; i < sig->n; i++) {
            if (!sig->names[i] && !(sig->names[i] = PyUnicode_InternFromString(sig->params[i].name))) return -1;
        }
    }
    return 0;
}

#undef U
#undef I
#undef F
#undef D

/* ------------------------------------------------------------------ a deadline on a call that holds the GIL */

/* exit_after arms a thread of its own that ends the process with `code` (after writing
 * `message` to stderr) unless disarmed within `seconds`. It exists for calls that block while
 * holding the GIL, where no Python thread could act: MPI_Finalize waiting in the runtime's
 * fence for a rank that died. Each arming has its own generation; disarm ends them all. */
static uint64_t gd_exit_generation;  /* the armed generation, 0 when disarmed */
static uint64_t gd_exit_count;

struct gd_exit_plan {
    uint64_t generation;
    double seconds;
    int code;
    char message[512];
};

static void *
gd_exit_thread(void *arg)
{
    struct gd_exit_plan *plan = arg;
    struct timespec wait = {(time_t)plan->seconds, (long)((plan->seconds - (double)(time_t)plan->seconds) * 1e9)};
    while (nanosleep(&wait, &wait) != 0 && errno == EINTR) {
    }
    if (__atomic_load_n(&gd_exit_generation, __ATOMIC_ACQUIRE) == plan->generation) {
        ssize_t unused = write(2, plan->message, strlen(plan->message));
        (void)unused;
        _exit(plan->code);
    }
    free(plan);
    return NULL;
}

static PyObject *
gd_exit_after(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double seconds;
    int code;
    const char *message;
    pthread_t thread;
    pthread_attr_t attr;
    if (gd_nargs("exit_after", nargs, 3) < 0) return NULL;
    seconds = PyFloat_AsDouble(args[0]);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    long wanted = PyLong_AsLong(args[1]);
    if (wanted == -1 && PyErr_Occurred()) return NULL;
    code = (int)(wanted & 0xff);
    if (!(message = PyUnicode_AsUTF8(args[2]))) return NULL;
    if (!(seconds >= 0.0 && seconds < 1e9)) {
        PyErr_SetString(PyExc_ValueError, "exit_after: seconds must be in [0, 1e9)");
        return NULL;
    }
    struct gd_exit_plan *plan = calloc(1, sizeof *plan);
    if (!plan) return PyErr_NoMemory();
    plan->generation = __atomic_add_fetch(&gd_exit_count, 1, __ATOMIC_ACQ_REL);
    plan->seconds = seconds;
    plan->code = code;
    snprintf(plan->message, sizeof plan->message, "%s\n", message);
    __atomic_store_n(&gd_exit_generation, plan->generation, __ATOMIC_RELEASE);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int err = pthread_create(&thread, &attr, gd_exit_thread, plan);
    pthread_attr_destroy(&attr);
    if (err) {
        __atomic_store_n(&gd_exit_generation, 0, __ATOMIC_RELEASE);
        free(plan);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *
gd_exit_disarm(PyObject *self, PyObject *unused)
{
    __atomic_store_n(&gd_exit_generation, 0, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *
py_openmp(PyObject *self, PyObject *unused)
{
    return Py_BuildValue("(Oi)", gd_openmp_built() ? Py_True : Py_False, gd_processors());
}

static PyObject *
py_kernel_isa(PyObject *self, PyObject *unused)
{
    return PyUnicode_FromString(gd_kernel_isa());
}

#define GD_FAST(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL, doc}
#define GD_KW(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_FASTCALL | METH_KEYWORDS, doc}

static PyMethodDef gd_methods[] = {
    GD_FAST("load64", gd_load64, "load64(addr) -> int"),
    GD_FAST("store64", gd_store64, "store64(addr, v)"),
    GD_FAST("add64", gd_add64, "add64(addr, d) -> old"),
    GD_FAST("cas64", gd_cas64, "cas64(addr, e, d) -> bool"),
    GD_FAST("load32", gd_load32, "load32(addr) -> int"),
    GD_FAST("store32", gd_store32, "store32(addr, v)"),
    GD_FAST("add32", gd_add32, "add32(addr, d) -> old"),
    GD_FAST("cas32", gd_cas32, "cas32(addr, e, d) -> bool"),
    GD_FAST("futex_wait", gd_futex_wait, "futex_wait(addr, expected, timeout_s) -> 0 woken / 1 timed out"),
    GD_FAST("futex_wake", gd_futex_wake, "futex_wake(addr, n) -> woken"),
    GD_FAST("cross_cpu_ns", gd_cross_cpu_ns, "cross_cpu_ns(cpu_a, cpu_b, rounds, timeout_s) -> ns per round trip of a cache line"),
    GD_FAST("poll_rings", gd_poll_rings, "poll_rings(table, count, stride, head_off, tail_off, start, spin_ns[, nap_ns]) -> index or -1"),
    GD_KW("sgd", py_sgd, "sgd(w, g, *, dtype, n, lr, clear, threads): w -= lr * g in place; with clear, g = 0"),
    GD_KW("momentum", py_momentum, "momentum(w, v, g, *, dtype, n, lr, mu, clear, threads): v = mu v + g; "
          "w -= lr v"),
    GD_KW("adagrad", py_adagrad, "adagrad(w, s, g, *, dtype, n, lr, eps, clear, threads): s += g^2; "
          "w -= lr g / (sqrt(s) + eps)"),
    GD_KW("adagrad_rows", py_adagrad_rows, "adagrad_rows(w, s, *, n_rows, width, idx, rows, dtype, count, lr, eps) "
          "-> bad indices"),
    GD_KW("adam", py_adam, "adam(w, m, v, g, *, dtype, n, lr, beta1, beta2, eps, step, clear, threads): "
          "m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; w -= lr m_hat / (sqrt(v_hat) + eps)"),
    GD_KW("adam_rows", py_adam_rows, "adam_rows(w, m, v, *, n_rows, width, idx, rows, dtype, count, lr, beta1, "
          "beta2, eps, step) -> bad indices"),
    GD_KW("sgd_rows", py_sgd_rows, "sgd_rows(w, v, *, n_rows, width, idx, rows, dtype, count, lr) -> bad indices"),
    GD_KW("nonfinite", py_nonfinite, "nonfinite(g, *, dtype, n, threads) -> elements that are NaN or infinite"),
    GD_KW("elastic", py_elastic, "elastic(c, w, *, n, alpha, threads): c += alpha (w - c)"),
    GD_KW("plain_sgd", py_plain_sgd, "plain_sgd(w, g, *, n, lr, threads): the reference loop for benchmarks"),
    GD_KW("copy", py_copy, "copy(dst, src, *, nbytes, threads)"),
    GD_KW("zero", py_zero, "zero(addr, *, nbytes)"),
    GD_FAST("exit_after", gd_exit_after, "exit_after(seconds, code, message): _exit(code) after seconds unless "
            "disarmed (for calls that block holding the GIL)"),
    {"exit_disarm", gd_exit_disarm, METH_NOARGS, "exit_disarm(): the armed exit_after does not happen"},
    {"openmp", py_openmp, METH_NOARGS, "openmp() -> (built with OpenMP, processors)"},
    {"kernel_isa", py_kernel_isa, METH_NOARGS, "kernel_isa() -> 'avx2' or 'generic'"},
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
    gd_kernels_init();
    if (gd_sigs_init() < 0) return NULL;
    return PyModule_Create(&gd_module);
}
