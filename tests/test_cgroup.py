"""gadei counts on the limits of the cgroup it runs in, not only on the machine's: a container
run with `--cpus 1.5` (a CPU quota) and a memory limit, made here as a real cgroup of the
test's own (`helpers.cgroup`, cgroup v1 as root), with gadei's commands run inside it.

Before, a job in a container with a quota of 4 CPUs on a 16-core host planned its learners'
threads and the server's team for 16 cores (the CPUs it may run on), and a bench sized its
runs by the host's free memory, which a container's limit does not change."""

import json
import os
import sys

import psutil

from gadei._proc import gadei_command

from helpers import blobs_job, cgroup, communicate, data_dir, missing, unique_name, wait_for

MB = 1 << 20


def test_a_cpu_quota_is_the_cores_a_job_counts_on_and_gadei_run_says_so(procs, tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        missing("2 CPUs to run on (a quota of 1.5 must count for fewer cores than the affinity)")
    path = blobs_job(tmp_path, unique_name("quota"), train={"learners": 2})
    with cgroup(cpus=1.5) as inside:
        run = procs.spawn(inside(gadei_command("run", "--check", path)))
        out, err = communicate(run, 120)
        probe = procs.spawn(inside([sys.executable, "-c", "import json; from gadei import cgroup, env; "
                                    "print(json.dumps([cgroup.cpu_quota(), env.usable_cores()]))"]))
        said, _ = communicate(probe, 60)
    assert run.returncode == 0, out + err
    cores = len(os.sched_getaffinity(0))
    assert (f"2 x 1 PyTorch thread (auto: 1 core (the cgroup's CPU quota, 1.5 CPUs; the process may run on {cores}): "
            "one for the server, and one thread a learner at least)") in out, out
    assert json.loads(said) == [1.5, 1], said
    # outside it, the same check counts on every CPU it may run on
    outside = procs.gadei("run", "--check", path)
    out, err = communicate(outside, 120)
    assert outside.returncode == 0 and f"(auto: {cores} cores: one for the server" in out, out + err


def test_a_bench_sizes_its_runs_by_the_cgroups_memory_limit_not_the_machines(procs, tmp_path):
    """`gadei bench threads --filters 20000` needs about 1.2 GB: the machine has it, a cgroup of
    1 GB does not, and the bench refuses it there before any run (it was killed by the kernel's
    out-of-memory killer inside the cgroup, a traceback)."""
    from gadei.bench.threads import RUN_COPIES, model_sizes

    trec = data_dir() / "trec"
    if not (trec / "TREC.train").is_file():
        missing("TREC is not in the shared data")
    need = RUN_COPIES * 4 * model_sizes(f"trec:{trec}", [20000])[20000][0]
    assert 1024 * MB < need < psutil.virtual_memory().available, need  # the machine has it, the cgroup does not
    out = tmp_path / "bench.json"
    with cgroup(memory=1024 * MB) as inside:
        bench = procs.spawn(inside(gadei_command("bench", "threads", "--quick", "--repeats", "1",
                                                  "--filters", "100,20000", "--out", out)),
                            env={"GADEI_DATA_DIR": str(data_dir())})
        stdout, err = communicate(bench, 180)
        probe = procs.spawn(inside([sys.executable, "-c", "import json; from gadei import cgroup; "
                                    "print(json.dumps([cgroup.memory_limit(), cgroup.memory_available()]))"]))
        said, _ = communicate(probe, 60)
    assert bench.returncode == 2, stdout + err
    assert err.startswith("gadei: error: --filters 20,000: the text CNN would have ") and err.count("\n") == 1, err
    assert "where this process's cgroup (a container's memory limit) has " in err, err
    assert "samples/s" not in stdout and not out.exists()  # no run, no table, no figures
    limit, available = json.loads(said)
    assert limit == 1024 * MB and 0 < available < limit, said  # the probe's own interpreter uses some of it




def test_a_region_larger_than_the_cgroups_memory_is_refused_before_it_is_made(procs):
    """A region's pages (tmpfs) are charged to its server's cgroup: `gadei serve --params
    20000000` (a region of 1.4 GB) in a cgroup of 300 MB was killed by the out-of-memory killer
    while it reserved them, saying nothing, and left the region behind. Now it is refused in
    one line before the region is made, naming the sizes."""
    from gadei.region import inspect, remove

    job = unique_name("roomless")
    with cgroup(memory=300 * MB) as inside:
        serve = procs.spawn(inside(gadei_command("serve", job, "--params", 20_000_000, "--no-supervisor")))
        out, err = communicate(serve, 120)
    assert serve.returncode == 2, out + err
    assert err.startswith(f"gadei: error: job {job!r}: the region needs ") and err.count("\n") == 1, err
    assert "MB, where this process's cgroup (a container's memory limit) has " in err, err
    assert inspect(job) is None  # nothing left in /dev/shm

    # A refused replacement loses nothing: the region a killed server left stays, as it was
    # (it was removed before the size was checked), for a restart that fits or for `gadei clean`.
    small = procs.gadei("serve", job, "--params", 1000, "--no-supervisor")
    try:
        wait_for(lambda: getattr(inspect(job), "state", None) == "running", 60, "the small server to serve")
        small.kill()
        small.wait()
        with cgroup(memory=300 * MB) as inside:
            serve = procs.spawn(inside(gadei_command("serve", job, "--params", 20_000_000, "--no-supervisor",
                                                     "--replace")))
            out, err = communicate(serve, 120)
        assert serve.returncode == 2 and "the region needs " in err, out + err
        left = inspect(job)
        assert left is not None and left.state == "leftover" and left.server_pid == small.pid, left
    finally:
        remove(job)

def test_cgroup_v2_limits_are_read_along_the_path_to_the_mounts_root(tmp_path, monkeypatch):
    """cgroup v2 as a container on a systemd host or under Kubernetes sees it (this machine's CI
    has v1, whose real cgroups the tests above make): the limits are files of a folder tree,
    here written as such a tree shows them, the nearest limit of each kind the smallest."""
    from gadei import cgroup

    mount = tmp_path / "sys fs cgroup"  # a space, as mountinfo escapes it (\\040)
    own = mount / "kubepods" / "pod-1" / "ctr"
    own.mkdir(parents=True)
    files = {"cgroup.controllers": "cpuset cpu io memory pids",
             "kubepods/memory.max": str(1 << 30), "kubepods/memory.current": str(600 * MB),
             "kubepods/memory.stat": f"anon {400 * MB}\nfile {200 * MB}\ninactive_file {100 * MB}\n",
             "kubepods/cpu.max": "max 100000",
             "kubepods/pod-1/cpu.max": "400000 100000",
             "kubepods/pod-1/ctr/cpu.max": "250000 100000", "kubepods/pod-1/ctr/memory.max": "max",
             "kubepods/pod-1/ctr/memory.current": str(300 * MB)}
    for name, text in files.items():
        (mount / name).write_text(text + "\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/kubepods/pod-1/ctr\n")
    escaped = str(mount).replace(" ", "\\040")
    (proc / "mountinfo").write_text(f"22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
                                    f"30 22 0:26 / {escaped} rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n")
    monkeypatch.setattr(cgroup, "_PROC", proc)
    assert cgroup.folders("memory") == [own, own.parent, own.parent.parent, mount]
    assert cgroup.cpu_quota() == 2.5 and cgroup.quota_cores() == 2  # the container's own, below its pod's 4
    assert cgroup.memory_limit() == 1 << 30  # the pod's parent's: the container has none of its own
    assert cgroup.memory_available() == (1 << 30) - 600 * MB + 100 * MB  # inactive page cache counts as free
    # a container's own namespace: its cgroup is the mount's root
    (proc / "cgroup").write_text("0::/\n")
    (proc / "mountinfo").write_text(f"30 22 0:26 / {escaped} rw - cgroup2 cgroup2 rw\n")
    assert cgroup.folders("cpu") == [mount] and cgroup.cpu_quota() is None and cgroup.memory_limit() is None
    # no cgroup mounted (or not Linux): no limits
    (proc / "mountinfo").write_text("22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n")
    assert cgroup.folders("memory") == [] and cgroup.memory_available() is None and cgroup.quota_cores() is None
