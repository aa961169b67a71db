"""The model chosen on the validation set, and when training stops (validation-driven training).

The evaluating learner (learner 0 of a `gadei run` job) evaluates the weights on the job's
validation set after every epoch and offers each evaluation here. `Selection` keeps the
best one (highest validation accuracy; on a tie, lower validation loss) in its folder, crash
safely, so a restarted learner (or a resumed run) goes on with the same best model and the
same count of evaluations without improvement:

    best.pt     the best weights so far, a state dict plain `torch.load(weights_only=True)`
                reads, written (temporary file, fsync, rename) only when an evaluation improves
    best.json   the selection's state: the best evaluation (epoch, version, validation
                accuracy and loss), the evaluations made, those since the best, and why
                training stopped once it did ("patience")

When `patience` evaluations in a row did not raise the best validation accuracy, training
stops (as Keras's EarlyStopping on it: a tie that lowers the loss is kept as the best model,
and counts; counted as an improvement, an easy set's falling loss kept a job whose validation
accuracy was 100% from its third epoch training to its cap, 40 epochs): the
learner says so in the region (`gadei.learner.Learner.end_training`), every learner ends its
schedule there, and the job ends as finished; `gadei run` hands back best.pt as model.pt.
The test set is never looked at here.
"""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import files
from .errors import GadeiError

BEST_MODEL = "best.pt"
BEST_STATE = "best.json"


@dataclass
class Evaluation:
    """One evaluation of the weights on the validation set."""

    epoch: float  # epochs of the evaluating learner when it was made (within an epoch on large data sets)
    version: int
    validation_accuracy: float
    validation_loss: float
    at: float = 0.0  # wall clock (time.time()) when it was made; 0: not known (a selection older than this field)

    def better_than(self, other: "Evaluation | None") -> bool:
        if other is None:
            return True
        return (self.validation_accuracy, -self.validation_loss) > (other.validation_accuracy, -other.validation_loss)


def ran_out(patience: int) -> str:
    """Why training stopped on patience, in words (the learner's log, result.json's reason)."""
    return (f"patience ran out: the validation accuracy did not improve for {patience} evaluation"
            + ("s" if patience != 1 else ""))


@dataclass
class Selection:
    """The best evaluation so far and the patience count, kept in `folder` (see the module).

    Attributes:
        folder: where best.pt and best.json are.
        patience: evaluations without improvement after which training stops (0: never).
        best: the best evaluation so far (None before the first).
        evaluations: evaluations made.
        since_best: evaluations since the best validation accuracy was reached (0 right after it
            rose; a tie kept for its lower loss counts one; those of training the job undid by
            going back to an older checkpoint do not).
        history: the evaluations counted, in order (`offer`).
        stopped: why training stopped ("patience"), None while it goes on.
    """

    folder: Path
    patience: int
    best: Evaluation | None = None
    evaluations: int = 0
    since_best: int = 0
    stopped: str | None = None
    history: list = field(default_factory=list)

    @classmethod
    def open(cls, folder: str | os.PathLike, patience: int) -> "Selection":
        """The selection kept in `folder`, or a new one. A best.json whose best is not the
        weights in best.pt (a crash between the two writes) is believed for the weights'
        own record, with the count of evaluations since the best started again.

        Raises:
            GadeiError: best.json is there but is not a selection's state.
        """
        folder = Path(folder)
        files.remove_orphans(folder, (BEST_MODEL, BEST_STATE))  # what a learner killed mid-write left
        selection = cls(folder, patience)
        state_path = folder / BEST_STATE
        try:
            state = json.loads(state_path.read_text())
        except FileNotFoundError:
            return selection
        except (OSError, ValueError) as err:
            raise GadeiError(f"{state_path}: not a model selection's state ({err}); remove it to start the "
                             "selection again") from None
        try:
            best = Evaluation(**state["best"]) if state.get("best") else None
            selection.evaluations, selection.since_best = int(state["evaluations"]), int(state["since_best"])
            selection.stopped, selection.history = state.get("stopped"), list(state.get("history", []))
        except (KeyError, TypeError, ValueError) as err:
            raise GadeiError(f"{state_path}: not a model selection's state ({err}); remove it to start the "
                             "selection again") from None
        saved = _saved_evaluation(folder / BEST_MODEL)
        if saved is not None and (best is None or saved.version != best.version):
            best, selection.since_best = saved, 0  # best.pt was replaced, best.json not yet
        selection.best = best if saved is not None else None
        return selection

    def offer(self, evaluation: Evaluation, weights: dict[str, torch.Tensor]) -> bool:
        """Count one evaluation of `weights` (a state dict, copied by the caller: it must not
        change while it is written); keep it when it is the best so far. Whether it was; when
        `patience` evaluations in a row did not raise the best validation accuracy, `stopped`
        becomes "patience".

        An evaluation at an epoch no later than one already counted comes from a job that went
        back to an older checkpoint (its supervisor, or a resumed run, restarted it): the
        evaluations from that epoch on were of training it undid and does again, so they leave
        the history and the count (where the best came from them, the count starts again from
        here; the best model stays, a model evaluated like any other). Each epoch of the training
        the job hands back counts once, so a job whose patience is as long as its epochs trains
        them all, however often it went back."""
        kept = [h for h in self.history if h.get("epoch", 0) < evaluation.epoch]
        self.since_best = max(0, self.since_best - (len(self.history) - len(kept)))
        self.history = kept
        self.evaluations += 1
        self.history.append(asdict(evaluation))
        improved = evaluation.better_than(self.best)
        rose = self.best is None or evaluation.validation_accuracy > self.best.validation_accuracy
        if improved:
            self._write(self.folder / BEST_MODEL, lambda handle: torch.save(
                {"model": weights, "evaluation": json.dumps(asdict(evaluation))}, handle))
            self.best = evaluation
        self.since_best = 0 if rose else self.since_best + 1
        if self.patience and self.since_best >= self.patience:
            self.stopped = "patience"
        self._write(self.folder / BEST_STATE, lambda handle: handle.write(json.dumps(self.state()).encode()))
        return improved

    def evaluated(self, epoch) -> bool:
        """Whether an evaluation at `epoch` was counted (a restarted learner's catch-up)."""
        return any(h.get("epoch") == epoch for h in self.history)

    def state(self) -> dict:
        return {"best": asdict(self.best) if self.best else None, "evaluations": self.evaluations,
                "since_best": self.since_best, "patience": self.patience, "stopped": self.stopped,
                "history": self.history}

    def _write(self, path: Path, write) -> None:
        """Crash safe: written whole, synced, and renamed over `path` (`gadei.files.replace`)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            files.replace(path, write, durable=True)
        except OSError as err:
            raise GadeiError(f"cannot write {path}: {err.strerror or err}") from None


def _saved_evaluation(path: Path) -> Evaluation | None:
    """The evaluation best.pt was saved with (None: no best.pt)."""
    try:
        saved = torch.load(path, weights_only=True)
    except FileNotFoundError:
        return None
    except Exception as err:  # noqa: BLE001 - torch raises many kinds for a damaged file
        raise GadeiError(f"{path}: not a best model that reads ({err}); remove it to start the selection "
                         "again") from None
    return Evaluation(**json.loads(saved["evaluation"]))


def best_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor] | None:
    """The best model's state dict in `folder` (None: no evaluation was kept there)."""
    try:
        return torch.load(Path(folder) / BEST_MODEL, weights_only=True)["model"]
    except FileNotFoundError:
        return None


def read_state(folder: str | os.PathLike) -> dict | None:
    """best.json of `folder` as a dict (None: none there)."""
    try:
        return json.loads((Path(folder) / BEST_STATE).read_text())
    except (FileNotFoundError, ValueError):
        return None
