"""A job's TensorBoard event files, written as it runs, in its output folder: with every job's
output folder under one folder (`runs/` by default), `tensorboard --logdir runs/` shows them
side by side, each folder one run.

`gadei run` (and so every daemon job, which is one) writes them while it follows the job:
per epoch of the evaluating learner (step: the epoch) its loss and train accuracy, validation
and test accuracy, staleness, the gradients skipped as not finite and its samples/s; every
2 s (step: the weights' version) the job's samples/s and updates/s, its server restarts and
learners alive; and the job's settings as TensorBoard hyperparameters, so that the HParams tab
compares jobs by them. A `gadei run` that is killed stops writing there: the job's other
outputs (metrics.jsonl and the rest) are still written by whoever takes them over.

The events are written with `torch.utils.tensorboard`, which needs the `tensorboard` package
(`pip install 'gadei[tensorboard]'`); without it a job runs as before and says once what to
install.
"""

import glob
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

EVENTS = "events.out.tfevents.*"  # the event files' names (TensorBoard's), in the output folder
INSTALL = "pip install 'gadei[tensorboard]'"

# epoch record key -> tag
EPOCH_TAGS = {
    "loss": "train/loss",
    "train_accuracy": "train/accuracy",
    "validation_accuracy": "eval/validation_accuracy",
    "test_accuracy": "eval/test_accuracy",
    "samples_per_s": "learner/samples_per_s",
    "staleness_mean": "staleness/mean",
    "staleness_max": "staleness/max",
    "nonfinite_skipped": "job/nonfinite_skipped",
}
# live figure -> tag
LIVE_TAGS = {
    "samples_per_s": "job/samples_per_s",
    "updates_per_s": "job/updates_per_s",
    "restarts": "job/restarts",
    "learners_alive": "job/learners_alive",
}


def forget(out: Path) -> None:
    """A fresh run (not a resumed one) in `out`: the event files of the run before are not its own."""
    for path in glob.glob(os.path.join(glob.escape(str(out)), EVENTS)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def hyperparameters(job) -> dict:
    """The job's settings as TensorBoard hyperparameters (numbers, strings and booleans only)."""
    train = job.train
    values = {"workload": job.workload, "learners": train.learners, "mode": train.mode, "lr": train.lr,
              "optimizer": train.optimizer, "batch": train.batch, "epochs": train.epochs,
              "patience": train.patience, "seed": train.seed, "devices": train.devices,
              "grad_dtype": job.transport.grad_dtype, "bridge": job.bridge.strategy if job.bridge else "none"}
    return {k: v for k, v in values.items() if isinstance(v, (int, float, str, bool))}


_missing_said = False  # a job that picks its model opens a Board per candidate, in one process: said once


class Board:
    """The event files of one run in `out`. Without TensorBoard installed, every call does nothing
    (and `warn` says so, once a process)."""

    def __init__(self, out: Path, job, warn=print):
        self._writer = None
        self._epochs: set[int] = set()
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        except ImportError:
            global _missing_said
            if not _missing_said:
                _missing_said = True
                warn(f"no TensorBoard event files for this job: TensorBoard is not installed ({INSTALL})")
            return
        self._writer = SummaryWriter(str(out), flush_secs=5)
        metrics = {tag: 0.0 for tag in ("eval/test_accuracy", "eval/validation_accuracy", "train/loss")}
        for summary in hparams(hyperparameters(job), metrics):
            self._writer.file_writer.add_summary(summary)

    def epochs(self, records: list[dict]) -> None:
        """Write the epoch records of epochs not written yet: each epoch once, as the evaluating
        learner first reported it (metrics.jsonl, written at the end, keeps a restarted learner's
        later record of an epoch where there is one)."""
        if self._writer is None:
            return
        for record in records:
            epoch = record.get("epoch")
            if not isinstance(epoch, int) or epoch in self._epochs:
                continue
            self._epochs.add(epoch)
            for key, tag in EPOCH_TAGS.items():
                value = record.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(tag, value, epoch)

    def live(self, version: int, figures: dict) -> None:
        """The job's figures now (LIVE_TAGS' keys), at step `version`; none before the first update
        (the learners are still starting)."""
        if self._writer is None or version == 0:
            return
        for key, tag in LIVE_TAGS.items():
            if key in figures:
                self._writer.add_scalar(tag, figures[key], version)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
