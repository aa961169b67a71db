"""Numeric-array classification: feature vectors in, labels out (the `mlp` workload).

Data: an NPZ file with arrays `x` (samples x features, numbers) and `y` (one label per
sample, numbers or strings), or a CSV file whose `label_column` (a header name, or a number
from 1 with or without a header) is the label and every other column a numeric feature.
Features are standardised with the training set's mean and standard deviation (kept with the
dataset, and in a run's `features.json`).
The mini-batch order follows the text workloads' contract (see :func:`batches`).
"""

from __future__ import annotations

import itertools
import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import nn

from .files import DataError, FileReport, check_data_file, column_index, decode, table_rows

__all__ = ["ArrayDataset", "MLP", "accuracy", "batches", "build_mlp", "read_arrays"]


@dataclass
class ArrayDataset:
    """Standardised features and label ids.

    Attributes:
        x: float32 ``[N, D]``, standardised.
        labels: label id per sample, into ``label_names``.
        label_names: label strings (shared by train and test).
        mean, std: the training set's feature statistics the features were standardised with.
        name: where the data came from, for logs.
    """

    x: np.ndarray
    labels: np.ndarray
    label_names: list[str]
    mean: np.ndarray
    std: np.ndarray
    name: str = ""
    vocab: None = field(default=None, repr=False)  # text workloads' field; none here

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def n_labels(self) -> int:
        return len(self.label_names)

    @property
    def features(self) -> int:
        return self.x.shape[1]


def read_arrays(path: Path, fmt: str, label_column: str | int, header: bool = True, encoding: str = "utf-8",
                fallback: str | None = None, reports: list[FileReport] | None = None) -> tuple[np.ndarray, list[str]]:
    """(features [N, D] float64, label strings) of one file; DataError naming file and line.
    A CSV file is read by the rules of `files.table_rows` (its FileReport goes to `reports`)."""
    if fmt == "npz":
        check_data_file(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                missing = [k for k in ("x", "y") if k not in data.files]
                if missing:
                    raise DataError(f"{path}: an NPZ data file needs arrays 'x' (samples x features) and 'y' "
                                    f"(labels); it has {', '.join(data.files) or 'none'}")
                x, y = np.asarray(data["x"]), np.asarray(data["y"])
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise DataError(f"{path}: not a readable NPZ file ({err})") from None
        if x.ndim != 2 or y.ndim != 1 or len(x) != len(y):
            raise DataError(f"{path}: 'x' must be samples x features and 'y' one label per sample; got shapes "
                            f"{x.shape} and {y.shape}")
        if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
            raise DataError(f"{path}: 'x' holds {x.dtype}, not numbers")
        for name, array in (("x", x), ("y", y)):  # a cast to float would drop the imaginary parts
            if np.iscomplexobj(array):
                raise DataError(f"{path}: {name!r} holds complex numbers ({array.dtype}); features and labels are real")
        x = x.astype(np.float64)
        labels = [str(v) for v in y.tolist()]
    elif fmt == "csv":
        report = FileReport(path)
        found = table_rows(path, decode(path, encoding, fallback, report), "csv", report)
        first = next(found, None)
        if first is None:
            raise DataError(f"{path}: no samples")
        names = [name.strip() for name in first[1]] if header else None
        width = len(first[1])
        at = column_index(path, names, "label_column", label_column)
        if at >= width:
            raise DataError(f"{path}: [data] label_column = {at + 1}, but the first row has {width} columns")
        names = names or [f"column {i + 1}" for i in range(width)]
        rows, labels = [], []
        for lineno, row in (found if header else itertools.chain([first], found)):
            if len(row) != width:
                raise DataError(f"{path}:{lineno}: {len(row)} fields, the " + ("header" if header else "first row")
                                + f" has {width}")
            values = []
            for column, cell in enumerate(row):
                if column == at:
                    continue
                try:
                    values.append(float(cell))
                except ValueError:
                    raise DataError(f"{path}:{lineno}: column {names[column]!r} holds {cell[:40]!r}, not a "
                                    "number (every column but the label is a feature)") from None
            rows.append(values)
            labels.append(row[at].strip())
        x = np.array(rows, dtype=np.float64).reshape(len(rows), width - 1)
        report.samples = len(rows)
        if reports is not None:
            reports.append(report)
    else:
        raise DataError(f"format {fmt!r}: numeric workloads read npz or csv")
    if len(labels) == 0:
        raise DataError(f"{path}: no samples")
    if x.shape[1] == 0:
        raise DataError(f"{path}: no features (every sample is a label alone); the MLP needs at least one")
    if not np.isfinite(x).all():
        bad = int(np.argwhere(~np.isfinite(x))[0][0])
        raise DataError(f"{path}: sample {bad + 1} has a feature that is NaN or infinite")
    return x, labels


def make_split(train: tuple[np.ndarray, list[str]], test: tuple[np.ndarray, list[str]], *, name: str,
               test_source: str, split: str = "test") -> tuple[ArrayDataset, ArrayDataset]:
    """Datasets from (features, labels): label map and feature statistics from train (`split`
    names the other one: test or validation)."""
    (xtr, ytr), (xte, yte) = train, test
    if xtr.shape[1] != xte.shape[1]:
        raise DataError(f"{test_source}: {xte.shape[1]} features, the training set has {xtr.shape[1]}")
    names = sorted(set(ytr))
    ids = {label: i for i, label in enumerate(names)}
    unknown = sorted(set(yte) - set(ids))
    if unknown:
        raise DataError(f"{test_source}: label {unknown[0]!r} does not occur in the training set "
                        f"(known: {', '.join(names)})")
    mean = xtr.mean(axis=0)
    std = xtr.std(axis=0)
    std[std == 0] = 1.0

    def make(x, y, split):
        return ArrayDataset(((x - mean) / std).astype(np.float32), np.array([ids[v] for v in y], dtype=np.int64),
                            names, mean, std, name=f"{name} ({split})")

    return make(xtr, ytr, "train"), make(xte, yte, split)


def hold_out(data: tuple[np.ndarray, list[str]], fraction: float, seed: int, stream: int = 7919):
    """(train, held out) with `fraction` of each label held out (as :func:`.text.hold_out`)."""
    from .text import hold_out as rows_hold_out

    x, labels = data
    rows = [([str(i)], label) for i, label in enumerate(labels)]
    train, test = rows_hold_out(rows, fraction, seed, stream)
    pick = lambda part: (x[[int(r[0][0]) for r in part]], [r[1] for r in part])  # noqa: E731
    return pick(train), pick(test)


def batches(dataset: ArrayDataset, batch_size: int, *, epoch: int, seed: int, shard: int = 0, shards: int = 1,
            **_) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of one shard: the order is a permutation seeded by (seed, epoch), shard i of
    n takes positions i, i+n, ... (as the text workloads' batches)."""
    if batch_size < 1 or shards < 1 or not 0 <= shard < shards or epoch < 0 or seed < 0:
        raise ValueError(f"batches: batch {batch_size}, shard {shard}/{shards}, epoch {epoch}, seed {seed}")
    order = np.random.default_rng([seed, epoch]).permutation(len(dataset))[shard::shards]
    for start in range(0, len(order), batch_size):
        idx = order[start: start + batch_size]
        yield torch.from_numpy(dataset.x[idx]), torch.from_numpy(dataset.labels[idx])


def evaluation_batches(model: nn.Module, dataset: ArrayDataset,
                       batch_size: int = 1024) -> Iterator[tuple[range, torch.Tensor, torch.Tensor]]:
    """``(indices, x, y)``: ``dataset`` in order, in batches, as every evaluation takes it
    (:func:`accuracy`, the evaluating learner's validation; as the text workloads')."""
    for start in range(0, len(dataset), batch_size):
        end = min(start + batch_size, len(dataset))
        yield range(start, end), torch.from_numpy(dataset.x[start:end]), torch.from_numpy(dataset.labels[start:end])


def accuracy(model: nn.Module, dataset: ArrayDataset, batch_size: int = 1024) -> float:
    was_training = model.training
    model.eval()
    correct = 0
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for _, x, y in evaluation_batches(model, dataset, batch_size):
                correct += int((model(x.to(device)).argmax(dim=1).cpu() == y).sum())
    finally:
        model.train(was_training)
    return correct / max(1, len(dataset))


class MLP(nn.Module):
    """features -> Linear(hidden) -> ReLU -> dropout -> Linear(hidden // 2) -> ReLU -> Linear(labels)."""

    def __init__(self, features: int, n_labels: int, hidden: int = 256, dropout: float = 0.2):
        super().__init__()
        if features < 1 or n_labels < 1 or hidden < 2:
            raise ValueError(f"MLP: features {features}, labels {n_labels} and hidden {hidden} must be positive")
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, hidden // 2), nn.ReLU(), nn.Linear(hidden // 2, n_labels))
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_mlp(features: int, n_labels: int, seed: int = 0, **kw) -> MLP:
    """An :class:`MLP` whose initial parameters depend only on the arguments."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MLP(features, n_labels, **kw)
