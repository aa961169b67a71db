"""A learner's transports: how its gradients reach its ring (push) and weights reach its model (pull).

Each direction is one interface with several implementations, chosen per learner:

push
    `publish` (CPU default): where the job's gradients are float32, the model's `.grad`
        tensors are views of the free ring slot, so backward accumulates straight into
        shared memory and pushing is publishing the slot (two atomic stores). Row-sparse
        tables and float16/bfloat16 gradients are written into the slot by the train thread
        at `step()` (only the touched rows; a converting copy).
    `thread` (the paper's push thread): backward writes private gradients; a push thread
        writes the finished one into the free slot and publishes it while the train thread
        goes on with the next step. One item in flight.
    `weights` (elastic mode): local SGD steps on a private model; every tau steps the
        model's weights go into the slot and the model moves towards the centre.
    `device` (GPU learners; also runs on a CPU "device"): after backward the train thread
        copies the gradients, on the model's device, into one of two device staging buffers
        (converted there to the ring's float16/bfloat16) and goes on; a push thread copies
        the staged gradient into the free slot on its own CUDA stream, waits for that
        stream, and publishes.

pull
    `view` (default): the model's parameters are views of the region's weights (Hogwild,
        no copies); the server's updates show up in the model as they happen.
    `copy`: a pull thread copies the weights into a private staging buffer whenever the
        server's version moved, and the train thread swaps it in between steps (a pointer
        swap); at most one pull per step. In consistent mode the copy is taken inside the
        server's seqlock, so it never holds half an update.
    `local` (elastic mode): the model is private; it starts from the centre.
    `device` (GPU learners; also runs on a CPU "device"): `copy` with device buffers: the
        pull thread copies new weights from the (page-locked) region into a device staging
        buffer on its own stream; the train thread swaps it in between steps.

`SlotWriter` is the one place that knows a slot's format (the device push lays its staging
buffer out as a slot's dense area and hands table rows to the writer's areas).

Every hand-off between the train thread and a push or pull thread holds at most one item,
every wait on it is cut into WAIT_SLICE pieces that look for an error or a shutdown, and
an error in a helper thread is raised in the train thread at its next step.
"""

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from typing import Callable, ClassVar

import torch

from . import _native
from . import device as _device
from .errors import GadeiError
from .modes import Options
from .params import Spec, views
from .region import Region
from .ring import WAIT_SLICE, Producer

log = logging.getLogger(__name__)

_U32 = 0xFFFFFFFF
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _Handoff:
    """A transport's background thread and the condition guarding its one-item hand-off."""

    def __init__(self, target, name: str):
        self.cond = threading.Condition()
        self.closing = False
        self.thread = threading.Thread(target=target, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Tell the thread to finish what it holds and end; wait for it (bounded)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.thread.join(timeout=10 * WAIT_SLICE + 5)


def _flat(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32)


def _addr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


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
            dense = torch.from_numpy(region.dense(learner, slot)).view(self.dtype)
            per_param = []
            for (name, p_shape), o, table in zip(spec, offsets, self.table_of):
                if table is not None:
                    per_param.append(None)
                    continue
                start = _dense_offset(shape.dense_segments, o)
                per_param.append(dense[start : start + math.prod(p_shape)].view(p_shape))
            self._dense.append(per_param)
            areas = []
            for t in range(len(shape.sparse)):
                count_addr, indices, rows = region.sparse_area(learner, slot, t)
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

    def rows_area(self, slot: int, table: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Where row-sparse table `table`'s rows go in `slot`: (address of the row count,
        indices, rows); the count is stored last, once the rows are in."""
        return self._areas[slot][table]

    def _write_rows(self, slot: int, param: int, table: int, grad: torch.Tensor) -> None:
        count_addr, indices, rows = self.rows_area(slot, table)
        if grad.is_sparse:
            grad = grad.coalesce()
            index, values = grad.indices()[0], grad.values()
        else:  # a dense gradient of a row-sparse table: send the rows that are not zero
            index = grad.reshape(grad.shape[0], -1).ne(0).any(dim=1).nonzero().flatten()
            values = grad[index]
        count = index.numel()
        self.check_rows(param, table, count)
        indices[:count].copy_(index)
        rows[:count].copy_(values.reshape(count, -1))
        _native.store64(count_addr, count)


    def check_rows(self, param: int, table: int, count: int) -> None:
        """Raise GadeiError if `count` rows of table `table` (parameter `param`) do not fit a slot."""
        if count > self.max_rows[table]:
            raise GadeiError(
                f"job {self.job!r}: one gradient touches {count:,} rows of {self.names[param]!r}, the job carries at "
                f"most {self.max_rows[table]:,} (serve it with a larger --max-rows)"
            )


def _is_view_of_slot(grad: torch.Tensor, writer: SlotWriter) -> bool:
    return any(view is not None and view.data_ptr() == grad.data_ptr()
               for per_slot in writer._dense for view in per_slot)


def _dense_offset(segments, offset: int) -> int:
    for start, length, slot in segments:
        if start <= offset < start + length:
            return slot + offset - start
    raise ValueError(f"weight offset {offset} is in no dense segment")


class Push(ABC):
    """How a learner's finished gradient reaches its ring.

    Args:
        region: the job's region.
        producer: this learner's end of its ring.
        parameters: the model's parameters, in region order.
        spec: their names and shapes.
        on_slice: called every WAIT_SLICE while blocked; raises to end the wait.
        options: the job's options.
    """

    name: ClassVar[str]

    def __init__(self, region: Region, producer: Producer, parameters: list, spec: Spec,
                 on_slice: Callable[[], None], options: Options):
        self.region = region
        self.producer = producer
        self.parameters = parameters
        self.spec = spec
        self.on_slice = on_slice
        self.options = options
        self.writer = SlotWriter(region, producer.learner, parameters, spec)
        self._warned = False

    @abstractmethod
    def bind(self) -> None:
        """Point every parameter's `.grad` where the next backward pass should accumulate."""

    @abstractmethod
    def push(self, version: int, step: int, samples: int) -> bool:
        """Hand over the gradient the model holds; False if it was not published (dropped)."""

    @property
    def pending(self) -> int:
        """Gradients handed over and not yet published (a push thread's): they reach the ring
        before the next one, so they count towards its staleness."""
        return 0

    def discard(self) -> None:
        """Throw away the gradient the model holds (it is not to be published)."""
        for p in self.parameters:
            if p.grad is not None and not p.grad.is_sparse and _is_view_of_slot(p.grad, self.writer):
                p.grad.zero_()
        self.bind()

    def close(self) -> None:
        """Stop any thread; a gradient not yet published is dropped."""
        for p in self.parameters:
            p.grad = None

    def _take_grads(self, slot: int) -> list[torch.Tensor | None]:
        """The model's gradients, warning once if a `.grad` that should be the slot was replaced."""
        grads = [p.grad for p in self.parameters]
        for grad, view in zip(grads, self.writer.grad_views(slot)):
            if view is None or grad is None or self._warned:
                continue
            if grad.is_sparse or grad.data_ptr() != view.data_ptr():
                self._warned = True
                log.warning(
                    "job %r: a parameter's .grad was replaced (zero_grad(set_to_none=True)?); copying "
                    "gradients into the ring each step. Leave .grad alone: gadei zeroes it.",
                    self.region.job,
                )
        return grads


class PublishPush(Push):
    """float32 `.grad` tensors are views of the free slot; the rest is written at push; a push publishes."""

    name = "publish"

    def bind(self) -> None:
        self.producer.wait_space(self.on_slice)
        for p, grad in zip(self.parameters, self.writer.grad_views(self.producer.slot)):
            p.grad = grad

    def push(self, version: int, step: int, samples: int) -> bool:
        self.writer.write_grads(self.producer.slot, self._take_grads(self.producer.slot))
        self.producer.publish(version, step, samples)
        self.bind()
        return True


class ThreadPush(Push):
    """Private gradients; a push thread writes the finished one into a slot and publishes it."""

    name = "thread"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._item: tuple[list, int, int, int] | None = None  # (gradients, version, step, samples)
        self._error: BaseException | None = None
        self._handoff = _Handoff(self._run, f"gadei-push-{self.region.job}")
        self._cond = self._handoff.cond
        self._handoff.start()

    def bind(self) -> None:
        for p in self.parameters:
            p.grad = None  # backward allocates fresh gradients (as torch.optim's zero_grad does)

    @property
    def pending(self) -> int:
        return int(self._item is not None)  # cleared once published

    def push(self, version: int, step: int, samples: int) -> bool:
        grads = [p.grad for p in self.parameters]
        with self._cond:
            while self._item is not None and self._error is None:
                self._cond.wait(WAIT_SLICE)  # the previous gradient is still being written
            if self._error is not None:
                raise self._error
            self._item = (grads, version, step, samples)
            self._cond.notify_all()
        self.bind()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._item is None and not self._handoff.closing:
                    self._cond.wait(WAIT_SLICE)
                if self._item is None:
                    return
                grads, version, step, samples = self._item
            try:
                self.producer.wait_space(self.on_slice)
                self.writer.write_grads(self.producer.slot, grads)
                self.producer.publish(version, step, samples)
            except BaseException as err:  # handed to the train thread, which raises it
                with self._cond:
                    self._error = err
                    self._item = None
                    self._cond.notify_all()
                return
            with self._cond:
                self._item = None
                self._cond.notify_all()

    def close(self) -> None:
        self._handoff.stop()
        super().close()


class ElasticPush(Push):
    """Elastic mode: local SGD on the private model; every tau steps an exchange with the centre.

    At an exchange the learner reads the centre c, puts its weights w in the slot for the
    server (which moves c += alpha (w - c)) and moves its own: w -= alpha (w - c).
    """

    name = "weights"

    def bind(self) -> None:
        for p in self.parameters:
            p.grad = None

    def push(self, version: int, step: int, samples: int) -> bool:
        lr = self.options.lr
        with torch.no_grad():
            for p in self.parameters:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
        self.bind()
        if (step + 1) % self.options.tau:
            return False
        self.producer.wait_space(self.on_slice)
        centre = torch.from_numpy(self.region.weights).clone()
        version = _native.load64(self.region.header.addr("version"))
        self.writer.write_weights(self.producer.slot)
        self.producer.publish(version, step, samples)
        with torch.no_grad():
            for p, c in zip(self.parameters, views(centre, self.spec)):
                p.sub_(self.options.alpha * (p - c))
        return True


class Pull(ABC):
    """How the server's weights reach a learner's model.

    Args:
        region: the job's region.
        parameters: the model's parameters, in region order.
        spec: their names and shapes.
        on_pull: called with the version after every pull (records it in the learner entry).
        consistent: copies must hold whole updates (the job runs in consistent mode).
    """

    name: ClassVar[str]

    def __init__(self, region: Region, parameters: list, spec: Spec, on_pull: Callable[[int], None],
                 consistent: bool = False):
        self.region = region
        self.parameters = parameters
        self.spec = spec
        self.on_pull = on_pull
        self.consistent = consistent
        self._version_addr = region.header.addr("version")
        self._seq_addr = region.header.addr("seq")
        self.retries = 0  # consistent copies taken again because an update ran during them

    @abstractmethod
    def start(self) -> None:
        """Give the model the current weights."""

    @abstractmethod
    def version(self) -> int:
        """The weights version the model computes with now."""

    def between_steps(self) -> None:
        """Called by the train thread after each push: take newer weights if there are any."""

    @abstractmethod
    def refresh(self) -> None:
        """Copy the latest weights into the model now (blocking)."""

    def finish(self) -> None:
        """Leave the model with a private copy of the latest weights and stop any thread."""
        flat = _flat(self.region.shape.n_params)
        self._bind(flat)
        self.on_pull(self._copy_weights(flat))

    def _copy_weights(self, target: torch.Tensor) -> int:
        """Copy the region's weights into `target`; the version they are (at least).

        In consistent mode the copy is retried until it was taken between two equal, even
        readings of the server's seqlock, so it holds whole updates only. A seqlock left odd
        for WAIT_SLICE is looked into: if the server died during that update, nothing will
        change the weights any more and they are copied as they are (with a warning).
        """
        nbytes = self.region.shape.n_params * 4
        odd_since = None
        while True:
            seq = _native.load64(self._seq_addr)
            whole = self.consistent
            if whole and seq & 1:
                now = time.monotonic()
                odd_since = odd_since or now
                if now - odd_since < WAIT_SLICE or self.region.server_alive():
                    if now - odd_since >= WAIT_SLICE:
                        odd_since = now  # alive: look again after another slice
                    _native.futex_wait(self._version_addr, _native.load64(self._version_addr) & _U32, 0.001)
                    continue
                log.warning("job %r: the server died during an update; copying the weights as they are",
                            self.region.job)
                whole = False
            version = _native.load64(self._version_addr)
            self._copy_into(target, nbytes)
            if not whole or _native.load64(self._seq_addr) == seq:
                return version
            self.retries += 1

    def _copy_into(self, target: torch.Tensor, nbytes: int) -> None:
        """Copy the region's weights (`nbytes`) into `target`, finished when this returns."""
        _native.copy(_addr(target), self.region.weights_addr, nbytes, 1)

    def _bind(self, flat: torch.Tensor, tensors: list[torch.Tensor] | None = None) -> None:
        """Make the parameters views of `flat` (`tensors`: those views, made beforehand)."""
        with torch.no_grad():
            for p, view in zip(self.parameters, tensors or views(flat, self.spec)):
                p.data = view


class ViewPull(Pull):
    """The model's parameters are views of the region's weights: no pulls, no copies."""

    name = "view"

    def start(self) -> None:
        self._bind(torch.from_numpy(self.region.weights))
        self._version = _native.load64(self._version_addr)

    def version(self) -> int:
        return self._version

    def between_steps(self) -> None:
        self._version = _native.load64(self._version_addr)

    def refresh(self) -> None:
        self.between_steps()


class CopyPull(Pull):
    """A pull thread copies new weights into a staging buffer; the train thread swaps it in."""

    name = "copy"

    def start(self) -> None:
        n = self.region.shape.n_params
        self._model_buf, self._staging = self._buffer(n), self._buffer(n)
        self._model_views, self._staging_views = views(self._model_buf, self.spec), views(self._staging, self.spec)
        self._ready = False
        self._staged_version = 0
        self._error: BaseException | None = None
        self._waiters_addr = self.region.header.addr("version_waiters")
        self.refresh()
        self._handoff = _Handoff(self._run, f"gadei-{self.name}-pull-{self.region.job}")
        self._cond = self._handoff.cond
        self._handoff.start()

    def _buffer(self, n: int) -> torch.Tensor:
        """One of the two weight buffers (the model's and the staging one)."""
        return _flat(n)

    def version(self) -> int:
        return self._version

    def refresh(self) -> None:
        version = self._copy_weights(self._model_buf)
        self._bind(self._model_buf, self._model_views)
        self._version = version
        self.on_pull(version)

    def between_steps(self) -> None:
        if self._error is not None:
            raise self._error
        if not self._ready:
            return
        with self._cond:
            self._swap_in()
            self._ready = False
            self._cond.notify_all()

    def _swap_in(self) -> bool:
        """Under the condition: make the staged weights the model's (a pointer swap) when they
        are newer; whether they were."""
        if self._staged_version <= self._version:
            return False
        self._model_buf, self._staging = self._staging, self._model_buf
        self._model_views, self._staging_views = self._staging_views, self._model_views
        self._bind(self._model_buf, self._model_views)
        self._version = self._staged_version
        self.on_pull(self._version)
        return True

    def _run(self) -> None:
        try:
            self._pull_loop()
        except BaseException as err:  # raised in the train thread at its next step
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _pull_loop(self) -> None:
        while True:
            with self._cond:
                while self._ready and not self._handoff.closing:
                    self._cond.wait(WAIT_SLICE)  # the train thread has not taken the last pull yet
                if self._handoff.closing:
                    return
                known = max(self._version, self._staged_version)
            version = self._wait_version(known)
            if version == known:
                continue
            version = self._stage()
            with self._cond:
                self._staged_version = version
                self._ready = True

    def _stage(self) -> int:
        """Pull thread: the region's weights into the staging buffer; their version."""
        return self._copy_weights(self._staging)

    def _wait_version(self, known: int) -> int:
        """The region's version once it differs from `known`, or `known` after WAIT_SLICE."""
        version = _native.load64(self._version_addr)
        if version != known:
            return version
        _native.add32(self._waiters_addr, 1)
        try:
            version = _native.load64(self._version_addr)
            if version == known:
                _native.futex_wait(self._version_addr, version & _U32, WAIT_SLICE)
                version = _native.load64(self._version_addr)
        finally:
            _native.add32(self._waiters_addr, -1)
        return version

    def finish(self) -> None:
        self._handoff.stop()
        super().finish()


class LocalPull(Pull):
    """Elastic mode: the model is private; it starts from the centre and keeps its own weights."""

    name = "local"

    def start(self) -> None:
        flat = _flat(self.region.shape.n_params)
        self._version = self._copy_weights(flat)
        self._bind(flat)
        self.on_pull(self._version)

    def version(self) -> int:
        return self._version

    def refresh(self) -> None:
        """The model is the learner's own; the centre is read at each exchange."""

    def finish(self) -> None:
        """The model keeps its local weights (the job's result is the centre in the region)."""


class DevicePush(Push):
    """The paper's push thread for a model on a device (a GPU; on a CPU "device" the same steps).

    After backward the train thread copies the gradients into a free one of two staging
    buffers on the model's device (device to device, already in the ring's dtype: float16 and
    bfloat16 are converted on the device, so half the bytes cross PCIe), records an event on
    its stream, hands the buffer over and goes on with the next mini-batch. The push thread
    waits for a free ring slot, copies the buffer into it on its own CUDA stream once that
    event has passed, waits for its stream and publishes. A buffer is reused only after the
    push thread is done with it, and the hand-off holds one buffer at most, so the train
    thread waits only when two gradients are still on their way. Row-sparse tables travel as
    their touched rows. On a CPU device there are no streams or events: synchronous copies.
    """

    name = "device"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        shape, region, learner = self.region.shape, self.region, self.producer.learner
        self.device = self.parameters[0].device
        self.cuda = self.device.type == "cuda"
        self.dtype = TORCH_DTYPES[shape.grad_dtype]
        self._itemsize = shape.grad_itemsize
        self._slots = [torch.from_numpy(region.dense(learner, s)).view(self.dtype) for s in range(shape.slots)]
        self._staging = [torch.zeros(shape.dense_count, dtype=self.dtype, device=self.device) for _ in range(2)]
        starts, offset = [], 0
        for _, p_shape in self.spec:
            starts.append(offset)
            offset += math.prod(p_shape)
        self._views = []  # per buffer, per parameter: its place in the buffer (None: a row-sparse table)
        for buf in self._staging:
            per_param = []
            for (_, p_shape), start, table in zip(self.spec, starts, self.writer.table_of):
                at = None if table is not None else _dense_offset(shape.dense_segments, start)
                per_param.append(None if at is None else buf[at : at + math.prod(p_shape)].view(p_shape))
            self._views.append(per_param)
        self._free = [1, 0]  # staging buffers neither handed over nor being copied
        self._item: tuple | None = None  # (buffer, rows, event, version, step, samples)
        self._error: BaseException | None = None
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._locked = _device.PageLock(region.job)
        if self.cuda:
            layout = region.layout
            self._locked.add(region.base + layout.payload(learner, 0), shape.slots * layout.payload_stride,
                             f"the ring of learner {learner}")
        self.bytes = 0  # copied from the device into slots
        self.copy_seconds = 0.0  # the push thread's copies, from their start to their stream's end
        self._handoff = _Handoff(self._run, f"gadei-device-push-{region.job}")
        self._cond = self._handoff.cond
        self._handoff.start()

    def bind(self) -> None:
        for p in self.parameters:
            p.grad = None  # backward allocates fresh gradients; the staged ones are copies

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._staging) - len(self._free)  # a buffer is free again once published

    def push(self, version: int, step: int, samples: int) -> bool:
        _device.inject("train.stage")
        with self._cond:
            while (self._item is not None or not self._free) and self._error is None:
                if not self._handoff.thread.is_alive():
                    raise GadeiError(f"job {self.region.job!r}: the push thread ended")
                self._cond.wait(WAIT_SLICE)  # two gradients are still on their way
            if self._error is not None:
                raise self._error
            buf = self._free.pop()
        try:
            rows = self._stage(buf)
        except BaseException:
            with self._cond:
                self._free.append(buf)
            raise
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        with self._cond:
            self._item = (buf, rows, event, version, step, samples)
            self._cond.notify_all()
        self.bind()
        return True

    def _stage(self, buf: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Copy the model's gradients into staging buffer `buf` (on the train thread's stream);
        the row-sparse tables' (table, indices, rows), on the device."""
        rows = []
        with torch.no_grad():
            for i, (p, view) in enumerate(zip(self.parameters, self._views[buf])):
                grad, table = p.grad, self.writer.table_of[i]
                if table is not None:
                    if grad is not None:
                        index, values = _touched_rows(grad)
                        self.writer.check_rows(i, table, index.numel())
                        rows.append((table, index, values.to(self.dtype).reshape(index.numel(), -1)))
                elif grad is None:
                    view.zero_()
                elif grad.is_sparse:  # a sparse gradient of a table the job sends dense
                    grad = grad.coalesce()
                    view.zero_()
                    view.index_copy_(0, grad.indices()[0], grad.values().to(self.dtype))
                else:
                    view.copy_(grad)  # converts to the ring's dtype on the device
        return rows

    def _run(self) -> None:
        with _device.stream_context(self._stream):
            while True:
                with self._cond:
                    while self._item is None and not self._handoff.closing:
                        self._cond.wait(WAIT_SLICE)
                    if self._item is None:
                        return
                    item, self._item = self._item, None
                    self._cond.notify_all()
                try:
                    self._write(*item)
                except BaseException as err:  # handed to the train thread, which raises it
                    with self._cond:
                        self._error = err
                        self._free.append(item[0])
                        self._cond.notify_all()
                    return
                with self._cond:
                    self._free.append(item[0])
                    self._cond.notify_all()

    def _write(self, buf: int, rows: list, event, version: int, step: int, samples: int) -> None:
        """Push thread: staging buffer `buf` into the free slot, then publish it."""
        _device.inject("push.copy")
        self.producer.wait_space(self.on_slice)
        slot = self.producer.slot
        started = time.perf_counter()
        if event is not None:
            self._stream.wait_event(event)  # the train stream has finished staging
        self._slots[slot].copy_(self._staging[buf], non_blocking=self.cuda)
        nbytes = self._staging[buf].numel() * self._itemsize
        counts = []
        for table, index, values in rows:
            count_addr, indices, area = self.writer.rows_area(slot, table)
            count = index.numel()
            indices[:count].copy_(index, non_blocking=self.cuda)
            area[:count].copy_(values, non_blocking=self.cuda)
            counts.append((count_addr, count))
            nbytes += count * 8 + values.numel() * self._itemsize
        if self._stream is not None:
            self._stream.synchronize()  # the slot holds the whole gradient before it is published
        for count_addr, count in counts:
            _native.store64(count_addr, count)
        self.copy_seconds += time.perf_counter() - started
        self.bytes += nbytes
        _device.inject("push.publish")
        self.producer.publish(version, step, samples)

    def close(self) -> None:
        self._handoff.stop()
        if self._handoff.thread.is_alive():  # a copy may still be running: keep the ring locked
            log.warning("job %r: the push thread did not end; the ring stays page-locked", self.region.job)
        else:
            if self._stream is not None:
                self._stream.synchronize()
            self._locked.release()
        super().close()


def _touched_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, rows) of a table's gradient: a sparse one coalesced (repeated rows summed), a
    dense one's rows that are not all zero."""
    if grad.is_sparse:
        grad = grad.coalesce()
        return grad.indices()[0], grad.values()
    index = grad.reshape(grad.shape[0], -1).ne(0).any(dim=1).nonzero().flatten()
    return index, grad[index]


class DevicePull(CopyPull):
    """`copy` with buffers on the model's device (a GPU; on a CPU "device" the same steps).

    The pull thread, when the server's version moved, copies the region's weights (page-locked
    on CUDA) into a device staging buffer on its own CUDA stream, after the train stream has
    released that buffer (an event recorded at the last swap), and waits for its stream; the
    train thread swaps the buffers between steps (a pointer swap, one staged pull at most).
    `refresh` copies on the train thread's stream, behind the work queued on the model.
    """

    name = "device"

    def start(self) -> None:
        self.device = self.parameters[0].device
        self.cuda = self.device.type == "cuda"
        self._host = torch.from_numpy(self.region.weights)
        self._locked = _device.PageLock(self.region.job)
        if self.cuda:
            self._locked.add(self.region.weights_addr, self.region.shape.n_params * 4, "the weights")
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._released = None  # event: the train stream is done with the staging buffer (CUDA)
        self.bytes = 0  # copied from the region to the device
        self.copy_seconds = 0.0
        super().start()

    def _buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float32, device=self.device)

    def _copy_into(self, target: torch.Tensor, nbytes: int) -> None:
        """On the calling thread's current stream (the pull thread's own, or the train stream)."""
        started = time.perf_counter()
        target.copy_(self._host, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self.copy_seconds += time.perf_counter() - started
        self.bytes += nbytes

    def _swap_in(self) -> bool:
        _device.inject("train.swap")
        swapped = super()._swap_in()
        if swapped and self.cuda:  # kernels queued on the old weights still read them
            self._released = torch.cuda.Event()
            self._released.record(torch.cuda.current_stream(self.device))
        return swapped

    def _pull_loop(self) -> None:
        with _device.stream_context(self._stream):
            super()._pull_loop()

    def _stage(self) -> int:
        """On the pull stream, once the train stream released the staging buffer (the event
        recorded at the last swap: set before `_ready` was cleared, so seen here)."""
        _device.inject("pull.copy")
        if self._released is not None:
            self._stream.wait_event(self._released)
        version = self._copy_weights(self._staging)
        _device.inject("pull.staged")
        return version

    def finish(self) -> None:
        """Stop the pull thread; the model keeps a private device copy of the latest weights."""
        self._handoff.stop()
        flat = torch.empty(self.region.shape.n_params, dtype=torch.float32, device=self.device)
        version = self._copy_weights(flat)
        self._bind(flat)
        self.on_pull(version)
        if self._handoff.thread.is_alive():
            log.warning("job %r: the pull thread did not end; the weights stay page-locked", self.region.job)
        else:
            if self._stream is not None:
                self._stream.synchronize()
            self._locked.release()


PUSHES: dict[str, type[Push]] = {cls.name: cls for cls in (PublishPush, ThreadPush, ElasticPush, DevicePush)}
PULLS: dict[str, type[Pull]] = {cls.name: cls for cls in (ViewPull, CopyPull, LocalPull, DevicePull)}
