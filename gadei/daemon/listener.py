"""The daemon's socket: one selector loop (`Loop`) reads requests, checks them
(`check_request`: a JSON object of a known op with known, typed fields, within MAX_REQUEST
bytes and REQUEST_TIMEOUT seconds) and writes the answers its worker threads compute."""

import json
import logging
import os
import queue
import selectors
import socket
import struct
import time

from ..errors import GadeiError
from ..protocol import Deadline


log = logging.getLogger(__name__)

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


def check_request(line: bytes) -> dict:
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


class Loop:
    """One thread serves every client: non-blocking sockets, a buffer and a deadline per
    connection, a bounded number of them; complete requests go to a small pool of threads,
    whose answers come back through a socket pair that wakes the loop."""

    WARN_EVERY = 60.0  # seconds between two warnings of one kind: a flood of bad clients must not flood the log

    def __init__(self, daemon, listener: socket.socket):  # daemon: a gadei.daemon.service.Daemon
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
        deadline = Deadline(timeout)
        self._take_answers()
        while any(c.outbox or c.deadline == float("inf") for c in self.conns.values()) and not deadline.expired():
            for key, events in self.selector.select(timeout=deadline.left()):
                if key.data == "wake":
                    self._woken()
                elif isinstance(key.data, _Conn) and events & selectors.EVENT_WRITE:
                    self._write(key.data)

    def _reply(self, conn: _Conn, answer: dict) -> None:
        if not answer.get("ok"):
            self.daemon.note_refused()
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
