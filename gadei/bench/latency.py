"""`gadei bench latency`: push-to-applied time of a gradient against the copy and the update
alone."""

import os
import time

import numpy as np
import torch

from ..env import settings
from ..transport.slot import Float32Dense
from .timing import MB, cross_cpu_ns, median, placement, table, time_it


GAP = 0.005  # seconds of the idle pause between pushes (the server dozes, then sleeps on its doorbell)


def bench_latency(args) -> dict:
    from ..local import LocalJob
    from ..learner import Learner

    results = []
    trips = [cross_cpu_ns()]  # how near the CPUs were: a push crosses from the learner's to the server's
    pushes = 50 if args.quick else 300
    torch.set_num_threads(1)  # this learner computes nothing: leave the server its core
    for size in (1, 16):
        n = size * MB // 4
        job = f"bench-latency-{os.getpid()}-{size}"
        with LocalJob(job, ["--params", str(n), "--learners", "1"], []) as local:
            local.start_server()
            for push in ("publish", "thread"):
                model = _Flat(n)
                # pull=view: no pull thread, so the figure is the push path alone
                with Learner(model, job, push=push, pull="view") as learner:
                    for gap in (0.0, GAP):
                        samples = []
                        for _ in range(pushes):
                            if gap:
                                _sleep(gap)
                            target = learner._producer.head + 1
                            start = time.perf_counter_ns()
                            learner.step()
                            while learner._producer.tail() < target:
                                time.sleep(0)  # lets a push thread have the GIL
                            samples.append((time.perf_counter_ns() - start) / 1e3)
                        results.append({"size_mb": size, "push": push, "gap_ms": gap * 1e3,
                                        "median_us": median(samples), "p90_us": float(np.percentile(samples, 90))})
            local.stop()
        trips.append(cross_cpu_ns())
        # the copy and the update on their own, on private buffers of the same size
        src = np.ones(n, dtype=np.float32)
        w, g = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.float32)
        dense = Float32Dense(n, settings().threads)  # the server's kernels; a copy takes one thread
        copy_s = median([time_it(lambda: dense.copy(g.ctypes.data, src.ctypes.data), 0.05)
                         for _ in range(args.repeats)])
        update_s = median([time_it(lambda: dense.sgd(w.ctypes.data, g.ctypes.data, 0.01), 0.05)
                           for _ in range(args.repeats)])
        paused_us = _after_pause(lambda: (dense.copy(g.ctypes.data, src.ctypes.data),
                                          dense.sgd(w.ctypes.data, g.ctypes.data, 0.01)),
                                 GAP, 20 if args.quick else 100)
        for r in results:
            if r["size_mb"] == size:
                r["copy_plus_update_us"] = (copy_s + update_s) * 1e6
                r["ratio"] = r["median_us"] / r["copy_plus_update_us"]
                if r["gap_ms"]:  # the same work after the same pause, in one process: what the pause costs any code
                    r["copy_plus_update_after_pause_us"] = paused_us
                    r["ratio_to_paused"] = r["median_us"] / paused_us
    rows = [(f"{r['size_mb']} MB", r["push"], f"{r['gap_ms']:.0f} ms", f"{r['median_us']:.0f}", f"{r['p90_us']:.0f}",
             f"{r['copy_plus_update_us']:.0f}", f"{r['ratio']:.2f}x") for r in results]
    print(f"\nlatency: push (learner.step) to applied by the server, microseconds; {pushes} pushes each; "
          "a 5 ms gap between pushes lets the server fall asleep on its doorbell")
    print(table(("gradient", "push", "gap", "median", "p90", "copy+update alone", "ratio"), rows))
    wake = wake_up(results)
    for w in wake:
        print(f"after a {w['gap_ms']:.0f} ms idle pause a {w['size_mb']} MB {w['push']} push is applied in "
              f"{w['ratio']:.2f}x the copy and update alone (target: within 2x), {w['ratio_to_paused']:.2f}x the "
              f"copy and update alone after the same pause; the pause added {w['wake_us']:.0f} us to the "
              f"push-to-applied of gap 0, {w['pause_us']:.0f} us to the copy and update alone")
    where = placement(trips, "before, between and after the sizes")
    if where:
        print(where)
    return {"rows": results, "wake_up": wake, "cross_cpu_ns": trips}


def wake_up(results: list[dict]) -> list[dict]:
    """For each size and push: the push-to-applied after an idle pause against the copy and update
    alone, and what the pause added to it (the idle server's wake-up)."""
    out = []
    for r in results:
        if r["gap_ms"]:
            busy = next(b for b in results
                        if b["size_mb"] == r["size_mb"] and b["push"] == r["push"] and not b["gap_ms"])
            out.append({"size_mb": r["size_mb"], "push": r["push"], "gap_ms": r["gap_ms"], "ratio": r["ratio"],
                        "wake_us": r["median_us"] - busy["median_us"], "ratio_to_paused": r["ratio_to_paused"],
                        "pause_us": r["copy_plus_update_after_pause_us"] - r["copy_plus_update_us"]})
    return out


def _after_pause(work, gap: float, times: int) -> float:
    """Median microseconds of `work()` run right after an idle pause of `gap` seconds: the
    pause's own cost to any code (a halted vCPU waking, caches gone cold), without gadei."""
    samples = []
    for _ in range(times):
        _sleep(gap)
        start = time.perf_counter_ns()
        work()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return median(samples)


def _sleep(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        time.sleep(max(0.0, end - time.perf_counter()) / 2)


class _Flat(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n))
