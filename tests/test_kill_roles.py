"""SIGKILL of each role of a job, under `gadei run` and under the daemon: the reported outcome
(exit status, message, the daemon's record) is the job's real one, and its outputs
(result.json, metrics.jsonl, accuracy.png) are written by the one process that saw it end, its
supervisor.

Each case runs a small job (an MLP on 900 numeric samples, two learners, checkpoints every
second), kills one process once the job has made some updates, and measures the seconds
from the kill to a clear stop (the job's outcome reported); `-s` prints them:

    python -m pytest -q -s tests/test_kill_roles.py --long

The default tier kills the server under `gadei run` (its supervisor restarts it from its
checkpoint), the supervisor (its server and learners end with it; `gadei run` starts a new one
that goes on from the newest checkpoint, or from the job's start before any), `gadei run` itself
(its supervisor finishes the job), and `gadei run` with its supervisor (the job ends, and
`--resume` goes on with it). The other roles and every kill under the daemon, a small job each,
are the long tier.
"""

import json
import os
import signal
import time

import psutil
import pytest

from gadei.region import Region, inspect
from helpers import (blobs_job, communicate, dead, end_jobs, finish, job_processes, learner_pids, start_daemon, tiered,
                     unique_name, wait_for)

pytestmark = pytest.mark.faults  # also run on a loaded machine: `--busy 2 -m faults` (docs/testing.md)

STOP_WITHIN = 120  # seconds from a kill to a clear stop, at most (the job itself takes about 10 s)
EPOCHS = 60  # the small job's: started warm, 12 epochs of it end within 1.5 s, before a poll sees it train
# how a process these tests SIGKILL is said to have ended (`gadei._proc.how_it_ended`)
KILLED = ("was killed by SIGKILL (signal 9), sent by a process (not the out-of-memory killer, which killed nothing "
          "since it started)")


@pytest.fixture
def small(tmp_path):
    """A job file of a small job, its name and output folder; every process of it is killed at the end."""
    name = unique_name("kill")
    path = blobs_job(tmp_path, name, train={"learners": 2, "epochs": EPOCHS, "patience": EPOCHS, "lr": 0.05},
                     checkpoint={"interval": 1})
    yield path, name, tmp_path / "out"
    end_jobs(name)


def _roles(name: str) -> dict:
    """The job's server, supervisor and learner pids as its region names them ({} without a region)."""
    try:
        with Region.attach(name, readonly=True) as region:
            h = region.header
            return {"server": h.get("server_pid"), "supervisor": h.get("supervisor_pid"), "version": h.get("version"),
                    "checkpointed": h.get("checkpointed_version"), "learners": learner_pids(region)}
    except Exception:
        return {}


def _when_training(name: str, checkpointed: bool = True) -> dict:
    """The roles, once the job has made 600 updates with both learners and its supervisor attached,
    and (`checkpointed`) its supervisor took a checkpoint (a restart goes on from it; a job started
    warm makes 600 updates within its first second)."""
    def ready():
        roles = _roles(name)
        return roles if roles.get("version", 0) >= 600 and roles["supervisor"] and len(roles["learners"]) == 2 \
            and (roles["checkpointed"] or not checkpointed) else None

    return wait_for(ready, 180, "the job to train with its supervisor and two learners", interval=0.05)


def _outputs_written(out, writer=None) -> dict:
    """result.json, metrics.jsonl of every epoch and the plot; result.json's content."""
    result = json.loads((out / "result.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == list(range(1, EPOCHS + 1)), metrics
    assert (out / "accuracy.png").stat().st_size > 1000
    assert not list(out.glob(".*.tmp*")), "a writer's temporary file was left"
    if writer is not None:
        assert result["written_by"] == writer
    return result


def _gone(name: str) -> bool:
    return not job_processes(name) and inspect(name) is None


def _say(case: str, outcome: str, seconds: float) -> None:
    print(f"\nkill {case}: {outcome}; {seconds:.1f} s from the kill to a clear stop", flush=True)


@pytest.mark.parametrize("role", tiered(["server", "supervisor", "learner"], default=["server", "supervisor"]))
def test_gadei_run_reports_the_real_outcome_when_a_role_of_its_job_is_killed(small, procs, role):
    path, name, out = small
    run = procs.gadei("run", path)
    roles = _when_training(name)
    pid = roles["learners"][0] if role == "learner" else roles[role]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    stdout, stderr = communicate(run, STOP_WITHIN)
    seconds = time.monotonic() - killed
    assert run.returncode == 0, stdout + stderr
    assert "done in" in stdout, stdout
    if role == "server":
        assert f"the server pid {pid} {KILLED}" in stderr and "restarting the server from checkpoint" in stderr, stderr
    if role == "supervisor":
        assert f"its supervisor (pid {pid}) {KILLED}; a new one goes on from checkpoint" in stderr, stderr
        assert dead(roles["server"]) and all(dead(p) for p in roles["learners"])  # they ended with it
    result = _outputs_written(out)
    assert (result["written_by"] == roles["supervisor"]) is (role != "supervisor"), (result, roles)
    assert (result["outcome"], result["finished"]) == ("done", True), result
    assert result["test_accuracy"] > 0.9, result
    wait_for(lambda: _gone(name), 30, "every process of the job to end")
    _say(f"{role} under gadei run", "gadei run exit 0, result.json outcome done", seconds)


def test_a_new_supervisor_waits_for_the_server_of_the_one_that_died_to_stop(small, procs):
    """The supervisor killed while its server is held (SIGSTOP, as on a loaded machine): the
    server, tied to it, has its SIGTERM pending and still serves the job's region when `gadei
    run` starts a new supervisor, forked in milliseconds. The new one waits for that server to
    stop rather than start a server of its own beside it (which once found the region taken and
    failed the job: "the server exited with code 2"), and the job goes on to its end."""
    path, name, out = small
    run = procs.gadei("run", path, env={**os.environ, "GADEI_LOG": "INFO"})
    roles = _when_training(name)
    os.kill(roles["server"], signal.SIGSTOP)
    try:
        os.kill(roles["supervisor"], signal.SIGKILL)
        wait_for(lambda: "is still stopping; waiting for it" in (out / "logs" / "supervisor.log").read_text(), 60,
                 "the new supervisor to wait for the server of the one that died")
        assert _roles(name)["server"] == roles["server"]  # the region is still the held server's
    finally:
        os.kill(roles["server"], signal.SIGCONT)
    stdout, stderr = communicate(run, STOP_WITHIN)
    assert run.returncode == 0 and "done in" in stdout, stdout + stderr
    assert f"its supervisor (pid {roles['supervisor']}) {KILLED}; a new one goes on from checkpoint" in stderr, stderr
    assert dead(roles["server"])
    assert (_outputs_written(out)["outcome"]) == "done"
    wait_for(lambda: _gone(name), 30, "every process of the job to end")


@pytest.mark.long  # four kills and the supervisor's back-off (1 + 2 + 4 s)
def test_a_learner_given_up_ends_gadei_run_with_the_reason(tmp_path, procs):
    """A launched learner that keeps dying is given up after --max-restarts (3) restarts; with
    no learner left the job ends, and the reason reaches gadei run's last line and result.json."""
    name = unique_name("given-up")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 500, "patience": 500, "lr": 0.05})
    try:
        run = procs.gadei("run", path)
        killed = set()
        while run.poll() is None and len(killed) < 8:
            pid = wait_for(lambda: run.poll() is not None or next(
                (p for p in _roles(name).get("learners", []) if p not in killed), None), 60, "a learner to kill")
            if pid is True:
                break
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        stdout, stderr = communicate(run, STOP_WITHIN)
        assert run.returncode == 1 and len(killed) == 4, (killed, stdout + stderr)
        result = json.loads((tmp_path / "out" / "result.json").read_text())
        for said in (stderr.strip().splitlines()[-1], result["reason"]):
            assert "the supervisor gave up on launched learners [0]: they died 4 times" in said, said
        assert result["outcome"] == "failed", result
    finally:
        end_jobs(name)


def _wait_policy(out, pid: int) -> str | None:
    """The OpenMP wait policy the learner `pid` says it runs with as it attaches (its log; a
    learner forked warm shows its title where /proc would show its environment)."""
    def said():
        for log in (out / "logs").glob("learner-*.log"):
            for line in log.read_text().splitlines():
                if f" attached (pid {pid}," in line and "OpenMP wait policy: " in line:
                    return line.split("OpenMP wait policy: ")[1].split(" ")[0]
        return None

    return wait_for(said, 60, f"learner pid {pid} to say it attached")


@pytest.mark.long
def test_learners_a_new_supervisor_starts_run_as_the_first_ones_did(tmp_path, procs):
    """Learners whose threads over-subscribe the cores start passive (`env.learners_openmp_env`);
    the supervisor `gadei run` starts in place of a dead one starts its learners with that
    policy too: it is started in the job's environment, not in `gadei run`'s own."""
    name = unique_name("again-env")
    threads = len(os.sched_getaffinity(0))  # 2 learners of as many threads as the cores: over-subscribed anywhere
    path = blobs_job(tmp_path, name, train={"learners": 2, "threads": threads, "epochs": 200, "patience": 200,
                                            "lr": 0.05}, checkpoint={"interval": 1})
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}  # gadei's choice
    try:
        run = procs.gadei("run", path, env=env)
        roles = _when_training(name)
        out = tmp_path / "out"
        for learner in roles["learners"]:
            assert _wait_policy(out, learner) == "passive"
        wait_for(lambda: list((tmp_path / "out" / "checkpoints").glob("ckpt-*.pt")), 60, "a checkpoint")
        os.kill(roles["supervisor"], signal.SIGKILL)

        def new_learners():
            now = _roles(name)
            return now if now.get("supervisor") not in (None, 0, roles["supervisor"]) and len(now["learners"]) == 2 \
                else None
        now = wait_for(new_learners, 120, "a new supervisor and its learners")
        for learner in now["learners"]:
            assert psutil.Process(learner).ppid() == now["supervisor"]
            assert _wait_policy(out, learner) == "passive"
        run.send_signal(signal.SIGTERM)
        stdout, stderr = communicate(run, STOP_WITHIN)
        assert run.returncode == 130, (run.returncode, stdout + stderr)
        assert json.loads((tmp_path / "out" / "result.json").read_text())["outcome"] == "stopped"
    finally:
        end_jobs(name)


def test_a_killed_gadei_run_leaves_the_job_to_its_supervisor(small, procs):
    path, name, out = small
    run = procs.gadei("run", path)
    roles = _when_training(name)
    run.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    run.wait()
    wait_for(lambda: (out / "result.json").exists(), STOP_WITHIN, "the supervisor to write result.json")
    seconds = time.monotonic() - killed
    result = _outputs_written(out, roles["supervisor"])
    assert (result["outcome"], result["finished"]) == ("done", True), result
    wait_for(lambda: _gone(name), 60, "every process of the job to end")
    last = (out / "logs" / "supervisor.log").read_text().strip().splitlines()[-1]
    assert last.startswith(f"gadei run: job {name} done in "), last
    _say("gadei run", "the supervisor wrote result.json, outcome done", seconds)


def test_a_job_whose_gadei_run_and_supervisor_are_killed_ends_and_resume_goes_on_with_it(small, procs):
    """Nothing of the job runs unwatched: the server and the learners end with their supervisor
    (the server stops cleanly: no region is left), no result.json says anything it did not see,
    and `gadei run --resume` goes on from the newest checkpoint to the job's end."""
    path, name, out = small
    run = procs.gadei("run", path)
    roles = _when_training(name)
    wait_for(lambda: list((out / "checkpoints").glob("ckpt-*.pt")), 60, "a checkpoint")
    run.send_signal(signal.SIGKILL)
    run.wait()
    os.kill(roles["supervisor"], signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: _gone(name), STOP_WITHIN, "the job's server and learners to end with their supervisor")
    seconds = time.monotonic() - killed
    assert not (out / "result.json").exists()
    resumed = procs.gadei("run", path, "--resume")
    stdout, stderr = communicate(resumed, STOP_WITHIN)
    assert resumed.returncode == 0 and "resuming from ckpt-" in stdout and "done in" in stdout, stdout + stderr
    result = _outputs_written(out)
    assert (result["outcome"], result["finished"]) == ("done", True), result
    _say("gadei run and the supervisor", "the job ended; --resume finished it, outcome done", seconds)


def test_a_supervisor_killed_before_any_checkpoint_is_followed_by_one_that_starts_the_job_again(tmp_path, procs):
    """A job shorter than its first checkpoint interval (a job of seconds, the interval a minute):
    with no checkpoint that records the learners' progress, the new supervisor starts the job from
    its start, and the job ends done, its outputs those of the new run alone."""
    name = unique_name("no-ckpt")
    path = blobs_job(tmp_path, name, train={"learners": 2, "epochs": EPOCHS, "patience": EPOCHS, "lr": 0.05},
                     checkpoint={"interval": 600})
    out = tmp_path / "out"
    try:
        run = procs.gadei("run", path)
        roles = _when_training(name, checkpointed=False)  # none comes: every 600 s
        os.kill(roles["supervisor"], signal.SIGKILL)
        stdout, stderr = communicate(run, STOP_WITHIN)
        assert run.returncode == 0 and "done in" in stdout, stdout + stderr
        assert (f"its supervisor (pid {roles['supervisor']}) {KILLED}; a new one goes on from the job's start (no "
                "checkpoint records the learners' progress yet)") in stderr, stderr
        result = _outputs_written(out)  # each epoch once: the first run's records went with it
        assert (result["outcome"], result["finished"]) == ("done", True) and result["written_by"] != \
            roles["supervisor"], result
        wait_for(lambda: _gone(name), 60, "every process of the job to end")
    finally:
        end_jobs(name)


@pytest.mark.long
def test_a_run_killed_with_its_supervisor_before_any_checkpoint_is_not_offered_resume(tmp_path, procs):
    """`gadei run` and its supervisor killed before the first checkpoint: the folder holds only the
    server's stop checkpoint, which does not record the learners' progress. Neither the job file
    run again nor `--resume` sends the user to the other: both say there is nothing to go on with."""
    name = unique_name("no-ckpt")
    path = blobs_job(tmp_path, name, train={"learners": 2, "epochs": EPOCHS, "patience": EPOCHS, "lr": 0.05},
                     checkpoint={"interval": 600})
    try:
        run = procs.gadei("run", path)
        roles = _when_training(name, checkpointed=False)
        run.send_signal(signal.SIGKILL)
        run.wait()
        os.kill(roles["supervisor"], signal.SIGKILL)
        wait_for(lambda: _gone(name), STOP_WITHIN, "the job's server and learners to end with their supervisor")
        assert list((tmp_path / "out" / "checkpoints").glob("ckpt-*.pt")), "the server's stop checkpoint"
        for again in (procs.gadei("run", path), procs.gadei("run", "--resume", path)):
            _, err = communicate(again, 60)
            assert again.returncode == 2 and "records the learners' progress, so there is nothing to go on with; " \
                "to run the job again, set another [output] folder or remove that one" in err, err
            assert "go on with it" not in err, err
    finally:
        end_jobs(name)


def _record(procs, env, name) -> dict:
    out, _ = finish(procs.gadei("status", "--json", env=env))
    return {j["name"]: j for j in json.loads(out.splitlines()[0])["jobs"]}[name]


def _ended(procs, env, name) -> dict | None:
    """The daemon's record of the job once it is no longer running (None before)."""
    record = _record(procs, env, name)
    return record if record["state"] != "running" else None


# a killed server or learner is restarted by the job's supervisor as under `gadei run` (the
# default tier's kills of each role): soak runs; what the daemon itself adds is in the long tier
@pytest.mark.parametrize("role", tiered(["server", "supervisor", "learner", "daemon", "daemon until the job ended",
                                         "daemon and the supervisor"], default=[], soak=["server", "learner"]))
def test_the_daemon_reports_the_real_outcome_when_a_role_of_its_job_is_killed(small, procs, daemon_env, role):
    """The job's supervisor restarts a killed server or learner, as under `gadei run`; a killed
    supervisor is replaced by the daemon from the newest checkpoint, also by a daemon started after
    both died; a killed daemon is restarted (at once, or only after the job ended) and the new one
    finds the job by its record and reports its real outcome. Each time the record says done, and
    the job's seconds count from its start (a replaced supervisor's run goes on in its time base)."""
    path, name, out = small
    daemon = start_daemon(procs, daemon_env)
    finish(procs.gadei("submit", path, env=daemon_env))
    # the record first: a status call takes a second or two, and the small job itself about five
    record = wait_for(lambda: (r := _record(procs, daemon_env, name))["state"] == "running" and r["pid"] and r, 120,
                      "the daemon to run the job", 0.2)
    roles = _when_training(name)
    assert record["pid"] == roles["supervisor"], (record, roles)
    started = psutil.Process(roles["supervisor"]).create_time()  # the job's start: its first supervisor's
    victim = {"server": roles["server"], "supervisor": roles["supervisor"],
              "learner": roles["learners"][0]}.get(role, daemon.pid)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    if role.startswith("daemon"):
        daemon.wait()
        if role == "daemon until the job ended":
            wait_for(lambda: dead(roles["supervisor"]) and (out / "result.json").exists(), STOP_WITHIN,
                     "the job to end while no daemon runs", 0.2)
        if role == "daemon and the supervisor":
            os.kill(roles["supervisor"], signal.SIGKILL)
        daemon = start_daemon(procs, daemon_env)  # the new daemon finds the job by its record
    record = wait_for(lambda: _ended(procs, daemon_env, name), STOP_WITHIN, "the daemon to report the job's end", 0.5)
    seconds = time.monotonic() - killed
    assert record["state"] == "done" and record["pid"] == 0, record
    assert record["message"].startswith(f"job {name} done in "), record
    if role == "daemon until the job ended":
        # when it ended (its result.json's time), not when the new daemon came to read it
        assert abs(record["ended"] - (out / "result.json").stat().st_mtime) < 1, record
    log = (out / "logs" / "supervisor.log").read_text()
    if role == "server":
        assert f"the server pid {victim} {KILLED}" in log, log[-3000:]
    result = _outputs_written(out)
    assert (result["written_by"] != roles["supervisor"]) is role.endswith("supervisor"), (result, roles)
    assert len(result["runs"]) == 1 and abs(result["runs"][0]["started"] - started) < 1, (result["runs"], started)
    assert (result["outcome"], result["finished"]) == ("done", True), result
    assert result["test_accuracy"] > 0.9, result
    wait_for(lambda: _gone(name), 60, "every process of the job to end")
    daemon.terminate()
    communicate(daemon, 60)
    _say(f"{role} under the daemon", f"record {record['state']}, result.json outcome {result['outcome']}", seconds)


@pytest.mark.long
def test_the_daemon_starts_a_job_again_when_its_supervisor_dies_before_any_checkpoint(tmp_path, procs, daemon_env):
    name = unique_name("no-ckpt")
    path = blobs_job(tmp_path, name, train={"learners": 2, "epochs": EPOCHS, "patience": EPOCHS, "lr": 0.05},
                     checkpoint={"interval": 600})
    daemon = start_daemon(procs, daemon_env)
    try:
        finish(procs.gadei("submit", path, env=daemon_env))
        roles = _when_training(name, checkpointed=False)
        os.kill(roles["supervisor"], signal.SIGKILL)
        killed = time.monotonic()
        record = wait_for(lambda: _ended(procs, daemon_env, name), STOP_WITHIN, "the daemon to report the job's end",
                          0.5)
        seconds = time.monotonic() - killed
        assert record["state"] == "done", record
        result = _outputs_written(tmp_path / "out")
        assert (result["outcome"], result["written_by"] != roles["supervisor"]) == ("done", True), result
        wait_for(lambda: _gone(name) or None, 60, "the job's processes to end")
        _say("supervisor (no checkpoint yet) under the daemon", "record done, started again from the job's start",
             seconds)
    finally:
        daemon.terminate()
        communicate(daemon, 60)
        end_jobs(name)
