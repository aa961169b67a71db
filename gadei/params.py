"""The mapping between a PyTorch model's parameters and the region's one flat float32 array.

Parameters are laid end to end in `model.named_parameters()` order; the region records
their names and shapes (the spec) so an attacher with another model gets an error that
names the first parameter that differs. Buffers (e.g. batch-norm statistics) are not
shared: each learner keeps its own.
"""

import math

import numpy as np
import torch

from . import files
from .errors import RegionMismatch
from .layout import SparseTable

Spec = list[tuple[str, tuple[int, ...]]]


def spec_of(model: torch.nn.Module) -> Spec:
    """[(name, shape)] of `model`'s parameters, in the order they lie in the region."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def sparse_tables(model: torch.nn.Module, max_rows: int) -> tuple[SparseTable, ...]:
    """The embedding tables of `model` (nn.Embedding, nn.EmbeddingBag) as row-sparse tables."""
    offsets, offset = {}, 0
    for p in model.parameters():
        offsets[id(p)] = offset
        offset += p.numel()
    tables = []
    for module in model.modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and id(module.weight) in offsets:
            rows, width = module.weight.shape
            tables.append(SparseTable(offsets.pop(id(module.weight)), rows, width, max(1, min(max_rows, rows))))
    return tuple(sorted(tables, key=lambda t: t.offset))


def sparse_grads(model: torch.nn.Module) -> bool:
    """True when an embedding table of `model` makes sparse gradients (nn.Embedding or
    nn.EmbeddingBag with sparse=True): only the rows a mini-batch touched have a gradient."""
    return any(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse for m in model.modules())


def count(spec: Spec) -> int:
    """Number of scalars in `spec`."""
    return sum(math.prod(shape) for _, shape in spec)


def check_model(job: str, model: torch.nn.Module, device: torch.device | None = None) -> None:
    """Raise RegionMismatch unless every parameter is a float32 tensor on `device` (default: the CPU)."""
    device = torch.device("cpu") if device is None else device
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise RegionMismatch(f"job {job!r}: parameter {name!r} is {p.dtype}; gadei holds float32 weights")
        if p.device != device:
            raise RegionMismatch(
                f"job {job!r}: parameter {name!r} is on {p.device}, not on {device}: the whole model must be on "
                "the device it trains on (a Learner's device=, else its first parameter's; a Server's model: the CPU)"
            )


def compare(job: str, model_spec: Spec, region_spec: Spec | None, region_params: int) -> list[str]:
    """Raise RegionMismatch naming both sides where the model and the region differ.

    Shapes must agree one by one; names may differ (a wrapped or compiled model prefixes
    them), and the differing names are returned so the caller can warn.
    """
    n = count(model_spec)
    if n != region_params:
        raise RegionMismatch(f"job {job!r}: model has {n:,} parameters, region holds {region_params:,}")
    if region_spec is None:
        return []
    if len(model_spec) != len(region_spec):
        raise RegionMismatch(
            f"job {job!r}: model has {len(model_spec)} parameter tensors, region holds {len(region_spec)}"
        )
    renamed = []
    for i, ((name, shape), (rname, rshape)) in enumerate(zip(model_spec, region_spec)):
        if tuple(shape) != tuple(rshape):
            raise RegionMismatch(
                f"job {job!r}: parameter {i} {name!r} has shape {tuple(shape)} in the model, "
                f"{tuple(rshape)} ({rname!r}) in the region"
            )
        if name != rname:
            renamed.append(f"{name!r} (region: {rname!r})")
    return renamed


def views(flat: torch.Tensor, spec: Spec) -> list[torch.Tensor]:
    """Views of the 1-D tensor `flat`, one per parameter of `spec`, in order."""
    out, offset = [], 0
    for _, shape in spec:
        size = math.prod(shape)
        out.append(flat[offset : offset + size].view(shape))
        offset += size
    return out


def flatten_into(model: torch.nn.Module, flat: np.ndarray) -> None:
    """Copy `model`'s parameters into the float32 array `flat`, end to end."""
    target = torch.from_numpy(flat)
    with torch.no_grad():
        for view, p in zip(views(target, spec_of(model)), model.parameters()):
            view.copy_(p.detach())


def save(state: dict[str, torch.Tensor], path: str, private: bool = True) -> None:
    """Write a state dict that `torch.load(path, weights_only=True)` reads, atomically (a
    temporary file renamed over `path`). `private`: mode 0600 whatever the umask, as `gadei
    run` writes its model.pt (`gadei serve --save`, `gadei bridge --save`); False: the umask
    decides, as for a job file's `[output] private = false`."""
    files.replace(path, lambda out: torch.save(state, out), private=private)


def state_dict(spec: Spec, flat: np.ndarray) -> dict[str, torch.Tensor]:
    """A state dict (name -> tensor) of a copy of the weights in `flat` laid out by `spec`.

    The tensors are views of one copied buffer, which `torch.save` stores once.
    """
    source = torch.from_numpy(np.array(flat, dtype=np.float32, copy=True))
    return {name: view for (name, _), view in zip(spec, views(source, spec))}
