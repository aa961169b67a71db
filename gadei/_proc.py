"""The processes gadei starts and watches: their command lines, their identity for liveness
checks (a pid plus its start time, so pid reuse cannot fool us), and how one ended, in words."""

import ctypes
import logging
import os
import signal
import subprocess
import sys

import psutil

log = logging.getLogger(__name__)

TIED_TO = "GADEI_TIED_TO"  # a pid: this process stops (SIGTERM) when that process, its parent, ends (`tie_to_parent`)
_PR_SET_PDEATHSIG = 1  # prctl(2)


def python_command(module: str, *args) -> list[str]:
    """The command line that runs `python -m MODULE ARGS...` with this Python, on the installed
    package whatever the working directory: `-P` keeps the working directory off `sys.path`,
    where a source tree (a repository root after `pip install .`, whose `gadei/` has no
    compiled `_native`) would be imported instead. Every process gadei starts is built here."""
    return [sys.executable, "-P", "-m", module, *map(str, args)]


def module_of(command: list[str]) -> tuple[str, list[str]]:
    """(MODULE, ARGS) of `python -P -m MODULE ARGS` (`gadei._proc.python_command`'s form).

    Raises:
        ValueError: `command` is not of that form.
    """
    if len(command) < 4 or command[1:3] != ["-P", "-m"]:
        raise ValueError(f"not a `python -P -m MODULE` command line: {command[:4]}")
    return command[3], [str(a) for a in command[4:]]


def gadei_subcommand(argv: list[str] | None = None) -> str | None:
    """The gadei command (`serve`, `learn`, ...) a command line runs: `gadei CMD ...`, or
    `python [options] -m gadei CMD ...` as `python_command` builds it; by default this
    process's original command line (`sys.orig_argv`, which the interpreter's options keep).
    None for any other program."""
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    i = 1  # argv[0] is the interpreter
    while i < len(argv):
        arg = argv[i]
        if arg == "-m":
            return argv[i + 2] if argv[i + 1:i + 2] == ["gadei"] and i + 2 < len(argv) else None
        if arg in ("-c", "-"):
            return None
        if arg in ("-X", "-W", "-Q"):  # an interpreter option whose value is the next argument
            i += 2
        elif arg.startswith("-"):
            i += 1
        else:  # a script: the `gadei` entry point, or another program
            return argv[i + 1] if os.path.basename(arg) == "gadei" and i + 1 < len(argv) else None
    return None


def gadei_command(*args) -> list[str]:
    """The command line that runs `gadei ARGS...` (the `gadei` command) with this Python."""
    return python_command("gadei", *args)


def start_time(pid: int | None = None) -> float:
    """The start of `pid` (default: us), in seconds since the machine booted, to a clock tick:
    the process's identity beside its pid, for `alive`. The kernel keeps it in ticks since boot
    (/proc/PID/stat), which no change of the wall clock moves. psutil's `create_time` adds those
    ticks to the boot time as the wall clock puts it now: a clock stepped by NTP or a VM's host
    moves it, and every process recorded before the step would seem to be another one.

    Raises:
        psutil.NoSuchProcess: no process runs as `pid`.
        psutil.AccessDenied: it is not ours to inspect.
    """
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            after_name = f.read().rpartition(b")")[2].split()  # the name, in parentheses, may hold anything
    except (FileNotFoundError, ProcessLookupError):  # never was, or reaped as we read
        raise psutil.NoSuchProcess(pid) from None
    except PermissionError:  # /proc mounted with hidepid: another user's process
        raise psutil.AccessDenied(pid) from None
    return int(after_name[19]) / _CLOCK_TICKS  # starttime, the stat's 22nd field


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_SINCE_BOOT_BELOW = 1e9  # a start above it is seconds since 1970: psutil's create_time, as gadei recorded it before


def running(pid: int) -> bool:
    """True when some process runs as `pid` (whichever it is: see `alive` for one process).

    A zombie (exited, not yet reaped) counts as ended; a process that is not ours to inspect
    runs (AccessDenied: never declared dead).
    """
    if pid <= 0:
        return False
    try:
        return not _exited(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _exited(proc: psutil.Process) -> bool:
    """The process has ended (a zombie: exited, not yet reaped). Its main thread alone a zombie
    is not enough: a process that exits (`os._exit`, a fatal signal) ends its main thread
    first, whose state is the one /proc and psutil show, while its other threads still end
    (on a busy machine, for milliseconds): until they have, it is not over, and its parent
    cannot reap it yet."""
    if proc.status() != psutil.STATUS_ZOMBIE:
        return False
    try:
        return len(os.listdir(f"/proc/{proc.pid}/task")) <= 1
    except OSError:  # reaped meanwhile
        return True


def alive(pid: int, started: float) -> bool:
    """True when `pid` runs and is the same process that started at `started`: the one answer
    to "is this process running" for every process gadei watches (a server, a learner, a
    supervisor, a daemon's job). `started`: its `start_time`, as recorded when it started.

    A zombie (exited, not yet reaped) counts as dead; so does a new process that reused the pid.
    """
    if pid <= 0:
        return False
    try:
        proc = psutil.Process(pid)
        if _exited(proc):
            return False
        if started >= _SINCE_BOOT_BELOW:  # recorded by an earlier gadei (a region, a record on disk)
            return abs(proc.create_time() - started) < 0.05
        return abs(start_time(pid) - started) < 0.5 / _CLOCK_TICKS
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # it exists and is not ours to inspect: never declare it dead


def holding(fd: int) -> list[int]:
    """The pids of the processes, lowest first, that hold open the file `fd` is open on, this one
    aside (found in /proc: another user's descriptors are not shown, nor counted)."""
    held = os.fstat(fd)
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or another user's
            continue
        for each in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{each}")
            except OSError:  # closed as it was looked at
                continue
            if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
                found.append(int(pid))
                break
    return sorted(found)


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed on this machine since it
    booted (`oom_kill` in /proc/vmstat, Linux 4.13 and later; it counts the kills of a cgroup's
    memory limit too); None where it is not kept. Read it when a process starts, and
    `how_it_ended` can say whether that killer is what ended it."""
    try:
        with open("/proc/vmstat", "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def how_it_ended(code: int | None, oom_kills_at_start: int | None = None) -> str:
    """How a process ended, in words, from its exit code as `subprocess` and `multiprocessing`
    give it (a negative code is the signal that killed it): "exited with code 2", "was killed
    by SIGSEGV (signal 11)". For SIGKILL, which no process catches, it says who most likely
    sent it: given `oom_kills()` as read when the process started, whether the kernel's
    out-of-memory killer killed anything since (the machine's count: another process's kill
    can be counted too, hence "most likely"); without it, that this killer is the usual cause
    where no one sent the signal. `code` None: a process whose exit code cannot be read (not
    this process's child): "is gone", and "most likely killed by the kernel's out-of-memory
    killer, ..." where that count rose."""
    if code is None:
        said = _oom_killed_since(oom_kills_at_start) if oom_kills_at_start is not None else ""
        return "is gone" + (f", most likely killed by {said}" if said else "")
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = f"{signal.Signals(-code).name} (signal {-code})"
    except ValueError:
        return f"was killed by signal {-code}"
    if -code != signal.SIGKILL:
        return f"was killed by {name}"
    if oom_kills_at_start is None or oom_kills() is None:
        return (f"was killed by {name}: where no one sent it, the kernel's out-of-memory killer did, when the "
                "machine or its cgroup ran out of memory (`dmesg` names what it killed)")
    said = _oom_killed_since(oom_kills_at_start)
    if said:
        return f"was killed by {name}, most likely by {said}"
    return (f"was killed by {name}, sent by a process (not the out-of-memory killer, which killed nothing since it "
            "started)")


def _oom_killed_since(oom_kills_at_start: int) -> str:
    now = oom_kills()
    if now is None or now <= oom_kills_at_start:
        return ""
    kills = now - oom_kills_at_start
    return (f"the kernel's out-of-memory killer, which killed {kills} process{'es' if kills != 1 else ''} on this "
            "machine since it started: the machine or its cgroup ran out of memory (`dmesg` names what it killed)")


def tie_to_parent() -> None:
    """Stop this process (SIGTERM: a server stops as on `gadei stop`) when the process that
    started it ends, even killed by SIGKILL, where that process asked for it by setting
    TIED_TO to its pid (`local.LocalJob`'s server and learners, a job's supervisor's: they do not
    outlive it). Linux's parent-death signal; the variable is removed, so that what this
    process starts in turn is not tied. A parent already gone is seen at once."""
    parent = os.environ.pop(TIED_TO, "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(parent):  # it ended before the signal was asked for
        os.kill(os.getpid(), signal.SIGTERM)


def wait_or_kill(proc: subprocess.Popen, timeout: float, what: str) -> int:
    """Wait up to `timeout` seconds for the child `proc` to exit; then SIGKILL it and reap it.
    Its exit code (-9 when it was killed). `what` names it in the warning (`job 'x': the server`).
    """
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("%s (pid %d) did not exit within %g s; killing it (SIGKILL)", what, proc.pid, timeout)
        proc.kill()
        return proc.wait()
