"""`gadei bench server`: what the server alone costs in CPU, against its kernel team's size.

One learner pushes dense float32 gradients at a fixed pace (one every `PACE` seconds, as a
learner whose step takes that long) to a `gadei serve` process started with `--threads T`,
for T = 1, 2, 4 and 8, whatever the cores: on a small machine the larger teams
over-subscribe it, which is the point. The bench reads the server process's CPU seconds
(/proc/PID/stat, all its threads) over the paced pushes and reports them per 1,000 applied
updates, beside what the same updates cost a single thread in this process (the kernel's
work, `kernel.sgd_thread_seconds`): whatever the server spends above that is waiting, spinning and
bookkeeping. A server whose idle threads sleep costs about the same at every team size; one
whose team spins between updates costs more with every thread, on any number of cores.
"""

import os
import random
import time

import torch

from ..protocol import wait_for
from .kernel import sgd_thread_seconds
from .timing import MB, median, process_cpu_s, process_threads, table

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
        work = sgd_thread_seconds(size) * 1000
        for team in TEAMS:
            mine = [r for r in runs if r["size_mb"] == size and r["threads"] == team]
            cpu = median([r["cpu_s"] / r["updates"] * 1000 for r in mine])
            records.append({"size_mb": size, "threads": team, "cpu_s_per_1000": cpu, "kernel_s_per_1000": work,
                            "cores": median([r["cpu_s"] / r["seconds"] for r in mine]),
                            "os_threads": max(r["os_threads"] for r in mine), "runs": mine})
    print(f"\nserver alone: CPU seconds of the `gadei serve` process per 1,000 applied updates, one learner pushing a "
          f"dense float32 gradient every {PACE * 1e3:g} ms, {updates} updates a run, median of {repeats} run(s) in "
          f"shuffled order; the kernel's work is the CPU the same updates take one thread of this process; "
          f"{os.cpu_count()} cores")
    print(table(("gradient", "kernel threads", "server CPU s / 1,000", "kernel's work", "above the work",
                 "server cores", "OS threads"),
                [(f"{r['size_mb']:g} MB", r["threads"], f"{r['cpu_s_per_1000']:.3f}", f"{r['kernel_s_per_1000']:.3f}",
                  f"{r['cpu_s_per_1000'] - r['kernel_s_per_1000']:+.3f}", f"{r['cores']:.2f}", r["os_threads"])
                 for r in records]))
    return {"pace_s": PACE, "updates": updates, "records": records}


def _paced_run(size_mb: float, team: int, updates: int) -> dict:
    from ..local import LocalJob
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
            for _ in range(20):  # warm up: the team exists, the pages are touched
                learner.step()
            _wait_applied(learner._producer)
            cpu0, start = process_cpu_s(pid), time.perf_counter()
            next_push = start
            for _ in range(updates):
                learner.step()
                next_push += PACE
                _sleep(max(0.0, next_push - time.perf_counter()))
            _wait_applied(learner._producer)
            seconds, cpu = time.perf_counter() - start, process_cpu_s(pid) - cpu0
            threads = process_threads(pid)
        local.stop()
    return {"updates": updates, "seconds": seconds, "cpu_s": cpu, "os_threads": threads}


def _wait_applied(producer, timeout: float = 60.0) -> None:
    """Until the server has taken every gradient `producer` published."""
    wait_for(lambda: producer.pending() <= 0, timeout, "the server to apply every gradient pushed",
             interval=0.0005, error=TimeoutError)
