"""The NumPy oracles the tests hold the native kernels and the update rules (gadei.modes) to:
each rule's update and each kernel's loop, on float32 arrays, in place, in the kernels' order."""

import math

import numpy as np

from gadei.modes import ADAGRAD_EPS, ADAM_BETA1, ADAM_BETA2, ADAM_EPS, RuleOptions


def async_reference(weights, grads, options, state=None, staleness=None, version=0):
    """AsyncSGD's update in NumPy on float32 arrays, in place, from weights at `version` (Adam's
    bias correction counts the updates); `staleness`: each gradient's, for stale_lr."""
    for i, grad in enumerate(grads):
        s = staleness[i] if staleness else 0
        lr = np.float32(options.lr / s if options.stale_lr and s > 1 else options.lr)
        if options.optimizer == "adam":  # update i makes version + i + 1
            n = len(weights)
            adam_reference(weights, state[:n], state[n:], grad, options.lr / s if options.stale_lr and s > 1 else
                           options.lr, version + i + 1, options.adam_beta1, options.adam_beta2, options.adam_eps)
        elif options.optimizer == "adagrad":
            touched = grad != 0
            state[touched] += grad[touched] * grad[touched]
            weights[touched] -= lr * grad[touched] / (np.sqrt(state[touched]) + np.float32(ADAGRAD_EPS))
        elif options.momentum:
            state[:] = np.float32(options.momentum) * state + grad
            weights -= lr * state
        else:
            weights -= lr * grad


def sync_reference(weights, grads, options, state=None, staleness=None, version=0):
    """SyncSGD's update in NumPy: async_reference on the mean of the round's gradients."""
    mean = np.zeros_like(weights)
    for grad in grads:
        mean += np.float32(1.0 / len(grads)) * grad
    async_reference(weights, [mean], RuleOptions(lr=options.lr, momentum=options.momentum,
                                                 optimizer=options.optimizer, adam_beta1=options.adam_beta1,
                                                 adam_beta2=options.adam_beta2, adam_eps=options.adam_eps),
                    state, version=version)


def elastic_reference(weights, grads, options, state=None, staleness=None, version=0):
    """ElasticAveraging's update in NumPy: the centre moves towards each learner's weights."""
    for w in grads:
        weights += np.float32(options.alpha) * (w - weights)


def nonfinite_reference(values: np.ndarray) -> int:
    """The non-finite check in NumPy: how many elements are NaN or infinite (bfloat16 as its
    uint16 bits, as the region holds it)."""
    if values.dtype == np.uint16:  # bfloat16 bits: exponent all ones
        return int(np.count_nonzero((values & 0x7F80) == 0x7F80))
    return int(np.count_nonzero(~np.isfinite(values)))


def adam_reference(w: np.ndarray, m: np.ndarray, v: np.ndarray, g: np.ndarray, lr: float, step: int,
                   beta1: float = ADAM_BETA1, beta2: float = ADAM_BETA2, eps: float = ADAM_EPS) -> None:
    """One Adam update at step `step` in NumPy, in place on float32 arrays: the scalars in
    double (as the kernel computes them), the elements in float32, in the kernel's order."""
    b1, a1 = np.float32(beta1), np.float32(1.0 - beta1)
    b2, a2 = np.float32(beta2), np.float32(1.0 - beta2)
    size = np.float32(lr / (1.0 - beta1 ** step))
    c2 = np.float32(1.0 / math.sqrt(1.0 - beta2 ** step))
    m[:] = b1 * m + a1 * g
    v[:] = b2 * v + a2 * (g * g)
    w -= size * (m / (np.sqrt(v) * c2 + np.float32(eps)))


def adam_rows_reference(table: np.ndarray, m: np.ndarray, v: np.ndarray, indices: np.ndarray, rows: np.ndarray,
                        lr: float, step: int) -> None:
    """Lazy Adam on a (rows x width) table in NumPy: each carried row in order, the others untouched."""
    for index, row in zip(indices, rows):
        adam_reference(table[index], m[index], v[index], row, lr, step)


def rows_reference(table: np.ndarray, indices: np.ndarray, rows: np.ndarray, lr: float,
                   state: np.ndarray | None = None) -> None:
    """The row-sparse kernel in NumPy: table[i] -= lr * row (state[i] += row), in order, so repeats add."""
    lr = np.float32(lr)
    for index, row in zip(indices, rows):
        if state is not None:
            state[index] += row
        table[index] -= lr * row
