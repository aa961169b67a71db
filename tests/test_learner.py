"""The learner API: stopping, a dead server, full rings that block without spinning, capacity, .grad fallbacks."""

import os
import signal
import time

import numpy as np
import psutil
import pytest
import torch

import gadei
from helpers import Serving, communicate, read_line, wait_for
from gadei.region import Region
from gadei.transport.slot import dense_area
from worker import Flat


def test_stopping_the_job_ends_the_with_block_quietly(job):
    model = Flat(100, 0.0)
    with Serving(job, model=Flat(100, 1.0), lr=0.5) as server:
        with gadei.Learner(model, job) as learner:
            for _ in range(3):
                for p in model.parameters():
                    p.grad.fill_(1.0)
                learner.step()
            server.request_stop()
            assert wait_for(lambda: learner.stopped, 10, "the learner to see the stop")
            with pytest.raises(gadei.JobStopped):
                learner.step()
            learner.step()  # raised inside the with block: ends it without an error
            pytest.fail("step() after a stop must raise")
        assert learner.steps == 3
        # the 3 published gradients were applied before the server stopped
        assert model.weight[0].item() == 1.0 - 0.5 * 3


def test_replaced_grads_are_copied_into_the_ring(job, caplog):
    model = Flat(100, 0.0)
    with Serving(job, model=Flat(100, 0.0), lr=0.25) as server:
        with gadei.Learner(model, job) as learner:
            for _ in range(4):
                model.zero_grad(set_to_none=True)  # a habit from torch.optim: gadei must still see the gradient
                for p in model.parameters():
                    p.grad = torch.full_like(p, 2.0)
                learner.step()
        np.testing.assert_array_equal(server.weights(), np.full(100, -0.25 * 2.0 * 4, dtype=np.float32))
    assert "copying gradients into the ring" in caplog.text


def test_backward_accumulates_straight_into_the_ring_slot(job):
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    with Serving(job, model=torch.nn.Linear(4, 1, bias=False), lr=1.0) as server:
        with torch.no_grad():
            server.region.weights[:] = 0.0
        with gadei.Learner(model, job) as learner:
            slot = dense_area(learner.region, learner.learner_id, learner._producer.slot)
            assert model.weight.grad.data_ptr() == slot.ctypes.data  # .grad is a view of the slot
            x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
            model(x).sum().backward()
            np.testing.assert_array_equal(slot, [1.0, 2.0, 3.0, 4.0])  # written by backward itself
            learner.step()
        np.testing.assert_array_equal(server.weights(), [-1.0, -2.0, -3.0, -4.0])


def test_a_view_learners_gradient_counts_as_computed_on_the_version_its_forward_pass_read(job):
    """Updates applied between attach (or the last step) and the forward pass are in the
    weights that pass reads: the gradient is not stale by them (staleness 0, not 5)."""
    model, other = Flat(100, 0.0), Flat(100, 0.0)
    with Serving(job, model=Flat(100, 0.0), lr=0.5, learners=2) as server:
        with gadei.Learner(model, job) as learner, gadei.Learner(other, job) as busy:
            for _ in range(5):  # another learner's updates after this one attached
                for p in other.parameters():
                    p.grad.fill_(1.0)
                busy.step()
            wait_for(lambda: server.version == 5, 10, "the other learner's 5 updates")
            model(torch.ones(1)).sum().backward()
            learner.step()
            wait_for(lambda: server.version == 6, 10, "this learner's update")
            entry = server.region.entry(learner.learner_id)
            assert entry.get("stale_max") == 0 and entry.get("stale_sum") == 0


def test_a_full_learner_table_is_refused_naming_the_owners(job, procs):
    with Serving(job, model=Flat(100), learners=1):
        holder = procs.worker("push", job, "--n", 100, "--steps", 10**9, "--slow")
        read_line(holder, 60)
        read_line(holder, 60)
        with pytest.raises(gadei.CapacityError, match=rf"all 1 learner entries are taken .*{holder.pid}.*--learners"):
            gadei.Learner(Flat(100), job, timeout=5).attach()


def _cpu_seconds(pid, wall):
    proc = psutil.Process(pid)
    before = sum(proc.cpu_times()[:2])
    end = time.monotonic() + wall
    wait_for(lambda: time.monotonic() >= end, wall + 5, f"{wall} s to pass")
    return sum(proc.cpu_times()[:2]) - before


def test_idle_server_and_blocked_learner_use_no_cpu_and_a_dead_server_ends_the_wait(job, procs):
    server = procs.worker("serve", job, "--n", 1000)
    read_line(server, 60)
    assert _cpu_seconds(server.pid, 1.0) < 0.05, "an idle server must sleep on its doorbell, not spin"

    server.send_signal(signal.SIGSTOP)  # now nobody consumes: the learner's ring fills up
    learner = procs.worker("push", job, "--n", 1000, "--steps", 10**9)
    read_line(learner, 60)
    read_line(learner, 60)
    with Region.attach(job, readonly=True) as region:
        wait_for(lambda: region.entry(0).get("head") == 2, 30, "the ring to fill")
        assert _cpu_seconds(learner.pid, 1.0) < 0.1, "a learner waiting for ring space must block, not spin"
        assert region.entry(0).get("head") == 2  # it did not overwrite an unconsumed slot

    server.send_signal(signal.SIGKILL)
    server.wait()
    started = time.monotonic()
    _, err = communicate(learner, 30)
    assert learner.returncode != 0
    assert "ServerGone" in err and "is gone" in err
    assert time.monotonic() - started < 5


def test_a_server_with_no_core_of_its_own_naps_instead_of_being_rung_for_each_gradient(job, procs):
    """Two learners that keep their cores busy (a gradient every 0.1 ms of work) and a server
    that counts one core for itself and them (GADEI_CORES=1: a machine the learners fill): the
    server naps between looks at its rings (`gadei.spin.nap_ns`, rings of 8 slots) and takes
    the gradients that came meanwhile, so the learners seldom find it asleep and ring it.
    Here it was rung 33-38 times for the 6,000 gradients; asleep on the doorbell instead (the nap
    taken out), 5,486 times."""
    server = procs.worker("serve", job, "--n", 1000, "--learners", 2, "--slots", 8,
                          env={**os.environ, "GADEI_CORES": "1"})
    read_line(server, 60)
    learners = [procs.worker("push", job, "--n", 1000, "--steps", 3000, "--busy", 0.0001, "--wait-learners", 2)
                for _ in range(2)]
    for learner in learners:
        communicate(learner, 120)
        assert learner.returncode == 0
    server.send_signal(signal.SIGTERM)
    report = read_line(server, 60)
    assert report["applied"] == 6000
    assert report["doorbell"] < 600, f"the learners rang the server {report['doorbell']:,} times for 6,000 gradients"


def _server_cpu_shares(job, procs, env=None) -> tuple[float, float]:
    """A server with a kernel team of 2 threads, one learner pushing 100 gradients 5 ms apart:
    the CPU seconds of the server's main thread and of its busiest other thread (the team's
    second one) over that time, each as a share of it. (A team of 2, because GNU OpenMP spins
    briefly only where its threads outnumber the cores: one of 2 would spin in full on this
    2-core machine as on a large one. The model is the smallest that gets one, 2 x
    GD_THREAD_MIN elements, so that the updates' own work stays a small share of the time even
    on a slow or crowded machine: each thread's share is set against the others', not the
    machine's speed.)"""
    n = 2 * 262_144
    server = procs.worker("serve", job, "--n", n, "--threads", 2, "--learners", 1, env=env)
    read_line(server, 60)
    learner = procs.worker("push", job, "--n", n, "--steps", 100, "--delay", 0.005)
    read_line(learner, 60)
    read_line(learner, 60)  # attached
    proc = psutil.Process(server.pid)

    def cpu() -> dict[int, float]:
        return {thread.id: thread.user_time + thread.system_time for thread in proc.threads()}

    before, started = cpu(), time.monotonic()
    communicate(learner, 60)
    assert learner.returncode == 0
    after, elapsed = cpu(), time.monotonic() - started
    shares = {tid: (seconds - before.get(tid, 0.0)) / elapsed for tid, seconds in after.items()}
    main = shares.pop(server.pid)
    return main, max(shares.values(), default=0.0)


def test_a_server_kernel_team_sleeps_between_updates(job, procs):
    """The server sleeps between gradients 5 ms apart, and so do its kernel's OpenMP threads
    (gadei sets a passive wait policy): here its main thread costs 0.04-0.05 of a core and the
    team's other thread 0.02 (0.03 and 0.015 with both cores kept busy by other processes), where
    that thread spinning for 300,000 turns after each update (GOMP_SPINCOUNT=300000) takes 0.21,
    and spinning throughout (OMP_WAIT_POLICY=ACTIVE) 0.98. A server dozing through the gaps
    (looking at the rings every 50 us) took a quarter of a core (0.24-0.27 with a 4 MB model)."""
    main, team = _server_cpu_shares(job, procs)
    assert team < 0.1, f"the server's kernel team thread used {team:.2f} cores for 100 updates 5 ms apart: it spins"
    assert main < 0.15, f"the server's main thread used {main:.2f} cores for 100 updates 5 ms apart: it spins"


def test_a_stalled_server_blocks_a_learner_until_it_resumes(job, procs):
    server = procs.worker("serve", job, "--n", 1000)
    read_line(server, 60)
    server.send_signal(signal.SIGSTOP)
    learner = procs.worker("push", job, "--n", 1000, "--steps", 50)
    read_line(learner, 60)
    read_line(learner, 60)
    with Region.attach(job, readonly=True) as region:
        wait_for(lambda: region.entry(0).get("head") == 2, 30, "the ring to fill")
    assert learner.poll() is None
    server.send_signal(signal.SIGCONT)
    assert read_line(learner, 60)["pushed"] == 50
