"""A stop (SIGTERM: `gadei cancel`; SIGINT: Ctrl-C) asked of `gadei run` while it starts its job,
with real processes: while it checks the job and reads its data, before the server starts, once it
was started, while the learners attach. Each is a stop, never a death or a failure: exit 130, a
last line that says "stopped" and how to go on, result.json with the reason (or, while the job was
checked, nothing written at all), an output folder that either `--resume` or the same command
takes, and nothing of the job left running."""

import json
import signal
import time

import pytest

from helpers import blobs_job, communicate, job_processes, job_version, tiered, unique_name, wait_for
from gadei.region import inspect

pytestmark = pytest.mark.faults  # also run on a loaded machine: `--busy 2 -m faults` (docs/testing.md)

SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}


def _catches_sigterm(pid: int) -> bool:
    """`gadei run` set its handler for the stops (`launch.take_stops`; SIGTERM's is set last):
    bit 15 of SigCgt in /proc/PID/status (nothing else in it catches SIGTERM)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def _when(point: str, run, out, name) -> bool:
    if point == "before the server":  # gadei run is about to prepare the job (data, folder): no server yet
        return _catches_sigterm(run.pid)
    if point == "after the server":  # its server was started (server.log is opened just before)
        return (out / "logs" / "server.log").exists()
    # the supervisor launched the learners (each one's log is opened as it starts), none trained yet
    return (out / "logs" / "learner-1.log").exists()


@pytest.mark.parametrize("point, how", tiered(
    [(point, how) for point in ("before the server", "after the server", "while learners attach")
     for how in SIGNALS],
    default=[("before the server", "SIGINT"), ("after the server", "SIGTERM")]))
def test_a_stop_while_gadei_run_starts_its_job_is_a_clean_stop(tmp_path, procs, point, how):
    """Once, a SIGTERM that reached the server before it set its handler killed it (-15) and the
    run said "job failed: the server exited -15 without a watchdog"; one that reached `gadei run`
    before its own handler ended it with no result.json; learners still attaching held the stop
    for 30 s, until the watchdog (now the supervisor) killed them."""
    name = unique_name("early")
    path = blobs_job(tmp_path, name, train={"learners": 2, "epochs": 50, "patience": 50})
    out = tmp_path / "out"
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored in the child, whoever started us
    try:
        run = procs.gadei("run", path)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        wait_for(lambda: _when(point, run, out, name) or run.poll() is not None, 120, f"gadei run to be {point}",
                 interval=0.002)
        assert run.poll() is None and job_version(name) == 0, communicate(run, 10)
        if point == "before the server":  # taken from its first step: while it reads the data
            assert not (out / "job.toml").exists() and not (out / "logs" / "server.log").exists()
        sent = time.monotonic()
        run.send_signal(SIGNALS[how])
        stdout, stderr = communicate(run, 120)
        took = time.monotonic() - sent
        if point == "before the server" and f"gadei run: job {name} stopped before it started" in stderr:
            # it landed while the job was checked (the data read): nothing was written, nothing to go on with
            assert run.returncode == 130 and not (out / "job.toml").exists(), stdout + stderr
            check = procs.gadei("run", path, "--check")
            assert communicate(check, 60) and check.returncode == 0
            return
        result = json.loads((out / "result.json").read_text())
        last = stdout.strip().splitlines()[-1]
        assert run.returncode == 130 and result["outcome"] == "stopped" and result["reason"], (result, stdout + stderr)
        assert last.startswith(f"gadei run: job {name} stopped after "), stdout + stderr
        assert "failed" not in stdout + stderr and "Traceback" not in stderr, stdout + stderr
        assert " INFO " not in stdout + stderr, stdout + stderr  # its own lines, not the library's records
        # learners that had not attached are told to go, not waited for until killed (30 s)
        assert took < 20, f"the stop took {took:.0f} s:\n{stdout}{stderr}"
        assert inspect(name) is None and not job_processes(name)
        serve_log = (out / "logs" / "server.log").read_text() if (out / "logs" / "server.log").exists() else ""
        assert "Traceback" not in serve_log, serve_log
        # what the last line says to do is what the folder takes
        again = ["--resume"] if "--resume" in last else []
        assert again or "start it again with `gadei run " in last, last
        check = procs.gadei("run", path, "--check", *again)
        _, err = communicate(check, 60)
        assert check.returncode == 0, (last, err)
    finally:
        for proc in job_processes(name):
            proc.kill()


@pytest.mark.parametrize("how", tiered(list(SIGNALS), default=["SIGTERM"]))
def test_a_gadei_run_started_held_takes_a_stop_sent_at_once(tmp_path, how):
    """The daemon starts `gadei run` with the stops held (`launch.spawn(held=True)`), as `gadei
    run` starts its server: a `gadei cancel` that comes at once, before the interpreter or gadei
    set a handler, waits until it takes it. Not held, the signal killed it then: -15, or -2 with
    nothing on stderr (Python's SIGINT before its own handler is set)."""
    from gadei._proc import gadei_command
    from gadei._proc import wait_or_kill
    from gadei.launch import spawn

    path = blobs_job(tmp_path, unique_name("held"), train={"learners": 2, "epochs": 50, "patience": 50})
    log = tmp_path / "run.log"
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored in the child, whoever started us
    try:
        run = spawn(gadei_command("run", path), log=log, held=True)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        run.send_signal(SIGNALS[how])
        code = run.wait(timeout=120)
    finally:
        wait_or_kill(run, 0, "gadei run")
    text = log.read_text()
    assert code == 130, (code, text)
    assert text.strip().splitlines()[-1].startswith("gadei run: job ") and "stopped before it started" in text, text
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


def test_a_stop_while_gadei_run_reads_a_large_data_set_ends_it_at_once_writing_nothing(tmp_path, procs):
    """A Ctrl-C (or a SIGTERM) while `gadei run` reads a data set of seconds (600,000 lines here; a
    large one takes minutes) ends it at once: exit 130, its last line says so, nothing is written.
    It once waited for the whole read, then started the job only to stop it."""
    import random

    name = unique_name("big-read")
    rows = random.Random(1)
    with open(tmp_path / "big.csv", "w") as big:
        big.write("text,label\n")
        for i in range(600_000):
            big.write(" ".join(f"w{rows.randrange(30_000)}" for _ in range(12)) + f",L{i % 4}\n")
    (tmp_path / "job.toml").write_text(f'[job]\nname = "{name}"\nworkload = "textcnn"\n[data]\ntrain = "big.csv"\n')
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored in the child, whoever started us
    try:
        run = procs.gadei("run", tmp_path / "job.toml")
    finally:
        signal.signal(signal.SIGINT, before)
    wait_for(lambda: _catches_sigterm(run.pid), 120, "gadei run to take its stops")
    time.sleep(1.0)  # into the read (seconds of it, on the fastest machine)
    sent = time.monotonic()
    run.send_signal(signal.SIGINT)
    stdout, stderr = communicate(run, 120)
    took = time.monotonic() - sent
    assert run.returncode == 130 and stderr.strip().splitlines()[-1] == (
        f"gadei run: job {name} stopped before it started (as its job file and data were checked); nothing was "
        "written"), stdout + stderr
    assert not (tmp_path / "runs").exists() and "Traceback" not in stderr, stdout + stderr
    assert took < 10, f"the stop took {took:.1f} s"


# Loaded by `gadei run` (and, through PYTHONPATH, by its children, which it leaves alone): once
# its server was started, its first pause sends it a SIGTERM from inside an exec'd string, as a
# stop may come while dataclasses build a class's methods in an import.
_STOP_IN_EXEC = '''
import os, time
if os.getppid() == int(os.environ["STOP_IN_EXEC_PARENT"]):
    _sleep, _sent = time.sleep, []
    def _pause(seconds):
        if not _sent and os.path.exists(os.environ["STOP_IN_EXEC_LOG"]):
            _sent.append(1)
            exec("import os, signal, time\\nos.kill(os.getpid(), signal.SIGTERM)\\ntime.sleep(0.05)\\n")
        _sleep(seconds)
    time.sleep = _pause
'''


def test_a_stop_that_comes_while_exec_runs_is_a_stop_with_exit_130(tmp_path, procs):
    """A stop's handler that raised KeyboardInterrupt where it landed: one that landed in code
    run by exec() (a string) left CPython's flag for an unhandled interrupt set although
    `gadei run` caught it, and the run, having written result.json and its last line, exited
    -2 (killed by SIGINT) instead of 130: 3 of 20 stops sent as the server started. The handler
    now records the stop, which the loop that follows the job takes."""
    import os

    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(_STOP_IN_EXEC)
    name = unique_name("exec-stop")
    path = blobs_job(tmp_path, name, train={"learners": 2, "epochs": 50, "patience": 50})
    out = tmp_path / "out"
    paths = [str(tmp_path / "hook"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(paths), "STOP_IN_EXEC_PARENT": str(os.getpid()),
           "STOP_IN_EXEC_LOG": str(out / "logs" / "server.log")}
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored in the child, whoever started us
    try:
        run = procs.gadei("run", path, env=env)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        stdout, stderr = communicate(run, 120)
        result = json.loads((out / "result.json").read_text())
        assert run.returncode == 130 and result["outcome"] == "stopped", (run.returncode, result, stdout + stderr)
        assert stdout.strip().splitlines()[-1].startswith(f"gadei run: job {name} stopped after "), stdout + stderr
        assert inspect(name) is None and not job_processes(name)
    finally:
        for proc in job_processes(name):
            proc.kill()
