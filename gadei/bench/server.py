"""`gadei bench server`: what the server alone costs in CPU, against its kernel team's size.

One learner pushes dense float32 gradients at a fixed pace (one every `PACE` seconds, as a
learner whose step takes that long) to a `gadei serve` process started with `--threads T`,
for T = 1, 2, 4 and 8, whatever the cores: on a small machine the larger teams
over-subscribe it, which is the point. The bench reads the server process's CPU seconds
(/proc/PID/stat, all its threads) over the paced pushes and reports them per 1,000 applied
updates, beside what the same updates cost a single thread in this process (the kernel's
work, `_native.sgd`): whatever the server spends above that is waiting, spinning and
bookkeeping. A server whose idle threads sleep costs about the same at every team size; one
whose team spins between updates costs more with every thread, on any number of cores.
"""

import os
import random
import time

import numpy as np
import torch

from .. import _native
from .timing import MB, aligned, median, table

TEAMS = (1, 2, 4, 8)
PACE = 0.002  # seconds between two pushes
SIZES_MB = (0.25, 4, 16)


def bench_server(args) -> dict:
    sizes = (4,) if args.quick else SIZES_MB
    updates = 200 if args.quick else 1000
    repeats = 1 if args.quick else max(1, args.repeats)
    torch.set_num_threads(1)
    runs = []
    for repeat in range(repeats):
        for size in sizes:
            teams = list(TEAMS)
            random.Random(repeat).shuffle(teams)  # the machine's drift falls on every team alike
            for team in teams:
                runs.append({"repeat": repeat, "size_mb": size, "threads": team,
                             **_paced_run(size, team, updates)})
    records = []
    for size in sizes:
        work = _kernel_seconds(size) * 1000
        for team in TEAMS:
            mine = [r for r in runs if r["size_mb"] == size and r["threads"] == team]
            cpu = median([r["cpu_s"] / r["updates"] * 1000 for r in mine])
            records.append({"size_mb": size, "threads": team, "cpu_s_per_1000": cpu, "kernel_s_per_1000": work,
                            "cores": median([r["cpu_s"] / r["seconds"] for r in mine]),
                            "os_threads": max(r["os_threads"] for r in mine), "runs": mine})
    print(f"\nserver alone: CPU seconds of the `gadei serve` process per 1,000 applied updates, one learner pushing a "
          f"dense float32 gradient every {PACE * 1e3:g} ms, {updates} updates a run, median of {repeats} run(s) in "
          f"shuffled order; the kernel's work is the CPU the same updates take one thread of this process; {os.cpu_count()} "
          "cores")
    print(table(("gradient", "kernel threads", "server CPU s / 1,000", "kernel's work", "above the work",
                 "server cores", "OS threads"),
                [(f"{r['size_mb']:g} MB", r["threads"], f"{r['cpu_s_per_1000']:.3f}", f"{r['kernel_s_per_1000']:.3f}",
                  f"{r['cpu_s_per_1000'] - r['kernel_s_per_1000']:+.3f}", f"{r['cores']:.2f}", r["os_threads"])
                 for r in records]))
    return {"pace_s": PACE, "updates": updates, "records": records}


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process `pid` has used so far."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_threads(pid: int) -> int:
    """The OS threads process `pid` has now."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(b"Threads:"):
                return int(line.split()[1])
    return 0


def _paced_run(size_mb: float, team: int, updates: int) -> dict:
    from ..launch import LocalJob
    from ..learner import Learner
    from .latency import _Flat, _sleep

    n = int(size_mb * MB) // 4
    job = f"bench-server-{os.getpid()}-{team}-{n}"
    with LocalJob(job, ["--params", str(n), "--learners", "1", "--threads", str(team)], []) as local:
        local.start_server()
        pid = local.server.pid
        model = _Flat(n)
        model.weight.grad = torch.full((n,), 1e-6)
        with Learner(model, job, push="publish", pull="view") as learner:
            tail = learner.entry.addr("tail")
            for _ in range(20):  # warm up: the team exists, the pages are touched
                learner.step()
            _wait_applied(tail, learner._producer.head)
            cpu0, start = process_cpu_s(pid), time.perf_counter()
            next_push = start
            for _ in range(updates):
                learner.step()
                next_push += PACE
                _sleep(max(0.0, next_push - time.perf_counter()))
            _wait_applied(tail, learner._producer.head)
            seconds, cpu = time.perf_counter() - start, process_cpu_s(pid) - cpu0
            threads = process_threads(pid)
        local.stop()
    return {"updates": updates, "seconds": seconds, "cpu_s": cpu, "os_threads": threads}


def _wait_applied(tail_addr: int, head: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while _native.load64(tail_addr) < head:
        if time.monotonic() > end:
            raise TimeoutError(f"the server applied no gradient for {timeout:g} s")
        time.sleep(0.0005)


def _kernel_seconds(size_mb: float) -> float:
    """CPU seconds of one update of a `size_mb` float32 gradient on this thread (w -= lr g; the
    gradient kept, since a cleared one would be skipped line by line): the median of 5 samples
    of 0.02 s each, in this thread's CPU time, so that other processes' load does not count."""
    n = int(size_mb * MB) // 4
    w, g = aligned(n), aligned(n)
    w[:], g[:] = 0.0, np.float32(1e-6)

    def sample() -> float:
        calls, start = 0, time.thread_time()
        while True:
            _native.sgd(w.ctypes.data, g.ctypes.data, n, 0.01, 0, 1)
            calls += 1
            spent = time.thread_time() - start
            if spent >= 0.02 and calls >= 2:
                return spent / calls

    sample()  # pages touched
    return median([sample() for _ in range(5)])
