"""The ring across processes: a learner's two threads blocked on its ring at once (the train
thread in `drain`, the push thread in `wait_space`) are both woken by the server that frees
it, in a learner process of its own (tests/worker.py two-waiters); and what the others read
of a ring through `gadei.ring` (status, a checkpoint, the server's rounds) is what it holds."""

import os
import statistics
import time

from gadei import ring
from gadei.protocol import WAIT_SLICE
from gadei.region import Region
from gadei.ring import Consumer, claim
from gadei.server import Server
from helpers import finish, read_line

TRIALS = 5


def test_both_threads_blocked_on_one_ring_wake_when_the_server_frees_it(job, procs):
    """With a `thread` or `device` push and a staleness bound, the train thread drains the
    ring while the push thread waits for space in it. Freeing one slot must end the push
    thread's wait and freeing the last the drain, each at once: a wake-up lost to the other
    thread would cost a whole wait slice (WAIT_SLICE, 0.1 s) before the waiter looks again."""
    server = Server(job, n_params=64, learners=1, slots=2, threads=1)
    try:
        consumer = Consumer(server.region)
        learner = procs.worker("two-waiters", job, "--trials", TRIALS)
        late = []
        for trial in range(TRIALS):
            assert read_line(learner, 60) == {"ready": trial}  # the ring is full, both threads sleep on it
            consumer.take(0)
            freed = time.monotonic()
            consumer.release(0)  # room for the push thread
            space = read_line(learner, 10)["space"] - freed
            for _ in range(server.region.shape.slots - 1):  # and the rest: the drain ends
                consumer.take(0)
                freed = time.monotonic()
                consumer.release(0)
            drained = read_line(learner, 10)["drained"] - freed
            late.append(max(space, drained))
        finish(learner, 30)
    finally:
        server.close()
    # a lost wake-up makes its trial a slice late; a woken thread is back in far less, even
    # on a loaded machine (the median of the trials forgives one slow one)
    assert statistics.median(late) < WAIT_SLICE / 2, f"seconds each trial's waiter was late: {late}"


def test_what_the_ring_tells_others_of_a_ring_is_what_it_holds(job):
    """`gadei status` (owner, since_claim), a checkpoint (counters), serve's stopped record
    (published), the server's sync rounds (Consumer.owned) and a leaving learner's log
    (Producer.pending) read a ring only through gadei.ring: after two gradients published and
    one consumed, each says so; a free entry has no owner."""
    server = Server(job, n_params=64, learners=2, slots=2, threads=1)
    region = Region.attach(job)
    try:
        consumer = Consumer(server.region)
        producer = claim(region, drain_timeout=5, server_alive=lambda: True)
        mine, other = producer.learner, 1 - producer.learner
        for step in range(2):
            producer.publish(region.header.get("version"), step, 1)
        consumer.take(mine)
        consumer.release(mine)
        assert ring.owner(region, mine) == os.getpid() and consumer.owned(mine)
        assert ring.owner(region, other) == 0 and not consumer.owned(other)
        assert ring.since_claim(region, mine) == (2, 1, 1)  # published, consumed, in the ring
        assert producer.pending() == 1 and ring.published(region) == 2
        counters = ring.counters(region)
        assert (counters[mine]["pid"], counters[mine]["head"], counters[mine]["tail"]) == (os.getpid(), 2, 1)
        assert ring.applied_in(counters, os.getpid()) == counters[mine]["applied_samples"]
        consumer.take(mine)
        consumer.release(mine)
        assert producer.drain(1.0, lambda: True) and producer.pending() == 0
        assert ring.since_claim(region, mine) == (2, 2, 0)
        producer.release()
        assert ring.owner(region, mine) == 0 and not consumer.owned(mine)
    finally:
        region.close()
        server.close()
