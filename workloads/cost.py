"""What training a workload on a data set costs, estimated from the data before anything trains:
the model's parameters and bytes, and the arithmetic of one sample's step. A job that trains
several candidate workloads (issue 47's `workload = "auto"`) orders them by it, cheapest
first; nothing here starts a process or knows of jobs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Estimate", "cheapest_first", "estimate"]


@dataclass(frozen=True)
class Estimate:
    """A workload's cost on one training set.

    Attributes:
        workload: The workload's name.
        parameters: The model's parameters (what the region holds, and each checkpoint).
        sparse_rows: Rows of its embedding table a sample touches on average (the rows a step
            moves through a ring, per sample; 0 for a dense model).
        flops_per_sample: Multiply-adds of one sample's forward pass (its backward costs about
            twice as much), the unit the candidates are ordered by.
        epoch_flops: ``flops_per_sample`` times the training samples.
        table: The rows and width of its embedding table where that table's gradient is
            sparse (it travels through the rings as the rows a step touched); ``(0, 0)``: none.
    """

    workload: str
    parameters: int
    sparse_rows: float
    flops_per_sample: float
    epoch_flops: float
    table: tuple[int, int] = (0, 0)

    @property
    def bytes(self) -> int:
        """The weights' bytes (float32); the server keeps as much again for Adagrad's sums."""
        return 4 * self.parameters


def estimate(name: str, train) -> Estimate:
    """The cost of workload ``name`` on ``train`` (a dataset of that workload: its ids are what
    the workload's vocabulary indexes; an ``ArrayDataset`` for ``mlp``).

    Raises:
        ValueError: If ``name`` is not a workload (the message lists them).
    """
    from . import get

    workload = get(name)
    model = workload.build_model(train, 0)
    parameters = sum(p.numel() for p in model.parameters())
    samples = len(train)
    if workload.kind == "numeric":
        flops = float(sum(m.weight.numel() for m in model.modules() if hasattr(m, "weight") and m.weight.dim() == 2))
        return Estimate(name, parameters, 0.0, flops, flops * samples)
    mean_len = sum(len(ids) for ids in train.ids) / max(1, samples)
    width = model.embedding.embedding_dim
    if name == "ngram":
        flops = mean_len * width + model.out.weight.numel()  # the mean of the rows, the linear layer
    elif name == "textcnn":
        convs = sum(conv.weight.numel() for conv in model.convs)  # filters x width x kernel, once a position
        flops = max(mean_len, model.min_len) * convs + model.out.weight.numel()
    else:
        dense = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embedding"))
        flops = mean_len * dense
    table = tuple(model.embedding.weight.shape) if model.embedding.sparse else (0, 0)
    return Estimate(name, parameters, mean_len, float(flops), float(flops) * samples, table)


def cheapest_first(estimates: list[Estimate]) -> list[Estimate]:
    """The estimates ordered by an epoch's arithmetic, then by parameters (the cheapest first)."""
    return sorted(estimates, key=lambda e: (e.epoch_flops, e.parameters))
