"""The job's shared-memory protocols between processes, owned here: the run-state machine, the
stop handshake, the doorbell, the version waits and the checkpoint hold; and `Deadline`, the
one way gadei waits for something with a time limit.

Every process of a job (server, learners, supervisor, `gadei stop`, a checkpointer, a bridge)
follows these rules on the same header words. This module is the only one that names those
words (`run_state`, `fail_reason`, `doorbell`, `server_sleeping`, `version_waiters`, `seq`,
`hold`, `held`, `hold_epoch`, `train_stop`); the others call it (`tests/test_owners.py` holds
that).

- Run state: CREATED -> SERVING (the server, once the weights are ready) -> STOPPING (anyone:
  a compare-and-swap from SERVING, then the doorbell) -> STOPPED (the server, after its
  drain). FAILED (the server, on an error it must not go on from) is final; the server
  writes why (`fail_reason`) before it stores the state.
- Doorbell: the server says it sleeps (`server_sleeping`), reads the bell, looks for work
  once more, then futex-waits on the bell; a learner that publishes rings (bump + wake) only
  when the server said it sleeps (a Dekker handshake: neither side can miss the other).
- Version: bumped once per update by the server; in consistent mode `seq` is odd while an
  update runs (a seqlock). Waiters count themselves in `version_waiters` so that the server
  wakes them only when someone waits.
- Checkpoint hold: a checkpointer waits for the last pause to end (`held` 0), sets `hold`
  (0 -> 1) and rings; the server, between two updates, sets `held` and waits until `hold` is
  0 again or its `hold_limit` passed; each pause that ends bumps `hold_epoch` and clears
  `held`. A copy is whole if `held` stayed 1 and the epoch did not move.
- Training decision: the evaluating learner sets `train_stop` once (a compare-and-swap from
  TRAIN_ON) when validation stopped improving; every learner ends its schedule when it sees it.
"""

import logging
import time
from typing import Callable, TypeVar

from .errors import GadeiTimeout, JobFailed, JobStopped
from .layout import FAILED, RUN_STATES, SERVING, STOPPED, STOPPING, TRAIN_ON

log = logging.getLogger(__name__)

T = TypeVar("T")

WAIT_SLICE = 0.1  # seconds a blocked wait sleeps before it looks at the other side again
HOLD_LIMIT = 2.0  # seconds the server of a small job stays paused for a checkpoint before it goes on without it
HOLD_RATE = 128 << 20  # bytes a second a checkpoint's copy is granted at the least: a large job pauses longer
_ALL = 1 << 30  # futex_wake: every waiter


class Deadline:
    """A point in time `seconds` from now (monotonic clock), for loops that wait on something.

    >>> deadline = Deadline(5.0)
    >>> while not ready():
    ...     if deadline.expired():
    ...         raise GadeiTimeout(f"not ready within {deadline.seconds:g} s")
    ...     time.sleep(deadline.slice(0.05))
    """

    __slots__ = ("seconds", "end")

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (0.0 once expired)."""
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def slice(self, most: float) -> float:
        """The next sleep: `most` seconds, or what is left if less."""
        return min(most, self.left())

    def sleep(self, most: float) -> None:
        time.sleep(self.slice(most))

    def restart(self) -> None:
        """The same number of seconds again, from now."""
        self.end = time.monotonic() + self.seconds


def wait_for(predicate: Callable[[], T], timeout: float, what: str, *, interval: float = 0.05,
             error: type[Exception] = GadeiTimeout) -> T:
    """Poll `predicate` until it returns something true, and return that.

    Raises:
        `error` (GadeiTimeout by default): it did not within `timeout` seconds; the message
            says what was waited for and how long.
    """
    deadline = Deadline(timeout)
    while True:
        value = predicate()
        if value:
            return value
        if deadline.expired():
            raise error(f"waited {timeout:g} s for {what}")
        deadline.sleep(interval)


class Doorbell:
    """The server's doorbell: the server sleeps on it when no ring holds work; others ring it."""

    __slots__ = ("_bell", "_sleeping")

    def __init__(self, region):
        h = region.header
        self._bell = h.word("doorbell")
        self._sleeping = h.word("server_sleeping")

    def ring(self) -> None:
        """Wake the server if it sleeps (a stop request, a hold, a signal)."""
        self._bell.add(1)
        self._bell.wake(1)

    def ring_if_sleeping(self) -> None:
        """A learner after publishing: ring only when the server said it sleeps."""
        if self._sleeping.load():
            self.ring()

    def sleep(self, look: Callable[[], int], timeout: float) -> int:
        """Server: sleep until rung or `timeout` passes, unless `look()` finds work first (>= 0);
        returns `look()`'s answer after the sleep."""
        self._sleeping.store(1)
        seen = self._bell.load()
        found = look()
        if found < 0:
            self._bell.wait(seen, timeout)
            found = look()
        self._sleeping.store(0)
        return found


class RunState:
    """The run-state machine of one job's region (see the module's docstring)."""

    __slots__ = ("_word", "_doorbell", "_header")

    def __init__(self, region):
        self._header = region.header
        self._word = region.header.word("run_state")
        self._doorbell = Doorbell(region)

    def get(self) -> int:
        return self._word.load()

    def name(self) -> str:
        return RUN_STATES.get(self._word.load(), "?")

    def serving(self) -> bool:
        return self._word.load() == SERVING

    def start(self) -> None:
        """Server: the weights are ready, learners may attach."""
        self._word.store(SERVING)

    def request_stop(self) -> bool:
        """Ask the job to stop (SERVING -> STOPPING) and ring the server awake; True when this
        call moved the state (False: it was not serving)."""
        moved = self._word.cas(SERVING, STOPPING)
        self._doorbell.ring()
        return moved

    def finish(self) -> None:
        """Server: drained, the job is stopped (a failed job stays failed)."""
        if self._word.load() != FAILED:
            self._word.store(STOPPED)

    def fail(self, reason: str) -> None:
        """Server: stop the job as failed (final: no checkpoint, no restart), `reason` recorded
        first for every reader of the state (`reason()`)."""
        self._header.set_text("fail_reason", reason)
        self._word.store(FAILED)

    def reason(self) -> str:
        """Why the server stopped the job as failed ("" unless the state is FAILED)."""
        return self._header.text("fail_reason") if self._word.load() == FAILED else ""

    def not_serving(self, job: str) -> JobStopped:
        """The error for a learner or bridge that finds job `job` not serving: JobFailed with
        the server's reason when it failed the job, else JobStopped."""
        state = self._word.load()
        if state == FAILED:
            return JobFailed(f"job {job!r} failed: {self.reason()}")
        if state in (STOPPING, STOPPED):
            return JobStopped(f"job {job!r} was stopped")
        return JobStopped(f"job {job!r} is {RUN_STATES.get(state, '?')}, not serving")

    def wait_stopped(self, timeout: float, alive: Callable[[], bool]) -> bool:
        """Wait until the state is STOPPED, `alive()` turns false, or `timeout` passes; True when stopped."""
        deadline = Deadline(timeout)
        while self._word.load() != STOPPED:
            if deadline.expired() or not alive():
                return False
            deadline.sleep(0.05)
        return True


class TrainStop:
    """The job's training decision (`train_stop`, `train_stop_version`): TRAIN_ON (0) while
    training goes on, else why it ended (a `layout.TRAIN_STOP_*`). One learner, the one that
    evaluates, decides; every learner reads it between steps and ends its schedule when it is
    not TRAIN_ON. Set once, by compare-and-swap, so the first decision stands."""

    __slots__ = ("_word", "_version")

    def __init__(self, region):
        h = region.header
        self._word = h.word("train_stop")
        self._version = h.word("train_stop_version")

    def get(self) -> int:
        return self._word.load()

    def decide(self, reason: int, version: int) -> bool:
        """End training for every learner (`reason`) at weights `version`; whether this call decided it."""
        if not self._word.cas(TRAIN_ON, reason):
            return False
        self._version.store(version)
        return True


class Version:
    """The weights' version, its seqlock (consistent mode) and the waits on it."""

    __slots__ = ("_version", "_seq", "_waiters")

    def __init__(self, region):
        h = region.header
        self._version = h.word("version")
        self._seq = h.word("seq")
        self._waiters = h.word("version_waiters")

    def get(self) -> int:
        return self._version.load()

    def seq(self) -> int:
        """The seqlock word: odd while an update runs (consistent mode)."""
        return self._seq.load()

    def begin_update(self) -> None:
        """Server, consistent mode: the weights are about to change (seq odd)."""
        self._seq.add(1)

    def end_update(self) -> None:
        """Server, consistent mode: the weights are whole again (seq even)."""
        self._seq.add(1)

    def bump(self) -> None:
        """Server: one update applied."""
        self._version.add(1)

    def wake_if_waited(self) -> None:
        """Server, after a bump: wake the waiters, if any counted themselves."""
        if self._waiters.load():
            self._version.wake()

    def wake_all(self) -> None:
        """Wake every waiter (the job stopped or failed: they look at the run state)."""
        self._version.wake()

    def wait_change(self, version: int, timeout: float) -> int:
        """Sleep until the version is no longer `version`, or `timeout` passes; the version then."""
        self._waiters.add(1)
        try:
            now = self._version.load()
            if now == version:
                self._version.wait(version, timeout)
                now = self._version.load()
            return now
        finally:
            self._waiters.add(-1)

    def nap(self, timeout: float) -> None:
        """Sleep up to `timeout` or until the version moves (a reader that saw the seqlock odd)."""
        self._version.wait(self._version.load(), timeout)


def hold_limit(shape) -> float:
    """Seconds the server of a region of `shape` stays paused for a checkpoint at most: HOLD_LIMIT,
    and the time its weights and optimizer state take to copy at HOLD_RATE. A copy runs at
    about 400 MiB/s into fresh memory on a busy 2-core host: 2 s alone held a model of 1.4 GB
    and its Adagrad state (2.8 GB) for none of its checkpoints."""
    return HOLD_LIMIT + 4 * shape.n_params * (1 + shape.state_arrays) / HOLD_RATE


class ServerHold:
    """The server's side of the checkpoint hold."""

    __slots__ = ("job", "limit", "_hold", "_held", "_epoch")

    def __init__(self, region):
        h = region.header
        self.job = region.job
        self.limit = hold_limit(region.shape)
        self._hold = h.word("hold")
        self._held = h.word("held")
        self._epoch = h.word("hold_epoch")

    def requested(self) -> int:
        """The hold word (0: none, 1: a checkpointer asks the server to pause; more is corrupt)."""
        return self._hold.load()

    def pause(self, check: Callable[[int], None], beat: Callable[[], None]) -> None:
        """Stay between two updates until the checkpointer lets go, or `limit` passed (then
        take the hold back and go on: the checkpointer sees the epoch moved and drops its copy).
        `check(hold)` raises on a corrupt hold word; `beat()` runs every WAIT_SLICE."""
        check(self._hold.load())  # before saying it holds: a copy then is never whole
        self._held.store(1)
        self._held.wake()
        deadline = Deadline(self.limit)
        try:
            while hold := self._hold.load():
                check(hold)
                if deadline.expired():
                    if self._hold.cas(1, 0):
                        log.warning("job %r: a checkpoint held the server for more than %.3g s: going on without it",
                                    self.job, self.limit)
                    break
                self._hold.wait(1, deadline.slice(WAIT_SLICE))
                beat()
        finally:
            self._epoch.add(1)
            self._held.store(0)
            self._held.wake()  # a checkpointer may wait for this pause to end before it asks for its own


def hold_requested(region) -> int:
    """The hold word of `region` (0: none, 1: a checkpointer holds the server; more is corrupt)."""
    return region.header.get("hold")


def hold_and_copy(region, timeout: float, copy: Callable[[], T], error: type[Exception]) -> T:
    """Checkpointer: pause the server between two updates, `copy()` the region, let go.

    Raises:
        `error`: another checkpoint holds the server, the server did not pause within
            `timeout` (or died), or it went on before the copy was done.
    """
    h = region.header
    hold, held, epoch = h.word("hold"), h.word("held"), h.word("hold_epoch")
    deadline = Deadline(timeout)
    # A pause the last checkpointer let go of may not have ended yet (the server has not run
    # since): taking the hold now would ride on that pause and its hold limit, already partly
    # spent, so that back-to-back checkpoints end with the server going on amid a copy.
    while held.load() and not hold.load():
        if deadline.expired() or not region.server_alive():
            raise error(f"job {region.job!r}: the server did not end its last checkpoint pause within {timeout:g} s")
        held.wait(1, deadline.slice(WAIT_SLICE))
    if not hold.cas(0, 1):
        raise error(f"job {region.job!r}: another checkpoint is being taken")
    try:
        Doorbell(region).ring()  # a sleeping server wakes up to see the hold
        while not held.load():
            if deadline.expired() or not region.server_alive():
                raise error(f"job {region.job!r}: the server did not pause for a checkpoint within {timeout:g} s")
            held.wait(0, deadline.slice(WAIT_SLICE))
        before = epoch.load()
        result = copy()
        if not (held.load() and epoch.load() == before):
            raise error(f"job {region.job!r}: the server went on before the checkpoint copy was done")
        return result
    finally:
        hold.cas(1, 0)
        hold.wake()
