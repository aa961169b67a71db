"""A ring slot's format: where a gradient lies in a slot (dense area, row-sparse tables' row
indices, rows and row counts: `payload_addr`, `dense_area`, `sparse_area`, the one maker of
views over a slot's payload), what the server reads of it once per gradient when it takes it
(`SlotFormat.take`: the slot header and the row counts, checked there, with one message each),
and the kernels that apply it to float32 arrays. Torch-free: the server's side; a learner's
`SlotWriter` (gadei.transport.writer) writes into it, and is with this module the only writer
of a row count (tests/test_owners.py holds it)."""

from dataclasses import dataclass

import numpy as np

from .. import _native
from ..errors import RegionCorrupt
from ..layout import DTYPE_CODES, GRADIENT, MAX_SAMPLES, MOVE, SparseTable
from ..region import Region

_F32 = DTYPE_CODES["float32"]
# NumPy element types of gradient slots; NumPy has no bfloat16, so its bits travel as uint16.
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@dataclass(frozen=True)
class Gradient:
    """One consumed slot: where its payload is and what the learner said about it.

    Attributes:
        learner: the learner entry it came from.
        payload: address of the slot's payload.
        version: the weights version it was computed on.
        samples: mini-batch size it was computed from.
        staleness: updates applied since `version`, when it is applied.
        move: a bridge's move (slot kind MOVE): the weights move by -payload, whatever the
            update rule (no learning rate, momentum, optimizer state, staleness scaling or
            bound), so that the move lands as the bridge computed it.
        rows: the rows each row-sparse table of the gradient carries, read and checked once
            when the slot was taken (the kernels use these, not the slot's counts again).
    """

    learner: int
    payload: int
    version: int
    samples: int
    staleness: int = 0
    move: bool = False
    rows: tuple[int, ...] = ()


def dense_offset(segments, offset: int) -> int:
    """Where weight `offset` lies in a slot's dense area (its dense segments: start, length, slot)."""
    for start, length, slot in segments:
        if start <= offset < start + length:
            return slot + offset - start
    raise ValueError(f"weight offset {offset} is in no dense segment")


def _payload(region: Region, learner: int, slot: int) -> int:
    """Byte offset in the region of slot `slot`'s payload in learner `learner`'s ring."""
    shape = region.shape
    if not (0 <= learner < shape.capacity and 0 <= slot < shape.slots):
        raise IndexError(f"job {region.job!r}: slot {slot} of learner {learner} is outside learners "
                         f"0..{shape.capacity - 1}, slots 0..{shape.slots - 1}")
    return region.layout.payload(learner, slot)


def payload_addr(region: Region, learner: int, slot: int) -> int:
    """Address of the payload of slot index `slot` of learner `learner`'s ring."""
    return region.base + _payload(region, learner, slot)


def dense_area(region: Region, learner: int, slot: int) -> np.ndarray:
    """NumPy view of the dense area of a slot, in the gradient dtype (bfloat16 as uint16)."""
    shape = region.shape
    return region.array(_payload(region, learner, slot), shape.dense_count, NUMPY_DTYPES[shape.grad_dtype])


def sparse_area(region: Region, learner: int, slot: int, table: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(address of the row count, row indices view, rows view) of row-sparse table `table` in a
    slot; only a slot's writer (gadei.transport.writer) stores the count, with `store_rows`."""
    spec, area = region.shape.sparse[table], region.layout.sparse_areas[table]
    base = _payload(region, learner, slot)
    indices = region.array(base + area.indices, spec.max_rows, np.int64)
    rows = region.array(base + area.rows, spec.max_rows * spec.width, NUMPY_DTYPES[region.shape.grad_dtype])
    return region.base + base + area.count, indices, rows.reshape(spec.max_rows, spec.width)


def store_rows(count_addr: int, count: int) -> None:
    """Store a table's row count in a slot (a writer does it last, once the rows are in)."""
    _native.store64(count_addr, count)


def clear(region: Region, learner: int, slot: int) -> None:
    """Zero a whole slot's payload, row counts included (a claim does it to a previous owner's
    unpublished slot, once nothing is in flight)."""
    _native.zero(payload_addr(region, learner, slot), nbytes=region.layout.payload_bytes)


class SlotFormat:
    """The layout of one gradient in a slot, what the server reads of a slot it takes, and the
    kernels that apply a gradient to float32 arrays."""

    def __init__(self, region: Region, threads: int):
        shape, lay = region.shape, region.layout
        self.dtype = DTYPE_CODES[shape.grad_dtype]
        self.itemsize = shape.grad_itemsize
        self.segments = shape.dense_segments
        self.tables: tuple[SparseTable, ...] = shape.sparse
        self.areas = lay.sparse_areas
        self.dense_count = shape.dense_count
        self.dense_bytes = shape.dense_count * self.itemsize
        self.n = shape.n_params
        self.threads = threads
        self.job = region.job
        self._region = region
        self._headers = [[region.slot_header(i, k) for k in range(shape.slots)] for i in range(shape.capacity)]
        self._payloads = [[payload_addr(region, i, k) for k in range(shape.slots)] for i in range(shape.capacity)]

    def take(self, learner: int, slot: int, version: int) -> Gradient:
        """The gradient in slot `slot` of `learner`'s ring (published, taken by the server),
        applied at weights version `version`: its header and row counts, read and checked once.

        Raises:
            RegionCorrupt: the header's samples or kind, or a row count, is out of range.
        """
        header = self._headers[learner][slot]
        computed_on, samples, kind = header.get("version"), header.get("samples"), header.get("kind")
        if samples >= MAX_SAMPLES or kind not in (GRADIENT, MOVE):
            name, value, allowed = ("samples", samples, f"0..{MAX_SAMPLES - 1:,}") if samples >= MAX_SAMPLES else \
                ("kind", kind, f"{GRADIENT} (gradient) or {MOVE} (move)")
            raise RegionCorrupt(f"job {self.job!r}: learner ring {learner}: slot {slot}'s {name} is {value:,}, "
                                f"allowed {allowed}: the slot is corrupt")
        payload = self._payloads[learner][slot]
        rows = tuple(_native.load64(payload + area.count) for area in self.areas) if self.areas else ()
        for table, count in zip(self.tables, rows):
            if count > table.max_rows:
                raise RegionCorrupt(f"job {self.job!r}: learner ring {learner}: slot {slot}'s row count of a "
                                    f"row-sparse table is {count:,}, allowed 0..{table.max_rows:,}: the slot is "
                                    "corrupt")
        # Only an update moves the version, and a taken gradient is applied by the next one.
        return Gradient(learner, payload, computed_on, samples, max(0, version - computed_on), kind == MOVE, rows)

    def bytes_in(self, grad: Gradient) -> int:
        """Gradient bytes `grad` carries (what a learner moved into the slot)."""
        rows = sum(count * (8 + table.width * self.itemsize) for count, table in zip(grad.rows, self.tables))
        return self.dense_bytes + rows

    def nonfinite(self, grad: Gradient) -> int:
        """How many values of `grad` are NaN or infinite (read only; the native check, GIL released)."""
        bad = _native.nonfinite(grad.payload, dtype=self.dtype, n=self.dense_count, threads=self.threads)
        for area, table, count in zip(self.areas, self.tables, grad.rows):
            bad += _native.nonfinite(grad.payload + area.rows, dtype=self.dtype, n=count * table.width, threads=1)
        return bad

    def indices_in(self, grad: Gradient) -> list[np.ndarray]:
        """A copy of the row indices each row-sparse table of `grad` carries."""
        region = self._region
        return [region.array(grad.payload - region.base + area.indices, count, np.int64).copy()
                for area, count in zip(self.areas, grad.rows)]

    def discard(self, payload: int) -> None:
        """Hand the slot at `payload` back without applying it: dense area zeroed, no rows."""
        _native.zero(payload, nbytes=self.dense_bytes)
        for area in self.areas:
            _native.store64(payload + area.count, 0)

    def sgd(self, weights: int, grad: Gradient, lr: float, *, clear: bool = True) -> None:
        """weights -= lr * gradient, in place (lr < 0 adds). Zeroes the slot with `clear`."""
        for offset, length, slot in self.segments:
            _native.sgd(weights + 4 * offset, grad.payload + self.itemsize * slot, dtype=self.dtype, n=length, lr=lr,
                        clear=int(clear), threads=self.threads)
        self._rows(weights, 0, grad, lr, clear)

    def adagrad(self, weights: int, state: int, grad: Gradient, lr: float, eps: float, *, clear: bool = True) -> None:
        """s += g^2; weights -= lr g / (sqrt(s) + eps), in place, where g is not zero (tables:
        only the rows the gradient carries)."""
        for offset, length, slot in self.segments:
            _native.adagrad(weights + 4 * offset, state + 4 * offset, grad.payload + self.itemsize * slot,
                            dtype=self.dtype, n=length, lr=lr, eps=eps, clear=int(clear), threads=self.threads)
        self._rows(weights, state, grad, lr, clear, "adagrad", eps=eps)

    def adam(self, weights: int, state: int, grad: Gradient, lr: float, step: int,
             betas: tuple[float, float, float], *, clear: bool = True) -> None:
        """Adam at step `step` with `betas` (beta1, beta2, eps), in place, its moments m at
        `state` and v n weights after: every dense weight moves (a zero gradient decays m and v
        too), a row-sparse table only in the rows the gradient carries (lazy Adam, as
        torch.optim.SparseAdam)."""
        second = state + 4 * self.n
        for offset, length, slot in self.segments:
            _native.adam(weights + 4 * offset, state + 4 * offset, second + 4 * offset,
                         grad.payload + self.itemsize * slot, dtype=self.dtype, n=length, lr=lr, beta1=betas[0],
                         beta2=betas[1], eps=betas[2], step=step, clear=int(clear), threads=self.threads)
        self._rows(weights, state, grad, lr, clear, "adam", step, betas)

    def momentum(self, weights: int, state: int, grad: Gradient, lr: float, mu: float, *, clear: bool = True) -> None:
        """v = mu v + gradient; weights -= lr v, in place over every weight (tables too)."""
        for offset, length, slot in self.segments:
            _native.momentum(weights + 4 * offset, state + 4 * offset, grad.payload + self.itemsize * slot,
                             dtype=self.dtype, n=length, lr=lr, mu=mu, clear=int(clear), threads=self.threads)
        for table in self.tables:  # the table's v decays everywhere; touched rows are added below
            _native.momentum(weights + 4 * table.offset, state + 4 * table.offset, 0, dtype=self.dtype, n=table.size,
                             lr=lr, mu=mu, clear=0, threads=self.threads)
        self._rows(weights, state, grad, lr, clear)

    def _rows(self, weights: int, state: int, grad: Gradient, lr: float, clear: bool, rule: str = "sgd",
              step: int = 0, betas: tuple[float, float, float] = (0.0, 0.0, 0.0), eps: float = 0.0) -> None:
        payload = grad.payload
        for table, area, count in zip(self.tables, self.areas, grad.rows):
            if count == 0:
                continue
            if rule == "adam":
                bad = _native.adam_rows(weights + 4 * table.offset, state + 4 * table.offset,
                                        state + 4 * (self.n + table.offset), n_rows=table.rows, width=table.width,
                                        idx=payload + area.indices, rows=payload + area.rows, dtype=self.dtype,
                                        count=count, lr=lr, beta1=betas[0], beta2=betas[1], eps=betas[2], step=step)
            elif rule == "adagrad":
                bad = _native.adagrad_rows(weights + 4 * table.offset, state + 4 * table.offset, n_rows=table.rows,
                                           width=table.width, idx=payload + area.indices, rows=payload + area.rows,
                                           dtype=self.dtype, count=count, lr=lr, eps=eps)
            else:
                bad = _native.sgd_rows(weights + 4 * table.offset, state + 4 * table.offset if state else 0,
                                       n_rows=table.rows, width=table.width, idx=payload + area.indices,
                                       rows=payload + area.rows, dtype=self.dtype, count=count, lr=lr)
            if clear:
                _native.store64(payload + area.count, 0)
            if bad:
                raise RegionCorrupt(f"job {self.job!r}: a gradient named {bad:,} row indices outside the table's "
                                    f"0..{table.rows - 1:,}: the slot is corrupt")


class Float32Dense:
    """The slot format of a plain float32 array of n elements: the sync round's sum (and, in its
    Adam, one dense part of the weights or one table), an elastic slot's weights, the weights a
    pull or a bridge copies out, and the kernel benchmarks' buffers (which time the kernels
    through these methods, and against `plain_sgd`)."""

    def __init__(self, n: int, threads: int):
        self.n, self.threads = n, threads

    def sgd(self, weights: int, payload: int, lr: float, *, clear: bool = True) -> None:
        """weights -= lr * payload, in place; zeroes the payload with `clear`."""
        _native.sgd(weights, payload, dtype=_F32, n=self.n, lr=lr, clear=int(clear), threads=self.threads)

    def momentum(self, weights: int, state: int, payload: int, lr: float, mu: float) -> None:
        """v = mu v + payload; weights -= lr v, in place (v at `state`); zeroes the payload."""
        _native.momentum(weights, state, payload, dtype=_F32, n=self.n, lr=lr, mu=mu, clear=1, threads=self.threads)

    def adagrad(self, weights: int, state: int, payload: int, lr: float, eps: float, *, clear: bool = True) -> None:
        """s += g^2; weights -= lr g / (sqrt(s) + eps) where g is not zero (s at `state`)."""
        _native.adagrad(weights, state, payload, dtype=_F32, n=self.n, lr=lr, eps=eps, clear=int(clear),
                        threads=self.threads)

    def adam(self, weights: int, m: int, v: int, payload: int, lr: float, step: int,
             betas: tuple[float, float, float], *, clear: bool = True) -> None:
        """Adam at step `step` with `betas` (beta1, beta2, eps), its moments at `m` and `v`."""
        _native.adam(weights, m, v, payload, dtype=_F32, n=self.n, lr=lr, beta1=betas[0], beta2=betas[1],
                     eps=betas[2], step=step, clear=int(clear), threads=self.threads)

    def adam_rows(self, weights: int, m: int, v: int, indices: np.ndarray, rows: np.ndarray, lr: float, step: int,
                  betas: tuple[float, float, float]) -> int:
        """Lazy Adam on a table of n floats, n / width rows of `width`: only the rows `indices`
        (int64) move, by their gradients `rows` (float32, one row of `width` per index), with
        their moments at `m` and `v`. How many indices were out of range (their rows unapplied).

        Raises:
            ValueError: `indices` and `rows` are not contiguous int64 and float32 arrays of one
                index per row, or the width does not divide n.
        """
        if not (indices.dtype == np.int64 and indices.ndim == 1 and indices.flags.c_contiguous
                and rows.dtype == np.float32 and rows.ndim == 2 and rows.flags.c_contiguous
                and len(rows) == len(indices) and rows.shape[1] and self.n % rows.shape[1] == 0):
            raise ValueError(f"adam_rows: {len(indices)} int64 indices and as many contiguous float32 rows of a width "
                             f"that divides {self.n:,} wanted; got indices {indices.dtype} {indices.shape}, rows "
                             f"{rows.dtype} {rows.shape}")
        width = rows.shape[1]
        return _native.adam_rows(weights, m, v, n_rows=self.n // width, width=width, idx=int(indices.ctypes.data),
                                 rows=int(rows.ctypes.data), dtype=_F32, count=len(indices), lr=lr, beta1=betas[0],
                                 beta2=betas[1], eps=betas[2], step=step)

    def elastic(self, centre: int, weights: int, alpha: float) -> None:
        """centre += alpha (weights - centre), in place over the n floats at `centre`: a
        learner's weights move the centre (elastic averaging); `weights` are left as they are."""
        _native.elastic(centre, weights, n=self.n, alpha=alpha, threads=self.threads)

    def nonfinite(self, payload: int) -> int:
        """How many of the n values at `payload` are NaN or infinite (the server's check, read only)."""
        return _native.nonfinite(payload, dtype=_F32, n=self.n, threads=self.threads)

    def copy(self, target: int, source: int) -> None:
        """Copy the n floats at `source` to `target`, on this thread alone (a pull's copy of the
        weights runs beside training: it takes no kernel threads)."""
        _native.copy(target, source, nbytes=4 * self.n, threads=1)

    def plain_sgd(self, weights: int, payload: int, lr: float) -> None:
        """weights -= lr * payload as a plain C loop: what `gadei bench kernel` holds `sgd` against."""
        _native.plain_sgd(weights, payload, n=self.n, lr=lr, threads=self.threads)


def openmp() -> tuple[bool, int]:
    """Whether the kernels were built with OpenMP, and the processors it sees (a benchmark's record)."""
    return _native.openmp()
