"""The region: created 0600 and pre-faulted, checked on attach, leftovers and foreign objects refused."""

import collections
import os
import signal
import time
import numpy as np
import posix_ipc
import pytest
import torch

import gadei
from gadei import ring
from gadei.layout import MAGIC, RING_SLOTS, Shape, layout
from gadei.region import SHM_DIR, Region, inspect, shm_name
from worker import Flat
from helpers import communicate, finish, read_line


def _path(job):
    return os.path.join(SHM_DIR, "gadei-" + job)


def test_region_is_private_prefaulted_and_unlinked_on_clean_stop(job):
    server = gadei.Server(job, n_params=300_000, learners=2)
    try:
        st = os.stat(_path(job))
        assert st.st_mode & 0o777 == 0o600
        assert st.st_uid == os.geteuid()
        size = layout(server.region.shape).total
        assert st.st_size == size
        assert st.st_blocks * 512 >= size, "tmpfs pages were not allocated at creation"
        with Region.attach(job, readonly=True) as seen:
            assert seen.shape == Shape(300_000, capacity=2, slots=RING_SLOTS)  # the server's choice ("auto")
            assert seen.header.get("magic") == MAGIC
            assert seen.read_name() == job
            assert seen.server_alive()
    finally:
        server.close()
    assert not os.path.exists(_path(job))
    assert inspect(job) is None


def test_attach_refuses_mismatches_naming_both_sides(job):
    with gadei.Server(job, model=Flat(1000), learners=2) as server:
        with Region.attach(job) as region:
            with pytest.raises(gadei.RegionMismatch, match=r"model has 999 parameters, region holds 1,000"):
                region.expect(n_params=999)
            with pytest.raises(gadei.RegionMismatch, match=r"float16 gradients, region holds float32"):
                region.expect(grad_dtype="float16")
        with pytest.raises(gadei.RegionMismatch, match=r"model has 1,001 parameters, region holds 1,000"):
            gadei.Learner(Flat(1001), job, timeout=5).attach()

        class Swapped(torch.nn.Module):  # same count, other shapes
            def __init__(self):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.zeros(7))
                self.bias = torch.nn.Parameter(torch.zeros(993))

        with pytest.raises(gadei.RegionMismatch, match=r"parameter 0 'weight' has shape \(7,\) in the model, \(993,\)"):
            gadei.Learner(Swapped(), job, timeout=5).attach()
        with pytest.raises(gadei.RegionMismatch, match=r"torch.float64; gadei holds float32"):
            gadei.Learner(Flat(1000).double(), job, timeout=5).attach()
        # a refused learner claimed nothing
        assert all(region_entry_free(job, i) for i in range(2))
        del server


def region_entry_free(job, learner):
    with Region.attach(job, readonly=True) as region:
        return ring.owner(region, learner) == 0


def test_bad_job_names_are_refused():
    for bad in ["", "a/b", "../x", "x" * 64, "-x", "sp ace", "dict-ü"]:
        with pytest.raises(gadei.BadJobName, match="use 1-63 ASCII letters, digits"):
            shm_name(bad)


def test_missing_region_says_how_to_start_one(job):
    with pytest.raises(gadei.RegionNotFound, match=rf"job '{job}' has no region .*gadei serve {job}"):
        Region.attach(job)


def test_foreign_object_with_the_jobs_name_is_refused_and_kept(job, procs):
    junk = posix_ipc.SharedMemory(shm_name(job), flags=posix_ipc.O_CREX, mode=0o600, size=8192)
    os.write(junk.fd, b"not a gadei region at all")
    junk.close_fd()
    with pytest.raises(gadei.ForeignRegion, match="is not a gadei region"):
        Region.attach(job)
    with pytest.raises(gadei.ForeignRegion, match=f"gadei clean --force {job}"):
        gadei.Server(job, n_params=10)
    out, _ = finish(procs.gadei("clean", job))
    assert "kept" in out and os.path.exists(_path(job))
    out, _ = finish(procs.gadei("clean", job, "--force"))
    assert "removed" in out and not os.path.exists(_path(job))


def test_leftover_of_a_killed_server_is_detected_refused_replaced_and_cleaned(job, procs):
    server = procs.worker("serve", job)
    pid = read_line(server, 60)["ready"]
    server.send_signal(signal.SIGKILL)
    server.wait()
    found = inspect(job)
    assert found.state == "leftover" and found.server_pid == pid
    with pytest.raises(gadei.LeftoverRegion, match=rf"left behind by server pid {pid}.*gadei clean {job}.*--replace"):
        gadei.Server(job, n_params=10)
    # the CLI refuses with the same message and exit status 2
    cli = procs.gadei("serve", job, "--params", "10")
    _, err = communicate(cli, 60)
    assert cli.returncode == 2 and f"left behind by server pid {pid}" in err
    # --replace takes its place
    with gadei.Server(job, n_params=10, replace=True) as replacement:
        assert inspect(job).state == "running"
        assert replacement.region.header.get("server_pid") == os.getpid()
    # and `gadei clean` removes a leftover and the record its server kept outside it (for `gadei
    # stop`), but never a live region or a live server's record
    from gadei.env import runtime_dir

    record = os.path.join(runtime_dir(), f"{job}.server.json")
    server = procs.worker("serve", job)
    pid = read_line(server, 60)["ready"]
    out, _ = finish(procs.gadei("clean", job))
    assert "kept: served by live pid" in out and inspect(job).state == "running" and os.path.exists(record)
    server.send_signal(signal.SIGKILL)
    server.wait()
    out, _ = finish(procs.gadei("clean"))
    assert f"{job}: removed" in out and inspect(job) is None
    assert f"{job}: removed the record of server pid {pid}, which is gone" in out and not os.path.exists(record)


_CREATOR = """
import json, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # first: the threads imports start inherit it
from gadei.layout import Shape
from gadei.region import Region
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
region = Region.create(sys.argv[1], Shape(n, capacity=2))  # as a server does, then it reads a checkpoint...
print(json.dumps({"created": True}), flush=True)
signal.sigwait({signal.SIGUSR1})
region.publish()
print(json.dumps({"published": True}), flush=True)
signal.sigwait({signal.SIGUSR1})
region.unlink()
"""


def test_a_region_its_server_is_still_creating_is_starting_kept_and_waited_for(job, procs):
    """Between Region.create and publish (a server reading a large checkpoint on a loaded
    machine: seconds) the job is 'starting': nothing takes it for a leftover, and nothing
    that waits for a 'running' server attaches to half a region (a supervisor restarting a
    server once did, and gave up on the job)."""
    creator = procs.start("-c", _CREATOR, job)
    read_line(creator, 60)
    found = inspect(job)
    assert (found.state, found.server_pid) == ("starting", creator.pid)
    with pytest.raises(gadei.GadeiTimeout, match="did not finish creating it within 0 s"):
        Region.attach(job)
    with pytest.raises(gadei.JobRunning, match=f"server pid {creator.pid} is creating"):
        gadei.Server(job, n_params=1000, replace=True)
    out, _ = finish(procs.gadei("clean", job))
    assert f"kept: served by live pid {creator.pid}" in out and os.path.exists(_path(job))
    out, _ = finish(procs.gadei("status", job))
    assert f"job {job}: starting: server pid {creator.pid} is still creating its region" in out
    creator.send_signal(signal.SIGUSR1)
    with Region.attach(job, readonly=True, wait=60) as region:  # waits for the publish
        assert region.shape == Shape(1000, capacity=2)
    assert inspect(job).state == "running"
    creator.send_signal(signal.SIGUSR1)
    finish(creator)
    assert inspect(job) is None


def test_a_large_region_being_reserved_is_its_creators_all_along(job, procs):
    """Reserving and pre-faulting 640 MB takes a while; but for microseconds after its
    creation, the region reads as its creator's all along (never as a leftover)."""
    creator = procs.start("-c", _CREATOR, job, 2**25)  # 128 MB of weights, 2 learners x 2 slots of 128 MB
    seen = collections.Counter()
    deadline = time.monotonic() + 120
    while not seen["starting"]:
        found = inspect(job)
        seen[found.state if found else None] += 1
        assert time.monotonic() < deadline and creator.poll() is None, (seen, creator.stderr.read())
    # at most one look each can fall into the microseconds between the creation and its size
    # (foreign: too small) and the pid's write (leftover); before, the whole reservation read
    # as a leftover: hundreds of looks
    assert seen["foreign"] <= 1 and seen["leftover"] <= 1, seen
    assert set(seen) <= {None, "foreign", "leftover", "starting"}, seen
    read_line(creator, 60)
    creator.send_signal(signal.SIGUSR1)
    assert read_line(creator, 60) == {"published": True}
    creator.send_signal(signal.SIGUSR1)
    finish(creator)


def test_a_server_killed_while_creating_its_region_leaves_a_leftover(job, procs):
    creator = procs.start("-c", _CREATOR, job)
    read_line(creator, 60)
    creator.send_signal(signal.SIGKILL)
    creator.wait()
    assert (inspect(job).state, inspect(job).server_pid) == ("leftover", creator.pid)
    with gadei.Server(job, n_params=10, replace=True):
        assert inspect(job).state == "running"
    assert inspect(job) is None


def test_a_live_server_cannot_be_replaced(job):
    with gadei.Server(job, n_params=10):
        with pytest.raises(gadei.JobRunning, match=f"already served by pid {os.getpid()}"):
            gadei.Server(job, n_params=10, replace=True)


def test_another_users_region_is_refused(job):
    if os.geteuid() != 0:
        pytest.skip("needs root to hand a region to another user")
    with gadei.Server(job, n_params=10):
        os.chown(_path(job), 65534, 65534)
        with pytest.raises(gadei.ForeignOwner, match=r"belongs to uid 65534.*you are uid 0"):
            Region.attach(job)
        assert inspect(job).state == "other-user"
        os.chown(_path(job), 0, 0)


def test_another_user_cannot_open_a_region(job):
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    with gadei.Server(job, n_params=10):
        # A forked child (everything already imported) drops to uid 65534 and tries to attach.
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read_end)
                os.setgid(65534)
                os.setuid(65534)
                Region.attach(job)
            except gadei.ForeignOwner as err:
                os.write(write_end, str(err).encode())
                code = 0
            except BaseException as err:
                os.write(write_end, repr(err).encode())
            finally:
                os._exit(code)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            message = pipe.read().decode()
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, message
    assert "belongs to uid 0" in message and "you are uid 65534" in message


def test_a_learner_started_before_its_server_waits_for_it(job, procs):
    learner = procs.worker("push", job, "--steps", "5")
    read_line(learner, 60)  # it is about to attach, and there is no region yet
    assert inspect(job) is None
    server = procs.worker("serve", job)
    read_line(server, 60)
    assert "attached" in read_line(learner, 60)
    assert read_line(learner, 60)["pushed"] == 5
    server.send_signal(signal.SIGTERM)
    out, _ = finish(server)
    assert '"applied": 5' in out
    assert inspect(job) is None


def test_weights_uploaded_by_the_first_learner(job):
    model = Flat(1000, init=3.0)
    with gadei.Server(job, n_params=1000) as server:
        with gadei.Learner(model, job, timeout=10) as learner:
            assert learner.version == 0
            np.testing.assert_array_equal(server.weights(), np.full(1000, 3.0, dtype=np.float32))
            assert server.region.read_spec() == [("weight", (993,)), ("bias", (7,))]
        # another model of the same size now gets the uploaded weights, not its own
        other = Flat(1000, init=-1.0)
        with gadei.Learner(other, job, timeout=10):
            assert other.weight[0].item() == 3.0
