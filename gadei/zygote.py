"""Warm starts: a job's processes forked from a process that has already imported what they
need (torch, NumPy, gadei, the workloads, the supervisor's package), as Android's zygote and
multiprocessing's forkserver start theirs, instead of each one starting an interpreter and
importing it all again (more than a second of CPU each).

- `warm()`: this process imports what a job's processes need, once, with its OpenMP runtime
  loaded under the passive wait policy (a server's, see `gadei.env.quiet_openmp`).
- `fork(command, ...)`: run `command` (a `gadei._proc` command line, `python -P -m MODULE
  ARGS`) in a child forked from this process, as `gadei.launch.spawn` runs it in a new
  interpreter: its own stdin, log, environment, session, signal handlers and title (`ps` shows
  the command), then MODULE run as `__main__`; its handle, a `Child`, answers as a
  `subprocess.Popen` does.
- `can_fork(passive)`: whether a fork is safe now: this process is warm and runs one thread
  of its own (a fork copies only the thread that calls it: a lock another held stays held), and
  the child may run under the passive policy (`passive`; OpenMP reads it once, as it loads).
- `Zygote`: a warm process of its own (`python -m gadei.zygote`) that forks job supervisors
  for the daemon, which runs threads and so cannot fork them itself; `serve` is its loop.

A forked child is its parent's child as a started one is: waited for, signalled and tied to it
(`gadei._proc.tie_to_parent`) the same way. What it does not get is a fresh interpreter: the
parent's open files stay open in it (one lock among them, on purpose: its job's claim on the
output folder, `gadei.claim`, which the job's processes hold with it; the daemon's own lock
never reaches a zygote, started with its descriptors closed), and it leaves by `os._exit`
after the module's exit handlers, never unwinding into its parent's code.
"""

import atexit
import importlib
import json
import logging
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from contextlib import contextmanager

from . import _proc
from .env import openmp_spins, quiet_openmp

log = logging.getLogger(__name__)

# What a job's processes import: the supervisor (its package, gadei's job layer, the plot and
# the event files it writes at the end), the server and the learners (torch, the kernels, the
# workloads).
PRELOAD = ("torch", "numpy", "gadei.server", "gadei.learner", "gadei.trainer", "gadei.checkpoint", "gadei.outputs",
           "gadei.board", "gadei.cli", "gadei_workloads.registry", "gadei_workloads.text", "gadei_workloads.ngram",
           "gadei_watchdog.cli", "gadei_watchdog.job")
# a job needs them at its end, and only where installed (the plot's figure and canvas; the event files)
LATE = ("matplotlib.figure", "matplotlib.backends.backend_agg", "torch.utils.tensorboard")
STOPS = (signal.SIGINT, signal.SIGTERM)  # as `gadei.launch.STOPS` (which imports this module)
_RESET = (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)

_warm = False


def warm(late: bool = True) -> None:
    """Import PRELOAD (and LATE where `late` and installed) into this process, with its OpenMP
    runtime passive. Idempotent."""
    global _warm
    if _warm:
        return
    quiet_openmp()
    for name in PRELOAD:
        importlib.import_module(name)
    if late:
        import_late()
    _warm = True


def import_late() -> None:
    """LATE's modules, those installed."""
    for name in LATE:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def can_fork(passive: bool = True) -> bool:
    """Whether `fork` may start a child now: this process is warm (`warm`), runs one Python
    thread, and the child may run with passive OpenMP threads (`passive`) as this process's do
    (they spin where OpenMP loaded before `warm`, or the user asked for it).

    Native pools are not counted: OpenBLAS's (NumPy's, started as it loads) stops and starts
    again around a fork by itself, and OpenMP's and torch's start only with their first parallel
    region, which a warm process never runs."""
    return _warm and passive and not openmp_spins() and hasattr(os, "fork") and threading.active_count() == 1


@contextmanager
def one_thread():
    """torch on this thread alone for the block: a warm process that computes (a job's supervisor
    evaluating a model it handed back) and forks after (the next candidate of a job that picks its
    model) must not start an OpenMP team, which the children it forks would inherit broken (GNU
    OpenMP's workers are not forked with it: a child's first parallel region waits for them for
    ever; one did, a server pre-faulting its region)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------ a forked child


class Child:
    """A child started by `fork`, answering as a `subprocess.Popen` does for what gadei asks of
    one: `pid`, `args`, `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped already (by a SIGCHLD handler): its code is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(pause)
            pause = min(0.05, pause * 2)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork(command: list[str], *, log=None, session: bool = True, env: dict | None = None, held: bool = False,
         keep_stdout: bool = False, close: tuple[int, ...] = ()) -> Child:
    """Run `command` in a child forked from this process (which `can_fork`), with what
    `gadei.launch.spawn` gives a started one (the same arguments); `close`: descriptors of this
    process the child must not hold (a zygote's socket)."""
    module, args = _proc.module_of(command)
    sys.stdout.flush()
    sys.stderr.flush()
    opened = None
    if isinstance(log, (str, os.PathLike)):
        opened = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
    log_fd = opened if opened is not None else (log.fileno() if log is not None else None)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # no stop runs this process's handler in the child
    try:
        pid = os.fork()
        if pid == 0:
            _child(command, module, args, log_fd, session, env, keep_stdout, None if held else before, close)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        if opened is not None:
            os.close(opened)
    return Child(pid, command)


def _child(command, module, args, log_fd, session, env, keep_stdout, unblock, close) -> None:
    """In the child: become `command`, run it, and leave with its exit code. Never returns."""
    code = 1
    try:
        for fd in close:
            os.close(fd)
        if session:
            os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a new interpreter has them
        for sig in _RESET:
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if log_fd is not None:
            os.dup2(log_fd, 2)
            if not keep_stdout:
                os.dup2(log_fd, 1)
        _title(command)  # first: it finds the memory it writes to by the environment the process started with
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        sys.argv, sys.orig_argv = [module, *args], list(command)
        logging.root.handlers.clear()  # the command configures its own (`gadei.console`)
        atexit._clear()  # this process's exit handlers are its parent's: the command registers its own
        atexit.register(logging.shutdown)
        if unblock is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblock)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as done:
            code = _exit_code(done.code)
        atexit._run_exitfuncs()
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - said on its log, as an interpreter would
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _title(command: list[str]) -> None:
    """`ps` and /proc show the child as `command` (setproctitle, where installed)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(" ".join(command))


# ------------------------------------------------------------------ the daemon's zygote


class Zygote:
    """A warm process (`python -m gadei.zygote`) that forks job supervisors for its owner (the
    daemon), each in a session of its own, its log the file descriptor handed over with the
    request. Its children are its own: it reaps them and tells `code` their exit codes.

    Requests and answers are JSON messages on a Unix socket pair (SOCK_SEQPACKET: one message
    each); a reader thread takes the answers, the exits and its word that it is warm (`ready`)
    as they come."""

    def __init__(self, timeout: float = 120.0, on_exit=None):
        self.timeout, self.on_exit = timeout, on_exit
        self._lock = threading.Lock()
        self._answers: list[dict] = []
        self._codes: dict[int, int] = {}
        self._changed = threading.Condition()
        self._ready = False  # it said it is warm
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = _proc.python_command("gadei.zygote", theirs.fileno())
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                     start_new_session=True)
        theirs.close()
        self.sock = ours
        self._reader = threading.Thread(target=self._read, name="gadei-zygote", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self._answers.append({"error": "the zygote ended"})
                    self._changed.notify_all()
                    return
                message = json.loads(data)
                if "ready" in message:
                    self._ready = True
                elif "exited" in message:
                    self._codes[message["exited"]] = message["code"]
                    if self.on_exit is not None:
                        self.on_exit()
                else:
                    self._answers.append(message)
                self._changed.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self, wait: float = 0.0) -> bool:
        """Whether it is warm (it imported what a job's processes need: a fork costs milliseconds),
        waiting up to `wait` seconds for it; False where it ended first."""
        with self._changed:
            self._changed.wait_for(lambda: self._ready or not self.alive(), wait)
            return self._ready

    def start(self, command: list[str], *, log_fd: int, env: dict, hold: int | None = None) -> int:
        """Fork `command` (a supervisor's command line) in the zygote, its stdout and stderr
        `log_fd`, in the environment `env`, its signals of stop held until it takes them: its pid.
        `hold`: a descriptor the child holds open, as it would have inherited it from its owner
        (its job's claim on the output folder, `gadei.claim`).

        Raises:
            OSError: the zygote is gone, or could not fork (the reason).
        """
        request = json.dumps({"command": command, "env": env}).encode()
        with self._lock:
            with self._changed:
                self._answers.clear()
            socket.send_fds(self.sock, [request], [log_fd] + ([hold] if hold is not None else []))
            with self._changed:
                if not self._changed.wait_for(lambda: self._answers, self.timeout):
                    raise OSError(f"the zygote (pid {self.proc.pid}) did not answer within {self.timeout:g} s")
                answer = self._answers.pop(0)
        if "error" in answer:
            raise OSError(f"the zygote (pid {self.proc.pid}) could not start it: {answer['error']}")
        return answer["pid"]

    def code(self, pid: int, wait: float = 0.0) -> int | None:
        """The exit code of the child `pid` once it ended and was reaped (waiting up to `wait`
        seconds for it); else None."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._codes or not self.alive(), wait)
            return self._codes.get(pid)

    def close(self, timeout: float = 10.0) -> None:
        """End the zygote (its children go on: each is in a session of its own)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        _proc.wait_or_kill(self.proc, timeout, f"the zygote (pid {self.proc.pid})")


def serve(fd: int) -> int:
    """The zygote's loop on the socket `fd`: fork a supervisor for each request, tell each exit;
    end when its owner closes the socket."""
    sock = socket.socket(fileno=fd)
    waker_r, waker_w = os.pipe()
    os.set_blocking(waker_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(waker_w)
    warm()
    try:
        sock.send(json.dumps({"ready": True}).encode())
    except OSError:  # its owner is gone already
        return 0
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(waker_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj == waker_r:
                os.read(waker_r, 4096)
                continue
            try:
                message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
            except OSError:
                message = b""
            if not message:
                return 0
            _answer(sock, message, fds, (fd, waker_r, waker_w))
        _reap(sock)


def _answer(sock, message: bytes, fds: list[int], close: tuple[int, ...]) -> None:
    """Fork the child a request asks for: its log the first descriptor handed over; the others (a
    claim) the child holds, and this process not."""
    try:
        request = json.loads(message)
        command, env = request["command"], request["env"]
        if not fds:
            raise ValueError("no log handed over")
        with open(fds[0], "ab", closefd=True) as log_file:
            child = fork(command, log=log_file, env=env, held=True, close=close)
        sock.send(json.dumps({"pid": child.pid}).encode())
    except Exception as err:  # noqa: BLE001 - said to the owner: the next request is answered as well
        sock.send(json.dumps({"error": f"{type(err).__name__}: {err}"}).encode())
    finally:
        for fd in fds[1:]:
            os.close(fd)


def _reap(sock) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        try:
            sock.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            return


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
