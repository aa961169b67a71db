"""What a push writes into a ring slot: `SlotWriter` writes a learner's gradients (or weights)
where the slot's format (gadei.transport.slot) says they lie, and gives the views of a slot a
model's gradients can be. It is the learner's one writer of a slot's row counts (a device push
stages the rows and has the writer store the counts)."""

import math

import torch

from ..errors import GadeiError
from ..params import Spec
from ..region import Region
from .slot import dense_area, dense_offset, sparse_area, store_rows


TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class SlotWriter:
    """Writes one learner's gradients (or, in elastic mode, its weights) into its slots.

    Dense parameters lie in a slot's dense area in the job's gradient dtype; a row-sparse
    table's gradient is written as its touched rows (coalesced: an index appears once).
    """

    def __init__(self, region: Region, learner: int, parameters: list, spec: Spec):
        shape = region.shape
        self.job = region.job
        self.parameters = parameters
        self.dtype = TORCH_DTYPES[shape.grad_dtype]
        self.aliasable = shape.grad_dtype == "float32"  # .grad may be the slot itself
        offsets, offset = [], 0
        for _, p_shape in spec:
            offsets.append(offset)
            offset += math.prod(p_shape)
        tables = {table.offset: i for i, table in enumerate(shape.sparse)}
        self.table_of = [tables.get(o) for o in offsets]  # parameter -> row-sparse table index or None
        self.names = [name for name, _ in spec]
        self.max_rows = [table.max_rows for table in shape.sparse]
        self._dense: list[list[torch.Tensor | None]] = []
        self._areas = []
        for slot in range(shape.slots):
            dense = torch.from_numpy(dense_area(region, learner, slot)).view(self.dtype)
            per_param = []
            for (name, p_shape), o, table in zip(spec, offsets, self.table_of):
                if table is not None:
                    per_param.append(None)
                    continue
                start = dense_offset(shape.dense_segments, o)
                per_param.append(dense[start : start + math.prod(p_shape)].view(p_shape))
            self._dense.append(per_param)
            areas = []
            for t in range(len(shape.sparse)):
                count_addr, indices, rows = sparse_area(region, learner, slot, t)
                areas.append((count_addr, torch.from_numpy(indices), torch.from_numpy(rows).view(self.dtype)))
            self._areas.append(areas)

    def grad_views(self, slot: int) -> list[torch.Tensor | None]:
        """What `.grad` of each parameter may be while backward writes into `slot` (None: private)."""
        if not self.aliasable:
            return [None] * len(self.parameters)
        return self._dense[slot]

    def write_grads(self, slot: int, grads: list[torch.Tensor | None]) -> None:
        """Put `grads` (one per parameter; None: zero) into `slot`, unless a gradient already is the slot."""
        for i, grad in enumerate(grads):
            if grad is None:
                continue
            table = self.table_of[i]
            if table is not None:
                self._write_rows(slot, i, table, grad)
                continue
            target = self._dense[slot][i]
            if grad.is_sparse:  # a sparse gradient of a table the job sends dense (the slot is zero)
                grad = grad.coalesce()
                target.index_copy_(0, grad.indices()[0], grad.values().to(target.dtype))
            elif grad.data_ptr() != target.data_ptr() or grad.dtype != target.dtype:
                target.copy_(grad)  # else backward accumulated into the slot itself

    def write_weights(self, slot: int) -> None:
        """Put the model's parameters into `slot` (float32, every parameter dense): elastic mode."""
        with torch.no_grad():
            for p, target in zip(self.parameters, self._dense[slot]):
                target.copy_(p)

    def rows_area(self, slot: int, table: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where row-sparse table `table`'s rows go in `slot`: (row indices, rows); their count
        is stored last, with `set_rows`, once they are in."""
        return self._areas[slot][table][1:]

    def set_rows(self, slot: int, table: int, count: int) -> None:
        """Store that `count` rows of table `table` are in `slot` (after the rows themselves)."""
        store_rows(self._areas[slot][table][0], count)

    def _write_rows(self, slot: int, param: int, table: int, grad: torch.Tensor) -> None:
        indices, rows = self.rows_area(slot, table)
        index, values = touched_rows(grad)
        count = index.numel()
        self.check_rows(param, table, count)
        indices[:count].copy_(index)
        rows[:count].copy_(values.reshape(count, -1))
        self.set_rows(slot, table, count)

    def check_rows(self, param: int, table: int, count: int) -> None:
        """Raise GadeiError if `count` rows of table `table` (parameter `param`) do not fit a slot."""
        if count > self.max_rows[table]:
            raise GadeiError(
                f"job {self.job!r}: one gradient touches {count:,} rows of {self.names[param]!r}, the job carries at "
                f"most {self.max_rows[table]:,} (give the job a larger [transport] max_rows, or its server --max-rows)"
            )


def touched_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, rows) of a row-sparse table's gradient: a sparse one coalesced (repeated rows
    summed), a dense one's rows that are not all zero. On a GPU this waits for the gradient
    (the count of rows sizes the result), so a device push finds them on its own stream."""
    if grad.is_sparse:
        grad = grad.coalesce()
        return grad.indices()[0], grad.values()
    index = grad.reshape(grad.shape[0], -1).ne(0).any(dim=1).nonzero().flatten()
    return index, grad[index]


def is_view_of_slot(grad: torch.Tensor, writer: SlotWriter) -> bool:
    return any(view is not None and view.data_ptr() == grad.data_ptr()
               for per_slot in writer._dense for view in per_slot)

