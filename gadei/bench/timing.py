"""What every benchmark shares: medians of interleaved, repeated timings, page-aligned
buffers, plain-text tables, and how near the host placed the CPUs the runs shared."""

import os
import random
import statistics
import time

import numpy as np
import psutil

from .. import _proc
from ..region import cross_cpu_ns as _round_trip_ns

MB = 1 << 20


def median(values):
    return statistics.median(values) if values else float("nan")


def interleaved(methods: dict, rounds: int, min_seconds: float) -> dict:
    """Median seconds per call of each method, timed in `rounds` rounds of shuffled order.

    Each sample is as many back-to-back calls as fill `min_seconds`; interleaving puts the
    machine's drifts (other tenants, frequency) on every method alike.
    """
    calls = {}
    for name, fn in methods.items():
        fn()  # warm up: page faults, OpenMP team start
        calls[name] = max(1, int(min_seconds / time_it(fn, min_seconds)))
    samples = {name: [] for name in methods}
    order = list(methods)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            fn, k = methods[name], calls[name]
            start = time.perf_counter()
            for _ in range(k):
                fn()
            samples[name].append((time.perf_counter() - start) / k)
    return {name: median(values) for name, values in samples.items()}


def time_it(fn, min_seconds: float) -> float:
    """Seconds per call of `fn`, over as many calls as fill `min_seconds` (at least 2)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if calls >= 2 and elapsed >= min_seconds:
            return elapsed / calls


def cross_cpu_ns(rounds: int = 20_000, samples: int = 5) -> float | None:
    """How near the host placed the first two CPUs this process may run on: the median
    nanoseconds of a cache line's round trip between two threads pinned to them (`samples`
    times `rounds` round trips: 6-40 ms here). On a virtual machine it changes when the
    host moves the vCPUs (the 2-vCPU development machine: 60-90 ns near, 330-380 ns far,
    for seconds at a time), and so does what any data crossing between them costs: a
    gradient from a learner to the server, the weights between Hogwild's processes.
    None with fewer than two CPUs, or where the threads could not be pinned or were not run
    within seconds (a benchmark goes on without it)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    try:
        return median([_round_trip_ns(cpus[0], cpus[1], rounds, 5.0) for _ in range(samples)])
    except OSError:  # TimeoutError included
        return None


def placement(trips: list[float | None], taken: str = "before and after each run") -> str | None:
    """One line on how near the CPUs were around a benchmark's runs (`cross_cpu_ns`, `taken`
    when), and whether that changed while they ran; None where none was measured."""
    trips = [t for t in trips if t is not None]
    if not trips:
        return None
    low, high = min(trips), max(trips)
    line = (f"a cache line's round trip between the first two CPUs, {taken}: {low:.0f}-{high:.0f} ns "
            f"(median {median(trips):.0f})")
    if high > 2 * low:
        line += ("; it changed more than 2x: the host moved the CPUs during the runs, so they ran under different "
                 "placements (each run's is in the JSON: cross_cpu_ns)")
    return line


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process `pid` has used so far (psutil.Error
    when it is gone)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def process_threads(pid: int) -> int:
    """The OS threads process `pid` has now (psutil.Error when it is gone)."""
    return psutil.Process(pid).num_threads()


def aligned(n: int) -> np.ndarray:
    """A float32 array of n elements starting on a 4096-byte boundary."""
    raw = np.empty(n + 1024, dtype=np.float32)
    skip = (-raw.ctypes.data % 4096) // 4
    return raw[skip : skip + n]


def table(headers, rows) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def start_server(job: str, target, args: tuple, timeout: float = 120.0):
    """Start `target(*args, failed)` (a bench run's gadei server) in a process of its own and
    wait until job `job`'s region is up; raise what it failed with (a message on the `failed`
    queue, or its exit code), or TimeoutError after `timeout` seconds.

    The process is spawned (a new interpreter) with OMP_WAIT_POLICY=PASSIVE in the environment
    it starts with, unless the user set an OpenMP wait policy: its kernel's idle threads sleep,
    as `gadei serve`'s do (`env.quiet_openmp`). A fork server's child would have the fork
    server's OpenMP runtime, loaded with the learners' policy."""
    import torch.multiprocessing as mp

    from ..env import environ, openmp_policy_given
    from ..errors import GadeiTimeout, RegionNotFound
    from ..protocol import Deadline
    from ..region import Region

    ctx = mp.get_context("spawn")
    failed = ctx.Queue()
    oom_kills = _proc.oom_kills()
    proc = ctx.Process(target=target, args=(*args, failed))
    with environ({} if openmp_policy_given() else {"OMP_WAIT_POLICY": "PASSIVE"}):
        proc.start()
    deadline = Deadline(timeout)
    while True:
        try:
            Region.attach(job, readonly=True).close()
            return proc
        except (RegionNotFound, GadeiTimeout):
            pass
        if not proc.is_alive():
            reason = (failed.get(timeout=1) if not failed.empty()
                      else f"it {_proc.how_it_ended(proc.exitcode, oom_kills)}")
            raise RuntimeError(f"bench job {job!r}: the server did not start: {reason}")
        if deadline.expired():
            proc.kill()
            proc.join()
            raise TimeoutError(f"bench job {job!r}: the server published no region within {timeout:g} s")
        time.sleep(0.02)
