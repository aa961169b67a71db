"""Workloads the parameter server trains: data, model and loss for each, by name.

A job names a workload (``"textcnn"``) and a data spec (``"generated"``,
``"trec:FOLDER"``); a learner gets the :class:`Workload` with :func:`get`, loads the
data, builds the model with the job's seed and calls the workload's loss per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import text
from .text import TextDataset
from .lstm import LSTMClassifier, build_lstm
from .textcnn import TextCNN, build_textcnn

__all__ = ["WORKLOADS", "Workload", "LSTMClassifier", "TextCNN", "TextDataset", "build_lstm", "build_textcnn", "get",
           "text"]


@dataclass(frozen=True)
class Workload:
    """One trainable task: how to get its data, its model and its loss.

    Attributes:
        name: Registry key.
        description: One line for people.
        default_data: Data spec used when the job names none (needs no files).
        load_data: ``spec -> (train, test)``, see :func:`.text.load`.
        build_model: ``(train, seed) -> model``, sized from the training set; the same
            seed gives bit-identical parameters in every process.
        loss: ``(model, x, y) -> scalar loss`` to minimise.
        evaluate: ``(model, dataset) -> accuracy`` in ``[0, 1]``.
        build_from_maps: ``(vocab_size, n_labels, seed) -> model``: the same model from
            the saved vocabulary and label maps (``gadei predict``), without the data.
    """

    name: str
    description: str
    default_data: str
    load_data: Callable[[str], tuple[TextDataset, TextDataset]]
    build_model: Callable[[TextDataset, int], nn.Module]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module, TextDataset], float]
    build_from_maps: Callable[[int, int, int], nn.Module]


def _build_textcnn(train: TextDataset, seed: int) -> nn.Module:
    return build_textcnn(len(train.vocab), train.n_labels, seed=seed)


def _build_lstm(train: TextDataset, seed: int) -> nn.Module:
    return build_lstm(len(train.vocab), train.n_labels, seed=seed)


def _cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


WORKLOADS: dict[str, Workload] = {
    "textcnn": Workload(
        name="textcnn",
        description="Kim 2014 sentence CNN (CNN-rand) for text classification",
        default_data="generated",
        load_data=text.load,
        build_model=_build_textcnn,
        loss=_cross_entropy,
        evaluate=text.accuracy,
        build_from_maps=lambda vocab_size, n_labels, seed: build_textcnn(vocab_size, n_labels, seed=seed),
    ),
    "lstm": Workload(
        name="lstm",
        description="bidirectional LSTM sentence classifier (max over time)",
        default_data="generated",
        load_data=text.load,
        build_model=_build_lstm,
        loss=_cross_entropy,
        evaluate=text.accuracy,
        build_from_maps=lambda vocab_size, n_labels, seed: build_lstm(vocab_size, n_labels, seed=seed),
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
        raise ValueError(
            f"workload {name!r} is unknown; known: {', '.join(sorted(WORKLOADS))}"
        ) from None
