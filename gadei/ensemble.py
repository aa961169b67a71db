"""The candidates' mean: the model a job that picks its model (`workload = "auto"`) hands back
where its candidates together beat each one alone.

An auto job trains every candidate anyway (`watchdog.choice`), and two models of different
families are wrong on different samples: the mean of their label probabilities is right more
often than either. Each member's weight in the mean is in inverse proportion to its validation
error (`weigh`), so that a member far behind the other counts less. On the developers' five
sets with 2 learners (docs/benchmarks.md, "The candidates' mean"), the mean of the n-gram model
and the text CNN beat the candidate with the better validation accuracy by 1.5-2.7 points on
average on four and was level on Subj.

So the job's choice (`choose`, when its outputs are written: `gadei.outputs.conclude`) is made
among the candidates that handed back a model and their mean, on the validation set: the mean is
handed back unless one candidate alone has a validation accuracy more than one standard error of
the mean's above it (a binomial standard error on the validation set, `standard_error`). A model
that is two is preferred over one as good: on a small validation set the one that looks better by
a few samples is as likely to be worse on the test set (measured in one process over TREC's seeds
0-9: choosing the highest of the three outright gave a median of 90.8% against the mean's 91.5%).

`choice_line` says which model the job handed back and why, in one line (result.json's "choice",
`gadei run`'s last line).

The mean's model is its members' run folders (candidates/<workload>/, each its own vocabulary,
label map and model.pt) and their weights (result.json's "weights"): `gadei predict` averages
their probabilities so (`gadei.predict`). The job's own model.pt holds every member's weights in
one state dict, each key prefixed by its workload ("ngram.embedding.weight"), for a user who
keeps one file.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path

from . import data, jobfile, zygote
from .errors import GadeiError

JOINED = "+"  # a mean's name in result.json's "workload": its members' joined ("ngram+textcnn")


@dataclass
class Mean:
    """The mean of some candidates' label probabilities, as measured on the job's sets.

    Attributes:
        members: the candidates' workloads, in the order they trained.
        validation_accuracy: the mean's, on the validation set.
        validation_samples: the validation set's size.
        test_accuracy: the mean's on the test set (which chooses nothing).
        test_samples: the test set's size.
        alone: each member's validation accuracy, measured here the same way (by workload).
        weights: each member's weight in the mean (by workload; they add up to 1, `weigh`).
    """

    members: list[str]
    validation_accuracy: float
    validation_samples: int
    test_accuracy: float
    test_samples: int
    alone: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    @property
    def workload(self) -> str:
        return JOINED.join(self.members)


def standard_error(accuracy: float, samples: int) -> float:
    """The binomial standard error of an accuracy measured on `samples` samples."""
    return math.sqrt(max(accuracy * (1 - accuracy), 0.0) / samples) if samples else 0.0


def weigh(accuracies: dict[str, float], samples: int) -> dict[str, float]:
    """Each member's weight in the mean, from its validation accuracy on `samples` samples: in
    inverse proportion to its validation error (an error of 0 counted as half a sample's), the
    weights adding up to 1."""
    inverse = {name: 1 / max(1 - accuracy, 0.5 / max(samples, 1)) for name, accuracy in accuracies.items()}
    return {name: value / sum(inverse.values()) for name, value in inverse.items()}


def measure(folders: list[Path]) -> Mean | str:
    """The mean of the models in the candidates' run `folders` (each a finished run's: job.toml,
    model.pt), on their validation and test sets; or why there is none, in words (their label
    maps or sets differ, or one has no validation set).

    Raises:
        OSError, RuntimeError: a candidate's model or data could not be read.
    """
    import torch
    from gadei_workloads import get
    from gadei_workloads.text import probabilities

    measured = []  # per member: (labels, validation labels, test labels, validation probabilities, test ones)
    with zygote.one_thread():  # its supervisor may fork after (a resumed job's next run)
        for folder in folders:
            job = jobfile.load(folder / "job.toml")
            workload = get(job.workload)
            if workload.kind != "text":
                return f"{job.workload} is not a text workload"
            train, validation, test = data.load(workload, f"job:{job.path}")
            if validation is None or not len(validation):
                return f"{job.workload} has no validation set"
            model = workload.build_model(train, job.train.seed)
            model.load_state_dict(torch.load(folder / "model.pt", weights_only=True))
            measured.append((train.label_names, validation.labels, test.labels, probabilities(model, validation),
                             probabilities(model, test)))
    first = measured[0]
    for folder, other in zip(folders[1:], measured[1:]):
        if other[:3] != first[:3]:
            return (f"{folder.name}'s labels or validation and test samples are not {folders[0].name}'s, so their "
                    "probabilities cannot be averaged sample by sample")

    def accuracy(probabilities, labels) -> float:
        right = int((probabilities.argmax(dim=1) == torch.tensor(labels)).sum())
        return right / len(labels) if labels else float("nan")

    alone = {f.name: accuracy(m[3], first[1]) for f, m in zip(folders, measured)}
    weights = weigh(alone, len(first[1]))
    validation = sum(weights[f.name] * m[3] for f, m in zip(folders, measured))
    test = sum(weights[f.name] * m[4] for f, m in zip(folders, measured))
    return Mean(members=[f.name for f in folders], validation_accuracy=accuracy(validation, first[1]),
                validation_samples=len(first[1]), test_accuracy=accuracy(test, first[2]), test_samples=len(first[2]),
                alone=alone, weights=weights)


def weights_of(result: dict, members: list[str], where: Path) -> list[float]:
    """The weights of `members` in the mean a job's result.json (`result`, read from `where`)
    names; even where it names none (one member, or a result.json older than "weights").

    Raises:
        GadeiError: its "weights" are not a weight of 0 or more for each member, adding up to 1.
    """
    said = result.get("weights")
    if said is None or len(members) < 2:
        return [1 / len(members)] * len(members)
    weights = [said.get(name) if isinstance(said, dict) else None for name in members]
    if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w <= 1 for w in weights) or \
            abs(sum(weights) - 1) > 1e-6:
        raise GadeiError(f"{where}: its \"weights\" ({said!r}) are not a weight from 0 to 1 for each of "
                         f"{', '.join(members)}, adding up to 1, as `gadei run` writes them")
    return weights


def beats(mean: Mean, best: float) -> bool:
    """Whether the job hands back `mean` rather than the candidate whose validation accuracy,
    `best`, is the highest alone: unless that one is more than a standard error above the mean."""
    return best <= mean.validation_accuracy + standard_error(mean.validation_accuracy, mean.validation_samples)


def choose(folders: list[Path], best: str) -> tuple[list[str], dict]:
    """What a job that picks its model hands back, from the run `folders` of its candidates that
    handed back a model (in the order they trained) and `best`, the workload of the one among them
    with the best validation accuracy: (the members of the model, by workload; result.json's
    fields for it): "mean" (the mean's figures, or why it was not measured) where there are two
    candidates or more, and where the mean is handed back, its "workload", "weights", validation
    and test accuracy."""
    if len(folders) < 2:
        return [best], {}
    try:
        mean = measure(folders)
    except (OSError, RuntimeError, ValueError, GadeiError) as err:  # the choice is among the candidates alone
        mean = f"{type(err).__name__}: {err}"
    if isinstance(mean, str):
        return [best], {"mean": {"not_measured": mean}}
    figures = {"workload": mean.workload, "weights": mean.weights, "validation_accuracy": mean.validation_accuracy,
               "validation_samples": mean.validation_samples, "test_accuracy": mean.test_accuracy}
    if not beats(mean, mean.alone[best]):
        return [best], {"mean": figures}
    return mean.members, {"mean": figures, "workload": mean.workload, "weights": mean.weights,
                          "validation_accuracy": mean.validation_accuracy, "test_accuracy": mean.test_accuracy,
                          "test_samples": mean.test_samples}


def state(folders: list[Path]) -> dict:
    """The mean's model.pt, a state dict: every member's (its model.pt) in one, each key prefixed
    by its workload (its folder's name)."""
    import torch

    joined = {}
    for folder in folders:
        joined.update({f"{folder.name}.{key}": value
                       for key, value in torch.load(folder / "model.pt", weights_only=True).items()})
    return joined


def choice_line(result: dict) -> str:
    """Why the job handed back the model of result.json's "workload", in one line: "ngram, the
    best validation accuracy of 2 candidates (ngram 90.12% in 14 s, textcnn 89.50% in 140 s;
    their mean 88.90%, more than a standard error (1.35%) below ngram)", or "the mean of ngram and
    textcnn (weights 0.53, 0.47), validation accuracy 91.21%, above the best alone (ngram 90.12% in
    14 s, textcnn 89.50% in 140 s)"."""
    said = []
    for c in result.get("candidates", []):
        if "validation_accuracy" in c:
            said.append(f"{c['workload']} {c['validation_accuracy']:.2%}"
                        + (f" in {c['seconds']:.0f} s" if "seconds" in c else ""))
        else:
            said.append(f"{c['workload']} {c.get('outcome') or 'not trained'}")
    members, mean = result.get("members") or [result["workload"]], result.get("mean") or {}
    error = standard_error(mean["validation_accuracy"], mean["validation_samples"]) if "validation_samples" in mean \
        else 0.0
    if len(members) > 1:
        alone = max(c.get("validation_accuracy", 0.0) for c in result.get("candidates", []))
        than = "above the best alone" if mean["validation_accuracy"] > alone else \
            "level with the best alone" if mean["validation_accuracy"] == alone else \
            f"within a standard error ({error:.2%}) of the best alone"
        weights = result.get("weights") or {}
        weighed = f" (weights {', '.join(f'{weights[m]:.2f}' for m in members)})" if set(weights) == set(members) \
            else ""
        return (f"the mean of {' and '.join(members)}{weighed}, validation accuracy "
                f"{result['validation_accuracy']:.2%}, {than} ({', '.join(said)})")
    if "validation_accuracy" in mean:
        said[-1] += (f"; their mean {mean['validation_accuracy']:.2%}, more than a standard error "
                     f"({error:.2%}) below {result['workload']}")
    return (f"{result['workload']}, the best validation accuracy of {len(result.get('candidates', []))} candidates "
            f"({', '.join(said)})")
