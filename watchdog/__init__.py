"""The watchdog of one job: it watches the server and learners through the region, keeps
checkpoints of the job, and restarts what dies (installed as `gadei_watchdog`; run it with
`gadei watchdog JOB`, or let `gadei serve --checkpoint-dir DIR` start it).

It attaches to a running job, registers its pid, start time and heartbeat in the region
header (refusing to run beside another live watchdog: the look and the registration are
one step under `gadei.watchdog_record.registering`'s lock, so of two that adopt a job at once one
attaches), and every `interval` seconds (sooner when a launched learner exits, and every 0.05 s
while the job stops, so that its end is seen at once):
- beats;
- judges the server and each learner by pid plus process start time (pid reuse cannot fool
  it) and by heartbeat: a process is dead when it is gone, or hung after `interval *
  max_missed` seconds without a beat. It reports each once; the entry of a learner that
  died without leaving is marked dead (its published gradients are still applied, its
  half-written slot is never published, and the next learner that claims the ring takes it);
- starts, watches and restarts the learners it launched (`learners`, see `learners.py`): a
  learner that dies is started again where the gradients it published end, after a
  back-off that doubles (`backoff` seconds, at most 30) up to `max_restarts` within
  `window`, then given up and reported. When all of them died at once, a checkpoint is
  taken first and they go on from it. When all are done, it stops the job;
- every `every` seconds takes a checkpoint between two updates (`gadei.checkpoint.capture`),
  with each launched learner's progress, and writes it crash safely, keeping the last `keep`.

A dead or hung server (`restart`: the arguments of `gadei serve`, which passes them): the
watchdog kills it if it still runs, kills the learners it launched, starts the server again
with `--replace --no-watchdog --resume CHECKPOINT_DIR` (the region is recreated from the
newest valid checkpoint; without one, from the initial weights), re-attaches, and starts
the learners again from that checkpoint's progress. After `max_restarts` server restarts
within `window` seconds it gives up (exit 3) and logs the command that resumes the job.

With `outputs` (a `gadei run` output folder), whatever the job's end, it records how the
job ended there (`gadei.outputs.END`: its exit code, whether every learner finished, why)
once no server of the job runs, and writes the job's outputs (`gadei.outputs.conclude`) when
the `gadei run` that started the job is gone (it holds the run's lock while it lives).

It ends when the job stops: 0, or 4 when it had given up on some launched learner. A job its
server stopped as failed (run state 'failed': a corrupt region, a non-finite gradient with
nonfinite = 'stop') is final: the watchdog takes no checkpoint of it, does not restart the
server, stops the learners it launched and ends with 5; the newest checkpoint is one from
before the failure.
"""

import logging
import os
import signal
import subprocess
import time
from dataclasses import asdict

from gadei import _proc, checkpoint, ring
from gadei.env import restarts, restarts_env
from gadei.errors import GadeiError, RegionNotFound
from gadei.launch import spawn, wait_or_kill
from gadei.layout import ACTIVE, DEAD, FAILED, SERVING, STOPPED, STOPPING
from gadei.protocol import Deadline, RunState
from gadei.region import Region, inspect
from gadei.watchdog_options import WatchdogSettings

from gadei.watchdog_record import (JOB_FAILED, LEARNERS_FAILED, SERVER_DEAD, Launched, load_state, registering,
                                   remove_state, save_state)

from .learners import Learners

log = logging.getLogger(__name__)

AT_ONCE = 2.0  # seconds: launched learners that all died within this died at once (a look may see some of them)


class Watchdog:
    """Watches one job; `run()` until the job stops (or its server is dead for good).

    Args:
        job: the job's name.
        settings: how to watch.
        adopted: the launched learners of a watchdog that died (`Watchdog.adopt`).
    """

    def __init__(self, job: str, settings: WatchdogSettings, adopted: list[Launched] | None = None):
        settings.check()
        self.job, self.settings = job, settings
        self.log_dir = settings.log_dir or settings.checkpoint_dir
        table = adopted if adopted is not None else [Launched(i, list(a)) for i, a in enumerate(settings.learners)]
        for l in adopted or []:  # learners an earlier watchdog started: their deaths are counted from now
            l.oom_kills = _proc.oom_kills()
        self.learners = Learners(job, table, self.log_dir, max_restarts=settings.max_restarts,
                                 window=settings.window, backoff=settings.backoff)
        self._restarts = restarts()
        self._server: subprocess.Popen | None = None  # a server this watchdog restarted
        self._server_oom_kills = _proc.oom_kills()  # when this watchdog, or the server it restarted, started
        self._reported: set[tuple[int, int]] = set()  # (learner entry, pid) reported dead or hung
        self._stopped_it = False  # this watchdog's own stop (every launched learner done) is the job's
        self.checkpoints = 0
        self._deaths: list[tuple[float, int]] = []  # (monotonic time, learner number) of recent deaths
        self.reason = ""  # why the job ended, when it did not end well
        self.finished = False  # the job stopped because every launched learner finished
        self.region = Region.attach(job)
        try:
            self._register()
        except BaseException:
            self.region.close()
            raise

    @classmethod
    def adopt(cls, job: str) -> "Watchdog":
        """A watchdog that takes over `job` from one that died, with its settings and learners.

        Raises:
            GadeiError: no watchdog of this job left its state on this machine.
        """
        try:
            saved, table = load_state(job)
        except FileNotFoundError:
            raise GadeiError(f"job {job!r}: no watchdog state to adopt (it was never watched on this machine, "
                             f"or its watchdog ended with it); start one with `gadei watchdog {job} "
                             "--checkpoint-dir DIR`") from None
        return cls(job, WatchdogSettings(**saved), adopted=table)

    def _register(self) -> None:
        h = self.region.header
        with registering(self.job):  # the look and the registration are one step for every watchdog of the job
            pid, started = h.get("watchdog_pid"), h.get("watchdog_start")
            if pid and pid != os.getpid() and _proc.alive(pid, started):
                raise GadeiError(f"job {self.job!r} already has a live watchdog (pid {pid})")
            h.set("watchdog_start", _proc.start_time())  # before the pid: a reader never pairs ours with another's
            h.set("watchdog_beat", time.monotonic_ns())
            h.set("watchdog_pid", os.getpid())
        log.info("job %r: watchdog watching; checkpoints every %g s to %s%s", self.job, self.settings.every,
                 self.settings.checkpoint_dir,
                 f"; {len(self.learners.table)} learners launched" if self.learners.table else "")

    def _save(self) -> None:
        try:
            save_state(self.job, asdict(self.settings), self.learners.table)
        except OSError as err:
            log.warning("job %r: cannot save the watchdog's state (for --adopt): %s", self.job, err)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Watch until the job stops (0, or LEARNERS_FAILED) or its server is dead for good
        (SERVER_DEAD), or failed (JOB_FAILED); with `outputs`, record the end and write the
        outputs that nobody else will."""
        code = self._watch()
        if self.settings.outputs:
            self._record_end(code)
        if code != SERVER_DEAD:  # kept then: the job's learners may still be adopted
            remove_state(self.job)  # after the end record: while either exists, the daemon knows the job lives
        return code

    def _record_end(self, code: int, timeout: float = 120.0) -> None:
        from pathlib import Path

        from gadei import outputs

        out = Path(self.settings.outputs)
        deadline = Deadline(timeout)  # the server writes the model at its stop, then removes its region
        while (found := inspect(self.job)) is not None and found.state in ("running", "starting") \
                and not deadline.expired():
            deadline.sleep(0.05)
        try:
            result = outputs.conclude(out, ending=outputs.Ending(code, self.finished, self.reason), leave_to_owner=True)
            if result is None:
                log.info("job %r: its `gadei run` writes the outputs", self.job)
                return
            log.info("job %r: its `gadei run` is gone; the watchdog wrote the outputs in %s (%s)", self.job, out,
                     result.get("outcome"))
        except (OSError, GadeiError) as err:
            log.error("job %r: cannot write the outputs in %s: %s", self.job, out, err)

    def _watch(self) -> int:
        next_checkpoint = Deadline(self.settings.every)
        self.learners.start_all()
        self._save()
        stopping = False
        try:
            while True:
                h = self.region.header
                h.set("watchdog_beat", time.monotonic_ns())
                run_state = RunState(self.region)
                state = run_state.get()
                if state == STOPPED:
                    return self._ended()
                if state == FAILED:
                    return self._failed()
                problem = self._server_problem()
                if problem:
                    if run_state.get() == FAILED:  # it failed the job, then exited, since the look above
                        return self._failed()
                    log.error("job %r: the server %s", self.job, problem)
                    if self.settings.restart and self._restart_server():
                        next_checkpoint.restart()
                        stopping = False  # the learners go on from the checkpoint: stop when they are done again
                        continue
                    self.learners.kill_all()
                    self.reason = f"the server {problem} and was not restarted (see logs/serve.log)"
                    log.error("job %r: go on from the last checkpoint with `gadei serve %s --replace --resume %s "
                              "...`", self.job, self.job, self.settings.checkpoint_dir)
                    return SERVER_DEAD
                self._look_at_learners()
                if state == SERVING:
                    self._supervise()
                    if not stopping and self.learners.finished:
                        stopping = True
                        self._stop_job()
                if state == SERVING and next_checkpoint.expired():
                    self.checkpoint()
                    next_checkpoint.restart()
                # a learner's exit ends the pause; a job told to stop is looked at again soon
                self.learners.pause(min(0.05, self.settings.interval) if stopping or state == STOPPING else
                                    self.settings.interval)
        finally:
            h = self.region.header
            if h.get("watchdog_pid") == os.getpid():
                h.set("watchdog_pid", 0)
            self.region.close()

    def _ended(self) -> int:
        log.info("job %r stopped; the watchdog ends after %d checkpoints", self.job, self.checkpoints)
        self.finished = self.region.header.get("finished") == 1
        self.learners.reap(timeout=30.0, region=self.region)
        if self._server is not None:  # it writes its last checkpoint, then exits
            wait_or_kill(self._server, 60.0, f"job {self.job!r}: the server")
        if self.learners.failed:
            log.error("job %r ended without learners %s (given up)", self.job, self.learners.failed)
            self.reason = (f"the watchdog gave up on launched learners {self.learners.failed}: they died "
                           f"{self.settings.max_restarts + 1} times within {self.settings.window:g} s (see their logs)")
            return LEARNERS_FAILED
        return 0

    def _failed(self) -> int:
        """The server stopped the job as failed: final. No checkpoint, no restart; the launched
        learners are stopped (they would only wait for a server that will not come back)."""
        why = RunState(self.region).reason() or "see logs/serve.log; the newest checkpoint is from before"
        self.reason = f"the server stopped the job as failed: {why}"
        log.error("job %r: %s; not restarting it, no checkpoint taken; the newest checkpoint in %s (version %s) is "
                  "from before the failure", self.job, self.reason, self.settings.checkpoint_dir,
                  f"{self.region.header.get('checkpointed_version'):,}")
        self.learners.kill_all()
        if self._server is not None:
            wait_or_kill(self._server, 60.0, f"job {self.job!r}: the server")
        return JOB_FAILED

    def _stop_job(self) -> None:
        h = self.region.header
        why = "every launched learner finished" if not self.learners.failed else \
            f"no launched learner is left (gave up on {self.learners.failed})"
        log.info("job %r: %s; stopping the job", self.job, why)
        if not self.learners.failed:
            h.set("finished", 1)  # before the stop, so whoever sees it stopping can tell why (a bridge's last exchange)
        self._stopped_it = RunState(self.region).request_stop()

    def _supervise(self) -> None:
        """Launched learners: notice deaths, restart them; all dead at once (within AT_ONCE seconds,
        which one look may see in part): checkpoint first."""
        died, changed = self.learners.look(self.region)
        now = time.monotonic()
        self._deaths = [(t, n) for t, n in self._deaths if now - t < AT_ONCE] + [(now, n) for n in died]
        if died and len({n for _, n in self._deaths}) > 1 and not any(l.running for l in self.learners.table):
            log.warning("job %r: all launched learners died; checkpointing the server's weights before they go on",
                        self.job)
            self.checkpoint()
        if changed:
            self._save()

    def checkpoint(self) -> None:
        """Take and write one checkpoint now; a failure is logged and the next one tried later."""
        try:
            checkpoint.take(self.region, self.settings.checkpoint_dir, keep=self.settings.keep,
                            progress=self.learners.progress if self.learners.table else None)
        except GadeiError as err:
            log.error("job %r: no checkpoint this time: %s", self.job, err)
            return
        self.checkpoints += 1

    # ------------------------------------------------------------------ the server

    def _server_problem(self) -> str | None:
        h = self.region.header
        if not _proc.alive(h.get("server_pid"), h.get("server_start")):
            pid, own = h.get("server_pid"), self._server
            code = own.poll() if own is not None and own.pid == pid else None  # only a child's code can be read
            return f"pid {pid} {_proc.how_it_ended(code, self._server_oom_kills)}"
        silent = (time.monotonic_ns() - h.get("server_beat")) / 1e9
        if silent > self.settings.interval * self.settings.max_missed and RunState(self.region).get() in (SERVING, STOPPING):
            return f"pid {h.get('server_pid')} has not beaten for {silent:.1f} s (hung)"
        return None

    def _restart_server(self, timeout: float = 120.0) -> bool:
        """Start the server again from the newest checkpoint; True once it serves and the
        launched learners go on."""
        now = time.time()
        recent = [t for t in self._restarts if now - t < self.settings.window]
        if len(recent) >= self.settings.max_restarts:
            log.error("job %r: gave up: the server was restarted %d times within %g s", self.job, len(recent),
                      self.settings.window)
            return False
        h = self.region.header
        pid, started = h.get("server_pid"), h.get("server_start")
        if _proc.alive(pid, started):  # hung, not gone: it must go before its region is replaced
            os.kill(pid, signal.SIGKILL)
            deadline = Deadline(10)
            while _proc.alive(pid, started) and not deadline.expired():
                time.sleep(0.05)
        if self._server is not None:
            self._server.wait()  # reap the one we restarted before
        self.learners.kill_all()
        folder = self.settings.checkpoint_dir
        found = checkpoint.latest(folder)
        args = [*self.settings.restart, "--replace", "--no-watchdog"] + (["--resume", folder] if found else [])
        self._restarts = [*recent, now]
        env = {**os.environ, **restarts_env(self._restarts)}
        os.makedirs(self.log_dir, exist_ok=True)
        server_log = os.path.join(self.log_dir, "server.log")
        self._server_oom_kills = oom_kills = _proc.oom_kills()
        proc = spawn(_proc.gadei_command(*args), log=server_log, env=env)
        self._server = proc
        log.warning("job %r: restarting the server (pid %d) %s; its output goes to %s", self.job, proc.pid,
                    f"from checkpoint version {found.version:,}" if found else "from its initial weights (no "
                    "checkpoint yet)", server_log)
        deadline = Deadline(timeout)
        while True:
            now_found = inspect(self.job)
            if now_found is not None and now_found.state == "running" and now_found.server_pid == proc.pid:
                break
            if proc.poll() is not None:
                log.error("job %r: the restarted server %s (see %s)", self.job, _proc.how_it_ended(proc.returncode, oom_kills),
                          server_log)
                return False
            if deadline.expired():
                log.error("job %r: the restarted server did not serve within %g s", self.job, timeout)
                return False
            time.sleep(0.05)
        # A `gadei stop` that the dead server had not finished is the new server's too (the
        # watchdog's own stop is not: its learners go on from the checkpoint and finish again).
        carried = RunState(self.region).get() == STOPPING and not self._stopped_it
        self._stopped_it = False
        self.region.close()
        try:
            self.region = Region.attach(self.job)
        except (RegionNotFound, GadeiError) as err:
            log.error("job %r: cannot attach to the restarted server's region: %s", self.job, err)
            return False
        self._register()
        self._reported.clear()
        self.learners.resume(found.progress if found else {})
        if carried:
            log.warning("job %r: the job was being stopped when its server died; stopping the restarted one", self.job)
            RunState(self.region).request_stop()
        else:
            self.learners.start_all()
        self._save()
        log.info("job %r: the restarted server serves", self.job)
        return True

    # ------------------------------------------------------------------ every learner

    def _look_at_learners(self) -> None:
        """Report each learner (launched or not) that died or hangs, once; mark the dead."""
        limit_ns = self.settings.interval * self.settings.max_missed * 1e9
        for i in range(self.region.shape.capacity):
            entry = self.region.entry(i)
            pid = ring.owner(self.region, i)
            if pid == 0 or entry.get("state") != ACTIVE:
                continue
            silent_ns = time.monotonic_ns() - entry.get("beat")
            if not _proc.alive(pid, entry.get("start")):
                if entry.cas("state", ACTIVE, DEAD):
                    log.warning("job %r: learner entry %d (pid %d) is gone; the entry is marked dead and its ring "
                                "goes to the next learner that attaches", self.job, i, pid)
                self._reported.discard((i, pid))
            elif silent_ns > limit_ns:
                if (i, pid) not in self._reported:
                    self._reported.add((i, pid))
                    log.warning("job %r: learner entry %d (pid %d) has not beaten for %.1f s (hung)", self.job, i, pid,
                                silent_ns / 1e9)
            elif (i, pid) in self._reported:
                self._reported.discard((i, pid))
                log.info("job %r: learner entry %d (pid %d) beats again", self.job, i, pid)
