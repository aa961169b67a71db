"""`gadei bench kernel`: the update kernels' GB/s against a plain C loop, `torch.Tensor.add_`
and PyTorch's fused CPU Adagrad and Adam, on the same buffers."""

import os
import time

import numpy as np
import torch

from ..transport.slot import Float32Dense
from .timing import MB, aligned, interleaved, median, table


def bench_kernel(args) -> dict:
    sizes = [1, 16, 64] if args.quick else [1, 4, 16, 32, 64, 128, 256]
    all_threads = os.cpu_count() or 1
    thread_counts = sorted({1, all_threads})
    lr = 0.01
    rows, records, adagrad_records, adam_records, check_records = [], [], [], [], []
    torch_threads = torch.get_num_threads()
    try:
        for size in sizes:
            n = size * MB // 4
            rng = np.random.default_rng(size)
            # page-aligned, as a region's weights and slots are (NumPy's own are 16 bytes off)
            w, g = aligned(n), aligned(n)
            w[:] = rng.standard_normal(n, dtype=np.float32)
            g[:] = rng.standard_normal(n, dtype=np.float32)
            tw, tg = torch.from_numpy(w), torch.from_numpy(g)
            wa, ga = w.ctypes.data, g.ctypes.data
            moved = 3 * n * 4  # read w, read g, write w
            for threads in thread_counts:
                dense = Float32Dense(n, threads)
                methods = {
                    "gadei": lambda: dense.sgd(wa, ga, lr, clear=False),
                    "plain_c": lambda: dense.plain_sgd(wa, ga, lr),
                    "torch_add_": lambda: tw.add_(tg, alpha=-lr),
                    # what the server runs per gradient: the read-only non-finite check, then the update
                    "checked": lambda: (dense.nonfinite(ga), dense.sgd(wa, ga, lr, clear=False)),
                }
                torch.set_num_threads(threads)
                seconds = interleaved(methods, rounds=10 * args.repeats, min_seconds=0.002 if args.quick else 0.01)
                checked = seconds.pop("checked")
                check_records.append({"size_mb": size, "threads": threads, "sgd_ms": seconds["gadei"] * 1e3,
                                      "checked_ms": checked * 1e3, "added": checked / seconds["gadei"] - 1})
                gbs = {name: moved / s / 1e9 for name, s in seconds.items()}
                record = {"size_mb": size, "threads": threads, "gb_per_s": gbs,
                          "vs_plain_c": gbs["gadei"] / gbs["plain_c"], "vs_torch": gbs["gadei"] / gbs["torch_add_"]}
                records.append(record)
                rows.append((f"{size} MB", threads, f"{gbs['gadei']:.1f}", f"{gbs['plain_c']:.1f}",
                             f"{gbs['torch_add_']:.1f}", f"{record['vs_plain_c']:.2f}x", f"{record['vs_torch']:.2f}x"))
            adagrad_records.extend(_bench_adagrad(w, g, size, thread_counts, args))
            adam_records.extend(_bench_adam(w, g, size, thread_counts, args))
    finally:
        torch.set_num_threads(torch_threads)
    print("\nkernel: w -= lr * g, GB/s counting 3 streams (read w, read g, write w); median of "
          f"{10 * args.repeats} interleaved samples")
    print(table(("size", "threads", "gadei", "plain C", "torch add_", "gadei/plain", "gadei/torch"), rows))
    print("\nkernel: Adagrad (s += g^2; w -= lr g / (sqrt(s) + eps)), GB/s counting 5 streams (read w, s, g; "
          f"write w, s), against torch.optim.Adagrad(fused=True).step(); median of {10 * args.repeats} interleaved "
          "samples")
    print(table(("size", "threads", "gadei", "torch fused", "gadei/torch"),
                 [(f"{r['size_mb']} MB", r["threads"], f"{r['gb_per_s']['gadei']:.1f}",
                   f"{r['gb_per_s']['torch_fused']:.1f}", f"{r['vs_torch']:.2f}x") for r in adagrad_records]))
    print("\nkernel: Adam (m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; w -= lr m_hat / (sqrt(v_hat) + eps)), "
          "GB/s counting 7 streams (read w, m, v, g; write w, m, v), against torch.optim.Adam(fused=True).step(); "
          f"median of {10 * args.repeats} interleaved samples")
    print(table(("size", "threads", "gadei", "torch fused", "gadei/torch"),
                 [(f"{r['size_mb']} MB", r["threads"], f"{r['gb_per_s']['gadei']:.1f}",
                   f"{r['gb_per_s']['torch_fused']:.1f}", f"{r['vs_torch']:.2f}x") for r in adam_records]))
    print("\nkernel: the server's non-finite check of a float32 gradient (one read-only pass) before w -= lr * g, "
          f"against the update alone; median of {10 * args.repeats} interleaved samples")
    print(table(("size", "threads", "update ms", "check + update ms", "added"),
                [(f"{r['size_mb']} MB", r["threads"], f"{r['sgd_ms']:.3f}", f"{r['checked_ms']:.3f}",
                  f"{r['added']:+.0%}") for r in check_records]))
    return {"rows": records, "adagrad": adagrad_records, "adam": adam_records, "nonfinite_check": check_records}


def _bench_adagrad(w: np.ndarray, g: np.ndarray, size: int, thread_counts, args) -> list[dict]:
    """The server's Adagrad kernel against PyTorch's fused CPU Adagrad on the same weights and
    gradient (each keeps its own sums, both start at zero). The gradient must be dense: the
    kernel skips zero elements, so a cleared one would time the skip."""
    from ..modes import ADAGRAD_EPS

    n, lr = w.size, 0.01
    s = aligned(n)
    s[:] = 0.0
    param = torch.nn.Parameter(torch.from_numpy(w), requires_grad=True)
    param.grad = torch.from_numpy(g)
    optimizer = torch.optim.Adagrad([param], lr=lr, eps=ADAGRAD_EPS, fused=True)
    wa, sa, ga = w.ctypes.data, s.ctypes.data, g.ctypes.data
    records = []
    for threads in thread_counts:
        dense = Float32Dense(n, threads)
        methods = {
            "gadei": lambda: dense.adagrad(wa, sa, ga, lr, ADAGRAD_EPS, clear=False),
            "torch_fused": optimizer.step,
        }
        torch.set_num_threads(threads)
        seconds = interleaved(methods, rounds=10 * args.repeats, min_seconds=0.002 if args.quick else 0.01)
        gbs = {name: 5 * n * 4 / sec / 1e9 for name, sec in seconds.items()}
        records.append({"size_mb": size, "threads": threads, "gb_per_s": gbs,
                        "vs_torch": gbs["gadei"] / gbs["torch_fused"]})
    return records


def _bench_adam(w: np.ndarray, g: np.ndarray, size: int, thread_counts, args) -> list[dict]:
    """The server's Adam kernel against PyTorch's fused CPU Adam on the same weights and
    gradient (each keeps its own moments, both start at zero; both take a step count that
    grows, as a job's version does)."""
    from ..modes import ADAM_BETA1, ADAM_BETA2, ADAM_EPS

    n, lr = w.size, 0.001
    m, v = aligned(n), aligned(n)
    m[:], v[:] = 0.0, 0.0
    param = torch.nn.Parameter(torch.from_numpy(w), requires_grad=True)
    param.grad = torch.from_numpy(g)
    optimizer = torch.optim.Adam([param], lr=lr, betas=(ADAM_BETA1, ADAM_BETA2), eps=ADAM_EPS, fused=True)
    wa, ma, va, ga = w.ctypes.data, m.ctypes.data, v.ctypes.data, g.ctypes.data
    step = [0]

    def gadei_step(dense: Float32Dense) -> None:
        step[0] += 1
        dense.adam(wa, ma, va, ga, lr, step[0], (ADAM_BETA1, ADAM_BETA2, ADAM_EPS), clear=False)

    records = []
    for threads in thread_counts:
        dense = Float32Dense(n, threads)
        methods = {"gadei": lambda: gadei_step(dense), "torch_fused": optimizer.step}
        torch.set_num_threads(threads)
        seconds = interleaved(methods, rounds=10 * args.repeats, min_seconds=0.002 if args.quick else 0.01)
        gbs = {name: 7 * n * 4 / sec / 1e9 for name, sec in seconds.items()}
        records.append({"size_mb": size, "threads": threads, "gb_per_s": gbs,
                        "vs_torch": gbs["gadei"] / gbs["torch_fused"]})
    return records


def sgd_thread_seconds(size_mb: float) -> float:
    """CPU seconds of one update of a `size_mb` float32 gradient on this thread (w -= lr g; the
    gradient kept, since a cleared one would be skipped line by line): the median of 5 samples
    of 0.02 s each, in this thread's CPU time, so that other processes' load does not count."""
    n = int(size_mb * MB) // 4
    w, g = aligned(n), aligned(n)
    w[:], g[:] = 0.0, np.float32(1e-6)
    dense = Float32Dense(n, 1)

    def sample() -> float:
        calls, start = 0, time.thread_time()
        while True:
            dense.sgd(w.ctypes.data, g.ctypes.data, 0.01, clear=False)
            calls += 1
            spent = time.thread_time() - start
            if spent >= 0.02 and calls >= 2:
                return spent / calls

    sample()  # pages touched
    return median([sample() for _ in range(5)])
