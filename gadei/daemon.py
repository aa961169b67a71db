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

Protocol: one JSON object per line each way. Requests: {"op": "submit", "jobfile": PATH},
{"op": "status", "job": NAME or null}, {"op": "cancel", "job": NAME}, {"op": "logs", "job":
NAME, "lines": N}. Answers: {"ok": true, ...} or {"ok": false, "error": MESSAGE}.
"""

import json
import logging
import os
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import _proc, jobfile
from .env import runtime_dir
from .errors import GadeiError

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
        job = jobfile.load(path)
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
        for path in [record.log, *sorted(Path(record.output, "logs").glob("learner-*.log"))]:
            try:
                text = Path(path).read_text(errors="replace").splitlines()
            except FileNotFoundError:
                continue
            parts.append(f"==> {path} <==\n" + "\n".join(text[-lines:]))
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
            with self.lock:
                self._reap()
                running = sum(r.state == RUNNING or (r.state == CANCELLED and r.pid) for r in self.records.values())
                queued = sorted((r for r in self.records.values() if r.state == QUEUED), key=lambda r: r.submitted)
                for record in queued[: max(0, self.max_jobs - running)]:
                    self._start(record)
            self._stop.wait(self.poll)

    def _start(self, record: Record) -> None:
        os.makedirs(os.path.dirname(record.log), exist_ok=True)
        with open(record.log, "ab") as out:
            proc = subprocess.Popen(_proc.gadei_command("run", record.jobfile, "--quiet")
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
        path = socket_path()
        if os.path.exists(path):
            try:
                request(path, {"op": "status", "job": None}, timeout=2)
                raise GadeiError(f"a gadei daemon already listens on {path}")
            except (ConnectionRefusedError, FileNotFoundError, socket.timeout):
                os.unlink(path)  # a dead daemon's socket
        daemon = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                pid, uid, _ = struct.unpack("3i", self.connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                            struct.calcsize("3i")))
                if uid != os.getuid():
                    log.warning("refused a request from uid %d (pid %d)", uid, pid)
                    answer = {"ok": False, "error": f"this gadei daemon serves uid {os.getuid()} only; a request "
                              f"from uid {uid} is refused"}
                else:
                    answer = daemon.answer(self.rfile.readline())
                self.wfile.write((json.dumps(answer) + "\n").encode())

        old_umask = os.umask(0o177)  # the socket is created 0600
        try:
            server = socketserver.ThreadingUnixStreamServer(path, Handler)
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        server.daemon_threads = True
        runner = threading.Thread(target=self.run_queue, name="gadei-daemon-runner", daemon=True)
        runner.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
        log.info("gadei daemon (pid %d) listening on %s; %d jobs at once; job records in %s", os.getpid(), path,
                 self.max_jobs, self.folder / "jobs")
        print(f"gadei daemon: listening on {path}", file=sys.stderr, flush=True)
        try:
            server.serve_forever(poll_interval=0.2)
        finally:
            self._stop.set()
            runner.join(5)
            server.server_close()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            log.info("gadei daemon stopped; running jobs go on and the next daemon finds them")

    def answer(self, line: bytes) -> dict:
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "submit":
                record = self.submit(req["jobfile"], resume=bool(req.get("resume")))
                return {"ok": True, "job": asdict(record)}
            if op == "status":
                with self.lock:
                    self._reap()
                    if req.get("job"):
                        return {"ok": True, "jobs": [asdict(self._get(req["job"]))]}
                    return {"ok": True, "jobs": [asdict(r) for r in sorted(self.records.values(),
                                                                            key=lambda r: r.submitted)]}
            if op == "cancel":
                return {"ok": True, "job": asdict(self.cancel(req["job"]))}
            if op == "logs":
                return {"ok": True, "text": self.logs(req["job"], int(req.get("lines", 50)))}
            return {"ok": False, "error": f"unknown request {op!r}"}
        except (GadeiError, ValueError, KeyError, TypeError) as err:
            return {"ok": False, "error": str(err) if not isinstance(err, KeyError) else f"missing field {err}"}


def request(path: str | None, message: dict, timeout: float = 30.0) -> dict:
    """Send one request to the daemon; its answer. Raises GadeiError when no daemon listens."""
    path = path or socket_path()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall((json.dumps(message) + "\n").encode())
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


def client(message: dict) -> dict:
    """`request` for the command line: a clear error when no daemon runs, or it refused."""
    path = socket_path()
    try:
        answer = request(path, message)
    except (FileNotFoundError, ConnectionRefusedError):
        raise GadeiError(f"no gadei daemon listens on {path}; start one with `gadei daemon`") from None
    except PermissionError:
        raise GadeiError(f"{path} belongs to another user's daemon") from None
    if not answer.get("ok"):
        raise GadeiError(answer.get("error", "the daemon refused"))
    return answer


def format_jobs(jobs: list[dict]) -> str:
    rows = [("job", "state", "submitted", "ran", "output", "note")]
    for j in jobs:
        ran = (j["ended"] or time.time()) - j["started"] if j["started"] else 0
        rows.append((j["name"], j["state"], time.strftime("%m-%d %H:%M:%S", time.localtime(j["submitted"])),
                     f"{ran:.0f} s" if j["started"] else "-", j["output"], j["message"]))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
