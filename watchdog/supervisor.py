"""The supervisor of one job: it starts the job's server (its child), launches the learners,
keeps checkpoints of the job, restarts what dies, and decides that the job ended and why
(`Supervisor.run`'s code, `finished`, `stopped`, `reason`); docs/fault-tolerance.md says each
duty in full.

Every `interval` seconds (sooner when a launched learner exits or the job stops) it beats in
the region's header (where it registered: `gadei status` shows it), judges the server and
each learner by pid and start time and by heartbeat (dead, or hung after `interval *
max_missed` s), restarts a dead learner where its applied gradients end (`learners.py`: back-off,
given up after `max_restarts` within `window`), a dead server from the newest checkpoint that
records the learners' progress (`server`: its arguments), takes a checkpoint every `every`
seconds, and stops the job once every launched learner finished. A stop asked of it
(`ask_stop`) is taken at its next look and only there: every launched learner finished, the
job is done; else a checkpoint of the learners' progress, then the stop. A server that failed
the job (run state 'failed') is final. The server and the learners it starts are its children,
tied to it (`gadei._proc.TIED_TO`): should it die, they end too.
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
from gadei._proc import wait_or_kill
from gadei.launch import started_as, spawn
from gadei.layout import ACTIVE, DEAD, FAILED, SERVING, STOPPED, STOPPING
from gadei.protocol import Deadline, RunState
from gadei.region import Region, inspect
from gadei.server_record import read_stop_record
from gadei.supervisor import JOB_FAILED, LEARNERS_FAILED, SERVER_DEAD, Launched, SupervisorSettings, remove_state, \
    save_state

from .learners import Learners

log = logging.getLogger(__name__)

AT_ONCE = 2.0  # seconds: launched learners that all died within this died at once (a look may see some of them)
SERVE_WITHIN = 120.0  # seconds a server it starts has to serve


class Supervisor:
    """Supervises one job; `run()` until the job stops (or its server is dead for good).

    Args:
        job: the job's name.
        settings: how to supervise.
        progress: how far each launched learner got (a checkpoint's `progress`): they start there.
        stop_record: where the servers it starts leave how they ended (`gadei serve --stop-record`).
        env: the environment of the processes it starts (None: its own).
        look: called at every look while the job serves, with the region (a job file's
            supervisor follows the epoch records there); it may call `stop`.
        passive_learners: the launched learners may run with passive OpenMP threads (those
            of one thread, or more than the cores hold), so that they may be started warm.
    """

    def __init__(self, job: str, settings: SupervisorSettings, *, progress: dict | None = None,
                 stop_record: str | None = None, env: dict | None = None, look=None, passive_learners: bool = True):
        settings.check()
        self.job, self.settings = job, settings
        self.log_dir = settings.log_dir or settings.checkpoint_dir
        self.stop_record = stop_record or os.path.join(self.log_dir, "server-stop.json")
        self.env = {**(os.environ if env is None else env), _proc.TIED_TO: str(os.getpid())}  # they end with it
        table = [Launched(i, list(a)) for i, a in enumerate(settings.learners)]
        self.learners = Learners(job, table, self.log_dir, self.env, max_restarts=settings.max_restarts,
                                 window=settings.window, backoff=settings.backoff, passive=passive_learners)
        self.learners.resume(progress or {})
        self._look = look
        self._restarts = restarts()
        self._server: subprocess.Popen | None = None  # the server, its child
        self._server_oom_kills = _proc.oom_kills()  # when the server it started last started
        self._reported: set[tuple[int, int]] = set()  # (learner entry, pid) reported dead or hung
        self._stopped_it = False  # this supervisor's own stop (every launched learner done) is the job's
        self.checkpoints = 0
        self._failing = ""  # why the last checkpoint failed, until one is written again
        self._deaths: list[tuple[float, int]] = []  # (monotonic time, learner number) of recent deaths
        self.region: Region | None = None
        self.stop_asked = False  # a stop was asked of it (`ask_stop`), not yet taken
        self.stopped = False  # it stopped the job on a stop asked before training ended
        self.finished = False  # the job stopped because every launched learner finished
        self.server_code: int | None = None  # the exit code of the server it started, at the job's end
        self.reason = ""  # why the job ended, when it did not end well
        self.note = ""  # what else the job's end should say ("the stop came after training ended")
        self.first_applied = 0.0  # when a server it started applied the job's first gradient (a restart's record)

    def ask_stop(self) -> None:
        """A stop asked of the job (a signal handler calls this): taken at the next look."""
        self.stop_asked = True

    # ------------------------------------------------------------------ its life

    def run(self) -> int:
        """Supervise until the job stops (0, or LEARNERS_FAILED) or its server is dead for good
        (SERVER_DEAD), or failed (JOB_FAILED)."""
        checkpoint.import_torch_now()  # beside the job's start, so that its first checkpoint comes `every` s in
        try:
            if not self._start_server():
                self.learners.kill_all()
                return 0 if self.stopped else SERVER_DEAD  # stopped as it started: nothing went wrong
            try:
                self.region = Region.attach(self.job)
                self._register()
            except GadeiError as err:
                self.reason = f"the job's region cannot be attached: {err}"
                self._stop_server(kill=True)
                raise
            return self._watch()
        finally:
            remove_state(self.job)

    def server_ended(self):
        """The last server's stop record (`gadei.server_record.StopRecord`), once it ended; else None."""
        return read_stop_record(self.stop_record)

    def _register(self) -> None:
        """In the region of the server it started: its pid, start time and heartbeat."""
        h = self.region.header
        h.set("supervisor_start", _proc.start_time())  # before the pid: a reader never pairs ours with another's
        h.set("supervisor_beat", time.monotonic_ns())
        h.set("supervisor_pid", os.getpid())
        log.info("job %r: supervisor watching; checkpoints every %g s to %s%s", self.job, self.settings.every,
                 self.settings.checkpoint_dir,
                 f"; {len(self.learners.table)} learners launched" if self.learners.table else "")

    def _save(self) -> None:
        try:
            save_state(self.job, asdict(self.settings), self.learners.table)
        except OSError as err:
            log.warning("job %r: cannot save the supervisor's record (for gadei status): %s", self.job, err)

    # ------------------------------------------------------------------ the loop

    def _watch(self) -> int:
        next_checkpoint = Deadline(self.settings.every)
        self.learners.start_all()
        self._save()
        stopping = False
        try:
            while True:
                h = self.region.header
                h.set("supervisor_beat", time.monotonic_ns())
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
                    if not self.stopped and self._restart_server():
                        next_checkpoint.restart()
                        stopping = False  # the learners go on from the checkpoint: stop when they are done again
                        continue
                    self.learners.kill_all()
                    if self.stopped:  # it was stopping, or was asked to as it restarted: the job stops here
                        self.note = self.note or f"the server {problem} as the job stopped"
                        return 0
                    self.reason = f"the server {problem} and was not restarted (see its log in {self.log_dir})"
                    log.error("job %r: go on from the last checkpoint with `gadei serve %s --replace --resume %s "
                              "...`", self.job, self.job, self.settings.checkpoint_dir)
                    return SERVER_DEAD
                self._look_at_learners()
                if state == SERVING:
                    self._supervise()
                    if self._look is not None and not stopping:
                        self._look(self.region)
                if not stopping and state == SERVING:
                    if self.stop_asked and not self.learners.finished:
                        self._supervise()  # a look now: the stop may have come after the last look, as they finished
                    if self.learners.finished:  # a stop asked now comes after training ended: nothing to stop
                        stopping = True
                        if self.stop_asked:
                            self.note = "the stop came after training ended"
                            log.info("job %r: a stop came after every launched learner finished: the job is done",
                                     self.job)
                        self._stop_job()
                    elif self.stop_asked:
                        stopping = True
                        self._take_stop()
                if state == SERVING and next_checkpoint.expired() and not stopping:
                    self.checkpoint()
                    next_checkpoint.restart()
                # a learner's exit ends the pause; a job told to stop is looked at again soon
                self.learners.pause(min(0.05, self.settings.interval) if stopping or state == STOPPING or
                                    self.stop_asked else self.settings.interval)
        finally:
            h = self.region.header
            if h.get("supervisor_pid") == os.getpid():
                h.set("supervisor_pid", 0)
            self.region.close()

    def stop(self, why: str) -> None:
        """Stop the job now, as it is (a job file's supervisor, on a diverged loss: `why`)."""
        log.error("job %r: %s; stopping the job", self.job, why)
        self.stopped = True
        RunState(self.region).request_stop()

    def _take_stop(self) -> None:
        """A stop asked while training goes on: a checkpoint that records how far each launched
        learner got (so that `--resume` goes on from it), then the job's stop."""
        self.stopped = True
        log.info("job %r: stopping the job, as asked", self.job)
        if self.learners.table:
            for _ in range(5):
                try:
                    taken = checkpoint.take(self.region, self.settings.checkpoint_dir, keep=self.settings.keep,
                                            progress=self.learners.progress)
                    log.info("job %r: checkpoint %s at version %s records the learners' progress", self.job,
                             taken.path.name, f"{taken.version:,}")
                    self.checkpoints += 1
                    break
                except GadeiError as err:  # another checkpoint holds the server, a slow pause: try again
                    log.warning("job %r: checkpoint before stopping: %s", self.job, err)
                    time.sleep(0.2)
        RunState(self.region).request_stop()

    def _ended(self) -> int:
        log.info("job %r stopped; the supervisor ends after %d checkpoints", self.job, self.checkpoints)
        self.finished = self.region.header.get("finished") == 1
        self.learners.reap(timeout=30.0, region=self.region)
        self.server_code = wait_or_kill(self._server, 60.0, f"job {self.job!r}: the server")  # its last checkpoint
        if self.learners.failed:
            log.error("job %r ended without learners %s (given up)", self.job, self.learners.failed)
            errors = "".join(f"; learner {learner.number}'s last error: {learner.error}"
                             for learner in self.learners.table if learner.failed and learner.error)
            self.reason = (f"the supervisor gave up on launched learners {self.learners.failed}: they died "
                           f"{self.settings.max_restarts + 1} times within {self.settings.window:g} s{errors} "
                           "(see their logs)")
            return LEARNERS_FAILED
        return 0

    def _failed(self) -> int:
        """The server stopped the job as failed: final. No checkpoint, no restart; the launched
        learners are stopped (they would only wait for a server that will not come back)."""
        why = RunState(self.region).reason() or "see the server's log; the newest checkpoint is from before"
        self.reason = f"the server stopped the job as failed: {why}"
        log.error("job %r: %s; not restarting it, no checkpoint taken; the newest checkpoint in %s (version %s) is "
                  "from before the failure", self.job, self.reason, self.settings.checkpoint_dir,
                  f"{self.region.header.get('checkpointed_version'):,}")
        self.learners.kill_all()
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
        if (died and len({n for _, n in self._deaths}) > 1
                and not any(learner.running for learner in self.learners.table)):
            log.warning("job %r: all launched learners died; checkpointing the server's weights before they go on",
                        self.job)
            self.checkpoint()
        if changed:
            self._save()

    def checkpoint(self) -> None:
        """Take and write one checkpoint now; a failure is logged (an error once, while the same
        one repeats: a full disk stays full) and the next one tried later."""
        try:
            checkpoint.take(self.region, self.settings.checkpoint_dir, keep=self.settings.keep,
                            progress=self.learners.progress if self.learners.table else None)
        except GadeiError as err:
            again, self._failing = str(err) == self._failing, str(err)
            (log.info if again else log.error)("job %r: no checkpoint this time%s: %s", self.job,
                                               " either" if again else "", err)
            return
        if self._failing:
            log.warning("job %r: checkpoints are written again", self.job)
            self._failing = ""
        self.checkpoints += 1

    # ------------------------------------------------------------------ the server

    def _start_server(self) -> bool:
        """Start the server with `restart`'s arguments, its child; True once it serves. A stop
        asked meanwhile is passed on (it stops once it serves, or before: it writes nothing); one
        asked before it started, it is not started at all."""
        if self.stop_asked:
            self.stopped = True
            log.info("job %r: stopped before its server started", self.job)
            return False
        command = _proc.gadei_command(*self.settings.server, "--no-supervisor", "--stop-record", self.stop_record)
        return self._serve(command, "starting the server", learners=True)

    def _serve(self, command: list[str], doing: str, learners: bool = False) -> bool:
        """Run `command` (a server) as this supervisor's child and wait until it serves (True), or
        it ended (False: `reason` says why). `learners`: the launched learners start beside it, not
        after it (they wait for its region), so that neither waits for the other to start."""
        os.makedirs(self.log_dir, exist_ok=True)
        server_log = os.path.join(self.log_dir, "server.log")
        before = self.server_ended()  # the last server's (a restart's): this one writes its own
        if before is not None:
            self.first_applied = self.first_applied or before.first_applied
        try:
            os.unlink(self.stop_record)
        except FileNotFoundError:
            pass
        self._server_oom_kills = oom_kills = _proc.oom_kills()
        env = {**self.env, **restarts_env(self._restarts)}
        proc = self._server = spawn(command, log=server_log, env=env, held=True)
        log.info("job %r: %s (pid %d, %s); its output goes to %s", self.job, doing, proc.pid, started_as(proc),
                 server_log)
        if learners:
            self.learners.start_all()
        deadline = Deadline(SERVE_WITHIN)
        passed_on = False
        while True:
            found = inspect(self.job)
            if found is not None and found.state == "running" and found.server_pid == proc.pid and not passed_on:
                return True
            if self.stop_asked and not passed_on:  # it takes this once it serves, or stops before it does
                passed_on = True
                self.stopped = True
                proc.send_signal(signal.SIGTERM)
            if proc.poll() is not None:
                record = self.server_ended()
                if passed_on:
                    self.reason = ""
                elif record is not None and record.reason:
                    self.reason = f"the server did not start: {record.reason}"
                else:
                    self.reason = f"the server {_proc.how_it_ended(proc.returncode, oom_kills)} (see {server_log})"
                if not passed_on:
                    log.error("job %r: %s", self.job, self.reason)
                return False
            if deadline.expired():
                self.reason = f"the server did not serve within {SERVE_WITHIN:g} s (see {server_log})"
                log.error("job %r: %s", self.job, self.reason)
                wait_or_kill(proc, 0, f"job {self.job!r}: the server")
                return False
            time.sleep(0.02)

    def _stop_server(self, kill: bool = False) -> None:
        if self._server is not None and self._server.poll() is None:
            self._server.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            wait_or_kill(self._server, 60.0, f"job {self.job!r}: the server")

    def _server_problem(self) -> str | None:
        h = self.region.header
        if not _proc.alive(h.get("server_pid"), h.get("server_start")):
            return f"pid {self._server.pid} {_proc.how_it_ended(self._server.poll(), self._server_oom_kills)}"
        silent = (time.monotonic_ns() - h.get("server_beat")) / 1e9
        if (silent > self.settings.interval * self.settings.max_missed
                and RunState(self.region).get() in (SERVING, STOPPING)):
            return f"pid {h.get('server_pid')} has not beaten for {silent:.1f} s (hung)"
        return None

    def _restart_server(self) -> bool:
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
        wait_or_kill(self._server, 10.0, f"job {self.job!r}: the server")  # reap the one it started before
        self.learners.kill_all()
        folder = self.settings.checkpoint_dir
        # the learners go on from the progress a checkpoint records: the newest that records it
        found = checkpoint.latest(folder, with_progress=bool(self.learners.table))
        args = [*self.settings.server, "--replace"] + (["--resume", str(found.path)] if found else [])
        self._restarts = [*recent, now]
        command = _proc.gadei_command(*args, "--no-supervisor", "--stop-record", self.stop_record)
        doing = "restarting the server " + (f"from checkpoint version {found.version:,}" if found else
                                           "from its initial weights (no checkpoint yet)")
        log.warning("job %r: %s", self.job, doing)
        if not self._serve(command, doing):
            return False
        # A `gadei stop` that the dead server had not finished is the new server's too (the
        # supervisor's own stop is not: its learners go on from the checkpoint and finish again).
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
