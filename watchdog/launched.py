"""The learners a watchdog launched: their processes, progress and restarts.

A launched learner is `gadei learn JOB ARGS... --start-at N`, where N is the samples of its
schedule (its epochs over its shard) that the job's weights already hold: a learner that
dies is started again where the gradients it published end, and after a server restart
from a checkpoint, where that checkpoint's `progress` says. Its output goes to
`learner-<number>.log` in the watchdog's log folder.

The table of launched learners is saved as JSON (with the watchdog's settings) in the
user's runtime folder, so a new watchdog (`gadei serve --adopt JOB`) can take over the
learners of one that died: it cannot wait for processes that are not its children, so it
tells a clean exit (the learner gave its ring back) from a death (its ring still names it).
"""

import fcntl
import json
import logging
import os
import signal
import subprocess
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import psutil

from gadei import _proc, ring
from gadei.env import runtime_dir
from gadei.layout import ACTIVE, DEAD
from gadei.protocol import Deadline

log = logging.getLogger(__name__)

BACKOFF_CAP = 30.0  # seconds: the longest wait before a learner is started again


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

    @property
    def running(self) -> bool:
        return self.pid != 0


class Learners:
    """Starts, watches and restarts a job's launched learners (the watchdog calls `look()`)."""

    def __init__(self, job: str, table: list[Launched], log_dir: str, *, max_restarts: int, window: float,
                 backoff: float):
        self.job, self.table, self.log_dir = job, table, log_dir
        self.max_restarts, self.window, self.backoff = max_restarts, window, backoff

    # ------------------------------------------------------------------ state

    @property
    def finished(self) -> bool:
        """Every launched learner is done or given up (and there is at least one)."""
        return bool(self.table) and all(l.done or l.failed for l in self.table) and not any(l.running for l in self.table)

    @property
    def failed(self) -> list[int]:
        return [l.number for l in self.table if l.failed]

    def progress(self, ckpt) -> dict:
        """What a checkpoint taken now holds of each learner's schedule (the `progress` hook).

        A running learner's samples are those the server applied from its ring (the
        counters are part of the same capture); a dead one waiting for its restart already
        counts what it published in `start_at`.
        """
        out = {}
        for l in self.table:
            if l.done:
                out[str(l.number)] = "done"
                continue
            applied = 0
            if l.running:
                # its entry's counters, or, once it gave the entry back and a new owner reset
                # them, the copy that owner kept
                applied = ring.applied_in(ckpt.learners, l.pid)
            out[str(l.number)] = l.start_at + applied
        return out

    # ------------------------------------------------------------------ processes

    def start(self, l: Launched) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        command = _proc.gadei_command("learn", self.job, *l.args, "--start-at", l.start_at)
        with open(os.path.join(self.log_dir, f"learner-{l.number}.log"), "ab") as out:
            l.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        l.pid, l.entry, l.seen, l.due = l.proc.pid, -1, 0, 0.0
        try:
            l.started = _proc.start_time(l.pid)
        except psutil.NoSuchProcess:
            l.started = 0.0
        log.info("job %r: started launched learner %d (pid %d) at sample %s of its schedule", self.job, l.number, l.pid,
                 f"{l.start_at:,}")

    def start_all(self) -> None:
        for l in self.table:
            if not (l.done or l.failed or l.running):
                self.start(l)

    def kill_all(self) -> None:
        """SIGKILL every running launched learner and reap it (the server is being replaced)."""
        for l in self.table:
            if l.running and _proc.alive(l.pid, l.started):
                os.kill(l.pid, signal.SIGKILL)
        for l in self.table:
            if l.proc is not None:
                l.proc.wait()
            elif l.running:
                _wait_gone(l.pid, l.started, 10.0)
            l.proc, l.pid, l.started, l.entry = None, 0, 0.0, -1

    def reap(self, timeout: float) -> None:
        """At the job's end: wait for the learners to leave, then kill what still runs."""
        deadline = Deadline(timeout)
        for l in self.table:
            if l.proc is not None:
                try:
                    l.proc.wait(timeout=deadline.left())
                except subprocess.TimeoutExpired:
                    log.warning("job %r: launched learner %d (pid %d) did not leave; killing it", self.job, l.number, l.pid)
                    l.proc.kill()
                    l.proc.wait()

    # ------------------------------------------------------------------ one look

    def look(self, region) -> tuple[list[int], bool]:
        """Notice exits and deaths, start what is due; (learners that died now, anything changed)."""
        died, changed = [], False
        now = time.time()
        for l in self.table:
            if l.running:
                exited, code = self._exited(l, region)
                if not exited:
                    self._track(l, region)
                    continue
                changed = True
                if code == 0:
                    l.done, l.pid, l.proc = True, 0, None
                    log.info("job %r: launched learner %d finished its schedule", self.job, l.number)
                else:
                    died.append(l.number)
                    self._died(l, region, code, now)
            if l.due and now >= l.due and not (l.done or l.failed):
                self.start(l)
                changed = True
        return died, changed

    def _exited(self, l: Launched, region) -> tuple[bool, int | None]:
        if l.proc is not None:
            code = l.proc.poll()
            return code is not None, code
        if _proc.alive(l.pid, l.started):
            return False, None
        # Not our child (adopted): a learner that left gave its ring back; one that died did not.
        return True, (None if ring.entry_of(region, l.pid) >= 0 else 0)

    def _track(self, l: Launched, region) -> None:
        if l.entry < 0 or not ring.owned_by(region, l.entry, l.pid):
            l.entry = ring.entry_of(region, l.pid)
        if l.entry >= 0:
            l.seen = region.entry(l.entry).get("samples")

    def _died(self, l: Launched, region, code, now: float) -> None:
        if code is None:
            how = "is gone"
        else:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
        published = l.seen
        if l.entry >= 0 and ring.owned_by(region, l.entry, l.pid):
            region.entry(l.entry).cas("state", ACTIVE, DEAD)
            published = ring.dead_owner_applied(region, l.entry, l.pid, published)
        else:
            # It gave its entry back (after draining it) and was killed before it exited, or
            # never was seen holding one: its entry, or a new owner's copy of it, says what
            # the server applied of it; `seen` may be older than its last pushes.
            left = ring.left_record(region, l.pid)
            if left is not None:
                published = left
        l.start_at += published
        l.proc, l.pid, l.started, l.entry, l.seen = None, 0, 0.0, -1, 0
        recent = [t for t in l.restarts if now - t < self.window]
        if len(recent) >= self.max_restarts:
            l.failed = True
            log.error("job %r: launched learner %d %s; gave up on it: it died %d times within %g s (see %s)", self.job,
                      l.number, how, len(recent) + 1, self.window,
                      os.path.join(self.log_dir, f"learner-{l.number}.log"))
            return
        delay = min(BACKOFF_CAP, self.backoff * 2 ** len(recent))
        l.restarts = [*recent, now]
        l.due = now + delay
        log.warning("job %r: launched learner %d %s after %s samples of its schedule; starting it again in %g s", self.job,
                    l.number, how, f"{l.start_at:,}", delay)

    def resume(self, progress: dict) -> None:
        """After a server restart: each learner goes on from a checkpoint's `progress` (none: 0)."""
        for l in self.table:
            if l.failed:
                continue
            done = progress.get(str(l.number))
            l.done = done == "done"
            l.start_at = 0 if l.done or done is None else int(done)
            l.due = 0.0


def _wait_gone(pid: int, started: float, timeout: float) -> None:
    deadline = Deadline(timeout)
    while _proc.alive(pid, started) and not deadline.expired():
        deadline.sleep(0.02)


# ------------------------------------------------------------------ the saved state


def state_path(job: str) -> str:
    """Where a job's watchdog keeps its settings and launched learners (for `--adopt`)."""
    return os.path.join(runtime_dir(), f"{job}.watchdog.json")


def lock_path(job: str) -> str:
    return os.path.join(runtime_dir(), f"{job}.watchdog.lock")


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
