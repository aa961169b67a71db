"""A run's claim on its output folder (`gadei.claim`): one run at a time writes a folder's
outputs, also before either run's server exists (two `gadei run`s of one job started at once
once both ran, and both wrote its outputs), and the claim outlives the client that took it while
the job's supervisor runs."""

import json
import os
import signal

import pytest

from gadei import claim, jobfile
from gadei.errors import FolderInUse
from gadei.prepare import prepare
from helpers import (blobs_job, communicate, daemon_jobs, end_jobs, job_processes, job_text, small_job, start_daemon,
                     unique_name, wait_for)

IN_USE = "is in use by a run that starts or runs now"


def test_a_claimed_folder_refuses_another_run_before_it_writes_anything(small, procs):
    """While a run holds the folder (prepared here, its server not started), `gadei run` and
    `gadei run --check` of another job file that writes there are refused, naming the folder and
    the pid that claimed it; what the first run wrote is untouched. Once the claim goes, both are
    accepted."""
    first, second = unique_name("claim1"), unique_name("claim2")
    for name in (first, second):
        (small / f"{name}.toml").write_text(small_job(name) + '[train]\nepochs = 1\n[output]\nfolder = "out"\n')
    held = prepare(jobfile.load(small / f"{first}.toml"), resume=False)
    written = (small / "out" / "job.toml").read_text()
    try:
        for args in (("run", "--check"), ("run",)):
            run = procs.gadei(*args, str(small / f"{second}.toml"))
            _, err = communicate(run, 120)
            assert run.returncode == 2 and f"output folder {small / 'out'} {IN_USE} (claimed by pid {os.getpid()})" \
                in err, err
        assert (small / "out" / "job.toml").read_text() == written and not (small / "out" / "result.json").exists()
    finally:
        held.claim.close()
    run = procs.gadei("run", str(small / f"{second}.toml"))
    out, err = communicate(run, 120)
    assert run.returncode == 0 and "done in" in out, out + err


def test_two_runs_of_one_job_started_at_once_run_it_once(tmp_path, procs):
    """Two `gadei run`s of one job file started together: one runs the job to its end, the other is
    refused (the folder claimed, or its server seen) without a word written into the first's
    outputs."""
    name = unique_name("twice")
    path = blobs_job(tmp_path, name, train={"learners": 2, "epochs": 4, "lr": 0.05})
    try:
        runs = [procs.gadei("run", str(path)) for _ in range(2)]
        ended = [communicate(run, 180) for run in runs]
    finally:
        end_jobs(name)
    codes = sorted(run.returncode for run in runs)
    said = "\n".join(out + err for out, err in ended)
    assert codes == [0, 2], said
    refused = ended[[run.returncode for run in runs].index(2)][1]
    assert IN_USE in refused or f"job '{name}' runs now" in refused, refused
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["outcome"] == "done" and said.count("done in") == 1, said


@pytest.mark.faults  # a daemon killed; also run on a loaded machine (docs/testing.md)
def test_a_daemon_jobs_supervisor_holds_its_claim_past_the_daemon(tmp_path, procs, daemon_env):
    """The daemon's zygote hands a job's supervisor the claim its daemon took: with the daemon
    killed (SIGKILL) while the job runs, the folder is still claimed, until the job ends. Every
    process that holds it carries the job's name on its command line (the supervisor, whose
    job file's path does not: `ps` and `pkill -f NAME` find the whole job)."""
    name = unique_name("dclaim")
    path = blobs_job(tmp_path, name, train={"learners": 2, "epochs": 400, "patience": 400, "lr": 0.05})
    out = tmp_path / "out"
    daemon = start_daemon(procs, daemon_env)
    try:
        submit = procs.gadei("submit", str(path), env=daemon_env)
        communicate(submit, 120)
        assert submit.returncode == 0, submit.err_lines
        wait_for(lambda: len(_holders(out)) >= 4, 120, "the job's supervisor, server and learners to start")
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        holders = _holders(out)
        assert len(holders) >= 4 and holders <= {proc.pid for proc in job_processes(name)}, holders
        with pytest.raises(FolderInUse, match=IN_USE):
            claim.check(out)
        run = procs.gadei("run", "--check", str(_other_job(tmp_path)))
        _, err = communicate(run, 120)
        assert run.returncode == 2 and IN_USE in err, err
    finally:
        end_jobs(name)
    wait_for(lambda: _free(out), 60, "the claim to go with the job's processes")


@pytest.mark.faults  # a daemon and a supervisor killed; also run on a loaded machine (docs/testing.md)
def test_the_supervisor_a_restarted_daemon_starts_in_place_of_a_dead_one_claims_the_folder(tmp_path, procs,
                                                                                          daemon_env):
    """A restarted daemon follows a running job without its claim (the job's processes hold it);
    where the job's supervisor dies then, the one it starts in its place claims the folder itself
    once the processes of the dead one let go of it: the folder stays claimed while the job runs,
    by the new supervisor among its processes (none held it: another run could take the folder)."""
    name = unique_name("rclaim")
    path = blobs_job(tmp_path, name, train={"learners": 2, "epochs": 400, "patience": 400, "lr": 0.05})
    out = tmp_path / "out"
    daemon = start_daemon(procs, daemon_env)
    try:
        communicate(procs.gadei("submit", str(path), env=daemon_env), 120)
        wait_for(lambda: len(_holders(out)) >= 4, 120, "the job's supervisor, server and learners to start")
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        daemon = start_daemon(procs, daemon_env)
        first = daemon_jobs(procs, daemon_env)[name]["pid"]
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: daemon_jobs(procs, daemon_env)[name]["pid"] not in (0, first), 120, "a new supervisor")
        supervisor = daemon_jobs(procs, daemon_env)[name]["pid"]
        wait_for(lambda: supervisor in _holders(out) and len(_holders(out)) >= 4, 120,
                 "the new supervisor to claim the folder and start the job's server and learners")
        assert _holders(out) <= {proc.pid for proc in job_processes(name)}, _holders(out)
        run = procs.gadei("run", "--check", str(_other_job(tmp_path)))
        _, err = communicate(run, 120)
        assert run.returncode == 2 and IN_USE in err, err
        assert daemon_jobs(procs, daemon_env)[name]["state"] == "running"
    finally:
        end_jobs(name)
        daemon.terminate()
        communicate(daemon, 60)
    wait_for(lambda: _free(out), 60, "the claim to go with the job's processes")


def test_a_refusal_names_who_holds_the_claim_once_the_run_that_claimed_it_ended(tmp_path, procs):
    """`gadei run` killed, its job runs on under its supervisor, which holds the claim: a run of
    another job file into that folder is refused naming the killed run's pid as ended and the
    pids that hold the claim now, the supervisor's among them (it named the dead pid alone, which
    reads as a lock left behind)."""
    name = unique_name("gone")
    path = blobs_job(tmp_path, name, train={"learners": 2, "epochs": 400, "patience": 400, "lr": 0.05})
    out = tmp_path / "out"
    run = procs.gadei("run", str(path))
    try:
        def supervisor() -> list[int]:
            return [p.pid for p in job_processes(name) if "gadei_watchdog" in " ".join(p.cmdline())]

        wait_for(lambda: supervisor() and supervisor()[0] in _holders(out), 120,
                 "the job's supervisor to hold the claim")
        run.send_signal(signal.SIGKILL)
        run.wait()
        other = procs.gadei("run", "--check", str(_other_job(tmp_path)))
        _, err = communicate(other, 120)
        assert other.returncode == 2, err
        assert f"{IN_USE} (claimed by pid {run.pid}, which has ended; held now by pid" in err, err
        assert str(supervisor()[0]) in err.split("held now by")[1], err
    finally:
        end_jobs(name)


def test_a_supervisor_started_as_a_new_interpreter_is_handed_the_claim(tmp_path, procs):
    """A job's supervisor that is not forked (no process to fork it warm) is handed the run's claim
    as it starts: with its client's claim let go of, the folder stays claimed while the job runs,
    and is free once it ended."""
    from gadei.launch import started_as
    from gadei.supervisor import Supervised

    name = unique_name("nclaim")
    prepared = prepare(jobfile.load(blobs_job(tmp_path, name, train={"learners": 2, "epochs": 400,
                                                                      "patience": 400, "lr": 0.05})), resume=False)
    out = prepared.job.output
    supervised = Supervised(name, out / "job.toml", out, by="gadei run", log=out / "logs" / "supervisor.log",
                            claim=prepared.claim)
    try:
        supervised.start()
        assert started_as(supervised.proc) == "a new interpreter"
        supervised.release()  # as a client killed would
        wait_for(lambda: supervised.pid in _holders(out) and len(_holders(out)) >= 3, 120,
                 "the supervisor, handed the claim, to start the job's server and learners (which hold it with it)")
        with pytest.raises(FolderInUse, match=IN_USE):
            claim.check(out)
        supervised.stop()
        wait_for(lambda: supervised.ended() is not None, 120, "the job to stop")
    finally:
        end_jobs(name)
    wait_for(lambda: _free(out), 60, "the claim to go with the job's processes")


def _other_job(folder):
    """Another job file (another name) whose output folder is folder/out."""
    path = folder / "other.toml"
    path.write_text(job_text({"job": {"name": unique_name("other"), "workload": "mlp"},
                              "data": {"train": "blobs.npz", "format": "npz"}, "output": {"folder": "out"}}))
    return path


def _holders(out) -> set[int]:
    """The pids of the processes that have the folder's claim file open."""
    lock = os.stat(out / claim.NAME)
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed as it was looked at
                continue
            if (st.st_dev, st.st_ino) == (lock.st_dev, lock.st_ino):
                found.add(int(pid))
    return found


def _free(out) -> bool:
    try:
        claim.check(out)
    except FolderInUse:
        return False
    return True


def test_something_else_in_the_claims_place_is_refused_by_the_check_and_left_alone(small, procs):
    """A symbolic link (to a file of someone else's) or a folder where logs/claim.lock goes: `gadei
    run --check` refuses it, naming it, and neither it nor what a link points to is touched."""
    name = unique_name("claimed")
    (small / "job.toml").write_text(small_job(name) + '[output]\nfolder = "out"\n')
    (small / "out" / "logs").mkdir(parents=True)
    (small / "theirs").write_text("not a lock\n")
    place = small / "out" / "logs" / "claim.lock"
    for make, said in ((lambda: place.symlink_to(small / "theirs"), "is a symbolic link"),
                       (place.mkdir, "is not a file")):
        make()
        run = procs.gadei("run", "--check", str(small / "job.toml"))
        _, err = communicate(run, 120)
        assert run.returncode == 2 and f"output folder {small / 'out'}: its logs/claim.lock {said}" in err, err
        place.unlink() if place.is_symlink() else place.rmdir()
    assert (small / "theirs").read_text() == "not a lock\n"


def test_a_file_system_without_locks_runs_the_job_saying_what_it_cannot_keep_out(small, monkeypatch, caplog):
    """Where the output folder's file system holds no locks (flock fails with ENOLCK, as on an NFS
    mount without them), the run is not refused: it is prepared, with a warning that says a second
    run is not kept out, and the check lets the next one through."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    name = unique_name("nolocks")
    (small / "job.toml").write_text(small_job(name) + '[output]\nfolder = "out"\n')
    monkeypatch.setattr(fcntl, "flock", no_locks)
    held = prepare(jobfile.load(small / "job.toml"), resume=False)
    try:
        assert (small / "out" / "job.toml").exists()
        assert "logs/claim.lock cannot be locked (No locks available)" in caplog.text, caplog.text
        claim.check(small / "out")
    finally:
        held.claim.close()
