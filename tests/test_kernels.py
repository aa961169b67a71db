"""The update kernels against their NumPy references, bit for bit, for every gradient dtype.

Lengths sit around the vector widths (8 and 16 elements), the 64-byte peel and the
524,288-element size from which the kernels split the work over a team of OpenMP threads
(262,144 elements a thread, GD_THREAD_MIN); gradients have dense
stretches, all-zero lines (which the kernels skip) and signed zeros, weights have -0.0,
infinities and NaN. The portable path is checked in a process with GADEI_NO_AVX2=1.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gadei import _native
from gadei.layout import DTYPE_CODES
from gadei.modes import ADAGRAD_EPS, ADAM_BETA1, ADAM_BETA2, ADAM_EPS, RuleOptions
from gadei.transport.slot import Float32Dense
from oracles import (adam_reference, adam_rows_reference, async_reference, elastic_reference, nonfinite_reference,
                     rows_reference, sync_reference)

SIZES = [1, 7, 8, 15, 16, 17, 31, 33, 64, 65, 1000, 4099, 65535, 65537, 524289, (1 << 20) + 13]
THREADS = [1, 2, 3]
DTYPES = ["float32", "float16", "bfloat16"]


def to_wire(g32: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 gradient as it travels in a slot (float16 / bfloat16 bits as NumPy arrays)."""
    if dtype == "float32":
        return g32.copy()
    if dtype == "float16":
        return g32.astype(np.float16)
    return torch.from_numpy(g32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()


def from_wire(g: np.ndarray, dtype: str) -> np.ndarray:
    """What the kernel reads: the wire value as float32, exactly."""
    if dtype == "bfloat16":
        return (g.astype(np.uint32) << 16).view(np.float32)
    return g.astype(np.float32)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint16)


def weights_and_gradient(n: int, seed: int):
    """Weights with special values; a gradient with dense stretches, zero lines and a few -0.0."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n).astype(np.float32)
    w[::97] = -0.0
    w[5::1031] = np.inf
    w[7::1543] = np.nan
    g = np.zeros(n, dtype=np.float32)
    for row in rng.choice(max(1, n // 128), size=max(1, n // 1280), replace=False):
        line = g[row * 128 : row * 128 + 128]
        line[:] = rng.standard_normal(len(line))
    g[rng.choice(n, size=max(1, n // 5000), replace=False)] = -0.0  # bits set: the line is not skipped
    if n >= 194:  # -0.0 - lr * -0.0 is +0.0: a kernel that took this line for zero would keep -0.0
        j = 97 * (n // 97 - 1)
        g[j - j % 16 : j - j % 16 + 16] = 0.0
        g[j] = -0.0
    return w, g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("n", SIZES)
def test_sgd_kernel_matches_reference(n, threads, dtype):
    w, g32 = weights_and_gradient(n, n)
    g = to_wire(g32, dtype)
    w_ref = w.copy()
    with np.errstate(invalid="ignore"):
        async_reference(w_ref, [from_wire(g, dtype)], RuleOptions(lr=0.3))
    _native.sgd(w.ctypes.data, g.ctypes.data, dtype=DTYPE_CODES[dtype], n=n, lr=0.3, clear=1, threads=threads)
    np.testing.assert_array_equal(bits(w), bits(w_ref))  # bits: -0.0, NaN and inf too
    assert not bits(g).any()  # handed back zeroed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [17, 65537])
def test_sgd_kernel_without_clear_keeps_the_gradient(n, dtype):
    w = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    g = to_wire(np.random.default_rng(2).standard_normal(n).astype(np.float32), dtype)
    before = g.copy()
    expected = w - np.float32(0.5) * from_wire(g, dtype)
    _native.sgd(w.ctypes.data, g.ctypes.data, dtype=DTYPE_CODES[dtype], n=n, lr=0.5, clear=0, threads=2)
    np.testing.assert_array_equal(w, expected)
    np.testing.assert_array_equal(g, before)


def test_sgd_kernel_touches_nothing_outside_its_range():
    n = 65537 + 16
    w, g = weights_and_gradient(n, 3)
    g[:] = 1.0
    w_before = w.copy()
    inner = slice(5, n - 11)
    _native.sgd(w[inner].ctypes.data, g[inner].ctypes.data, dtype=DTYPE_CODES["float32"], n=n - 16, lr=0.25, clear=1,
                threads=4)
    np.testing.assert_array_equal(bits(w[:5]), bits(w_before[:5]))
    np.testing.assert_array_equal(bits(w[n - 11 :]), bits(w_before[n - 11 :]))
    assert np.all(g[inner] == 0) and np.all(g[:5] == 1) and np.all(g[n - 11 :] == 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", [1, 33, 4099, 131075])
def test_momentum_kernel_matches_reference(n, threads, dtype):
    w, g32 = weights_and_gradient(n, n + 1)
    w[~np.isfinite(w)] = 1.0
    v = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    g = to_wire(g32, dtype)
    w_ref, v_ref = w.copy(), v.copy()
    async_reference(w_ref, [from_wire(g, dtype)], RuleOptions(lr=0.1, momentum=0.9), v_ref)
    _native.momentum(w.ctypes.data, v.ctypes.data, g.ctypes.data, dtype=DTYPE_CODES[dtype], n=n, lr=0.1, mu=0.9,
                     clear=1, threads=threads)
    np.testing.assert_array_equal(w, w_ref)
    np.testing.assert_array_equal(v, v_ref)
    assert not bits(g).any()
    # no gradient (a row-sparse table's untouched rows): v decays, w follows
    async_reference(w_ref, [np.zeros(n, np.float32)], RuleOptions(lr=0.1, momentum=0.9), v_ref)
    _native.momentum(w.ctypes.data, v.ctypes.data, 0, dtype=DTYPE_CODES[dtype], n=n, lr=0.1, mu=0.9, clear=0,
                     threads=threads)
    np.testing.assert_array_equal(w, w_ref)
    np.testing.assert_array_equal(v, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", [1, 33, 4099, 131075])
def test_adagrad_kernel_matches_reference(n, threads, dtype):
    w, g32 = weights_and_gradient(n, n + 2)
    s = np.abs(np.random.default_rng(n).standard_normal(n)).astype(np.float32)
    s[: n // 3] = 0.0  # a weight's first step: lr * g / |g|
    g = to_wire(g32, dtype)
    w_ref, s_ref = w.copy(), s.copy()
    for _ in range(2):  # the second step sees the first one's sums
        async_reference(w_ref, [from_wire(g, dtype)], RuleOptions(lr=0.1, optimizer="adagrad"), s_ref)
        _native.adagrad(w.ctypes.data, s.ctypes.data, g.ctypes.data, dtype=DTYPE_CODES[dtype], n=n, lr=0.1,
                        eps=ADAGRAD_EPS, clear=0, threads=threads)
        np.testing.assert_array_equal(w, w_ref)
        np.testing.assert_array_equal(s, s_ref)
    _native.adagrad(w.ctypes.data, s.ctypes.data, g.ctypes.data, dtype=DTYPE_CODES[dtype], n=n, lr=0.1, eps=ADAGRAD_EPS,
                    clear=1, threads=threads)
    assert not bits(g).any()  # clear: the slot is zero again
    zero_g = from_wire(to_wire(g32, dtype), dtype) == 0
    first = s_ref == 0
    assert np.all(s[zero_g & first] == 0)  # a zero gradient leaves its weight's sum alone


def test_adagrad_rows_update_only_the_rows_a_gradient_carries():
    rows_n, width, lr = 20, 9, 0.5
    rng = np.random.default_rng(3)
    table = rng.standard_normal((rows_n, width)).astype(np.float32)
    sums = np.zeros((rows_n, width), np.float32)
    indices = np.array([4, 11, 4, -1], dtype=np.int64)  # row 4 twice, one index out of the table
    rows = rng.standard_normal((4, width)).astype(np.float32)
    t_ref, s_ref = table.copy(), sums.copy()
    for i, row in zip(indices[:3], rows[:3]):
        s_ref[i] += row * row
        t_ref[i] -= np.float32(lr) * row / (np.sqrt(s_ref[i]) + np.float32(ADAGRAD_EPS))
    bad = _native.adagrad_rows(table.ctypes.data, sums.ctypes.data, n_rows=rows_n, width=width, idx=indices.ctypes.data,
                               rows=rows.ctypes.data, dtype=DTYPE_CODES["float32"], count=4, lr=lr, eps=ADAGRAD_EPS)
    assert bad == 1
    np.testing.assert_array_equal(table, t_ref)
    np.testing.assert_array_equal(sums, s_ref)
    assert np.count_nonzero(sums.any(axis=1)) == 2


def adam(w, m, v, g, lr, step, threads, dtype, clear=0):
    _native.adam(w.ctypes.data, m.ctypes.data, v.ctypes.data, g.ctypes.data, dtype=DTYPE_CODES[dtype], n=len(w), lr=lr,
                 beta1=ADAM_BETA1, beta2=ADAM_BETA2, eps=ADAM_EPS, step=step, clear=clear, threads=threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", [1, 15, 33, 4099, 131075])
def test_adam_kernel_matches_reference(n, threads, dtype):
    w, g32 = weights_and_gradient(n, n + 3)
    rng = np.random.default_rng(n)
    m = rng.standard_normal(n).astype(np.float32) * np.float32(0.01)
    v = np.abs(rng.standard_normal(n)).astype(np.float32) * np.float32(1e-4)
    m[: n // 3], v[: n // 3] = 0.0, 0.0  # a weight's first step
    g = to_wire(g32, dtype)
    w_ref, m_ref, v_ref = w.copy(), m.copy(), v.copy()
    for step in (1, 2, 7001):  # the bias correction at the first steps and after it faded
        with np.errstate(invalid="ignore"):
            adam_reference(w_ref, m_ref, v_ref, from_wire(g, dtype), 0.01, step)
        adam(w, m, v, g, 0.01, step, threads, dtype)
        np.testing.assert_array_equal(bits(w), bits(w_ref))
        np.testing.assert_array_equal(bits(m), bits(m_ref))
        np.testing.assert_array_equal(bits(v), bits(v_ref))
    zero = from_wire(g, dtype) == 0
    assert np.all(m[zero & (np.arange(n) >= n // 3)] != 0)  # a zero gradient decays m, it does not skip it
    adam(w, m, v, g, 0.01, 7002, threads, dtype, clear=1)
    assert not bits(g).any()  # clear: the slot is zero again


@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_kernel_follows_torch_adam(dtype):
    """Eight steps of the kernel (t = 1..8) against torch.optim.Adam's on the same gradients."""
    n, lr = 4099, 0.001
    rng = np.random.default_rng(17)
    w = rng.standard_normal(n).astype(np.float32)
    start = w.copy()
    param = torch.nn.Parameter(torch.from_numpy(w.copy()))
    adam_torch = torch.optim.Adam([param], lr=lr, betas=(ADAM_BETA1, ADAM_BETA2), eps=ADAM_EPS, foreach=False)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for step in range(1, 9):
        g32 = rng.standard_normal(n).astype(np.float32) * np.float32(10.0 ** rng.integers(-4, 2))
        g32[rng.choice(n, n // 10, replace=False)] = 0.0
        g = to_wire(g32, dtype)
        param.grad = torch.from_numpy(from_wire(g, dtype).copy())
        adam_torch.step()
        adam(w, m, v, g, lr, step, 2, dtype)
        state = adam_torch.state[param]
        for ours, theirs in ((m, state["exp_avg"]), (v, state["exp_avg_sq"])):  # torch's m is a lerp: rounds apart
            np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-5, atol=1e-6 * float(theirs.abs().max()))
        # each step moves a weight by about lr: agreeing to a thousandth of that (atol 1e-3 lr) is
        # one implementation; a wrong bias correction or eps is off by a percent. A CI run saw 36
        # of 4,099 weights 1.7-3e-7 apart after some step (not reproduced in 10 runs since).
        np.testing.assert_allclose(w, param.detach().numpy(), rtol=1e-6, atol=1e-3 * lr)
    assert np.abs(w - start).max() > 4 * lr  # eight steps of about lr each moved the weights


@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_rows_is_lazy_adam_as_torch_sparse_adam(dtype):
    """Only the rows a gradient carries move (their moments too); the rest keep their weights
    and moments, as torch.optim.SparseAdam; out-of-range indices are counted and skipped.
    SparseAdam adds eps before the bias correction of v (Adam after it), so the comparison
    with it runs a second table with eps 1e-30 (SparseAdam refuses 0), where the two agree to rounding."""
    rows_n, width, lr = 30, 19, 0.01
    rng = np.random.default_rng(23)
    table = rng.standard_normal((rows_n, width)).astype(np.float32)
    m, v = np.zeros_like(table), np.zeros_like(table)
    plain, m0, v0 = table.copy(), m.copy(), v.copy()  # the same rows with eps 1e-30
    param = torch.nn.Parameter(torch.from_numpy(table.copy()))
    sparse_adam = torch.optim.SparseAdam([param], lr=lr, betas=(ADAM_BETA1, ADAM_BETA2), eps=1e-30)
    t_ref, m_ref, v_ref = table.copy(), m.copy(), v.copy()
    ever = set()
    for step, chosen in enumerate(([4, 11, 2], [11, 29, 0, 5], [4], [7, 11]), start=1):
        indices = np.array(chosen + [-1, rows_n], dtype=np.int64)  # two indices outside the table
        rows = to_wire(rng.standard_normal((len(indices), width)).astype(np.float32), dtype)
        before = table.copy()
        bad = _native.adam_rows(table.ctypes.data, m.ctypes.data, v.ctypes.data, n_rows=rows_n, width=width,
                                idx=indices.ctypes.data, rows=rows.ctypes.data, dtype=DTYPE_CODES[dtype],
                                count=len(indices), lr=lr, beta1=ADAM_BETA1, beta2=ADAM_BETA2, eps=ADAM_EPS, step=step)
        assert bad == 2
        exact = from_wire(rows, dtype)[: len(chosen)]
        adam_rows_reference(t_ref, m_ref, v_ref, indices[: len(chosen)], exact, lr, step)
        np.testing.assert_array_equal(table, t_ref)
        np.testing.assert_array_equal(m, m_ref)
        np.testing.assert_array_equal(v, v_ref)
        _native.adam_rows(plain.ctypes.data, m0.ctypes.data, v0.ctypes.data, n_rows=rows_n, width=width,
                          idx=indices.ctypes.data, rows=rows.ctypes.data, dtype=DTYPE_CODES[dtype], count=len(indices),
                          lr=lr, beta1=ADAM_BETA1, beta2=ADAM_BETA2, eps=1e-30, step=step)
        param.grad = torch.sparse_coo_tensor(torch.tensor([chosen]), torch.from_numpy(exact.copy()), (rows_n, width),
                                             check_invariants=True)
        sparse_adam.step()
        np.testing.assert_allclose(plain, param.detach().numpy(), rtol=1e-6, atol=1e-7)
        ever |= set(chosen)
        untouched = [i for i in range(rows_n) if i not in chosen]
        np.testing.assert_array_equal(table[untouched], before[untouched])
        assert not m[[i for i in range(rows_n) if i not in ever]].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_row_kernel_adds_repeated_rows_and_skips_bad_indices(dtype, with_state):
    rows_n, width = 50, 37
    rng = np.random.default_rng(5)
    table = rng.standard_normal((rows_n, width)).astype(np.float32)
    state = rng.standard_normal((rows_n, width)).astype(np.float32) if with_state else None
    indices = np.array([3, 7, 3, 49, 0, 3, 7], dtype=np.int64)  # 3 three times, 7 twice
    rows = to_wire(rng.standard_normal((len(indices), width)).astype(np.float32), dtype)
    t_ref = table.copy()
    s_ref = state.copy() if with_state else None
    rows_reference(t_ref, indices, from_wire(rows, dtype), 0.2, s_ref)
    bad = _native.sgd_rows(table.ctypes.data, state.ctypes.data if with_state else 0, n_rows=rows_n, width=width,
                           idx=indices.ctypes.data, rows=rows.ctypes.data, dtype=DTYPE_CODES[dtype], count=len(indices),
                           lr=0.2)
    assert bad == 0
    np.testing.assert_array_equal(table, t_ref)
    if with_state:
        np.testing.assert_array_equal(state, s_ref)
    untouched = [i for i in range(rows_n) if i not in indices]
    np.testing.assert_array_equal(table[untouched], t_ref[untouched])
    before = table.copy()
    wild = np.array([-1, 50, 10**12], dtype=np.int64)
    assert _native.sgd_rows(table.ctypes.data, 0, n_rows=rows_n, width=width, idx=wild.ctypes.data,
                            rows=rows.ctypes.data, dtype=DTYPE_CODES[dtype], count=3, lr=0.2) == 3
    np.testing.assert_array_equal(table, before)  # nothing written outside the table


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("n", [5, 65537 + 3])
def test_elastic_kernel_matches_reference(n, threads):
    rng = np.random.default_rng(n)
    centre = rng.standard_normal(n).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    expected = centre.copy()
    elastic_reference(expected, [w], RuleOptions(alpha=0.3))
    _native.elastic(centre.ctypes.data, w.ctypes.data, n=n, alpha=0.3, threads=threads)
    np.testing.assert_array_equal(centre, expected)


def test_the_float32_face_of_the_sync_adam_and_elastic_rules_is_their_kernels_on_checked_arguments():
    """`Float32Dense.adam_rows` (the sync round's Adam on a table's touched rows) is lazy Adam on
    a table of n floats, its rows as wide as the gradient rows, an index outside the table
    counted and nothing written past the table; `elastic` moves the centre towards the
    weights. Indices or rows of another type, shape or layout are refused before the kernel."""
    rows_n, width, lr = 12, 5, 0.01
    rng = np.random.default_rng(41)
    weights = rng.standard_normal(2 * rows_n * width).astype(np.float32)  # the table, then what follows it
    m, v = np.zeros_like(weights), np.zeros_like(weights)
    t_ref, m_ref, v_ref = (a[: rows_n * width].reshape(rows_n, width).copy() for a in (weights, m, v))
    after = weights[rows_n * width:].copy()
    table = Float32Dense(rows_n * width, 1)
    for step, chosen in enumerate(([3, 0, 11], [7, 3]), start=1):
        indices = np.array(chosen + [rows_n], dtype=np.int64)  # the last one is outside the table
        rows = rng.standard_normal((len(indices), width)).astype(np.float32)
        bad = table.adam_rows(weights.ctypes.data, m.ctypes.data, v.ctypes.data, indices, rows, lr, step,
                              (ADAM_BETA1, ADAM_BETA2, ADAM_EPS))
        assert bad == 1
        adam_rows_reference(t_ref, m_ref, v_ref, indices[:-1], rows[:-1], lr, step)
        np.testing.assert_array_equal(weights[: rows_n * width].reshape(rows_n, width), t_ref)
        np.testing.assert_array_equal(m[: rows_n * width].reshape(rows_n, width), m_ref)
        np.testing.assert_array_equal(v[: rows_n * width].reshape(rows_n, width), v_ref)
        np.testing.assert_array_equal(weights[rows_n * width:], after)
        assert not m[rows_n * width:].any() and not v[rows_n * width:].any()
    indices, rows = np.array([1, 2], dtype=np.int64), np.ones((2, width), dtype=np.float32)
    for wrong in ((indices.astype(np.int32), rows), (indices, rows.astype(np.float64)), (indices, rows[:1]),
                  (indices, np.ones((2, 2 * width), dtype=np.float32)[:, ::2]), (indices, np.ones((2, 7), np.float32))):
        with pytest.raises(ValueError, match="adam_rows: 2 int64 indices and as many contiguous float32 rows"):
            table.adam_rows(weights.ctypes.data, m.ctypes.data, v.ctypes.data, *wrong, lr, 1, (0.9, 0.999, 1e-8))

    centre = rng.standard_normal(1000).astype(np.float32)
    w = rng.standard_normal(1000).astype(np.float32)
    expected, pushed = centre.copy(), w.copy()
    elastic_reference(expected, [w], RuleOptions(alpha=0.3))
    Float32Dense(1000, 2).elastic(centre.ctypes.data, w.ctypes.data, 0.3)
    np.testing.assert_array_equal(centre, expected)
    np.testing.assert_array_equal(w, pushed)  # the learner's weights are left as they are

def test_sync_reference_is_sgd_on_the_mean():
    rng = np.random.default_rng(0)
    w = rng.standard_normal(100).astype(np.float32)
    grads = [rng.standard_normal(100).astype(np.float32) for _ in range(3)]
    expected = w - np.float32(0.1) * ((grads[0] + grads[1] + grads[2]) / np.float32(3))
    sync_reference(w, grads, RuleOptions(lr=0.1))
    np.testing.assert_allclose(w, expected, rtol=1e-6)


def test_staleness_aware_learning_rate_reference():
    w = np.zeros(4, dtype=np.float32)
    async_reference(w, [np.ones(4, np.float32)] * 3, RuleOptions(lr=1.0, stale_lr=True), staleness=[0, 1, 4])
    np.testing.assert_array_equal(w, np.full(4, -(1 + 1 + 0.25), dtype=np.float32))


@pytest.mark.parametrize("n", [1, 1000, 65537])
def test_plain_reference_loop_matches(n):
    rng = np.random.default_rng(11)
    w, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    expected = w - np.float32(0.1) * g
    _native.plain_sgd(w.ctypes.data, g.ctypes.data, n=n, lr=0.1, threads=2)
    np.testing.assert_array_equal(w, expected)


def gradient_with_nonfinite(n: int, dtype: str, seed: int) -> np.ndarray:
    """A wire gradient with NaN, +inf and -inf (and large finite values next to them) at random places."""
    rng = np.random.default_rng(seed)
    g32 = rng.standard_normal(n).astype(np.float32) * 1e3
    g32[rng.choice(n, size=max(1, n // 3000), replace=False)] = 6e4  # finite in every dtype
    for value in (np.nan, np.inf, -np.inf):
        g32[rng.choice(n, size=max(1, n // 1000), replace=False)] = value
    g = to_wire(g32, dtype)
    if dtype == "float32" and n > 3:
        g[n // 2] = np.frombuffer(np.uint32(0xFF800001).tobytes(), np.float32)[0]  # a NaN with the sign bit set
    return g


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_check_matches_reference_and_writes_nothing(n, threads, dtype):
    g = gradient_with_nonfinite(n, dtype, n + threads)
    before = g.copy()
    expected = nonfinite_reference(g)
    assert expected > 0
    assert _native.nonfinite(g.ctypes.data, dtype=DTYPE_CODES[dtype], n=n, threads=threads) == expected
    assert (bits(g) == bits(before)).all()
    finite = to_wire(np.full(n, 65504.0, np.float32), dtype)  # the largest float16: finite everywhere
    assert _native.nonfinite(finite.ctypes.data, dtype=DTYPE_CODES[dtype], n=n, threads=threads) == 0


def test_portable_kernels_without_avx2_match_reference():
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import numpy as np\n"
        "from gadei import _native\n"
        "from gadei.layout import DTYPE_CODES\n"
        "from gadei.modes import RuleOptions\n"
        "from oracles import async_reference, adam_reference, nonfinite_reference\n"
        "from test_kernels import weights_and_gradient, to_wire, from_wire, bits, gradient_with_nonfinite, adam\n"
        "assert _native.kernel_isa() == 'generic', _native.kernel_isa()\n"
        "for dtype in ('float32', 'float16', 'bfloat16'):\n"
        "    for n in (1, 17, 4099, 200003):\n"
        "        w, g32 = weights_and_gradient(n, n); g = to_wire(g32, dtype); wr = w.copy()\n"
        "        with np.errstate(invalid='ignore'): async_reference(wr, [from_wire(g, dtype)], RuleOptions(lr=0.3))\n"
        "        _native.sgd(w.ctypes.data, g.ctypes.data, dtype=DTYPE_CODES[dtype], n=n, lr=0.3, clear=1, threads=2)\n"
        "        assert (bits(w) == bits(wr)).all() and not bits(g).any(), (dtype, n)\n"
        "        g = gradient_with_nonfinite(n, dtype, n)\n"
        "        assert _native.nonfinite(g.ctypes.data, dtype=DTYPE_CODES[dtype], n=n, threads=2) "
        "== nonfinite_reference(g), (dtype, n)\n"
        "        w, g32 = weights_and_gradient(n, n); g = to_wire(g32, dtype); wr = w.copy()\n"
        "        m = np.full(n, 0.01, np.float32); v = np.full(n, 1e-4, np.float32); mr = m.copy(); vr = v.copy()\n"
        "        with np.errstate(invalid='ignore'): adam_reference(wr, mr, vr, from_wire(g, dtype), 0.01, 3)\n"
        "        adam(w, m, v, g, 0.01, 3, 2, dtype)\n"
        "        assert (bits(w) == bits(wr)).all() and (bits(m) == bits(mr)).all() "
        "and (bits(v) == bits(vr)).all(), (dtype, n)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True, text=True,
                          env={**os.environ, "GADEI_NO_AVX2": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_kernels_use_avx2_where_the_cpu_has_it():
    with open("/proc/cpuinfo") as cpuinfo:
        flags = cpuinfo.read()
    assert _native.kernel_isa() == ("avx2" if " avx2" in flags and " f16c" in flags else "generic")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("threads", [2, 3, 7])
def test_dense_kernels_split_over_a_team_equal_their_references(threads, dtype):
    """A kernel forms a team only from 2 x 262,144 elements (GD_THREAD_MIN): the lengths above stop
    at 131,075 for momentum, Adagrad and Adam, so their threaded path is checked here, on a length
    that makes teams of 2, 3 and 7 with a ragged last chunk, a half-size gradient offset per chunk
    included; each equals its reference bit for bit."""
    n = 7 * 262144 + 13
    w0, g32 = weights_and_gradient(n, threads)
    w0[~np.isfinite(w0)] = 1.0
    g0 = to_wire(g32, dtype)
    rng = np.random.default_rng(threads)
    state = np.abs(rng.standard_normal(n)).astype(np.float32) * np.float32(1e-3)
    f, code = from_wire(g0, dtype), DTYPE_CODES[dtype]

    w, g, w_ref = w0.copy(), g0.copy(), w0.copy()
    async_reference(w_ref, [f], RuleOptions(lr=0.3))
    _native.sgd(w.ctypes.data, g.ctypes.data, dtype=code, n=n, lr=0.3, clear=1, threads=threads)
    np.testing.assert_array_equal(bits(w), bits(w_ref))
    assert not bits(g).any()

    w, v, w_ref, v_ref = w0.copy(), state.copy(), w0.copy(), state.copy()
    async_reference(w_ref, [f], RuleOptions(lr=0.1, momentum=0.9), v_ref)
    _native.momentum(w.ctypes.data, v.ctypes.data, g0.ctypes.data, dtype=code, n=n, lr=0.1, mu=0.9, clear=0,
                     threads=threads)
    np.testing.assert_array_equal(bits(w), bits(w_ref))
    np.testing.assert_array_equal(bits(v), bits(v_ref))

    w, s, w_ref, s_ref = w0.copy(), state.copy(), w0.copy(), state.copy()
    async_reference(w_ref, [f], RuleOptions(lr=0.1, optimizer="adagrad"), s_ref)
    _native.adagrad(w.ctypes.data, s.ctypes.data, g0.ctypes.data, dtype=code, n=n, lr=0.1, eps=ADAGRAD_EPS, clear=0,
                    threads=threads)
    np.testing.assert_array_equal(bits(w), bits(w_ref))
    np.testing.assert_array_equal(bits(s), bits(s_ref))

    w, m, v, w_ref, m_ref, v_ref = w0.copy(), state * 10, state.copy(), w0.copy(), state * 10, state.copy()
    adam_reference(w_ref, m_ref, v_ref, f, 0.01, 3)
    adam(w, m, v, g0, 0.01, 3, threads, dtype)
    for got, want in ((w, w_ref), (m, m_ref), (v, v_ref)):
        np.testing.assert_array_equal(bits(got), bits(want))

    bad = gradient_with_nonfinite(n, dtype, threads)
    assert _native.nonfinite(bad.ctypes.data, dtype=code, n=n, threads=threads) == nonfinite_reference(bad)

    centre, expected = w0.copy(), w0.copy()
    elastic_reference(expected, [state], RuleOptions(alpha=0.3))
    _native.elastic(centre.ctypes.data, state.ctypes.data, n=n, alpha=0.3, threads=threads)
    np.testing.assert_array_equal(bits(centre), bits(expected))
