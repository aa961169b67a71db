"""Running a job's processes on this machine: the one place gadei starts one (`spawn`; `become`
for a command that turns into another), stops a job (`stop_job`), or ends itself when a call
that takes no time limit overstays (`exit_after`). Ending a child that does not exit in time is
`gadei._proc.wait_or_kill`."""

import logging
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

from . import _native, _proc, zygote
from .errors import ForeignRegion, GadeiError, GadeiTimeout, RegionNotFound
from .protocol import Deadline, RunState
from .region import Region, inspect
from .server_record import live_server

log = logging.getLogger(__name__)

_POLL = 0.02


def stop_job(job: str, timeout: float = 30.0) -> None:
    """Ask `job`'s server to stop (as `gadei stop` does) and wait until its region is gone.

    A server whose region cannot be read (its header is corrupt, or the name now holds
    another object) is stopped by its pid and start time (`server_record.live_server`): SIGTERM,
    and SIGKILL when it has not exited within `timeout`. Only a process of this user is.

    Raises:
        RegionNotFound: the job has no region (and no live server).
        GadeiError: the region is a leftover (no live server to stop).
        GadeiTimeout: the server did not finish within `timeout` seconds.
    """
    found = inspect(job)
    if found is None or found.state in ("foreign", "leftover"):  # the header does not name a live server
        problem = "it has no region" if found is None else f"its region is not readable ({found.state}" + \
            (f": {found.problem})" if found.problem else f", naming dead server pid {found.server_pid})")
        if stop_by_pid(job, problem, timeout):
            return
        if found is None:
            raise RegionNotFound(f"job {job!r} has no region: nothing to stop")
    if found.state not in ("running", "starting"):
        raise GadeiError(f"job {job!r} has no live server ({found.state}); remove its region with `gadei clean {job}`")
    deadline = Deadline(timeout)  # one deadline for both waits: the publish and the stop
    try:
        region = Region.attach(job, wait=timeout)  # a starting server is stopped once it serves
    except ForeignRegion as err:  # its identity reads, the rest of its header does not
        if stop_by_pid(job, f"its region is not readable: {err}", timeout):
            return
        raise
    with region:
        RunState(region).request_stop()
    while True:
        now = inspect(job)
        if now is None or now.state not in ("running", "starting"):
            return
        if deadline.expired():
            raise GadeiTimeout(f"job {job!r}: server pid {found.server_pid} did not stop within {timeout:g} s")
        time.sleep(_POLL)


STOPS = zygote.STOPS  # the signals that stop a gadei process in order (SIGTERM's handler is set last: a
# process that catches SIGTERM has its SIGINT handler too)


def spawn(command: list[str], *, log=None, session: bool = True, env: dict | None = None,
          held: bool = False, keep_stdout: bool = False, passive: bool = True, keep: tuple = ()) -> subprocess.Popen:
    """Start one of a job's processes: `command` (a `gadei._proc` command line), stdin from
    /dev/null, stdout and stderr appended to `log` (a path, or a file open for writing; None:
    this process's own; `keep_stdout`: stdout stays this process's, stderr alone goes to `log`),
    in a session of its own unless `session` is False (then a signal to this process's group
    reaches it too). `env`: its whole environment (None: this process's). `held`: it starts
    with SIGTERM and SIGINT blocked (a signal mask is inherited through exec), so a stop sent to
    it at once waits until it takes them (`take_stops`, once its handler is set) instead of
    killing it while it starts (a job's supervisor and its server). `keep`: descriptors a new
    interpreter keeps open too (a forked child keeps every one): a job's claim on its folder.

    Started warm (forked, `gadei.zygote.fork`: no interpreter to start, nothing to import) where
    this process can (`zygote.can_fork`): it is warm and runs one thread, and `passive` says the
    child may run with passive OpenMP threads; else a new interpreter runs it.
    """
    if zygote.can_fork(passive):
        return zygote.fork(command, log=log, session=session, env=env, held=held, keep_stdout=keep_stdout)
    if held:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # this thread's, for the fork
        try:
            return spawn(command, log=log, session=session, env=env, keep_stdout=keep_stdout, keep=keep)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
    if log is None:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=session, env=env, pass_fds=keep)
    if hasattr(log, "fileno"):
        return subprocess.Popen(command, stdout=None if keep_stdout else log,
                                stderr=log if keep_stdout else subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=session, env=env, pass_fds=keep)
    with open(log, "ab") as out:
        return spawn(command, log=out, session=session, env=env, keep_stdout=keep_stdout, keep=keep)


def started_as(proc) -> str:
    """How `spawn` started `proc`, in words: "forked warm", or "a new interpreter"."""
    return "forked warm" if isinstance(proc, zygote.Child) else "a new interpreter"


def take_stops(handler) -> dict:
    """Set `handler` for SIGTERM and SIGINT (not for one this process was started with ignored,
    as a shell's background job has SIGINT), then unblock them: a stop that came while this
    process started (`spawn(held=True)`) is handled now. The handlers before, by signal."""
    before = {}
    for sig in STOPS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            before[sig] = signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
    return before


def become(command: list[str]) -> None:
    """This process becomes `command` (a `gadei._proc` command line; exec: the same pid and
    start time, so what names this process names that one), its output flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)


def stop_by_pid(job: str, problem: str, timeout: float) -> bool:
    """Stop `job`'s server by signal (SIGTERM, SIGKILL past `timeout`) where its region cannot
    tell it to, or it does not take what the region tells it (`problem` says why, in the
    warning); False when no live server of this user is known (`server_record.live_server`)."""
    server = live_server(job)
    if server is None:
        return False
    pid, started, where = server
    log.warning("job %r: %s; stopping server pid %d (found in %s) by signal", job, problem, pid, where)
    os.kill(pid, signal.SIGTERM)  # the server stops as on `gadei stop`, or on what it finds wrong
    os.kill(pid, signal.SIGCONT)  # a stopped (SIGSTOP) server takes the SIGTERM once it runs
    deadline = Deadline(timeout)
    while _proc.alive(pid, started):
        if deadline.expired():
            log.warning("job %r: server pid %d did not exit within %g s of SIGTERM; killing it (SIGKILL)", job, pid,
                        timeout)
            os.kill(pid, signal.SIGKILL)
            deadline.restart()
            while _proc.alive(pid, started):
                if deadline.expired():
                    raise GadeiTimeout(f"job {job!r}: server pid {pid} did not exit within {timeout:g} s of SIGKILL")
                time.sleep(_POLL)
            break
        time.sleep(_POLL)
    return True


@contextmanager
def exit_after(seconds: float, code: int, message: str):
    """Leave this process (`_exit(code)`, `message` on stderr) unless the block ends within
    `seconds`: the deadline of a call that takes none and blocks holding the GIL (MPI_Finalize),
    kept by a native thread. Disarmed when the block ends, by an error too."""
    _native.exit_after(float(seconds), code, message)
    try:
        yield
    finally:
        _native.exit_disarm()
