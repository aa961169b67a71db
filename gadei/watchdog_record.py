"""What a job's watchdog leaves outside its process, for gadei to read without importing it (the
watchdog, `gadei_watchdog`, runs as a process of its own and uses gadei): its exit codes, and
its record in the user's runtime folder: its settings and the learners it launched
(`save_state`), from which a new watchdog adopts the job (`gadei serve --adopt`), `gadei
status` shows the launched learners, and a checkpoint taken before a stop says how far each
one got (`progress`).

The record is JSON, written atomically, and lives while the watchdog does (the daemon reads
its presence as the watchdog's life); `registering`'s lock beside it makes a watchdog's look
for a live one and its registration one step.
"""

import fcntl
import glob
import json
import os
import subprocess
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from . import ring
from .env import runtime_dir

# The watchdog's exit codes (0: the job stopped).
SERVER_DEAD = 3  # the server died or hung and was not (or could not be) restarted
LEARNERS_FAILED = 4  # the job ended after the watchdog gave up on a launched learner
JOB_FAILED = 5  # the server stopped the job as failed; nothing was restarted

_SUFFIX = ".watchdog.json"


@dataclass
class Launched:
    """One learner the watchdog launched, across its restarts.

    Attributes:
        number: its place in the job's list of learners (0, 1, ...).
        args: the arguments after `gadei learn JOB`.
        start_at: samples of its schedule its current process skipped.
        pid, started: its current process (pid and start time; 0 when none runs).
        entry: the learner entry (ring) that process holds, once it attached.
        seen: samples that process had published when last looked at.
        done: it finished its schedule.
        failed: it died too often within the window; no more restarts.
        restarts: wall-clock times it was started again after a death.
        due: wall-clock time of the next start (0: none pending).
    """

    number: int
    args: list[str]
    start_at: int = 0
    pid: int = 0
    started: float = 0.0
    entry: int = -1
    seen: int = 0
    done: bool = False
    failed: bool = False
    restarts: list[float] = field(default_factory=list)
    due: float = 0.0

    def __post_init__(self):
        self.proc: subprocess.Popen | None = None  # only when it is this watchdog's child
        self.oom_kills: int | None = None  # `_proc.oom_kills()` when this watchdog started (or adopted) it

    @property
    def running(self) -> bool:
        return self.pid != 0


def progress(table: list[Launched], ckpt) -> dict:
    """What a checkpoint taken now holds of each launched learner's schedule (the
    `checkpoint.take` progress hook), by learner number as text: samples, or "done".

    A running learner's samples are those the server applied from its ring (the counters are
    part of the same capture); a dead one waiting for its restart already counts what it
    published in `start_at`.
    """
    out = {}
    for l in table:
        if l.done:
            out[str(l.number)] = "done"
            continue
        # its entry's counters, or, once it gave the entry back, the record it kept then
        # (`gadei.ring.applied_in`)
        applied = ring.applied_in(ckpt.learners, l.pid) if l.running else 0
        out[str(l.number)] = l.start_at + applied
    return out


def state_path(job: str) -> str:
    """Where a job's watchdog keeps its settings and launched learners (for `--adopt`)."""
    return os.path.join(runtime_dir(), job + _SUFFIX)


def lock_path(job: str) -> str:
    return os.path.join(runtime_dir(), f"{job}.watchdog.lock")


def saved_jobs() -> dict[str, str]:
    """The jobs whose watchdog's record is in the runtime folder: job name -> the record's path.

    Raises:
        PermissionError: the runtime folder is not the user's own and private (`env.runtime_dir`).
    """
    return {os.path.basename(path)[: -len(_SUFFIX)]: path
            for path in glob.glob(os.path.join(glob.escape(runtime_dir()), "*" + _SUFFIX))}


@contextmanager
def registering(job: str):
    """Held while a watchdog checks that the job has no live watchdog and registers itself in
    the region header (an exclusive `flock` on `<job>.watchdog.lock` in the runtime folder):
    two that take over a dead one at the same moment (`gadei run`'s and its server's adoption)
    cannot both register; the second sees the first alive and refuses."""
    fd = os.open(lock_path(job), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def save_state(job: str, settings: dict, table: list[Launched]) -> None:
    """Write the watchdog's state atomically (a reader never sees half a file)."""
    path = state_path(job)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as out:
        json.dump({"job": job, "settings": settings, "learners": [asdict(l) for l in table]}, out)
    os.replace(tmp, path)


def load_state(job: str) -> tuple[dict, list[Launched]]:
    """The state a job's watchdog saved; FileNotFoundError when it saved none."""
    with open(state_path(job)) as handle:
        data = json.load(handle)
    return data["settings"], [Launched(**l) for l in data["learners"]]


def remove_state(job: str) -> None:
    """At the job's end: its saved state and its registration lock (`registering`) go, so
    that a runtime folder does not gather one of each per job ever run."""
    for path in (state_path(job), lock_path(job)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
