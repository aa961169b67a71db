"""Learners killed at random points never stall the server or the others; half-written slots are never applied.

A steady learner pushes 1.0 into every element for the whole test. Victims attach one
after another, write 2.0 into their slot slowly (64 chunks with a pause between them) and
are SIGKILLed after a random delay: before, during or after writing a slot. Once the
capacity is used up, later victims take over the rings of dead ones. At the end the
weights must be uniform (a half-applied slot would leave a step in them) and equal to the
initial weights minus lr times the sum of what was published, and every published
gradient must have been applied.
"""

import random
import signal
import time

import pytest

from helpers import finish, read_line, wait_for
from gadei.region import Region

pytestmark = pytest.mark.faults  # also run on a loaded machine: `--busy 2 -m faults` (docs/testing.md)

N = 200_003
LR = 0.125
VICTIMS = 6


def _heads(job):
    with Region.attach(job, readonly=True) as region:
        return [region.entry(i).get("head") for i in range(region.shape.capacity)]


def test_killed_learners_never_stall_the_job_and_half_written_slots_are_never_applied(job, procs):
    rng = random.Random(20261122)
    server = procs.worker("serve", job, "--n", N, "--lr", LR, "--learners", 3)
    read_line(server, 60)
    steady = procs.worker("push", job, "--n", N, "--value", 1, "--steps", 10**9, "--slow")
    read_line(steady, 60)
    steady_ring = read_line(steady, 60)["attached"]
    for round_ in range(VICTIMS):
        victim = procs.worker("push", job, "--n", N, "--value", 2, "--steps", 10**9, "--slow")
        read_line(victim, 60)
        ring = read_line(victim, 60)["attached"]
        assert ring != steady_ring
        before = _heads(job)[ring]
        # a step of a slow victim takes ~15-30 ms; kill it somewhere in its first few steps
        wait_for(lambda: _heads(job)[ring] > before or victim.poll() is not None, 30, "the victim's first push")
        deadline_steps = rng.randint(0, 3)
        wait_for(lambda: _heads(job)[ring] >= before + 1 + deadline_steps, 30, "the victim's pushes")
        victim_delay = rng.uniform(0.0, 0.03)
        wait_for(_clock_passed(victim_delay), 1, "a random moment")
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        # the server and the steady learner go on
        seen = _heads(job)[steady_ring]
        wait_for(lambda: _heads(job)[steady_ring] >= seen + 3, 30, f"the steady learner to go on after kill {round_}")

    server.send_signal(signal.SIGTERM)
    report = read_line(server, 60)
    finish(server)
    summary = read_line(steady, 60)
    finish(steady)
    heads = report["heads"]
    assert heads == report["tails"], "a published gradient was not applied"
    assert report["applied"] == report["version"] == sum(heads)
    assert summary["pushed"] == heads[steady_ring]
    victim_pushes = sum(heads) - heads[steady_ring]
    expected = 1.0 - LR * (1.0 * heads[steady_ring] + 2.0 * victim_pushes)
    assert report["wmin"] == report["wmax"], "weights are not uniform: a half-written slot was applied"
    assert report["wmin"] == expected


def _clock_passed(seconds):
    end = time.monotonic() + seconds
    return lambda: time.monotonic() >= end
