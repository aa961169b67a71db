"""How the server's weights reach a learner's model: `Pull` and its CPU implementations (`view`,
`copy`, `local`; the GPU one is in gadei.transport.device)."""

import logging
import time
from abc import ABC, abstractmethod
from typing import Callable, ClassVar

import torch

from ..params import Spec, views
from ..region import Region
from ..protocol import WAIT_SLICE, Version
from .handoff import Handoff
from .slot import Float32Dense

log = logging.getLogger(__name__)


def flat_zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float32)


def addr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


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
        self._clock = Version(region)
        self._weights = Float32Dense(region.shape.n_params, 1)  # what a copy moves
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
        flat = flat_zeros(self.region.shape.n_params)
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
            seq = self._clock.seq()
            whole = self.consistent
            if whole and seq & 1:
                now = time.monotonic()
                odd_since = odd_since or now
                if now - odd_since < WAIT_SLICE or self.region.server_alive():
                    if now - odd_since >= WAIT_SLICE:
                        odd_since = now  # alive: look again after another slice
                    self._clock.nap(0.001)
                    continue
                log.warning("job %r: the server died during an update; copying the weights as they are",
                            self.region.job)
                whole = False
            version = self._clock.get()
            self._copy_into(target, nbytes)
            if not whole or self._clock.seq() == seq:
                return version
            self.retries += 1

    def _copy_into(self, target: torch.Tensor, nbytes: int) -> None:
        """Copy the region's weights (`nbytes`) into `target`, finished when this returns."""
        self._weights.copy(addr(target), self.region.weights_addr)

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
        self._version = self._clock.get()

    def version(self) -> int:
        return self._version

    def between_steps(self) -> None:
        self._version = self._clock.get()

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
        self.refresh()
        self._handoff = Handoff(self._run, f"gadei-{self.name}-pull-{self.region.job}")
        self._cond = self._handoff.cond
        self._handoff.start()

    def _buffer(self, n: int) -> torch.Tensor:
        """One of the two weight buffers (the model's and the staging one)."""
        return flat_zeros(n)

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
        version = self._clock.get()
        if version != known:
            return version
        return self._clock.wait_change(known, WAIT_SLICE)

    def finish(self) -> None:
        self._handoff.stop()
        super().finish()


class LocalPull(Pull):
    """Elastic mode: the model is private; it starts from the centre and keeps its own weights."""

    name = "local"

    def start(self) -> None:
        flat = flat_zeros(self.region.shape.n_params)
        self._version = self._copy_weights(flat)
        self._bind(flat)
        self.on_pull(self._version)

    def version(self) -> int:
        return self._version

    def refresh(self) -> None:
        """The model is the learner's own; the centre is read at each exchange."""

    def finish(self) -> None:
        """The model keeps its local weights (the job's result is the centre in the region)."""
