"""The region is untrusted input: a server whose region is tampered with stops the job with a
clear error (or skips and counts a non-finite gradient), never loops, crashes or restarts
from garbage, and `gadei stop` can always end it.

Each test runs `gadei serve` as a real process, tampers with its region through the region
and layout modules (as a buggy or hostile process of the same user could), and asserts what
the server does within a deadline: the error names the field, the value and what is allowed.
"""

import json
import math
import os
import signal
import time

import numpy as np
import posix_ipc
import pytest
import torch

from helpers import blobs_job, communicate, end_jobs, finish, job_version, tiered, unique_name, wait_for
from gadei import JobFailed, Learner, checkpoint
from gadei.layout import MAGIC
from gadei.region import Region, inspect, shm_name
from gadei.transport.slot import dense_area

N = 4096  # parameters of the served job
SLOTS = 2
DEADLINE = 10.0  # seconds a clear stop may take (it takes milliseconds; the machine is shared)


def _serve(procs, job, *extra):
    server = procs.gadei("serve", job, "--params", str(N), "--learners", "2", "--slots", str(SLOTS),
                         "--threads", "1", *extra)
    wait_for(lambda: (found := inspect(job)) is not None and found.state == "running", 60, "the server's region")
    return server


def _push(region, learner=0, value=1.0, samples=1, version=None, kind=0):
    """Publish one gradient of `value` into `learner`'s ring, as a learner would (no claim needed)."""
    entry = region.entry(learner)
    head = entry.get("head")
    slot = head % region.shape.slots
    dense_area(region, learner, slot)[:] = 1.0
    dense_area(region, learner, slot)[7] = value
    header = region.slot_header(learner, slot)
    header.set("version", region.header.get("version") if version is None else version)
    header.set("step", head)
    header.set("samples", samples)
    header.set("kind", kind)
    entry.set("head", head + 1)
    _ring(region)


def _ring(region):
    from gadei import _native

    _native.add32(region.header.addr("doorbell"), 1)
    _native.futex_wake(region.header.addr("doorbell"), 1)


def _applied(region, learner=0):
    entry = region.entry(learner)
    return entry.get("tail") == entry.get("head")


def _stops_with(server, *phrases):
    """The server exits within DEADLINE, not 0, and its error says every phrase; the seconds it took."""
    began = time.monotonic()
    _, err = communicate(server, DEADLINE)
    took = time.monotonic() - began
    assert server.returncode not in (0, None), f"server exited {server.returncode}:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    for phrase in phrases:
        assert phrase in err, f"{phrase!r} not in the server's error:\n{err[-3000:]}"
    print(f"clear stop in {took:.2f} s: {[line for line in err.splitlines() if 'error' in line][-1:]}")
    return took, err


def _nothing_left(procs, job):
    """No region and no server remain; `gadei stop` has nothing to stop and says so."""
    assert inspect(job) is None
    stop = procs.gadei("stop", job)
    _, err = communicate(stop, 60)
    assert stop.returncode == 2 and "nothing to stop" in err, err


# ------------------------------------------------------------------ rings


def test_tail_far_ahead_of_head_stops_the_job(job, procs):
    server = _serve(procs, job)
    with Region.attach(job) as region:
        _push(region)
        wait_for(lambda: _applied(region), 10, "the first gradient to be applied")
        region.entry(1).set("tail", 1000)  # head 0: the ring would hold -1000 gradients
        _ring(region)
    _stops_with(server, "learner ring 1", "head - tail = -1,000", "allowed 0..2")
    _nothing_left(procs, job)


@pytest.mark.long  # a server each: the default tier keeps one corrupt counter, magic and version
def test_head_far_ahead_of_tail_stops_the_job(job, procs):
    server = _serve(procs, job)
    with Region.attach(job) as region:
        region.entry(0).set("head", 1000)  # 1,000 "published" slots in a ring of 2
        _ring(region)
    _stops_with(server, "learner ring 0", "head - tail = 1,000", "allowed 0..2")
    _nothing_left(procs, job)


def test_head_behind_tail_by_one_stops_the_job(job, procs):
    server = _serve(procs, job)
    with Region.attach(job) as region:
        for _ in range(3):
            _push(region)
            wait_for(lambda: _applied(region), 10, "a gradient to be applied")
        region.entry(0).set("head", 2)  # tail 3: head went back
        _ring(region)
    _stops_with(server, "learner ring 0", "head - tail = -1", "allowed 0..2")
    _nothing_left(procs, job)


# ------------------------------------------------------------------ slot and header counters


@pytest.mark.long  # a server each: the default tier keeps one corrupt counter, magic and version
def test_huge_samples_in_a_slot_stops_the_job(job, procs):
    server = _serve(procs, job)
    with Region.attach(job) as region:
        _push(region, samples=2**63 + 5)
    _stops_with(server, "learner ring 0", "samples", f"{2**63 + 5:,}", "allowed")
    _nothing_left(procs, job)


def test_version_near_two_to_the_64_stops_the_job(job, procs):
    server = _serve(procs, job)
    with Region.attach(job) as region:
        _push(region)
        wait_for(lambda: _applied(region), 10, "the first gradient to be applied")
        region.header.set("version", 2**64 - 3)
        _push(region, version=5)
    _stops_with(server, "version", f"{2**64 - 3:,}", "expected 1")
    _nothing_left(procs, job)


@pytest.mark.long  # a server each: the default tier keeps one corrupt counter, magic and version
def test_hold_other_than_0_or_1_stops_the_job(job, procs):
    server = _serve(procs, job)
    with Region.attach(job) as region:
        region.header.set("hold", 7)
        _push(region)
    took, _ = _stops_with(server, "hold", "7", "allowed 0..1")
    assert took < 2.0, "the server waited out a checkpoint hold first"
    _nothing_left(procs, job)


def test_corrupted_magic_stops_the_job(job, procs):
    server = _serve(procs, job)
    with Region.attach(job) as region:
        region.header.set("magic", MAGIC ^ 0xFF)
    _stops_with(server, "magic", f"{MAGIC ^ 0xFF:#018x}", f"expected {MAGIC:#018x}")
    _nothing_left(procs, job)


@pytest.mark.long  # a server each: the default tier keeps one corrupt counter, magic and version
def test_corrupted_shape_field_stops_the_job(job, procs):
    server = _serve(procs, job)
    with Region.attach(job) as region:
        region.header.set("slots", 3)
    _stops_with(server, "slots", "3", "expected 2")
    _nothing_left(procs, job)


@pytest.mark.long  # a server each: the default tier keeps one corrupt counter, magic and version
def test_unknown_run_state_stops_the_job(job, procs):
    server = _serve(procs, job)
    with Region.attach(job) as region:
        region.header.set("run_state", 77)
        _ring(region)
    _stops_with(server, "run_state", "77")
    _nothing_left(procs, job)


# ------------------------------------------------------------------ non-finite gradients


def _status(procs, job):
    out, _ = finish(procs.gadei("status", job, "--json", "--interval", "0.05"))
    return json.loads(out.splitlines()[-1])


@pytest.mark.parametrize("value", tiered([math.nan, math.inf, -math.inf], default=[math.nan]))
def test_a_non_finite_gradient_is_skipped_and_counted_by_default(job, procs, value):
    server = _serve(procs, job, "--json")
    with Region.attach(job, readonly=True) as seen, Region.attach(job) as region:
        _push(region, value=value)
        wait_for(lambda: _applied(region), 10, "the gradient to be taken")
        assert seen.header.get("version") == 0, "a non-finite gradient was applied"
        assert np.all(seen.weights == 0.0)
        _push(region, value=2.0)  # the next, finite one is applied
        wait_for(lambda: _applied(region), 10, "the finite gradient to be applied")
        assert seen.header.get("version") == 1
        assert np.isfinite(seen.weights).all()
    status = _status(procs, job)
    assert status["nonfinite_skipped"] == 1 and status["applied"] == 1
    out, _ = finish(procs.gadei("status", job, "--interval", "0.05"))
    assert "1 non-finite gradients skipped" in out
    finish(procs.gadei("stop", job))
    stopped = json.loads(finish(server)[0].splitlines()[-1])
    assert stopped["nonfinite_skipped"] == 1 and stopped["applied"] == 1


def test_a_non_finite_gradient_stops_the_job_with_nonfinite_stop(job, procs):
    server = _serve(procs, job, "--nonfinite", "stop")
    with Region.attach(job, readonly=True) as seen, Region.attach(job) as region:
        _push(region, value=math.nan)
        _stops_with(server, "learner ring 0", "1 non-finite", "--nonfinite stop")
        assert np.all(seen.weights == 0.0) and seen.header.get("version") == 0
    _nothing_left(procs, job)


# ------------------------------------------------------------------ gadei stop


@pytest.mark.parametrize("content", [b"not a gadei region", b""], ids=["foreign", "zeros"])
def test_stop_ends_a_server_whose_region_name_holds_another_object(job, procs, content):
    server = _serve(procs, job)
    posix_ipc.unlink_shared_memory(shm_name(job))  # the server keeps its mapping
    junk = posix_ipc.SharedMemory(shm_name(job), flags=posix_ipc.O_CREX, mode=0o600, size=8192)
    os.write(junk.fd, content)  # zeros read as a region whose (dead) creator never published it
    junk.close_fd()
    try:
        stop = procs.gadei("stop", job)
        _, err = communicate(stop, 60)
        assert stop.returncode == 0, err
        assert f"server pid {server.pid}" in err and "not readable" in err
        communicate(server, DEADLINE)
        assert server.returncode == 0  # a clean stop: SIGTERM, drain, exit
    finally:
        posix_ipc.unlink_shared_memory(shm_name(job))


def test_stop_ends_a_stopped_server_whose_magic_is_corrupt(job, procs):
    server = _serve(procs, job)
    os.kill(server.pid, signal.SIGSTOP)  # it cannot notice the corruption itself meanwhile
    try:
        with Region.attach(job) as region:
            region.header.set("magic", 0x1234)
        assert inspect(job).state == "foreign"
        stop = procs.gadei("stop", job, "--timeout", "20")
        _, err = communicate(stop, 60)
        assert stop.returncode == 0, err
        assert f"server pid {server.pid}" in err
        communicate(server, DEADLINE)
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGCONT)
    assert server.returncode is not None
    _nothing_left(procs, job)


@pytest.mark.parametrize("moment", ["created", "published"])
def test_a_server_signalled_the_moment_its_region_appears_stops_cleanly(job, procs, moment):
    """SIGTERM (`gadei stop` by pid, `gadei run`'s Ctrl-C, the daemon's cancel) can reach a
    server the moment its region can be seen: while the server still makes it ("created": the
    name exists), or just after it was published, before the server serves. The server stops
    as on `gadei stop` and removes its region; it never dies of the signal leaving the region
    behind."""
    server = procs.gadei("serve", job, "--params", str(1 << 22), "--learners", "2", "--slots", "1", "--threads", "1")
    path = os.path.join("/dev/shm", shm_name(job).lstrip("/"))

    def appeared():
        if server.poll() is not None:
            pytest.fail(f"the server exited {server.returncode} before its region appeared")
        if moment == "created":
            return os.path.exists(path)
        found = inspect(job)
        return found is not None and found.state == "running"

    wait_for(appeared, 60, f"the server's region to be {moment}", interval=0.0005)
    server.send_signal(signal.SIGTERM)
    _, err = communicate(server, 60)
    assert server.returncode == 0, err[-3000:]
    _nothing_left(procs, job)


# ------------------------------------------------------------------ the supervisor


def test_the_supervisor_does_not_restart_from_a_corrupt_region_and_keeps_the_last_checkpoint(job, procs, tmp_path):
    folder = tmp_path / "ckpt"
    server = _serve(procs, job, "--checkpoint-dir", str(folder), "--checkpoint-every", "0.2", "--watch-interval",
                    "0.1")
    with Region.attach(job) as region:
        for _ in range(5):
            _push(region)
            wait_for(lambda: _applied(region), 10, "a gradient to be applied")
        wait_for(lambda: (c := checkpoint.latest(folder)) is not None and c.version == 5, 30,
                 "a checkpoint of version 5")
        region.entry(1).set("tail", 1000)
        _ring(region)
    _, err = _stops_with(server, "learner ring 1", "head - tail = -1,000")
    assert "restarting the server" not in err
    versions = [checkpoint.load(path).version for path in checkpoint.listing(folder)]
    assert versions and max(versions) == 5, versions
    _nothing_left(procs, job)


# ------------------------------------------------------------------ the reason reaches the user


def _failed_run(path, out, run, code: int = 1) -> tuple[str, dict]:
    """`gadei run` exited `code` within 120 s; (its last line on stderr, result.json)."""
    _, err = communicate(run, 120)
    assert run.returncode == code, err[-3000:]
    last = err.strip().splitlines()[-1]
    return last, json.loads((out / "result.json").read_text())


def test_gadei_run_says_which_field_of_a_corrupt_region_stopped_the_job(tmp_path, procs):
    """The server's reason, not "see logs/serve.log": in gadei run's last line and result.json's
    reason."""
    name = unique_name("tamper-run")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 50, "patience": 50, "lr": 0.05})
    try:
        run = procs.gadei("run", path)
        wait_for(lambda: (f := inspect(name)) is not None and f.state == "running" and job_version(name) >= 50, 120,
                 "the job to train")
        with Region.attach(name) as region:
            region.header.set("hold", 5)  # allowed 0..1: the server's audit at its next beat stops the job
            _ring(region)
        last, result = _failed_run(path, tmp_path / "out", run)
        for said in (last, result["reason"]):
            assert "header field hold is 5, allowed 0..1" in said and "--resume" in said, said
        assert result["outcome"] == "failed", result
    finally:
        end_jobs(name)


def test_a_learner_of_a_failed_job_gets_the_servers_reason(job, procs):
    """The Python API: `step` raises JobFailed with the server's reason, and a `with` block lets
    it through (a stop ends the block quietly; a failure must not look like one)."""
    server = _serve(procs, job)
    model = torch.nn.Linear(64, 64, bias=False)  # N parameters
    with pytest.raises(JobFailed, match="header field hold is 5, allowed 0..1.*--resume"):
        with Learner(model, job, timeout=10) as learner:
            with Region.attach(job) as region:
                region.header.set("hold", 5)
                _ring(region)
            deadline = time.monotonic() + DEADLINE
            while time.monotonic() < deadline:
                model.weight.grad = torch.zeros_like(model.weight)
                learner.step(1)
    _stops_with(server, "header field hold is 5")


def test_gadei_run_says_a_non_finite_gradient_stopped_the_job(tmp_path, procs):
    name = unique_name("nonfinite-run")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 20, "lr": 10, "optimizer": "sgd",
                                                   "momentum": 0.9, "nonfinite": "stop"})  # diverges at once
    try:
        last, result = _failed_run(path, tmp_path / "out", procs.gadei("run", path))
        for said in (last, result["reason"]):
            assert "non-finite value" in said and "learner ring 0" in said and "lower the learning rate" in said, said
        assert result["outcome"] == "failed", result
    finally:
        end_jobs(name)


def test_gadei_run_says_a_diverged_loss_stopped_the_job(tmp_path, procs):
    """The same diverging job with the default nonfinite = 'skip': the server skips its
    non-finite gradients, the loss turns NaN, and gadei run stops the job (exit 3) saying so."""
    name = unique_name("diverged-run")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 20, "lr": 10, "optimizer": "sgd",
                                                   "momentum": 0.9})
    try:
        last, result = _failed_run(path, tmp_path / "out", procs.gadei("run", path), code=3)
        for said in (last, result["reason"]):
            assert "training diverged" in said and "lower [train] lr" in said, said
        assert result["outcome"] == "diverged", result
    finally:
        end_jobs(name)

