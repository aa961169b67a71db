"""How the nodes' models are combined: the `Strategy` interface, and the collective ones,
`Average` and `Elastic` (gossip is in gadei.bridge.gossip)."""

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np

from ..errors import GadeiTimeout
from .mpi import PeerLost
from .options import LEAVING, BridgeOptions
from .wire import Wire


class Ended(Exception):
    """The exchanges are over for every rank (one of them left)."""


class Strategy(ABC):
    """How the nodes' models are combined.

    The bridge loop asks `ready(due)` whether to exchange now (`due`: the local schedule
    says so), and then calls `exchange(w, leaving, finished)` with a copy of the local
    weights; it returns the target the local model moves to, or None (no move this time).
    `leaving`: the local job has stopped and this rank is about to go. `finished`: the
    local job finished its schedule; the rank keeps taking part with its final weights
    (moved to each target in memory) until every node finished: that exchange is `final`,
    its target the job's model, the same on every node. Collective strategies take every
    rank into every exchange and raise Ended when any rank leaves; `leave()` says goodbye
    where a strategy needs to.

    Args:
        comm: the MPI communicator (one rank per node).
        wire: how vectors travel.
        options: the bridge's options.
        n: parameters of the model.
    """

    name: ClassVar[str]
    collective: ClassVar[bool] = True

    def __init__(self, comm, wire: Wire, options: BridgeOptions, n: int):
        self.comm = comm
        self.wire = wire
        self.options = options
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.n = n
        self.lost: list[int] = []  # peers given up on
        self.peer = None  # the partner of the last exchange (gossip)
        self.final = False  # the last exchange was the final one: every node had finished

    def ready(self, due: bool) -> bool:
        return due

    @property
    def done(self) -> bool:
        """No exchange is left to do (no peers)."""
        return False

    @abstractmethod
    def exchange(self, weights: np.ndarray, leaving: bool, finished: bool = False) -> np.ndarray | None:
        """One exchange from the local weights; the target, or None."""

    def leave(self) -> None:
        """Tell the others this rank goes (after the last exchange)."""

    def trace(self) -> dict:
        """What `--trace` records of the last exchange besides the vectors sent and received."""
        return {}

    @property
    def clean(self) -> bool:
        """Nothing is left in flight: MPI may be finalised."""
        return not self.lost


class _Collective(Strategy):
    """The allreduce round shared by average and elastic: a flag element says who leaves."""

    def __init__(self, *args):
        super().__init__(*args)
        self._send = np.empty(self.n + 1, dtype=np.float32)
        self._sum = np.empty(self.n + 1, dtype=np.float32)

    def _allreduce(self, vector: np.ndarray, leaving: bool, finished: bool) -> np.ndarray:
        """The sum over ranks of `vector`; Ended if any rank is leaving; PeerLost on timeout;
        `final` set when every rank has finished."""
        self._send[: self.n] = vector
        self._send[self.n] = LEAVING if leaving else 1.0 if finished else 0.0
        try:
            self.wire.allreduce_sum(self._send, self._sum, what=f"{self.name} exchange")
        except GadeiTimeout as err:
            self.lost = [r for r in range(self.size) if r != self.rank]
            raise PeerLost(f"{self.name}: a peer did not take part in the exchange: {err}", self.lost) from None
        flag = float(self._sum[self.n])
        if flag >= LEAVING:
            raise Ended(f"{int(flag // LEAVING)} rank(s) left")
        self.final = flag == self.size
        return self._sum[: self.n]


class Average(_Collective):
    """Every node ends each exchange with the mean model.

        d_i = w_i - r          (r: the model every node agreed on at the last exchange)
        r  <- r + (1/N) sum_i d_i,   and every node moves to r

    The first exchange averages the weights themselves (r = 0). Deltas are small, so
    float16 on the wire loses little of them.
    """

    name = "average"

    def __init__(self, *args):
        super().__init__(*args)
        self.reference: np.ndarray | None = None

    def exchange(self, weights, leaving, finished=False):
        delta = weights if self.reference is None else weights - self.reference
        total = self._allreduce(delta, leaving, finished)
        mean = total * np.float32(1.0 / self.size)
        if self.reference is None:
            self.reference = mean.copy()
        else:
            self.reference += mean
        return self.reference


class Elastic(_Collective):
    """Elastic averaging against a global centre c, kept alike by every rank (MPI elastic SGD).

        d_i = w_i - c
        node i:  w_i <- w_i - alpha d_i
        centre:  c   <- c + alpha sum_i d_i

    The first exchange sets c to the mean of the weights and moves every node there; the
    final one (every node finished) moves every node to the centre, the job's model.
    alpha defaults to 0.9 / N (EASGD's beta = N alpha = 0.9).
    """

    name = "elastic"

    def __init__(self, *args):
        super().__init__(*args)
        self.alpha = np.float32(self.options.alpha or 0.9 / self.size)
        self.centre: np.ndarray | None = None

    def exchange(self, weights, leaving, finished=False):
        if self.centre is None:
            total = self._allreduce(weights, leaving, finished)
            self.centre = total * np.float32(1.0 / self.size)
            return self.centre
        delta = weights - self.centre
        total = self._allreduce(delta, leaving, finished)
        self.centre += self.alpha * total
        return self.centre if self.final else weights - self.alpha * delta

    def trace(self):
        return {"centre": self.centre, "alpha": self.alpha}
