"""How a learner's finished gradient reaches its ring: `Push` and its CPU implementations
(`publish`, `thread`, `weights`; the GPU one is in gadei.transport.device)."""

import logging
from abc import ABC, abstractmethod
from typing import Callable, ClassVar

import torch

from ..modes import RuleOptions
from ..params import Spec, views
from ..region import Region
from ..ring import WAIT_SLICE, Producer
from .handoff import Handoff
from .writer import SlotWriter, is_view_of_slot

log = logging.getLogger(__name__)


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
                 on_slice: Callable[[], None], options: RuleOptions):
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
            if p.grad is not None and not p.grad.is_sparse and is_view_of_slot(p.grad, self.writer):
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
        self._handoff = Handoff(self._run, f"gadei-push-{self.region.job}")
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
        version = self.region.header.get("version")
        self.writer.write_weights(self.producer.slot)
        self.producer.publish(version, step, samples)
        with torch.no_grad():
            for p, c in zip(self.parameters, views(centre, self.spec)):
                p.sub_(self.options.alpha * (p - c))
        return True
