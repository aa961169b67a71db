"""`gadei run job.toml`: one job from its job file, in the foreground, with a live progress line.

Everything that can be wrong with the job file and its data is found before anything
starts (`gadei.jobfile`). Then the job runs as `gadei serve` with a watchdog that launches
the learners (`--learner`), so a crashed learner or server is restarted from its last
checkpoint (docs/fault-tolerance.md). The output folder gets:

    job.toml        the job as run, with the defaults filled in (its processes read this one)
    labels.json     label names, index = the model's output
    vocab.json      the vocabulary (`gadei_workloads.text.Vocab.from_json` reads it); numeric
                    workloads: features.json (feature count, training mean and std)
    model.pt        the model chosen on the validation set (the best of learner 0's evaluations,
                    see gadei.selection), a state dict plain `torch.load(weights_only=True)` reads
    result.json     the job's outcome (done, stopped, failed, diverged, and why), which evaluation
                    chose model.pt (epoch, version, validation accuracy and loss), its test accuracy
                    (evaluated on the whole test set at the end), why training stopped (patience,
                    cap, cancelled), its seconds (a resumed run's also with the runs it resumed,
                    where they are known) and the chosen model's, since the job's start (one
                    time base: `gadei.outputs`); written by whoever sees the job end
                    (`gadei.outputs.conclude`)
    metrics.jsonl   one JSON line per epoch of learner 0: loss, train accuracy (its own mini-batches,
                    with dropout, as it trained), validation loss and accuracy, test accuracy,
                    samples/s, seconds (the epoch's, and since the job's start to its evaluation),
                    and the staleness of the job's gradients (mean over the epoch, max so far)
    accuracy.png    validation and test accuracy against epochs and against seconds since the
                    job's start, the chosen model
    checkpoints/    crash-safe checkpoints, the last `keep`; best.pt and best.json, the model
                    selection (gadei.selection)
    logs/           the server's and watchdog's log (serve.log) and each learner's
    events.out.tfevents.*  TensorBoard's event files, written as the job runs (`gadei.board`;
                    with TensorBoard installed)

Across nodes: a job with a [bridge] section started as `mpiexec -n NODES gadei run job.toml`
runs on each rank as that node's job (`BridgedRun`): job `<name>-r<rank>`, output folder
`<folder>/node-<rank>` (the files above, and node.json: the node, the node count and its
learners' shards; logs/bridge.log: the bridge's JSON lines; result.json's "bridge": what it
did), one ring more than learners for the bridge, which this process runs in a thread
once its job serves, and learner i trains shard rank*L + i of NODES*L.
"""

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import _proc, device, jobfile, outputs
from .board import Board
from .console import last_error
from .custody import adopt
from .env import learners_openmp_env
from .prepare import RUN, Prepared, describe, go_on, prepare
from ._proc import gadei_command
from .bridge.run import BridgedRun
from .errors import GadeiError

log = logging.getLogger(__name__)


def run_job(path: str, *, quiet: bool = False, resume: bool = False, by: str = RUN,
            asked: list[int] | None = None) -> int:
    """Run the job file at `path` to its end; 0 when it finished and wrote its model.
    `resume`: go on with the run its output folder holds (see `resume_point`). `by`: the
    command that started the job (`gadei.prepare.RUN`, or `SUBMIT` for the daemon's),
    which what the run says to go on with it names. `asked`: the stops (signal numbers) asked
    for since this process took them (`launch.take_stops`, `gadei run`'s first step), taken
    once the job is prepared (see `JobRun`).

    A job with a [bridge] section started as more than one MPI rank (`mpiexec -n NODES gadei
    run job.toml`) runs as node `rank` of NODES (`BridgedRun`); alone, or as one rank, it runs as
    any job on one node."""
    job = jobfile.load(path)
    node = BridgedRun.launched(job)
    if node is None:
        return JobRun(prepare(job, resume, None, by), quiet, asked=asked).run()
    return node.end(JobRun(node.prepare(job, resume), quiet, node, asked).run())


class JobRun:
    """One job's life on this node, from its prepared job (`gadei.prepare`) to its outcome:
    launch (server, watchdog, learners; a bridged node's bridge), follow (the progress line,
    through server restarts and a watchdog's death), finish (`outputs.conclude`: metrics, plot,
    result.json), report (the exit code). `gadei run` runs one; the daemon runs `gadei run`;
    a bridged node's runs with its bridge (`BridgedRun`).

    The job ends when its server process has exited and its watchdog has recorded the end
    (`outputs.END`) with no server of the job left running. A server that dies is the
    watchdog's to restart: the run follows the restarted one. A watchdog that dies (gone
    without an end record) is replaced within WATCHDOG_GRACE seconds (`gadei serve --adopt`,
    which takes over its launched learners); when that fails, the job is stopped and failed
    with the reason. This process holds the run's lock (`outputs.Owner`) throughout, so the
    watchdog leaves the outputs to it; killed, it lets go, and the watchdog writes them (killed
    with the watchdog, the server's custody has a new one adopt the job: `gadei.custody`).

    A stop (SIGTERM: `gadei cancel`; SIGINT: Ctrl-C) is never a death of this process: one asked
    for before the job is launched (`asked`, from `gadei run`'s start: `launch.take_stops`) is
    taken before the server would start, which then does not (result.json says stopped before
    the job wrote a model); one asked for while it launches is taken once it is launched (its
    server, started with the stops held, takes this run's SIGTERM whenever it comes:
    `launch.spawn(held=True)`); later ones stop the job in order (`_follow_and_finish`), taken
    by the loop that follows the job, within 0.25 s (or once `ended` has had a new watchdog
    take over, where the job's died: `_adopt`). The handler only records a stop: a
    KeyboardInterrupt raised from it lands in whatever code runs, and one that lands in an
    exec'd string (dataclasses make their methods so, in an import) leaves CPython's flag for an
    unhandled interrupt set even once caught, so this process exited -2 after writing
    result.json."""

    def __init__(self, prepared: Prepared, quiet: bool, node: "BridgedRun | None" = None, asked: list[int] | None = None):
        self.prepared, self.quiet, self.node = prepared, quiet, node
        self.asked = asked  # None: this run takes the stops itself (`run`)
        self.job = prepared.job
        self.serve: subprocess.Popen | None = None
        self.oom_kills: int | None = None  # `_proc.oom_kills()` when it started the server
        self.dog: tuple[int, float] | None = None  # the watchdog's pid and start time, as the region names it
        self.server: tuple[int, float] | None = None  # the job's server, as the region names it
        self.note = ""  # what went wrong that no end record will say
        self.stopped = False  # this run stopped the job (`_stop`)
        self._said_restart = False
        self._tried: tuple[int, float] | None = None  # the dead watchdog this run last had a new one take over from

    def run(self) -> int:
        job, node = self.job, self.node
        out = job.output
        for line in describe(self.prepared, node):
            print(line, flush=True)
        if self.asked is None:
            from .launch import take_stops

            self.asked = []
            take_stops(lambda sig, _frame: self.asked.append(sig))
        owner = outputs.Owner(out)
        self.board = Board(out, job, warn=lambda line: print(line, file=sys.stderr, flush=True))
        try:
            if self.asked:  # before anything started: nothing to stop, nothing to wait for
                return self._finish(owner, interrupted=True, started=time.monotonic())
            self.oom_kills = _proc.oom_kills()
            self.serve = self.launch()
            return self._follow_and_finish(owner)
        finally:
            self.board.epochs(outputs.epoch_records(out))  # those reported after the last look (or a stop)
            self.board.close()
            owner.close()

    def launch(self) -> subprocess.Popen:
        """Start `gadei serve` with the watchdog and learners of this job (and the node's ring)."""
        job, node, found = self.job, self.node, self.prepared.found
        out, t = job.output, job.train
        as_run = str(out / "job.toml")
        learner = ["--job-file", as_run, "--json"]  # the job as run: workload, data, seed, epochs, batch
        rings = t.learners + (1 if node is not None else 0)  # a bridged node's bridge takes a ring of its own
        command = [*gadei_command("serve", job.name), "--job-file", as_run, "--learners", str(rings),
                   "--checkpoint-dir", str(out / "checkpoints"), "--log-dir", str(out / "logs"),
                   "--save", str(out / "model.pt"), "--outputs", str(out), "--json"]
        command += ["--lr", str(node.lr(job))] if node is not None else []  # a node's own rate (BridgedRun.lr)
        command += ["--resume", str(found.path)] if found is not None else []
        shards = node.shards(t.learners) if node is not None else [f"{i}/{t.learners}" for i in range(t.learners)]
        devices = device.spread(tuple(t.devices.split(",")), t.learners)
        if set(devices) != {"cpu"}:
            print("  learners' devices: " + ", ".join(f"{i}: {d}" for i, d in enumerate(devices)), flush=True)
        # Learner 0 evaluates and decides for the job (patience: the job file's); a bridged node's
        # does not choose (the nodes' model is the one their bridge agrees on; they stop at the cap).
        chooses = node is None and self.prepared.validation is not None  # validation_holdout = 0: nothing to choose on
        evaluates = ["--eval"] + (["--validate", "--best", str(out / "checkpoints")] if chooses else [])
        for i, shard in enumerate(shards):
            extra = ["--shard", shard, "--entry", str(i)] + (evaluates if i == 0 else []) + (["--device", devices[i]]
                                                                          if devices[i] != "cpu" else [])
            command.append("--learner=" + " ".join(shlex.quote(a) for a in [*learner, *extra]))
        # In a session of its own, as the watchdog and the learners are: a terminal's Ctrl-C, or the
        # daemon's SIGTERM to this process's group (`gadei cancel`), reaches this process alone,
        # which stops the job in order (`_follow_and_finish`: the checkpoint that records the
        # learners' progress, then the server); a server that took the signal too would stop
        # before that checkpoint, which then records nothing (or is never taken).
        from .launch import spawn

        return spawn(command, log=out / "logs" / "serve.log", env=self.environment(), held=True)

    def environment(self) -> dict[str, str]:
        """The environment of the job's processes: `gadei serve` and, through it, the watchdog
        and the learners it starts; and a new watchdog that takes over (`_adopt`), whose
        restarted learners must run as the first ones did. Learners' threads that over-subscribe
        the cores sleep between PyTorch's parallel regions (`env.learners_openmp_env`)."""
        t = self.job.train
        return {**(self.node.child_environment() if self.node is not None else os.environ),
                **learners_openmp_env(t.learners, t.learner_threads)}

    def _follow_and_finish(self, owner: outputs.Owner) -> int:
        job, node, serve = self.job, self.node, self.serve
        out = job.output
        started = time.monotonic()
        bridge = node.start_bridge(job, serve) if node is not None else None
        train_size = len(self.prepared.train) / (node.size if node is not None else 1)
        threading.Thread(target=outputs.load_plotting, name="gadei-load-plotting", daemon=True).start()
        try:
            if self.asked:  # while it launched (or its bridge started)
                raise _StopAsked
            _follow(self, train_size, started, self.quiet, f"node {node.rank}: " if node is not None else "")
        except _Diverged:
            print(f"\ngadei run: job {job.name}: the training loss is not finite; stopping the job", file=sys.stderr,
                  flush=True)
            self._stop()
            interrupted = True
        except _StopAsked:
            _ignore_stops()  # one stop is enough: a second must not cut this one (or the outputs) short
            # The watchdog may have recorded the job's end before this run saw it (it looks every
            # 0.25 s): a job that had ended on its own was not stopped, whatever came now.
            interrupted = outputs.read_ending(out) is None
            if interrupted:
                print(f"\ngadei run: stopping the job {job.name}", flush=True)
                taken = checkpoint_progress(job, self.prepared.found.progress if self.prepared.found else {})
                if taken is not None:
                    print(f"gadei run: checkpoint {taken.path.name} at version {taken.version:,} (resume with "
                          f"{go_on(job, self.prepared.by)})", flush=True)
                self._stop()
        else:
            interrupted = False
        # The job is stopping, or ended: let it finish, and write its outputs whatever comes now,
        # to this process's end. A Ctrl-C here would end this process without result.json, which
        # no one else writes (the watchdog left the outputs to this run, whose lock it saw held),
        # and `--resume` would then find no run that finished.
        _ignore_stops()
        while not self.ended():  # an interrupted job stopping, or one that ended before this run saw it
            time.sleep(0.2)
        if bridge is not None:
            node.stop_bridge(bridge, out / "model.pt", private=job.private)
        return self._finish(owner, interrupted, started, bridge)

    def _finish(self, owner: outputs.Owner, interrupted: bool, started: float, bridge=None) -> int:
        """The job ended (or never started): its outputs (`outputs.conclude`), and the exit code."""
        _ignore_stops()
        node = self.node
        result = outputs.conclude(self.job.output, job=self.job, owner=owner, interrupted=interrupted, note=self.note,
                                  bridge=node.summary(bridge) if node is not None and bridge is not None else None)
        return report(self.job, result, time.monotonic() - started, self.prepared.by)

    def _stop(self) -> None:
        """Stop the job: its server (ours, or the one its watchdog restarted) stops as on `gadei stop`."""
        self.stopped = True
        if self.serve.poll() is None:
            self.serve.send_signal(signal.SIGTERM)
            return
        from .launch import stop_job

        try:
            stop_job(self.job.name, timeout=60)
        except GadeiError as err:
            log.warning("stopping job %s: %s", self.job.name, err)

    def ended(self) -> bool:
        """One look at the job: True once it ended. Replaces a dead watchdog (`_adopt`)."""
        from .region import inspect

        code = self.serve.poll()
        self._look()
        ending = outputs.read_ending(self.job.output)
        found = inspect(self.job.name)
        serving = found is not None and found.state in ("running", "starting") and _proc.alive(*self.server) \
            if self.server else found is not None and found.state in ("running", "starting")
        dog_alive = self.dog is not None and _proc.alive(*self.dog)
        if ending is not None:
            return code is not None and not serving
        how = _proc.how_it_ended(code, self.oom_kills) if code is not None else ""
        if code is not None and not serving and not dog_alive:
            if code == 0 and not self.note and self._learners_done():  # not when this run stopped it (note)
                outputs.record_end(self.job.output, outputs.Ending(
                    0, True, "every learner finished (its watchdog died before it recorded the end)"))
                return True
            if self.dog is None and code == 0 and self.stopped:
                pass  # this run stopped its server before it had a watchdog (it launched none): a stop
            elif self.dog is None or code == 0:
                said = last_error(self.job.output / "logs" / "serve.log")  # a refusal before it served
                self.note = self.note or f"the server {how} without a watchdog" + (f": {said}" if said else "")
            else:
                self.note = self.note or (f"the server {how} and its watchdog (pid {self.dog[0]}) is gone "
                                          "without saying how the job ended")
            return True
        if code is not None and code != 0 and not self._said_restart:
            self._said_restart = True
            print(f"\ngadei run: job {self.job.name}: the server {how}; its watchdog restarts it from the "
                  "last checkpoint", file=sys.stderr, flush=True)
        if self.dog is not None and not dog_alive and serving and self.dog != self._tried:
            self._adopt()
        return False

    def _learners_done(self) -> bool:
        """Whether every launched learner finished its schedule, for a job whose watchdog died
        between stopping it and recording its end: the server's stop record (serve.log) holds
        as many applied gradients as the learners' whole schedules have mini-batches (each is
        applied once, restarts included), or the newest checkpoint that records the learners'
        progress says each one is done."""
        from . import checkpoint

        if self.node is None and self.job.train.mode != "sync":
            n, t = len(self.prepared.train), self.job.train
            steps = t.epochs * sum(-(-len(range(k, n, t.learners)) // t.batch) for k in range(t.learners))
            stops = [line for line in _lines(self.job.output / "logs" / "serve.log") if '"event": "stopped"' in line]
            try:
                if stops and json.loads(stops[-1])["applied_total"] == steps:
                    return True
            except (ValueError, KeyError, TypeError):
                pass
        found = checkpoint.latest(self.job.output / "checkpoints", with_progress=True)
        return (found is not None and len(found.progress) >= self.job.train.learners
                and all(v == "done" for v in found.progress.values()))

    def _look(self) -> None:
        """Who the region names as the job's server and watchdog (they change on a restart, an adoption)."""
        from .region import Region

        try:
            with Region.attach(self.job.name, readonly=True) as region:
                h = region.header
                server = (h.get("server_pid"), h.get("server_start"))
                dog = (h.get("watchdog_pid"), h.get("watchdog_start"))
        except GadeiError:
            return
        if server[0]:
            self.server = server
        if dog[0]:
            self.dog = dog

    def _adopt(self) -> None:
        """The watchdog died with the job running: a new one takes over (`gadei serve --adopt`),
        or the job stops, failed, with the reason; not when another adopter's watchdog watches it
        now or the job no longer serves (`custody.adopt`): then no takeover was needed. Once per
        dead watchdog (`_tried`)."""
        dead = self.dog[0]
        print(f"\ngadei run: job {self.job.name}: its watchdog (pid {dead}) died; starting a new one that takes over "
              "its learners", file=sys.stderr, flush=True)
        self._tried = self.dog
        adopted, reason = adopt(self.job.name, self.environment())
        if adopted:  # a new watchdog watches the job, or the job no longer serves: nothing to take over
            print(f"gadei run: job {self.job.name}: {reason}", file=sys.stderr, flush=True)
            self._look()
            return
        self.note = f"its watchdog (pid {dead}) died and no new one could take over: {reason}"
        print(f"gadei run: job {self.job.name}: {self.note}; stopping the job", file=sys.stderr, flush=True)
        self.dog = None
        self._stop()


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def report(job: jobfile.Job, result: dict, elapsed: float, by: str = RUN) -> int:
    """Print the job's outcome (result.json, whoever wrote it); `gadei run`'s exit code. `by`:
    the command that started the job, which a stopped run's line names to go on with it;
    `elapsed`: this run's seconds, said only where result.json has none."""
    out = job.output
    accuracy = f", test accuracy {result['test_accuracy']:.2%}" if "test_accuracy" in result else ""
    # result.json's seconds, the job's time base (`gadei.outputs`): as "reached after" counts
    seconds = result["seconds"] if isinstance(result.get("seconds"), (int, float)) else elapsed
    took = f"{seconds:.0f} s" + (f" ({result['seconds_in_all']:.0f} s with the runs it resumed)"
                                 if isinstance(result.get("seconds_in_all"), (int, float)) else "")
    kind = result.get("outcome")
    if kind == outputs.DIVERGED:
        print(f"gadei run: job {job.name}: {result['reason']}; its outputs and logs are in {out}", file=sys.stderr,
              flush=True)
        return DIVERGED
    if kind == outputs.FAILED:
        print(f"gadei run: job {job.name} failed: {result['reason']}; see {out / 'logs'}", file=sys.stderr,
              flush=True)
        return 1
    # the chosen model (`gadei.outputs.chosen`): its time in the job's time base too
    best = (f"epoch {result['epoch']:g} (validation accuracy {result['validation_accuracy']:.2%}"
            + (f", reached after {result['seconds_to_best']:.0f} s" if "seconds_to_best" in result else "") + ")"
            if "epoch" in result else "")
    if kind == outputs.STOPPED:
        last = outputs.last_epoch(out)
        if not (out / "model.pt").exists():
            model = "before it wrote a model"
        else:
            model = (f"the model chosen so far, {best}, is in" if best else "its weights so far are in") + \
                f" {out / 'model.pt'}"
        print(f"gadei run: job {job.name} stopped after {took} (epoch {last.get('epoch', 0)} of "
              f"{job.train.epochs}{accuracy}); {model}; {_again(job, by)}", flush=True)
        return 130  # as a shell reports a Ctrl-C'd command
    chose = (f", stopped by {result['stopped']}" if "stopped" in result else "") + (f", chose {best}" if best else "")
    print(f"gadei run: job {job.name} done in {took}{chose}{accuracy}; model {out / 'model.pt'}", flush=True)
    return 0


def _again(job: jobfile.Job, by: str) -> str:
    """How to go on with a stopped run, as its output folder allows: `--resume` from a checkpoint
    that records the learners' progress, or, stopped before any was taken (while it started),
    the same command again, which a folder without checkpoints takes (`prepare.check`)."""
    from . import checkpoint

    folder = job.output / "checkpoints"
    if checkpoint.latest(folder, with_progress=True) is not None:
        return f"go on with {go_on(job, by)}"
    if not (folder.is_dir() and any(folder.iterdir())):
        return "it had not started training; start it again with " + (f"`{by} {job.path}`" if job.path else
                                                                       "the same command")
    return (f"no checkpoint in {folder} records the learners' progress, so there is nothing to go on with; remove "
            "that folder to start it again")


class _StopAsked(Exception):
    """A stop (SIGTERM: `gadei cancel`; SIGINT: Ctrl-C) was asked of this run (`JobRun.asked`)."""


def _ignore_stops() -> None:
    """From here on a stop (SIGTERM, SIGINT) is ignored: the job is stopping or ended, and this
    process writes its outputs to the end."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def checkpoint_progress(job: jobfile.Job, start: dict | None = None, attempts: int = 5):
    """Before a stop: a checkpoint that records how far each launched learner got (from the
    watchdog's saved table and the learners' rings, under the server's hold), so that
    `gadei run --resume` goes on from here; the server's own stop checkpoint cannot say.
    Taken by `gadei run` on Ctrl-C (and so on `gadei cancel`), and by the daemon when it
    cancels a job whose `gadei run` is gone. `start`: where each learner started (a resumed
    run's checkpoint's progress; {}: at the beginning), what the checkpoint records of a job
    that serves but whose watchdog has not yet saved its table (it saves it as it launches the
    learners: none has trained yet); None: no checkpoint then. The checkpoint, or None when
    there was no job (or no watchdog, without `start`) to take it from, or every attempt failed."""
    from . import checkpoint
    from .region import Region
    from .watchdog_record import load_state, progress

    try:
        region = Region.attach(job.name)
    except GadeiError:
        return None  # no job (yet, or no more): nothing to record
    try:
        _, table = load_state(job.name)
    except FileNotFoundError:
        if start is None:
            region.close()
            return None
        table = None
        at = {str(i): start.get(str(i), 0) for i in range(job.train.learners)}
    with region:
        for _ in range(attempts):
            try:
                return checkpoint.take(region, job.output / "checkpoints", keep=job.checkpoint.keep,
                                       progress=lambda ckpt: progress(table, ckpt) if table is not None else at)
            except checkpoint.CheckpointError as err:  # e.g. the watchdog's is being taken: try again
                log.warning("checkpoint before stopping: %s", err)
                time.sleep(0.2)
    return None


def _follow(run: JobRun, train_size: float, started: float, quiet: bool, label: str = "") -> None:
    """Print a progress line every 2 s until the job ends (`JobRun.ended`): epochs done (updates x
    mini-batch over the training set, or a bridged node's share of it), the last evaluated
    epoch's loss and accuracy, samples/s and updates/s (over the last 2 s, from the same count
    of applied updates as the epochs, so a learner's restart or its leaving does not zero it),
    version, ETA. On a terminal the line is rewritten in place, unless `label` (a bridged
    node's, which starts its lines) says that other ranks write to the same terminal (mpiexec
    gives each rank one). The same figures and every epoch record go to the job's TensorBoard
    event files (`gadei.board`), `quiet` or not."""
    job = run.job
    overwrite = sys.stdout.isatty() and not label
    from .region import Region
    from .status import read

    total = job.train.epochs * train_size
    # patience may end training before the epoch cap, which the ETA counts to: say so
    sooner = run.prepared.validation is not None and not label and patience_may_stop(job.train, train_size)
    cap = " at the epoch cap (patience may stop it sooner)" if sooner else ""
    before = None  # (monotonic seconds, version) of the last line
    width = 0
    next_line = time.monotonic() + 2.0
    board = run.board
    while not run.ended():
        time.sleep(0.25)
        if run.asked:  # a stop (SIGTERM, SIGINT), recorded by its handler: taken here, between two looks
            raise _StopAsked
        records = outputs.epoch_records(job.output)
        board.epochs(records)
        epoch = records[-1] if records else {}
        diverged = _diverged(job, [epoch])
        if diverged is not None:
            raise diverged
        if time.monotonic() < next_line:
            continue
        next_line = time.monotonic() + 2.0
        try:
            with Region.attach(job.name, readonly=True) as region:
                status = read(region)
        except GadeiError:
            continue
        version = status.version
        now = (time.monotonic(), version)
        if before is None or version < before[1]:  # the first look, or a server restarted from an older checkpoint
            before = now
            continue
        updates_per_s = (now[1] - before[1]) / max(1e-9, now[0] - before[0])
        samples_per_s = updates_per_s * job.train.batch
        board.live(version, {"samples_per_s": samples_per_s, "updates_per_s": updates_per_s,
                             "restarts": status.restarts,
                             "learners_alive": sum(1 for l in status.learners if l.alive)})
        before = now
        if quiet:
            continue
        done = min(total, version * job.train.batch)
        left = (total - done) / samples_per_s if samples_per_s > 0 else float("nan")
        line = (f"  {label}epoch {done / train_size:.2f}/{job.train.epochs}"
                + (f"; after epoch {epoch['epoch']}: loss {epoch['loss']:.3f}" if "loss" in epoch else "")
                + (f", test accuracy {epoch['test_accuracy']:.1%}" if "test_accuracy" in epoch else "")
                + f", {samples_per_s:,.0f} samples/s, {updates_per_s:,.0f} updates/s, version {version:,}"
                + (f", ETA {left:.0f} s{cap}" if left == left and done < total else "")
                + f", {time.monotonic() - started:.0f} s")
        if overwrite:
            print("\r" + line.ljust(width), end="", flush=True)
            width = len(line)
        else:
            print(line, flush=True)
    if overwrite:
        print(flush=True)


def patience_may_stop(train: jobfile.Train, samples: float) -> bool:
    """Whether patience can end a validated job's training before its epoch cap: it needs
    `patience` evaluations without improvement after the first (always the best so far), and
    one at the cap's end is no sooner. A job evaluates after each epoch, and a training set
    of more than `gadei.trainer.EVALUATE_SAMPLES` samples also within it (about once per that
    many)."""
    from .trainer import EVALUATE_SAMPLES

    per_epoch = 1 + (int(samples) // EVALUATE_SAMPLES if samples > EVALUATE_SAMPLES else 0)
    return train.patience + 1 < train.epochs * per_epoch


DIVERGED = 3  # `gadei run`'s exit code when the training loss became NaN or infinite


class _Diverged(GadeiError):
    """The evaluating learner's epoch loss is NaN or infinite: training diverged."""


def _diverged(job: jobfile.Job, metrics: list[dict]) -> _Diverged | None:
    """The first epoch of `metrics` whose loss is not finite, as the error that stops the job."""
    import math

    for record in metrics:
        loss = record.get("loss")
        if isinstance(loss, (int, float)) and not math.isfinite(loss):
            return _Diverged(f"job {job.name}: the training loss is {loss} after epoch {record.get('epoch')}: "
                             f"training diverged; the learning rate is likely too high (lr {job.train.lr:g}), "
                             "lower [train] lr")
    return None


