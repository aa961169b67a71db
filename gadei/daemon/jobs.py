"""The daemon's jobs: their records on disk, the queue, the runner that starts them as `gadei
run`, and the daemon's life (one per state folder, by a lock)."""

import fcntl
import json
import logging
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import _proc, jobfile
from ..env import CORES, cores_said, job_cores_env, runtime_dir, state_dir as state_folder
from ..errors import GadeiError, NoSuchJob
from .listener import BACKLOG, MAX_CONNECTIONS, WORKERS, Loop, check_request

log = logging.getLogger(__name__)

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
LIVE = (QUEUED, RUNNING)


def state_dir(create: bool = True) -> Path:
    """The daemon's state folder (its lock, and the job records in jobs/); `create`: make it
    (0700) if it is missing, as the daemon does, not a reader of the records."""
    path = Path(state_folder())
    if create:
        (path / "jobs").mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def socket_path() -> str:
    return os.path.join(runtime_dir(), "daemon.sock")


@dataclass
class JobRecord:
    """One submitted job, as the daemon keeps it on disk."""

    name: str
    jobfile: str  # the job file as submitted (absolute)
    output: str
    state: str = QUEUED
    submitted: float = 0.0
    started: float = 0.0
    ended: float = 0.0
    pid: int = 0  # the `gadei run` process while it runs
    pid_start: float = 0.0
    returncode: int | None = None
    message: str = ""
    resume: bool = False  # go on with the run its output folder holds (`gadei run --resume`)
    orphaned: bool = False  # its `gadei run` died while the job went on (under its watchdog): followed by region

    @property
    def log(self) -> str:
        return os.path.join(self.output, "logs", "run.log")


def read_records(folder: Path) -> dict[str, JobRecord]:
    """The job records in the state folder `folder` (none if it has none), by name; an
    unreadable one is skipped with a warning. What a starting daemon knows, and what `gadei
    status` and `gadei logs` show while no daemon runs."""
    records = {}
    for path in sorted((folder / "jobs").glob("*.json")):
        try:
            record = JobRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as err:
            log.warning("skipping the unreadable job record %s: %s", path, err)
            continue
        records[record.name] = record
    return records


def job_logs(record: JobRecord, lines: int) -> str:
    """The last `lines` lines of each of a job's logs (`gadei logs`: its `gadei run`'s, its
    server's and watchdog's, each learner's), or why it has none: a job that never started
    (cancelled while queued, or one that could not start) says so."""
    parts = []
    folder = Path(record.output, "logs")
    try:
        learners = sorted(folder.glob("learner-*.log"))
    except OSError:
        learners = []
    for path in [record.log, str(folder / "serve.log"), *learners]:
        try:
            text = _tail(path, lines)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as err:
            text = f"(unreadable: {err.strerror})"
        parts.append(f"==> {path} <==\n" + text)
    if record.started:
        return "\n".join(parts) if parts else f"job {record.name!r} has no logs yet"
    if record.state == QUEUED:
        why = f"job {record.name!r} is queued: it has not started yet, so it has no logs"
    elif record.state == CANCELLED:
        why = f"job {record.name!r} was cancelled before it started: it never ran, so it has no logs"
    else:
        why = f"job {record.name!r} never started ({record.state}: {record.message}), so it has no logs"
    return why + ("; the logs in its output folder are an earlier run's:\n" + "\n".join(parts) if parts else "")


class Daemon:
    """The queue, the runner and the request handler; `serve_forever()` until SIGTERM/SIGINT."""

    def __init__(self, max_jobs: int = 1, poll: float = 0.5, metrics_port: int | None = None):
        if max_jobs < 1:
            raise GadeiError(f"--max-jobs {max_jobs}: must be at least 1")
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            raise GadeiError(f"--metrics-port {metrics_port}: must be a TCP port, 0 to 65535 (0: any free one)")
        self.max_jobs, self.poll, self.metrics_port = max_jobs, poll, metrics_port
        self.started = time.monotonic()
        self.oom_kills = _proc.oom_kills()  # for a job's `gadei run` an earlier daemon started, which it cannot reap
        self.refused = 0  # requests answered with an error (`gadei.daemon.metrics`), counted by `note_refused`
        self.folder = state_dir()
        # One daemon per state folder, for its whole life: a second one (even beside a stopped
        # first) is refused here, before it reads or writes a record.
        self._locks = [_lock(self.folder / "daemon.lock", f"state folder {self.folder}")]
        self.lock = threading.Lock()
        self.records: dict[str, JobRecord] = {}
        self.procs: dict[str, tuple[subprocess.Popen, int | None]] = {}  # with `_proc.oom_kills()` at its start
        self._stop = threading.Event()
        self.records.update(read_records(self.folder))
        with self.lock:
            for record in self.records.values():
                if record.state == RUNNING:
                    self._reattach(record)
                elif record.state == CANCELLED and not record.ended and record.orphaned and _job_alive(record):
                    # its cancel was this daemon's to finish (a thread of the daemon before, which
                    # died with it): finished now; `_reap` records the end
                    self._cancel_orphan(record)

    # ------------------------------------------------------------------ records

    def _save(self, record: JobRecord) -> None:
        path = self.folder / "jobs" / f"{record.name}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(record), indent=1))
        os.replace(tmp, path)

    def _reattach(self, record: JobRecord) -> None:
        if _proc.alive(record.pid, record.pid_start):
            log.info("job %s still runs (pid %d): watching it again", record.name, record.pid)
            return
        if record.orphaned or _job_alive(record):
            self._orphan(record, "its `gadei run` ended while the daemon was down")
            return
        self._conclude(record, None, "ended while the daemon was down")

    def _orphan(self, record: JobRecord, why: str) -> None:
        """The job's `gadei run` is gone but the job goes on under its watchdog (which writes its
        outputs at its end): followed by its region until it ends (`_reap`); a cancelled one
        (its run died before it stopped the job) is stopped by the daemon (`_cancel_orphan`)."""
        record.pid, record.orphaned = 0, True
        if record.state == CANCELLED:  # cancelled, and its run died before it stopped the job: stopped here
            record.message = f"cancelling ({why})"
            self._save(record)
            self._cancel_orphan(record)
            return
        record.message = f"{why}; the job goes on under its watchdog, which writes its outputs"
        self._save(record)
        log.warning("job %s: %s", record.name, record.message)

    def _conclude(self, record: JobRecord, code: int | None, why: str = "", oom_kills: int | None = None) -> None:
        """The job ended: its state from its result.json (`gadei.outputs`), which is written
        here when neither its `gadei run` nor its watchdog lived to write it. `code`: its `gadei
        run`'s exit code where known (`oom_kills`: `_proc.oom_kills()` when it started)."""
        from .. import outputs

        out = Path(record.output)
        result = outputs.read_result(out)
        run_ended = "gadei run " + _proc.how_it_ended(code, oom_kills)
        if result is None and (code is None or code < 0) and (out / "job.toml").is_file():
            try:  # gadei run was killed: the job's outputs are this process's to write
                result = outputs.conclude(out, note=why or run_ended, wait=120)
            except Exception as err:  # noqa: BLE001 (the record must end whatever this costs)
                log.error("job %s: cannot write its outputs: %s", record.name, _reason(err))
        outcome = result.get("outcome") if result else None
        # when it ended: its result.json's time (a job that ended while no daemon ran ended then,
        # not when this daemon came to read it)
        at = _written_at(out / "result.json") if result is not None else None
        if record.state == CANCELLED:
            self._finish(record, CANCELLED, code, "cancelled; its last checkpoint and logs are kept", at)
        elif outcome == "done" or (outcome is None and code == 0):
            self._finish(record, DONE, code, why, at)
        elif result is not None:
            self._finish(record, FAILED, code, f"{outcome}: {result.get('reason', '')}" + (f" ({why})" if why else ""),
                         at)
        else:
            self._finish(record, FAILED, code, (f"{why}; " if why else "") + f"{run_ended}; see `gadei logs {record.name}`")

    def _finish(self, record: JobRecord, state: str, code: int | None, message: str = "",
                at: float | None = None) -> None:
        """Record the job's end: `state`, its run's exit `code`, `message`, and when (`at`; None: now)."""
        record.state, record.returncode, record.ended, record.pid = state, code, at or time.time(), 0
        record.message = message
        self._save(record)
        log.info("job %s %s%s", record.name, state, f": {message}" if message else "")

    # ------------------------------------------------------------------ requests

    def submit(self, path: str, resume: bool = False) -> JobRecord:
        """Check a job file and its data now, then queue it; `resume`: to go on with the run in
        its output folder. Raises GadeiError saying why not."""
        from ..prepare import SUBMIT, check

        job = jobfile.load(path)
        with self.lock:
            old = self.records.get(job.name)
            if old is not None and old.state in LIVE:
                raise GadeiError(f"job {job.name!r} is already {old.state}; cancel it first or give the job "
                                 "another [job] name")
            if old is not None and old.state == CANCELLED and not old.ended:  # its run still stops (`_conclude`)
                raise GadeiError(f"job {job.name!r} is being cancelled: its run is still stopping (its checkpoint, "
                                 "then its outputs); submit it again once `gadei status` no longer says cancelling")
        # what `gadei run` would refuse (a squatted region name, the data, the output folder, the
        # resume point) is the submitter's to hear now, not the log's
        check(job, resume, None, remove_model=False, by=SUBMIT)
        record = JobRecord(name=job.name, jobfile=str(job.path), output=str(job.output), submitted=time.time(),
                        resume=resume)
        with self.lock:
            self.records[job.name] = record
            self._save(record)
        log.info("job %s queued (%s)", job.name, job.path)
        return record

    def cancel(self, name: str) -> JobRecord:
        """Cancel a queued job, or stop a running one as Ctrl-C stops `gadei run` (a checkpoint
        that records the learners' progress, then the stop). Answers at once: a running job's
        state is `cancelled` with the message "cancelling" until its run has stopped (`_reap`)."""
        with self.lock:
            record = self._get(name)
            if record.state == QUEUED:
                self._finish(record, CANCELLED, None, "cancelled before it started")
                return record
            if record.state != RUNNING:
                raise GadeiError(f"job {name!r} is {record.state}; nothing to cancel")
            if not record.orphaned:
                try:
                    os.killpg(record.pid, signal.SIGTERM)  # gadei run stops its job: last checkpoint, logs kept
                except ProcessLookupError:
                    pass
            record.message = "cancelling"
            record.state = CANCELLED
            self._save(record)
        if record.orphaned:
            self._cancel_orphan(record)
        return record

    def _cancel_orphan(self, record: JobRecord) -> None:
        """No gadei run: stop the job as it would, in a thread, without holding the lock (up to a
        minute). A daemon that dies meanwhile leaves the record cancelled but not ended: the
        next one starts this again (`__init__`)."""
        threading.Thread(target=self._stop_orphan, args=(record,), daemon=True,
                         name=f"gadei-daemon-cancel-{record.name}").start()

    def _stop_orphan(self, record: JobRecord, tries: int = 5) -> None:
        """An orphaned job's cancel: the checkpoint that records each learner's progress, then the
        stop (`gadei.launch.stop_job`), tried again while a server of the job lives on (its
        watchdog may restart a server it found dead meanwhile); `_reap` records the end."""
        from ..launch import stop_job
        from ..run import checkpoint_progress

        name = record.name
        try:
            taken = checkpoint_progress(jobfile.load(Path(record.output) / "job.toml"))
        except GadeiError as err:  # its job as run is gone: stop it all the same
            log.warning("job %s: no checkpoint before cancelling it: %s", name, err)
            taken = None
        if taken is not None:
            log.info("job %s: checkpoint %s at version %s before cancelling it", name, taken.path.name,
                     f"{taken.version:,}")
        for attempt in range(tries):
            try:
                stop_job(name, timeout=60)
                return
            except Exception as err:  # noqa: BLE001 (a thread of the daemon: say it, never die silently)
                if not _job_alive(record):
                    return
                log.warning("job %s: cannot stop it (try %d of %d): %s", name, attempt + 1, tries, _reason(err))
                time.sleep(2.0)
        log.error("job %s: still runs after %d tries to stop it; stop it with `gadei stop %s`", name, tries, name)

    def logs(self, name: str, lines: int) -> str:
        with self.lock:
            record = self._get(name)
        return job_logs(record, lines)

    def _get(self, name: str) -> JobRecord:
        record = self.records.get(name)
        if record is None:
            raise NoSuchJob(f"the daemon has no job {name!r} (known: {', '.join(sorted(self.records)) or 'none'})")
        return record

    # ------------------------------------------------------------------ the runner

    def run_queue(self) -> None:
        """Start queued jobs while fewer than max_jobs run; notice the ones that ended."""
        while not self._stop.is_set():
            try:
                self._run_once()
            except Exception:  # e.g. a record that cannot be saved (disk full): log it, the loop goes on
                log.exception("the runner failed; trying again in %g s", self.poll)
            self._stop.wait(self.poll)

    def _run_once(self) -> None:
        """One look: reap the jobs that ended, start queued ones; a job that cannot start is
        failed with the reason and the next one is started instead."""
        with self.lock:
            self._reap()
            running = sum(r.state == RUNNING or (r.state == CANCELLED and r.pid) for r in self.records.values())
            queued = sorted((r for r in self.records.values() if r.state == QUEUED), key=lambda r: r.submitted)
            for record in queued[: max(0, self.max_jobs - running)]:
                try:
                    self._start(record)
                except Exception as err:  # this job cannot start; the queue goes on with the next
                    reason = _reason(err)
                    log.warning("job %s could not start: %s", record.name, reason)
                    try:
                        self._finish(record, FAILED, None, f"could not start: {reason}")
                    except OSError as save_err:  # the record stays queued in memory only: drop it
                        log.error("job %s: cannot save its record (%s); forgetting it", record.name, save_err)
                        self.records.pop(record.name, None)

    def _start(self, record: JobRecord) -> None:
        logs = os.path.dirname(record.log)
        if os.path.lexists(record.output) and not os.path.isdir(record.output):
            raise GadeiError(f"output folder {record.output} is not a folder")
        os.makedirs(logs, mode=0o700, exist_ok=True)  # private until `gadei run` applies the job's [output] private
        fd = os.open(record.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        from ..launch import spawn

        env = {**os.environ, **job_cores_env(self.max_jobs)}  # its share of the cores, beside the other jobs
        oom_kills = _proc.oom_kills()
        with open(fd, "ab") as out:
            proc = spawn(_proc.gadei_command("run", record.jobfile, "--quiet", "--submitted")
                         + (["--resume"] if record.resume else []), log=out, held=True, env=env)  # a cancel at once
        # is then a stop it takes (once its handler is set), never its death
        self.procs[record.name] = proc, oom_kills
        record.state, record.pid, record.started = RUNNING, proc.pid, time.time()
        try:
            record.pid_start = _proc.start_time(proc.pid)
        except Exception:  # it ended at once: _reap says how
            record.pid_start = 0.0
        self._save(record)
        log.info("job %s started (pid %d)", record.name, proc.pid)

    def _reap(self) -> None:
        for record in self.records.values():
            if record.orphaned and record.state in (RUNNING, CANCELLED):
                if not _job_alive(record):
                    self._conclude(record, None, record.message.split(";")[0])
                continue
            if not record.pid:
                continue
            proc, oom_kills = self.procs.get(record.name, (None, None))
            if proc is not None:
                code = proc.poll()
                if code is None:
                    continue
                del self.procs[record.name]
            elif _proc.alive(record.pid, record.pid_start):
                continue  # a job an earlier daemon started
            else:
                code, oom_kills = None, self.oom_kills
            if code != 0 and _job_alive(record):
                self._orphan(record, f"its `gadei run` (pid {record.pid}) " + _proc.how_it_ended(code, oom_kills))
                continue
            self._conclude(record, code, oom_kills=oom_kills)

    # ------------------------------------------------------------------ the socket

    def serve_forever(self) -> None:
        """Serve requests on the socket until SIGTERM, SIGINT or a `stop` request.

        Raises:
            DaemonRunning: another daemon holds this state folder's (or this socket's) lock.
        """
        path = socket_path()
        exporter = None
        try:
            self._locks.append(_lock(Path(path + ".lock"), f"socket {path}"))
            if self.metrics_port is not None:
                from . import metrics

                exporter = metrics.serve(self, self.metrics_port, (QUEUED, RUNNING, DONE, FAILED, CANCELLED), RUNNING)
                print(f"gadei daemon: Prometheus metrics on http://{metrics.LOOPBACK}:{exporter.server_port}/metrics",
                      file=sys.stderr, flush=True)
            self._serve(path)
        finally:
            if exporter is not None:
                exporter.shutdown()
                exporter.server_close()
            self.close()

    def close(self) -> None:
        """Let go of the locks (they also go when the process ends)."""
        while self._locks:
            os.close(self._locks.pop())

    def _serve(self, path: str) -> None:
        _raise_fd_limit(MAX_CONNECTIONS + 64)
        try:
            os.unlink(path)  # a dead daemon's socket: we hold the lock, so nobody else's
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is created 0600
        try:
            listener.bind(path)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        listener.listen(BACKLOG)
        listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="gadei-daemon-request")
        runner = threading.Thread(target=self.run_queue, name="gadei-daemon-runner", daemon=True)
        runner.start()
        previous = {sig: signal.signal(sig, lambda *_: self.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
        share = job_cores_env(self.max_jobs)
        log.info("gadei daemon (pid %d) listening on %s; %d jobs at once%s; job records in %s", os.getpid(), path,
                 self.max_jobs, f", each counting on {share[CORES]} of {cores_said()}" if share else "",
                 self.folder / "jobs")
        print(f"gadei daemon: listening on {path}; stop it with `gadei daemon stop`", file=sys.stderr, flush=True)
        try:
            Loop(self, listener).run()
        finally:
            self._stop.set()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._pool.shutdown(wait=False, cancel_futures=True)
            runner.join(5)
            listener.close()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            self._wake_r.close()
            self._wake_w.close()
            log.info("gadei daemon stopped; running jobs go on and the next daemon finds them")

    def note_refused(self) -> None:
        """One more request answered with an error (the listener's loop, its one thread that
        replies, calls this; a scrape only reads the count)."""
        self.refused += 1

    def stop(self) -> None:
        """Ask the loop to end (a signal handler, a `stop` request)."""
        self._stop.set()
        wake = getattr(self, "_wake_w", None)
        if wake is not None:
            try:
                wake.send(b"x")
            except OSError:
                pass  # the loop has wake-ups to read already, or is gone

    def answer(self, line: bytes) -> dict:
        """The answer to one request line: {"ok": true, ...} or {"ok": false, "error": ..., "kind": ...}
        (the class of the error, e.g. NoSuchJob, JobFileError); never raises."""
        try:
            req = check_request(line)
            op = req["op"]
            if op == "submit":
                record = self.submit(req["jobfile"], resume=req.get("resume", False))
                return {"ok": True, "job": asdict(record)}
            if op == "status":
                with self.lock:
                    self._reap()
                    if req.get("job") is not None:
                        return {"ok": True, "jobs": [asdict(self._get(req["job"]))]}
                    return {"ok": True, "jobs": [asdict(r) for r in sorted(self.records.values(),
                                                                            key=lambda r: r.submitted)]}
            if op == "cancel":
                return {"ok": True, "job": asdict(self.cancel(req["job"]))}
            if op == "logs":
                return {"ok": True, "text": self.logs(req["job"], req.get("lines", 50))}
            if op == "stop":
                log.info("stop requested")
                self.stop()
                return {"ok": True, "pid": os.getpid()}
            raise AssertionError(op)
        except GadeiError as err:  # "kind": the error's class, which the client raises again (`client.Client`)
            return {"ok": False, "error": str(err), "kind": type(err).__name__}
        except Exception as err:  # a bug must cost one request its answer, never the daemon
            log.exception("request %.200r failed", line)
            return {"ok": False, "error": f"the daemon failed on this request: {type(err).__name__}: {err}"}


def _job_alive(record: JobRecord) -> bool:
    """A server of the job runs, or someone (its watchdog) is writing its outputs."""
    from .. import outputs
    from ..region import inspect

    found = inspect(record.name)
    if found is not None and found.state in ("running", "starting"):
        return True
    out = Path(record.output)
    if outputs.owned(out):
        return True
    if outputs.read_result(out) is not None:
        return False
    ending = outputs.read_ending(out)
    if ending is None:
        return _watchdog_alive(record.name)
    # the watchdog writes the end record, then takes the lock to write the outputs: between the two it lives on
    return _proc.alive_since(ending.pid, ending.time)


def _watchdog_alive(name: str) -> bool:
    """The job's watchdog still runs (its record names it while it lives: `gadei.watchdog_record`)."""
    from ..watchdog_record import state_path

    return os.path.exists(state_path(name))


def _reason(err: Exception) -> str:
    if isinstance(err, OSError) and err.strerror:
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    return str(err) or type(err).__name__


LOG_TAIL_BYTES = 4 << 20  # the most of one log a `logs` answer carries


def _tail(path, lines: int) -> str:
    """The last `lines` lines of the file at `path`, from at most its last LOG_TAIL_BYTES."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        handle.seek(max(0, size - LOG_TAIL_BYTES))
        data = handle.read(LOG_TAIL_BYTES)
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def _lock(path: Path, what: str) -> int:
    """Hold an exclusive lock on `path` for this process's life (the descriptor); the holder's
    pid is written in it. Raises DaemonRunning when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DaemonRunning(f"a gadei daemon (pid {holder}) already serves {what}; stop it with `gadei daemon "
                            f"stop`, or give this one another GADEI_STATE_DIR and GADEI_RUNTIME_DIR") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _raise_fd_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            log.warning("at most %d open files (ulimit -n): fewer than %d connections may be open at once", new,
                        MAX_CONNECTIONS)


class DaemonRunning(GadeiError):
    """Another daemon already serves this state folder or socket."""


def _written_at(path: Path) -> float | None:
    """When `path` was last written (not after now), or None where it cannot be read."""
    try:
        return min(time.time(), path.stat().st_mtime)
    except OSError:
        return None
