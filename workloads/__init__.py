"""Workloads the parameter server trains: data, model and loss for each, by name.

A job names a workload (``"textcnn"``) and a data spec (``"generated"``,
``"trec:FOLDER"``); a learner gets the :class:`Workload` with :func:`get`, loads the
data, builds the model with the job's seed and calls the workload's loss per batch.

The names, their kinds and the candidates of a job that picks its model are here, without
PyTorch: a job file is checked without it (``gadei submit`` is a client of the daemon, which
reads the data). The rest (:class:`Workload`, :data:`WORKLOADS`, :func:`get`, the models) is
:mod:`.registry`'s, imported on first use.
"""

from __future__ import annotations

import importlib

KINDS = {"textcnn": "text", "lstm": "text", "ngram": "text", "mlp": "numeric"}
"""Each workload's name and what it reads: ``"text"`` (sentences: the text formats) or
``"numeric"`` (feature vectors: npz or numeric csv); :data:`.registry.WORKLOADS` has each."""

CANDIDATES = ("ngram", "textcnn")
"""The workloads a job picks its model among when its job file names none (``workload =
"auto"``): each is trained, cheapest first (:func:`.cost.cheapest_first`), and their mean is
handed back, or the one with the best validation accuracy where it beats the mean by more than a
standard error (``gadei.ensemble``)."""

_REGISTRY = ("WORKLOADS", "Workload", "LSTMClassifier", "NgramClassifier", "TextCNN", "TextDataset", "build_lstm",
             "build_mlp", "build_ngram", "build_textcnn", "get")
__all__ = ["CANDIDATES", "KINDS", *_REGISTRY, "ngram", "numeric", "specs", "text", "topics"]


def __getattr__(name: str):
    """The registry's names and the submodules, imported on first use (PEP 562)."""
    if name in _REGISTRY:
        return getattr(importlib.import_module(".registry", __name__), name)
    if name in ("ngram", "numeric", "specs", "text", "topics"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
