"""The daemon with real processes: submit, status, cancel, a restarted daemon that still knows
every job, a bad job file refused at submit, and another user's request refused by its uid."""

import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

import gadei
from helpers import daemon_jobs as _jobs
from helpers import (blobs, command_words, communicate, data_dir, finish, job_processes, job_text, job_version,
                     learner_pids, missing, small_job, start_daemon, trec_job, unique_name, wait_for,
                     wait_listening)
from gadei import checkpoint, data
from gadei.daemon import request
from gadei.errors import GadeiError
from gadei.region import Region, inspect, remove
from gadei.server_record import read_stop_record

pytestmark = pytest.mark.faults  # also run on a loaded machine: `--busy 2 -m faults` (docs/testing.md)


def _jobfile(folder, name, epochs, interval=2):
    path = folder / f"{name}.toml"
    path.write_text(trec_job(name, f"out-{name}", train={"learners": 2, "epochs": epochs, "lr": 0.05},
                             checkpoint={"interval": interval}))
    return path


@pytest.mark.long  # two TREC jobs through a restarted daemon: a minute
def test_submit_status_cancel_and_a_restarted_daemon_knows_every_job(tmp_path, procs, daemon_env):
    if not (data_dir() / "trec").is_dir():
        missing("TREC is not in the shared data")
    prefix = f"d{os.getpid()}"
    long, short = f"{prefix}-long", f"{prefix}-short"
    daemon = start_daemon(procs, daemon_env)
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
    assert checkpoint.latest(out / "checkpoints") is not None and (out / "logs" / "server.log").exists()
    wait_for(lambda: not job_processes(long), 60, "the cancelled job's processes to end")

    daemon.terminate()  # the running job goes on without the daemon
    communicate(daemon, 60)
    daemon = start_daemon(procs, daemon_env)
    wait_for(lambda: _jobs(procs, daemon_env)[short]["state"] == "done", 300, "the short job to finish")
    jobs = _jobs(procs, daemon_env)
    assert jobs[long]["state"] == "cancelled" and jobs[short]["returncode"] in (0, None)
    assert (tmp_path / f"out-{short}" / "model.pt").exists()
    logs, _ = finish(procs.gadei("logs", short, "--lines", 5, env=daemon_env))
    assert "test accuracy" in logs
    daemon.terminate()
    communicate(daemon, 60)


def test_a_job_cancelled_while_running_goes_on_with_submit_resume_to_every_learners_end(tmp_path, procs, daemon_env):
    """`gadei cancel` stops a running job as Ctrl-C does: its supervisor takes a checkpoint that
    records each learner's progress first, so `gadei submit --resume` goes on from it to the end
    of every learner's schedule, as an uncancelled run would end. The supervisor is slow to take
    the cancel (held, as on a loaded machine): the daemon answers at once, the job's server goes
    on serving meanwhile, and the stop is taken once the supervisor runs. What the job says to go
    on with it names `gadei submit --resume` and the file submitted, the command that started it."""
    name = f"d{os.getpid()}-cancel"
    x, y = blobs(900)
    np.savez(tmp_path / "blobs.npz", x=x, y=y)
    path = tmp_path / "job.toml"  # no validation set: trained to the cap, whose steps are known
    path.write_text(job_text({"job": {"name": name, "workload": "mlp"},
                              "data": {"train": "blobs.npz", "format": "npz", "holdout": 0.2, "validation_holdout": 0},
                              "train": {"learners": 2, "epochs": 60}, "checkpoint": {"interval": 600},
                              "output": {"folder": "out"}}))
    out = tmp_path / "out"
    daemon = start_daemon(procs, daemon_env)
    finish(procs.gadei("submit", path, env=daemon_env))

    wait_for(lambda: job_version(name) >= 500, 120, "the job to make 500 updates")
    supervisor = _jobs(procs, daemon_env)[name]["pid"]
    # held, as on a loaded machine: the supervisor, and the learners too, so that the job is
    # still training (most of its schedule left) when the supervisor takes the cancel
    held = [supervisor, *(c.pid for c in psutil.Process(supervisor).children() if "learn" in command_words(c))]
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        finish(procs.gadei("cancel", name, env=daemon_env))
        assert _jobs(procs, daemon_env)[name]["message"] == "cancelling"  # answered while the supervisor is held
        # a job submitted again while its supervisor still stops it would start beside it (once it did)
        early = procs.gadei("submit", path, env=daemon_env)
        _, err = communicate(early, 60)
        assert early.returncode == 2 and "is being cancelled: its supervisor is still stopping it" in err, err
        found = inspect(name)  # the job's server serves on meanwhile
        assert found is not None and found.state == "running", (found, _jobs(procs, daemon_env)[name])
    finally:
        for pid in reversed(held):  # the learners first: they train on when the supervisor takes the stop
            os.kill(pid, signal.SIGCONT)
    wait_for(lambda: _jobs(procs, daemon_env)[name]["message"].startswith("cancelled;"), 120,
             "the cancelled job to end")
    assert json.loads((out / "result.json").read_text())["outcome"] == "stopped"
    first = read_stop_record(out / "logs" / "server-stop.json")
    # the job stopped after the checkpoint that records the learners' progress: its server's own
    # checkpoint at its stop (which records none) is the newest
    found = checkpoint.latest(out / "checkpoints", with_progress=True)
    assert found is not None and set(found.progress) == {"0", "1"}, found and found.progress
    newest = checkpoint.load(checkpoint.listing(out / "checkpoints")[-1])
    assert newest.path != found.path and newest.version >= found.version, (found.path, newest.path)
    # what the job says to go on with it (its log, its record), and the refusal of a plain submit,
    # name the command that started it
    last = (out / "logs" / "supervisor.log").read_text().strip().splitlines()[-1]
    assert last.startswith(f"gadei submit: job {name} stopped after ") and \
        last.endswith(f"go on with `gadei submit --resume {path}`"), last
    message = _jobs(procs, daemon_env)[name]["message"]
    assert message == f"cancelled; {last.removeprefix('gadei submit: ')}", message
    again = procs.gadei("submit", path, env=daemon_env)
    _, err = communicate(again, 60)
    assert again.returncode == 2 and f"go on with it with `gadei submit --resume {path}`" in err, err

    finish(procs.gadei("submit", "--resume", path, env=daemon_env))
    wait_for(lambda: _jobs(procs, daemon_env)[name]["state"] in ("done", "failed"), 300, "the resumed job to end")
    assert _jobs(procs, daemon_env)[name]["state"] == "done", _jobs(procs, daemon_env)[name]
    result = json.loads((out / "result.json").read_text())
    assert result["outcome"] == "done" and result["finished"], result
    last = read_stop_record(out / "logs" / "server-stop.json")
    # every mini-batch of 60 epochs of each learner's shard is in the weights once, as in an uncancelled run
    steps = 60 * sum(-(-len(range(i, 721, 2)) // 2) for i in range(2))
    assert last.version == steps and last.resumed_applied + last.applied == steps, (first, last)
    assert 0 < last.resumed_applied <= first.version, (first, last)
    again = procs.gadei("submit", path, env=daemon_env)  # a finished run is not offered --resume
    _, err = communicate(again, 60)
    assert (again.returncode == 2 and f"the run in {out} finished (outcome done on " in err
            and "--resume" not in err), err
    finish(procs.gadei("daemon", "stop", env=daemon_env))
    communicate(daemon, 60)


def test_a_bad_job_file_is_refused_at_submit_and_nothing_is_queued(tmp_path, procs, daemon_env):
    daemon = start_daemon(procs, daemon_env)
    bad = tmp_path / "bad.toml"
    bad.write_text('[job]\nname = "x"\nworkload = "textcnn"\n[data]\ntrain = "nope.csv"\nformat = "csv"\n')
    submit = procs.gadei("submit", bad, env=daemon_env)
    _, err = communicate(submit, 60)
    assert submit.returncode == 2 and "[data] train = '" in err and "no such file" in err
    out, _ = finish(procs.gadei("status", "--json", env=daemon_env))
    assert "daemon-jobs" not in out  # nothing was queued
    daemon.terminate()
    communicate(daemon, 60)


def test_jobs_that_run_side_by_side_share_the_cores(small, procs, daemon_env):
    """`--max-jobs 2`: each job counts on half the daemon's cores (GADEI_CORES), for its learners'
    threads and its server, and its log's opening lines (what the daemon chose for it) say so."""
    name = unique_name("share")
    job = small / "job.toml"
    job.write_text(small_job(name) + '[train]\nlearners = 1\nepochs = 1\n[output]\nfolder = "out"\n')
    daemon = start_daemon(procs, daemon_env, "--max-jobs", 2)
    finish(procs.gadei("submit", job, env=daemon_env))
    wait_for(lambda: _jobs(procs, daemon_env)[name]["state"] in ("done", "failed"), 120, "the job to end")
    assert _jobs(procs, daemon_env)[name]["state"] == "done"
    logs, _ = finish(procs.gadei("logs", name, "--lines", 200, env=daemon_env))
    cores = max(1, len(os.sched_getaffinity(0)) // 2)
    line = next((ln for ln in logs.splitlines() if "learners: 1 x" in ln), logs)
    assert f"(auto: {cores} core" in line and "(GADEI_CORES; the process may use" in line, line
    # the server's OpenMP runtime is passive; so is the learner's, forked warm from its supervisor (one
    # thread: it has no team to wait)
    assert logs.count("OpenMP wait policy: passive (gadei's") >= 2, logs
    # its start took the sets its submit read (nothing changed since), its supervisor (forked by the daemon's
    # zygote) read them as the start encoded them, and they are gone at the job's end
    assert f"job {name} starts with the data its submit read" in "".join(daemon.err_lines)
    assert "its data read from " in logs and "as encoded when the job was prepared" in logs, logs
    assert not (small / "out" / data.ENCODED).exists()
    daemon.terminate()
    communicate(daemon, 60)


def test_no_daemon_is_a_clear_error(procs, daemon_env, tmp_path):
    submit = procs.gadei("submit", tmp_path / "x.toml", env=daemon_env)
    _, err = communicate(submit, 60)
    assert submit.returncode == 2 and "no gadei daemon listens" in err and "gadei daemon" in err


def test_a_client_waits_for_a_daemon_that_has_started_and_does_not_listen_yet(procs, daemon_env, tmp_path):
    """A daemon listens only once it is warm, seconds after it starts (its zygote and its own
    imports): `gadei submit` run right after `gadei daemon` waits for it, where it said "no gadei
    daemon listens ...; start one with `gadei daemon`" (and a second daemon would be refused). A
    client whose timeout runs out first says that the daemon is starting, and one that a held
    daemon does not answer, that it did not answer (both were a DaemonError that said it twice). The daemon is held
    (SIGSTOP) once it holds its socket's lock, before it listens, however fast it warms."""
    path = _sock(daemon_env)

    def holds() -> bool:
        try:
            with open(path + ".lock") as lock:
                return lock.read().split()[:1] == [str(daemon.pid)]
        except FileNotFoundError:
            return False

    daemon = procs.gadei("daemon", env=daemon_env)
    wait_for(lambda: holds() or daemon.poll() is not None, 60, "the daemon to hold its socket's lock")
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        assert not os.path.exists(path), "the daemon listened before it was held: nothing is tested"
        with pytest.raises(gadei.GadeiTimeout, match=rf"the gadei daemon \(pid {daemon.pid}\) on {path} is starting "
                                                     r"and did not listen within 1 s"):
            gadei.Client(path, timeout=1).jobs()
        submit = procs.gadei("submit", tmp_path / "x.toml", env=daemon_env)
        time.sleep(3)
        assert submit.poll() is None, submit.err_lines  # it waits: not refused for want of a daemon
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    _, err = communicate(submit, 60)  # the daemon's own answer: the job file is not there
    assert submit.returncode == 2 and "No such file or directory" in err and "no gadei daemon" not in err, err
    os.kill(daemon.pid, signal.SIGSTOP)  # listening now, and held: no answer comes
    try:
        with pytest.raises(gadei.GadeiTimeout, match=rf"^the gadei daemon on {path} did not answer within 1 s"):
            gadei.Client(path, timeout=1).jobs()
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    daemon.terminate()
    communicate(daemon, 60)
    with pytest.raises(gadei.NoDaemon):  # its lock's pid and start time are a dead process's: not waited for
        gadei.Client(path, timeout=5).jobs()


def test_a_runtime_folder_too_deep_for_the_socket_is_a_clear_error(tmp_path, procs, daemon_env):
    """A Unix socket's path holds at most 107 bytes: a GADEI_RUNTIME_DIR deeper than that leaves
    (a TMPDIR under pytest's folders did) is refused by the daemon and its clients in one line
    that says which path and what to set, not with bind's traceback."""
    deep = tmp_path / ("d" * 120)
    deep.mkdir(mode=0o700)
    env = {**daemon_env, "GADEI_RUNTIME_DIR": str(deep)}
    for argv in (("daemon",), ("status",)):
        proc = procs.gadei(*argv, env=env)
        _, err = communicate(proc, 60)
        assert proc.returncode == 2, (argv, err)
        assert err.strip() == (f"gadei: error: the daemon's socket {deep / 'daemon.sock'} is "
                               f"{len(str(deep / 'daemon.sock'))} bytes long, more than the 107 a Unix socket's "
                               "path may have; set GADEI_RUNTIME_DIR to a shorter folder"), (argv, err)
    assert list(deep.iterdir()) == []  # nothing bound, nothing locked


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
    daemon = start_daemon(procs, daemon_env)
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


# ------------------------------------------------------------------ abuse of the protocol


def _sock(env) -> str:
    return os.path.join(env["GADEI_RUNTIME_DIR"], "daemon.sock")


def _raw(path: str, payload: bytes, timeout: float = 30.0, pace: float = 0.0) -> dict | None:
    """Send `payload` as is (byte by byte every `pace` seconds when given) and read the one answer
    line; None when the daemon closed the connection without one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        try:
            if pace:
                for i in range(len(payload)):
                    s.sendall(payload[i : i + 1])
                    time.sleep(pace)
            else:
                s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon stopped reading (too long): its answer is waiting
        data = b""
        try:
            while not data.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return json.loads(data) if data.endswith(b"\n") else None


class _Peak:
    """The largest RSS and thread count of a process, sampled every 20 ms in a thread."""

    def __init__(self, pid: int):
        self.proc, self.rss, self.threads = psutil.Process(pid), 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._done.is_set():
            try:
                self.rss = max(self.rss, self.proc.memory_info().rss)
                self.threads = max(self.threads, self.proc.num_threads())
            except psutil.Error:
                return
            self._done.wait(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(5)


def _no_traceback(daemon):
    err = "".join(daemon.err_lines)
    assert "Traceback" not in err, err[-3000:]


def test_every_malformed_request_gets_an_error_answer_and_the_daemon_goes_on(procs, daemon_env):
    """Garbage, JSON that is not an object, out-of-range fields, nesting, a 32 MB line four
    times at once, a slow sender, a job file that is a device, a client that hangs up: each
    gets an answer (or is dropped quietly), the daemon's memory stays bounded, and it still
    answers a plain status request."""
    daemon = start_daemon(procs, daemon_env)
    path = _sock(daemon_env)
    with _Peak(daemon.pid) as peak:
        base = psutil.Process(daemon.pid).memory_info().rss
        slow = concurrent.futures.ThreadPoolExecutor(1).submit(_raw, path, b'{"op": "status", "job": null', 30, 1.0)
        cases = [
            (b"garbage\n", "not JSON"),
            (b"\xff\xfe\x00\n", "not JSON"),
            (b"\n", "not JSON"),
            (b"[1]\n", "a JSON object is expected, not list"),
            (b"5\n", "a JSON object is expected, not int"),
            (b"null\n", "a JSON object is expected, not NoneType"),
            (b'"status"\n', "a JSON object is expected, not str"),
            (b'{"op": "logs", "job": "x", "lines": 1e400}\n', "lines = inf: an integer from 1 to 100,000"),
            (b'{"op": "logs", "job": "x", "lines": true}\n', "an integer from 1 to 100,000"),
            (b'{"op": "logs", "job": "x", "lines": 0}\n', "an integer from 1 to 100,000"),
            (b'{"op": "logs", "job": ["x"]}\n', "a job name is expected"),
            (b'{"op": NaN}\n', "NaN is not allowed"),
            (b'{"op": "format-disk"}\n', "op = 'format-disk' is unknown"),
            (b'{"op": "status", "jobs": 1}\n', "unknown field 'jobs'"),
            (b'{"op": "cancel"}\n', "the field 'job' is missing"),
            (b'{"op": "submit", "jobfile": "relative.toml"}\n', "an absolute path"),
            (b'{"op": "submit", "jobfile": "/dev/zero"}\n', "'/dev/zero': not a regular file"),
            (b"[" * 50_000 + b"\n", "nested too deeply"),
            (b'{"a":' * 10_000 + b"\n", "nested too deeply"),
        ]
        for payload, message in cases:
            answer = _raw(path, payload)
            assert answer is not None and answer["ok"] is False and message in answer["error"], (payload[:60], answer)
        big = b"x" * (32 << 20) + b"\n"
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: _raw(path, big), range(4)))
        assert all(a is not None and "over 65,536 bytes" in a["error"] for a in answers), answers
        for _ in range(20):  # clients that hang up before their answer, or in the middle of a request
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
                s.sendall(b'{"op": "status", "job": null}\n' if _ % 2 else b'{"op": "sta')
        answer = slow.result(60)
        assert answer is not None and "not complete within 10 s" in answer["error"], answer
        assert _raw(path, b'{"op": "status", "job": null}\n') == {"ok": True, "jobs": []}
    print(f"\nmalformed requests: daemon RSS {base / 2**20:.0f} MiB before, peak {peak.rss / 2**20:.0f} MiB; "
          f"peak threads {peak.threads}")
    assert peak.rss - base < 64 << 20
    assert peak.threads <= 8
    finish(procs.gadei("daemon", "stop", env=daemon_env))
    communicate(daemon, 30)
    assert daemon.returncode == 0
    _no_traceback(daemon)


def test_200_concurrent_clients_and_1000_idle_connections(procs, daemon_env):
    """1,000 connections that never send a byte do not cost a thread each, nor keep out 200
    clients that ask for the status at the same moment: every one of those is answered."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    daemon = start_daemon(procs, daemon_env)
    path = _sock(daemon_env)
    idle = []
    try:
        with _Peak(daemon.pid) as peak:
            base = psutil.Process(daemon.pid).memory_info().rss
            for _ in range(1000):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                idle.append(s)
                s.settimeout(10)
                s.connect(path)
            start = threading.Barrier(200)

            def status(_):
                start.wait(30)
                return request(path, {"op": "status", "job": None}, timeout=30)

            with concurrent.futures.ThreadPoolExecutor(200) as pool:
                answers = list(pool.map(status, range(200)))
            threads = psutil.Process(daemon.pid).num_threads()
        assert answers == [{"ok": True, "jobs": []}] * 200
        print(f"\n1,000 idle connections + 200 concurrent status requests: daemon RSS {base / 2**20:.0f} MiB "
              f"before, peak {peak.rss / 2**20:.0f} MiB; peak threads {peak.threads}")
        assert peak.threads <= 8 and threads <= 8
        assert peak.rss - base < 64 << 20
    finally:
        for s in idle:
            s.close()
    finish(procs.gadei("daemon", "stop", env=daemon_env))
    communicate(daemon, 30)
    _no_traceback(daemon)


def test_a_second_daemon_is_refused_by_the_lock_even_beside_a_stopped_one(procs, daemon_env):
    """A daemon that does not answer (SIGSTOP) is not taken for dead: a second one started
    beside it is refused by the state folder's lock and leaves the socket alone; the first
    goes on serving it after SIGCONT."""
    daemon = start_daemon(procs, daemon_env)
    path = _sock(daemon_env)
    inode = os.stat(path).st_ino
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        second = procs.gadei("daemon", env=daemon_env)
        _, err = communicate(second, 30)
        assert second.returncode == 2 and f"a gadei daemon (pid {daemon.pid}) already serves state folder" in err, err
        assert os.stat(path).st_ino == inode
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert request(path, {"op": "status", "job": None}, timeout=10) == {"ok": True, "jobs": []}
    daemon.terminate()  # SIGTERM stops it cleanly too
    communicate(daemon, 30)
    assert daemon.returncode == 0 and not os.path.exists(path)
    _no_traceback(daemon)


def test_a_job_that_cannot_start_is_failed_and_the_queue_goes_on(tmp_path, procs, daemon_env):
    """A queued job whose output folder is a file (left queued by an earlier daemon) is marked
    failed with the reason when this daemon tries to start it; the next job starts."""
    state = tmp_path / "state" / "jobs"
    state.mkdir(parents=True)
    blocked = tmp_path / "out-blocked"
    blocked.write_text("a file where the output folder should be")
    record = {"name": "blocked", "jobfile": str(tmp_path / "blocked.toml"), "output": str(blocked), "state": "queued",
              "submitted": time.time()}
    (state / "blocked.json").write_text(json.dumps(record))
    name = f"d{os.getpid()}-next"
    daemon = start_daemon(procs, daemon_env)
    path = _sock(daemon_env)

    def jobs() -> dict:
        return {j["name"]: j for j in request(path, {"op": "status", "job": None}, timeout=10)["jobs"]}

    submitted = request(path, {"op": "submit", "jobfile": str(_jobfile(tmp_path, name, epochs=50))}, timeout=60)
    assert submitted["ok"], submitted
    now = wait_for(lambda: (lambda j: j[name]["state"] != "queued" and j)(jobs()), 60, "the second job to start")
    assert now["blocked"]["state"] == "failed"
    assert now["blocked"]["message"] == f"could not start: output folder {blocked} is not a folder"
    assert now[name]["state"] == "running"
    assert request(path, {"op": "cancel", "job": name}, timeout=10)["ok"]
    wait_for(lambda: jobs()[name]["pid"] == 0, 120, "the cancelled job to end")
    finish(procs.gadei("daemon", "stop", env=daemon_env))
    communicate(daemon, 30)
    _no_traceback(daemon)


def test_a_large_jobs_submit_waits_for_its_checks_the_daemon_answers_as_it_starts_it_and_a_cancel_starts_nothing(
        tmp_path, procs, daemon_env):
    """A submit's checks read the job's data, and a client's submit waits for them beyond its
    timeout by the data files' size (a submit of a large set timed out, and the job was queued).
    Starting the job reads its data again where its files changed since (here: touched):
    minutes for a large set, which the runner spent holding the daemon's lock, so that `gadei
    status`, `gadei cancel` and every submit waited for it (a status asked then timed out). Now
    the daemon answers meanwhile, and a job cancelled as it is prepared ends cancelled with none
    of its processes started."""
    import random

    draw = random.Random(0)
    words = [f"w{i}" for i in range(5000)]
    data = tmp_path / "large.csv"
    with data.open("w") as f:  # seconds to read and encode here, for each of the two models a job that picks one tries
        f.write("label,text\n")
        f.writelines(f"{'ab'[i % 2]},{' '.join(draw.choices(words, k=25))}\n" for i in range(60_000))
    name = f"d{os.getpid()}-large"
    job = tmp_path / "large.toml"
    job.write_text(f'[job]\nname = "{name}"\n[data]\ntrain = "{data}"\nformat = "csv"\n')
    daemon = start_daemon(procs, daemon_env)
    path = _sock(daemon_env)
    # the data changes while the submit's checks read it (touched every 50 ms, from before its look at the files
    # until it answers), so that the start reads it again, not the submit's sets: a touch once the submit had
    # answered was sometimes later than the start's look on a busy machine
    submitted = threading.Event()

    def touch():
        while not submitted.wait(0.05):
            os.utime(data)

    toucher = threading.Thread(target=touch)
    toucher.start()
    try:  # a submit is answered once the daemon's checks have read the data: its wait grows with the data files
        assert gadei.Client(path, timeout=2).submit(job).state == "queued"
    finally:
        submitted.set()
        toucher.join(10)
    answered, deadline = 0, time.monotonic() + 600
    while True:  # the runner prepares it now: each look must be answered, as at any other time
        assert time.monotonic() < deadline, "the job was still queued after 600 s"
        asked = time.monotonic()
        record = request(path, {"op": "status", "job": name}, timeout=10)["jobs"][0]
        assert time.monotonic() - asked < 10
        if record["state"] != "queued":
            break
        answered += record["message"] == "starting: checked again"  # else not picked yet
        if answered == 3:
            assert request(path, {"op": "cancel", "job": name}, timeout=10)["ok"]
        time.sleep(0.2)
    assert answered >= 3, "the job started before the daemon was asked while it prepared it"
    assert (record["state"], record["message"]) == ("cancelled", "cancelled before it started"), record
    wait_for(lambda: f"job {name} was cancelled as it was prepared; not started" in "".join(daemon.err_lines), 300,
             "the runner to end preparing the cancelled job")
    assert f"job {name} starts with the data its submit read" not in "".join(daemon.err_lines)  # it changed since
    time.sleep(1)
    assert request(path, {"op": "status", "job": name}, timeout=10)["jobs"][0]["state"] == "cancelled"
    assert inspect(name) is None and job_processes(name) == []
    finish(procs.gadei("daemon", "stop", env=daemon_env))
    communicate(daemon, 60)
    _no_traceback(daemon)


def test_daemon_stop_and_the_systemd_unit(tmp_path, procs, daemon_env):
    """`gadei daemon systemd-unit` prints a unit systemd-analyze accepts (where it is installed);
    its ExecStart runs the daemon in the foreground, SIGTERM (systemctl stop) ends it with 0 and
    its socket removed, and `gadei daemon stop` does the same."""
    out, _ = finish(procs.gadei("daemon", "systemd-unit", env=daemon_env))
    unit = tmp_path / "gadei-daemon.service"
    unit.write_text(out)
    fields = dict(line.split("=", 1) for line in out.splitlines() if "=" in line and not line.startswith("Environment"))
    assert fields["ExecStart"].split()[1:] == ["-P", "-m", "gadei", "daemon", "run"]  # the installed gadei
    assert f"Environment=GADEI_STATE_DIR={daemon_env['GADEI_STATE_DIR']}" in out
    analyze = shutil.which("systemd-analyze")
    if analyze:
        check = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
        problems = [line for line in (check.stdout + check.stderr).splitlines() if str(unit) in line]
        assert check.returncode == 0 and not problems, check.stdout + check.stderr
    path = _sock(daemon_env)
    for how in ("SIGTERM", "gadei daemon stop"):
        daemon = procs.start(*fields["ExecStart"].split()[1:], env=daemon_env)
        wait_listening(path, daemon)
        assert request(path, {"op": "status", "job": None}, timeout=10)["ok"]
        if how == "SIGTERM":
            daemon.terminate()
        else:
            _, err = finish(procs.gadei("daemon", "stop", env=daemon_env))
            assert f"daemon (pid {daemon.pid}) stopped" in err
            assert daemon.poll() is not None  # stop waits until it has ended
        communicate(daemon, 30)
        assert daemon.returncode == 0 and not os.path.exists(path), how
        _no_traceback(daemon)
    stop = procs.gadei("daemon", "stop", env=daemon_env)
    _, err = communicate(stop, 30)
    assert stop.returncode == 2 and "no gadei daemon listens" in err


@pytest.mark.parametrize("xdg", [False, True], ids=["home", "xdg-state-home"])
def test_job_records_are_where_the_docs_say(tmp_path, monkeypatch, xdg):
    """Without GADEI_STATE_DIR the daemon keeps a job's record in the jobs/ folder of
    $XDG_STATE_HOME/gadei, else of ~/.local/state/gadei; docs/jobs.md, daemon.md and cli.md each
    name that folder, in those words (once they disagreed on it)."""
    from pathlib import Path

    from gadei.daemon import Daemon, JobRecord

    monkeypatch.delenv("GADEI_STATE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if xdg:
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    else:
        monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    daemon = Daemon()
    try:
        daemon._save(JobRecord(name="rec", jobfile=str(tmp_path / "rec.toml"), output=str(tmp_path / "out")))
    finally:
        daemon.close()
    folder = tmp_path / "xdg" / "gadei" / "jobs" if xdg else tmp_path / "home" / ".local" / "state" / "gadei" / "jobs"
    assert [p.name for p in folder.iterdir()] == ["rec.json"]

    said = "`$GADEI_STATE_DIR/jobs/`, default `$XDG_STATE_HOME/gadei/jobs/`, else `~/.local/state/gadei/jobs/`"
    docs = Path(__file__).resolve().parent.parent / "docs"
    for name in ("jobs.md", "daemon.md", "cli.md"):
        text = " ".join((docs / name).read_text().split())
        assert said in text, name
        assert text.count(".local/state/gadei") == text.count(".local/state/gadei/jobs/"), name


def test_two_submits_of_one_name_at_once_queue_one_and_refuse_the_other(tmp_path, monkeypatch):
    """A submit checks the job's data before it queues it, seconds for a large set; a second
    submit of the same name meanwhile is refused (it once passed the same look at the queue and
    replaced the first one's record, whose submitter had been told it was queued), and so is a job
    of another name whose output folder a queued job's is (it failed as it started)."""
    from gadei import prepare
    from gadei.daemon.jobs import Jobs

    (tmp_path / "train.csv").write_text("text,label\n" + "".join(f"words {i},{'ab'[i % 2]}\n" for i in range(40)))
    first, second = tmp_path / "first.toml", tmp_path / "second.toml"
    for path in (first, second):
        path.write_text(f'[job]\nname = "same"\nworkload = "ngram"\n[data]\ntrain = "train.csv"\n'
                        f'[output]\nfolder = "out-{path.stem}"\n')
    checking, go_on, check = threading.Event(), threading.Event(), prepare.check

    def slow_check(job, *args, **kwargs):  # the first submit's check takes as long as the test holds it
        if job.path == first:
            checking.set()
            assert go_on.wait(60)
        return check(job, *args, **kwargs)

    monkeypatch.setattr(prepare, "check", slow_check)
    (tmp_path / "state" / "jobs").mkdir(parents=True)
    jobs = Jobs(tmp_path / "state")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        queued = pool.submit(jobs.submit, str(first))
        assert checking.wait(60)
        with pytest.raises(GadeiError, match="job 'same' is being submitted by another submit, which checks its data"):
            jobs.submit(str(second))
        go_on.set()
        assert queued.result(60).output == str(tmp_path / "out-first")
    assert jobs.records["same"].output == str(tmp_path / "out-first") and jobs.records["same"].state == "queued"
    with pytest.raises(GadeiError, match="job 'same' is already queued"):
        jobs.submit(str(second))
    other = tmp_path / "other.toml"  # another name, the queued job's output folder: it would fail as it started
    other.write_text(first.read_text().replace('name = "same"', 'name = "other"'))
    with pytest.raises(GadeiError, match="out-first is that of job 'same', which is queued; set another"):
        jobs.submit(str(other))


def test_a_job_record_that_is_not_the_daemons_is_skipped_saying_why(tmp_path, procs, daemon_env, caplog):
    """The state folder's records are read from disk: one that is not a JSON object, or whose
    fields are not of the types the daemon writes, is skipped with a warning that names the
    field; `gadei status` shows the others (once a list or a string time ended it in a traceback)."""
    from dataclasses import asdict
    from pathlib import Path

    from gadei.daemon.jobs import JobRecord, read_records

    folder = Path(daemon_env["GADEI_STATE_DIR"])
    (folder / "jobs").mkdir(parents=True, exist_ok=True)
    good = asdict(JobRecord(name="good", jobfile=str(tmp_path / "j.toml"), output=str(tmp_path / "out"),
                            state="done", submitted=time.time(), message="job good done"))
    bad = {"list": [1], "time": {**good, "name": "time", "submitted": "yesterday"},
           "pid": {**good, "name": "pid", "pid": True}, "state": {**good, "name": "state", "state": "odd"}}
    for name, record in {"good": good, **bad}.items():
        (folder / "jobs" / f"{name}.json").write_text(json.dumps(record))
    caplog.set_level("WARNING")
    assert list(read_records(folder)) == ["good"]
    for said in ("list, not a JSON object", "its submitted is 'yesterday', not int or float",
                 "its pid is True, not int", "its state is 'odd', not one of queued"):
        assert said in caplog.text, caplog.text
    out, err = finish(procs.gadei("status", env=daemon_env), 60)
    assert "good" in out and "done" in out and "Traceback" not in err, out + err


def test_status_and_logs_read_the_records_a_stopped_daemon_left(tmp_path, procs, daemon_env):
    """With the daemon stopped, `gadei status` shows the jobs it recorded (not "no gadei jobs"),
    `gadei status JOB` that job's record (not "has no region") and `gadei logs JOB` the logs on
    disk, each saying the daemon is not running; a job cancelled while queued never started,
    and its logs say so, with the daemon and without."""
    prefix = f"d{os.getpid()}"
    ran, never = f"{prefix}-ran", f"{prefix}-never"
    try:
        _status_and_logs_without_the_daemon(tmp_path, procs, daemon_env, prefix, ran, never)
    finally:  # the job runs in a session of its own: a failed check must not leave it running
        for proc in job_processes(ran):
            proc.kill()
        if inspect(ran) is not None:
            remove(ran)


def _attached(name: str) -> int:
    """How many learners of job `name` are attached to its region now (0 without a region)."""
    try:
        with Region.attach(name, readonly=True) as region:
            return len(learner_pids(region))
    except GadeiError:
        return 0


def _status_and_logs_without_the_daemon(tmp_path, procs, daemon_env, prefix, ran, never):
    daemon = start_daemon(procs, daemon_env)
    finish(procs.gadei("submit", _jobfile(tmp_path, ran, epochs=50), env=daemon_env))
    wait_for(lambda: _jobs(procs, daemon_env)[ran]["state"] == "running", 60, "the first job to start")
    finish(procs.gadei("submit", _jobfile(tmp_path, never, epochs=1), env=daemon_env))
    finish(procs.gadei("cancel", never, env=daemon_env))  # still queued behind the first: it never starts
    out, _ = finish(procs.gadei("logs", never, env=daemon_env))
    cancelled = f"job '{never}' was cancelled before it started: it never ran, so it has no logs"
    assert out.strip() == cancelled, out
    serve_log = tmp_path / f"out-{ran}" / "logs" / "server.log"  # "running" is its supervisor; its server comes later
    wait_for(lambda: serve_log.exists() and _attached(ran) == 2, 120, "the first job's learners to attach")
    finish(procs.gadei("cancel", ran, env=daemon_env))
    wait_for(lambda: _jobs(procs, daemon_env)[ran]["pid"] == 0, 120, "the cancelled job to end")
    finish(procs.gadei("daemon", "stop", env=daemon_env))
    communicate(daemon, 30)
    wait_for(lambda: not job_processes(ran), 60, "the cancelled job's processes to end")

    not_running = "gadei: the daemon is not running: the job records as it left them"
    out, err = finish(procs.gadei("status", env=daemon_env))
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith(prefix)}
    assert rows == {ran: "cancelled", never: "cancelled"} and not_running in err, out + err
    assert "no gadei jobs" not in err
    out, err = finish(procs.gadei("status", never, env=daemon_env))
    assert never in out and "cancelled before it started" in out and not_running in err, out + err
    assert "has no region" not in err
    out, _ = finish(procs.gadei("status", "--json", env=daemon_env))
    record = json.loads(out.splitlines()[0])
    assert record["daemon"] == "not running" and [j["name"] for j in record["jobs"]] == [ran, never], out

    out, err = finish(procs.gadei("logs", ran, "--lines", 5, env=daemon_env))
    logs = tmp_path / f"out-{ran}" / "logs"
    # as docs/jobs.md says
    assert all(f"==> {logs / name} <==" in out for name in ("supervisor.log", "server.log")), out
    assert not_running in err, err
    out, err = finish(procs.gadei("logs", never, env=daemon_env))
    assert out.strip() == cancelled and not_running in err, out + err
    unknown = procs.gadei("logs", f"{prefix}-nope", env=daemon_env)
    _, err = communicate(unknown, 60)
    assert unknown.returncode == 2 and "no gadei daemon listens" in err and f"no job '{prefix}-nope' is recorded" in err
