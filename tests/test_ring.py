"""The ring across processes: a learner's two threads blocked on its ring at once (the train
thread in `drain`, the push thread in `wait_space`) are both woken by the server that frees
it, in a learner process of its own (tests/worker.py two-waiters); what the others read of a
ring through `gadei.ring` (status, a checkpoint, the server's rounds) is what it holds; and a
launched learner that gave its entry back is counted right by the supervisor whatever claims of
the entry follow."""

import os
import signal
import statistics
import time

from gadei import checkpoint, ring
from gadei.protocol import WAIT_SLICE
from gadei.region import Region
from gadei.ring import Consumer, claim
from gadei.server import Server
from gadei.supervisor import Launched, progress
from gadei_watchdog.learners import Learners
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


def test_a_launched_learner_that_left_is_counted_right_after_two_claims_of_its_entry(job, procs, tmp_path):
    """A launched learner (number 0) pushes 5 gradients, drains, gives its entry back and has
    not exited yet when two other learners claim that entry one after the other, within one
    supervisor's interval. A checkpoint taken then says the weights hold its 5, and when it is
    killed before it exits, the supervisor goes on with it after those 5. (Once the entry's next
    owner copied the last owner's counters into the entry itself: the second claim
    overwrote the copy, and the supervisor, finding no record, counted 0 and restarted it from
    the start, its 5 gradients applied twice.)"""
    server = procs.worker("serve", job, "--learners", 1, "--slots", 2)
    read_line(server, 60)
    left = procs.worker("push", job, "--steps", 5, "--entry", 0, "--linger", 120)
    for _ in range(3):  # attaching, attached, then what it pushed (its entry given back)
        said = read_line(left, 60)
    assert said["pushed"] == 5, said
    for _ in range(2):  # the two claims: each attaches, pushes one gradient and leaves
        other = procs.worker("push", job, "--steps", 1)
        finish(other)
    region = Region.attach(job)
    try:
        entry = region.entry(0)
        assert entry.get("pid") == other.pid and entry.get("applied_samples") == 1  # the last claim's own
        table = [Launched(0, ["--entry", "0"], pid=left.pid)]
        table[0].proc = left  # the supervisor's child, as a launched learner is
        taken = checkpoint.capture(region, progress=lambda ckpt: progress(table, ckpt))
        assert taken.progress == {"0": 5}  # running, its entry given back: the weights hold its 5
        left.send_signal(signal.SIGKILL)  # killed before it exited
        left.wait()
        learners = Learners(job, table, str(tmp_path), {}, max_restarts=3, window=60.0, backoff=60.0)
        died, _ = learners.look(region)
        assert died == [0] and table[0].start_at == 5, table[0]
    finally:
        region.close()
    server.send_signal(signal.SIGTERM)
    finish(server)
