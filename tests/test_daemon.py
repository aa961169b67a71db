"""The daemon with real processes: submit, status, cancel, a restarted daemon that still knows
every job, a bad job file refused at submit, and another user's request refused by its uid."""

import json
import os
import shutil
import tempfile
import textwrap

import psutil
import pytest

from conftest import communicate, data_dir, finish, trec_job, wait_for
from gadei import checkpoint
from gadei.region import inspect


@pytest.fixture
def daemon_env(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return {"GADEI_RUNTIME_DIR": str(run), "GADEI_STATE_DIR": str(tmp_path / "state")}


def _jobfile(folder, name, epochs, interval=2):
    path = folder / f"{name}.toml"
    path.write_text(trec_job(name, f"out-{name}", train={"learners": 2, "epochs": epochs, "lr": 0.05},
                             checkpoint={"interval": interval}))
    return path


def _start_daemon(procs, env):
    daemon = procs.gadei("daemon", "--max-jobs", 1, env=env)
    wait_for(lambda: os.path.exists(os.path.join(env["GADEI_RUNTIME_DIR"], "daemon.sock")) or daemon.poll() is not None,
             60, "the daemon's socket")
    assert daemon.poll() is None, daemon.err_lines
    return daemon


def _jobs(procs, env) -> dict:
    out, _ = finish(procs.gadei("status", "--json", env=env))
    record = json.loads(out.splitlines()[0])
    assert record["event"] == "daemon-jobs"
    return {j["name"]: j for j in record["jobs"]}


@pytest.mark.slow
def test_submit_status_cancel_and_a_restarted_daemon_knows_every_job(tmp_path, procs, daemon_env):
    if not (data_dir() / "trec").is_dir():
        pytest.skip("TREC is not in the shared data")
    prefix = f"d{os.getpid()}"
    long, short = f"{prefix}-long", f"{prefix}-short"
    daemon = _start_daemon(procs, daemon_env)
    finish(procs.gadei("submit", _jobfile(tmp_path, long, epochs=50), env=daemon_env))
    finish(procs.gadei("submit", _jobfile(tmp_path, short, epochs=1), env=daemon_env))
    again = procs.gadei("submit", _jobfile(tmp_path, short, epochs=1), env=daemon_env)
    _, err = communicate(again, 60)
    assert again.returncode == 2 and f"job '{short}' is already queued" in err

    wait_for(lambda: _jobs(procs, daemon_env)[long]["state"] == "running", 60, "the first job to start")
    assert _jobs(procs, daemon_env)[short]["state"] == "queued"  # one at a time
    out = tmp_path / f"out-{long}"
    wait_for(lambda: checkpoint.listing(out / "checkpoints"), 120, "a checkpoint of the long job")
    finish(procs.gadei("cancel", long, env=daemon_env))
    wait_for(lambda: _jobs(procs, daemon_env)[short]["state"] == "running", 120, "the short job to start")
    assert _jobs(procs, daemon_env)[long]["state"] == "cancelled"
    wait_for(lambda: inspect(long) is None, 60, "the cancelled job's region to go")
    assert checkpoint.latest(out / "checkpoints") is not None and (out / "logs" / "serve.log").exists()
    wait_for(lambda: not [p for p in psutil.process_iter(["cmdline", "status"])
                          if long in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE],
             60, "the cancelled job's processes to end")

    daemon.terminate()  # the running job goes on without the daemon
    communicate(daemon, 60)
    daemon = _start_daemon(procs, daemon_env)
    wait_for(lambda: _jobs(procs, daemon_env)[short]["state"] == "done", 300, "the short job to finish")
    jobs = _jobs(procs, daemon_env)
    assert jobs[long]["state"] == "cancelled" and jobs[short]["returncode"] in (0, None)
    assert (tmp_path / f"out-{short}" / "model.pt").exists()
    logs, _ = finish(procs.gadei("logs", short, "--lines", 5, env=daemon_env))
    assert "test accuracy" in logs
    daemon.terminate()
    communicate(daemon, 60)


def test_a_bad_job_file_is_refused_at_submit_and_nothing_is_queued(tmp_path, procs, daemon_env):
    daemon = _start_daemon(procs, daemon_env)
    bad = tmp_path / "bad.toml"
    bad.write_text('[job]\nname = "x"\nworkload = "textcnn"\n[data]\ntrain = "nope.csv"\nformat = "csv"\n')
    submit = procs.gadei("submit", bad, env=daemon_env)
    _, err = communicate(submit, 60)
    assert submit.returncode == 2 and "[data] train = '" in err and "no such file" in err
    out, _ = finish(procs.gadei("status", "--json", env=daemon_env))
    assert "daemon-jobs" not in out  # nothing was queued
    daemon.terminate()
    communicate(daemon, 60)


def test_no_daemon_is_a_clear_error(procs, daemon_env, tmp_path):
    submit = procs.gadei("submit", tmp_path / "x.toml", env=daemon_env)
    _, err = communicate(submit, 60)
    assert submit.returncode == 2 and "no gadei daemon listens" in err and "gadei daemon" in err


def test_another_users_request_is_refused_by_its_uid(tmp_path, procs, daemon_env):
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    # pytest's own folders are closed to other users: the socket goes where they can reach it
    run = tempfile.mkdtemp(prefix="gadei-uid-test-")
    daemon_env = {**daemon_env, "GADEI_RUNTIME_DIR": run}
    try:
        _refused(tmp_path, procs, daemon_env)
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _refused(tmp_path, procs, daemon_env):
    daemon = _start_daemon(procs, daemon_env)
    sock = os.path.join(daemon_env["GADEI_RUNTIME_DIR"], "daemon.sock")
    # Open the modes so the other uid gets through the file system: the peer-uid check must hold alone.
    os.chmod(daemon_env["GADEI_RUNTIME_DIR"], 0o711)
    os.chmod(sock, 0o666)
    other = procs.start("-c", textwrap.dedent(f"""
        import json, os, socket
        os.setgid(65534); os.setuid(65534)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect({sock!r})
        s.sendall(b'{{"op": "status", "job": null}}\\n')
        print(s.makefile().readline(), end="")
    """))
    out, err = communicate(other, 60)
    assert other.returncode == 0, err
    answer = json.loads(out)
    assert answer["ok"] is False and "a request from uid 65534 is refused" in answer["error"]
    daemon.terminate()
    _, err = communicate(daemon, 60)
    assert "refused a request from uid 65534" in err
