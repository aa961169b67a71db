"""A job file's supervisor: the one process that runs a `gadei run` (or daemon) job from its
prepared output folder (`gadei.prepare.prepare`: job.toml, maps, node.json) to its outputs.

It starts the job's server and learners as `Supervisor` does (the commands made from the job:
`server_args`, `learner_args`), follows the evaluating learner's epoch records as they come
(into the job's TensorBoard event files, `gadei.board`; a loss that is not finite stops the job),
takes a stop asked of it (SIGTERM, SIGINT) as `Supervisor` says, and at the job's end waits for
the last server's stop record (and a bridged node's bridge: `gadei.bridge.record.wait`) and
writes the job's outputs (`gadei.outputs.conclude`): the only writer of them. Its last line says
the outcome as `gadei run` does; its exit code is `gadei run`'s. A job that picks its model
(`workload = "auto"`) is its candidates' runs, one after another (`choice.Choice`, which hands
each back here to be supervised and concluded as a job of its own), then the choice's outputs.
"""

import logging
import math
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

from gadei import checkpoint, claim as claims, curves, data, device, jobfile, outputs, placement, zygote
from gadei.board import Board
from gadei.bridge import record as bridge_record
from gadei.env import learners_openmp_env, pause_at
from gadei.errors import FolderInUse, GadeiError
from gadei.launch import stop_by_pid, take_stops
from gadei.protocol import Deadline
from gadei.region import inspect, remove
from gadei.server_record import live_server
from gadei.supervisor import SERVER_DEAD, STOP_RECORD, SupervisorSettings

from .choice import Choice
from .supervisor import Supervisor

log = logging.getLogger(__name__)

LIVE_EVERY = 2.0  # seconds between the job's live figures in its event files
OUTGOING = 60.0  # seconds a server of a supervisor that died is given to stop before this one stops it
FINAL = "logs/final.pt"  # the weights the last server ended with (`gadei serve --save`)


def server_args(job: jobfile.Job, node: placement.NodeRecord | None, found=None) -> list[str]:
    """The arguments of the job's `gadei serve` (its supervisor adds --no-supervisor and --stop-record):
    the job as run, one ring more than learners on a bridged node (its bridge's), a node's rate,
    the checkpoint it resumes from (`found`)."""
    out, t = job.output, job.train
    rings = t.learners + (1 if node is not None else 0)
    args = ["serve", job.name, "--job-file", str(out / "job.toml"), "--learners", str(rings),
            "--checkpoint-dir", str(out / "checkpoints"), "--save", str(out / FINAL), "--json"]
    args += ["--lr", repr(node.lr)] if node is not None else []
    args += ["--resume", str(found.path)] if found is not None else []
    return args


def learner_args(job: jobfile.Job, node: placement.NodeRecord | None) -> list[list[str]]:
    """Each learner's arguments after `gadei learn JOB`: the job as run, its shard and entry, its
    device; learner 0 evaluates, and chooses the model on the validation set where the job has one
    and is not a bridged node's (the nodes' model is the one their bridges agree on)."""
    out, t = job.output, job.train
    shards = node.shards if node is not None else placement.Local().shards(t.learners)
    devices = device.spread(tuple(t.devices.split(",")), t.learners)
    chooses = node is None and data.has_validation(job)
    evaluates = ["--eval"] + (["--validate", "--best", str(out / "checkpoints")] if chooses else [])
    evaluates += ["--records", str(out / outputs.EPOCHS)]
    return [["--job-file", str(out / "job.toml"), "--json", "--shard", shard, "--entry", str(i)]
            + (evaluates if i == 0 else []) + (["--device", devices[i]] if devices[i] != "cpu" else [])
            for i, shard in enumerate(shards)]


class _Follow:
    """What the supervisor does at each look at a running job file's job: the evaluating learner's
    new epoch records into the event files, a loss that is not finite a stop (diverged), and
    every LIVE_EVERY seconds the job's samples/s, updates/s, restarts and learners alive."""

    def __init__(self, job: jobfile.Job):
        self.job = job
        self._board: Board | None = None
        self.supervisor: Supervisor | None = None
        self._before = None  # (monotonic seconds, version) of the last live figures
        self._next = time.monotonic() + LIVE_EVERY
        self._diverged = False

    @property
    def board(self) -> Board:
        """The job's event files, opened at the first look: after the supervisor started the job's
        processes (their writer runs a thread, and a process that runs two may not fork them:
        `gadei.zygote.can_fork`), as the plot's import is started."""
        if self._board is None:
            self._board = Board(self.job.output, self.job, warn=lambda line: log.warning("%s", line))
            threading.Thread(target=curves.load, name="gadei-load-plotting", daemon=True).start()  # the plot waits less
        return self._board

    def __call__(self, region) -> None:
        records = outputs.epoch_records(self.job.output / outputs.EPOCHS)
        self.board.epochs(records)
        for record in records:
            loss = record.get("loss")
            if isinstance(loss, (int, float)) and not math.isfinite(loss) and not self._diverged:
                self._diverged = True
                self.supervisor.stop(f"the training loss is {loss} after epoch {record.get('epoch')}: training "
                                     f"diverged (lr {self.job.train.lr:g})")
                return
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + LIVE_EVERY
            self._live(region)

    def _live(self, region) -> None:
        from gadei.status import read

        status = read(region)
        now = (time.monotonic(), status.version)
        before, self._before = self._before, now
        if before is None or now[1] < before[1]:
            return
        updates = (now[1] - before[1]) / max(1e-9, now[0] - before[0])
        self.board.live(status.version, {"samples_per_s": updates * self.job.train.batch, "updates_per_s": updates,
                                         "restarts": status.restarts,
                                         "learners_alive": sum(1 for learner in status.learners if learner.alive)})


class _Stops:
    """A stop asked of the job (SIGTERM, SIGINT: its clients pass one on), taken by the supervisor
    of the run going on (`Supervisor.ask_stop`); one asked between the candidates of a job that
    picks its model is kept, and the next one does not start. Once the job's end is decided, a stop
    changes nothing."""

    def __init__(self):
        self.asked = False
        self.supervisor: Supervisor | None = None

    def take(self, _sig, _frame) -> None:
        self.asked = True
        if self.supervisor is not None:
            self.supervisor.ask_stop()


def run(job_file: str, *, name: str | None = None, resume: bool = False, by: str = outputs.RUN,
        named: str | None = None, since: float | None = None, claim: bool = False) -> int:
    """Supervise the prepared job whose job.toml is `job_file` to its end and write its outputs;
    `gadei run`'s exit code for its outcome (`name`: the job's name, which its command line
    carries, checked against the job file's). `resume`: go on from the newest checkpoint that
    records the learners' progress (a job that picks its model: with the candidate it was
    training); `by`: the command that started the job, and `named`: the job file it started it
    from (what the job's last line says to go on with it names); `since`: when this run started
    (a supervisor that died started it; default: now); `claim`: it claims the output folder itself
    (`gadei.claim`), where none was handed to it."""
    since = since or time.time()
    job = jobfile.load(job_file)
    if name is not None and name != job.name:
        raise GadeiError(f"{job_file} holds job {job.name!r}, not {name!r}")
    if job.private:
        os.umask(0o077)  # its processes' files (checkpoints, logs) are private too (`prepare.output_modes`)
    pause_at("starting")  # a test's hold: nothing of the job started, a stop sent now waits (blocked) for the handler
    stops = _Stops()
    take_stops(stops.take)  # its clients' Ctrl-C and cancel
    zygote.warm(late=False)  # what its server and learners import, imported once here
    if resume:
        _outgoing_gone(job.name)
    _claimed = _claim(job) if claim else None  # held, by this process and those it forks, to its end
    if job.workload == jobfile.AUTO:
        choice = Choice(job, lambda candidate, found, started: _supervised(candidate, found, stops, started,
                                                                           hold=False))
        ending = choice.run(resume=resume, since=since, stopped=lambda: stops.asked)
        pause_at("concluding")  # a test's hold, as below: once, when the job's end is decided
        result = _conclude(job, ending, since=since)
    else:
        found = checkpoint.latest(job.output / "checkpoints", with_progress=True) if resume else None
        if resume and found is None:  # the supervisor before this one died before its first checkpoint
            # its client said so as it started this one (`Supervised.ended`): the log's record, not a second warning
            log.info("job %r: no checkpoint in %s records the learners' progress yet: the job starts again from its "
                     "start", job.name, job.output / "checkpoints")
            outputs.afresh(job.output)  # what the run before left is not this one's
        result = _supervised(job, found, stops, since)
    log.info("job %r: %s", job.name, result["outcome"])
    said = replace(job, path=Path(named)) if named else job
    print(f"{by}: {outputs.summary(said, result, by)}", flush=True)
    return outputs.exit_code(result)


def _conclude(job: jobfile.Job, ending: outputs.Ending, **kwargs) -> dict:
    """`outputs.conclude`: the job's outputs (where one cannot be written, a result.json that says
    so); a GadeiError where not even result.json can be (a full disk): this supervisor's last
    line, and its exit code 2 (refused), which its client does not start it again for."""
    try:
        return outputs.conclude(job, ending, **kwargs)
    except OSError as err:
        raise GadeiError(f"job {job.name!r}: its outputs in {job.output} are not written (not even result.json): "
                         f"{f'{err.filename}: ' if err.filename else ''}{err.strerror or err}") from None


def _outgoing_gone(job: str) -> None:
    """Wait for the server of a supervisor that died to end before this one starts its own (the
    job's region is that server's until it ends): tied to its supervisor, it stops on the
    supervisor's death (SIGTERM: a checkpoint, then its exit), which may take a while on a busy
    machine, or never where it is held; past `OUTGOING` seconds it is stopped by signal. A region
    it left (it was killed, or died) is removed."""
    server = live_server(job)
    if server is not None:
        log.info("job %r: the server of the supervisor before this one (pid %d) is still stopping; waiting for it",
                 job, server[0])
        deadline = Deadline(OUTGOING)
        while live_server(job) is not None and not deadline.expired():
            time.sleep(0.05)
        stop_by_pid(job, f"the server of the supervisor before this one did not stop within {OUTGOING:g} s", 30.0)
    found = inspect(job)
    if found is not None and found.state == "leftover":  # it died without removing it: in the new server's way
        log.info("job %r: removing the region the server before this one left (pid %d, not running)", job,
                 found.server_pid)
        remove(job)


def _claim(job: jobfile.Job):
    """The output folder claimed by this supervisor, which was handed no claim (a restarted daemon's
    replaces one that died): the processes of the one before it hold it until they end (its server
    has; its learners follow it), for up to `OUTGOING` seconds.

    Raises:
        FolderInUse: the claim is still held: by another run, which this one must not write over.
    """
    deadline = Deadline(OUTGOING)
    while True:
        try:
            return claims.take(job.output, job.private)
        except FolderInUse:
            if deadline.expired():
                raise


def _supervised(job: jobfile.Job, found, stops: _Stops, since: float, hold: bool = True) -> dict:
    """Supervise the job (a job file's, or a candidate's of one that picks its model) in its output
    folder to its end, from checkpoint `found` (None: from its start), and write its outputs;
    result.json's content. `since`: when this run of it started, its time base; `hold`: the
    test's hold at the job's end (GADEI_PAUSE_AT=concluding) is here (not a candidate's)."""
    out = job.output
    node = placement.read_node(out)
    (out / FINAL).unlink(missing_ok=True)  # an earlier run's: this run's servers save their own
    settings = SupervisorSettings(checkpoint_dir=str(out / "checkpoints"), every=job.checkpoint.interval,
                                  keep=job.checkpoint.keep, server=server_args(job, node, found),
                                  learners=learner_args(job, node), log_dir=str(out / "logs"))
    t = job.train
    openmp = learners_openmp_env(t.learners, t.learner_threads)
    follow = _Follow(job)
    supervisor = Supervisor(job.name, settings, progress=found.progress if found else None,
                            stop_record=str(out / STOP_RECORD), env={**os.environ, **openmp}, look=follow,
                            passive_learners=t.learner_threads <= 1 or bool(openmp))
    follow.supervisor = supervisor
    stops.supervisor = supervisor
    if stops.asked:  # before this supervisor was made: it stops the job before its server starts
        supervisor.ask_stop()
    # its server and learners start warm, forked from this process (`gadei.zygote`), the job's data read once here
    data.keep(f"job:{out / 'job.toml'}", job.workload)
    try:
        code = supervisor.run()
    except GadeiError as err:
        code, supervisor.reason = SERVER_DEAD, supervisor.reason or str(err)
    stops.supervisor = None  # its end is decided: a stop now changes nothing of it
    if hold:
        pause_at("concluding")  # a test's hold (GADEI_PAUSE_AT): the job's end decided, its outputs not yet written
    bridge = bridge_record.wait(out, node.timeout, node.host) if node is not None else None
    stop = supervisor.server_ended()
    saved = out / FINAL
    # a bridged node's model is the one the nodes agreed on; one whose bridge left the exchanges (it
    # trained on alone) agreed on none and hands back its server's, as a node of its own
    final = bridge.model if bridge is not None and bridge.model else str(saved) if saved.exists() and \
        stop is not None and stop.outcome == "stopped" else None
    ending = outputs.Ending(code, supervisor.finished, supervisor.stopped, supervisor.reason or supervisor.note, final,
                            supervisor.first_applied or (stop.first_applied if stop is not None else 0.0))
    board = follow.board
    try:
        board.epochs(outputs.epoch_records(out / outputs.EPOCHS))  # those reported after the last look
        result = _conclude(job, ending, since=since, bridge=bridge.summary if bridge is not None else None)
    finally:
        board.close()
    data.forget_encoded(out)  # the job's sets as its daemon encoded them: this run of it is over
    return result
