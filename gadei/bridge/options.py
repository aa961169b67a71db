"""The bridge's options, declared once (`gadei.options.option`): `gadei bridge`'s flags and
`--help` and a job file's [bridge] keys and their checks are made from `BridgeOptions`, and
what two of them do not allow together (`BridgeOptions.conflict`) is said once for both; and
the limits they are checked against."""

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

from ..modes import MAX_LR
from ..options import check_all, option
from .mpi import BridgeError

log = logging.getLogger(__name__)


STRATEGY_NAMES = ("average", "elastic", "gossip")  # the classes: gadei.bridge.exchange.STRATEGIES
DEFAULT_INTERVAL = 100  # local versions between exchanges when neither interval nor every is given
SCHEDULES = ("interval", "every")  # the exchange schedule: after local versions or every seconds, one of them


# An exchange's flag element: 1 from a rank whose job finished, LEAVING from one that leaves
# now. Both are exact in float16 (--float16 sends the flag too) and their sums in float32, so
# the sum tells how many finished (< LEAVING) and whether one left (>= LEAVING).
LEAVING = 2048.0
MAX_RANKS = int(LEAVING) - 1


@dataclass(frozen=True)
class BridgeOptions:
    """How the bridge exchanges: `gadei bridge --help`, or a job file's [bridge] under
    `mpiexec -n NODES gadei run`.

    What only one of them has, and why: where a rank's output goes (checkpoint_dir, save,
    json, trace) is `gadei bridge`'s alone, a bridged job's outputs being its output folder's;
    node_lr is the job file's alone, `gadei bridge` attaching to a job already served at its
    rate (`gadei serve --lr`).

    Both refuse the same values, and the same pairs (`conflict`); `gadei bridge` shows interval
    and every as alternatives (`[--interval N | --every S]`), and its parser refuses the two
    together before `conflict` would.

    Attributes:
        strategy: 'average', 'elastic' or 'gossip'.
        interval: exchange after this many local versions (None: use `every`, or
            DEFAULT_INTERVAL when neither is given).
        every: exchange every this many seconds (None: use `interval`).
        alpha: elastic moving rate (None: 0.9 / nodes).
        bucket_mb: megabytes per bucket; 0: no buckets; None ("auto"): sized from the measured link.
        float16: float16 on the wire, float32 accumulation.
        timeout: seconds any MPI wait may last before the peer counts as lost.
        node_lr: a bridged job's lr on each node (None: [train] lr x nodes, elastic x (nodes + 1):
            gadei.placement.Bridged.lr).
        checkpoint_dir: average/elastic write a checkpoint of the local job here when they end on a lost peer.
        save: once every node's job finished, write the model they agreed on here.
        json: print JSON lines (one per exchange and one at the end) on stdout.
        trace: write each exchange's vectors into this folder (`exchange.write_trace`: a copy of
            the model per exchange, for tests and debugging).
    """

    strategy: str = option("average", "average: allreduce of the deltas, every node ends an exchange with the mean "
                           "model; elastic: nodes pulled towards a global centre with moving rate --alpha; gossip: "
                           "average with one random peer at a time, even ranks asking, odd ranks answering",
                           choices=STRATEGY_NAMES)
    interval: int | None = option(None, "exchange after N local versions", low=1, high=10**9, metavar="N",
                                  shown=str(DEFAULT_INTERVAL))
    every: float | None = option(None, "exchange every S seconds instead of after local versions", low=0,
                                 low_open=True, metavar="S")
    alpha: float | None = option(None, "elastic: moving rate", low=0, high=1, low_open=True, high_open=True,
                                 shown="0.9 / nodes")
    bucket_mb: float | None = option(None, "megabytes per message; 0: the whole model in one; auto: sized from the "
                                     "measured latency and per-byte cost", low=0, auto=True, metavar="MB|auto",
                                     allowed='0 (the whole model in one message), a number of megabytes above 0, '
                                     'or "auto"')
    float16: bool = option(False, "float16 on the wire, float32 sums")
    timeout: float = option(60.0, "seconds any wait on a peer may last", low=0, low_open=True)
    node_lr: float | None = option(None, "each node's learning rate", low=0, low_open=True, high=MAX_LR, flag=False,
                                   shown="[train] lr x nodes, elastic x (nodes + 1)")
    checkpoint_dir: str | None = option(None, "average/elastic: when a peer is lost, write a checkpoint of the local "
                                        "job here", job=False, metavar="DIR")
    save: str | None = option(None, "once every node's job finished, write the model they agreed on here (average, "
                              "elastic: the last exchange's; gossip: the mean of the final weights); '{rank}' is "
                              "replaced by this rank's number", job=False, metavar="PATH")
    json: bool = option(False, "JSON lines on stdout: ready, one per exchange, ended", job=False)
    trace: str | None = option(None, "write each exchange's vectors to DIR/rank-R/N.npz (the weights sent, the "
                               "target, elastic's centre, gossip's pair): a copy of the model per exchange, for tests "
                               "and debugging", job=False, metavar="DIR")

    def conflict(self, shown: Callable[[str, Any], str]) -> str | None:
        """What these options do not allow together, in words, or None: a job file's [bridge]
        and `gadei bridge`'s flags refuse alike, each naming an option as its source writes it
        (`shown(name, value)`: "every = 2", "--every 2")."""
        if self.interval is not None and self.every is not None:
            return (f"{shown('interval', self.interval)} and {shown('every', self.every)}: exchange after versions or "
                    "every seconds; allowed: one of them")
        if self.alpha is not None and self.strategy != "elastic":
            return (f"{shown('alpha', self.alpha)} with {shown('strategy', self.strategy)}: alpha is the elastic "
                    f"strategy's moving rate; allowed: with {shown('strategy', 'elastic')}")
        return None

    def scheduled(self) -> "BridgeOptions":
        """These options with the exchange schedule filled in: DEFAULT_INTERVAL local versions
        when neither interval nor every is given."""
        if self.interval is None and self.every is None:
            return replace(self, interval=DEFAULT_INTERVAL)
        return self

    def check(self, nodes: int) -> None:
        """The options against their declarations, each other, and `nodes` ranks.

        Raises:
            BridgeError: an option's value is not allowed, or not with another's, or not with
                this many ranks.
        """
        try:
            check_all(self)
        except ValueError as err:
            raise BridgeError(f"bridge options: {err}") from None
        conflict = self.conflict(lambda name, value: f"{name} = {value!r}")
        if conflict is not None:
            raise BridgeError(f"bridge options: {conflict}")
        if nodes < 2:
            raise BridgeError(f"the bridge runs on {nodes} rank: start one rank per node, "
                              "`mpiexec -n NODES gadei bridge`")
        if nodes > MAX_RANKS:
            raise BridgeError(f"the bridge runs on {nodes} ranks: at most {MAX_RANKS}")
        if self.strategy == "elastic" and self.alpha is not None and self.alpha * nodes > 1:
            log.warning("elastic alpha %g x %d nodes > 1: the centre overshoots the nodes "
                        "(EASGD needs alpha * nodes <= 1)", self.alpha, nodes)
