"""The native core: copies, atomics, futex waits and ring polling (the kernels: test_kernels.py)."""

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from gadei import _native

@pytest.mark.parametrize("nbytes", [1, 4096, 1 << 20, (1 << 20) + 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_copy_and_zero(nbytes, threads):
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes + 8, dtype=np.uint8)
    _native.copy(dst.ctypes.data, src.ctypes.data, nbytes=nbytes, threads=threads)
    np.testing.assert_array_equal(dst[:nbytes], src)
    assert not dst[nbytes:].any()
    _native.zero(src.ctypes.data, nbytes=nbytes)
    assert not src.any()


def test_atomics():
    cell = np.zeros(2, dtype=np.uint64)
    addr = cell.ctypes.data
    _native.store64(addr, 41)
    assert _native.add64(addr, 1) == 41 and _native.load64(addr) == 42
    assert not _native.cas64(addr, 7, 9) and _native.load64(addr) == 42
    assert _native.cas64(addr, 42, 1 << 40) and _native.load64(addr) == 1 << 40
    word = addr + 8
    _native.store32(word, 0xFFFFFFFF)
    assert _native.add32(word, 1) == 0xFFFFFFFF and _native.load32(word) == 0  # wraps like a u32
    assert _native.cas32(word, 0, 5) and _native.load32(word) == 5


def test_concurrent_adds_are_atomic():
    cell = np.zeros(1, dtype=np.uint64)
    addr = cell.ctypes.data

    def bump():
        for _ in range(20000):
            _native.add64(addr, 1)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cell[0] == 80000


def test_futex_wait_times_out_and_returns_at_once_on_a_changed_word():
    word = np.zeros(1, dtype=np.uint32)
    started = time.monotonic()
    assert _native.futex_wait(word.ctypes.data, 0, 0.05) == 1
    assert time.monotonic() - started >= 0.04
    assert _native.futex_wait(word.ctypes.data, 1, 5.0) == 0  # word holds 0, not 1: no sleep


def test_futex_wake_ends_a_wait():
    word = np.zeros(1, dtype=np.uint32)
    result = []
    waiter = threading.Thread(target=lambda: result.append(_native.futex_wait(word.ctypes.data, 0, 10.0)))
    waiter.start()
    deadline = time.monotonic() + 10
    while waiter.is_alive() and time.monotonic() < deadline:
        _native.store32(word.ctypes.data, 1)
        _native.futex_wake(word.ctypes.data, 1)
        waiter.join(0.01)
    assert result == [0]


def test_poll_rings_finds_published_work_round_robin():
    stride, count = 128, 5
    table = np.zeros(stride * count // 8, dtype=np.uint64)
    base = table.ctypes.data
    head_off, tail_off = 8, 72
    assert _native.poll_rings(base, count, stride, head_off, tail_off, 0, 1000) == -1
    for ring in (1, 3):
        _native.store64(base + ring * stride + head_off, 4)
        _native.store64(base + ring * stride + tail_off, 3)
    assert _native.poll_rings(base, count, stride, head_off, tail_off, 0, 0) == 1
    assert _native.poll_rings(base, count, stride, head_off, tail_off, 2, 0) == 3
    assert _native.poll_rings(base, count, stride, head_off, tail_off, 4, 0) == 1


def test_poll_rings_dozing_finds_work_published_meanwhile_and_sleeps_otherwise():
    """With nap_ns the poll sleeps between looks: it finds a gradient another thread publishes
    during the doze, and a doze with nothing published costs little CPU (it does not spin)."""
    import threading
    import time

    stride, count = 128, 3
    table = np.zeros(stride * count // 8, dtype=np.uint64)
    base = table.ctypes.data
    head_off, tail_off = 8, 72
    cpu, start = time.thread_time(), time.monotonic()
    assert _native.poll_rings(base, count, stride, head_off, tail_off, 0, 200_000_000, 50_000) == -1
    elapsed = time.monotonic() - start
    assert elapsed >= 0.2
    # A spinning poll uses all the CPU it is given over those 0.2 s (all of it on an idle core);
    # a doze of 50 us naps about a sixth of it. Measured against the doze's own wall time, not a
    # spinning run's CPU: on a loaded machine that one is given a fraction of a core.
    dozing = time.thread_time() - cpu
    assert dozing < 0.5 * elapsed, (dozing, elapsed)
    publisher = threading.Timer(0.05, lambda: _native.store64(base + 2 * stride + head_off, 1))
    publisher.start()
    start = time.monotonic()
    assert _native.poll_rings(base, count, stride, head_off, tail_off, 0, 5_000_000_000, 50_000) == 2
    assert time.monotonic() - start < 2.0
    publisher.join()


def test_built_with_openmp():
    built, processors = _native.openmp()
    assert built, "setup.py found no OpenMP: the kernel runs serial"
    assert processors >= 1


def test_cross_cpu_ns_times_a_cache_line_between_two_cpus_and_says_when_it_cannot():
    """`gadei bench` records how near the host placed the CPUs around each run: a cache line's
    round trip between two pinned threads, tens to hundreds of nanoseconds, never zero; a
    CPU the process may not run on is an OSError, not a hang."""
    import os

    from gadei.bench.timing import cross_cpu_ns, placement

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: no pair to time")
    for ns in (_native.cross_cpu_ns(cpus[0], cpus[1], 20_000, 5.0), cross_cpu_ns()):
        assert 10 < ns < 100_000, ns
    # two threads on one CPU take turns by the scheduler's timeslice: far slower, still ends
    assert _native.cross_cpu_ns(cpus[0], cpus[0], 20, 5.0) > 0
    absent = next(c for c in range(1023, -1, -1) if c not in cpus)
    with pytest.raises(OSError, match=f"cannot run a thread on CPU {cpus[0]} or {absent}"):
        _native.cross_cpu_ns(cpus[0], absent, 1000, 5.0)
    with pytest.raises(ValueError, match="rounds >= 1"):
        _native.cross_cpu_ns(cpus[0], cpus[1], 0, 5.0)
    assert "changed more than 2x" in placement([75.0, None, 80.0, 340.0]) and placement([None]) is None
    assert "changed" not in placement([75.0, 80.0, 90.0]) and "75-90 ns (median 80)" in placement([75.0, 80.0, 90.0])


def test_exit_after_ends_a_process_stuck_holding_the_gil_unless_the_block_ended():
    """The deadline MPI_Finalize gets (`gadei.launch.exit_after`, as the bridge uses it): a
    native thread, because the stuck call holds the GIL (no Python thread could run: builtin
    sum over a range is one C call); a block that ends, by an error too, disarms it."""
    stuck = ("from gadei.launch import exit_after\n"
             "with exit_after(0.3, 7, 'gave up waiting'):\n"
             "    sum(range(10**12))\n")  # one C call that keeps the GIL for hours, as the fence does
    done = subprocess.run([sys.executable, "-c", stuck], capture_output=True, text=True, timeout=60)
    assert done.returncode == 7 and "gave up waiting" in done.stderr
    disarmed = ("import time; from gadei.launch import exit_after\n"
                "with exit_after(0.2, 7, 'should not print'):\n    pass\n"
                "try:\n    with exit_after(0.2, 8, 'nor this'):\n        raise KeyError\nexcept KeyError:\n    pass\n"
                "time.sleep(0.6); print('lived')\n")
    done = subprocess.run([sys.executable, "-c", disarmed], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "lived" and not done.stderr


def test_the_typed_stub_declares_exactly_what_the_module_has():
    import ast
    from pathlib import Path

    stub = Path(_native.__file__).with_name("_native.pyi")
    if not stub.exists():  # an editable install builds the module next to the source's stub
        stub = Path(__file__).resolve().parent.parent / "gadei" / "_native.pyi"
    declared = {node.name for node in ast.parse(stub.read_text()).body if isinstance(node, ast.FunctionDef)}
    assert declared == {name for name in dir(_native) if not name.startswith("_")}


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
@pytest.mark.parametrize("nbytes", [1, 4099, (2 << 20) + 5, (3 << 20) + 7, (7 << 20) + 13])
def test_copy_is_right_at_any_thread_count_and_length(nbytes, threads):
    """A team of up to 7 threads splits a copy at the destination's cache lines (1 MiB a thread at
    least: the sizes above make teams of 2, 3 and 7); lengths that do not divide and a destination
    3 bytes past a line leave a ragged first and last chunk. Every byte arrives, none beside it."""
    src = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes + 16, dtype=np.uint8)
    _native.copy(dst.ctypes.data + 3, src.ctypes.data, nbytes=nbytes, threads=threads)
    np.testing.assert_array_equal(dst[3 : 3 + nbytes], src)
    assert not dst[:3].any() and not dst[3 + nbytes :].any()



def _kernels_h() -> dict[str, list[tuple[str, bool]]]:
    """native/kernels.h's kernels: name (without gd_) -> [(parameter, is a pointer)] in C's order."""
    import re
    from pathlib import Path

    header = (Path(__file__).resolve().parent.parent / "native" / "kernels.h").read_text()
    header = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    found = {}
    for name, params in re.findall(r"^(?:void|int64_t)\s+gd_(\w+)\(([^;]*)\);", header, flags=re.M):
        found[name] = [(re.findall(r"\w+", p)[-1], "*" in p) for p in params.split(",")]
    return found


_SCALARS = {"dtype": 1, "n": 0, "count": 0, "nbytes": 0, "n_rows": 1, "width": 1, "step": 1, "clear": 0,
            "threads": 1, "lr": 0.1, "mu": 0.9, "eps": 1e-8, "beta1": 0.9, "beta2": 0.999, "alpha": 0.5}


def test_each_kernel_takes_its_c_arguments_by_name_in_c_order_and_a_swap_is_an_error():
    """`sgd(w, g, n, lr, clear, threads, dtype)` against `gd_sgd(w, g, dtype, n, lr, clear, threads)`
    once let a swap compute garbage silently. Now every binding of kernels.h (and its line in the
    typed stub) has the C function's names in C's order; after the leading addresses each argument
    is keyword-only, so scalars passed by position, a misspelt name or a float where C has an
    integer are a TypeError."""
    import ast
    from pathlib import Path

    kernels = _kernels_h()
    assert set(kernels) >= {"sgd", "momentum", "adagrad", "adagrad_rows", "adam", "adam_rows", "sgd_rows",
                            "nonfinite", "elastic", "plain_sgd", "copy"}
    stub = ast.parse((Path(__file__).resolve().parent.parent / "gadei" / "_native.pyi").read_text())
    stubbed = {node.name: node.args for node in stub.body if isinstance(node, ast.FunctionDef)}
    scratch = np.zeros(64, dtype=np.float32)
    for name, params in kernels.items():
        if name not in stubbed:
            continue  # not a kernel binding (the ISA, the scalar conversions)
        addresses = [p for p, pointer in params if pointer and p not in ("idx", "rows")]
        scalars = [p for p, _ in params[len(addresses):]]
        assert [p for p, pointer in params[: len(addresses)]] == addresses, name  # the addresses lead
        args = stubbed[name]
        assert [a.arg for a in args.args] == addresses and [a.arg for a in args.kwonlyargs] == scalars, name
        fn = getattr(_native, name)
        ptrs = [scratch.ctypes.data] * len(addresses)
        values = {p: scratch.ctypes.data if p in ("idx", "rows") else _SCALARS[p] for p in scalars}
        fn(*ptrs, **values)  # nothing to do (n, count or nbytes 0): the names are right
        with pytest.raises(TypeError, match="positional argument"):
            fn(*ptrs, *values.values())
        for at, missing in enumerate(scalars):  # C's order: the binding numbers each name as kernels.h does
            with pytest.raises(TypeError, match=rf"'{missing}' \(pos {len(addresses) + at + 1}\)"):
                fn(*ptrs, **{p: v for p, v in values.items() if p != missing})
        with pytest.raises(TypeError):  # a name C does not have
            fn(*ptrs, **values, thread=1)
        size = next(p for p in ("n", "count", "nbytes") if p in values)
        with pytest.raises(TypeError):
            fn(*ptrs, **{**values, size: 0.5})
    # the old order, by position, is refused rather than read as (dtype=n, n=lr, ...)
    with pytest.raises(TypeError):
        _native.sgd(scratch.ctypes.data, scratch.ctypes.data, 16, 0.5, 1, 1, 1)


def test_kernel_arguments_are_matched_by_string_and_checked_for_range_and_repeats():
    """The kernels' parser matches a keyword by pointer to its interned name first; a name built at
    run time (a different string object) must still be found by its text. An address given both by
    position and by name, an int out of C's int range or a negative size is refused, never read."""
    scratch = np.zeros(16, dtype=np.float32)
    p = scratch.ctypes.data
    built = "".join(["thr", "eads"])  # equal to 'threads', not the interned object
    assert _native.nonfinite(p, dtype=1, n=0, **{built: 1}) == 0
    scratch[3] = np.inf
    assert _native.nonfinite(g=p, dtype=1, n=16, threads=1) == 1  # an address by name
    with pytest.raises(TypeError, match=r"given by name \('g'\) and position \(1\)"):
        _native.nonfinite(p, g=p, dtype=1, n=0, threads=1)
    with pytest.raises(OverflowError):
        _native.nonfinite(p, dtype=1, n=0, threads=2**31)
    with pytest.raises(OverflowError):
        _native.nonfinite(p, dtype=1, n=-1, threads=1)
    with pytest.raises(TypeError, match="positional argument"):
        _native.zero(p, 0)
