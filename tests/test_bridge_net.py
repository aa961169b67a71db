"""The bridge across real links: three nodes, each in its own network namespace with its own
address (veth pairs on a Linux bridge, 198.18.0.0/15, the range set aside for network tests),
Open MPI over TCP between them, and one node's link cut or its bridge rank stalled mid-job.

How the ranks start is how they start on real machines: mpiexec (here in the root namespace,
on the bridge's address .254) launches one Open MPI daemon per host through its ssh agent;
the agent here is a script that runs the daemon inside the host's namespace (with its own
host name) instead of over ssh. Open MPI is pinned to the namespaces' subnet
(`btl tcp,self`, `btl_tcp_if_include`, `oob_tcp_if_include`), so the bridges' traffic goes
over the veths. The nodes' jobs (servers and a learner each) use shared memory only; they run
in the root namespace (a namespace changes nothing for them) and keep training throughout.

For each strategy, node 3 (rank 2) is then either cut off (`ip link set VETH down`) or its
bridge rank stopped (SIGSTOP) for longer than --timeout and continued, and the test checks
(and prints, with -s) what every rank reported and when: average and elastic end on every
rank with 'peer lost' within the timeout of the next exchange; gossip goes on between the
others and the cut rank drops its peer; every node's job goes on training; nothing hangs.

Skipped, with the reason, where `ip netns` does not work (not root, no iproute2); where it
works, failing to build the namespaces fails the test under CI=true.
"""

import fcntl
import os
import random
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from helpers import finish, json_lines, missing, read_line, tiered, wait_for
from gadei._proc import gadei_command
from gadei.bridge import MPIEXEC_OPTIONS, find_mpiexec
from gadei.region import Region, inspect, remove

HERE = Path(__file__).resolve().parent
WORKER = HERE / "bridge_worker.py"
NODES = 3
N = 100_003
TIMEOUT = 3.0  # the bridges' --timeout
EVERY = 0.1  # seconds between exchanges
NET_LOCK = "/tmp/gadei-test-net.lock"  # held while a test picks its subnet and takes it


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class Net:
    """NODES namespaces on one Linux bridge; removed by `remove` (also after a failure)."""

    def __init__(self):
        tag = uuid.uuid4().hex[:6]
        self.prefix = f"gd{tag}"  # interface names stay within 15 characters
        self.bridge = f"{self.prefix}br"
        self.namespaces = [f"{self.prefix}n{k}" for k in range(1, NODES + 1)]
        self.outer = [f"{self.prefix}v{k}" for k in range(1, NODES + 1)]  # the bridge's end of node k's veth
        self.subnet = ""
        self.hosts: list[str] = []

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        # 198.18.X.0/24 with an X no other network on this machine has (a test beside this one,
        # `pytest -n 2`, or another run of the suite): chosen and taken under one lock
        with open(NET_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken = set(re.findall(r"inet 198\.18\.(\d+)\.", _ip("-4", "-o", "addr", "show").stdout))
            index = random.choice([x for x in range(256) if str(x) not in taken])
            _ip("addr", "add", f"198.18.{index}.254/24", "dev", self.bridge)
        self.subnet = f"198.18.{index}.0/24"
        self.hosts = [f"198.18.{index}.{k}" for k in range(1, NODES + 1)]
        for ns, outer, host in zip(self.namespaces, self.outer, self.hosts):
            inner = f"{self.prefix}p{outer[-1]}"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{host}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def remove(self) -> None:
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
        for outer in self.outer:
            _ip("link", "del", outer, check=False)
        _ip("link", "del", self.bridge, check=False)

    def agent(self, folder: Path) -> Path:
        """Open MPI's ssh agent for these hosts: `agent HOST COMMAND...` runs COMMAND in HOST's
        namespace under the host name nodeK (a UTS namespace of its own)."""
        cases = "".join(f"  {host}) ns={ns}; name=node{k};;\n"
                        for k, (host, ns) in enumerate(zip(self.hosts, self.namespaces), 1))
        path = folder / "netns-agent"
        path.write_text("#!/bin/sh\nhost=$1; shift\ncase $host in\n" + cases +
                        "  *) echo \"netns-agent: unknown host $host\" >&2; exit 1;;\nesac\n"
                        "exec ip netns exec $ns unshare --uts sh -c \"hostname $name; $*\"\n")
        path.chmod(0o755)
        return path


@pytest.fixture
def net():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        pytest.skip("network namespaces need root, iproute2 (`ip`) and util-linux (`unshare`)")
    if _ip("netns", "list", check=False).returncode != 0:
        pytest.skip("`ip netns` does not work here")
    if find_mpiexec() is None:
        missing("no mpiexec (pip install 'gadei[mpi]')")
    made = Net()
    try:
        try:
            made.create()
        except subprocess.CalledProcessError as err:
            missing(f"cannot build the test network ({' '.join(err.cmd)}: {err.stderr.strip()})")
        yield made
    finally:
        made.remove()


class Ranks:
    """mpiexec of NODES bridge ranks over the namespaces; each rank's stdout and stderr go to
    files (a cut node's output could not reach mpiexec)."""

    def __init__(self, procs, net: Net, folder: Path, job: str, strategy: str):
        self.folder = folder
        redirect = 'exec "$@" > "$0/rank-$OMPI_COMM_WORLD_RANK.out" 2> "$0/rank-$OMPI_COMM_WORLD_RANK.err"'
        argv = [find_mpiexec(), *MPIEXEC_OPTIONS, "--prtemca", "plm_ssh_agent", str(net.agent(folder)),
                "--prtemca", "plm_ssh_no_tree_spawn", "1", "--host", ",".join(net.hosts),
                "--mca", "btl", "tcp,self", "--mca", "mpi_ft_enable", "1", "--mca", "btl_tcp_if_include", net.subnet,
                "--prtemca", "oob_tcp_if_include", net.subnet, "-n", str(NODES),
                "sh", "-c", redirect, str(folder),
                *gadei_command("bridge", job), "--job-per-rank", "--json", "--strategy", strategy,
                "--every", str(EVERY), "--timeout", str(TIMEOUT), "--bucket-mb", "0"]
        env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        self.proc = procs.spawn(argv, env)

    def events(self, rank: int, kind: str) -> list[dict]:
        path = self.folder / f"rank-{rank}.out"
        text = path.read_text() if path.exists() else ""
        return [e for e in json_lines(text) if e.get("event") == kind]

    def log(self, rank: int) -> str:
        path = self.folder / f"rank-{rank}.err"
        return path.read_text() if path.exists() else ""

    def logs(self) -> str:
        return "".join(f"--- rank {r}\n{self.log(r)[-2000:]}" for r in range(NODES)) + "--- mpiexec\n" + \
            "".join(self.proc.err_lines)[-2000:] + "--- mpiexec's processes\n" + self._tree()

    def _tree(self) -> str:
        """mpiexec's descendants (its daemons in the namespaces, the ranks), one a line: which
        of them a launch that never became ready left running."""
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return "(mpiexec has exited)\n"
        lines = []
        for child in tree:
            try:
                lines.append(f"{child.pid} {child.status()} {' '.join(child.cmdline())[:200]}")
            except psutil.NoSuchProcess:
                pass
        return "\n".join(lines) + "\n" if lines else "(none)\n"

    def wait(self, predicate, timeout: float, what: str):
        try:
            return wait_for(predicate, timeout, what, interval=0.05)
        except pytest.fail.Exception as failed:
            pytest.fail(f"{failed}\n{self.logs()}")

    def reap(self) -> None:
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for child in tree:
            try:
                child.send_signal(signal.SIGCONT)
                child.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)


def _version(job: str) -> int:
    with Region.attach(job, readonly=True) as region:
        return region.header.get("version")


@pytest.mark.parametrize("strategy, fault", tiered([(s, f) for s in ("average", "elastic", "gossip")
                                                     for f in ("cut", "stall")], default=[("average", "cut")],
                                                    soak=[("elastic", "stall"), ("gossip", "cut")]))
def test_a_cut_or_stalled_node_never_hangs_the_others(net, job, procs, tmp_path, strategy, fault):
    jobs = [f"{job}-{r}" for r in range(NODES)]
    server = procs.start(WORKER, "serve", *jobs, "--n", N)
    read_line(server, 120)
    ranks = None
    try:
        trainer = procs.start(WORKER, "train", *jobs, "--n", N, "--delay", 0.01)
        read_line(trainer, 120)
        ranks = Ranks(procs, net, tmp_path, job, strategy)
        ranks.wait(lambda: all(ranks.events(r, "ready") for r in range(NODES)), 120, "every bridge rank to be ready")
        ready = {r: ranks.events(r, "ready")[0] for r in range(NODES)}
        active = (0, 2) if strategy == "gossip" else range(NODES)
        ranks.wait(lambda: all(len(ranks.events(r, "exchange")) >= 3 for r in active), 120,
                   "three exchanges on every rank")
        versions = {job: _version(job) for job in jobs}
        began = time.monotonic()
        if fault == "cut":
            _ip("link", "set", net.outer[2], "down")
        else:
            os.kill(ready[2]["pid"], signal.SIGSTOP)
            wait_for(lambda: time.monotonic() - began >= TIMEOUT + 2, TIMEOUT + 5, "the stall")
            os.kill(ready[2]["pid"], signal.SIGCONT)
        ended_at: dict[int, float] = {}

        def look(ranks_: tuple) -> bool:
            for r in ranks_:
                if r not in ended_at and ranks.events(r, "ended"):
                    ended_at[r] = time.monotonic() - began
            return all(r in ended_at for r in ranks_)

        outcome = {}
        if strategy in ("average", "elastic"):
            # every rank, the cut one too, ends with 'peer lost' within the next exchange's timeout
            ranks.wait(lambda: look(tuple(range(NODES))), TIMEOUT * 2 + 30, "every rank to end its exchanges")
            for r in range(NODES):
                end = ranks.events(r, "ended")[0]
                assert end["reason"] == "peer lost", (r, end, ranks.logs())
                assert "goes on training on its own" in ranks.log(r)
                outcome[r] = f"peer lost after {ended_at[r]:.1f} s"
            survivors = (0, 1) if fault == "cut" else (0, 1, 2)
            assert max(ended_at[r] for r in survivors) <= (EVERY + TIMEOUT) + (TIMEOUT + 2 if fault == "stall" else 0) \
                + 10, ended_at  # the timeout, and the time to notice it on a busy machine
        else:
            # gossip: 0 and 1 go on pairing; rank 2 drops its peer (cut) or is dropped (stall)
            seen = len(ranks.events(0, "exchange"))
            ranks.wait(lambda: len(ranks.events(0, "exchange")) >= seen + 10, TIMEOUT * 2 + 30,
                       "rank 0 to go on exchanging with rank 1")
            if fault == "cut":
                ranks.wait(lambda: "stops pairing with rank 1" in ranks.log(2), TIMEOUT * 3 + 30,
                           "the cut rank to stop pairing")
                outcome[2] = f"stops pairing with rank 1 after {time.monotonic() - began:.1f} s"
            outcome[0] = f"{len(ranks.events(0, 'exchange')) - seen} exchanges since"
        for job in jobs:  # every node's job goes on training, the cut one's too
            wait_for(lambda: _version(job) > versions[job] + 10, 30, f"job {job} to go on training")
        # the end: stop the jobs, reconnect, and mpiexec must exit
        if fault == "cut":
            _ip("link", "set", net.outer[2], "up")
        stopped = time.monotonic()
        server.send_signal(signal.SIGTERM)
        read_line(server, 60)
        finish(server)
        finish(trainer)
        ranks.wait(lambda: look(tuple(range(NODES))), TIMEOUT * 3 + 30, "every rank to end")
        for r in range(NODES):
            end = ranks.events(r, "ended")[0]
            outcome.setdefault(r, "")
            outcome[r] += f" | ended: {end['reason']}, lost {end['lost']}, {end['exchanges']} exchanges"
        try:
            ranks.proc.wait(timeout=TIMEOUT * 3 + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"mpiexec did not exit after every rank ended\n{ranks.logs()}")
        print(f"\n{strategy} {fault}: mpiexec exited {ranks.proc.returncode} "
              f"{time.monotonic() - stopped:.1f} s after the jobs stopped")
        for r in range(NODES):
            print(f"  rank {r}: {outcome[r]}")
    finally:
        if ranks is not None:
            _ip("link", "set", net.outer[2], "up", check=False)
            ranks.reap()
        for name in jobs:
            if inspect(name) is not None:
                remove(name)

