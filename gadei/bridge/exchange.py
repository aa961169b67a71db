"""One bridge rank's loop: its local job, its strategy, and the exchanges between them
(`BridgeRank`); `main` for `gadei bridge`, and how a rank ends its MPI (`finalize`)."""

import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from .. import files
from ..errors import GadeiError, GadeiTimeout, JobStopped, ServerGone
from ..launch import exit_after
from ..protocol import Deadline
from ..ring import WAIT_SLICE
from .gossip import Gossip
from .mpi import LinkDown, PeerLost, mpi
from .node import RESTART_WAIT, LocalNode
from .options import BridgeOptions
from .strategies import Average, Elastic, Ended, Strategy
from .wire import MB, Wire, measure_link

log = logging.getLogger(__name__)


PEER_LOST = 3  # exit code: a peer did not answer in time and average/elastic ended the exchanges
RESTART_LOOK = 0.1  # seconds between two looks for a crashed local server's restarted one


STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (Average, Elastic, Gossip)}


@dataclass
class Report:
    """What one bridge rank did."""

    rank: int
    job: str
    strategy: str
    exchanges: int = 0
    moves: int = 0  # moves the bridge saw the server apply (also one it applied while the job stopped)
    published: int = 0  # moves handed to the server's ring (it applies every one exactly once)
    seconds: float = 0.0
    exchange_seconds: float = 0.0
    bytes_sent: int = 0
    reason: str = ""
    lost: list[int] = field(default_factory=list)
    checkpoint: str | None = None
    bucket_bytes: int = 0
    restarts: int = 0  # restarts of the local server the bridge followed (attached to the restarted one)

    @property
    def rate(self) -> float:
        return self.exchanges / self.seconds if self.seconds > 0 else 0.0


class _Schedule:
    """When the next exchange is due: after `interval` versions, or `every` seconds after the
    last one was due; collective strategies also join after `idle` seconds without one, so
    that a node with nothing to train does not leave the others waiting into their timeout."""

    def __init__(self, interval: int | None, every: float | None, idle: float | None):
        self.interval, self.every, self.idle = interval, every, idle
        self.version = 0
        self.last = self.next = time.monotonic()

    def due(self, version: int) -> bool:
        now = time.monotonic()
        if self.idle is not None and now - self.last >= self.idle:
            return True
        if self.every is not None:
            return now >= self.next
        return version - self.version >= self.interval

    def exchanged(self, version: int) -> None:
        now = time.monotonic()
        self.version, self.last = version, now
        if self.every is not None:
            self.next = max(self.next + self.every, now - self.every)  # keep the pace; no burst to catch up


class BridgeRank:
    """One rank of the bridge: its local job, its strategy, and the loop between them.

    Args:
        job: the local job's name.
        options: how to exchange.
        comm: the communicator (default: MPI.COMM_WORLD).
        on_event: called with each record (ready, exchange, ended; with "rank") as it happens,
            besides the JSON line `options.json` prints.
    """

    def __init__(self, job: str, options: BridgeOptions, comm=None, on_event=None):
        MPI = mpi()
        self.on_event = on_event
        self.comm = comm or MPI.COMM_WORLD
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        options.check(self.size)
        self.options = options = options.scheduled()
        self.job = job
        self.node = LocalNode(job)
        self.report = Report(rank=self.rank, job=job, strategy=options.strategy)
        self.clean = False  # after run(): MPI may be finalised (no peer lost, nothing in flight)
        self.final: np.ndarray | None = None  # after run(): the job's model when every node finished (collective)
        self._spec = None
        self._published = 0  # moves handed to the servers before the current one (restarted since)
        self._unconfirmed = 0  # moves in the ring when the job stopped: the stopping server still applies them

    def _emit(self, record: dict) -> None:
        record = {**record, "rank": self.rank}
        if self.on_event is not None:
            self.on_event(record)
        if self.options.json:
            print(json.dumps(record), flush=True)

    def run(self) -> Report:
        """Exchange until the local job stops, every peer left, or a peer is lost (PEER_LOST)."""
        o, node = self.options, self.node
        started = time.monotonic()
        try:
            if o.bucket_mb is None:
                link = measure_link(self.comm, o.timeout, on_poll=self._beat)
                bucket = link.bucket_bytes()
                log.info("bridge rank %d: link alpha %.1f us, beta %.3f ns/byte: buckets of %.2f MB", self.rank,
                         link.alpha * 1e6, link.beta * 1e9, bucket / MB)
            else:
                link, bucket = None, int(o.bucket_mb * MB) // 4 * 4
            wire = Wire(self.comm, bucket, o.float16, o.timeout, on_poll=self._beat)
            strategy = STRATEGIES[o.strategy](self.comm, wire, o, node.n)
        except GadeiTimeout as err:
            self._lost(str(err), [r for r in range(self.size) if r != self.rank])
            return self._finish(started, None)
        self.report.bucket_bytes = bucket
        self._emit({"event": "ready", "pid": os.getpid(), "job": self.job, "size": self.size,
                    "strategy": o.strategy, "role": _role(strategy), "bucket_bytes": bucket,
                    "link": asdict(link) if link else None})
        idle = o.timeout / 4 if strategy.collective else None
        schedule = _Schedule(o.interval, o.every, idle)
        weights = np.empty(node.n, dtype=np.float32)
        broken = False
        final: np.ndarray | None = None  # a finished job's last weights, moved to each target here
        held: np.ndarray | None = None  # a crashed server's last weights, moved to each target here until
        restart: Deadline | None = None  # its restarted server serves (then the bridge attaches to that one)
        look = Deadline(0.0)  # the next look for the restarted server
        self.report.reason = "the local job stopped"
        why_left = ""  # why this rank left the exchanges, when it was not the local job stopping
        try:
            while not strategy.done:
                leaving = False
                if held is not None and look.expired():  # the local server died: follow its restart, or leave
                    look = Deadline(RESTART_LOOK)
                    successor, why_left = self._restarted(node, restart)
                    if successor is not None:
                        node, held = successor, None
                        schedule.version = node.version()  # a restart goes back to the last checkpoint
                    elif why_left:
                        broken = leaving = True
                elif final is None and held is None:
                    node.beat()
                    serving = node.serving()
                    if not serving and not broken and node.crashed():
                        held, restart = np.empty_like(weights), Deadline(RESTART_WAIT)
                        node.snapshot(held)  # the node's last weights: the region stays mapped here
                        log.warning("bridge rank %d: the server (pid %d) of job %r died; taking part with its last "
                                    "weights until its supervisor's restarted server serves (at most %g s)", self.rank,
                                    node.server[0], self.job, RESTART_WAIT)
                        self._emit({"event": "server-died", "pid": node.server[0], "t": time.time()})
                        continue
                    leaving = broken or not serving
                    if leaving and strategy.collective and self._finished(node):
                        final, leaving = np.empty_like(weights), False
                        node.snapshot(final)
                        log.info("bridge rank %d: job %r finished; taking part with its final weights until every "
                                 "node has finished", self.rank, self.job)
                if leaving and not strategy.collective:
                    break
                if not strategy.ready(final is not None or schedule.due(node.version()) or leaving):
                    time.sleep(0.001)
                    continue
                began = time.monotonic()
                kept = final if final is not None else held  # weights kept here, not in a live region
                if kept is None:
                    seen = node.snapshot(weights)
                else:
                    seen = node.version()
                    weights[:] = kept
                target = strategy.exchange(weights, leaving, final is not None)
                took = time.monotonic() - began
                if target is not None:
                    self.report.exchanges += 1
                    self.report.exchange_seconds += took
                    if o.trace:
                        write_trace(o.trace, self.rank, self.report.exchanges, weights, target, strategy, seen)
                    if kept is not None:
                        kept[:] = target
                    elif not leaving:
                        before = node.published
                        try:
                            node.move(target, weights)
                            self.report.moves += 1
                        except (JobStopped, ServerGone, GadeiTimeout) as err:
                            # finished or crashed (the next look tells) or not: then the others
                            # learn it at the next exchange (collective) or from BYE
                            log.warning("bridge rank %d: %s", self.rank, err)
                            broken = isinstance(err, GadeiTimeout)  # alive, but it did not apply the move
                            if isinstance(err, JobStopped):  # published, unless the ring had no room
                                self._unconfirmed += node.published - before
                    self._emit({"event": "exchange", "n": self.report.exchanges, "t": time.time(), "seconds": took,
                                "version": seen, "peer": strategy.peer, "final": strategy.final})
                if strategy.final:
                    self.final, self._spec = final, node.region.read_spec()
                    self.report.reason = "every node finished"
                    break
                schedule.exchanged(node.version())
            else:
                self.report.reason = "no peers left"
        except Ended as end:
            self.report.reason = why_left or f"the exchanges ended: {end}"
        except PeerLost as err:
            self._lost(str(err), err.peers)
        except LinkDown as err:  # MPI failed outside an exchange with a known peer
            self._lost(str(err), [r for r in range(self.size) if r != self.rank])
        except (JobStopped, ServerGone) as err:
            self.report.reason = f"the local job ended: {err}"
        finally:
            if why_left and self.report.reason == "the local job stopped":
                self.report.reason = why_left
            self.report.lost = sorted(set(self.report.lost) | set(strategy.lost))
            self.report.bytes_sent = wire.sent
            self.report.published = self._published + node.published
        if self.report.reason != "peer lost":
            strategy.leave()
            if not strategy.collective and held is not None and not broken:
                broken = not self._await_restart(node, restart)  # the peers finished while it restarts
            if not strategy.collective:
                self._final_average(strategy, weights, broken)
        return self._finish(started, strategy)

    def _beat(self) -> None:
        self.node.beat()  # the node attached now (a restarted server's, after a restart)

    def _restarted(self, node: LocalNode, restart: Deadline) -> tuple[LocalNode | None, str]:
        """One look for the restarted server of a node whose server died: (the node attached
        to it, "") once it serves; (None, why) when none will (no supervisor, or none served
        within RESTART_WAIT); (None, "") while one may yet."""
        successor = node.successor()
        if successor is not None:
            return self._reattach(node, successor), ""
        if node.supervisor_alive() and not restart.expired():
            return None, ""
        why = (f"the local server (pid {node.server[0]}) died and " +
               ("no supervisor restarts it" if not node.supervisor_alive() else
                f"no restarted server served within {restart.seconds:g} s"))
        log.error("bridge rank %d: %s; leaving the exchanges", self.rank, why)
        return None, why

    def _await_restart(self, node: LocalNode, restart: Deadline) -> bool:
        """Every peer left the exchanges while the local server was dead (gossip): wait for
        its restart, so that the restarted job's final weights still join the final average.
        True once attached to the restarted server."""
        log.warning("bridge rank %d: every peer left the exchanges while job %r's server was down; waiting for its "
                    "restart (at most %.0f s more) so that its final weights join the final average", self.rank,
                    self.job, restart.left())
        while True:
            successor, why = self._restarted(node, restart)
            if successor is not None:
                return True
            if why:
                self.report.reason = why
                return False
            time.sleep(RESTART_LOOK)

    def _reattach(self, old: LocalNode, new: LocalNode) -> LocalNode:
        """The local server was restarted (by its supervisor, from its last checkpoint): the
        bridge goes on with the restarted one; the next exchange copies its weights."""
        self._published += old.published
        self.node = new
        try:
            old.close()
        except GadeiError as err:
            log.warning("bridge rank %d: %s", self.rank, err)
        self.report.restarts += 1
        log.warning("bridge rank %d: job %r: attached to the restarted server (pid %d) at version %d", self.rank,
                    self.job, new.server[0], new.version())
        self._emit({"event": "reattached", "pid": new.server[0], "version": new.version(), "t": time.time()})
        return new

    def _finished(self, node: LocalNode) -> bool:
        """The local job finished (LocalNode.finished): then the ring is drained, so the moves
        published as it stopped were applied too."""
        if not node.finished(self.options.timeout / 4):
            return False
        self.report.moves += self._unconfirmed
        self._unconfirmed = 0
        return True

    def _final_average(self, strategy: Strategy, weights: np.ndarray, broken: bool) -> None:
        """gossip: once the local job finished, one allreduce of every node's final weights
        (each node waits up to the timeout for the others to finish): their mean is the job's
        model. Skipped when a peer was lost or the local job did not finish."""
        node = self.node
        while not broken and node.serving():  # no peers left, but the local job still trains
            node.beat()
            time.sleep(WAIT_SLICE)
        if broken or strategy.lost or not self._finished(node):
            return
        node.snapshot(weights)
        log.info("bridge rank %d: job %r finished; averaging the nodes' final weights", self.rank, self.job)
        total = np.empty_like(weights)
        began = time.monotonic()
        try:
            strategy.wire.allreduce_sum(weights, total, what="the final average")
        except GadeiTimeout as err:
            strategy.abandon()
            log.warning("bridge rank %d: no final average (%s): the model of job %r is its own", self.rank, err,
                        self.job)
            return
        total *= np.float32(1.0 / self.size)
        self.final, self._spec = total, node.region.read_spec()
        self.report.exchanges += 1
        self.report.exchange_seconds += time.monotonic() - began
        self.report.reason = "every node finished"
        self._emit({"event": "exchange", "n": self.report.exchanges, "t": time.time(),
                    "seconds": time.monotonic() - began, "version": node.version(), "peer": None, "final": True})

    def save_final(self, path: str, private: bool = True) -> bool:
        """Write the job's model of the final exchange (every node finished) to `path` as the
        state dict `torch.load(path, weights_only=True)` reads, like `gadei serve --save` (mode
        0600, or, not `private`, as the umask decides); False when there was no final exchange."""
        if self.final is None:
            return False
        from .. import params

        params.save(params.state_dict(self._spec, self.final), path, private=private)
        log.info("bridge rank %d: saved the model every node agreed on to %s", self.rank, path)
        return True

    def _lost(self, why: str, peers: list[int]) -> None:
        self.report.reason = "peer lost"
        self.report.lost = peers
        log.error("bridge rank %d: %s; ending the exchanges: job %r goes on training on its own", self.rank, why,
                  self.job)
        if self.options.checkpoint_dir:
            self.report.checkpoint = self.node.checkpoint(self.options.checkpoint_dir)
            if self.report.checkpoint:
                log.info("bridge rank %d: checkpoint of job %r written to %s", self.rank, self.job,
                         self.report.checkpoint)

    def _finish(self, started: float, strategy: Strategy | None) -> Report:
        self.report.seconds = time.monotonic() - started
        r = self.report
        log.info("bridge rank %d: %d exchanges in %.1f s (%.1f/s), %.1f MB sent; %s%s", r.rank, r.exchanges, r.seconds,
                 r.rate, r.bytes_sent / MB, r.reason, f"; lost ranks {r.lost}" if r.lost else "")
        self._emit({"event": "ended", **asdict(r), "rate": r.rate})
        try:
            self.node.close()
        except GadeiError as err:
            log.warning("bridge rank %d: %s", self.rank, err)
        self.clean = strategy is not None and strategy.clean and r.reason != "peer lost"
        return r


def write_trace(folder: str, rank: int, n: int, sent: np.ndarray, target: np.ndarray, strategy: Strategy,
                version: int) -> None:
    """`--trace`: exchange `n` of `rank` as FOLDER/rank-R/N.npz: the weights it sent, the target
    it got, the local version they were copied at, and what its strategy adds (`Strategy.trace`)."""
    where = os.path.join(folder, f"rank-{rank}")
    os.makedirs(where, exist_ok=True)
    files.replace(os.path.join(where, f"{n:06d}.npz"), lambda f: np.savez(
        f, sent=sent, target=target, version=version, final=strategy.final, **strategy.trace()))


def _role(strategy: Strategy) -> str:
    if isinstance(strategy, Gossip):
        return "active" if strategy.active else "passive"
    return "member"


def job_name(job: str, rank: int, per_rank: bool) -> str:
    """The local job of `rank`: JOB with {rank} filled in, or JOB-rank with `per_rank`."""
    name = job.replace("{rank}", str(rank))
    return f"{name}-{rank}" if per_rank else name


def main(job: str, options: BridgeOptions, per_rank: bool = False) -> int:
    """`gadei bridge`: run this rank's bridge and end the process the way MPI needs (`finalize`)."""
    MPI = mpi()
    rank = MPI.COMM_WORLD.Get_rank()
    if options.checkpoint_dir:
        options = replace(options, checkpoint_dir=options.checkpoint_dir.replace("{rank}", str(rank)))
    bridge = BridgeRank(job_name(job, rank, per_rank), options)
    report = bridge.run()
    if options.save:
        if not bridge.save_final(options.save.replace("{rank}", str(rank))):
            log.warning("bridge rank %d: no model saved to %s: the exchanges ended before every node finished (%s)",
                        rank, options.save, report.reason)
    return finalize(bridge.clean, PEER_LOST if report.reason == "peer lost" else 0, options.timeout)


def finalize(clean: bool, code: int, timeout: float) -> int:
    """End this rank's MPI: `code` after MPI_Finalize when no peer is known to be lost
    (`BridgeRank.clean`); otherwise (a lost peer, requests left in flight) the process exits here
    with `code` without finalising, so no wait on a dead peer can hang it. Finalize itself
    is given `timeout` seconds: it waits in the runtime's fence for every rank, and one that
    died without any survivor noticing (killed between two gossip exchanges) never comes; a
    gossip rank that left while the others still train waits that long for them at most.
    It blocks holding the GIL, so a native thread keeps that deadline (`launch.exit_after`)."""
    if not clean:
        _exit(code)
    MPI = mpi()
    sys.stdout.flush()
    sys.stderr.flush()
    with exit_after(timeout, code, f"gadei.bridge WARNING rank {MPI.COMM_WORLD.Get_rank()}: MPI_Finalize did not "
                    f"return within {timeout:g} s (a rank died unnoticed, or still runs): leaving without it"):
        MPI.Finalize()
    return code


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
