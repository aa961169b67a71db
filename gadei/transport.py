"""A learner's transports: how its gradients reach its ring (push) and weights reach its model (pull).

Each direction is one interface with several implementations, chosen per learner:

push
    `publish` (CPU default): the model's `.grad` tensors are views of the free ring slot, so
        backward accumulates straight into shared memory and pushing is publishing the slot
        (two atomic stores), not copying. The train thread blocks only when the ring is full.
    `thread` (the paper's push thread): backward accumulates into one of two private
        staging buffers; a push thread copies the finished one into the free slot and
        publishes it while the train thread goes on with the other. One item in flight.

pull
    `view` (default): the model's parameters are views of the region's weights (Hogwild,
        no copies); the server's updates show up in the model as they happen.
    `copy`: a pull thread copies the weights into a private staging buffer whenever the
        server's version moved, and the train thread swaps it in between steps (a pointer
        swap); at most one pull per step.

The GPU transports (device staging, copy streams) implement the same two interfaces.
"""

import logging
import threading
from abc import ABC, abstractmethod
from typing import Callable, ClassVar

import torch

from . import _native
from .params import Spec, views
from .region import Region
from .ring import WAIT_SLICE, Producer

log = logging.getLogger(__name__)

_U32 = 0xFFFFFFFF


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


class Push(ABC):
    """How a learner's finished gradient reaches its ring.

    Args:
        region: the job's region.
        producer: this learner's end of its ring.
        parameters: the model's parameters, in region order.
        spec: their names and shapes.
        on_slice: called every WAIT_SLICE while blocked; raises to end the wait.
    """

    name: ClassVar[str]

    def __init__(self, region: Region, producer: Producer, parameters: list, spec: Spec, on_slice: Callable[[], None]):
        self.region = region
        self.producer = producer
        self.parameters = parameters
        self.spec = spec
        self.on_slice = on_slice
        self._warned = False

    @abstractmethod
    def bind(self) -> None:
        """Point every parameter's `.grad` where the next backward pass should accumulate."""

    @abstractmethod
    def push(self, version: int, step: int, samples: int) -> None:
        """Hand over the gradient the model holds; return when the next backward may start."""

    def close(self) -> None:
        """Stop any thread; a gradient not yet published is dropped."""
        for p in self.parameters:
            p.grad = None

    def _gather(self, targets: list[torch.Tensor]) -> None:
        """Make sure the gradient is in `targets`: copy any `.grad` the user replaced (slow path)."""
        for p, target in zip(self.parameters, targets):
            grad = p.grad
            if grad is None or grad.data_ptr() == target.data_ptr():
                continue
            if not self._warned:
                self._warned = True
                log.warning(
                    "job %r: a parameter's .grad was replaced (zero_grad(set_to_none=True)?); copying "
                    "gradients into the ring each step. Leave .grad alone: gadei zeroes it.",
                    self.region.job,
                )
            target.copy_(grad)


class PublishPush(Push):
    """`.grad` tensors are views of the free slot; a push publishes that slot."""

    name = "publish"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        region, learner = self.region, self.producer.learner
        self._grads = [
            views(torch.from_numpy(region.payload(learner, k)), self.spec) for k in range(region.shape.slots)
        ]

    def bind(self) -> None:
        self.producer.wait_space(self.on_slice)
        for p, grad in zip(self.parameters, self._grads[self.producer.slot]):
            p.grad = grad

    def push(self, version: int, step: int, samples: int) -> None:
        self._gather(self._grads[self.producer.slot])
        self.producer.publish(version, step, samples)
        self.bind()


class ThreadPush(Push):
    """Two private staging buffers; a push thread copies the finished one into a slot and publishes."""

    name = "thread"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        n = self.region.shape.n_params
        self._buffers = [_flat(n), _flat(n)]
        self._grads = [views(buf, self.spec) for buf in self._buffers]
        self._current = 0
        self._item: tuple[int, int, int, int] | None = None  # (buffer, version, step, samples)
        self._error: BaseException | None = None
        self._handoff = _Handoff(self._run, f"gadei-push-{self.region.job}")
        self._cond = self._handoff.cond
        self._handoff.start()

    def bind(self) -> None:
        for p, grad in zip(self.parameters, self._grads[self._current]):
            p.grad = grad

    def push(self, version: int, step: int, samples: int) -> None:
        self._gather(self._grads[self._current])
        with self._cond:
            while self._item is not None and self._error is None:
                self._cond.wait(WAIT_SLICE)  # the previous gradient is still being copied
            if self._error is not None:
                raise self._error
            self._item = (self._current, version, step, samples)
            self._cond.notify_all()
        self._current ^= 1
        self.bind()

    def _run(self) -> None:
        payload_bytes = self.region.layout.payload_bytes
        while True:
            with self._cond:
                while self._item is None and not self._handoff.closing:
                    self._cond.wait(WAIT_SLICE)
                if self._item is None:
                    return
                buffer, version, step, samples = self._item
            try:
                self.producer.wait_space(self.on_slice)
                source = _addr(self._buffers[buffer])
                _native.copy(self.region.payload_addr(self.producer.learner, self.producer.slot), source, payload_bytes, 1)
                self.producer.publish(version, step, samples)
                _native.zero(source, payload_bytes)  # after publishing: off the push-to-applied path
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


class Pull(ABC):
    """How the server's weights reach a learner's model.

    Args:
        region: the job's region.
        parameters: the model's parameters, in region order.
        spec: their names and shapes.
        on_pull: called with the version after every pull (records it in the learner entry).
    """

    name: ClassVar[str]

    def __init__(self, region: Region, parameters: list, spec: Spec, on_pull: Callable[[int], None]):
        self.region = region
        self.parameters = parameters
        self.spec = spec
        self.on_pull = on_pull
        self._version_addr = region.header.addr("version")

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
        version = _native.load64(self._version_addr)
        _native.copy(_addr(flat), self.region.weights_addr, self.region.shape.n_params * 4, 1)
        self._bind(flat)
        self.on_pull(version)

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
        self._model_buf, self._staging = _flat(n), _flat(n)
        self._model_views, self._staging_views = views(self._model_buf, self.spec), views(self._staging, self.spec)
        self._ready = False
        self._staged_version = 0
        self._waiters_addr = self.region.header.addr("version_waiters")
        self.refresh()
        self._handoff = _Handoff(self._run, f"gadei-pull-{self.region.job}")
        self._cond = self._handoff.cond
        self._handoff.start()

    def version(self) -> int:
        return self._version

    def refresh(self) -> None:
        version = _native.load64(self._version_addr)
        _native.copy(_addr(self._model_buf), self.region.weights_addr, self.region.shape.n_params * 4, 1)
        self._bind(self._model_buf, self._model_views)
        self._version = version
        self.on_pull(version)

    def between_steps(self) -> None:
        if not self._ready:
            return
        with self._cond:
            if self._staged_version > self._version:
                self._model_buf, self._staging = self._staging, self._model_buf
                self._model_views, self._staging_views = self._staging_views, self._model_views
                self._bind(self._model_buf, self._model_views)
                self._version = self._staged_version
                self.on_pull(self._version)
            self._ready = False
            self._cond.notify_all()

    def _run(self) -> None:
        nbytes = self.region.shape.n_params * 4
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
            _native.copy(_addr(self._staging), self.region.weights_addr, nbytes, 1)
            with self._cond:
                self._staged_version = version
                self._ready = True

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


PUSHES: dict[str, type[Push]] = {cls.name: cls for cls in (PublishPush, ThreadPush)}
PULLS: dict[str, type[Pull]] = {cls.name: cls for cls in (CopyPull, ViewPull)}
