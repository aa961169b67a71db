"""The supervisor with real processes, as `gadei serve --checkpoint-dir` starts it (the command
becomes it, and it starts the job's server as its child): it checkpoints a training job every
few seconds (whole updates only), reports dead and hung learners, stops the job when asked
(SIGTERM) with a checkpoint, restarts a killed server from its last checkpoint, gives up after
too many restarts, and restarts, gives up on or checkpoints for the learners it launched."""

import contextlib
import json
import os
import re
import shutil
import signal
import time

import numpy as np
import psutil
import pytest

from helpers import communicate, end_jobs, finish, learner_pids, read_line, small_job, unique_name, wait_for
from gadei import _proc, checkpoint
from gadei.errors import GadeiError
from gadei.region import Region, inspect

pytestmark = pytest.mark.faults  # also run on a loaded machine: `--busy 2 -m faults` (docs/testing.md)

N = 200_000


def _whole(ckpt) -> bool:
    expected = -0.125 * ckpt.version  # the first pusher uploaded zeros; each push adds 1 to the gradient
    return all(bool((t == expected).all()) for t in ckpt.model.values())


def _job(procs, job, folder, learners=2):
    """`gadei serve --params N --checkpoint-dir` (its supervisor, same pid) and `learners` pushers
    that push a gradient of ones at every step; once they push."""
    supervised = procs.gadei("serve", job, "--params", N, "--lr", 0.125, "--learners", learners, "--checkpoint-dir",
                             folder, "--checkpoint-every", 0.3, "--watch-interval", 0.1, "--max-missed", 10)
    wait_for(lambda: _served(job), 60, "the server")
    with Region.attach(job, readonly=True) as region:
        wait_for(lambda: region.header.get("supervisor_pid") == supervised.pid, 60, "the supervisor to register")
    pushers = [procs.worker("push", job, "--n", N, "--steps", 10**9) for _ in range(learners)]
    for pusher in pushers:
        read_line(pusher, 60)
        read_line(pusher, 60)
    return supervised, pushers


def test_the_supervisor_checkpoints_a_training_job_and_stops_it_when_asked(job, procs, tmp_path):
    try:
        supervised, _ = _job(procs, job, tmp_path)
        wait_for(lambda: len(checkpoint.listing(tmp_path)) >= 4, 60, "four checkpoints")
        supervised.send_signal(signal.SIGTERM)  # a stop it takes: a checkpoint, then the server's
        _, err = communicate(supervised, 60)
        assert supervised.returncode == 0, err
        assert "stopping the job, as asked" in err, err
        saved = [checkpoint.load(path) for path in checkpoint.listing(tmp_path)]
        assert len(saved) == 3  # --keep 3: the server's own at its stop among them
        assert all(_whole(c) for c in saved) and [c.version for c in saved] == sorted(c.version for c in saved)
        assert saved[-1].config["n_params"] == N and len(saved[-1].learners) == 2
        assert inspect(job) is None
    finally:
        end_jobs(job)


def test_a_checkpoint_that_fails_the_same_way_again_is_an_error_once_and_the_first_one_written_after_is_said(
        job, procs, tmp_path):
    """A full disk stays full: `gadei run` showed the same error line at every checkpoint (11
    lines in a minute's job). The first failure is an error; its repeats are logged at INFO
    ("either"), and the first checkpoint written after them says so as a warning."""
    folder = tmp_path / "checkpoints"
    try:
        supervised, _ = _job(procs, job, folder)
        wait_for(lambda: checkpoint.listing(folder), 60, "a checkpoint")

        def a_file_in_its_place() -> bool:
            """Every checkpoint fails from now on, the same way. The folder is moved away whole
            first: removed in place, a checkpoint written as it went left it not empty."""
            gone = tmp_path / f"gone-{time.monotonic_ns()}"
            with contextlib.suppress(FileNotFoundError):
                folder.rename(gone)
            shutil.rmtree(gone, ignore_errors=True)
            try:
                folder.write_text("a file where the folder was")
            except IsADirectoryError:  # the supervisor made it again meanwhile
                return False
            return True
        wait_for(a_file_in_its_place, 60, "a file in the checkpoint folder's place")
        failing = lambda: [line for line in supervised.err_lines if "no checkpoint this time" in line]  # noqa: E731
        wait_for(lambda: len(failing()) >= 4, 60, "four failed checkpoints")
        folder.unlink()
        wait_for(lambda: any("checkpoints are written again" in line for line in supervised.err_lines), 60,
                 "a checkpoint written again")
        supervised.send_signal(signal.SIGTERM)
        _, err = communicate(supervised, 60)
        assert supervised.returncode == 0 and checkpoint.listing(folder), err
        # (level, "either", why) of each; a write that ran as the folder went may have failed otherwise first
        said = [re.search(r" (ERROR|INFO) job '[^']+': no checkpoint this time( either)?: (.*)$", line).groups()
                for line in failing()]
        assert all((level, either) == (("INFO", " either") if i and why == said[i - 1][2] else ("ERROR", None))
                   for i, (level, either, why) in enumerate(said)), said
        assert said[-1][2] == said[-2][2] and said[-1][2].endswith("File exists"), said
        assert [line for line in err.splitlines() if "written again" in line][0].split()[3] == "WARNING", err
    finally:
        end_jobs(job)


def test_the_supervisor_reports_dead_and_hung_learners(job, procs, tmp_path):
    try:
        supervised, (killed, stopped) = _job(procs, job, tmp_path)
        killed.send_signal(signal.SIGKILL)
        stopped.send_signal(signal.SIGSTOP)
        wait_for(lambda: sum(1 for line in supervised.err_lines if "learner" in line and "pid" in line) >= 2, 60,
                 "the supervisor to report both learners")
        lines = [line for line in supervised.err_lines if " learner " in line]
        assert any(f"(pid {killed.pid}) is gone" in line for line in lines), lines
        assert any(f"(pid {stopped.pid}) has not beaten" in line for line in lines), lines
        stopped.send_signal(signal.SIGCONT)
        wait_for(lambda: any(f"(pid {stopped.pid}) beats again" in line for line in supervised.err_lines), 60,
                 "the supervisor to see the learner beat again")
        finish(procs.gadei("stop", job))
        communicate(supervised, 60)
        assert supervised.returncode == 0
    finally:
        end_jobs(job)


def _served(job) -> int:
    """The pid of the server that serves `job` now (0: none)."""
    found = inspect(job)
    return found.server_pid if found is not None and found.state == "running" else 0


def _served_by_another(job, pid):
    found = inspect(job)
    return found is not None and found.state == "running" and found.server_pid != pid and found.server_pid


def test_gadei_serve_restarts_a_killed_server_from_its_last_checkpoint(job, procs, tmp_path):
    """`gadei serve --checkpoint-dir` becomes the job's supervisor (same pid), which starts the
    server as its child and restarts it when it is killed, from the newest checkpoint."""
    try:
        supervised = procs.gadei("serve", job, "--params", N, "--lr", 0.125, "--learners", 2, "--checkpoint-dir",
                                 tmp_path, "--checkpoint-every", 0.3)
        first = wait_for(lambda: _served(job), 60, "the server")
        assert psutil.Process(first).ppid() == supervised.pid
        with Region.attach(job, readonly=True) as region:
            wait_for(lambda: region.header.get("supervisor_pid") == supervised.pid, 60, "the supervisor")
        pusher = procs.worker("push", job, "--n", N, "--steps", 10**9)
        read_line(pusher, 60)
        read_line(pusher, 60)
        wait_for(lambda: (checkpoint.latest(tmp_path) or None) and checkpoint.latest(tmp_path).version > 0, 60,
                 "a checkpoint of some training")
        os.kill(first, signal.SIGKILL)
        new_pid = wait_for(lambda: _served_by_another(job, first), 120, "the supervisor to restart the server")
        restarted = psutil.Process(new_pid)
        assert restarted.ppid() == supervised.pid
        last = checkpoint.latest(tmp_path)
        with Region.attach(job, readonly=True) as region:
            version = region.header.get("version")
            # the first learner uploaded 0
            assert version == last.version and np.all(region.weights == -0.125 * version)
            assert region.header.get("resumed_applied") == last.applied
            # the same supervisor goes on watching the new region
            wait_for(lambda: region.header.get("supervisor_pid") == supervised.pid, 60,
                     "the supervisor to register again")
        assert any("restarting the server" in line for line in supervised.err_lines)
        out, _ = finish(procs.gadei("status", job, "--json", "--interval", "0.1"))
        status = json.loads(out.splitlines()[-1])
        assert (status["restarts"], status["supervisor_pid"], status["supervisor_alive"]) == (1, supervised.pid, True)
        assert status["checkpointed_version"] >= last.version
        text, _ = finish(procs.gadei("status", job, "--interval", "0.1"))
        assert f"supervisor: pid {supervised.pid} alive" in text and "1 server restarts" in text
        said = f"the server pid {first} was killed by SIGKILL (signal 9), sent by a process (not the out-of-memory"
        assert any(said in line for line in supervised.err_lines), supervised.err_lines
        restarted.kill()
        wait_for(lambda: _served_by_another(job, new_pid), 120, "the supervisor to restart the server again")
        out = procs.gadei("stop", job)
        communicate(out, 60)
        assert out.returncode == 0
        _, err = communicate(supervised, 60)  # it sees the job stopped, reaps the server and ends
        assert supervised.returncode == 0, err
        assert inspect(job) is None
    finally:
        end_jobs(job)


def test_the_supervisor_gives_up_after_too_many_restarts(job, procs, tmp_path):
    recent = ",".join(str(time.time() - k) for k in range(3))
    supervised = procs.gadei("serve", job, "--params", 100, "--checkpoint-dir", tmp_path, "--checkpoint-every", 0.3,
                             env={"GADEI_RESTARTS": recent})
    server = wait_for(lambda: _served(job), 60, "the server")
    with Region.attach(job, readonly=True) as region:
        wait_for(lambda: region.header.get("supervisor_pid") != 0, 60, "the supervisor")
    os.kill(server, signal.SIGKILL)
    try:
        _, err = communicate(supervised, 60)
    finally:
        end_jobs(job, keep_regions=True)
    assert supervised.returncode == 3, err
    assert inspect(job).state == "leftover"
    assert "gave up: the server was restarted 3 times within 300 s" in err, err


@pytest.mark.long  # a job of 10-15 s
def test_a_launched_learner_that_keeps_failing_is_given_up_and_the_job_ends(job, procs, tmp_path):
    serve = procs.gadei("serve", job, "--params", 1000, "--checkpoint-dir", tmp_path, "--checkpoint-every", 60,
                        "--max-restarts", 1, "--learner", f"--data trec:{tmp_path}/no-such-folder --epochs 1")
    _, err = communicate(serve, 120)
    assert serve.returncode == 4, err  # the supervisor's: it gave up on a launched learner
    missing = f"(TREC file '{tmp_path}/no-such-folder/TREC.train': No such file or directory)"  # its own line, quoted
    assert (f"launched learner 0 exited with code 2 {missing} after 0 samples of its schedule; starting it again "
            "in 1 s") in err, err
    assert f"launched learner 0 exited with code 2 {missing}; gave up on it: it died 2 times within 300 s" in err, err
    assert f"job {job!r} ended without learners [0] (given up)" in err
    said = (tmp_path / "learner-0.log").read_text()
    assert said.count("gadei: error: TREC file") == 2 and "Traceback" not in said  # both runs said why, plainly
    assert inspect(job) is None


@pytest.mark.long  # a job of 10-15 s
def test_launched_learners_that_all_die_within_moments_are_seen_dying_at_once(job, procs, tmp_path):
    """Two of three launched learners die, and the third a moment later, after the supervisor
    already saw the first two: still all at once (the third before the others were restarted),
    so the supervisor checkpoints the server's weights before they go on."""
    learner = "--data generated --epochs 1000 --batch 2"
    serve = procs.gadei("serve", job, "--workload", "textcnn", "--data", "generated", "--learners", 3,
                        "--checkpoint-dir", tmp_path, "--checkpoint-every", 600, "--watch-interval", 0.1,
                        "--learner", learner, "--learner", learner, "--learner", learner)

    def learners() -> list[int]:
        try:
            with Region.attach(job, readonly=True) as region:
                return learner_pids(region)
        except GadeiError:  # not there yet
            return []
    try:
        wait_for(lambda: len(learners()) == 3, 120, "three launched learners to attach")
        first, second, third = learners()
        for pid in (first, second):
            psutil.Process(pid).kill()
        time.sleep(0.5)  # the fault is the gap: the supervisor (a look every 0.1 s) sees these two die first
        psutil.Process(third).kill()
        wait_for(lambda: len(learners()) == 3 and third not in learners(), 60, "the learners to be restarted")
    finally:
        end_jobs(job)
    err = finish(serve, 60)[1]
    assert "all launched learners died; checkpointing the server's weights" in err, err[-3000:]
    assert len(checkpoint.listing(tmp_path)) >= 1


@pytest.mark.parametrize("flag, value, expected", [
    ("--server", '{"serve": 1}', "is a JSON object; allowed: a JSON list of strings"),
    ("--server", '["serve", 1]', "holds 1, not a string; allowed: a JSON list of strings"),
    ("--learners", '[["--epochs", 1]]', 'holds ["--epochs", 1], not a list of strings; allowed: a JSON list of lists'),
    ("--learners", "--epochs 1", "is not a JSON list; allowed: a JSON list of lists of strings"),
    ("--progress", "[0]", "is not a checkpoint's progress; allowed: a JSON object"),
])
def test_the_supervisors_json_flags_are_checked_even_under_python_dash_o(job, procs, tmp_path, flag, value,
                                                                        expected):
    """Checked by code, not `assert`, which `python -O` drops (the bad value then went on to the
    supervisor: a learner `gadei learn JOB 1`, a progress table that is a list)."""
    command = _proc.python_command("gadei_watchdog", job, "--checkpoint-dir", tmp_path, f"{flag}={value}")
    dog = procs.spawn([command[0], "-O", *command[1:]])
    _, err = communicate(dog, 60)
    assert dog.returncode == 2 and f"gadei supervisor: error: argument {flag}: " in err and expected in err, err


def test_a_job_files_supervisor_named_for_another_job_refuses_it_and_starts_nothing(small, procs):
    """`gadei run` and the daemon start it as `gadei_watchdog NAME --job-file FILE` (so `ps` shows
    the job's name): a name that is not the job file's is refused before anything starts."""
    name = unique_name("named")
    (small / "job.toml").write_text(small_job(name) + "[train]\nepochs = 1\n")
    dog = procs.spawn(_proc.python_command("gadei_watchdog", "other", "--job-file", small / "job.toml"))
    _, err = communicate(dog, 60)
    assert dog.returncode == 2 and f"gadei supervisor: error: {small / 'job.toml'} holds job '{name}', not 'other'" \
        in err, err
    assert not (small / "runs").exists() and inspect(name) is None


def test_a_file_where_the_checkpoint_folder_goes_is_refused_before_anything_starts(job, procs, tmp_path):
    """It was a FileExistsError's traceback as the server started (its log goes there)."""
    (tmp_path / "ckpt").write_text("a file")
    serve = procs.gadei("serve", job, "--params", 1000, "--checkpoint-dir", tmp_path / "ckpt")
    _, err = communicate(serve, 60)
    assert serve.returncode == 2 and "Traceback" not in err, err
    assert f"supervisor checkpoint_dir = '{tmp_path / 'ckpt'}' is not a folder (a file is in its place)" in err \
        and inspect(job) is None, err
    os.mkfifo(tmp_path / "logs")  # or something else: what is there is said
    serve = procs.gadei("serve", job, "--params", 1000, "--checkpoint-dir", tmp_path / "c",
                        "--log-dir", tmp_path / "logs")
    _, err = communicate(serve, 60)
    assert serve.returncode == 2 and "is not a folder (a FIFO is in its place)" in err, err


def test_a_job_supervisor_that_refused_is_not_started_again_where_one_that_died_is(tmp_path, procs, monkeypatch):
    """`Supervised.ended`, as `gadei run` and the daemon follow a job file's supervisor: one that
    exited 2 said why on its last line (it refused: not even result.json could be written, a full
    disk), and is not started again from the newest checkpoint to fail the same way; one that died
    (exit 1, a signal) is."""
    import sys

    import torch

    from gadei.supervisor import Supervised

    out = tmp_path / "out"
    checkpoint.save(out / "checkpoints", checkpoint.Checkpoint("refused", 7, 7, {"w": torch.zeros(2)},
                                                               progress={"0": 5}))
    supervised = Supervised("refused", out / "job.toml", out, by="gadei run")
    started = []
    monkeypatch.setattr(supervised, "start", lambda resume=False, said=(): started.append(resume))
    for code in (2, 1):
        supervised.proc = procs.spawn([sys.executable, "-c", f"raise SystemExit({code})"])
        supervised.proc.wait(60)
        supervised.pid = supervised.proc.pid
        ended = supervised.ended()
        if code == 2:
            assert ended == {"outcome": None, "resumable": True, "reason": f"its supervisor (pid {supervised.pid}) "
                             "exited with code 2 and no new one goes on with the job (it refused to go on)"} \
                and started == [], ended
    assert ended is None and started == [True]


def test_a_job_whose_result_cannot_be_written_ends_once_and_gadei_run_says_why(tmp_path, procs):
    """The whole path of a job whose supervisor cannot write even result.json (a full disk; here a
    folder in its place, which fails its write as surely): the supervisor's last line names the
    file and why, it exits 2, and `gadei run` does not start a new one from the newest checkpoint
    to fail the same way: its last line says so, and nothing of the job runs on."""
    from helpers import blobs_job, job_processes, job_version, unique_name

    name = unique_name("unwritable")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 40, "patience": 40},
                     checkpoint={"interval": 1})
    out = tmp_path / "out"
    run = procs.gadei("run", path)
    try:
        wait_for(lambda: job_version(name) > 0 or run.poll() is not None, 120, "the job to train")
        (out / "result.json").mkdir()  # before the job's end: its training takes seconds
        stdout, stderr = communicate(run, 300)
        said = stdout + stderr
        assert run.returncode == 1, said
        assert (f"exited with code 2 and no new one goes on with the job (it refused to go on: job {name!r}: its "
                f"outputs in {out} are not written (not even result.json): {out / 'result.json'}: Is a directory)"
                ) in said, said
        assert "a new one goes on" not in said and "Traceback" not in said, said
        assert (out / "result.json").is_dir() and not job_processes(name) and inspect(name) is None
    finally:
        for proc in job_processes(name):
            proc.kill()


def test_a_job_that_gave_up_its_learner_says_the_learners_own_error_in_result_json(tmp_path, procs):
    """A learner of a `gadei run` job is killed once its data file is gone: each learner started
    again refuses (exit 2, its error line), the supervisor gives it up, and the job's reason
    (result.json, `gadei run`'s last line) quotes that line, not only "see their logs"."""
    from helpers import blobs_job, job_processes, job_version, unique_name

    name = unique_name("givenup")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 100_000, "patience": 100_000})
    out = tmp_path / "out"
    run = procs.gadei("run", path)
    try:
        wait_for(lambda: job_version(name) > 0 or run.poll() is not None, 120, "the job to train")
        (tmp_path / "blobs.npz").unlink()
        with Region.attach(name, readonly=True) as region:
            [learner] = learner_pids(region)
        psutil.Process(learner).kill()
        stdout, stderr = communicate(run, 300)
        said = stdout + stderr
        assert run.returncode == 1 and "Traceback" not in said, said
        result = json.loads((out / "result.json").read_text())
        error = f"learner 0's last error: job.toml: [data] train = '{tmp_path / 'blobs.npz'}': no such file"
        assert result["outcome"] == "failed" and error in result["reason"], result
        assert error in said and not job_processes(name) and inspect(name) is None, said
    finally:
        for proc in job_processes(name):
            proc.kill()


def test_a_child_that_does_not_exit_in_time_is_killed_and_reaped(procs):
    """`_proc.wait_or_kill`, the one "wait, else kill" (a supervisor's server and its launched
    learners at the job's end)."""
    from gadei._proc import wait_or_kill

    done = procs.spawn(["true"])
    assert wait_or_kill(done, 30, "a child that exits") == 0
    stuck = procs.spawn(["sleep", "60"])
    started = time.monotonic()
    assert wait_or_kill(stuck, 0.2, "a child that does not") == -signal.SIGKILL
    assert time.monotonic() - started < 10 and stuck.poll() == -signal.SIGKILL


def test_a_launched_learner_is_started_with_its_number_as_its_entry(monkeypatch, tmp_path):
    """A launched learner keeps its record in the entry of its number when it gives its ring
    back (`gadei.ring._keep_record`), so the supervisor starts each with `--entry NUMBER` unless
    its arguments name one: without it (a `--learners` list written by hand) a learner killed
    after it gave its entry back was counted by nothing once another learner claimed it."""
    from gadei_watchdog import learners
    from gadei.supervisor import Launched

    started = []
    monkeypatch.setattr(learners, "spawn", lambda command, **_: started.append(command) or _NoProcess())
    table = [Launched(0, ["--steps", "5"]), Launched(1, ["--entry", "3"]), Launched(2, ["--entry=0"])]
    learners.Learners("j", table, str(tmp_path), {}, max_restarts=3, window=60.0, backoff=1.0).start_all()
    tails = [c[c.index("j") + 1:] for c in started]
    assert tails[0][:4] == ["--steps", "5", "--entry", "0"], tails
    assert tails[1][:2] == ["--entry", "3"] and tails[1].count("--entry") == 1, tails
    assert tails[2][0] == "--entry=0" and "--entry" not in tails[2], tails


class _NoProcess:
    pid = 2 ** 22 + 1  # no such process: its start time is not known

    def poll(self):
        return 0


def test_the_supervisors_pause_ends_when_a_launched_learner_exits(tmp_path):
    """The supervisor looked every `interval` whatever happened: a job whose learners had all
    finished ended up to two intervals later (two 0.5 s looks on every job's end). Its pause
    ends now when a learner it launched exits; with none running, it is the whole pause."""
    import subprocess
    import sys

    from gadei.supervisor import Launched
    from gadei_watchdog.learners import Learners

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    try:
        ours = Launched(0, [])
        ours.proc, ours.pid, ours.started = child, child.pid, _proc.start_time(child.pid)
        learners = Learners("pause", [ours], str(tmp_path), {}, max_restarts=1, window=1.0, backoff=1.0)
        began = time.monotonic()
        learners.pause(20)  # the child exits after 0.3 s
        assert time.monotonic() - began < 10 and child.poll() is not None
        ours.proc, ours.pid = None, 0
        began = time.monotonic()
        learners.pause(0.2)  # none runs: a plain sleep
        assert time.monotonic() - began >= 0.2
    finally:
        child.kill()
        child.wait()
