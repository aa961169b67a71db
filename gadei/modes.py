"""Update rules: how the server turns one consumed gradient slot into a change of the weights.

The server's apply loop is the same for every mode; what it does with a slot is one
`UpdateRule`. A rule states its maths in its docstring, applies it with a native kernel
(GIL released, OpenMP) and carries a pure NumPy `reference` that the tests hold the kernel
to. Every rule hands the slot back zeroed, because the next backward pass of the learner
accumulates into it.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from . import _native


@dataclass(frozen=True)
class Gradient:
    """One consumed slot: where its payload is and what the learner said about it.

    Attributes:
        learner: the learner entry it came from.
        payload: address of the gradient elements (n_params of the region's grad dtype).
        version: the weights version it was computed on.
        samples: mini-batch size it was computed from.
    """

    learner: int
    payload: int
    version: int
    samples: int


class UpdateRule(ABC):
    """The server's update rule of one mode.

    Args:
        weights: address of the region's float32 weights.
        n: number of weights.
        lr: learning rate.
        threads: OpenMP threads of the kernel.
    """

    name: ClassVar[str]

    def __init__(self, weights: int, n: int, *, lr: float, threads: int):
        if not lr > 0:
            raise ValueError(f"learning rate must be positive, not {lr!r}")
        self.weights = weights
        self.n = n
        self.lr = float(lr)
        self.threads = max(1, int(threads))

    @abstractmethod
    def apply(self, grad: Gradient) -> None:
        """Update the weights with `grad` in place and zero its payload."""

    @staticmethod
    @abstractmethod
    def reference(weights: np.ndarray, grad: np.ndarray, lr: float) -> None:
        """The same update in NumPy, in place on `weights` and `grad` (for tests)."""


class AsyncSGD(UpdateRule):
    """ASGD, Hogwild style: for each gradient g as it arrives, w <- w - lr * g, in place.

    No lock: learners may read the weights while they change (that is what `view` pulls
    see). The gradient is zeroed in the same pass, g <- 0.
    """

    name = "async"

    def apply(self, grad: Gradient) -> None:
        _native.sgd(self.weights, grad.payload, self.n, self.lr, 1, self.threads)

    @staticmethod
    def reference(weights: np.ndarray, grad: np.ndarray, lr: float) -> None:
        weights -= np.float32(lr) * grad
        grad[:] = 0


RULES: dict[str, type[UpdateRule]] = {rule.name: rule for rule in (AsyncSGD,)}


def make_rule(mode: str, weights: int, n: int, *, lr: float, threads: int) -> UpdateRule:
    """The update rule of `mode`, bound to the weights at `weights`."""
    try:
        rule = RULES[mode]
    except KeyError:
        raise ValueError(f"mode {mode!r} is not one of {sorted(RULES)}") from None
    return rule(weights, n, lr=lr, threads=threads)
