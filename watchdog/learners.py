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

from gadei import _proc, ring
from gadei.launch import spawn, wait_or_kill
from gadei.layout import ACTIVE, DEAD
from gadei.protocol import Deadline
from gadei.supervisor import Launched, progress

log = logging.getLogger(__name__)

BACKOFF_CAP = 30.0  # seconds: the longest wait before a learner is started again


class Learners:
    """Starts, watches and restarts a job's launched learners (the watchdog calls `look()`)."""

    def __init__(self, job: str, table: list[Launched], log_dir: str, env: dict, *, max_restarts: int,
                 window: float, backoff: float):
        self.job, self.table, self.log_dir, self.env = job, table, log_dir, env
        self.max_restarts, self.window, self.backoff = max_restarts, window, backoff

    # ------------------------------------------------------------------ state

    @property
    def finished(self) -> bool:
        """Every launched learner is done or given up (and there is at least one)."""
        return (bool(self.table) and all(l.done or l.failed for l in self.table)
                and not any(l.running for l in self.table))

    @property
    def failed(self) -> list[int]:
        return [l.number for l in self.table if l.failed]

    def progress(self, ckpt) -> dict:
        """What a checkpoint taken now holds of each learner's schedule (the `progress` hook;
        `gadei.supervisor.progress`)."""
        return progress(self.table, ckpt)

    # ------------------------------------------------------------------ processes

    def start(self, l: Launched) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        command = _proc.gadei_command("learn", self.job, *_numbered(l), "--start-at", l.start_at)
        l.oom_kills = _proc.oom_kills()
        l.proc = spawn(command, log=os.path.join(self.log_dir, f"learner-{l.number}.log"), session=False, env=self.env)
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
            if l.proc is not None and l.proc.poll() is None:
                l.proc.kill()
        for l in self.table:
            if l.proc is not None:
                l.proc.wait()
            l.proc, l.pid, l.started, l.entry = None, 0, 0.0, -1

    def reap(self, timeout: float, region=None) -> None:
        """At the job's end: wait for the learners to leave, then kill what still runs. With the
        job's `region`: a learner never seen attached that holds no ring (still starting: it has
        published nothing) is told to go first (SIGTERM), not waited for: it would wait for a
        region that is gone (`GADEI_ATTACH_TIMEOUT`) until killed."""
        deadline = Deadline(timeout)
        for l in self.table if region is not None else ():
            if l.proc is not None and l.proc.poll() is None and l.entry < 0 and ring.entry_of(region, l.pid) < 0:
                log.info("job %r: launched learner %d (pid %d) had not attached; stopping it", self.job, l.number,
                         l.pid)
                l.proc.send_signal(signal.SIGTERM)
        for l in self.table:
            if l.proc is not None:
                wait_or_kill(l.proc, deadline.left(), f"job {self.job!r}: launched learner {l.number}")

    def pause(self, seconds: float) -> None:
        """Sleep `seconds`, or less: until a running launched learner exits, so that the next
        look sees its end at once (a job whose learners all finished stops then, not up to one
        interval later). Waits on the learners' pidfds (Linux); elsewhere it sleeps."""
        fds = []
        try:
            for l in self.table:
                if l.proc is not None and l.proc.poll() is None:
                    try:
                        fds.append(os.pidfd_open(l.pid))
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
        code = l.proc.poll() if l.proc is not None else None
        return l.proc is None or code is not None, code

    def _track(self, l: Launched, region) -> None:
        if l.entry < 0 or not ring.owned_by(region, l.entry, l.pid):
            l.entry = ring.entry_of(region, l.pid)
        if l.entry >= 0:
            l.seen = region.entry(l.entry).get("samples")

    def _died(self, l: Launched, region, code, now: float) -> None:
        how = _proc.how_it_ended(code, l.oom_kills)
        published = l.seen
        if l.entry >= 0 and ring.owned_by(region, l.entry, l.pid):
            region.entry(l.entry).cas("state", ACTIVE, DEAD)
            published = ring.dead_owner_applied(region, l.entry, l.pid, published)
        else:
            # It gave its entry back (after draining it) and was killed before it exited, or
            # never was seen holding one: the record it kept when it gave the entry back, or
            # that entry, says what the server applied of it; `seen` may be older than its
            # last pushes.
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
        log.warning("job %r: launched learner %d %s after %s samples of its schedule; starting it again in %g s",
                    self.job, l.number, how, f"{l.start_at:,}", delay)

    def resume(self, progress: dict) -> None:
        """After a server restart: each learner goes on from a checkpoint's `progress` (none: 0)."""
        for l in self.table:
            if l.failed:
                continue
            done = progress.get(str(l.number))
            l.done = done == "done"
            l.start_at = 0 if l.done or done is None else int(done)
            l.due = 0.0


def _numbered(l: Launched) -> list[str]:
    """Its arguments, with `--entry NUMBER` unless they name an entry: a launched learner
    keeps what the server applied of it in the entry of its number when it gives its ring
    back (`gadei.ring.claim`'s prefer), which `_died` and `progress` read."""
    if any(a == "--entry" or a.startswith("--entry=") for a in l.args):
        return list(l.args)
    return [*l.args, "--entry", str(l.number)]
