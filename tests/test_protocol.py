"""The ring, the server's apply loop and the protocol module at the module level: in this
process, on a real region (no subprocess), beside the end-to-end tests that run them as
`gadei serve` and `gadei learn`."""

import ctypes
import threading
import time

import numpy as np
import pytest

from gadei import protocol, status
from gadei.errors import GadeiTimeout, JobFailed, JobStopped, RegionCorrupt
from gadei.layout import FIELD_BYTES, SERVING, STOPPED, STOPPING
from gadei.region import Region
from gadei.transport.slot import dense_area
from gadei.ring import Consumer, claim
from gadei.server import Server

N = 64


@pytest.fixture
def served(job):
    """A Server of N parameters (weights 1.0) in this process, and a learner's view of its region."""
    server = Server(job, n_params=N, learners=2, slots=2, lr=0.5, threads=1)
    server.region.weights[:] = 1.0
    region = Region.attach(job)
    try:
        yield server, region
    finally:
        region.close()
        server.close()


def _in_futex_wait(thread: threading.Thread) -> bool:
    """The thread sleeps in the kernel on a futex (not merely about to)."""
    with open(f"/proc/self/task/{thread.native_id}/wchan") as f:
        return "futex" in f.read()


def _publish(region, producer, value: float, step: int) -> None:
    dense_area(region, producer.learner, producer.slot)[:] = value
    producer.publish(region.header.get("version"), step, 1)


def test_a_published_slot_is_taken_once_and_its_release_frees_the_ring(served):
    server, region = served
    producer = claim(region, drain_timeout=5, server_alive=lambda: True)
    consumer = Consumer(server.region)
    assert consumer.poll(0) == -1
    _publish(region, producer, 0.25, 0)
    _publish(region, producer, 0.5, 1)
    assert not producer.has_space()  # two slots, both published
    assert consumer.poll(0) == producer.learner
    assert consumer.take(producer.learner) == 0
    consumer.release(producer.learner)
    assert producer.tail() == 1 and producer.has_space()
    assert consumer.take(producer.learner) == 1
    consumer.release(producer.learner)
    assert consumer.poll(0) == -1 and producer.drain(1.0, lambda: True)


@pytest.mark.parametrize("ahead", [5, 2**64 - 3], ids=["by-5", "wrapped"])
def test_a_learner_refuses_a_corrupt_tail_and_never_writes_over_a_pending_slot(served, ahead):
    """Both ends of a ring check what they read (issue 33): with the ring full, a tail written
    ahead of the head (head - tail = -5, or a counter wrapped to near 2**64) would read as room
    to write over a slot the server has not taken; the producer stops with the server's
    message instead."""
    server, region = served
    producer = claim(region, drain_timeout=5, server_alive=lambda: True)
    _publish(region, producer, 0.25, 0)
    _publish(region, producer, 0.5, 1)  # full: both slots wait for the server
    region.entry(producer.learner).set("tail", (producer.head + ahead) % 2**64)
    pending = [dense_area(region, producer.learner, s).copy() for s in range(2)]
    for look in (producer.has_space, lambda: producer.wait_space(lambda: None),
                 lambda: producer.drain(1.0, lambda: True)):
        with pytest.raises(RegionCorrupt, match=f"learner ring {producer.learner}: head - tail = .*allowed 0..2"):
            look()
    assert all(np.array_equal(dense_area(region, producer.learner, s), pending[s]) for s in range(2))


def test_the_apply_loop_applies_each_gradient_once_and_stops_on_request(served):
    server, region = served
    producer = claim(region, drain_timeout=5, server_alive=lambda: True)
    loop = threading.Thread(target=server.serve, kwargs={"grace": 0.5})
    loop.start()
    try:
        grads = [0.25, 0.5, 0.125, 1.0]
        for step, g in enumerate(grads):
            producer.wait_space(lambda: None)
            _publish(region, producer, g, step)
        protocol.wait_for(lambda: region.header.get("version") == len(grads), 10, "every gradient applied")
        # the checkpoint hold: the server pauses between two updates and says so once per pause
        epoch = region.header.get("hold_epoch")
        seen = protocol.hold_and_copy(region, 5.0, lambda: region.header.get("version"), RuntimeError)
        assert seen == len(grads)
        protocol.wait_for(lambda: region.header.get("hold_epoch") == epoch + 1, 5, "the pause to end")
        assert producer.drain(5.0, lambda: True)
        producer.release()
        state = protocol.RunState(region)
        assert state.get() == SERVING and state.request_stop() and not state.request_stop()
    finally:
        protocol.RunState(region).request_stop()
        loop.join(10)
    assert not loop.is_alive()
    assert protocol.RunState(region).get() == STOPPED
    expected = np.float32(1.0)
    for g in grads:
        expected = np.float32(expected - np.float32(0.5) * np.float32(g))
    assert np.array_equal(region.weights, np.full(N, expected, np.float32))  # w0 - lr * sum(g), each once
    assert region.header.get("applied") == len(grads)


def test_a_large_job_holds_still_for_a_checkpoint_copy_longer_than_a_small_ones(job):
    """The server goes on by itself after its hold limit, which grows with the weights and
    state it holds: a copy of 1.4 GB of weights and their Adagrad state took longer than the
    2 s a small job waits, and not one checkpoint of that job was whole."""
    n = 40 << 20  # 160 MiB of weights and as much Adagrad state: a limit of 4.5 s
    server = Server(job, n_params=n, learners=1, slots=2, lr=0.5, threads=1, optimizer="adagrad")
    loop = threading.Thread(target=server.serve, kwargs={"grace": 0.5})
    loop.start()
    try:
        with Region.attach(job) as region:
            limit = protocol.hold_limit(region.shape)
            assert limit == pytest.approx(protocol.HOLD_LIMIT + 8 * n / protocol.HOLD_RATE)
            assert limit > protocol.HOLD_LIMIT + 2

            def slow_copy() -> int:  # longer than a small job's limit
                time.sleep(protocol.HOLD_LIMIT + 1)
                return region.header.get("version")

            assert protocol.hold_and_copy(region, 5.0, slow_copy, RuntimeError) == 0  # whole: held throughout
    finally:
        protocol.RunState(server.region).request_stop()
        loop.join(10)
        server.close()
    assert not loop.is_alive()


def test_a_stop_request_moves_serving_to_stopping_once_and_wakes_a_sleeping_server(served):
    server, region = served
    woke = []
    sleeper = threading.Thread(target=lambda: woke.append(protocol.Doorbell(server.region).sleep(lambda: -1, 10)))
    sleeper.start()
    try:
        protocol.wait_for(lambda: _in_futex_wait(sleeper), 5, "the server to sleep on the doorbell")
        assert region.header.get("server_sleeping") == 1
        assert protocol.RunState(region).request_stop()
        sleeper.join(5)
        assert not sleeper.is_alive() and woke == [-1]  # rung: back well before its 10 s
    finally:
        sleeper.join(15)
    assert protocol.RunState(region).get() == STOPPING
    assert not protocol.RunState(region).request_stop()  # only from serving


def test_a_failed_jobs_reason_is_read_by_every_attacher_and_bounded_and_printable(served):
    server, region = served
    view = protocol.RunState(region)
    assert view.reason() == "" and isinstance(view.not_serving("j"), JobStopped)  # serving: no reason, no failure
    protocol.RunState(server.region).fail("learner ring 1: head - tail = -5; résumé " + "x" * 1000)
    said = view.reason()
    assert (said.startswith("learner ring 1: head - tail = -5; résumé x")
            and len(said.encode()) == FIELD_BYTES["text"] - 1)
    err = view.not_serving("j")
    assert isinstance(err, JobFailed) and str(err).startswith("job 'j' failed: learner ring 1: head - tail = -5")
    # what another process wrote is untrusted: bad UTF-8 and escape sequences never reach a terminal
    tampered = b"bad \xff\x1b[31m red\0"
    ctypes.memmove(region.header.addr("fail_reason"), tampered, len(tampered))
    assert view.reason() == "bad \ufffd?[31m red"
    assert status.format_table(status.read(region), None).splitlines()[1] == "  failed: bad \ufffd?[31m red"


def test_a_learner_takes_the_entry_it_prefers_when_free_else_the_first_free(served):
    """A launched learner's number is the one it was launched as (`--entry`), in its log and in
    gadei status, whichever learner attached first."""
    server, region = served
    alive = lambda: True  # noqa: E731
    second = claim(region, drain_timeout=1, server_alive=alive, prefer=1)
    assert second.learner == 1
    first = claim(region, drain_timeout=1, server_alive=alive, prefer=1)  # taken: the first free
    assert first.learner == 0
    for producer in (first, second):
        producer.release()


def test_a_version_wait_ends_at_the_bump_or_the_timeout(served):
    server, region = served
    clock, mine = protocol.Version(server.region), protocol.Version(region)
    assert mine.wait_change(0, 0.05) == 0  # timed out: nothing moved
    got = []
    waiter = threading.Thread(target=lambda: got.append(mine.wait_change(0, 10)))
    waiter.start()
    try:
        protocol.wait_for(lambda: _in_futex_wait(waiter), 5, "the waiter to sleep on the version")
        assert region.header.get("version_waiters") == 1  # it counted itself, so the server wakes it
        clock.bump()
        clock.wake_if_waited()
        waiter.join(5)
        assert not waiter.is_alive() and got == [1]  # woken: back well before its 10 s
    finally:
        waiter.join(15)
    assert region.header.get("version_waiters") == 0


def test_deadline_and_wait_for():
    deadline = protocol.Deadline(0.05)
    assert not deadline.expired() and 0 < deadline.slice(1.0) <= 0.05
    protocol.wait_for(deadline.expired, 1.0, "the deadline")
    assert deadline.left() == 0.0 and deadline.slice(1.0) == 0.0
    with pytest.raises(GadeiTimeout, match=r"waited 0.05 s for nothing"):
        protocol.wait_for(lambda: False, 0.05, "nothing")
    assert protocol.wait_for(lambda: 7, 0.05, "a value") == 7


def test_one_server_at_a_time_holds_the_spin_token_and_a_dead_holder_frees_it(tmp_path, procs, monkeypatch):
    """Servers side by side: only the holder of the machine's spin token spins or dozes while it
    waits for gradients, the others sleep; a holder that dies (SIGKILL) leaves it free."""
    from gadei.spin import SpinToken
    from helpers import read_line

    monkeypatch.setenv("GADEI_RUNTIME_DIR", str(tmp_path))
    holder = procs.start("-c", "from gadei.spin import SpinToken; import json, time; t = SpinToken(); "
                         "print(json.dumps({'held': t.take()}), flush=True); time.sleep(600)",
                         env={"GADEI_RUNTIME_DIR": str(tmp_path)})
    assert read_line(holder, 60) == {"held": True}
    token = SpinToken()
    try:
        assert not token.take(), "a second server took the spin token while the first held it"
        holder.kill()
        holder.wait()
        assert token.take() and token.take()  # taken once, held after
        token.give()
        other = SpinToken()
        assert other.take(), "a token given back stayed taken"
        other.close()
    finally:
        token.close()


@pytest.mark.parametrize("gap_us, rings, slots, nap_us", [
    (180, 2, 8, 1000),  # 2 learners of the n-gram workload at batch 1: the longest nap
    (600, 2, 8, 1000),  # at batch 4: still a few gradients a nap
    (100, 1, 8, 350),  # one ring fills sooner: half the time its 7 free slots take
    (40, 1, 8, 0),  # a nap that short saves no wake-ups: the doorbell
    (180, 2, 2, 0),  # one free slot a ring: a learner would wait out the nap
    (1200, 2, 8, 0),  # gradients farther apart than a nap: rung for each loses nothing
])
def test_a_server_with_no_core_of_its_own_naps_only_where_it_saves_wake_ups_and_no_ring_fills(gap_us, rings, slots,
                                                                                               nap_us):
    from gadei.spin import nap_ns

    assert nap_ns(gap_us * 1000, rings, slots) == nap_us * 1000
