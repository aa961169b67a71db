"""Exactly once, with real processes: every published gradient is applied once, none twice, none lost.

Learners push gradients of known values (small integers, learning rate a power of two, so
every partial sum is exact in float32); the final weights must equal the initial weights
minus lr times the sum of everything pushed, to the bit, and the counters must agree.
The same contract runs against every push and pull transport.
"""

import signal

import pytest

from conftest import finish, read_line

N = 100_003  # not a multiple of any vector width
LR = 0.125
STEPS = 300
VALUES = (1.0, 2.0, 3.0)


@pytest.mark.parametrize(
    "pull, push, slots",
    [("copy", "publish", 2), ("view", "publish", 2), ("copy", "thread", 2), ("view", "thread", 2),
     ("copy", "publish", 1), ("copy", "publish", 4)],
)
def test_every_gradient_is_applied_exactly_once(job, procs, pull, push, slots):
    server = procs.worker("serve", job, "--n", N, "--lr", LR, "--learners", len(VALUES), "--slots", slots)
    read_line(server, 60)
    learners = [
        procs.worker("push", job, "--n", N, "--value", v, "--steps", STEPS, "--pull", pull, "--push", push)
        for v in VALUES
    ]
    for learner in learners:
        read_line(learner, 60)  # attaching
        read_line(learner, 60)  # attached
    done = [read_line(l, 120) for l in learners]
    for learner in learners:
        finish(learner)
    assert [d["pushed"] for d in done] == [STEPS] * len(VALUES)

    server.send_signal(signal.SIGTERM)
    report = read_line(server, 60)
    finish(server)
    expected = 1.0 - LR * STEPS * sum(VALUES)  # exact in float32
    assert report["wmin"] == report["wmax"] == expected
    assert report["applied"] == report["version"] == STEPS * len(VALUES)
    # a learner that finished early leaves its ring to the next one: count over all rings
    assert report["heads"] == report["tails"]
    assert sum(report["heads"]) == STEPS * len(VALUES)
    # each learner ended with the final weights in its model
    assert all(d["weight0"] == expected or d["version"] < report["version"] for d in done)
