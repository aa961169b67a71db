"""The daemon's cancel with real processes: a cancel that comes while the job starts is a stop
(the job ends cancelled, its run says stopped), and a cancel that the daemon was carrying out
itself when it died is finished by the daemon started after it."""

import json
import os
import signal
import time

import numpy as np
import pytest

from helpers import daemon_jobs as _jobs
from helpers import blobs, communicate, finish, job_processes, job_text, job_version, start_daemon, tiered, wait_for
from gadei.region import inspect, remove


def _job(folder, name: str, epochs: int):
    x, y = blobs(900)
    np.savez(folder / "blobs.npz", x=x, y=y)
    path = folder / "job.toml"
    path.write_text(job_text({"job": {"name": name, "workload": "mlp"},
                              "data": {"train": "blobs.npz", "format": "npz", "holdout": 0.2, "validation_holdout": 0},
                              "train": {"learners": 2, "epochs": epochs}, "checkpoint": {"interval": 600},
                              "output": {"folder": "out"}}))
    return path


def _end(name: str) -> None:
    for proc in job_processes(name):
        proc.kill()
    if inspect(name) is not None:
        remove(name)


@pytest.mark.parametrize("when", tiered(["as its run starts", "once its server started"],
                                        default=["as its run starts"]))
def test_a_cancel_while_the_job_starts_ends_it_cancelled_and_its_run_stopped(tmp_path, procs, daemon_env, when):
    """`gadei cancel` a second or two after `gadei submit`: its SIGTERM reaches a `gadei run` that
    is still importing or preparing, or a server still starting. Once, that killed `gadei run`
    (-15, no result.json: the daemon wrote one that said failed), or the server before it set its
    handler, and the run said "job failed: the server exited -15 without a watchdog"."""
    name = f"d{os.getpid()}-early-{when.split()[-1]}"
    out = tmp_path / "out"
    start_daemon(procs, daemon_env)
    try:
        finish(procs.gadei("submit", _job(tmp_path, name, epochs=50), env=daemon_env))
        if when == "as its run starts":
            wait_for(lambda: _jobs(procs, daemon_env)[name]["pid"], 30, "the daemon to start the job's gadei run")
        else:
            wait_for(lambda: (out / "logs" / "serve.log").exists(), 60, "gadei run to start the job's server",
                     interval=0.002)
        assert job_version(name) == 0
        cancelled = time.monotonic()
        finish(procs.gadei("cancel", name, env=daemon_env))
        wait_for(lambda: _jobs(procs, daemon_env)[name]["message"].startswith("cancelled;"), 60,
                 "the cancelled job to end")
        took = time.monotonic() - cancelled
        record = _jobs(procs, daemon_env)[name]
        result = json.loads((out / "result.json").read_text())
        last = (out / "logs" / "run.log").read_text().strip().splitlines()[-1]
        assert record["state"] == "cancelled" and record["returncode"] == 130, record
        assert result["outcome"] == "stopped" and result["reason"], result
        assert last.startswith(f"gadei run: job {name} stopped after ") and "gadei submit" in last, last
        assert took < 20, f"the cancel took {took:.0f} s"
        assert inspect(name) is None and not job_processes(name)
    finally:
        _end(name)


@pytest.mark.long  # an orphaned job held, its daemon killed, another started: a minute
def test_a_cancel_the_daemon_was_carrying_out_when_it_died_is_finished_by_the_next_daemon(tmp_path, procs,
                                                                                          daemon_env):
    """An orphaned job's cancel runs in a thread of the daemon (the progress checkpoint, then the
    stop). Killed while it runs (the job's server held by SIGSTOP, so the thread is caught in it),
    the daemon left the record cancelled with the message "cancelling": once, the daemon started
    after it kept that for as long as the job ran on; now it finishes the cancel."""
    name = f"d{os.getpid()}-cancel-dies"
    out = tmp_path / "out"
    daemon = start_daemon(procs, daemon_env)
    finish(procs.gadei("submit", _job(tmp_path, name, epochs=200), env=daemon_env))
    server = None
    try:
        wait_for(lambda: job_version(name) >= 200, 120, "the job to make 200 updates")
        os.kill(_jobs(procs, daemon_env)[name]["pid"], signal.SIGKILL)
        wait_for(lambda: _jobs(procs, daemon_env)[name]["orphaned"], 60, "the daemon to see gadei run die")
        server = inspect(name).server_pid
        os.kill(server, signal.SIGSTOP)  # the cancel's checkpoint waits for it: the thread is caught
        finish(procs.gadei("cancel", name, env=daemon_env))
        assert _jobs(procs, daemon_env)[name]["message"] == "cancelling"
        daemon.kill()
        communicate(daemon, 30)
        os.kill(server, signal.SIGCONT)
        server = None
        assert inspect(name).state == "running"  # the job runs on: no one stops it but the next daemon
        start_daemon(procs, daemon_env)
        _stopped_as_cancelled(procs, daemon_env, name, out, "the next daemon to finish the cancel")
    finally:
        if server is not None:
            os.kill(server, signal.SIGCONT)
        _end(name)


@pytest.mark.long  # a job held, its run killed mid-cancel: most of a minute
def test_a_cancelled_job_whose_run_dies_before_stopping_it_is_stopped_by_the_daemon(tmp_path, procs, daemon_env):
    """The daemon's SIGTERM reached a `gadei run` that was killed before it stopped the job (held
    by SIGSTOP, then SIGKILL): once, the daemon then only followed the job (orphaned), which ran
    on to its end with the record saying "cancelling"; now it stops the job itself."""
    name = f"d{os.getpid()}-run-dies"
    out = tmp_path / "out"
    start_daemon(procs, daemon_env)
    finish(procs.gadei("submit", _job(tmp_path, name, epochs=200), env=daemon_env))
    try:
        wait_for(lambda: job_version(name) >= 200, 120, "the job to make 200 updates")
        run = _jobs(procs, daemon_env)[name]["pid"]
        os.kill(run, signal.SIGSTOP)  # it cannot take the cancel's SIGTERM
        finish(procs.gadei("cancel", name, env=daemon_env))
        os.kill(run, signal.SIGKILL)
        _stopped_as_cancelled(procs, daemon_env, name, out, "the daemon to stop the cancelled job")
    finally:
        _end(name)


def _stopped_as_cancelled(procs, daemon_env, name: str, out, what: str) -> None:
    """The job's record ends cancelled (waited for as `what`), its result.json says stopped, its
    region is gone; then the daemon is stopped."""
    wait_for(lambda: _jobs(procs, daemon_env)[name]["message"].startswith("cancelled;"), 90, what)
    assert json.loads((out / "result.json").read_text())["outcome"] == "stopped"
    assert inspect(name) is None
    finish(procs.gadei("daemon", "stop", env=daemon_env))
