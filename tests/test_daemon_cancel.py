"""The daemon's cancel with real processes: a cancel that comes while the job starts is a stop
(the job ends cancelled, its supervisor says stopped); a cancel outlives the daemon that took
it (the job's supervisor carries it out, and the daemon started after it records the end); and
a cancelled job whose supervisor is killed before it stopped the job ends cancelled, with how."""

import json
import os
import signal
import time

import numpy as np
import psutil
import pytest

from helpers import daemon_jobs as _jobs
from helpers import blobs, communicate, finish, job_processes, job_text, job_version, start_daemon, tiered, wait_for
from gadei import checkpoint
from gadei.region import inspect, remove

pytestmark = pytest.mark.faults  # also run on a loaded machine: `--busy 2 -m faults` (docs/testing.md)


def _job(folder, name: str, epochs: int | None):
    """The small job's file (None: its epochs left to the defaults)."""
    x, y = blobs(900)
    np.savez(folder / "blobs.npz", x=x, y=y)
    path = folder / "job.toml"
    path.write_text(job_text({"job": {"name": name, "workload": "mlp"},
                              "data": {"train": "blobs.npz", "format": "npz", "holdout": 0.2, "validation_holdout": 0},
                              "train": {"learners": 2, **({"epochs": epochs} if epochs else {})},
                              "checkpoint": {"interval": 600},
                              "output": {"folder": "out"}}))
    return path


def _end(name: str) -> None:
    for proc in job_processes(name):
        proc.kill()
    if inspect(name) is not None:
        remove(name)


@pytest.mark.parametrize("when", tiered(["as its supervisor starts", "once its server started"],
                                        default=["as its supervisor starts"]))
def test_a_cancel_while_the_job_starts_ends_it_cancelled_and_stopped(tmp_path, procs, daemon_env, when):
    """`gadei cancel` a second or two after `gadei submit`: its SIGTERM reaches a supervisor that
    is still starting, or a server still starting. Once, that killed the job's `gadei run` (-15,
    no result.json: the daemon wrote one that said failed), or the server before it set its
    handler, and the run said "job failed: the server exited -15 without a watchdog". The job
    file leaves its epochs to the defaults: the record says what the run said (once "epoch 0 of
    None", the job file's epochs)."""
    name = f"d{os.getpid()}-early-{when.split()[-1]}"
    out = tmp_path / "out"
    starting = when == "as its supervisor starts"
    # held where it starts (GADEI_PAUSE_AT), its stops still blocked: a supervisor forked warm starts in well under
    # a second, so no timing of the test's could meet it there
    start_daemon(procs, {**daemon_env, "GADEI_PAUSE_AT": "starting"} if starting else daemon_env)
    try:
        finish(procs.gadei("submit", _job(tmp_path, name, epochs=None), env=daemon_env))
        if starting:
            wait_for(lambda: _jobs(procs, daemon_env)[name]["pid"], 30, "the daemon to start the job's supervisor")
            supervisor = psutil.Process(_jobs(procs, daemon_env)[name]["pid"])
            wait_for(lambda: supervisor.status() == psutil.STATUS_STOPPED, 60, "the supervisor to hold as it starts")
        else:
            wait_for(lambda: (out / "logs" / "server.log").exists(), 60, "the supervisor to start the job's server",
                     interval=0.002)
        cancelled = time.monotonic()
        finish(procs.gadei("cancel", name, env=daemon_env))
        if starting:
            assert job_version(name) == 0  # nothing of the job started
            supervisor.send_signal(signal.SIGCONT)
        wait_for(lambda: _jobs(procs, daemon_env)[name]["message"].startswith("cancelled;"), 60,
                 "the cancelled job to end")
        took = time.monotonic() - cancelled
        record = _jobs(procs, daemon_env)[name]
        result = json.loads((out / "result.json").read_text())
        last = (out / "logs" / "supervisor.log").read_text().strip().splitlines()[-1]
        assert record["state"] == "cancelled" and record["returncode"] == 130, record
        assert result["outcome"] == "stopped" and result["reason"], result
        assert last.startswith(f"gadei submit: job {name} stopped after ") and "gadei submit" in last, last
        assert record["message"] == f"cancelled; {last.removeprefix('gadei submit: ')}", (record, last)
        assert took < 20, f"the cancel took {took:.0f} s"
        assert inspect(name) is None and not job_processes(name)
    finally:
        _end(name)


@pytest.mark.long  # a job held, its daemon killed, another started: most of a minute
def test_a_cancel_outlives_the_daemon_that_took_it(tmp_path, procs, daemon_env):
    """The daemon killed right after it passed a cancel on (the job's supervisor held by SIGSTOP,
    so that it has not taken it yet): the supervisor takes the stop once it runs, and the daemon
    started after it finds the job by its record and records it cancelled."""
    name = f"d{os.getpid()}-cancel-dies"
    out = tmp_path / "out"
    daemon = start_daemon(procs, daemon_env)
    finish(procs.gadei("submit", _job(tmp_path, name, epochs=200), env=daemon_env))
    supervisor = None
    try:
        wait_for(lambda: job_version(name) >= 200, 120, "the job to make 200 updates")
        supervisor = _jobs(procs, daemon_env)[name]["pid"]
        os.kill(supervisor, signal.SIGSTOP)
        finish(procs.gadei("cancel", name, env=daemon_env))
        assert _jobs(procs, daemon_env)[name]["message"] == "cancelling"
        daemon.kill()
        communicate(daemon, 30)
        os.kill(supervisor, signal.SIGCONT)
        supervisor = None
        start_daemon(procs, daemon_env)
        _stopped_as_cancelled(procs, daemon_env, name, out, "the next daemon to record the cancel")
        found = checkpoint.latest(out / "checkpoints", with_progress=True)
        assert found is not None and set(found.progress) == {"0", "1"}, found and found.progress
    finally:
        if supervisor is not None:
            os.kill(supervisor, signal.SIGCONT)
        _end(name)


@pytest.mark.long  # a job held, its supervisor killed mid-cancel: most of a minute
def test_a_cancelled_job_whose_supervisor_dies_before_stopping_it_ends_cancelled(tmp_path, procs, daemon_env):
    """The daemon's SIGTERM reached a supervisor that was killed before it stopped the job (held
    by SIGSTOP, then SIGKILL): the job ends with its supervisor (nothing of it runs on), no new
    supervisor goes on with a job that was asked to stop, and the record says cancelled and how
    its supervisor ended."""
    name = f"d{os.getpid()}-sup-dies"
    out = tmp_path / "out"
    start_daemon(procs, daemon_env)
    finish(procs.gadei("submit", _job(tmp_path, name, epochs=200), env=daemon_env))
    try:
        wait_for(lambda: job_version(name) >= 200, 120, "the job to make 200 updates")
        supervisor = _jobs(procs, daemon_env)[name]["pid"]
        os.kill(supervisor, signal.SIGSTOP)  # it cannot take the cancel's SIGTERM
        finish(procs.gadei("cancel", name, env=daemon_env))
        os.kill(supervisor, signal.SIGKILL)
        wait_for(lambda: _jobs(procs, daemon_env)[name]["message"].startswith("cancelled;"), 90,
                 "the daemon to record the cancelled job's end")
        record = _jobs(procs, daemon_env)[name]
        assert record["state"] == "cancelled" and f"its supervisor (pid {supervisor}) was killed by SIGKILL" in \
            record["message"], record
        wait_for(lambda: inspect(name) is None and not job_processes(name), 60, "the job to end with its supervisor")
        assert not (out / "result.json").exists()
        finish(procs.gadei("daemon", "stop", env=daemon_env))
    finally:
        _end(name)


def _stopped_as_cancelled(procs, daemon_env, name: str, out, what: str) -> None:
    """The job's record ends cancelled (waited for as `what`), its result.json says stopped, its
    region is gone; then the daemon is stopped."""
    wait_for(lambda: _jobs(procs, daemon_env)[name]["message"].startswith("cancelled;"), 90, what)
    assert json.loads((out / "result.json").read_text())["outcome"] == "stopped"
    assert inspect(name) is None
    finish(procs.gadei("daemon", "stop", env=daemon_env))
