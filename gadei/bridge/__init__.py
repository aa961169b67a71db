"""The bridge: one MPI rank per node joins the nodes' jobs into one (the hybrid model).

    node A: server + learners  <-- region -->  bridge rank 0  <== MPI ==>  bridge rank 1  <-- region -->  node B

Each node runs its own server and learners. Its bridge (`mpiexec -n NODES gadei bridge JOB
...`, or a thread of each rank of `mpiexec -n NODES gadei run job.toml` with a [bridge]
section, which also runs the node's job: `Background`) attaches to the local region like a
learner: it claims a ring, beats its entry and never holds anything the server needs.
Every `interval` local versions (or `every` seconds) it copies the local weights w,
exchanges with the other nodes as its `Strategy` says, and gets a target t the local model
should move to. It writes the move back through its ring as one slot of kind MOVE holding
w - t, which the server applies exactly once like any other slot but as it is, outside the
job's update rule: w -= (w - t) (the centre, in elastic mode), with no learning rate,
momentum, optimizer state (adagrad's sums, adam's moments), staleness scaling or bound. That leaves

    t + (whatever the learners added since w was copied)

so the learners' progress during the exchange is kept, the server applies every update
exactly once, and it never waits for the bridge. The bridge waits until its move was
applied before it copies the weights again. Jobs it cannot move are refused: sync mode (the
bridge would be a member of every round), row-sparse tables and float16/bfloat16 rings (the
move changes every weight and must travel as float32).

Strategies (one interface, `Strategy`):
    average  allreduce of the deltas since the last exchange; every node ends the exchange
             with the same model (the first exchange averages the weights themselves).
    elastic  elastic averaging against a global centre c kept by every rank alike (MPI
             elastic SGD): node i moves w_i -= alpha (w_i - c), the centre moves
             c += alpha sum_i (w_i - c).
    gossip   asynchronous pairwise averaging (AD-PSGD): even ranks are active, odd ranks
             passive; an active rank averages with one random passive peer at a time, so
             pairings cannot deadlock, and a peer that does not answer within its patience
             is passed over for another (a slow node delays only its partner of the moment).

Wire: large vectors travel in buckets whose size comes from the measured per-message
latency alpha and per-byte cost beta (MG-WFBP's merging: a bucket is large enough that
alpha is at most 5 % of its transfer time), optionally as float16 with float32
accumulation (an allgather of float16 buckets summed in rank order, the same on every rank).

End: when the local job finished (its supervisor stopped it after every launched learner
finished, and says so in the header `finished`), the bridge gives its ring back so the
server can stop, and reads the final weights. average and elastic keep taking part in the
exchanges with them (moved to each target in memory; nothing more reaches the stopped
server) until every rank finished: that exchange is `final` and its target the job's model,
the same on every rank (average: the agreed model; elastic: the centre). gossip says BYE
and joins one allreduce of the final weights (up to `timeout` for the others): their mean.
`BridgeRank.save_final` writes it (`gadei bridge --save`; `gadei run` into each node's
model.pt). A job stopped otherwise leaves the exchanges at once.

Failure: every MPI wait polls non-blocking requests against a deadline (`timeout`). When a
peer does not answer in time, average and elastic end the exchange for everyone (each
surviving rank logs it, writes a checkpoint of its job with `checkpoint_dir`, exits
PEER_LOST); gossip stops pairing with that peer and goes on. The local job is never
stopped by the bridge: the node keeps training. Run mpiexec with `--enable-recovery
--runtime-options error-nonzero-status=false` so that Open MPI does not kill the surviving
ranks when one dies (`MPIEXEC_OPTIONS`). MPI_Finalize (the runtime's fence of every rank)
can wait forever on a rank that died without any survivor noticing, so it is bounded by
`timeout` too: a rank whose finalize does not return in time leaves without it (`finalize`).
A passive gossip rank held by one asker for a quarter of the timeout answers the others'
requests BUSY, so they try another peer and do not take it for lost while it waits out a
dead asker.
A local server that dies without stopping its job is restarted by the node's supervisor into
a new region: the bridge takes part with the dead server's last weights (moved in memory,
never in the dead region) until the restarted one serves, then attaches to it
(`LocalNode.successor`); with no supervisor left, or none serving within RESTART_WAIT, it
leaves the exchanges and says why.

The package, one noun a module:
    mpi         mpi4py loaded once, the bridge's errors, every wait polled against a deadline
    wire        the measured link and `Wire`: buckets, float16 on the wire
    node        `LocalNode`: the node's job seen from its bridge rank
    options     `BridgeOptions` and their limits
    strategies  the `Strategy` interface, `Average`, `Elastic`
    gossip      `Gossip`
    exchange    `BridgeRank`: one rank's loop; `main` (`gadei bridge`), `finalize`
    mpiexec     ranks under a launcher, `Background` (a rank's bridge beside its job), mpiexec here
    measurement `gadei bench bridge`'s measurement (`python -m gadei.bridge SIZES REPEATS`)
"""

from .exchange import PEER_LOST, STRATEGIES, BridgeRank, Report, finalize, job_name, main
from .mpi import BridgeError, LinkDown, PeerLost, mpi, wait_all
from .mpiexec import MPIEXEC_OPTIONS, Background, child_environment, find_mpiexec, launched_ranks, local_mpiexec
from .node import LocalNode
from .options import DEFAULT_INTERVAL, STRATEGY_NAMES, BridgeOptions
from .strategies import Average, Elastic, Strategy
from .gossip import Gossip
from .wire import Link, Wire, fit_link, measure_link

__all__ = [
    "DEFAULT_INTERVAL", "MPIEXEC_OPTIONS", "PEER_LOST", "STRATEGIES", "STRATEGY_NAMES", "Average", "Background",
    "BridgeError", "BridgeRank", "Elastic", "Gossip", "Link", "LinkDown", "LocalNode", "BridgeOptions", "PeerLost",
    "Report", "Strategy", "Wire", "child_environment", "finalize", "find_mpiexec", "fit_link", "job_name",
    "launched_ranks", "local_mpiexec", "main", "measure_link", "mpi", "wait_all",
]
