"""The node's job seen from its bridge rank: attach like a learner, copy the weights, write the
move to a target back through the bridge's own ring as one MOVE slot, and notice a server
that died without stopping the job and the restarted one its supervisor brings up (a new
region under the job's name: `successor`)."""

import logging
import time

import numpy as np

from ..env import settings
from ..errors import GadeiError, GadeiTimeout, ServerGone
from ..layout import MOVE, SERVING, STOPPING
from ..protocol import RunState, Version
from ..region import Region
from ..ring import WAIT_SLICE, claim
from ..transport.slot import Float32Dense, dense_area
from .mpi import BridgeError

log = logging.getLogger(__name__)

RESTART_WAIT = 150.0  # seconds a bridge waits for its node's supervisor to restart a dead server (which the
# supervisor gives 120 s to serve), while the node's supervisor lives


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
            self._state = RunState(self.region)
            self._clock = Version(self.region)
            self._server_beat_addr = h.addr("server_beat")
            self._server_timeout_ns = int(env.server_timeout * 1e9)
            if not self._state.serving():
                raise self._state.not_serving(job)
            self.producer = claim(self.region, drain_timeout=self.timeout, server_alive=self.server_alive)
            self.entry = self.region.entry(self.producer.learner)
            self.entry.set("threads", 1)
            self._beat = self.entry.word("beat")
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
            raise BridgeError(f"job {self.job!r} cannot be bridged: {why}; serve it in async, consistent or elastic "
                              "mode with float32 dense gradients (`gadei serve --no-row-sparse`: a model with sparse "
                              "embedding gradients gets row-sparse tables by default)")

    @property
    def n(self) -> int:
        return self.region.shape.n_params

    def version(self) -> int:
        return self._clock.get()

    def beat(self) -> None:
        self._beat.store(time.monotonic_ns())

    def server_alive(self) -> bool:
        from .. import _proc

        return _proc.alive(*self._server)

    def serving(self) -> bool:
        """True while the job serves and its server lives."""
        return self._state.serving() and self.server_alive()

    @property
    def server(self) -> tuple[int, float]:
        """The server this node attached to: its pid and start time."""
        return self._server

    def crashed(self) -> bool:
        """The server died without stopping the job (the run state still says serving or
        stopping): its supervisor, if it has one, restarts it into a new region (`successor`)."""
        return self._state.get() in (SERVING, STOPPING) and not self.server_alive()

    def supervisor_alive(self) -> bool:
        """The job's supervisor (the one this region's header names) still runs."""
        from .. import supervisor

        return supervisor.alive(self.region)

    def successor(self) -> "LocalNode | None":
        """After a crash: the job as a restarted server serves it (the job's region is another
        one now, whose header names another live server), attached as this node was; None
        while there is none yet (or it could not be attached this time)."""
        from .. import _proc

        try:
            with Region.attach(self.job, readonly=True) as region:
                h = region.header
                server = (h.get("server_pid"), h.get("server_start"))
                if server == self._server or not RunState(region).serving() or not _proc.alive(*server):
                    return None
            return LocalNode(self.job, attach_timeout=self.timeout)
        except BridgeError:
            raise  # the restarted job cannot be bridged: not a thing to try again
        except GadeiError as err:  # it stopped or died again meanwhile, or no ring is free yet
            log.info("job %r: the restarted server cannot be attached yet: %s", self.job, err)
            return None

    def _on_slice(self) -> None:
        self.beat()
        if not self._state.serving():
            raise self._state.not_serving(self.job)
        if not self.server_alive():
            raise ServerGone(f"job {self.job!r}: server pid {self._server[0]} is gone")

    def snapshot(self, out: np.ndarray) -> int:
        """Copy the weights into `out`; the version they are. In consistent mode the copy
        holds whole updates only (taken between two equal, even seqlock readings)."""
        weights = Float32Dense(self.n, 1)
        odd_since = None
        while True:
            seq = self._clock.seq()
            whole = self.mode == "consistent"
            if whole and seq & 1:
                odd_since = odd_since or time.monotonic()
                if time.monotonic() - odd_since < WAIT_SLICE or self.server_alive():
                    time.sleep(0.0002)
                    continue
                whole = False  # the server died inside an update: nothing will finish it
            version = self.version()
            weights.copy(int(out.ctypes.data), self.region.weights_addr)
            if not whole or self._clock.seq() == seq:
                return version

    def move(self, target: np.ndarray, seen: np.ndarray) -> None:
        """Move the weights by (target - seen) through the ring; return once the server applied it.

        Raises:
            JobStopped, ServerGone: the job ended first (the move may be lost with it).
            GadeiTimeout: the server did not apply it within the attach timeout.
        """
        self.producer.wait_space(self._on_slice)
        slot = dense_area(self.region, self.producer.learner, self.producer.slot)
        np.subtract(seen, target, out=slot)  # the server's w -= slot leaves target + the learners' progress since
        self.producer.publish(self.version(), self.published, 0, kind=MOVE)
        self.published += 1
        if not self.producer.drain(self.timeout, self._drainable):
            self._on_slice()
            raise GadeiTimeout(f"job {self.job!r}: the server did not apply the bridge's update "
                               f"within {self.timeout:g} s")

    def _drainable(self) -> bool:
        self.beat()
        return self.serving()

    def finished(self, wait: float) -> bool:
        """After the job stopped: True when it stopped because every launched learner finished
        (its supervisor says so) and every move reached the weights. Gives the ring back (so
        the stopping server need not wait for it) and waits up to `wait` seconds for the
        server to have stopped: the weights are then final, and stay readable here."""
        h = self.region.header
        if not h.get("finished"):
            return False
        applied = self.producer.drain(wait, self.server_alive)
        self._release()
        if not self._state.wait_stopped(wait, self.server_alive):
            return False
        return applied

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.producer.release()

    def checkpoint(self, folder: str) -> str | None:
        """Write a checkpoint of the job into `folder`; its path, None when it could not."""
        from ..checkpoint import CheckpointError, take

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
