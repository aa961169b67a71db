"""The learner program: train a built-in workload as one learner of a job (what `gadei learn`
runs, and so what a job's supervisor launches): its shard of each epoch, seeded data
order and dropout, a restarted learner going on where its gradients end (`--start-at`), the
epoch records its log carries, and, for the evaluating learner, validation-driven training
(`_Chooser`: evaluate, keep the best model, end every learner's training on patience)."""

import contextlib
import json
import logging
import os
import threading
import time

from .console import emit
from .data import workload_model
from .errors import GadeiError
from .layout import TRAIN_STOP_PATIENCE

log = logging.getLogger(__name__)


def run(args) -> int:
    """Train as `gadei learn ARGS` says; the exit code."""
    import torch

    from .device import resolve
    from .learner import Learner

    device = resolve(args.device)  # a CUDA device on a machine without one fails here, before the data loads
    torch.set_num_threads(args.torch_threads)
    workload, train, validation, test, model = workload_model(args.workload, args.data, args.seed)
    model.to(device)
    batches = workload.batches
    chooser = _Chooser.start(args, workload, train, validation, device) if args.validate else None

    shard, shards = _shard(args.shard)
    if args.start_at < 0:
        raise GadeiError(f"--start-at {args.start_at}: must be >= 0")
    # Dropout masks: each learner (and each restart of one) draws its own, reproducibly. Left
    # at torch's fixed default seed, every learner would use the same mask at the same step,
    # which weakens dropout (on SST-2, two learners ended 1-2 points below one).
    torch.manual_seed(hash((args.seed, shard, shards, args.start_at)) & 0x7FFF_FFFF_FFFF_FFFF)
    per_epoch = len(range(shard, len(train), shards))
    first_epoch, skip = divmod(args.start_at, per_epoch) if per_epoch else (args.epochs, 0)
    model.train()
    started = time.monotonic()
    samples = 0
    with (Learner(model, args.job, pull=args.pull, push=args.push, device=device, entry=args.entry) as learner,
          chooser or contextlib.nullcontext()):  # the evaluation running as the learner leaves (a stop): its end
        staleness = _Staleness(learner.region)
        if chooser is not None and chooser.selection.stopped:  # decided before a restart: say it again
            chooser.end_training(learner)
        elif first_epoch > 0 and (skip == 0 and args.eval or chooser is not None and not (
                chooser.selection.evaluated(first_epoch) and _recorded(args, first_epoch))):
            _catch_up(args, learner, chooser, workload, model, test, first_epoch)
        for epoch in range(first_epoch, args.epochs):
            if learner.training_ended:
                break
            epoch_start, steps, seen, position = time.monotonic(), 0, 0, 0
            loss_sum = torch.zeros((), device=device)  # summed on the device: no GPU wait per step
            correct = torch.zeros((), dtype=torch.int64, device=device)
            for x, y in batches(train, args.batch, epoch=epoch, seed=args.seed, shard=shard, shards=shards):
                position += len(y)
                if skip > 0:  # a restarted learner: these samples' gradients are in the weights already
                    skip -= len(y)
                    continue
                if learner.training_ended:  # the evaluating learner decided for the job: end the schedule
                    break
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss, right = workload.gradient(model, x, y, learner.constraint_lr)
                learner.step(samples=len(y))
                loss_sum += loss.detach()
                steps += 1
                samples += len(y)
                seen += len(y)
                correct += right
                if chooser is not None and chooser.due(position, per_epoch):  # a large data set: within the epoch too
                    learner.refresh()
                    at = round(epoch + position / per_epoch, 3)
                    chooser.later(learner, _snapshot(model), at, {"event": "evaluation", "job": args.job,
                                                                  "learner": learner.learner_id, "epoch": at,
                                                                  "version": learner.version},
                                  lambda record: _report_evaluation(args, record))
            record = {
                "event": "epoch", "job": args.job, "learner": learner.learner_id, "epoch": epoch + 1,
                "loss": loss_sum.item() / max(1, steps), "train_accuracy": correct.item() / max(1, seen),
                "steps": steps,
                "samples_per_s": steps and (samples / (time.monotonic() - started)),
                "epoch_seconds": time.monotonic() - epoch_start, "version": learner.version,
                **staleness.since_last(), "nonfinite_skipped": learner.region.header.get("nonfinite_skipped"),
            }
            if chooser is not None:
                chooser.wait()  # the evaluation before this epoch's: its decision may have ended training
            if learner.training_ended and (chooser is None or chooser.selection.stopped):
                break  # trained after the decision: nothing to evaluate or report
            if chooser is not None:  # evaluated on a copy of the weights while this learner trains on
                learner.refresh()
                record["version"] = learner.version  # the evaluated weights' (the job's end reuses its test accuracy)
                chooser.later(learner, _snapshot(model), epoch + 1, record, lambda record: _report(args, record),
                              test if args.eval else None)
                chooser.new_epoch()
            else:
                if args.eval:  # without a validation set: the test set's accuracy, reported only
                    learner.refresh()
                    record["version"] = learner.version
                    record["test_accuracy"] = workload.evaluate(model, test)
                    record["evaluated_at"] = time.time()
                    model.train()
                _report(args, record)
            if learner.training_ended:
                break
    return 0


def _recorded(args, epoch: int) -> bool:
    """Whether --records holds a record of `epoch`'s end (True where there are no records to
    keep); a record cut short by a kill is none."""
    from .outputs import epoch_records

    return not args.records or any(record.get("epoch") == epoch for record in epoch_records(args.records))


def _snapshot(model) -> dict:
    """A copy of `model`'s weights on the CPU: an evaluation's, which the shared weights must not move under."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _catch_up(args, learner, chooser, workload, model, test, epoch: int) -> None:
    """A restarted evaluating learner whose schedule goes on after epoch `epoch`: its last run
    may have been killed between that epoch's last step and its record (the evaluations take a
    while, and run while the learner trains on: a restart within the next epoch can find it
    unmade too). Evaluate now, as at that epoch's end, so that neither the job's metrics nor the
    model selection miss the epoch. The record says "restarted": the metrics keep the epoch's
    own record where the last run wrote it (`gadei.outputs.write_metrics`), and the selection
    counts an epoch once: an epoch it counted whose record the last run did not write (killed
    between the two) is recorded as counted, its test accuracy that of the weights now."""
    learner.refresh()
    record = {"event": "epoch", "job": args.job, "learner": learner.learner_id, "epoch": epoch,
              "version": learner.version, "restarted": True}
    weights = _snapshot(model)
    if chooser is not None and not chooser.selection.evaluated(epoch):
        record.update(chooser.evaluate(weights, epoch, learner.version))
        if chooser.selection.stopped:
            chooser.end_training(learner)
    elif chooser is not None:
        record.update(chooser.counted(epoch))
    if args.eval:
        if chooser is not None:
            chooser.eval_model.load_state_dict(weights)  # a copy: the shared weights move while it evaluates
        record["test_accuracy"] = workload.evaluate(chooser.eval_model if chooser else model, test)
        record.setdefault("evaluated_at", time.time())
    model.train()
    _report(args, record)


# A data set larger than this (training samples) is also evaluated every this many samples
# of the job within an epoch, so that an epoch of a large set is not the unit of patience.
EVALUATE_SAMPLES = 100_000


_BEAT_EVERY = 1.0  # seconds between a waiting learner's beats (hung: interval * max_missed, 10 s by default)


class _Chooser:
    """The evaluating learner's part in validation-driven training: evaluate a copy of the
    weights on the validation set, offer it to the job's `gadei.selection.Selection` (kept in
    --best), which keeps the best and says when patience ran out.

    An evaluation runs on a thread of its own while the learner trains on (`later`), one at a
    time: the next waits for it (`wait`), so a decision comes at most one evaluation late. On a
    small job the evaluations were the evaluating learner's extra time, which the other learners
    finished ahead of it by (0.2-0.7 s of the 2-core machine's small job, docs/benchmarks.md);
    torch runs the two threads' operators side by side."""

    def __init__(self, workload, validation, eval_model, selection, every: int = 0):
        self.workload, self.validation, self.eval_model, self.selection = workload, validation, eval_model, selection
        self.every = every  # samples of this learner's shard between evaluations within an epoch (0: none)
        self._mark = 0
        self._running: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._learner = None  # the learner whose evaluation runs: it beats while `wait` waits for it

    def later(self, learner, weights: dict, at, record: dict, report, test=None) -> None:
        """Evaluate `weights` (`learner`'s at `at`: an epoch, or a point within one) on the
        validation set once the evaluation before has ended, while the learner trains on: offered
        to the selection (patience running out ends every learner's training), then the test set's
        accuracy where `test` is given (it reports, never chooses); then `report(record)`, the
        record with the evaluation's fields. Nothing where the evaluation before ended training."""
        self.wait()
        if self.selection.stopped:
            return
        version = learner.version

        def evaluate():
            try:
                record.update(self.evaluate(weights, at, version))
                if self.selection.stopped:
                    self.end_training(learner)
                if test is not None:  # the chooser's model holds `weights` already
                    record["test_accuracy"] = self.workload.evaluate(self.eval_model, test)
                report(record)
            except BaseException as err:  # noqa: BLE001 - raised on the learner's thread by `wait`
                self._failed = err

        self._learner = learner
        self._running = threading.Thread(target=evaluate, name="gadei-evaluation", daemon=True)
        self._running.start()

    def wait(self) -> None:
        """Until the evaluation `later` started has ended, its learner beating meanwhile; what it
        raised, raised here."""
        if self._running is not None:
            while self._running.is_alive():
                self._running.join(_BEAT_EVERY)
                self._learner.beat()
            self._running = None
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed

    def __enter__(self) -> "_Chooser":
        return self

    def __exit__(self, *exc) -> None:
        """The learner leaves (its schedule's end, the job's stop): the evaluation still running
        ends and is reported first, while the learner is attached and beats; a stop no longer
        leaves the selection holding an epoch that the job's metrics lack."""
        self.wait()

    def end_training(self, learner) -> None:
        """Patience ran out: end every learner's training, saying why."""
        from .selection import ran_out

        learner.end_training(TRAIN_STOP_PATIENCE, ran_out(self.selection.patience))

    def new_epoch(self) -> None:
        self._mark = 0

    def due(self, position: int, per_epoch: int) -> bool:
        """An evaluation within the epoch is due at `position` samples into this learner's
        shard of it (a large data set: every EVALUATE_SAMPLES of the job's; the end of the
        epoch has its own)."""
        if not self.every or position >= per_epoch:
            return False
        mark = position // self.every
        if mark <= self._mark:
            return False
        self._mark = mark
        return True

    @classmethod
    def start(cls, args, workload, train, validation, device) -> "_Chooser":
        from .selection import Selection

        if validation is None:
            raise GadeiError(f"--validate: --data {args.data!r} has no validation set; give a job file's data "
                             "(job:JOBFILE), whose [data] validation (or held-out share of train) is one")
        if not args.best:
            raise GadeiError("--validate: give --best FOLDER, where the best model and the selection's state are kept")
        eval_model = workload.build_model(train, args.seed).to(device)
        eval_model.eval()
        shards = _shard(args.shard)[1]
        every = EVALUATE_SAMPLES // shards if len(train) > EVALUATE_SAMPLES else 0
        return cls(workload, validation, eval_model, Selection.open(args.best, args.patience), every)

    def counted(self, epoch: int) -> dict:
        """The record's fields of the evaluation at `epoch` that the selection counted (its version
        not among them: a record's version is its test accuracy's weights')."""
        made = [h for h in self.selection.history if h.get("epoch") == epoch][-1]
        best = self.selection.best
        return {"validation_loss": made["validation_loss"], "validation_accuracy": made["validation_accuracy"],
                **({"evaluated_at": made["at"]} if made.get("at") else {}),  # 0: a selection's from before the field
                "best": best is not None and best.epoch == epoch, "best_epoch": best.epoch if best else None,
                "since_best": self.selection.since_best}

    def evaluate(self, weights: dict, epoch: int, version: int) -> dict:
        """Validation loss and accuracy of `weights`; whether they are the best so far (and
        kept); the record's fields."""
        from .selection import Evaluation

        import torch

        self.eval_model.load_state_dict(weights)
        device = next(self.eval_model.parameters()).device
        loss, correct = 0.0, 0
        with torch.no_grad():
            for _, x, y in self.workload.evaluation_batches(self.eval_model, self.validation):
                x, y = x.to(device), y.to(device)
                batch_loss, right = self.workload.loss_and_correct(self.eval_model, x, y)
                loss += float(batch_loss) * len(y)
                correct += int(right)
        n = max(1, len(self.validation))
        evaluation = Evaluation(epoch=epoch, version=version, validation_accuracy=correct / n,
                                validation_loss=loss / n, at=time.time())
        improved = self.selection.offer(evaluation, weights)
        best = self.selection.best
        return {"validation_loss": evaluation.validation_loss, "validation_accuracy": evaluation.validation_accuracy,
                "evaluated_at": evaluation.at, "best": improved, "best_epoch": best.epoch,
                "since_best": self.selection.since_best,
                **({"stopped": self.selection.stopped} if self.selection.stopped else {})}


class _Staleness:
    """The job's gradient staleness (versions between the weights a gradient was computed on
    and the version it was applied at), over every learner of the region, between two calls.
    Counted per ring owner, so a learner that leaves or is restarted does not skew it."""

    def __init__(self, region):
        self.region = region
        self.last = self._counts()
        self.most = max((top for _, _, top in self.last.values()), default=0)

    def _counts(self) -> dict[tuple[int, int], tuple[float, int, int]]:
        from . import status

        return {(entry.learner, entry.pid): (entry.stale_mean * entry.applied, entry.applied, entry.stale_max)
                for entry in status.read(self.region).learners}

    def since_last(self) -> dict:
        """`staleness_mean` of the gradients applied since the last call (all learners) and
        `staleness_max`, the largest any gradient of the job had so far: kept here, since a ring
        owner that leaves (or is restarted) takes its own largest with it."""
        now = self._counts()
        stale = applied = 0
        for owner, (total, count, top) in now.items():
            before_total, before_count, _ = self.last.get(owner, (0.0, 0, 0))
            self.most = max(self.most, top)
            if count > before_count:
                stale += total - before_total
                applied += count - before_count
        self.last = now
        return {"staleness_mean": round(stale / applied, 3) if applied else 0.0, "staleness_max": self.most}


def _record(args, record: dict) -> None:
    """`record` as one JSON line appended to --records (one write of a whole line: a reader never
    sees half of one), where it is given: the job's epoch records, which its supervisor follows."""
    if args.records:
        line = (json.dumps(record) + "\n").encode()
        fd = os.open(args.records, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def _report(args, record: dict) -> None:
    _record(args, record)
    if args.json:
        emit(record)
        return
    acc = f", test accuracy {record['test_accuracy']:.2%}" if "test_accuracy" in record else ""
    if record.get("restarted"):
        print(f"learner {record['learner']} restarted after epoch {record['epoch']}: version "
              f"{record['version']:,}{acc}", flush=True)
        return
    print(f"learner {record['learner']} epoch {record['epoch']}: loss {record['loss']:.4f}, "
          f"{record['samples_per_s']:.0f} samples/s, version {record['version']:,}{acc}", flush=True)


def _report_evaluation(args, record: dict) -> None:
    _record(args, record)
    if args.json:
        emit(record)
        return
    print(f"learner {record['learner']} at epoch {record['epoch']}: validation accuracy "
          f"{record['validation_accuracy']:.2%}, loss {record['validation_loss']:.4f}"
          + (" (best so far)" if record["best"] else ""), flush=True)


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise GadeiError(f"--shard {text!r}: expected INDEX/COUNT, e.g. 0/2") from None
    if not 0 <= index < count:
        raise GadeiError(f"--shard {text!r}: INDEX must be in 0..COUNT-1")
    return index, count
