"""Update rules: how the server turns consumed slots into a change of the shared weights.

The server's loop is the same for every mode except `sync`, which collects one gradient per
live learner before it updates; what happens to the weights is one `UpdateRule`. A rule
states its maths in its docstring and applies it with the native kernels of the slot's
format (gadei.transport.slot: GIL released, OpenMP); the tests hold it to a pure NumPy oracle
(tests/oracles.py). Every rule hands a slot's dense area back zeroed and its row counts at
zero, because the next backward pass of the learner accumulates into it.

| mode | rule | learners see |
|---|---|---|
| async | ASGD (Hogwild): w -= lr_s * g for each gradient as it comes; optional momentum, staleness-aware lr_s = lr / staleness, staleness bound | weights as they change |
| consistent | the same, inside a seqlock, so a pull never copies a half-applied update | whole updates only (pull='copy') |
| sync | SSGD: one gradient from every live learner, averaged, applied once | a new version per round |
| elastic | EASGD: the region holds the centre c; a learner's weights w move it, c += alpha (w - c) | their own local model |
"""  # noqa: E501 (a markdown table: one row a line)

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .options import check_all, declared, from_header, option, used_in
from .layout import MODE_CODES
from .region import Region
from .transport.slot import Float32Dense, Gradient, SlotFormat

MODES = ("async", "consistent", "sync", "elastic")  # the update rules (RULES), as a job file and --mode name them
SERVER_STEPS = ("async", "consistent", "sync")  # the modes whose server takes the optimiser step
ASYNC = ("async", "consistent")
OPTIMIZERS = ("sgd", "adagrad", "adam")  # index = the header's code
NONFINITE = ("skip", "stop")  # what the server does with a gradient holding NaN or inf; index = the header's code
ADAGRAD_EPS = 1e-10
ADAM_BETA1, ADAM_BETA2, ADAM_EPS = 0.9, 0.999, 1e-8  # torch.optim.Adam's defaults (RuleOptions' adam_*)
ADAM_OPTIONS = ("adam_beta1", "adam_beta2", "adam_eps")
MAX_LR = 10.0  # a larger step makes every workload's loss overflow at once


@dataclass(frozen=True)
class RuleOptions:
    """A job's update-rule options, stored in the region header.

    Attributes:
        lr: learning rate.
        momentum: momentum mu kept by the server (0: none): v = mu v + g; w -= lr v.
        optimizer: "sgd" (w -= lr g, with momentum if set), "adagrad" (per weight: s += g^2;
            w -= lr g / (sqrt(s) + 1e-10); the server keeps s, and checkpoints it) or "adam"
            (per weight, torch.optim.Adam's rule with betas adam_beta1, adam_beta2 and
            adam_eps: the server keeps the moments m and v, and checkpoints them; the step t of the bias
            correction is the weights' version after the update; row-sparse tables are
            updated lazily, as torch.optim.SparseAdam: only the rows a gradient carries).
            Adagrad gives rarely seen weights (the embedding rows of rare words) larger
            steps, as Kim 2014's Adadelta did: on SST-2 the text CNN reaches 78-79% in 3
            epochs at lr 0.01, where plain SGD stays near 77% after 20. Adam's usual lr is
            0.001.
        adam_beta1, adam_beta2, adam_eps: Adam's decay of its first and second moments and
            its epsilon (torch's defaults 0.9, 0.999, 1e-8); only with optimizer adam.
        stale_lr: divide the learning rate by each gradient's staleness (async, consistent).
        stale_bound: 0, or K: no gradient is applied more than K versions after the weights
            it was computed on (async, consistent). A learner does not publish a gradient
            that could arrive later than that; when it is that far behind it blocks until the
            server settled what it published and then takes the newest weights. The server
            discards a gradient that still arrives too late (a learner preempted between its
            check and its push).
        alpha: elastic moving rate.
        tau: elastic: local steps between two exchanges with the centre.
        drop_after: seconds without a heartbeat after which a learner is left out of a sync
            round or of the staleness bound.
        nonfinite: what the server does with a gradient (or a bridge's move, or an elastic
            learner's weights) holding NaN or infinite values: "skip" (default) hands the slot
            back unapplied and counts it (`gadei status`), so one bad mini-batch costs one
            step and never poisons the shared weights; "stop" stops the job with an error
            naming the learner ring (the last checkpoint is from before it).
    """

    lr: float = option(0.01, "learning rate", low=0, low_open=True, high=MAX_LR)
    momentum: float = option(0.0, "momentum kept by the server (0: none; sgd)", low=0, high=1, high_open=True,
                             modes=SERVER_STEPS)
    optimizer: str = option("sgd", "the server's update: sgd (w -= lr g), adagrad (per weight, lr divided by the "
                            "root of the sum of its squared gradients) or adam (per weight, moments kept by the "
                            "server; usual lr 0.001); async, consistent, sync", choices=OPTIMIZERS,
                            modes=SERVER_STEPS)
    adam_beta1: float = option(ADAM_BETA1, "adam: decay of the first moment m (torch's beta1)", low=0, high=1,
                               high_open=True, modes=SERVER_STEPS)
    adam_beta2: float = option(ADAM_BETA2, "adam: decay of the second moment v (torch's beta2)", low=0, high=1,
                               high_open=True, modes=SERVER_STEPS)
    adam_eps: float = option(ADAM_EPS, "adam: added to the root of v before dividing (torch's eps)", low=0, high=1,
                             low_open=True, modes=SERVER_STEPS)
    stale_lr: bool = option(False, "async/consistent: divide lr by each gradient's staleness", modes=ASYNC)
    stale_bound: int = option(0, "async/consistent: no gradient applied more than K versions late (0: no bound)",
                              low=0, high=10**9, metavar="K", modes=ASYNC)
    alpha: float = option(0.1, "elastic: moving rate", low=0, high=1, low_open=True, high_open=True,
                          modes=("elastic",))
    tau: int = option(4, "elastic: local steps between exchanges with the centre", low=1, high=10**6,
                      modes=("elastic",))
    drop_after: float = option(10.0, "sync/stale_bound: seconds without a heartbeat before a learner is left out",
                               low=0, low_open=True, high=86400)
    nonfinite: str = option("skip", "a gradient with NaN or inf values: skip it and count it (`gadei status` shows "
                            "the count), or stop the job with an error", choices=NONFINITE)

    def check(self, mode: str, rings: int | None = None) -> None:
        """Raise ValueError naming the option and its allowed values where `mode` cannot use it.

        `rings` (the job's learner capacity) bounds stale_bound from below: a gradient may
        wait behind one from each of the other rings.
        """
        check_all(self)
        if self.optimizer != "sgd" and self.momentum:
            raise ValueError(f"momentum applies to the sgd optimizer, not {self.optimizer}"
                             + (" (Adam keeps its own first moment, beta1 0.9)" if self.optimizer == "adam" else ""))
        for name in ADAM_OPTIONS:
            if self.optimizer != "adam" and getattr(self, name) != RuleOptions.__dataclass_fields__[name].default:
                raise ValueError(f"{name} applies to the adam optimizer only; give optimizer = 'adam' (--optimizer "
                                 "adam) with it, or leave it out")
        if self.optimizer != "sgd" and mode == "elastic":
            raise ValueError(f"the {self.optimizer} optimizer applies to async, consistent and sync modes, not "
                             "elastic (elastic learners take their own local steps)")
        if mode in MODES:  # an option of another mode, given: say so rather than ignore it
            for f in declared(RuleOptions):
                if not used_in(RuleOptions, f.name, mode) and getattr(self, f.name) != f.default:
                    users = f.metadata["option"]["modes"]
                    raise ValueError(f"{f.name} applies to {', '.join(users[:-1])} and {users[-1]} modes, not {mode}"
                                     if len(users) > 1 else f"{f.name} applies to {users[0]} mode, not {mode}")
        if self.stale_bound and rings is not None and self.stale_bound < rings:
            raise ValueError(f"stale_bound {self.stale_bound} is below the {rings} learner rings: with {rings} "
                             f"learners a gradient can wait behind {rings - 1} others; use at least {rings}")


class UpdateRule(ABC):
    """The server's update rule of one mode.

    Args:
        region: the job's region (its weights, state array and slot layout).
        options: the job's options.
        threads: OpenMP threads of the kernels.
    """

    name: ClassVar[str]
    rounds: ClassVar[bool] = False  # True: the server collects one gradient per learner per update
    seqlock: ClassVar[bool] = False  # True: the server makes `seq` odd around each update

    def __init__(self, region: Region, options: RuleOptions, threads: int):
        options.check(self.name)
        self.options = options
        self.threads = max(1, int(threads))
        self.weights = region.weights_addr
        self.state = region.base + region.layout.state if region.layout.state is not None else 0
        self.format = SlotFormat(region, self.threads)
        self._header = region.header
        self.betas = (options.adam_beta1, options.adam_beta2, options.adam_eps)

    def step(self) -> int:
        """The step t of the update being made: the weights' version after it (updates applied
        to them, ever, across restarts; Adam's bias correction counts it)."""
        return self._header.get("version") + 1

    @abstractmethod
    def apply(self, grads: list[Gradient]) -> None:
        """Make one update of the weights from `grads` (one gradient, or a sync round), leaving
        their slots ready for reuse (the server hands them back)."""

    def move(self, grad: Gradient) -> None:
        """Apply a bridge's move: w -= payload (the centre, in elastic mode), clearing the slot.
        The bridge only attaches to jobs whose slots are dense float32 (gadei.bridge)."""
        self.format.sgd(self.weights, grad, 1.0)


class AsyncSGD(UpdateRule):
    """ASGD, Hogwild style: each gradient g, as it arrives, updates the weights in place.

        lr_s = lr / max(1, staleness) with stale_lr, else lr
        momentum 0:   w <- w - lr_s * g
        momentum mu:  v <- mu * v + g;  w <- w - lr_s * v
        adagrad:      s <- s + g^2;  w <- w - lr_s * g / (sqrt(s) + eps)   (where g != 0)
        adam:         m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;
                      w <- w - lr_s / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
                      (t: the weights' version after the update; b1 0.9, b2 0.999, eps 1e-8)

    No lock: learners may read the weights while they change (that is what `view` pulls
    see). Row-sparse tables update only the rows a gradient carries (with momentum, their
    v decays everywhere and the carried rows are added; Adam is lazy there, as SparseAdam: an
    untouched row's moments do not decay).
    """

    name = "async"

    def learning_rate(self, staleness: int) -> float:
        """The learning rate a gradient of this staleness is applied with."""
        if self.options.stale_lr and staleness > 1:
            return self.options.lr / staleness
        return self.options.lr

    def apply(self, grads: list[Gradient]) -> None:
        for grad in grads:
            self._update(grad, self.learning_rate(grad.staleness))

    def _update(self, grad: Gradient, lr: float) -> None:
        if self.options.optimizer == "adam":
            self.format.adam(self.weights, self.state, grad, lr, self.step(), self.betas)
        elif self.options.optimizer == "adagrad":
            self.format.adagrad(self.weights, self.state, grad, lr, ADAGRAD_EPS)
        elif self.options.momentum:
            self.format.momentum(self.weights, self.state, grad, lr, self.options.momentum)
        else:
            self.format.sgd(self.weights, grad, lr)



class ConsistentSGD(AsyncSGD):
    """ASGD inside a seqlock, so that a pull never copies a half-applied update.

    The server makes the region's `seq` odd before an update and even after it (the version
    moves inside); a pull copies the weights between two reads of an even, unchanged `seq`,
    and copies again otherwise. The server never waits for readers. The maths is AsyncSGD's.
    """

    name = "consistent"
    seqlock = True


class SyncSGD(AsyncSGD):
    """SSGD: one gradient from every live learner, averaged, applied as one update.

        g = (1 / k) * sum of the round's k gradients
        w <- w - lr * g   (with momentum mu: v <- mu * v + g; w <- w - lr * v; adagrad and
                           adam as in AsyncSGD, on g, with t the round's version)

    With Adam, a row-sparse table moves only in the rows some gradient of the round carried
    (lazy, as in async mode).

    The average is summed in a server-private float32 buffer; the version moves once per
    round. A learner that stops beating for `drop_after` seconds is left out of the round
    (its gradient, when it comes, is applied in a later round, exactly once).
    """

    name = "sync"
    rounds = True

    def __init__(self, region: Region, options: RuleOptions, threads: int):
        super().__init__(region, options, threads)
        self._sum = np.zeros(region.shape.n_params, dtype=np.float32)
        self._sum_addr = int(self._sum.ctypes.data)
        self._sum_format = Float32Dense(region.shape.n_params, self.threads)
        # Adam moves the dense parts of the weights and the tables' touched rows apart
        self._dense_parts = [(offset, Float32Dense(length, self.threads)) for offset, length, _ in self.format.segments]
        self._tables = [Float32Dense(table.size, 1) for table in self.format.tables]

    def apply(self, grads: list[Gradient]) -> None:
        if not grads:
            return
        touched = [self.format.indices_in(g) for g in grads] if self.options.optimizer == "adam" else None
        scale = -1.0 / len(grads)  # sgd with a negative lr adds: sum += g / k
        for grad in grads:
            self.format.sgd(self._sum_addr, grad, scale)
        if touched is not None:
            self._adam(touched)
        elif self.options.optimizer == "adagrad":
            self._sum_format.adagrad(self.weights, self.state, self._sum_addr, self.options.lr, ADAGRAD_EPS)
        elif self.options.momentum:
            self._sum_format.momentum(self.weights, self.state, self._sum_addr, self.options.lr, self.options.momentum)
        else:
            self._sum_format.sgd(self.weights, self._sum_addr, self.options.lr)  # also zeroes the sum

    def _adam(self, touched: list[list[np.ndarray]]) -> None:
        """Adam on the round's mean gradient (in the sum buffer, zeroed after): dense weights
        every one, a table's rows only where some gradient of the round (`touched`: each one's
        row indices per table) carried them."""
        lr, step, n = self.options.lr, self.step(), len(self._sum)
        m, v = self.state, self.state + 4 * n
        for offset, part in self._dense_parts:
            part.adam(self.weights + 4 * offset, m + 4 * offset, v + 4 * offset, self._sum_addr + 4 * offset, lr, step,
                      self.betas)
        for k, (table, rows_format) in enumerate(zip(self.format.tables, self._tables)):
            indices = np.unique(np.concatenate([rows[k] for rows in touched]))
            if not indices.size:
                continue
            area = self._sum[table.offset : table.offset + table.size].reshape(table.rows, table.width)
            rows = np.ascontiguousarray(area[indices])
            rows_format.adam_rows(self.weights + 4 * table.offset, m + 4 * table.offset, v + 4 * table.offset, indices,
                                  rows, lr, step, self.betas)  # indices checked when the round was summed
            area[indices] = 0.0



class ElasticAveraging(UpdateRule):
    """EASGD, asynchronous: the region's weights are the centre c; learners train local models.

    Every `tau` local steps a learner pushes its weights w and moves them towards the centre
    it read, w <- w - alpha * (w - c); the server moves the centre towards each w it gets:

        c <- c + alpha * (w - c)

    Slots carry float32 weights, not gradients, and no row-sparse tables.
    """

    name = "elastic"

    def __init__(self, region: Region, options: RuleOptions, threads: int):
        super().__init__(region, options, threads)
        shape = region.shape
        if shape.grad_dtype != "float32" or shape.sparse:
            raise ValueError("elastic mode pushes whole float32 weights: use grad_dtype float32 and no row-sparse "
                             "tables")
        self.n = shape.n_params
        self._slot_format = Float32Dense(self.n, self.threads)  # a slot holds a learner's float32 weights

    def apply(self, grads: list[Gradient]) -> None:
        for grad in grads:
            self._slot_format.elastic(self.weights, grad.payload, self.options.alpha)


RULES: dict[str, type[UpdateRule]] = {rule.name: rule for rule in (AsyncSGD, ConsistentSGD, SyncSGD, ElasticAveraging)}
assert set(RULES) == set(MODE_CODES)


def read_options(region: Region) -> RuleOptions:
    """The options the job's server recorded in the region header (`options.from_header`)."""
    return from_header(RuleOptions, region.header)


def state_names(options: RuleOptions) -> tuple[str, ...]:
    """What the region's state array holds under `options`, n_params float32 each, in order
    (their names in a checkpoint): nothing, the momentum buffer, Adagrad's sums, or Adam's two
    moments."""
    if options.optimizer == "adam":
        return ("adam_m", "adam_v")
    if options.optimizer == "adagrad":
        return ("adagrad_sums",)
    return ("momentum",) if options.momentum else ()


def make_rule(mode: str, region: Region, options: RuleOptions, threads: int) -> UpdateRule:
    """The update rule of `mode`, bound to `region`."""
    try:
        rule = RULES[mode]
    except KeyError:
        raise ValueError(f"mode {mode!r} is not one of {sorted(RULES)}") from None
    return rule(region, options, threads)
