"""Gradient rings: a learner claims one, produces into it; the server consumes from all of them.

Each learner entry of the region owns one single-producer/single-consumer ring of `slots`
gradient slots. `head` (written only by the learner) counts slots published, `tail`
(written only by the server) counts slots consumed; both are monotonic 64-bit counters,
so `0 <= head - tail <= slots` always and slot k lives at index k % slots.

- The learner writes slot `head % slots` only while `head - tail < slots` (it is free), and
  publishes it by storing `head + 1` after the payload and slot header are written. A slot
  that a killed learner left half-written is never published, so never applied.
- The server reads a slot only while `tail < head`, applies it, zeroes it in the same pass
  (so the next backward pass can accumulate into it), then stores `tail + 1`.

Waits are futex waits on the counters themselves, with the Dekker handshake that makes
lost wake-ups impossible: the waiter counts itself in (`space_waiting`, a count: a learner's
train and push threads may both wait), re-checks, then sleeps on the value it saw; the other
side stores its counter, then wakes every sleeper only if the count is not 0. Every wait is
cut into short slices so the waiter can notice that the other side died.

Ownership of an entry is its `lease` word: the owner's pid in the high 32 bits (0 when
free) and a claim counter in the low 32, changed only by compare-and-swap, so two
learners can never own one ring.

This module is the only one that reads or writes a ring's counters (head, tail, lease,
space_waiting, claim_head, and the owner accounting pid, last_pid, last_applied;
tests/test_owners.py holds it): `gadei status`, a checkpoint, the server's sync rounds and
the supervisor ask it what they mean (`owner`, `since_claim`, `published`, `counters`,
`drained`, `left_record`...).
"""

import logging
import os
import time


from . import _native, _proc
from .errors import CapacityError, GadeiTimeout, RegionCorrupt
from .layout import ACTIVE, CLAIMING, ENTRY, ENTRY_BYTES, FREE, GRADIENT, HIST_BUCKETS
from .protocol import WAIT_SLICE, Deadline, Doorbell
from .region import Region
from .transport.slot import clear as clear_slot

log = logging.getLogger(__name__)

_RECLAIM_GRACE = 0.2  # seconds a claimed-looking entry must stay dead before it is taken
_U32 = 0xFFFFFFFF
_WAKE_ALL = 1 << 30  # futex_wake's count for every sleeper


def _lease_owner(lease: int) -> int:
    """The pid a lease word names (0 when free)."""
    return lease >> 32


def _lease(pid: int, claims: int) -> int:
    return (pid << 32) | (claims & _U32)


def owner_alive(region: Region, learner: int) -> bool:
    """True when learner entry `learner` is owned by a running process."""
    entry = region.entry(learner)
    pid = _lease_owner(entry.get("lease"))
    if pid == 0 or not _proc.running(pid):
        return False
    started = entry.get("start")
    if started == 0 or _proc.alive(pid, started):
        return True
    # The recorded start time is another process's: either the pid was reused, or a new
    # owner has just won the lease and not yet written its start time. Look again.
    deadline = Deadline(_RECLAIM_GRACE)
    while not deadline.expired():
        time.sleep(0.02)
        if _lease_owner(entry.get("lease")) != pid or _proc.alive(pid, entry.get("start")):
            return True
    return False


def check_ring(job: str, learner: int, head: int, tail: int, slots: int) -> None:
    """Raise RegionCorrupt unless `0 <= head - tail <= slots` (the ring protocol's invariant)."""
    if not 0 <= head - tail <= slots:
        raise RegionCorrupt(f"job {job!r}: learner ring {learner}: head - tail = {head - tail:,} (head {head:,}, "
                            f"tail {tail:,}), allowed 0..{slots}: the ring is corrupt")


def check_rings(region: Region) -> None:
    """Check every ring of `region` (a checkpoint does, before it copies); RegionCorrupt names the first bad one."""
    for learner in range(region.shape.capacity):
        entry = region.entry(learner)
        check_ring(region.job, learner, entry.get("head"), entry.get("tail"), region.shape.slots)


class Producer:
    """The learner's end of its ring.

    One thread writes and publishes (the train thread, or a push thread); the other may only
    wait on it (`drain`), and both may sleep on it at once.

    Call `claim` to get one; `free_slot()` is where backward writes; `publish()` hands it
    to the server; `wait_space()` blocks while the ring is full.
    """

    def __init__(self, region: Region, learner: int, number: int | None = None):
        self.region = region
        self.learner = learner
        self.number = number  # a launched learner's number (`claim`'s prefer): where `release` keeps its record
        self.entry = region.entry(learner)
        self.slots = region.shape.slots
        self._head_addr = self.entry.addr("head")
        self._tail_addr = self.entry.addr("tail")
        self._waiting_addr = self.entry.addr("space_waiting")
        self._doorbell = Doorbell(region)
        self._entries = [region.entry(i) for i in range(region.shape.capacity)]
        self.head = self.entry.get("head")  # only this producer writes it, so a local copy is exact

    @property
    def slot(self) -> int:
        """Index of the slot the next gradient goes into."""
        return self.head % self.slots

    def tail(self) -> int:
        """Slots the server has consumed from this ring, ever (its tail, as read now)."""
        return _native.load64(self._tail_addr)

    def pending(self) -> int:
        """Gradients published on this ring that the server has not consumed yet, as read now
        (unchecked: a log line may say it of a ring `drain` gave up on)."""
        return self.head - self.tail()

    def _pending(self) -> tuple[int, int]:
        """Published slots the server has not handed back, and the tail read: RegionCorrupt
        (check_ring) unless 0 <= head - tail <= slots. The learner checks what it reads as the
        server does: a tail written ahead of the head would otherwise read as room to write
        over a slot the server has not consumed yet."""
        tail = _native.load64(self._tail_addr)
        check_ring(self.region.job, self.learner, self.head, tail, self.slots)
        return self.head - tail, tail

    def has_space(self) -> bool:
        """True when slot `self.slot` is free (consumed by the server, or never used)."""
        return self._room(self._pending()[0])

    def _room(self, pending: int) -> bool:
        """The ring's bound: with `pending` slots published and not consumed, one is free."""
        return pending < self.slots

    def published_everywhere(self) -> tuple[int, int]:
        """(slots ever published on every ring of the job: the heads summed, the rings owned
        now): what a staleness bound counts a gradient's wait by (`Learner._ahead`)."""
        heads = owned = 0
        for entry in self._entries:
            heads += entry.get("head")
            owned += _lease_owner(entry.get("lease")) != 0
        return heads, owned

    def publish(self, version: int, step: int, samples: int, kind: int = GRADIENT) -> None:
        """Hand slot `self.slot` (payload already written) to the server, and ring if it sleeps.

        `kind`: GRADIENT (applied by the job's update rule) or MOVE (a bridge's move of the
        weights by -payload, applied as it is: see `gadei.bridge.LocalNode.move`)."""
        slot = self.region.slot_header(self.learner, self.slot)
        slot.set("version", version)
        slot.set("step", step)
        slot.set("samples", samples)
        slot.set("kind", kind)
        self.head += 1
        _native.store64(self._head_addr, self.head)  # publishes payload and slot header
        self._doorbell.ring_if_sleeping()

    def wait_space(self, on_slice) -> None:
        """Block until slot `self.slot` is free; call `on_slice()` every WAIT_SLICE while blocked.

        `on_slice` is how the caller notices that the server died or the job stopped: it
        raises to end the wait.
        """
        while not self.has_space():
            self._sleep(self._room, WAIT_SLICE)
            on_slice()

    def drain(self, timeout: float, server_alive) -> bool:
        """Wait until the server consumed every published slot; False if it did not in time."""
        deadline = Deadline(timeout)
        while self._pending()[0]:
            if deadline.expired() or not server_alive():
                return False
            self._sleep(lambda pending: pending == 0, deadline.slice(WAIT_SLICE))
        return True

    def _sleep(self, done, timeout: float) -> None:
        """Sleep on the tail until the server moves it (or `timeout`), unless `done(pending)` already.

        The two threads of a learner with a push thread may both sleep here at once (the train
        thread drains while the push thread waits for space): `space_waiting` counts the
        sleepers and the server wakes them all, so neither loses the other's wake-up. The
        count goes up before the tail is looked at again, the Dekker handshake with
        `Consumer.release`, which stores the tail before it reads the count.
        """
        _native.add32(self._waiting_addr, 1)
        try:
            pending, tail = self._pending()
            if not done(pending):
                _native.futex_wait(self._tail_addr, tail & _U32, timeout)
        finally:
            _native.add32(self._waiting_addr, -1)

    def release(self) -> None:
        """Give the entry back (after `drain`): it is free for the next learner."""
        lease = self.entry.get("lease")
        if _lease_owner(lease) != os.getpid():
            log.warning("job %r: learner entry %d is no longer ours; leaving it", self.region.job, self.learner)
            return
        if self.number is not None and drained(self.entry):
            _keep_record(self.region.entry(self.number), self.entry.get("applied_samples"))
        self.entry.set("state", FREE)
        # `pid` stays: it says whose gradients the entry's counters (applied_samples) count,
        # and a supervisor's checkpoint may still match this learner by it until it exits.
        self.entry.set("start", 0.0)
        self.entry.cas("lease", lease, _lease(0, lease))


def claim(region: Region, *, drain_timeout: float, server_alive, prefer: int | None = None) -> Producer:
    """Claim a learner entry of `region` for this process and return the producer of its ring.

    Entry `prefer` is taken first when it is free or its owner died (a launched learner's
    number, so that it is the same in its log, `gadei status` and the supervisor's list); then a
    free entry; when none is free, one whose owner died is reclaimed (its published gradients
    are left for the server to apply, then its slots are zeroed). A launched learner's
    `release` keeps what the server applied of it in entry `prefer` (`_keep_record`).

    Raises:
        CapacityError: every entry belongs to a live learner.
        GadeiTimeout: a reclaimed ring was not drained by the server within `drain_timeout`.
    """
    me = os.getpid()
    capacity = region.shape.capacity
    first = [(prefer, False), (prefer, True)] if prefer is not None and 0 <= prefer < capacity else []
    for learner, reclaim in first + [(learner, reclaim) for reclaim in (False, True) for learner in range(capacity)]:
        entry = region.entry(learner)
        lease = entry.get("lease")
        owner = _lease_owner(lease)
        if reclaim == (owner == 0):
            continue
        if reclaim and owner_alive(region, learner):
            continue
        if not entry.cas("lease", lease, _lease(me, (lease & _U32) + 1)):
            continue
        if reclaim:
            log.warning("job %r: taking over learner entry %d of dead pid %d", region.job, learner, owner)
        number = prefer if first else None
        return _take(region, learner, (lease & _U32) + 1, drain_timeout, server_alive, number)
    owners = [_lease_owner(region.entry(i).get("lease")) for i in range(capacity)]
    raise CapacityError(
        f"job {region.job!r}: all {capacity} learner entries are taken by live learners (pids "
        f"{', '.join(map(str, owners))}); serve the job with more --learners"
    )


def _take(region: Region, learner: int, claims: int, drain_timeout: float, server_alive,
          number: int | None) -> Producer:
    entry = region.entry(learner)
    entry.set("state", CLAIMING)
    entry.set("start", _proc.start_time())
    entry.set("beat", time.monotonic_ns())
    entry.set("space_waiting", 0)  # a killed owner's sleepers may have died counted in
    producer = Producer(region, learner, number)
    # A previous owner's published slots are applied by the server, never dropped; its
    # unpublished (maybe half-written) slot is zeroed below once nothing is in flight.
    if not producer.drain(drain_timeout, server_alive):
        entry.set("state", FREE)
        entry.cas("lease", entry.get("lease"), _lease(0, claims))
        raise GadeiTimeout(
            f"job {region.job!r}: learner entry {learner} still had {producer.pending()} "
            f"unapplied gradients after {drain_timeout:g} s; is the server running?"
        )
    for slot in range(region.shape.slots):
        clear_slot(region, learner, slot)
    # pid 0 before the reset: a reader that matches the previous owner by pid reads its counters
    # between two reads of pid (`left_record`), so it never takes the reset ones for its own.
    entry.set("pid", 0)
    # The server writes these only while consuming this ring, and the ring is empty.
    for name in ("applied_samples", "stale_sum", "stale_max", "discarded"):
        entry.set(name, 0)
    hist = entry.addr("stale_hist")
    for bucket in range(HIST_BUCKETS):
        _native.store64(hist + 8 * bucket, 0)
    for name in ("pulled_version", "pulls", "samples", "dropped", "pull_retries"):
        entry.set(name, 0)
    # Only now are the counters this process's: a checkpoint taken before would otherwise
    # count the previous owner's applied gradients as this one's (gadei.supervisor.progress).
    entry.set("pid", os.getpid())
    entry.set("claim_head", producer.head)
    entry.set("state", ACTIVE)
    return producer


def _keep_record(record, applied: int) -> None:
    """Keep this process's `applied` (its ring drained: all the server applied of it) in
    `record`'s (last_pid, last_applied): the entry numbered like the launched learner it is.

    One writer at a time: the supervisor starts a launched learner's next process only after it
    has counted the last one's end, so a record outlives any number of claims of the entry
    this process held (a copy kept in that entry by its next owner was overwritten by the
    one after; a count of claims would only have told so). A learner started by hand with the
    same `--entry` writes it too, and the reader matches the pid. last_pid is 0 while
    last_applied changes, for `left_record`'s two reads.
    """
    record.set("last_pid", 0)
    record.set("last_applied", applied)
    record.set("last_pid", os.getpid())


# ------------------------------------------------------------------ what others read of the rings
# (`gadei status`, a checkpoint, the supervisor's look at every learner and its accounting of
# the learners it launched: gadei_watchdog.learners). Only loads: safe on a read-only mapping.


def owner(region: Region, learner: int) -> int:
    """The pid that owns learner entry `learner` (0 when free), alive or not."""
    return _lease_owner(region.entry(learner).get("lease"))


def since_claim(region: Region, learner: int) -> tuple[int, int, int]:
    """(gradients entry `learner`'s owner published since it claimed the ring, those the
    server consumed, those in the ring now): what `gadei status` shows of a learner."""
    entry = region.entry(learner)
    head, tail, base = entry.get("head"), entry.get("tail"), entry.get("claim_head")
    return max(0, head - base), max(0, tail - base), head - tail


def published(region: Region) -> int:
    """Gradients ever published on every ring of the job (the heads summed)."""
    return sum(region.entry(i).get("head") for i in range(region.shape.capacity))


# Each entry's counters as a checkpoint keeps them (`checkpoint.Checkpoint.learners`), read
# in this order: pid and applied_samples before last_pid and last_applied (`applied_in`).
_COUNTERS = ("pid", "head", "tail", "samples", "applied_samples", "pulls", "dropped", "discarded", "stale_sum",
             "stale_max", "pull_retries", "last_pid", "last_applied")


def counters(region: Region) -> list[dict]:
    """Every learner entry's counters (JSON-compatible), as a checkpoint keeps them and
    `applied_in` reads them."""
    return [{name: region.entry(i).get(name) for name in _COUNTERS} for i in range(region.shape.capacity)]


def drained(entry) -> bool:
    """True when `entry`'s ring holds no published gradient the server has not consumed."""
    return entry.get("tail") == entry.get("head")


def _wait_drained(entry, deadline: Deadline) -> bool:
    while not drained(entry) and not deadline.expired():
        deadline.sleep(0.01)
    return drained(entry)


def entry_of(region: Region, pid: int) -> int:
    """The learner entry process `pid` owns; -1 when it owns none."""
    return next((i for i in range(region.shape.capacity) if owned_by(region, i, pid)), -1)


def owned_by(region: Region, learner: int, pid: int) -> bool:
    """True when entry `learner`'s lease names process `pid`."""
    return _lease_owner(region.entry(learner).get("lease")) == pid


def dead_owner_applied(region: Region, learner: int, pid: int, seen: int, timeout: float = 2.0) -> int:
    """The samples process `pid`, dead while it owns entry `learner`, contributed.

    The server applies what the dead learner published; once its ring is empty (waited for
    up to `timeout`), applied_samples is exactly the samples it contributed (its samples
    counter may miss the last step: it counts after publishing). Not drained in time: the
    most it published, `seen` (as last seen) or its samples counter.
    """
    entry = region.entry(learner)
    if _wait_drained(entry, Deadline(timeout)) and owned_by(region, learner, pid):
        # The counters are its own once it wrote its pid (after resetting them);
        # one that died before that, taking the entry over, published nothing.
        return entry.get("applied_samples") if entry.get("pid") == pid else 0
    return max(seen, entry.get("samples"))


def left_record(region: Region, pid: int, timeout: float = 2.0) -> int | None:
    """applied_samples of process `pid` that gave its learner entry back; None if no entry keeps it.

    A launched learner that drained its ring keeps its record when it releases it, in the
    entry of its number (`_keep_record`: last_pid 0 while last_applied changes), which no
    claim of any entry overwrites. Else (not launched, or it left without draining, the job
    stopping or the server gone) the entry it left still names it in `pid` (its counters are
    kept at release) until a new owner claims it (pid 0 before the reset). Each answer is
    read between two reads of the field that names it. Its ring is waited for (up to
    `timeout`) to be drained first: a learner that left because the job stopped or the server
    died may leave published gradients the server still applies.
    """
    for i in range(region.shape.capacity):
        record = region.entry(i)
        if record.get("last_pid") == pid:
            applied = record.get("last_applied")
            if record.get("last_pid") == pid:
                return applied
    deadline = Deadline(timeout)
    for i in range(region.shape.capacity):
        entry = region.entry(i)
        while entry.get("pid") == pid:
            if not drained(entry) and not deadline.expired():
                deadline.sleep(0.01)
                continue
            done = drained(entry)
            applied, samples = entry.get("applied_samples"), entry.get("samples")
            if entry.get("pid") == pid:
                # not drained in time: what it published, as dead_owner_applied counts it
                return applied if done else max(applied, samples)
    return None


def applied_in(learners: list[dict], pid: int) -> int:
    """What the server applied of process `pid`'s gradients, by the entries' counters as one
    capture read them (a checkpoint's `learners`, read in `checkpoint.capture`'s order).

    The record it kept when it released its entry (last_pid, last_applied: `_keep_record`)
    first: it is what the entry's counters said then, and the capture reads it after pid and
    applied_samples, so a claim between those reads (pid still this learner's, the counters
    already reset) is seen in it. 0 when no entry names it.
    """
    return next((c["last_applied"] for c in learners if c.get("last_pid") == pid),
                next((c["applied_samples"] for c in learners if c["pid"] == pid), 0))


class Consumer:
    """The server's end of every ring: find work, read a slot, hand it back.

    The server is the only writer of the tails, so it keeps its own copy of each and trusts
    the region's neither for them nor for a head: `take` checks the ring's invariant
    (an integer compare per gradient) and raises RegionCorrupt when another process broke it.
    """

    def __init__(self, region: Region):
        self.region = region
        self.capacity = region.shape.capacity
        self.slots = region.shape.slots
        self._table = region.base + region.layout.table
        self._entries = [region.entry(i) for i in range(self.capacity)]
        self._tail_addrs = [e.addr("tail") for e in self._entries]
        self._waiting_addrs = [e.addr("space_waiting") for e in self._entries]
        self._head_addrs = [e.addr("head") for e in self._entries]
        self._doorbell = Doorbell(region)
        self._next = 0
        self._tails = [_native.load64(addr) for addr in self._tail_addrs]
        for learner, tail in enumerate(self._tails):
            check_ring(region.job, learner, _native.load64(self._head_addrs[learner]), tail, self.slots)

    def poll(self, spin_ns: int, nap_ns: int = 0) -> int:
        """The next ring (round-robin) holding a published gradient, spinning up to spin_ns; -1 if none.
        With nap_ns: looking every nap_ns (sleeping in between) instead of spinning."""
        found = _native.poll_rings(
            self._table, self.capacity, ENTRY_BYTES, ENTRY["head"].offset, ENTRY["tail"].offset, self._next, spin_ns,
            nap_ns,
        )
        if found >= 0:
            self._next = (found + 1) % self.capacity
        return found

    def sleep(self, timeout: float) -> int:
        """Sleep on the doorbell until a learner publishes or `timeout` passes; returns poll()."""
        return self._doorbell.sleep(lambda: self.poll(0), timeout)

    def tail(self, learner: int) -> int:
        return self._tails[learner]

    def pending(self, learner: int) -> bool:
        """Whether `learner`'s ring looks non-empty (`take` then checks it)."""
        return _native.load64(self._head_addrs[learner]) != self._tails[learner]

    def take(self, learner: int) -> int:
        """The slot index of the oldest published gradient of `learner`'s ring.

        Raises:
            RegionCorrupt: the ring's head - tail is outside 1..slots, or its tail is not
                what this server stored.
        """
        tail = self._tails[learner]
        stored = _native.load64(self._tail_addrs[learner])
        head = _native.load64(self._head_addrs[learner])
        if stored != tail or not 0 < head - tail <= self.slots:
            check_ring(self.region.job, learner, head, stored, self.slots)
            if stored != tail:
                raise RegionCorrupt(f"job {self.region.job!r}: learner ring {learner}: tail is {stored:,}, the "
                                    f"server stored {tail:,} (only the server writes it): the ring is corrupt")
            raise RegionCorrupt(f"job {self.region.job!r}: learner ring {learner}: head {head:,} went back to its "
                                f"tail while the server took from it: the ring is corrupt")
        return tail % self.slots

    def release(self, learner: int) -> None:
        """Mark the oldest slot of `learner`'s ring consumed (after the update finished) and wake it."""
        self._tails[learner] += 1
        _native.store64(self._tail_addrs[learner], self._tails[learner])
        if _native.load32(self._waiting_addrs[learner]):  # a learner's threads: both may sleep on it
            _native.futex_wake(self._tail_addrs[learner], _WAKE_ALL)

    def wake_all(self) -> None:
        """Wake every learner that waits for ring space (they will look at the run state)."""
        for addr in self._tail_addrs:
            _native.futex_wake(addr, _WAKE_ALL)

    def owned(self, learner: int) -> bool:
        """Whether some process owns entry `learner` (alive or not: no liveness check)."""
        return _lease_owner(self._entries[learner].get("lease")) != 0

    def attached(self) -> int:
        """Entries some process owns (a cheap count, no liveness checks)."""
        return sum(1 for i in range(self.capacity) if self.owned(i))

    def learner_threads(self) -> int:
        """Cores the attached learners say they keep busy (a cheap sum, no liveness checks)."""
        return sum(entry.get("threads") for i, entry in enumerate(self._entries) if self.owned(i))

    def busy_entries(self) -> list[int]:
        """Entries owned by a live learner."""
        return [i for i in range(self.capacity) if self.owned(i) and owner_alive(self.region, i)]

