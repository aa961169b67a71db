"""The native core against NumPy references: the update kernel, copies, atomics and futex waits."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gadei import _native
from gadei.modes import AsyncSGD

# Lengths around the vector widths (4, 8, 16 floats), the 16-float chunk alignment and the
# 65,536-element threshold where the kernel starts using OpenMP threads.
SIZES = [1, 3, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 1000, 4099, 65535, 65536, 65537, 131075, 1 << 20, (1 << 20) + 13]
THREADS = [1, 2, 3, 4]


def _arrays(n, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    return w, g


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("n", SIZES)
def test_sgd_kernel_matches_numpy_reference(n, threads):
    w, g = _arrays(n, n)
    w_ref, g_ref = w.copy(), g.copy()
    lr = 0.0123
    AsyncSGD.reference(w_ref, g_ref, lr)
    _native.sgd(w.ctypes.data, g.ctypes.data, n, lr, 1, threads)
    np.testing.assert_array_equal(w, w_ref)
    np.testing.assert_array_equal(g, g_ref)  # zeroed in the same pass


def _embedding_like(n, seed):
    """Weights with special values; a gradient that is zero but for some 128-wide rows and a few -0.0."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n).astype(np.float32)
    w[:: 97] = -0.0
    w[5 :: 1031] = np.inf
    w[7 :: 1543] = np.nan
    g = np.zeros(n, dtype=np.float32)
    for row in rng.choice(max(1, n // 128), size=max(1, n // 1280), replace=False):
        line = g[row * 128 : row * 128 + 128]
        line[:] = rng.standard_normal(len(line))
    g[rng.choice(n, size=max(1, n // 5000), replace=False)] = -0.0  # bits set: the line is not skipped
    # -0.0 - lr * -0.0 is +0.0: a kernel that skipped this line as "zero" would leave -0.0
    if n >= 194:
        j = 97 * (n // 97 - 1)
        g[j - j % 16 : j - j % 16 + 16] = 0.0
        g[j] = -0.0
    return w, g


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", [100, 4099, 200_003])
def test_sgd_kernel_skips_zero_lines_bit_exactly(n, threads):
    w, g = _embedding_like(n, n)
    w_ref, g_ref = w.copy(), g.copy()
    with np.errstate(invalid="ignore"):
        AsyncSGD.reference(w_ref, g_ref, 0.3)
    _native.sgd(w.ctypes.data, g.ctypes.data, n, 0.3, 1, threads)
    np.testing.assert_array_equal(w.view(np.uint32), w_ref.view(np.uint32))  # bits: -0.0, NaN, inf too
    np.testing.assert_array_equal(g.view(np.uint32), g_ref.view(np.uint32))


def test_generic_kernel_without_avx2_matches_reference():
    # the portable loop (no AVX2 on the CPU, or GADEI_NO_AVX2=1), checked in a fresh process
    code = (
        "import numpy as np, sys; sys.path.insert(0, sys.argv[1])\n"
        "from gadei import _native; from gadei.modes import AsyncSGD; from test_native import _embedding_like\n"
        "assert _native.kernel_isa() == 'generic'\n"
        "for n in (1, 17, 4099, 200003):\n"
        "    w, g = _embedding_like(n, n); wr, gr = w.copy(), g.copy()\n"
        "    with np.errstate(invalid='ignore'): AsyncSGD.reference(wr, gr, 0.3)\n"
        "    _native.sgd(w.ctypes.data, g.ctypes.data, n, 0.3, 1, 2)\n"
        "    assert (w.view(np.uint32) == wr.view(np.uint32)).all() and not g.any()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                          env={**os.environ, "GADEI_NO_AVX2": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [17, 65537])
def test_sgd_kernel_without_clear_keeps_gradient(n, threads):
    w, g = _arrays(n, 7)
    g_before = g.copy()
    expected = w - np.float32(0.5) * g
    _native.sgd(w.ctypes.data, g.ctypes.data, n, 0.5, 0, threads)
    np.testing.assert_array_equal(w, expected)
    np.testing.assert_array_equal(g, g_before)


def test_sgd_kernel_touches_nothing_outside_its_range():
    n = 65537 + 16
    w, g = _arrays(n, 3)
    w_before = w.copy()
    inner = slice(5, n - 11)
    _native.sgd(w[inner].ctypes.data, g[inner].ctypes.data, n - 16, 0.25, 1, 4)
    np.testing.assert_array_equal(w[:5], w_before[:5])
    np.testing.assert_array_equal(w[n - 11 :], w_before[n - 11 :])
    assert np.all(g[inner] == 0) and np.all(g[:5] != 0) and np.all(g[n - 11 :] != 0)


@pytest.mark.parametrize("n", [1, 1000, 65537])
def test_plain_reference_loop_matches(n):
    w, g = _arrays(n, 11)
    expected = w - np.float32(0.1) * g
    _native.plain_sgd(w.ctypes.data, g.ctypes.data, n, 0.1, 2)
    np.testing.assert_array_equal(w, expected)


@pytest.mark.parametrize("nbytes", [1, 4096, 1 << 20, (1 << 20) + 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_copy_and_zero(nbytes, threads):
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes + 8, dtype=np.uint8)
    _native.copy(dst.ctypes.data, src.ctypes.data, nbytes, threads)
    np.testing.assert_array_equal(dst[:nbytes], src)
    assert not dst[nbytes:].any()
    _native.zero(src.ctypes.data, nbytes)
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


def test_kernel_uses_avx2_where_the_cpu_has_it():
    with open("/proc/cpuinfo") as cpuinfo:
        has_avx2 = " avx2" in cpuinfo.read()
    assert _native.kernel_isa() == ("avx2" if has_avx2 else "generic")


def test_built_with_openmp():
    built, processors = _native.openmp()
    assert built, "setup.py found no OpenMP: the kernel runs serial"
    assert processors >= 1
