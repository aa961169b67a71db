"""Typed stub of gadei._native (native/gadei_native.c): atomics, futex waits and update
kernels on raw addresses of a gadei region.

Every `addr` is an integer address inside a mapped region (the caller owns its bounds and
alignment: 8 bytes for the 64-bit calls, 4 for the 32-bit ones). `dtype` is a code from
`gadei.layout.DTYPE_CODES` (float32, float16, bfloat16 gradients); weights and optimizer
state are float32. The kernels release the GIL and use up to `threads` OpenMP threads.
The kernels take their arguments by name, as in native/kernels.h, through one small parser
that matches the names without building a dict (about 0.03 us a call more than positional
arguments; PyArg_ParseTupleAndKeywords, which builds a dict a call, cost 0.3-0.9 us, and
4-12% on a 1 MB update, whose streaming leaves the next parse to run from cold caches). The
other functions (atomics, futex waits, the ring poll, the probes and guards) are
positional-only fast calls: the atomics and the poll are the ring's per-gradient path, calls
of a few tens of nanoseconds where any matching of names would show.

Only the modules that own a protocol or a kernel call it (tests/test_owners.py holds the list):
`gadei.region` (atomic words and futexes: `Record`, `Word`, which `gadei.protocol` builds on;
`cross_cpu_ns`), `gadei.ring`, `gadei.transport.slot` (the payload kernels; `Float32Dense`,
the kernels on plain float32 arrays and the weights copy, which the sync and elastic rules,
pulls, the bridge and the kernel benchmarks use) and `gadei.launch` (`exit_after`, the exit
guard). The update rules (`gadei.modes`) apply their kernels through the slot's format.
"""

# atomics (sequentially consistent)
def load64(addr: int, /) -> int: ...
def store64(addr: int, value: int, /) -> None: ...
def add64(addr: int, delta: int, /) -> int:
    """Add `delta`; the value before."""
def cas64(addr: int, expected: int, desired: int, /) -> bool:
    """Compare-and-swap; True when it swapped."""
def load32(addr: int, /) -> int: ...
def store32(addr: int, value: int, /) -> None: ...
def add32(addr: int, delta: int, /) -> int: ...
def cas32(addr: int, expected: int, desired: int, /) -> bool: ...

# futex waits on a 32-bit word of a shared mapping
def futex_wait(addr: int, expected: int, timeout_s: float, /) -> int:
    """Sleep while the word holds `expected`: 0 when woken (or it already differed), 1 on time-out."""
def futex_wake(addr: int, n: int, /) -> int:
    """Wake up to `n` waiters; how many woke."""
def poll_rings(table: int, count: int, stride: int, head_off: int, tail_off: int, start: int, spin_ns: int,
               nap_ns: int = 0, /) -> int:
    """The first ring from `start` (round-robin) whose head is past its tail, spinning up to
    `spin_ns` (with `nap_ns`: sleeping that long between looks instead of spinning); -1 when none."""

# how near two CPUs are
def cross_cpu_ns(cpu_a: int, cpu_b: int, rounds: int, timeout_s: float, /) -> float:
    """Nanoseconds per round trip of a cache line between two threads pinned to the two CPUs
    (OSError: a thread cannot run on its CPU; TimeoutError: the rounds took over timeout_s)."""

# update kernels (native/kernels.h): each takes its C function's arguments by the same names, in
# the same order; the leading addresses may be positional, every argument after them is
# keyword-only, so that a swapped length, dtype or thread count is a TypeError
def sgd(w: int, g: int, *, dtype: int, n: int, lr: float, clear: int, threads: int) -> None:
    """w -= lr * g in place over n elements; with `clear`, g = 0 after."""
def momentum(w: int, v: int, g: int, *, dtype: int, n: int, lr: float, mu: float, clear: int, threads: int) -> None:
    """v = mu v + g; w -= lr v (g == 0: a zero gradient)."""
def adagrad(w: int, s: int, g: int, *, dtype: int, n: int, lr: float, eps: float, clear: int, threads: int) -> None:
    """s += g^2; w -= lr g / (sqrt(s) + eps)."""
def adagrad_rows(w: int, s: int, *, n_rows: int, width: int, idx: int, rows: int, dtype: int, count: int, lr: float,
                 eps: float) -> int:
    """Adagrad on `count` rows of a table (indices int64 at `idx`); how many indices were out of range."""
def adam(w: int, m: int, v: int, g: int, *, dtype: int, n: int, lr: float, beta1: float, beta2: float, eps: float,
         step: int, clear: int, threads: int) -> None:
    """Adam at step t (bias correction): m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
    w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps), every element."""
def adam_rows(w: int, m: int, v: int, *, n_rows: int, width: int, idx: int, rows: int, dtype: int, count: int,
              lr: float, beta1: float, beta2: float, eps: float, step: int) -> int:
    """Lazy Adam on `count` rows of a table: only those rows' moments and weights change; how many
    indices were out of range."""
def sgd_rows(w: int, v: int, *, n_rows: int, width: int, idx: int, rows: int, dtype: int, count: int,
             lr: float) -> int:
    """SGD on `count` rows of a table (v != 0: v += the rows too); how many indices were out of range."""
def nonfinite(g: int, *, dtype: int, n: int, threads: int) -> int:
    """How many of the n gradient elements at `g` are NaN or infinite (a read-only pass)."""
def elastic(c: int, w: int, *, n: int, alpha: float, threads: int) -> None:
    """c += alpha (w - c)."""
def plain_sgd(w: int, g: int, *, n: int, lr: float, threads: int) -> None:
    """The reference loop the benchmarks compare the kernel with."""
def copy(dst: int, src: int, *, nbytes: int, threads: int) -> None: ...
def zero(addr: int, *, nbytes: int) -> None: ...

# process guards and build facts
def exit_after(seconds: float, code: int, message: str, /) -> None:
    """_exit(code) after `seconds`, printing `message`, unless disarmed (for calls that block holding the GIL)."""
def exit_disarm() -> None: ...
def openmp() -> tuple[bool, int]:
    """(built with OpenMP, processors)."""
def kernel_isa() -> str:
    """'avx2' or 'generic': the update kernel chosen for this CPU when the module loaded."""
