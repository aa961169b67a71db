"""SIGKILL of each role of a job, under `gadei run` and under the daemon: the reported outcome
(exit status, message, the daemon's record) is the job's real one, and its outputs
(result.json, metrics.jsonl, accuracy.png) are written by whichever process saw it end.

Each case runs a small job (an MLP on 900 numeric samples, two learners, checkpoints every
second), kills one process once the job has made some updates, and measures the seconds
from the kill to a clear stop (the job's outcome reported); `-s` prints them:

    python -m pytest -q -s tests/test_kill_roles.py --long

The default tier kills one role of each kind of supervisor: the server under `gadei run`
(restarted from its checkpoint), `gadei run` itself (its watchdog writes the outputs) and
`gadei run` with its watchdog (the server has a new watchdog adopt the job). The other roles,
the adoption variants and every kill under the daemon, a small job each, are the long tier.
"""

import json
import os
import signal
import time

import psutil
import pytest

from gadei.outputs import epoch_records
from gadei.region import Region, inspect
from helpers import (blobs_job, communicate, dead, end_jobs, finish, job_processes, learner_pids, start_daemon, tiered,
                     unique_name, wait_for)

STOP_WITHIN = 120  # seconds from a kill to a clear stop, at most (the job itself takes about 15 s)
# how a process these tests SIGKILL is said to have ended (`gadei._proc.how_it_ended`)
KILLED = "was killed by SIGKILL (signal 9), sent by a process (not the out-of-memory killer, which killed nothing since it started)"


@pytest.fixture
def small(tmp_path):
    """A job file of a small job, its name and output folder; every process of it is killed at the end."""
    name = unique_name("kill")
    path = blobs_job(tmp_path, name, train={"learners": 2, "epochs": 12, "patience": 12, "lr": 0.05},
                     checkpoint={"interval": 1})
    yield path, name, tmp_path / "out"
    end_jobs(name)


def _roles(name: str) -> dict:
    """The job's server, watchdog and learner pids as its region names them ({} without a region)."""
    try:
        with Region.attach(name, readonly=True) as region:
            h = region.header
            return {"server": h.get("server_pid"), "watchdog": h.get("watchdog_pid"), "version": h.get("version"),
                    "learners": learner_pids(region)}
    except Exception:
        return {}


def _when_training(name: str) -> dict:
    """The roles, once the job has made 600 updates with both learners and its watchdog attached."""
    def ready():
        roles = _roles(name)
        return roles if roles.get("version", 0) >= 600 and roles["watchdog"] and len(roles["learners"]) == 2 else None

    return wait_for(ready, 180, "the job to train with its watchdog and two learners", interval=0.05)


def _outputs_written(out, writer=None) -> dict:
    """result.json, metrics.jsonl of every epoch and the plot; result.json's content."""
    result = json.loads((out / "result.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == list(range(1, 13)), metrics
    assert (out / "accuracy.png").stat().st_size > 1000
    assert not list(out.glob(".*.tmp*")), "a writer's temporary file was left"
    if writer is not None:
        assert result["written_by"] == writer
    return result


def _gone(name: str) -> bool:
    return not job_processes(name) and inspect(name) is None


def _say(case: str, outcome: str, seconds: float) -> None:
    print(f"\nkill {case}: {outcome}; {seconds:.1f} s from the kill to a clear stop", flush=True)


@pytest.mark.parametrize("role", tiered(["server", "watchdog", "learner"], default=["server"]))
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
        assert f"the server {KILLED}; its watchdog restarts it" in stderr, stderr
    if role == "watchdog":
        assert f"its watchdog (pid {pid}) died; starting a new one" in stderr, stderr
    result = _outputs_written(out, run.pid)
    assert (result["outcome"], result["finished"]) == ("done", True), result
    assert result["test_accuracy"] > 0.9, result
    wait_for(lambda: _gone(name), 30, "every process of the job to end")
    _say(f"{role} under gadei run", "gadei run exit 0, result.json outcome done", seconds)


@pytest.mark.long  # four kills and the watchdog's back-off (1 + 2 + 4 s)
def test_a_learner_given_up_ends_gadei_run_with_the_reason(tmp_path, procs):
    """A launched learner that keeps dying is given up after --max-restarts (3) restarts; with
    no learner left the job ends, and the reason reaches gadei run's last line and result.json."""
    name = unique_name("given-up")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 500, "lr": 0.05})
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
            assert "the watchdog gave up on launched learners [0]: they died 4 times" in said, said
        assert result["outcome"] == "failed", result
    finally:
        end_jobs(name)


def _environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().partition("=")[::2] for item in f.read().split(b"\0") if item)


@pytest.mark.long
def test_learners_a_new_watchdog_restarts_run_as_the_first_ones_did(tmp_path, procs):
    """Learners whose threads over-subscribe the cores start passive (`env.learners_openmp_env`);
    a watchdog that `gadei run` has take over from a dead one restarts learners with that
    policy too: it is started in the job's environment, not in `gadei run`'s own."""
    name = unique_name("adopt-env")
    threads = len(os.sched_getaffinity(0))  # 2 learners of as many threads as the cores: over-subscribed anywhere
    path = blobs_job(tmp_path, name, train={"learners": 2, "threads": threads, "epochs": 200, "patience": 200,
                                            "lr": 0.05})
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}  # gadei's choice
    try:
        run = procs.gadei("run", path, env=env)
        roles = _when_training(name)
        for learner in roles["learners"]:
            assert _environment(learner).get("OMP_WAIT_POLICY") == "PASSIVE", _environment(learner)
        os.kill(roles["watchdog"], signal.SIGKILL)

        def new_watchdog():
            dog = _roles(name).get("watchdog")
            return dog if dog and dog != roles["watchdog"] else None
        dog = wait_for(new_watchdog, 60, "a new watchdog to take over")
        os.kill(roles["learners"][0], signal.SIGKILL)
        restarted = wait_for(lambda: next((p for p in _roles(name).get("learners", []) if p not in roles["learners"]),
                                          None), 60, "the new watchdog to restart the killed learner")
        assert psutil.Process(restarted).ppid() == dog
        assert _environment(restarted).get("OMP_WAIT_POLICY") == "PASSIVE", _environment(restarted)
        run.send_signal(signal.SIGTERM)
        stdout, stderr = communicate(run, STOP_WITHIN)
        assert run.returncode == 130, (run.returncode, stdout + stderr)
        assert json.loads((tmp_path / "out" / "result.json").read_text())["outcome"] == "stopped"
    finally:
        end_jobs(name)


@pytest.mark.long
def test_a_watchdog_that_dies_and_cannot_be_replaced_ends_the_job_with_a_clear_error(small, procs):
    path, name, out = small
    run = procs.gadei("run", path)
    roles = _when_training(name)
    os.unlink(os.path.join(os.environ["GADEI_RUNTIME_DIR"], f"{name}.watchdog.json"))  # nothing to adopt from
    os.kill(roles["watchdog"], signal.SIGKILL)
    killed = time.monotonic()
    stdout, stderr = communicate(run, STOP_WITHIN)
    seconds = time.monotonic() - killed
    assert run.returncode == 1, stdout + stderr
    assert f"its watchdog (pid {roles['watchdog']}) died and no new one could take over" in stderr, stderr
    assert "no watchdog state to adopt" in stderr, stderr
    result = json.loads((out / "result.json").read_text())
    assert result["outcome"] == "failed" and "no new one could take over" in result["reason"], result
    assert (out / "metrics.jsonl").exists() and (out / "model.pt").exists()
    wait_for(lambda: _gone(name) or None, 60, "the job's processes to end")  # its orphaned learners stop with it
    _say("watchdog (no state to adopt) under gadei run", "gadei run exit 1, outcome failed", seconds)


def test_a_killed_gadei_run_leaves_the_outputs_to_the_watchdog(small, procs):
    path, name, out = small
    run = procs.gadei("run", path)
    roles = _when_training(name)
    run.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    run.wait()
    wait_for(lambda: (out / "result.json").exists(), STOP_WITHIN, "the watchdog to write result.json")
    seconds = time.monotonic() - killed
    result = _outputs_written(out, roles["watchdog"])
    assert (result["outcome"], result["finished"]) == ("done", True), result
    ending = json.loads((out / "logs" / "watchdog-end.json").read_text())
    assert ending["code"] == 0 and ending["finished"]
    wait_for(lambda: _gone(name), 60, "every process of the job to end")
    _say("gadei run", "the watchdog wrote result.json, outcome done", seconds)


def _kill_run_and_watchdog(procs, path, name, *, adoptable: bool, watchdog_signal=signal.SIGKILL):
    """Start the job, SIGKILL its `gadei run` and then signal its watchdog (nothing supervises
    it after that but its server); the roles before the kill, and the moment of it."""
    run = procs.gadei("run", path)
    roles = _when_training(name)
    if not adoptable:
        os.unlink(os.path.join(os.environ["GADEI_RUNTIME_DIR"], f"{name}.watchdog.json"))  # nothing to adopt from
    run.send_signal(signal.SIGKILL)
    os.kill(roles["watchdog"], watchdog_signal)
    killed = time.monotonic()
    run.wait()
    return roles, killed


@pytest.mark.parametrize("how", tiered(["SIGKILL", "SIGINT"], default=["SIGKILL"]))
def test_a_job_whose_gadei_run_and_watchdog_are_killed_is_adopted_and_finishes(small, procs, how):
    """The server sees that neither its watchdog nor its `gadei run` lives, starts a new
    watchdog that takes over the learners, and that watchdog finishes the job and writes its
    outputs. SIGINT: the watchdog ends on KeyboardInterrupt, clearing its pid in the region as
    it goes, so that the region names no watchdog at all; the job is no less unwatched."""
    path, name, out = small
    roles, killed = _kill_run_and_watchdog(procs, path, name, adoptable=True, watchdog_signal=getattr(signal, how))
    if how == "SIGINT":  # the case under test: it ended naming no watchdog (or, already, the new one)
        wait_for(lambda: dead(roles["watchdog"]), 30, "the interrupted watchdog to end")
        with Region.attach(name, readonly=True) as region:
            assert region.header.get("watchdog_pid") != roles["watchdog"], "the watchdog did not clear its pid"
    wait_for(lambda: (out / "result.json").exists(), STOP_WITHIN, "a new watchdog to finish the job and write "
             "result.json")
    seconds = time.monotonic() - killed
    ending = json.loads((out / "logs" / "watchdog-end.json").read_text())
    assert ending["code"] == 0 and ending["finished"], ending
    assert ending["pid"] not in (roles["watchdog"], roles["server"]), (ending, roles)
    result = _outputs_written(out, ending["pid"])  # the new watchdog wrote them
    assert (result["outcome"], result["finished"]) == ("done", True), result
    assert result["test_accuracy"] > 0.9, result
    log = (out / "logs" / "serve.log").read_text()
    assert f"its watchdog (pid {roles['watchdog']}) and its `gadei run` are gone" in log, log[-3000:]
    assert f"adopted by watchdog pid {ending['pid']};" in log, log[-3000:]
    wait_for(lambda: _gone(name), 60, "every process of the job to end")
    _say("gadei run and the watchdog", "a new watchdog finished the job and wrote result.json, outcome done",
         seconds)


@pytest.mark.long
def test_a_job_whose_gadei_run_and_watchdog_are_killed_and_cannot_be_adopted_fails_clearly(small, procs):
    path, name, out = small
    roles, killed = _kill_run_and_watchdog(procs, path, name, adoptable=False)
    wait_for(lambda: (out / "result.json").exists() and _gone(name), STOP_WITHIN, "the job to end as failed, "
             "every process of it gone")
    seconds = time.monotonic() - killed
    result = json.loads((out / "result.json").read_text())
    assert result["outcome"] == "failed", result
    assert result["reason"].startswith(f"its watchdog (pid {roles['watchdog']}) and its gadei run died and no new "
                                        "watchdog could take over: "), result
    assert "no watchdog state to adopt" in result["reason"], result
    assert result["written_by"] == roles["server"], (result, roles)
    assert (out / "metrics.jsonl").exists() and (out / "model.pt").exists()
    _say("gadei run and the watchdog (no state to adopt)", "the server failed the job, result.json outcome failed",
         seconds)


def _waiting_at(path) -> set[int]:
    """The pids that wait for the flock on `path` (/proc/locks lists each waiter after "->")."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as locks:
        return {int(f[5]) for f in (line.split() for line in locks) if f[1] == "->" and f[6].endswith(f":{inode}")}


@pytest.mark.long
def test_a_job_whose_gadei_run_and_watchdog_die_while_it_stops_is_ended_by_its_server(small, procs):
    """The job was asked to stop, and its watchdog and `gadei run` die before the watchdog
    recorded the end (the server no longer serves, so nothing is adopted): the server, once it
    stopped, records the end and writes the outputs (outcome stopped: not every learner was done)."""
    from gadei.protocol import RunState

    path, name, out = small
    run = procs.gadei("run", path)
    roles = _when_training(name)
    # an epoch done before the stop, whose metrics the server's outputs must keep (600 updates
    # are not always learner 0's first epoch on a loaded machine: CI dry run, an empty metrics.jsonl)
    wait_for(lambda: epoch_records(out), 180, "learner 0's first epoch record")
    run.send_signal(signal.SIGKILL)
    run.wait()
    os.kill(roles["server"], signal.SIGSTOP)  # held until the watchdog is gone, so that it cannot record the end
    try:
        with Region.attach(name) as region:
            assert RunState(region).request_stop()
        os.kill(roles["watchdog"], signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: dead(roles["watchdog"]), 30, "the watchdog to die")
    finally:
        os.kill(roles["server"], signal.SIGCONT)
    wait_for(lambda: (out / "result.json").exists() and _gone(name), STOP_WITHIN, "the server to write result.json "
             "and every process of the job to end")
    seconds = time.monotonic() - killed
    ending = json.loads((out / "logs" / "watchdog-end.json").read_text())
    assert ending["pid"] == roles["server"] and not ending["finished"], ending
    assert "died while the job was stopping" in ending["reason"], ending
    result = json.loads((out / "result.json").read_text())
    assert result["outcome"] == "stopped" and result["written_by"] == roles["server"], result
    assert (out / "metrics.jsonl").stat().st_size > 0 and (out / "accuracy.png").stat().st_size > 1000
    _say("gadei run, then the watchdog while the job stops", "the server recorded the end, result.json outcome "
         "stopped", seconds)


@pytest.mark.long
def test_two_adoptions_at_once_leave_one_watchdog_and_the_loser_says_so(small, procs):
    """gadei run and a second `gadei serve --adopt` take over a dead watchdog at the same moment
    (held at the registration lock until both wait there): one registers, the other stands
    down with a true message, and the job finishes."""
    from gadei.watchdog_record import lock_path, registering

    path, name, out = small
    run = procs.gadei("run", path)
    roles = _when_training(name)
    with registering(name):
        lock = lock_path(name)
        os.kill(roles["watchdog"], signal.SIGKILL)
        wait_for(lambda: len(_waiting_at(lock)) == 1, 60, "gadei run's new watchdog to wait at the lock")
        other = procs.gadei("serve", name, "--adopt")
        waiting = wait_for(lambda: len(w := _waiting_at(lock)) == 2 and w, 60, "the second new watchdog to wait")
        time.sleep(1.0)  # both wait: neither registers while the lock is held
        assert _roles(name)["watchdog"] == roles["watchdog"], "a watchdog registered without the lock"
    _, said = communicate(other, 90)
    stdout, stderr = communicate(run, STOP_WITHIN)
    assert run.returncode == 0, stdout + stderr
    result = _outputs_written(out, run.pid)
    assert result["outcome"] == "done", result
    winner = json.loads((out / "logs" / "watchdog-end.json").read_text())["pid"]  # it watched the job to its end
    assert winner in waiting, (winner, waiting)
    if other.returncode == 0:
        assert f"adopted by watchdog pid {winner};" in said, said
    else:
        assert (f"job {name!r} was adopted by watchdog pid {winner} at the same moment; this one stood down" in said
                or f"exited with code 2: job {name!r} already has a live watchdog (pid {winner})" in said), said
    log = (out / "logs" / "watchdog.log").read_text()
    assert f"job {name!r} already has a live watchdog (pid {winner})" in log, log[-3000:]  # the loser's refusal
    wait_for(lambda: _gone(name), 60, "every process of the job to end")
    assert not os.path.exists(lock), "the registration lock outlived the job"  # the watchdog removed it at the end


@pytest.mark.long
def test_a_watchdog_that_dies_while_its_job_stops_is_not_said_to_be_left_to_no_one(small, procs):
    """The job was asked to stop, and its watchdog dies with nothing to adopt from before its
    server stopped (held with SIGSTOP across the stop request and the kill): gadei run's
    adoption fails, but the job no longer serves, so nothing was left to take over; gadei run
    says so, and does not claim that no new watchdog could take over (nor fail the job for it)."""
    from gadei.protocol import RunState

    path, name, out = small
    run = procs.gadei("run", path)
    roles = _when_training(name)
    os.kill(roles["server"], signal.SIGSTOP)
    try:
        with Region.attach(name) as region:
            assert RunState(region).request_stop()
        os.unlink(os.path.join(os.environ["GADEI_RUNTIME_DIR"], f"{name}.watchdog.json"))  # nothing to adopt from
        os.kill(roles["watchdog"], signal.SIGKILL)

        def adopting():
            return [p for p in psutil.Process(run.pid).children() if "--adopt" in p.cmdline()]

        adopter = wait_for(adopting, 60, "gadei run's `gadei serve --adopt`", interval=0.02)[0]
        wait_for(lambda: not psutil.pid_exists(adopter.pid) or adopter.status() == psutil.STATUS_ZOMBIE, 90,
                 "gadei run's adoption to end")
    finally:
        os.kill(roles["server"], signal.SIGCONT)
    stdout, stderr = communicate(run, STOP_WITHIN)
    assert f"its watchdog (pid {roles['watchdog']}) died; starting a new one" in stderr, stderr
    assert "no watchdog state to adopt" in stderr and "the job no longer serves: nothing is left to take over" \
        in stderr, stderr
    assert "no new one could take over" not in stderr, stderr
    result = json.loads((out / "result.json").read_text())
    assert "no new one could take over" not in result["reason"], result
    wait_for(lambda: _gone(name), 60, "every process of the job to end")


@pytest.mark.long
def test_a_job_whose_watchdog_dies_before_it_registers_is_ended_by_its_server(small, procs, tmp_path):
    """The server of a `gadei run` job (--outputs) whose watchdog dies before it registers in
    the header (here it may not use the runtime folder: others can write to it), and no `gadei
    run` holds the outputs: after the watchdog's `interval * max_missed` seconds the server's
    custody counts the job unwatched, no new watchdog can take over, and the job ends failed
    with the reason, where before it was served with no watchdog and no learners forever."""
    path, name, out = small
    (out / "logs").mkdir(parents=True)
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    runtime.chmod(0o777)  # refused by every watchdog of the job (gadei.env.runtime_dir)
    serve = procs.gadei("serve", name, "--job-file", path, "--checkpoint-dir", tmp_path / "checkpoints",
                        "--outputs", out, "--watch-interval", "0.2", "--max-missed", "10",
                        env={"GADEI_RUNTIME_DIR": str(runtime)})
    _, stderr = communicate(serve, STOP_WITHIN)
    ending = json.loads((out / "logs" / "watchdog-end.json").read_text())
    assert ending["pid"] == serve.pid and ending["code"] != 0, ending
    assert ending["reason"].startswith("its watchdog (none registered within 2 s) and its gadei run died and no new "
                                       "watchdog could take over: "), ending
    assert inspect(name) is None, "the server left its region"


def _record(procs, env, name) -> dict:
    out, _ = finish(procs.gadei("status", "--json", env=env))
    return {j["name"]: j for j in json.loads(out.splitlines()[0])["jobs"]}[name]


@pytest.mark.long
def test_the_daemon_reports_the_real_outcome_when_gadei_run_the_server_and_the_daemon_are_killed(small, procs,
                                                                                                 daemon_env):
    path, name, out = small
    daemon = start_daemon(procs, daemon_env)
    finish(procs.gadei("submit", path, env=daemon_env))
    # the record first: a status call takes seconds under load, and the small job may end meanwhile
    run_pid = wait_for(lambda: (r := _record(procs, daemon_env, name))["state"] == "running" and r["pid"], 120,
                       "the daemon to run the job", 0.2)
    os.environ["GADEI_RUNTIME_DIR"], saved = daemon_env["GADEI_RUNTIME_DIR"], os.environ["GADEI_RUNTIME_DIR"]
    try:
        roles = _when_training(name)
    finally:
        os.environ["GADEI_RUNTIME_DIR"] = saved
    os.kill(roles["server"], signal.SIGKILL)
    os.kill(run_pid, signal.SIGKILL)
    killed = time.monotonic()
    # the record as the daemon first shows the death (the small job may end soon after: read it once)
    record = wait_for(lambda: (r := _record(procs, daemon_env, name))["orphaned"] and r, 30,
                      "the daemon to see gadei run die", 0.2)
    assert KILLED in record["message"] and record["state"] in ("running", "done"), record
    daemon.send_signal(signal.SIGKILL)
    daemon.wait()
    daemon = start_daemon(procs, daemon_env)  # a new daemon finds the job by its record and its region
    record = wait_for(lambda: (r := _record(procs, daemon_env, name))["state"] != "running" and r, STOP_WITHIN,
                      "the job's end", 0.5)
    seconds = time.monotonic() - killed
    assert record["state"] == "done", record
    result = _outputs_written(out)
    assert (result["outcome"], result["finished"]) == ("done", True), result
    wait_for(lambda: _gone(name), 60, "every process of the job to end")
    _say("server, then gadei run, then the daemon, under the daemon", "record done, result.json outcome done",
         seconds)


def _ended(procs, env, name) -> dict | None:
    """The daemon's record of the job once it is no longer running (None before)."""
    record = _record(procs, env, name)
    return record if record["state"] != "running" else None


@pytest.mark.long
@pytest.mark.parametrize("role", ["server", "watchdog", "learner", "gadei run", "daemon", "daemon until the job ended"])
def test_the_daemon_reports_the_real_outcome_when_a_role_of_its_job_is_killed(small, procs, daemon_env, role):
    """The daemon's `gadei run` of the job follows a killed server, watchdog or learner as it
    does in the foreground, and the daemon's record says done; a killed `gadei run` leaves the
    job to its watchdog, which the daemon follows (orphaned) to its end; a killed daemon is
    restarted (at once, or only after the job ended) and the new one finds the job by its
    record and reports its real outcome."""
    path, name, out = small
    daemon = start_daemon(procs, daemon_env)
    finish(procs.gadei("submit", path, env=daemon_env))
    # the record first: a status call takes a second or two, and the small job itself about five
    record = wait_for(lambda: (r := _record(procs, daemon_env, name))["state"] == "running" and r["pid"] and r, 120,
                      "the daemon to run the job", 0.2)
    run_pid = record["pid"]
    roles = _when_training(name)
    victim = {"server": roles["server"], "watchdog": roles["watchdog"], "learner": roles["learners"][0],
              "gadei run": run_pid}.get(role, daemon.pid)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    if role.startswith("daemon"):
        daemon.wait()
        if role == "daemon until the job ended":
            wait_for(lambda: not psutil.pid_exists(run_pid) and (out / "result.json").exists(), STOP_WITHIN,
                     "the job to end while no daemon runs", 0.2)
        daemon = start_daemon(procs, daemon_env)  # the new daemon finds the job by its record
    record = wait_for(lambda: _ended(procs, daemon_env, name), STOP_WITHIN, "the daemon to report the job's end", 0.5)
    seconds = time.monotonic() - killed
    assert record["state"] == "done" and record["returncode"] in (0, None), record
    assert record["orphaned"] == (role == "gadei run") and record["pid"] == 0, record
    if role == "gadei run":
        assert f"its `gadei run` (pid {run_pid}) {KILLED}" in record["message"], record
    if role == "daemon until the job ended":
        assert "ended while the daemon was down" in record["message"], record
        # when it ended (its result.json's time), not when the new daemon came to read it
        assert abs(record["ended"] - (out / "result.json").stat().st_mtime) < 1, record
    else:  # the new daemon found the job's gadei run alive and followed it to its end
        assert "ended while the daemon was down" not in record["message"], record
    if role in ("server", "watchdog", "learner"):
        assert record["returncode"] == 0, record  # the daemon's own child: its exit status is known
    log = (out / "logs" / "run.log").read_text()
    if role == "server":
        assert f"the server {KILLED}; its watchdog restarts it" in log, log[-3000:]
    if role == "watchdog":
        assert f"its watchdog (pid {victim}) died; starting a new one" in log, log[-3000:]
    # the job's gadei run wrote them, or its watchdog where gadei run was killed
    result = _outputs_written(out, roles["watchdog"] if role == "gadei run" else run_pid)
    assert (result["outcome"], result["finished"]) == ("done", True), result
    assert result["test_accuracy"] > 0.9, result
    wait_for(lambda: _gone(name), 60, "every process of the job to end")
    daemon.terminate()
    communicate(daemon, 60)
    _say(f"{role} under the daemon", f"record {record['state']}, result.json outcome {result['outcome']}", seconds)


@pytest.mark.long
def test_the_daemon_reports_a_failed_job_when_its_watchdog_dies_and_cannot_be_replaced(small, procs, daemon_env):
    path, name, out = small
    daemon = start_daemon(procs, daemon_env)
    finish(procs.gadei("submit", path, env=daemon_env))
    roles = _when_training(name)
    os.unlink(os.path.join(daemon_env["GADEI_RUNTIME_DIR"], f"{name}.watchdog.json"))  # nothing to adopt from
    os.kill(roles["watchdog"], signal.SIGKILL)
    killed = time.monotonic()
    record = wait_for(lambda: _ended(procs, daemon_env, name), STOP_WITHIN, "the daemon to report the job's end", 0.5)
    seconds = time.monotonic() - killed
    assert (record["state"], record["returncode"]) == ("failed", 1), record
    assert "no new one could take over" in record["message"], record
    result = json.loads((out / "result.json").read_text())
    assert result["outcome"] == "failed" and "no new one could take over" in result["reason"], result
    wait_for(lambda: _gone(name) or None, 60, "the job's processes to end")
    daemon.terminate()
    communicate(daemon, 60)
    _say("watchdog (no state to adopt) under the daemon", "record failed, result.json outcome failed", seconds)


@pytest.mark.long
def test_the_daemon_reports_done_when_gadei_run_and_the_watchdog_are_killed(small, procs, daemon_env):
    """The daemon follows the job as orphaned; its server has a new watchdog adopt it, which
    finishes it and writes the outputs; the daemon's record says done."""
    path, name, out = small
    daemon = start_daemon(procs, daemon_env)
    finish(procs.gadei("submit", path, env=daemon_env))
    record = wait_for(lambda: (r := _record(procs, daemon_env, name))["state"] == "running" and r["pid"] and r, 120,
                      "the daemon to run the job", 0.2)
    roles = _when_training(name)
    os.kill(record["pid"], signal.SIGKILL)
    os.kill(roles["watchdog"], signal.SIGKILL)
    killed = time.monotonic()
    record = wait_for(lambda: _ended(procs, daemon_env, name), STOP_WITHIN, "the daemon to report the job's end", 0.5)
    seconds = time.monotonic() - killed
    assert record["state"] == "done" and record["orphaned"], record
    ending = json.loads((out / "logs" / "watchdog-end.json").read_text())
    assert ending["pid"] not in (roles["watchdog"], roles["server"]), (ending, roles)
    result = _outputs_written(out, ending["pid"])  # the watchdog the server started wrote them
    assert (result["outcome"], result["finished"]) == ("done", True), result
    wait_for(lambda: _gone(name), 60, "every process of the job to end")
    daemon.terminate()
    communicate(daemon, 60)
    _say("gadei run and the watchdog under the daemon", "a new watchdog finished the job; record done, result.json "
         "outcome done", seconds)
