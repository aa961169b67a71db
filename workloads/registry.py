"""The workloads' registry: each one's data, model and loss (:class:`Workload`), by name
(:data:`WORKLOADS`, :func:`get`). It imports PyTorch; the package's names and kinds
(``gadei_workloads.KINDS``) do not, and the package imports this module on first use of one of
its names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import CANDIDATES, KINDS, ngram, numeric, specs, text
from .lstm import LSTMClassifier, build_lstm
from .ngram import NgramClassifier, build_ngram
from .numeric import build_mlp
from .text import TextDataset
from .textcnn import TextCNN, build_textcnn

__all__ = ["WORKLOADS", "Workload", "LSTMClassifier", "NgramClassifier", "TextCNN", "TextDataset", "build_lstm",
           "build_mlp", "build_ngram", "build_textcnn", "get"]


@dataclass(frozen=True)
class Workload:
    """One trainable task: how to get its data, its model and its loss.

    Attributes:
        name: Registry key.
        description: One line for people.
        default_data: Data spec used when the job names none (needs no files).
        load_data: ``spec -> (train, test)``, see :func:`.specs.load`.
        criterion: ``(logits, y) -> scalar loss`` to minimise (:meth:`loss` runs the model).
        evaluate: ``(model, dataset) -> accuracy`` in ``[0, 1]``.
        build_from_maps: ``(size, n_labels, seed) -> model``; size is the vocabulary's
            (text) or the feature count (numeric). ``gadei predict`` builds from the saved
            maps with it, :meth:`build_model` from the training set.
        kind: ``"text"`` (sentences: the text formats) or ``"numeric"`` (feature vectors:
            npz or numeric csv).
        batches: ``(dataset, batch, epoch=, seed=, shard=, shards=) -> (x, y)`` mini-batches.
        evaluation_batches: ``(model, dataset) -> (indices, x, y)`` batches, as :attr:`evaluate`
            takes the data: the evaluating learner's validation takes them so too, so that the
            validation accuracy a job chooses its model by is the model's as ``gadei predict``
            and the test set see it (:func:`.text.evaluation_batches`).
        tokens: What the vocabulary indexes of a sentence's words (a text workload; None: the
            words): the readers of a job file's data and ``gadei predict`` apply it before
            encoding (the n-gram workload's :func:`.ngram.ngrams`).
        max_vocab: The most ids of the vocabulary built from a job's training set.
        lr: The job file's default learning rate for this workload (None: the job file's own,
            0.01): what a step of the default update (Adagrad) should move the model by.
    """

    name: str
    description: str
    default_data: str
    load_data: Callable[[str], tuple[TextDataset, TextDataset]]
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module, TextDataset], float]
    build_from_maps: Callable[[int, int, int], nn.Module]
    kind: str = "text"
    batches: Callable = text.batches
    evaluation_batches: Callable = text.evaluation_batches
    tokens: Callable[[list[str]], list[str]] | None = None
    max_vocab: int = 20000
    lr: float | None = None

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mini-batch's loss (the model in its current mode)."""
        return self.criterion(model(x), y)

    def loss_and_correct(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mini-batch's loss and how many of its samples the same forward pass got right
        (the training accuracy a learner reports, at no extra cost), both 0-d tensors on the
        model's device: reading them (`.item()`) would wait for the GPU, so a learner adds
        them up there and reads the sums once an epoch."""
        logits = model(x)
        return self.criterion(logits, y), (logits.argmax(dim=1) == y).sum()

    def gradient(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 lr: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One training step's gradient: :meth:`loss_and_correct`, then :meth:`backward`; or,
        on the CPU, for a model that computes its cross-entropy gradient in closed form
        (``accumulate_grads``: the n-gram classifier), that, with the same result in ``.grad``
        at a fraction of autograd's cost. The loss and the count right, as
        :meth:`loss_and_correct` gives them."""
        closed = getattr(model, "accumulate_grads", None)
        if closed is not None and x.device.type == "cpu" and self.criterion is nn.functional.cross_entropy:
            return closed(x, y)
        loss, right = self.loss_and_correct(model, x, y)
        self.backward(model, loss, lr)
        return loss, right

    def backward(self, model: nn.Module, loss: torch.Tensor, lr: float | None) -> None:
        """``loss.backward()``, then the model's constraints as gradient corrections for an
        update ``w -= lr * g`` (a model with ``constrain_grads``, such as the text CNN's
        max-norm; see :meth:`.TextCNN.constrain_grads`). ``lr`` None: the update is not
        plain SGD (Adagrad, momentum) and no correction is added."""
        loss.backward()
        constrain = getattr(model, "constrain_grads", None)
        if constrain is not None and lr is not None:
            constrain(lr)

    def build_model(self, train, seed: int) -> nn.Module:
        """The model sized from the training set; the same seed gives bit-identical
        parameters in every process."""
        size = train.features if self.kind == "numeric" else len(train.vocab)
        return self.build_from_maps(size, train.n_labels, seed)


def _numeric_data(spec: str):
    raise ValueError(f"data spec {spec!r}: the mlp workload reads the data of a job file ('job:JOBFILE')")


WORKLOADS: dict[str, Workload] = {
    "textcnn": Workload(
        name="textcnn",
        description="Kim 2014 sentence CNN (CNN-rand) for text classification",
        default_data="generated",
        load_data=specs.load,
        criterion=nn.functional.cross_entropy,
        evaluate=text.accuracy,
        build_from_maps=lambda vocab_size, n_labels, seed: build_textcnn(vocab_size, n_labels, seed=seed),
    ),
    "lstm": Workload(
        name="lstm",
        description="bidirectional LSTM sentence classifier (max over time)",
        default_data="generated",
        load_data=specs.load,
        criterion=nn.functional.cross_entropy,
        evaluate=text.accuracy,
        build_from_maps=lambda vocab_size, n_labels, seed: build_lstm(vocab_size, n_labels, seed=seed),
    ),
    "ngram": Workload(
        name="ngram",
        description="fastText-style linear classifier over word uni- and bigrams (the mean of their rows)",
        default_data="generated",
        load_data=lambda spec: specs.load(spec, tokens=ngram.ngrams, max_size=ngram.MAX_VOCAB),
        criterion=nn.functional.cross_entropy,
        evaluate=text.accuracy,
        build_from_maps=lambda vocab_size, n_labels, seed: build_ngram(vocab_size, n_labels, seed=seed),
        tokens=ngram.ngrams,
        max_vocab=ngram.MAX_VOCAB,
        lr=ngram.LR,
    ),
    "mlp": Workload(
        name="mlp",
        description="multi-layer perceptron for numeric feature vectors (npz or numeric csv)",
        default_data="job:",
        load_data=_numeric_data,
        criterion=nn.functional.cross_entropy,
        evaluate=numeric.accuracy,
        build_from_maps=lambda features, n_labels, seed: build_mlp(features, n_labels, seed=seed),
        kind=KINDS["mlp"],
        batches=numeric.batches,
        evaluation_batches=numeric.evaluation_batches,
    ),
}


def get(name: str) -> Workload:
    """Returns the workload registered under ``name``.

    Raises:
        ValueError: If no workload has that name (the message lists the known ones).
    """
    try:
        return WORKLOADS[name]
    except KeyError:
        auto = (f" ('auto' is a job file's: the job trains {', '.join(CANDIDATES)} and keeps their mean or the "
                "better; here name one)" if name == "auto" else "")
        raise ValueError(
            f"workload {name!r} is unknown{auto}; known: {', '.join(sorted(WORKLOADS))}"
        ) from None
