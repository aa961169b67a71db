"""The learners a supervisor launched: their processes (its children), progress and restarts.

A launched learner is `gadei learn JOB ARGS... --start-at N`, where N is the samples of its
schedule (its epochs over its shard) that the job's weights already hold: a learner that
dies is started again where the gradients it published end, and after a server restart
from a checkpoint, where that checkpoint's `progress` says. Its output goes to
`learner-<number>.log` in the supervisor's log folder. The table of launched learners
(`gadei.supervisor.Launched`) is saved with the supervisor's record, which `gadei status` shows.
"""

import logging
import os
import select
import signal
import time

import psutil

from gadei import _proc, console, ring
from gadei._proc import wait_or_kill
from gadei.launch import started_as, spawn
from gadei.layout import ACTIVE, DEAD
from gadei.protocol import Deadline
from gadei.supervisor import Launched, progress

log = logging.getLogger(__name__)

BACKOFF_CAP = 30.0  # seconds: the longest wait before a learner is started again


class Learners:
    """Starts, watches and restarts a job's launched learners (the watchdog calls `look()`)."""

    def __init__(self, job: str, table: list[Launched], log_dir: str, env: dict, *, max_restarts: int,
                 window: float, backoff: float, passive: bool = True):
        self.job, self.table, self.log_dir, self.env = job, table, log_dir, env
        self.max_restarts, self.window, self.backoff = max_restarts, window, backoff
        self.passive = passive  # they may run with passive OpenMP threads (started warm where they may)

    # ------------------------------------------------------------------ state

    @property
    def finished(self) -> bool:
        """Every launched learner is done or given up (and there is at least one)."""
        return (bool(self.table) and all(learner.done or learner.failed for learner in self.table)
                and not any(learner.running for learner in self.table))

    @property
    def failed(self) -> list[int]:
        return [learner.number for learner in self.table if learner.failed]

    def progress(self, ckpt) -> dict:
        """What a checkpoint taken now holds of each learner's schedule (the `progress` hook;
        `gadei.supervisor.progress`)."""
        return progress(self.table, ckpt)

    # ------------------------------------------------------------------ processes

    def start(self, learner: Launched) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        command = _proc.gadei_command("learn", self.job, *_numbered(learner), "--start-at", learner.start_at)
        learner.oom_kills = _proc.oom_kills()
        learner.proc = spawn(command, log=os.path.join(self.log_dir, f"learner-{learner.number}.log"), session=False,
                             env=self.env, passive=self.passive)
        learner.pid, learner.entry, learner.seen, learner.due = learner.proc.pid, -1, 0, 0.0
        try:
            learner.started = _proc.start_time(learner.pid)
        except psutil.NoSuchProcess:
            learner.started = 0.0
        log.info("job %r: started launched learner %d (pid %d, %s) at sample %s of its schedule", self.job,
                 learner.number, learner.pid, started_as(learner.proc), f"{learner.start_at:,}")

    def start_all(self) -> None:
        for learner in self.table:
            if not (learner.done or learner.failed or learner.running):
                self.start(learner)

    def kill_all(self) -> None:
        """SIGKILL every running launched learner and reap it (the server is being replaced)."""
        for learner in self.table:
            if learner.proc is not None and learner.proc.poll() is None:
                learner.proc.kill()
        for learner in self.table:
            if learner.proc is not None:
                learner.proc.wait()
            learner.proc, learner.pid, learner.started, learner.entry = None, 0, 0.0, -1

    def reap(self, timeout: float, region=None) -> None:
        """At the job's end: wait for the learners to leave, then kill what still runs. With the
        job's `region`: a learner never seen attached that holds no ring (still starting: it has
        published nothing) is told to go first (SIGTERM), not waited for: it would wait for a
        region that is gone (`GADEI_ATTACH_TIMEOUT`) until killed."""
        deadline = Deadline(timeout)
        for learner in self.table if region is not None else ():
            if (learner.proc is not None and learner.proc.poll() is None and learner.entry < 0
                    and ring.entry_of(region, learner.pid) < 0):
                log.info("job %r: launched learner %d (pid %d) had not attached; stopping it", self.job, learner.number,
                         learner.pid)
                learner.proc.send_signal(signal.SIGTERM)
        for learner in self.table:
            if learner.proc is not None:
                wait_or_kill(learner.proc, deadline.left(), f"job {self.job!r}: launched learner {learner.number}")

    def pause(self, seconds: float) -> None:
        """Sleep `seconds`, or less: until a running launched learner exits, so that the next
        look sees its end at once (a job whose learners all finished stops then, not up to one
        interval later). Waits on the learners' pidfds (Linux); elsewhere it sleeps."""
        fds = []
        try:
            for learner in self.table:
                if learner.proc is not None and learner.proc.poll() is None:
                    try:
                        fds.append(os.pidfd_open(learner.pid))
                    except (AttributeError, OSError):  # no pidfds here, or it is gone: the look will see
                        pass
            if fds:
                poller = select.poll()  # not select(): any descriptor number
                for fd in fds:
                    poller.register(fd, select.POLLIN)
                poller.poll(1000 * seconds)
            else:
                time.sleep(seconds)
        finally:
            for fd in fds:
                os.close(fd)

    # ------------------------------------------------------------------ one look

    def look(self, region) -> tuple[list[int], bool]:
        """Notice exits and deaths, start what is due; (learners that died now, anything changed)."""
        died, changed = [], False
        now = time.time()
        for learner in self.table:
            if learner.running:
                exited, code = self._exited(learner, region)
                if not exited:
                    self._track(learner, region)
                    continue
                changed = True
                if code == 0:
                    learner.done, learner.pid, learner.proc = True, 0, None
                    log.info("job %r: launched learner %d finished its schedule", self.job, learner.number)
                else:
                    died.append(learner.number)
                    self._died(learner, region, code, now)
            if learner.due and now >= learner.due and not (learner.done or learner.failed):
                self.start(learner)
                changed = True
        return died, changed

    def _exited(self, learner: Launched, region) -> tuple[bool, int | None]:
        code = learner.proc.poll() if learner.proc is not None else None
        return learner.proc is None or code is not None, code

    def _track(self, learner: Launched, region) -> None:
        if learner.entry < 0 or not ring.owned_by(region, learner.entry, learner.pid):
            learner.entry = ring.entry_of(region, learner.pid)
        if learner.entry >= 0:
            learner.seen = region.entry(learner.entry).get("samples")

    def _died(self, learner: Launched, region, code, now: float) -> None:
        how = _proc.how_it_ended(code, learner.oom_kills)
        published = learner.seen
        if learner.entry >= 0 and ring.owned_by(region, learner.entry, learner.pid):
            region.entry(learner.entry).cas("state", ACTIVE, DEAD)
            published = ring.dead_owner_applied(region, learner.entry, learner.pid, published)
        else:
            # It gave its entry back (after draining it) and was killed before it exited, or
            # never was seen holding one: the record it kept when it gave the entry back, or
            # that entry, says what the server applied of it; `seen` may be older than its
            # last pushes.
            left = ring.left_record(region, learner.pid)
            if left is not None:
                published = left
        learner.start_at += published
        learner.proc, learner.pid, learner.started, learner.entry, learner.seen = None, 0, 0.0, -1, 0
        recent = [t for t in learner.restarts if now - t < self.window]
        said = os.path.join(self.log_dir, f"learner-{learner.number}.log")
        learner.error = console.refusal_in(said) if code == console.REFUSED else ""
        how += f" ({learner.error})" if learner.error else ""
        if len(recent) >= self.max_restarts:
            learner.failed = True
            log.error("job %r: launched learner %d %s; gave up on it: it died %d times within %g s (see %s)", self.job,
                      learner.number, how, len(recent) + 1, self.window, said)
            return
        delay = min(BACKOFF_CAP, self.backoff * 2 ** len(recent))
        learner.restarts = [*recent, now]
        learner.due = now + delay
        log.warning("job %r: launched learner %d %s after %s samples of its schedule; starting it again in %g s",
                    self.job, learner.number, how, f"{learner.start_at:,}", delay)

    def resume(self, progress: dict) -> None:
        """After a server restart: each learner goes on from a checkpoint's `progress` (none: 0)."""
        for learner in self.table:
            if learner.failed:
                continue
            done = progress.get(str(learner.number))
            learner.done = done == "done"
            learner.start_at = 0 if learner.done or done is None else int(done)
            learner.due = 0.0


def _numbered(learner: Launched) -> list[str]:
    """Its arguments, with `--entry NUMBER` unless they name an entry: a launched learner
    keeps what the server applied of it in the entry of its number when it gives its ring
    back (`gadei.ring.claim`'s prefer), which `_died` and `progress` read."""
    if any(a == "--entry" or a.startswith("--entry=") for a in learner.args):
        return list(learner.args)
    return [*learner.args, "--entry", str(learner.number)]
