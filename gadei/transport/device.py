"""The transports of a model on a device (a GPU; a CPU "device" runs the same steps): the push
stages gradients on the device and a push thread copies them into the slot on its own stream;
the pull is `copy` with device buffers."""

import logging
import math
import time

import torch

from .. import device as _device
from ..errors import GadeiError
from ..ring import WAIT_SLICE
from .pull import CopyPull
from .push import Push
from .handoff import Handoff
from .slot import dense_area, dense_offset
from .writer import TORCH_DTYPES, touched_rows

log = logging.getLogger(__name__)


class DevicePush(Push):
    """The paper's push thread for a model on a device (a GPU; on a CPU "device" the same steps).

    After backward the train thread queues the copy of the dense gradients into a free one of
    two staging buffers on the model's device (device to device, already in the ring's dtype:
    float16 and bfloat16 are converted on the device, so half the bytes cross PCIe), records
    an event on its stream, hands the buffer over and goes on with the next mini-batch: it
    never waits for the device. The push thread, on its own CUDA stream once that event has
    passed, takes the row-sparse tables' touched rows (which waits for that stream: their
    count sizes them), waits for a free ring slot, copies the buffer and the rows into it,
    waits for its stream and publishes. A buffer is reused only after the push thread is
    done with it, and the hand-off holds one buffer at most, so the train thread waits only
    when two gradients are still on their way. On a CPU device there are no streams or
    events: synchronous copies.
    """

    name = "device"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        shape, region, learner = self.region.shape, self.region, self.producer.learner
        self.device = self.parameters[0].device
        self.cuda = self.device.type == "cuda"
        self.dtype = TORCH_DTYPES[shape.grad_dtype]
        self._itemsize = shape.grad_itemsize
        self._slots = [torch.from_numpy(dense_area(region, learner, s)).view(self.dtype) for s in range(shape.slots)]
        self._staging = [torch.zeros(shape.dense_count, dtype=self.dtype, device=self.device) for _ in range(2)]
        starts, offset = [], 0
        for _, p_shape in self.spec:
            starts.append(offset)
            offset += math.prod(p_shape)
        self._views = []  # per buffer, per parameter: its place in the buffer (None: a row-sparse table)
        for buf in self._staging:
            per_param = []
            for (_, p_shape), start, table in zip(self.spec, starts, self.writer.table_of):
                at = None if table is not None else dense_offset(shape.dense_segments, start)
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
        self.copy_seconds = 0.0  # the push thread's copies, as the device timed them (device.CopyTimer)
        self.copies = 0  # gradients copied into slots
        self.train_wait_seconds = 0.0  # the train thread's waits for a staging buffer (two still on their way)
        self.space_wait_seconds = 0.0  # the push thread's waits for a free slot (the server behind)
        self._handoff = Handoff(self._run, f"gadei-device-push-{region.job}")
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
            started = time.perf_counter()
            while (self._item is not None or not self._free) and self._error is None:
                if not self._handoff.thread.is_alive():
                    raise GadeiError(f"job {self.region.job!r}: the push thread ended")
                self._cond.wait(WAIT_SLICE)  # two gradients are still on their way
            self.train_wait_seconds += time.perf_counter() - started
            if self._error is not None:
                raise self._error
            buf = self._free.pop()
        try:
            tables = self._stage(buf)
        except BaseException:
            with self._cond:
                self._free.append(buf)
            raise
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        with self._cond:
            self._item = (buf, tables, event, version, step, samples)
            self._cond.notify_all()
        self.bind()
        return True

    def _stage(self, buf: int) -> list[tuple[int, int, torch.Tensor]]:
        """Queue the copy of the model's dense gradients into staging buffer `buf` on the train
        thread's stream (one multi-tensor copy, converting to the ring's dtype); the row-sparse
        tables' gradients as backward left them, (parameter, table, gradient), for the push
        thread: finding their touched rows waits for the device, which here would stall the
        train thread until backward ended instead of letting it queue the next step."""
        tables, targets, sources, zeros = [], [], [], []
        with torch.no_grad():
            for i, (p, view) in enumerate(zip(self.parameters, self._views[buf])):
                grad, table = p.grad, self.writer.table_of[i]
                if table is not None:
                    if grad is not None:
                        self._check_rows(i, table, grad)
                        tables.append((i, table, grad))
                elif grad is None:
                    zeros.append(view)
                elif grad.is_sparse:  # a sparse gradient of a table the job sends dense
                    grad = grad.coalesce()
                    view.zero_()
                    view.index_copy_(0, grad.indices()[0], grad.values().to(self.dtype))
                else:
                    targets.append(view)
                    sources.append(grad)
            if zeros:
                torch._foreach_zero_(zeros)
            if targets:
                torch._foreach_copy_(targets, sources)
        return tables

    def _check_rows(self, param: int, table: int, grad: torch.Tensor) -> None:
        """Raise GadeiError now, at this step, if table `table`'s touched rows do not fit a slot:
        without waiting for the device where a bound on their count fits (a sparse gradient's
        entries, or the table's rows), else by counting them."""
        bound = grad._nnz() if grad.is_sparse else grad.shape[0]
        if bound > self.writer.max_rows[table]:
            self.writer.check_rows(param, table, touched_rows(grad)[0].numel())

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

    def _write(self, buf: int, tables: list, event, version: int, step: int, samples: int) -> None:
        """Push thread: staging buffer `buf` and the tables' touched rows into the free slot,
        then publish it."""
        _device.inject("push.copy")
        if event is not None:
            self._stream.wait_event(event)  # the train stream has finished staging
        rows = []
        for _, table, grad in tables:  # on this thread's stream, which waits for the rows' count
            index, values = touched_rows(grad)
            rows.append((table, index, values.to(self.dtype).reshape(index.numel(), -1)))
        started = time.perf_counter()
        self.producer.wait_space(self.on_slice)
        self.space_wait_seconds += time.perf_counter() - started
        slot = self.producer.slot
        timer = _device.CopyTimer(self._stream)
        self._slots[slot].copy_(self._staging[buf], non_blocking=self.cuda)
        nbytes = self._staging[buf].numel() * self._itemsize
        counts = []
        for table, index, values in rows:
            indices, area = self.writer.rows_area(slot, table)
            count = index.numel()
            indices[:count].copy_(index, non_blocking=self.cuda)
            area[:count].copy_(values, non_blocking=self.cuda)
            counts.append((table, count))
            nbytes += count * 8 + values.numel() * self._itemsize
        timer.stop()
        if self._stream is not None:
            self._stream.synchronize()  # the slot holds the whole gradient before it is published
        for table, count in counts:
            self.writer.set_rows(slot, table, count)
        self.copy_seconds += timer.seconds()
        self.bytes += nbytes
        self.copies += 1
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
        self.copy_seconds = 0.0  # as the device timed the copies (device.CopyTimer)
        self.copies = 0
        super().start()

    def _buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.float32, device=self.device)

    def _copy_into(self, target: torch.Tensor, nbytes: int) -> None:
        """On the calling thread's current stream (the pull thread's own, or the train stream)."""
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        timer = _device.CopyTimer(stream)
        target.copy_(self._host, non_blocking=self.cuda)
        timer.stop()
        if stream is not None:
            stream.synchronize()
        self.copy_seconds += timer.seconds()
        self.bytes += nbytes
        self.copies += 1

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
