"""A run's claim on its output folder: one run at a time writes a folder's outputs.

A job's region tells a running job from one that is not, but only once its server has created
it: two `gadei run`s of one job started within seconds of each other (or a `gadei run` and the
daemon's start of the same job, or two job files of different names with one [output] folder)
both pass every check before either server exists, and both then write the same outputs. So the
run that prepares a folder first takes an exclusive `flock` on its logs/claim.lock (`take`,
refusing the folder where another holds it) and holds it to the job's end: `gadei run` and the
daemon keep it while they follow the job, and the job's supervisor holds it too (forked with it,
handed it by the daemon's zygote, or as it starts a new interpreter), so a client that dies leaves
the folder claimed while its job runs. A restarted daemon follows its running jobs without their
claims (their processes hold them): a supervisor it starts in place of one that died takes the
claim itself, once that one's processes let go of it (`gadei_watchdog.job`). The kernel lets go
of a claim when the last process holding it ends, whatever killed it: nothing is left to clean
up, and the file stays (removing it would let two runs lock two files of one name).

`check` says whether a folder is claimed now without writing anything (`gadei run --check`,
a submit).
"""

import errno
import fcntl
import logging
import os
import stat
import time
from pathlib import Path

from . import _proc
from .errors import FolderInUse, GadeiError

log = logging.getLogger(__name__)

NAME = "logs/claim.lock"
_WAIT = 1.0  # seconds `take` tries for: `check`'s look holds the lock for a moment


def _refusal(out: Path, fd: int) -> FolderInUse:
    """What a run refused for a claimed folder is told: the pid that claimed it, where it wrote it,
    and, where that one has ended (a `gadei run` killed while its job runs on), the pids that hold
    the claim now (a pid that runs no more reads as a claim left behind, which it is not)."""
    try:
        said = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        said = ""
    holders = _proc.holding(fd)
    now = f"held now by pid{'s' if len(holders) > 1 else ''} {', '.join(map(str, holders))}"
    if not said.isdigit():
        by = f" ({now})" if holders else ""
    elif int(said) in holders or not holders:
        by = f" (claimed by pid {said})"
    else:
        by = f" (claimed by pid {said}, which has ended; {now}, which it started)"
    return FolderInUse(f"output folder {out} is in use by a run that starts or runs now{by}, and a folder holds one "
                       "run at a time: wait for it to end, stop it, or set another [output] folder")


def _unusable(out: Path, why: str) -> GadeiError:
    return GadeiError(f"output folder {out}: its {NAME} {why} (a run locks that file while it runs); remove it")


def _open(out: Path, flags: int, mode: int = 0o600) -> int | None:
    """The claim's file, opened (None: there is none, and `flags` do not make it).

    Raises:
        GadeiError: something that is not a file is in its place, or the OS refuses it.
    """
    try:
        fd = os.open(Path(out) / NAME, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENOTDIR) and not flags & os.O_CREAT:
            return None
        raise _unusable(out, "is a symbolic link" if err.errno == errno.ELOOP else
                        f"cannot be opened: {err.strerror or err}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _unusable(out, "is not a file")
    return fd


def check(out: Path) -> None:
    """Refuse `out` where a run claims it now, or its claim's file could not be taken, writing
    nothing.

    Raises:
        FolderInUse: a run holds the folder's claim.
        GadeiError: something that is not a file is in the claim's place.
    """
    fd = _open(out, os.O_RDONLY)
    if fd is None:  # no claim was ever taken there
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _refusal(out, fd) from None
        except OSError:  # a file system without locks (`take` says so)
            pass
    finally:
        os.close(fd)


def take(out: Path, private: bool = True):
    """Claim `out` (a folder that exists) for this run: its logs/ made, logs/claim.lock locked and
    this process's pid written in it. The claim (an open file) is held as long as it, or a copy
    inherited by a forked child or handed over, is open; `private`: the file is 0600.

    Raises:
        FolderInUse: another run holds it (tried for a moment: `check`'s look holds it shortly).
        GadeiError: the claim cannot be made (what is in its place, the OS's reason).
    """
    try:
        (Path(out) / NAME).parent.mkdir(exist_ok=True)
    except OSError as err:
        raise _unusable(out, f"cannot be made: {err.strerror or err}") from None
    fd = _open(out, os.O_RDWR | os.O_CREAT, 0o600 if private else 0o666)
    deadline = time.monotonic() + _WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                refusal = _refusal(out, fd)
                os.close(fd)
                raise refusal from None
            time.sleep(0.02)
        except OSError as err:  # a file system that holds no locks (an NFS mount without them, some FUSE ones)
            log.warning("output folder %s: %s cannot be locked (%s): this run goes on, and another run of this "
                        "folder started meanwhile is not kept out", out, NAME, err.strerror or err)
            break
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return open(fd, "rb", buffering=0)
