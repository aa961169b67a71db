"""The bridge's options (`gadei bridge --help`, a job file's [bridge]) and the limits they are
checked against."""

import logging
from dataclasses import dataclass

from .mpi import BridgeError

log = logging.getLogger(__name__)


STRATEGY_NAMES = ("average", "elastic", "gossip")  # the classes: gadei.bridge.exchange.STRATEGIES
DEFAULT_INTERVAL = 100  # local versions between exchanges when neither interval nor every is given


# An exchange's flag element: 1 from a rank whose job finished, LEAVING from one that leaves
# now. Both are exact in float16 (--float16 sends the flag too) and their sums in float32, so
# the sum tells how many finished (< LEAVING) and whether one left (>= LEAVING).
LEAVING = 2048.0
MAX_RANKS = int(LEAVING) - 1


@dataclass
class BridgeOptions:
    """How the bridge exchanges; see `gadei bridge --help`.

    Attributes:
        strategy: 'average', 'elastic' or 'gossip'.
        interval: exchange after this many local versions (None: use `every`).
        every: exchange every this many seconds (None: use `interval`).
        alpha: elastic moving rate (default 0.9 / nodes).
        bucket_mb: megabytes per bucket; 0: no buckets; None: sized from the measured link.
        float16: float16 on the wire, float32 accumulation.
        timeout: seconds any MPI wait may last before the peer counts as lost.
        checkpoint_dir: average/elastic write a checkpoint of the local job here when they end on a lost peer.
        save: once every node's job finished, write the model they agreed on here.
        json: print JSON lines (one per exchange and one at the end) on stdout.
        trace: write each exchange's vectors into this folder (`exchange.write_trace`: a copy of
            the model per exchange, for tests and debugging).
    """

    strategy: str = "average"
    interval: int | None = None
    every: float | None = None
    alpha: float | None = None
    bucket_mb: float | None = None
    float16: bool = False
    timeout: float = 60.0
    checkpoint_dir: str | None = None
    save: str | None = None
    json: bool = False
    trace: str | None = None

    def check(self, nodes: int) -> None:
        if self.strategy not in STRATEGY_NAMES:
            raise BridgeError(f"strategy {self.strategy!r} is not one of {list(STRATEGY_NAMES)}")
        if nodes < 2:
            raise BridgeError(f"the bridge runs on {nodes} rank: start one rank per node, `mpiexec -n NODES gadei bridge`")
        if nodes > MAX_RANKS:
            raise BridgeError(f"the bridge runs on {nodes} ranks: at most {MAX_RANKS}")
        if self.interval is not None and self.every is not None:
            raise BridgeError("give --interval or --every, not both")
        if self.interval is not None and self.interval < 1:
            raise BridgeError(f"--interval {self.interval}: must be at least 1 version")
        if self.every is not None and self.every < 0:
            raise BridgeError(f"--every {self.every}: must not be negative")
        if not self.timeout > 0:
            raise BridgeError(f"--timeout {self.timeout}: must be positive seconds")
        if self.bucket_mb is not None and self.bucket_mb < 0:
            raise BridgeError(f"--bucket-mb {self.bucket_mb}: must be 0 (no buckets), positive, or auto")
        if self.alpha is not None and not 0 < self.alpha < 1:
            raise BridgeError(f"--alpha {self.alpha}: must be in (0, 1)")
        if self.strategy == "elastic" and self.alpha is not None and self.alpha * nodes > 1:
            log.warning("elastic alpha %g x %d nodes > 1: the centre overshoots the nodes (EASGD needs alpha * nodes <= 1)",
                        self.alpha, nodes)
