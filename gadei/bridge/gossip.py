"""Gossip (AD-PSGD): asynchronous pairwise averaging with one random peer at a time; even
ranks ask, odd ranks answer, and a peer that misses its patience is passed over."""

import logging
import random
import statistics
import time
from enum import Enum

import numpy as np

from ..errors import GadeiTimeout
from ..protocol import Deadline
from .mpi import LinkDown, link_errors, mpi, pause, wait_all
from .strategies import Strategy
from .wire import from16, to16

log = logging.getLogger(__name__)


# gossip message tags; REQ, ACK, CANCEL, BYE and BUSY carry [exchange id]
_REQ, _ACK, _CANCEL, _BYE, _BUSY, _DATA, _REPLY = 11, 12, 13, 14, 15, 20, 21


class _Answer(Enum):
    """How a gossip peer answered one request."""

    ACKED = "acknowledged it: the swap follows"
    BUSY = "declined it: alive, but serving another asker"
    SILENT = "no answer by the deadline"
    LEFT = "left the job meanwhile"


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
        self.pair: tuple[int, int] | None = None  # the last exchange's (asking rank, its request id)

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

    @link_errors
    def _post(self, peer: int, tag: int, value: int) -> None:
        buffer = np.array([value], dtype=np.int64)
        self._small.append((self.comm.Isend(buffer, peer, tag), buffer))
        self._small = [(r, b) for r, b in self._small if not r.Test()]

    @link_errors
    def _take(self, source: int, tag: int) -> tuple[int, int] | None:
        """A control message (source, value) that has arrived, or None; never waits for one."""
        if not self.comm.Iprobe(source=source, tag=tag, status=self._status):
            return None
        sender = self._status.Get_source()
        buffer = np.empty(1, dtype=np.int64)
        wait_all([self.comm.Irecv(buffer, sender, tag)], Deadline(self.options.timeout),
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
        answered = self._await_ack(peer, self._id, Deadline(self._patience()))
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
        self.peer, self.pair = peer, (self.rank, self._id)
        return _mean(weights, other)

    def _await_ack(self, peer: int, ident: int, deadline: Deadline) -> _Answer:
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
            if deadline.expired():
                return _Answer.SILENT
            self.wire.poll()
            pause(time.monotonic() - started)

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
        self.peer, self.pair = peer, (peer, ident)
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

    @link_errors
    def _receive_then_reply(self, peer: int, ident: int, weights):
        """The asker's weights (after which ours go to it), or None when it cancelled after our ACK."""
        deadline = Deadline(self.options.timeout)
        started = time.monotonic()
        # Look before receiving: the data comes only if the asker saw the ACK before it gave up.
        while not self.comm.Iprobe(source=peer, tag=_DATA):
            self._read_control()
            if ident in self._cancelled.get(peer, ()):
                self._cancelled[peer].discard(ident)
                return None
            if peer not in self.peers:
                return None
            if deadline.expired():
                raise GadeiTimeout(f"gossip: rank {peer} asked but sent nothing within {self.options.timeout:g} s")
            self._on_poll()
            pause(time.monotonic() - started)
        return self._passive_swap(peer, weights)

    @link_errors
    def _passive_swap(self, peer: int, weights):
        """Receive the asker's buckets, then send ours (so nothing of ours waits on a cancelled asker)."""
        MPI = mpi()
        wire = self.wire
        deadline = Deadline(self.options.timeout)
        slices = wire._slices(weights.size)
        if wire.float16:
            incoming = np.empty(weights.size, dtype=np.uint16)
            recvs = [[incoming[s], MPI.UINT16_T] for s in slices]
        else:
            recvs = [[self._out[s], MPI.FLOAT] for s in slices]
        wait_all([self.comm.Irecv(buf, peer, _DATA) for buf in recvs], deadline, f"gossip with rank {peer}",
                 self._on_poll)
        if wire.float16:
            from16(incoming, self._out)
            wire._check16(weights)
            sends = [[to16(weights[s]), MPI.UINT16_T] for s in slices]
        else:
            sends = [[weights[s], MPI.FLOAT] for s in slices]
        wait_all([self.comm.Isend(buf, peer, _REPLY) for buf in sends], deadline, f"gossip with rank {peer}",
                 self._on_poll)
        wire.sent += sum(buf[0].nbytes for buf in sends)
        return self._out

    def trace(self):
        return {"peer": self.peer, "asker": self.pair[0], "request": self.pair[1], "active": self.active}

    def leave(self) -> None:
        for peer in sorted(self.peers):
            self._post(peer, _BYE, 0)
        deadline = Deadline(min(2.0, self.options.timeout))
        while self._small and not deadline.expired():
            self._small = [(r, b) for r, b in self._small if not r.Test()]
            time.sleep(0.001)
        if self._small:
            self._abandoned = True


def _mean(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = a + b
    out *= np.float32(0.5)
    return out
