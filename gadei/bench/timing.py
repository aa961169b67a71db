"""What every benchmark shares: medians of interleaved, repeated timings, page-aligned
buffers, and plain-text tables."""

import random
import statistics
import time

import numpy as np


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


def aligned(n: int) -> np.ndarray:
    """A float32 array of n elements starting on a 4096-byte boundary."""
    raw = np.empty(n + 1024, dtype=np.float32)
    skip = (-raw.ctypes.data % 4096) // 4
    return raw[skip : skip + n]


def table(headers, rows) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def start_server(ctx, job: str, target, args: tuple, timeout: float = 120.0):
    """Start `target(*args, failed)` (a bench run's gadei server) in a process of `ctx` and wait
    until job `job`'s region is up; raise what it failed with (a message on the `failed` queue,
    or its exit code), or TimeoutError after `timeout` seconds."""
    from ..errors import GadeiTimeout, RegionNotFound
    from ..protocol import Deadline
    from ..region import Region

    failed = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, failed))
    proc.start()
    deadline = Deadline(timeout)
    while True:
        try:
            Region.attach(job, readonly=True).close()
            return proc
        except (RegionNotFound, GadeiTimeout):
            pass
        if not proc.is_alive():
            reason = failed.get(timeout=1) if not failed.empty() else f"exit code {proc.exitcode}"
            raise RuntimeError(f"bench job {job!r}: the server did not start: {reason}")
        if deadline.expired():
            proc.kill()
            proc.join()
            raise TimeoutError(f"bench job {job!r}: the server published no region within {timeout:g} s")
        time.sleep(0.02)
