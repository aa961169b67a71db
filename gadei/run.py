"""`gadei run job.toml`: one job from its job file, in the foreground, with a live progress line;
a client of the job's supervisor.

Everything that can be wrong with the job file and its data is found before anything starts
(`gadei.prepare`; a stop that comes meanwhile, while a large data set is read, ends this command at
once, with nothing written), and the output folder made ready (the job as run, the maps). Then the job's
supervisor runs it (`gadei.supervisor.Supervised`: a process of its own, which starts the server
and the learners, checkpoints the job, restarts what crashes and alone writes the outputs:
model.pt, result.json, metrics.jsonl, accuracy.png, TensorBoard events; docs/jobs.md lists the
folder's files); this command shows the job's progress and what the supervisor warns of, passes
a Ctrl-C or a SIGTERM on to it as a stop, and says the outcome from result.json. Killed, it
leaves the job to its supervisor; a supervisor that dies takes its job down with it, and this
command starts a new one that goes on from the newest checkpoint. Under `mpiexec -n NODES` a job
with a [bridge] section runs as one node per rank (`gadei.placement.Bridged`).
"""

import logging
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from . import jobfile, outputs, placement
from .errors import GadeiError
from .outputs import RUN, exit_code, summary
from .prepare import Prepared, check, describe, prepare
from .supervisor import LOG, Supervised

log = logging.getLogger(__name__)

LINE_EVERY = 2.0  # seconds between progress lines


def run_job(path: str, *, quiet: bool = False, resume: bool = False, by: str = RUN,
            asked: list[int] | None = None) -> int:
    """Run the job file at `path` to its end; `gadei run`'s exit code (0 when it finished and
    handed back its model). `resume`: go on with the run its output folder holds. `by`: the
    command that started the job, which what the run says to go on with it names. `asked`: the
    stops (signal numbers) asked for since this process took them (`launch.take_stops`, `gadei
    run`'s first step), passed on to the job's supervisor once it runs.

    A job with a [bridge] section started as more than one MPI rank (`mpiexec -n NODES gadei
    run job.toml`) runs as one node of NODES (`gadei.placement`)."""
    job = jobfile.load(path)
    place = placement.of(job)
    try:
        with _stop_ends_it(asked):  # nothing written yet: a stop (Ctrl-C) ends this command now
            checked = check(job, resume, place, by=by)
        prepared = prepare(job, resume, place, by, checked=checked)
    except BaseException as err:
        place.agree(None)  # the other nodes do not wait for this one into their timeout
        if isinstance(err, _StopAsked):
            print(f"gadei run: job {job.name} stopped before it started (as its job file and data were checked); "
                  "nothing was written", file=sys.stderr, flush=True)
            return outputs.EXIT_CODES[outputs.STOPPED]
        raise
    place.agree(prepared)
    return place.end(JobRun(prepared, place, quiet, asked).run())


class _StopAsked(BaseException):
    """A stop asked of `gadei run` while it checks its job: nothing started, nothing to stop. Not a
    KeyboardInterrupt, which CPython remembers once it went through an exec() (`tests/
    test_run_stops.py`), nor an Exception, which a reader of a data file may catch."""


@contextmanager
def _stop_ends_it(asked: list[int] | None):
    """While this runs, a stop (SIGTERM, SIGINT; one `asked` holds already too) ends it, raising
    _StopAsked; after, a stop is recorded in `asked` again, for the job's supervisor. Nothing where
    the caller takes no stops (`asked` None)."""
    if asked is None:
        yield
        return

    def stop(_sig, _frame):
        raise _StopAsked

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)
              if signal.getsignal(sig) is not signal.SIG_IGN}  # a shell's background job ignores SIGINT
    try:
        if asked:
            raise _StopAsked
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


class JobRun:
    """One prepared job run by its supervisor, followed to its end: the progress line, the
    supervisor's warnings, a stop passed on, a dead supervisor replaced (`Supervised`), a
    bridged node's bridge; the outcome said as result.json says it."""

    def __init__(self, prepared: Prepared, place, quiet: bool, asked: list[int] | None = None):
        self.prepared, self.place, self.quiet = prepared, place, quiet
        self.job = prepared.job
        self.asked = asked  # None: this run takes the stops itself (`run`)
        out = self.job.output
        self.supervised = Supervised(self.job.name, out / "job.toml", out, by=prepared.by, named=self.job.path,
                                     env=place.environment(), log=out / LOG, private=self.job.private,
                                     claim=prepared.claim)

    def run(self) -> int:
        job, place = self.job, self.place
        for line in describe(self.prepared, place):
            print(line, flush=True)
        if self.asked is None:
            from .launch import take_stops

            self.asked = []
            take_stops(lambda sig, _frame: self.asked.append(sig))
        supervised = self.supervised
        if place.forks:  # the supervisor forked from this process: nothing imported twice, the data read once
            from . import data, zygote

            zygote.warm(late=False)
            for each in self.prepared.candidates or [self.prepared]:  # a job that picks its model: each candidate's
                data.keep(f"job:{each.job.output / 'job.toml'}", each.job.workload,
                          (each.train, each.validation, each.test))
        warnings = _Warnings(job.output / LOG)  # before its supervisor starts: what it says from its first line
        supervised.start(resume=self.prepared.going_on is not None)
        place.start(job, ended=lambda: not supervised.running())
        progress = _Progress(self) if not self.quiet else None
        picking = _Candidates(job) if self.prepared.candidates is not None else None
        while (result := supervised.ended()) is None:
            if self.asked and not supervised.stop_asked:  # a stop (SIGTERM, SIGINT), recorded by its handler
                print(f"\ngadei run: stopping the job {job.name}", flush=True)
                supervised.stop()
            place.poll(job)
            warnings.show()
            if picking is not None:
                picking.show(progress)
            if progress is not None:
                progress.look(picking.training if picking is not None else None)
            supervised.wait(0.25)
        for sig in (signal.SIGTERM, signal.SIGINT):  # the job ended: a stop now has nothing to stop
            signal.signal(sig, signal.SIG_IGN)
        if progress is not None:
            progress.end()
        warnings.show()
        if picking is not None:
            picking.show(None)
        if result.get("outcome") is None:  # its supervisor died, and no new one could go on with the job
            again = outputs.again(job, self.prepared.by) if result.get("resumable") else "see its logs"
            print(f"gadei run: job {job.name}: {result['reason']}; {again}", file=sys.stderr, flush=True)
            return 1
        line = f"gadei run: {summary(job, result, self.prepared.by)}"
        print(line, file=sys.stderr if result["outcome"] in (outputs.FAILED, outputs.DIVERGED) else sys.stdout,
              flush=True)
        return exit_code(result)


class _Candidates:
    """A job that picks its model: a line as each candidate ends (its result.json), saying its
    outcome, the validation accuracy of its model and its seconds; and which one trains now."""

    def __init__(self, job: jobfile.Job):
        self.out = job.output
        found = outputs.candidates(self.out) or []
        self.said = {c.workload for c in found if c.result is not None}  # a resumed run's kept ones: said before
        self.training: outputs.Candidate | None = None
        self.count = len(found)

    def show(self, progress: "_Progress | None") -> None:
        """Say the candidates that ended since the last look (after the progress line, where it is
        rewritten in place)."""
        found = outputs.candidates(self.out) or []
        for i, c in enumerate(found, 1):
            if c.result is not None and c.workload not in self.said:
                self.said.add(c.workload)
                r = c.result
                model = (f", validation accuracy {r['validation_accuracy']:.2%} (epoch {r['epoch']:g})"
                         if "validation_accuracy" in r else "")
                seconds = r.get("seconds_in_all", r.get("seconds"))
                took = f" in {seconds:.0f} s" if isinstance(seconds, (int, float)) else ""
                if progress is not None:
                    progress.end()
                print(f"  candidate {i} of {self.count}, {c.workload}: {r.get('outcome')}{took}{model}"
                      + ("" if r.get("outcome") == outputs.DONE else f" ({r.get('reason')})"), flush=True)
        self.training = next((c for c in found if c.result is None), None)


class _Warnings:
    """What the job's supervisor warns of (its log's WARNING and ERROR records: a server restarted,
    a learner given up), shown on stderr as it comes: from the log's end when this run starts (a
    resumed run's supervisor appends to the log of the runs before, whose warnings were said)."""

    def __init__(self, path: Path):
        try:
            offset = path.stat().st_size
        except FileNotFoundError:
            offset = 0
        self.path, self.offset = path, offset

    def show(self) -> None:
        try:
            with open(self.path, "rb") as log_file:
                log_file.seek(self.offset)
                text = log_file.read()
        except FileNotFoundError:
            return
        end = text.rfind(b"\n") + 1  # whole lines only
        self.offset += end
        for line in text[:end].decode(errors="replace").splitlines():
            for level in (" WARNING ", " ERROR "):
                if level in line:
                    print(f"gadei run: {line.split(level, 1)[1]}", file=sys.stderr, flush=True)


class _Progress:
    """A progress line every LINE_EVERY seconds: epochs done (updates x mini-batch over the
    training set, or a bridged node's share of it), the last evaluated epoch's loss and accuracy,
    samples/s and updates/s (over the last seconds, from the same count of applied updates as
    the epochs, so a learner's restart or its leaving does not zero it), version, ETA. On a
    terminal the line is rewritten in place, unless the placement's label (a bridged node's,
    which starts its lines) says that other ranks write to the same terminal."""

    def __init__(self, run: JobRun):
        job = run.job
        self.job, self.label = job, run.place.label
        self.train_size = len(run.prepared.train) / run.place.size
        self.overwrite = sys.stdout.isatty() and not self.label
        self.total = job.train.epochs * self.train_size
        # patience may end training before the epoch cap, which the ETA counts to: say so
        sooner = run.prepared.validation is not None and run.place.chooses and \
            patience_may_stop(job.train, self.train_size)
        self.cap = " at the epoch cap (patience may stop it sooner)" if sooner else ""
        self.started = time.monotonic()
        self.before = None  # (monotonic seconds, version) of the last line
        self.width = 0
        self.next = time.monotonic() + LINE_EVERY

    def look(self, candidate: outputs.Candidate | None = None) -> None:
        """A line, where one is due; `candidate`: the one a job that picks its model trains now."""
        from .region import Region
        from .status import read

        if time.monotonic() < self.next:
            return
        self.next = time.monotonic() + LINE_EVERY
        try:
            with Region.attach(self.job.name, readonly=True) as region:
                version = read(region).version
        except GadeiError:
            return
        now = (time.monotonic(), version)
        before, self.before = self.before, now
        if before is None or version < before[1]:  # the first look, or a server restarted from an older checkpoint
            return
        t = self.job.train
        updates_per_s = (now[1] - before[1]) / max(1e-9, now[0] - before[0])
        samples_per_s = updates_per_s * t.batch
        done = min(self.total, version * t.batch)
        left = (self.total - done) / samples_per_s if samples_per_s > 0 else float("nan")
        epoch = outputs.last_epoch(candidate.folder if candidate is not None else self.job.output)
        line = (f"  {self.label}" + (f"{candidate.workload}: " if candidate is not None else "")
                + f"epoch {done / self.train_size:.2f}/{t.epochs}"
                + (f"; after epoch {epoch['epoch']}: loss {epoch['loss']:.3f}" if "loss" in epoch else "")
                + (f", test accuracy {epoch['test_accuracy']:.1%}" if "test_accuracy" in epoch else "")
                + f", {samples_per_s:,.0f} samples/s, {updates_per_s:,.0f} updates/s, version {version:,}"
                + (f", ETA {left:.0f} s{self.cap}" if left == left and done < self.total else "")
                + f", {time.monotonic() - self.started:.0f} s")
        if self.overwrite:
            print("\r" + line.ljust(self.width), end="", flush=True)
            self.width = len(line)
        else:
            print(line, flush=True)

    def end(self) -> None:
        if self.overwrite and self.width:
            print(flush=True)
            self.width = 0


def patience_may_stop(train: jobfile.Train, samples: float) -> bool:
    """Whether patience can end a validated job's training before its epoch cap: it needs
    `patience` evaluations without improvement after the first (always the best so far), and
    one at the cap's end is no sooner. A job evaluates after each epoch, and a training set
    of more than `gadei.trainer.EVALUATE_SAMPLES` samples also within it (about once per that
    many)."""
    from .trainer import EVALUATE_SAMPLES

    per_epoch = 1 + (int(samples) // EVALUATE_SAMPLES if samples > EVALUATE_SAMPLES else 0)
    return train.patience + 1 < train.epochs * per_epoch
