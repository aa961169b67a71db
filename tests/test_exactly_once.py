"""Exactly once, with real processes: every published gradient is applied once, none twice, none lost.

Learners push gradients of known values (small integers, learning rate a power of two, so
every partial sum is exact in float32, float16 and bfloat16); the final weights must equal
the initial weights minus lr times the sum of everything pushed, to the bit, and the
counters must agree. The same contract runs against every push and pull transport, ring
size and gradient transport (float32, float16, bfloat16, row-sparse tables with a row named
twice in one gradient, and a sparse gradient sent into a dense float16 slot).
"""

import signal

import numpy as np
import pytest

from helpers import finish, read_line
from worker import MODELS, TABLE_ROWS, TABLE_WIDTH, TOUCHED

N = 100_003  # not a multiple of any vector width
LR = 0.125
STEPS = 300
VALUES = (1.0, 2.0, 3.0)


def expected_weights(model: str, total: float = STEPS * sum(VALUES)) -> np.ndarray:
    """Initial weights 1, minus lr times `total` (the sum of one element over every gradient
    pushed), in the region's parameter order; a table's touched rows only (row 0 twice per
    gradient)."""
    parts = []
    for p in MODELS[model](N, 1.0).parameters():
        part = np.full(tuple(p.shape), 1.0 - LR * total, dtype=np.float32)
        if p.dim() == 2:  # the table: only the rows a gradient names move, row 0 twice
            part[:] = 1.0
            for row in TOUCHED:
                part[row] -= LR * total
        parts.append(part.ravel())
    return np.concatenate(parts)


def push_known_gradients(job, procs, tmp_path, *, values=VALUES, pull="copy", push="publish", slots=2,
                         grad_dtype="float32", model="flat", row_sparse=False, mode="async", devices=None,
                         vary=False, jitter=None, deadline=120) -> None:
    """The exactly-once contract: one learner per entry of `values` pushes STEPS gradients of
    that value (`vary`: V, 2V, 3V, V, ... so that a gradient overwritten by the next one while
    it is copied changes the sums) through the `pull` and `push` transports (on `devices[i]`
    for the device ones, with random delays seeded by `jitter`); the final weights must equal
    the initial ones minus lr times everything pushed, to the bit, and the counters agree."""
    dump = tmp_path / "weights.npy"
    server = procs.worker("serve", job, "--model", model, "--n", N, "--lr", LR, "--learners", len(values),
                          "--slots", slots, "--grad-dtype", grad_dtype, "--mode", mode,
                          *(["--row-sparse"] if row_sparse else []), "--dump", dump)
    read_line(server, 60)
    learners = [
        procs.worker("push", job, "--model", model, "--n", N, "--value", v, "--steps", STEPS, "--pull", pull,
                     "--push", push, *(["--device", devices[i]] if devices else []), *(["--vary"] if vary else []),
                     *(["--jitter", jitter * 100 + i] if jitter is not None else []))
        for i, v in enumerate(values)
    ]
    for learner in learners:
        read_line(learner, 60)  # attaching
        read_line(learner, 60)  # attached
    done = [read_line(l, deadline) for l in learners]
    for learner in learners:
        finish(learner)
    assert [d["pushed"] for d in done] == [STEPS] * len(values)

    server.send_signal(signal.SIGTERM)
    report = read_line(server, 60)
    finish(server)
    expected = expected_weights(model, sum(v * ((1 + k % 3) if vary else 1) for v in values for k in range(STEPS)))
    np.testing.assert_array_equal(np.load(dump), expected)
    assert report["applied"] == report["version"] == STEPS * len(values)
    # a learner that finished early leaves its ring to the next one: count over all rings
    assert report["heads"] == report["tails"]
    assert sum(report["heads"]) == STEPS * len(values)
    itemsize = 4 if grad_dtype == "float32" else 2
    dense = N - TABLE_ROWS * TABLE_WIDTH if row_sparse else N
    per_gradient = dense * itemsize + (len(set(TOUCHED)) * (8 + TABLE_WIDTH * itemsize) if row_sparse else 0)
    assert report["applied_bytes"] == per_gradient * STEPS * len(values)
    final = float(expected[-TABLE_ROWS * TABLE_WIDTH if model == "table" else -1])  # the last parameter's first
    # each learner left with the weights of the version it last saw in its model: the last to
    # leave saw every gradient applied, so it holds exactly the final weights
    assert max(d["version"] for d in done) == report["version"]
    assert all(d["weight0"] == final for d in done if d["version"] == report["version"])


@pytest.mark.parametrize(
    "pull, push, slots, grad_dtype, model, row_sparse",
    [
        ("copy", "publish", 2, "float32", "flat", False),
        ("view", "publish", 2, "float32", "flat", False),
        ("copy", "thread", 2, "float32", "flat", False),
        ("view", "thread", 2, "float32", "flat", False),
        ("copy", "publish", 1, "float32", "flat", False),
        ("copy", "publish", 4, "float32", "flat", False),
        ("view", "publish", 2, "float16", "flat", False),
        ("view", "thread", 2, "bfloat16", "flat", False),
        ("view", "publish", 2, "float32", "table", True),
        ("copy", "thread", 2, "bfloat16", "table", True),
        ("view", "publish", 2, "float16", "table", False),
    ],
)
def test_every_gradient_is_applied_exactly_once(job, procs, tmp_path, pull, push, slots, grad_dtype, model,
                                                row_sparse):
    push_known_gradients(job, procs, tmp_path, pull=pull, push=push, slots=slots, grad_dtype=grad_dtype, model=model,
                         row_sparse=row_sparse)
