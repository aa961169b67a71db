"""The daemon's service: one per state folder (by a lock held for its life), its jobs
(`gadei.daemon.jobs.Jobs`) served on a Unix socket, one JSON request a line
(`gadei.daemon.listener`), until SIGTERM, SIGINT or a `stop` request."""

import fcntl
import logging
import os
import queue
import resource
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from .. import _proc
from ..env import CORES, cores_said, job_cores_env, runtime_dir
from ..errors import GadeiError
from .jobs import CANCELLED, DONE, FAILED, QUEUED, RUNNING, Jobs, state_dir
from .listener import BACKLOG, MAX_CONNECTIONS, WORKERS, Loop, check_request

log = logging.getLogger(__name__)


ZYGOTE_READY = 60.0  # seconds the daemon waits for its zygote to be warm before it listens


SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (Linux's sun_path holds 108, its NUL included)


def socket_path() -> str:
    """The daemon's socket: `daemon.sock` in this user's runtime folder.

    Raises:
        GadeiError: the path is too long for a Unix socket (a deep GADEI_RUNTIME_DIR).
    """
    path = os.path.join(runtime_dir(), "daemon.sock")
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise GadeiError(f"the daemon's socket {path} is {len(os.fsencode(path))} bytes long, more than the "
                         f"{SOCKET_PATH_MAX} a Unix socket's path may have; set GADEI_RUNTIME_DIR to a shorter folder")
    return path


class Daemon(Jobs):
    """The queue, the runner and the request handler; `serve_forever()` until SIGTERM/SIGINT."""

    def __init__(self, max_jobs: int | None = None, poll: float = 0.5, metrics_port: int | None = None):
        if max_jobs is not None and max_jobs < 1:
            raise GadeiError(f"--max-jobs {max_jobs}: must be at least 1")
        if metrics_port is not None and not 0 <= metrics_port <= 65535:
            raise GadeiError(f"--metrics-port {metrics_port}: must be a TCP port, 0 to 65535 (0: any free one)")
        self.metrics_port = metrics_port
        self.started = time.monotonic()
        self.refused = 0  # requests answered with an error (`gadei.daemon.metrics`), counted by `note_refused`
        folder = state_dir()
        # One daemon per state folder, for its whole life: a second one (even beside a stopped
        # first) is refused here, before it reads or writes a record.
        self._locks = [_lock(folder / "daemon.lock", f"state folder {folder}")]
        super().__init__(folder, max_jobs, poll)

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
        # Warm before the socket: the zygote imports what a job's processes need, and beside it this
        # process what a submit needs (its checks read the job's data: torch and the workloads),
        # seconds of CPU each; a daemon that listens takes its first job as fast as its next ones,
        # and a client that sees the socket sees a ready daemon.
        self._warm()
        runner = threading.Thread(target=self.run_queue, name="gadei-daemon-runner", daemon=True)
        runner.start()
        _import_submit()
        if not self.zygote.ready(ZYGOTE_READY):
            log.warning("the zygote (pid %d) is not warm after %g s; listening without it", self.zygote.proc.pid,
                        ZYGOTE_READY)
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
        previous = {sig: signal.signal(sig, lambda *_: self.stop()) for sig in (signal.SIGTERM, signal.SIGINT)}
        if self.max_jobs is None:
            placed = f"jobs placed by the cores ({cores_said()}), memory and /dev/shm they need"
        else:
            share = job_cores_env(self.max_jobs)
            placed = f"{self.max_jobs} jobs at once" + (f", each counting on {share[CORES]} of {cores_said()}"
                                                       if share else "")
        log.info("gadei daemon (pid %d) listening on %s; %s; job records in %s", os.getpid(), path, placed,
                 self.folder / "jobs")
        print(f"gadei daemon: listening on {path}; stop it with `gadei daemon stop`", file=sys.stderr, flush=True)
        try:
            Loop(self, listener).run()
        finally:
            self.stop_runner()
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
        self.stop_runner()
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


SUBMIT_IMPORTS = ("gadei.prepare", "gadei_workloads.registry", "gadei_workloads.cost", "gadei_workloads.text",
                  "gadei_workloads.ngram")


def _import_submit() -> None:
    """Import SUBMIT_IMPORTS (one that fails fails again where a submit needs it, and says so there)."""
    import importlib

    started = time.monotonic()
    for name in SUBMIT_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - said by the submit that needs it
            log.debug("importing %s ahead of the first submit failed", name, exc_info=True)
    log.info("imported what a submit needs in %.1f s", time.monotonic() - started)


def _lock(path: Path, what: str) -> int:
    """Hold an exclusive lock on `path` for this process's life (the descriptor); the holder's
    pid and start time are written in it (`lock_holder`). Raises DaemonRunning when another
    process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = (os.pread(fd, 64, 0).decode(errors="replace").split() or ["?"])[0]
        os.close(fd)
        raise DaemonRunning(f"a gadei daemon (pid {holder}) already serves {what}; stop it with `gadei daemon "
                            f"stop`, or give this one another GADEI_STATE_DIR and GADEI_RUNTIME_DIR") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {_proc.start_time()!r}\n".encode(), 0)
    return fd


def lock_holder(socket: str) -> int | None:
    """The pid of the live daemon that holds the lock of the socket at `socket`, or None. A daemon
    holds it from its start, and listens only once it is warm (seconds later): a client that
    finds no socket, or one that refuses it, waits for a daemon that holds the lock. (Read, not
    locked: a client's lock, however short, would turn a daemon that starts then away.)"""
    try:
        with open(socket + ".lock", "rb") as held:
            pid, started = held.read(64).split()[:2]
        pid, started = int(pid), float(started)
    except (OSError, ValueError):  # none, or not yet written (an older daemon's held its pid alone)
        return None
    return pid if _proc.alive(pid, started) else None


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
