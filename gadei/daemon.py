"""`gadei daemon`: training as a service for one user. Jobs arrive as job files on a Unix
socket, wait in a queue, and run (`gadei run`) up to `max_jobs` at once.

The socket is `daemon.sock` in the user's runtime folder (`gadei.env.runtime_dir`, mode
0700), itself mode 0600, and every request's peer uid is read with SO_PEERCRED: a request
from another user is refused even where the file modes would let it through.

Each job's record is a JSON file in the state folder (`GADEI_STATE_DIR`, default
`$XDG_STATE_HOME/gadei` or `~/.local/state/gadei`), written atomically on every change, so
a daemon that is restarted knows every job's state and output. Jobs run in sessions of
their own: a daemon that stops or dies leaves them running, and the next one finds them
again by pid and start time (or, if they ended meanwhile, by the model they left).

One daemon per state folder: it holds an exclusive `flock` on `daemon.lock` there (and on
`daemon.sock.lock` beside its socket) for its whole life, so a second daemon is refused at
once, even beside a stopped one, and a daemon only ever removes its own socket.

Protocol: one JSON object per line each way. Requests: {"op": "submit", "jobfile": PATH,
"resume": BOOL}, {"op": "status", "job": NAME or null}, {"op": "cancel", "job": NAME},
{"op": "logs", "job": NAME, "lines": N}, {"op": "stop"}. Answers: {"ok": true, ...} or {"ok":
false, "error": MESSAGE}. One thread serves every connection (`_Loop`, a selector): a request
is at most MAX_REQUEST bytes and must arrive within REQUEST_TIMEOUT, at most MAX_CONNECTIONS
are open at once, and every request, however malformed, gets an answer; WORKERS threads
compute the answers. A job that cannot start is marked failed with the reason, and the queue
goes on.
"""

import fcntl
import json
import logging
import os
import queue
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from . import _proc, jobfile
from .env import runtime_dir
from .errors import GadeiError, GadeiTimeout

log = logging.getLogger(__name__)

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
LIVE = (QUEUED, RUNNING)


def state_dir() -> Path:
    folder = os.environ.get("GADEI_STATE_DIR")
    if not folder:
        base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        folder = os.path.join(base, "gadei")
    path = Path(folder)
    (path / "jobs").mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def socket_path() -> str:
    return os.path.join(runtime_dir(), "daemon.sock")


@dataclass
class Record:
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

    @property
    def log(self) -> str:
        return os.path.join(self.output, "logs", "run.log")


class Daemon:
    """The queue, the runner and the request handler; `serve_forever()` until SIGTERM/SIGINT."""

    def __init__(self, max_jobs: int = 1, poll: float = 0.5):
        if max_jobs < 1:
            raise GadeiError(f"--max-jobs {max_jobs}: must be at least 1")
        self.max_jobs, self.poll = max_jobs, poll
        self.folder = state_dir()
        # One daemon per state folder, for its whole life: a second one (even beside a stopped
        # first) is refused here, before it reads or writes a record.
        self._locks = [_lock(self.folder / "daemon.lock", f"state folder {self.folder}")]
        self.lock = threading.Lock()
        self.records: dict[str, Record] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self._stop = threading.Event()
        for path in sorted((self.folder / "jobs").glob("*.json")):
            try:
                record = Record(**json.loads(path.read_text()))
            except (ValueError, TypeError) as err:
                log.warning("skipping the unreadable job record %s: %s", path, err)
                continue
            self.records[record.name] = record
        with self.lock:
            for record in self.records.values():
                if record.state == RUNNING:
                    self._reattach(record)

    # ------------------------------------------------------------------ records

    def _save(self, record: Record) -> None:
        path = self.folder / "jobs" / f"{record.name}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(record), indent=1))
        os.replace(tmp, path)

    def _reattach(self, record: Record) -> None:
        if _proc.alive(record.pid, record.pid_start):
            log.info("job %s still runs (pid %d): watching it again", record.name, record.pid)
            return
        done = os.path.exists(os.path.join(record.output, "model.pt"))
        self._finish(record, DONE if done else FAILED, None,
                     "ended while the daemon was down" + ("" if done else "; see its logs"))

    def _finish(self, record: Record, state: str, code: int | None, message: str = "") -> None:
        record.state, record.returncode, record.ended, record.pid = state, code, time.time(), 0
        record.message = message
        self._save(record)
        log.info("job %s %s%s", record.name, state, f": {message}" if message else "")

    # ------------------------------------------------------------------ requests

    def submit(self, path: str, resume: bool = False) -> Record:
        """Check a job file and its data now, then queue it; `resume`: to go on with the run in
        its output folder. Raises GadeiError saying why not."""
        from .region import check_name_free

        job = jobfile.load(path)
        check_name_free(job.name)  # a squatted region name is the submitter's to hear, not the log's
        with self.lock:
            old = self.records.get(job.name)
            if old is not None and old.state in LIVE:
                raise GadeiError(f"job {job.name!r} is already {old.state}; cancel it first or give the job "
                                 "another [job] name")
        train, _ = jobfile.load_data(job)  # a data problem is the submitter's to hear, not the log's
        checkpoints = job.output / "checkpoints"
        if resume:
            from .run import resume_point

            resume_point(job.with_defaults(len(train))[0], remove_model=False)  # refused now, not in the log
        elif checkpoints.is_dir() and any(checkpoints.iterdir()):
            raise GadeiError(f"output folder {job.output} holds a previous run (checkpoints/); go on with it with "
                             "`gadei submit --resume`, or set another [output] folder, or remove that one")
        record = Record(name=job.name, jobfile=str(job.path), output=str(job.output), submitted=time.time(),
                        resume=resume)
        with self.lock:
            self.records[job.name] = record
            self._save(record)
        log.info("job %s queued (%s)", job.name, job.path)
        return record

    def cancel(self, name: str) -> Record:
        with self.lock:
            record = self._get(name)
            if record.state == QUEUED:
                self._finish(record, CANCELLED, None, "cancelled before it started")
            elif record.state == RUNNING:
                try:
                    os.killpg(record.pid, signal.SIGTERM)  # gadei run stops its job: last checkpoint, logs kept
                except ProcessLookupError:
                    pass
                record.message = "cancelling"
                record.state = CANCELLED
                self._save(record)
            else:
                raise GadeiError(f"job {name!r} is {record.state}; nothing to cancel")
            return record

    def logs(self, name: str, lines: int) -> str:
        with self.lock:
            record = self._get(name)
        parts = []
        try:
            learners = sorted(Path(record.output, "logs").glob("learner-*.log"))
        except OSError:
            learners = []
        for path in [record.log, *learners]:
            try:
                text = _tail(path, lines)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as err:
                text = f"(unreadable: {err.strerror})"
            parts.append(f"==> {path} <==\n" + text)
        return "\n".join(parts) if parts else f"job {name!r} has no logs yet"

    def _get(self, name: str) -> Record:
        record = self.records.get(name)
        if record is None:
            raise GadeiError(f"the daemon has no job {name!r} (known: {', '.join(sorted(self.records)) or 'none'})")
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

    def _start(self, record: Record) -> None:
        logs = os.path.dirname(record.log)
        if os.path.lexists(record.output) and not os.path.isdir(record.output):
            raise GadeiError(f"output folder {record.output} is not a folder")
        os.makedirs(logs, mode=0o700, exist_ok=True)  # private until `gadei run` applies the job's [output] private
        fd = os.open(record.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "gadei", "run", record.jobfile, "--quiet"]
                                    + (["--resume"] if record.resume else []), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[record.name] = proc
        record.state, record.pid, record.started = RUNNING, proc.pid, time.time()
        try:
            record.pid_start = _proc.start_time(proc.pid)
        except Exception:  # it ended at once: _reap says how
            record.pid_start = 0.0
        self._save(record)
        log.info("job %s started (pid %d)", record.name, proc.pid)

    def _reap(self) -> None:
        for record in self.records.values():
            if not record.pid:
                continue
            proc = self.procs.get(record.name)
            if proc is not None:
                code = proc.poll()
                if code is None:
                    continue
                del self.procs[record.name]
            elif _proc.alive(record.pid, record.pid_start):
                continue  # a job an earlier daemon started
            else:
                code = None
            if record.state == CANCELLED:
                self._finish(record, CANCELLED, code, "cancelled; its last checkpoint and logs are kept")
            elif code == 0 or (code is None and os.path.exists(os.path.join(record.output, "model.pt"))):
                self._finish(record, DONE, code)
            else:
                self._finish(record, FAILED, code, f"gadei run exited {code}; see `gadei logs {record.name}`")

    # ------------------------------------------------------------------ the socket

    def serve_forever(self) -> None:
        """Serve requests on the socket until SIGTERM, SIGINT or a `stop` request.

        Raises:
            DaemonRunning: another daemon holds this state folder's (or this socket's) lock.
        """
        path = socket_path()
        try:
            self._locks.append(_lock(Path(path + ".lock"), f"socket {path}"))
            self._serve(path)
        finally:
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
        log.info("gadei daemon (pid %d) listening on %s; %d jobs at once; job records in %s", os.getpid(), path,
                 self.max_jobs, self.folder / "jobs")
        print(f"gadei daemon: listening on {path}; stop it with `gadei daemon stop`", file=sys.stderr, flush=True)
        try:
            _Loop(self, listener).run()
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
        """The answer to one request line: {"ok": true, ...} or {"ok": false, "error": ...}; never raises."""
        try:
            req = _check_request(line)
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
        except GadeiError as err:
            return {"ok": False, "error": str(err)}
        except Exception as err:  # a bug must cost one request its answer, never the daemon
            log.exception("request %.200r failed", line)
            return {"ok": False, "error": f"the daemon failed on this request: {type(err).__name__}: {err}"}


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


# ------------------------------------------------------------------ requests on the wire

MAX_REQUEST = 64 * 1024  # bytes of one request line (a submit names a job file, it does not carry it)
REQUEST_TIMEOUT = 10.0  # seconds a client has to send its request, and to take its answer
MAX_CONNECTIONS = 512  # open at once; past it, the one that waited longest without a request is closed
BACKLOG = 1024  # connections the kernel queues before the loop accepts them
WORKERS = 4  # threads that answer requests (a submit reads the job's data)

_FIELDS = {  # op -> field -> (check, required)
    "submit": {"jobfile": ("path", True), "resume": ("bool", False)},
    "status": {"job": ("job_or_null", False)},
    "cancel": {"job": ("job", True)},
    "logs": {"job": ("job", True), "lines": ("lines", False)},
    "stop": {},
}
MAX_LINES = 100_000


class BadRequest(GadeiError, ValueError):
    """A request the daemon does not take (the message says which field and why)."""


def _check_request(line: bytes) -> dict:
    """The request in `line`, checked: a JSON object with a known `op` and its known fields,
    of the right types and ranges. Raises BadRequest saying what is wrong."""
    try:
        req = json.loads(line, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest("request: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"request: not JSON ({err})") from None
    if not isinstance(req, dict):
        raise BadRequest(f"request: a JSON object is expected, not {type(req).__name__} ({_short(req)})")
    op = req.get("op")
    if op not in _FIELDS:
        raise BadRequest(f"request: op = {_short(op)} is unknown; allowed: {', '.join(_FIELDS)}")
    fields = _FIELDS[op]
    for key in req:
        if key != "op" and key not in fields:
            raise BadRequest(f"request {op!r}: unknown field {_short(key)}; allowed: {', '.join(fields) or 'none'}")
    for key, (check, required) in fields.items():
        if key not in req:
            if required:
                raise BadRequest(f"request {op!r}: the field {key!r} is missing")
            continue
        value, where = req[key], f"request {op!r}: {key} = {_short(req[key])}"
        if check == "bool" and not isinstance(value, bool):
            raise BadRequest(f"{where}: true or false is expected")
        if check == "lines" and (isinstance(value, bool) or not isinstance(value, int)
                                 or not 1 <= value <= MAX_LINES):
            raise BadRequest(f"{where}: an integer from 1 to {MAX_LINES:,} is expected")
        if check == "path" and (not isinstance(value, str) or not value or "\0" in value or len(value) > 4096
                                or not os.path.isabs(value)):
            raise BadRequest(f"{where}: an absolute path (a string of up to 4,096 characters) is expected")
        if check in ("job", "job_or_null") and not (value is None and check == "job_or_null"):
            if not isinstance(value, str) or not value or len(value) > 255:
                raise BadRequest(f"{where}: a job name is expected")
    return req


def _no_constant(name: str):
    raise ValueError(f"{name} is not allowed")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Conn:
    """One client: its socket, what it sent so far, the answer still to send, its deadline."""

    __slots__ = ("sock", "uid", "pid", "inbox", "outbox", "deadline", "waiting", "accepted")

    def __init__(self, sock: socket.socket, now: float):
        self.sock = sock
        self.inbox = bytearray()
        self.outbox = b""
        self.accepted = now
        self.deadline = now + REQUEST_TIMEOUT
        self.waiting = True  # for its request (False once it is complete: answered or being answered)
        self.pid, self.uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                     struct.calcsize("3i")))


class _Loop:
    """One thread serves every client: non-blocking sockets, a buffer and a deadline per
    connection, a bounded number of them; complete requests go to a small pool of threads,
    whose answers come back through a socket pair that wakes the loop."""

    WARN_EVERY = 60.0  # seconds between two warnings of one kind: a flood of bad clients must not flood the log

    def __init__(self, daemon: Daemon, listener: socket.socket):
        self.daemon, self.listener = daemon, listener
        self.selector = selectors.DefaultSelector()
        self.conns: dict[int, _Conn] = {}  # fd -> connection, oldest first
        self._warned: dict[str, list] = {}  # message -> [time of the last warning, warnings held back since]

    def _warn(self, message: str, *args) -> None:
        """log.warning, at most once every WARN_EVERY seconds per message; the next one says how
        many were held back."""
        now = time.monotonic()
        last = self._warned.setdefault(message, [-self.WARN_EVERY, 0])
        if now - last[0] < self.WARN_EVERY:
            last[1] += 1
            return
        held = f" ({last[1]} more like it in the last {now - last[0]:.0f} s)" if last[1] else ""
        last[0], last[1] = now, 0
        log.warning(message + held, *args)

    def run(self) -> None:
        d = self.daemon
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(d._wake_r, selectors.EVENT_READ, "wake")
        try:
            while not d._stop.is_set():
                now = time.monotonic()
                nearest = min((c.deadline for c in self.conns.values()), default=now + 1.0)
                for key, events in self.selector.select(timeout=min(1.0, max(0.0, nearest - now))):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._woken()
                    elif events & selectors.EVENT_READ:
                        self._read(key.data)
                    elif events & selectors.EVENT_WRITE:
                        self._write(key.data)
                self._expire()
            self._flush_answers(REQUEST_TIMEOUT / 10)  # e.g. the answer to `stop`
        finally:
            for conn in list(self.conns.values()):
                self._close(conn)
            self.selector.close()

    def _accept(self) -> None:
        for _ in range(BACKLOG):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # e.g. EMFILE: the rest wait in the backlog
                self._warn("cannot accept a connection: %s", err)
                return
            sock.setblocking(False)
            if len(self.conns) >= MAX_CONNECTIONS:
                self._evict()
            conn = _Conn(sock, time.monotonic())
            self.conns[sock.fileno()] = conn
            self.selector.register(sock, selectors.EVENT_READ, conn)  # another uid's too: it hears why, after

    def _evict(self) -> None:
        """Make room: close the connection that waited longest without sending its request."""
        for conn in self.conns.values():
            if conn.waiting and not conn.outbox:
                self._warn("%d connections open: closing the oldest idle one (pid %d, %.1f s without a request)",
                            len(self.conns), conn.pid, time.monotonic() - conn.accepted)
                self._close(conn)
                return
        oldest = next(iter(self.conns.values()))
        self._close(oldest)

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # reset by the client: nothing to answer
            self._close(conn)
            return
        if not chunk:
            if conn.inbox:
                log.debug("pid %d hung up in the middle of a request", conn.pid)
            self._close(conn)
            return
        conn.inbox += chunk
        end = conn.inbox.find(b"\n")
        if end < 0 and len(conn.inbox) <= MAX_REQUEST:
            return
        self.selector.unregister(conn.sock)
        conn.waiting = False
        if end < 0 or end > MAX_REQUEST:
            self._warn("pid %d sent a request of over %d bytes: refused", conn.pid, MAX_REQUEST)
            self._reply(conn, {"ok": False, "error": f"request: over {MAX_REQUEST:,} bytes without a newline; a "
                               "request is one JSON object on one line"})
            return
        if conn.uid != os.getuid():
            self._warn("refused a request from uid %d (pid %d)", conn.uid, conn.pid)
            self._reply(conn, {"ok": False, "error": f"this gadei daemon serves uid {os.getuid()} only; a request "
                               f"from uid {conn.uid} is refused"})
            return
        line = bytes(conn.inbox[:end])
        conn.inbox = bytearray()
        conn.deadline = float("inf")  # being answered; the answer gets its own deadline
        future = self.daemon._pool.submit(self.daemon.answer, line)
        future.add_done_callback(lambda f, fd=conn.sock.fileno(), c=conn: self._answered(fd, c, f))

    def _answered(self, fd: int, conn: _Conn, future) -> None:  # a pool thread
        if future.cancelled():
            return
        self.daemon._answers.put((fd, conn, future.result()))
        try:
            self.daemon._wake_w.send(b"a")
        except OSError:
            pass  # full: the loop has wake-ups to read already

    def _woken(self) -> None:
        try:
            while self.daemon._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        self._take_answers()

    def _take_answers(self) -> None:
        while True:
            try:
                fd, conn, answer = self.daemon._answers.get_nowait()
            except queue.Empty:
                return
            if self.conns.get(fd) is conn:  # still connected (not closed and the descriptor reused)
                self._reply(conn, answer)

    def _flush_answers(self, timeout: float) -> None:
        """Before the loop ends: send the answers being computed or ready (bounded by `timeout`)."""
        deadline = time.monotonic() + timeout
        self._take_answers()
        while (any(c.outbox or c.deadline == float("inf") for c in self.conns.values())
               and time.monotonic() < deadline):
            for key, events in self.selector.select(timeout=max(0.0, deadline - time.monotonic())):
                if key.data == "wake":
                    self._woken()
                elif isinstance(key.data, _Conn) and events & selectors.EVENT_WRITE:
                    self._write(key.data)

    def _reply(self, conn: _Conn, answer: dict) -> None:
        conn.outbox = (json.dumps(answer) + "\n").encode()
        conn.waiting = False
        conn.deadline = time.monotonic() + REQUEST_TIMEOUT
        try:
            self.selector.register(conn.sock, selectors.EVENT_WRITE, conn)
        except KeyError:
            self.selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the client hung up before its answer: nothing to tell it
            log.debug("pid %d hung up before its answer", conn.pid)
            self._close(conn)
            return
        conn.outbox = conn.outbox[sent:]
        if not conn.outbox:
            self._close(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            if conn.waiting:
                self._warn("pid %d sent no complete request within %g s: closed", conn.pid, REQUEST_TIMEOUT)
                self.selector.unregister(conn.sock)
                self._reply(conn, {"ok": False, "error": f"request: not complete within {REQUEST_TIMEOUT:g} s"})
                if conn.sock.fileno() in self.conns and conn.outbox:  # it does not read: do not wait for it
                    self._close(conn)
            else:
                self._warn("pid %d did not take its answer within %g s: closed", conn.pid, REQUEST_TIMEOUT)
                self._close(conn)

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self.conns.pop(fd, None)
        conn.sock.close()


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


def request(path: str | None, message: dict, timeout: float = 30.0) -> dict:
    """Send one request to the daemon; its answer, within `timeout` seconds in all.

    A full listen backlog (EAGAIN) is waited out until the deadline, and a refused connection
    (a daemon restarting) for up to 2 s of it.

    Raises:
        FileNotFoundError, ConnectionRefusedError: no daemon listens on `path`.
        GadeiTimeout: no answer within `timeout`.
    """
    path = path or socket_path()
    deadline = time.monotonic() + timeout
    refused_until = time.monotonic() + min(2.0, timeout)
    pause = 0.005
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect(path)
            break
        except (BlockingIOError, InterruptedError, ConnectionRefusedError) as err:
            sock.close()
            now = time.monotonic()
            if isinstance(err, ConnectionRefusedError) and now >= refused_until:
                raise
            if now >= deadline:
                raise GadeiTimeout(f"the gadei daemon on {path} did not take the connection within {timeout:g} s "
                                   "(its listen backlog stayed full)") from None
            time.sleep(min(pause, max(0.0, deadline - now)))
            pause = min(0.1, pause * 2)
        except BaseException:
            sock.close()
            raise
    with sock:
        try:
            sock.sendall((json.dumps(message) + "\n").encode())
            data = b""
            while not data.endswith(b"\n"):
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except socket.timeout:
            raise GadeiTimeout(f"the gadei daemon on {path} did not answer within {timeout:g} s (is it stopped?)") \
                from None
    if not data:
        raise GadeiError(f"the gadei daemon on {path} closed the connection without an answer")
    return json.loads(data)


def client(message: dict, timeout: float = 30.0) -> dict:
    """`request` for the command line: a clear error when no daemon runs, or it refused."""
    path = socket_path()
    try:
        answer = request(path, message, timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        raise GadeiError(f"no gadei daemon listens on {path}; start one with `gadei daemon`") from None
    except PermissionError:
        raise GadeiError(f"{path} belongs to another user's daemon") from None
    if not answer.get("ok"):
        raise GadeiError(answer.get("error", "the daemon refused"))
    return answer


def stop(timeout: float = 30.0) -> int:
    """`gadei daemon stop`: ask the daemon to stop and wait until it has; its pid.

    Raises:
        GadeiError: no daemon runs.
        GadeiTimeout: it did not end within `timeout`.
    """
    pid = client({"op": "stop"}, timeout)["pid"]
    deadline = time.monotonic() + timeout
    while _proc_running(pid):
        if time.monotonic() >= deadline:
            raise GadeiTimeout(f"the gadei daemon (pid {pid}) did not stop within {timeout:g} s")
        time.sleep(0.05)
    return pid


def _proc_running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def systemd_unit() -> str:
    """A systemd user unit that runs this gadei's daemon (`gadei daemon systemd-unit` prints it)."""
    env = "".join(f"Environment={name}={os.environ[name]}\n" for name in ("GADEI_STATE_DIR", "GADEI_RUNTIME_DIR")
                  if os.environ.get(name))
    return (
        "[Unit]\n"
        "Description=gadei daemon: queued training jobs of %u\n"
        "Documentation=file://" + str(Path(__file__).resolve().parent.parent / "docs" / "daemon.md") + "\n\n"
        "[Service]\n"
        "Type=simple\n"
        f"ExecStart={sys.executable} -m gadei daemon run\n"
        f"ExecStop={sys.executable} -m gadei daemon stop\n"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        "UMask=0077\n"
        "KillMode=process\n"  # jobs run in sessions of their own: stopping the daemon leaves them running
        + env +
        "\n[Install]\n"
        "WantedBy=default.target\n"
    )


def format_jobs(jobs: list[dict]) -> str:
    rows = [("job", "state", "submitted", "ran", "output", "note")]
    for j in jobs:
        ran = (j["ended"] or time.time()) - j["started"] if j["started"] else 0
        rows.append((j["name"], j["state"], time.strftime("%m-%d %H:%M:%S", time.localtime(j["submitted"])),
                     f"{ran:.0f} s" if j["started"] else "-", j["output"], j["message"]))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
