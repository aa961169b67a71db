"""The watchdog of one job: it watches the server and learners through the region and keeps
checkpoints of the job (installed as `gadei_watchdog`; run it with `gadei watchdog JOB`).

It attaches to a running job (so a new watchdog can take over a job whose watchdog died),
registers its pid, start time and heartbeat in the region header, and every `interval`
seconds:
- beats;
- judges the server and each learner by pid plus process start time (pid reuse cannot fool
  it) and by heartbeat: a process is dead when it is gone, or hung after `interval *
  max_missed` seconds without a beat; it reports each death once;
- every `every` seconds takes a checkpoint between two updates (`gadei.checkpoint.capture`)
  and writes it crash safely, keeping the last `keep`, and records its version in the header.

It ends when the job stops (0). When the server is dead and the watchdog knows how it was
started (`restart`, the arguments of `gadei serve`, which passes them), it starts it again
with `--replace --resume CHECKPOINT_DIR`: the region is recreated from the newest valid
checkpoint, and the new server starts a watchdog of its own, so this one ends (0) once the
new server serves. Restarts are counted in GADEI_RESTARTS (inherited by the new server and
its watchdog); after `max_restarts` within `window` seconds it gives up. Without `restart`,
or when it gives up, it ends with 3 and logs the command that resumes the job.
"""

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from gadei import _proc, checkpoint
from gadei.errors import GadeiError
from gadei.layout import ACTIVE, SERVING, STOPPED, STOPPING
from gadei.region import Region, inspect
from gadei.ring import lease_owner

log = logging.getLogger(__name__)

SERVER_DEAD = 3  # exit code: the server died or hung


@dataclass
class Settings:
    """How a watchdog watches.

    Attributes:
        checkpoint_dir: where checkpoints go.
        every: seconds between two checkpoints.
        keep: checkpoints kept.
        interval: seconds between two looks (and the watchdog's own beats).
        max_missed: beats a process may miss before it counts as hung.
        restart: the `gadei` arguments that started the server, to start it again; None: do not.
        max_restarts: restarts within `window` seconds before giving up.
        window: seconds over which restarts are counted.
    """

    checkpoint_dir: str
    every: float = 60.0
    keep: int = 3
    interval: float = 0.5
    max_missed: int = 20
    restart: list[str] | None = None
    max_restarts: int = 3
    window: float = 300.0

    def check(self) -> None:
        for name in ("every", "interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"watchdog {name} must be positive seconds, not {getattr(self, name)!r}")
        for name in ("keep", "max_missed"):
            if getattr(self, name) < 1:
                raise ValueError(f"watchdog {name} must be at least 1, not {getattr(self, name)!r}")


class Watchdog:
    """Watches one job; `run()` until the job stops or its server dies."""

    def __init__(self, job: str, settings: Settings):
        settings.check()
        self.job, self.settings = job, settings
        self.region = Region.attach(job)
        self._dead: set[tuple[int, int]] = set()  # (learner, pid) already reported
        self.checkpoints = 0
        try:
            self._register()
        except BaseException:
            self.region.close()
            raise

    def _register(self) -> None:
        h = self.region.header
        pid, started = h.get("watchdog_pid"), h.get("watchdog_start")
        if pid and _proc.alive(pid, started):
            raise GadeiError(f"job {self.job!r} already has a live watchdog (pid {pid})")
        h.set("watchdog_start", _proc.start_time())
        h.set("watchdog_beat", time.monotonic_ns())
        h.set("watchdog_pid", os.getpid())
        log.info("job %r: watchdog watching; checkpoints every %g s to %s", self.job, self.settings.every,
                 self.settings.checkpoint_dir)

    def run(self) -> int:
        """Watch until the job stops (0) or its server is dead (SERVER_DEAD)."""
        h = self.region.header
        next_checkpoint = time.monotonic() + self.settings.every
        try:
            while True:
                h.set("watchdog_beat", time.monotonic_ns())
                state = h.get("run_state")
                if state == STOPPED:
                    log.info("job %r stopped; the watchdog ends after %d checkpoints", self.job, self.checkpoints)
                    return 0
                problem = self._server_problem()
                if problem:
                    log.error("job %r: the server %s", self.job, problem)
                    if self.settings.restart and self._restart_server():
                        return 0
                    log.error("job %r: go on from the last checkpoint with `gadei serve %s --replace --resume %s "
                              "...`", self.job, self.job, self.settings.checkpoint_dir)
                    return SERVER_DEAD
                self._look_at_learners()
                if state == SERVING and time.monotonic() >= next_checkpoint:
                    self.checkpoint()
                    next_checkpoint = time.monotonic() + self.settings.every
                time.sleep(self.settings.interval)
        finally:
            if h.get("watchdog_pid") == os.getpid():
                h.set("watchdog_pid", 0)
            self.region.close()

    def _restart_server(self, timeout: float = 120.0) -> bool:
        """Start the server again from the newest checkpoint; True once it serves."""
        now = time.time()
        history = [float(t) for t in os.environ.get("GADEI_RESTARTS", "").split(",") if t.strip()]
        recent = [t for t in history if now - t < self.settings.window]
        if len(recent) >= self.settings.max_restarts:
            log.error("job %r: gave up: the server was restarted %d times within %g s", self.job, len(recent),
                      self.settings.window)
            return False
        h = self.region.header
        pid = h.get("server_pid")
        if _proc.alive(pid, h.get("server_start")):  # hung, not gone: it must go before its region is replaced
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _proc.alive(pid, h.get("server_start")) and time.monotonic() < deadline:
                time.sleep(0.05)
        folder = self.settings.checkpoint_dir
        found = checkpoint.latest(folder)
        args = [*self.settings.restart, "--replace"] + (["--resume", folder] if found else [])
        env = {**os.environ, "GADEI_RESTARTS": ",".join(str(t) for t in [*recent, now])}
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "server.log"), "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "gadei", *args], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        log.warning("job %r: restarting the server (pid %d) %s; its output goes to %s", self.job, proc.pid,
                    f"from checkpoint version {found.version:,}" if found else "from its initial weights (no "
                    "checkpoint yet)", os.path.join(folder, "server.log"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found_now = inspect(self.job)
            if found_now is not None and found_now.state == "running" and found_now.server_pid == proc.pid:
                log.info("job %r: the restarted server serves", self.job)
                return True
            if proc.poll() is not None:
                log.error("job %r: the restarted server exited with %d (see %s)", self.job, proc.returncode,
                          os.path.join(folder, "server.log"))
                return False
            time.sleep(0.05)
        log.error("job %r: the restarted server did not serve within %g s", self.job, timeout)
        return False

    def checkpoint(self) -> None:
        """Take and write one checkpoint now; a failure is logged and the next one tried later."""
        try:
            checkpoint.take(self.region, self.settings.checkpoint_dir, keep=self.settings.keep)
        except GadeiError as err:
            log.error("job %r: no checkpoint this time: %s", self.job, err)
            return
        self.checkpoints += 1

    def _server_problem(self) -> str | None:
        h = self.region.header
        if not _proc.alive(h.get("server_pid"), h.get("server_start")):
            return f"pid {h.get('server_pid')} is gone"
        silent = (time.monotonic_ns() - h.get("server_beat")) / 1e9
        if silent > self.settings.interval * self.settings.max_missed and h.get("run_state") in (SERVING, STOPPING):
            return f"pid {h.get('server_pid')} has not beaten for {silent:.1f} s (hung)"
        return None

    def _look_at_learners(self) -> None:
        limit_ns = self.settings.interval * self.settings.max_missed * 1e9
        for i in range(self.region.shape.capacity):
            entry = self.region.entry(i)
            pid = lease_owner(entry.get("lease"))
            if pid == 0 or entry.get("state") != ACTIVE or (i, pid) in self._dead:
                continue
            if not _proc.alive(pid, entry.get("start")):
                why = "is gone"
            elif time.monotonic_ns() - entry.get("beat") > limit_ns:
                why = f"has not beaten for {(time.monotonic_ns() - entry.get('beat')) / 1e9:.1f} s"
            else:
                continue
            self._dead.add((i, pid))
            log.warning("job %r: learner %d (pid %d) %s; its ring goes to the next learner that attaches",
                        self.job, i, pid, why)


def main(argv=None) -> int:
    """`python -m gadei_watchdog JOB ...`: the same as `gadei watchdog JOB ...`."""
    from gadei.cli import main as gadei_main

    import sys

    return gadei_main(["watchdog", *(sys.argv[1:] if argv is None else argv)])
