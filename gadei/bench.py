"""`gadei bench`: gadei measured side by side with its best alternative, in one run.

kernel   the update kernel's GB/s against a plain in-place C loop and `torch.Tensor.add_`
         on the same buffers, 1 MB to 256 MB, one thread and all threads; and the Adagrad
         kernel against PyTorch's fused CPU Adagrad.
latency  push-to-applied time of 1 MB and 16 MB gradients (a learner publishes, the server
         applies) against the time the copy and the update take on their own.
train    samples/s and test accuracy of the text CNN at mini-batch 1, 2 and 4: one learner
         + server against a plain single-process PyTorch loop, and two learners against
         PyTorch Hogwild with two processes (torch.multiprocessing, share_memory).
transport  bytes per step and samples/s of float32, bfloat16 and row-sparse gradients
         (text CNN, 20k x 128 embedding, one learner + server) at mini-batch 1, 2 and 4.
accuracy the test accuracy each of those transports reaches on TREC and SST-2 with two
         learners after the same epochs (mean and range over seeds).
modes    test accuracy and samples/s of async, sync and elastic with two learners on TREC
         after the same epochs.
bridge   the MPI bridge's exchange (time, GB/s, bytes on the wire) against one blocking
         MPI_Allreduce of the whole model, unbucketed, in buckets sized from the measured
         latency and per-byte cost, and each with float16 on the wire; models of --sizes MB,
         --ranks ranks started with mpiexec on this machine.
gpu      GPU learners (gadei.bench_gpu): per-step time of one GPU learner + server against a
         plain PyTorch GPU loop, samples/s and GPU busy fraction with 1-8 learners on one GPU,
         the transports' copy bandwidth against pinned copies; needs CUDA (--device).

Every figure is the median of `--repeats` runs, the methods interleaved within each run so
that the machine's noise falls on all of them alike; ratios are of the medians. The tables
are printed and everything is saved as JSON (`--out`).
"""

import json
import logging
import os
import platform
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from . import _native
from .env import settings

log = logging.getLogger(__name__)

MB = 1 << 20


def _median(values):
    return statistics.median(values) if values else float("nan")


def _interleaved(methods: dict, rounds: int, min_seconds: float) -> dict:
    """Median seconds per call of each method, timed in `rounds` rounds of shuffled order.

    Each sample is as many back-to-back calls as fill `min_seconds`; interleaving puts the
    machine's drifts (other tenants, frequency) on every method alike.
    """
    calls = {}
    for name, fn in methods.items():
        fn()  # warm up: page faults, OpenMP team start
        calls[name] = max(1, int(min_seconds / _time_it(fn, min_seconds)))
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
    return {name: _median(values) for name, values in samples.items()}


def _time_it(fn, min_seconds: float) -> float:
    """Seconds per call of `fn`, over as many calls as fill `min_seconds` (at least 2)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - start
        if calls >= 2 and elapsed >= min_seconds:
            return elapsed / calls


def _aligned(n: int) -> np.ndarray:
    """A float32 array of n elements starting on a 4096-byte boundary."""
    raw = np.empty(n + 1024, dtype=np.float32)
    skip = (-raw.ctypes.data % 4096) // 4
    return raw[skip : skip + n]


def _table(headers, rows) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


# ------------------------------------------------------------------ kernel


def bench_kernel(args) -> dict:
    sizes = [1, 16, 64] if args.quick else [1, 4, 16, 32, 64, 128, 256]
    all_threads = os.cpu_count() or 1
    thread_counts = sorted({1, all_threads})
    lr = 0.01
    rows, records, adagrad_records, check_records = [], [], [], []
    torch_threads = torch.get_num_threads()
    try:
        for size in sizes:
            n = size * MB // 4
            rng = np.random.default_rng(size)
            # page-aligned, as a region's weights and slots are (NumPy's own are 16 bytes off)
            w, g = _aligned(n), _aligned(n)
            w[:] = rng.standard_normal(n, dtype=np.float32)
            g[:] = rng.standard_normal(n, dtype=np.float32)
            tw, tg = torch.from_numpy(w), torch.from_numpy(g)
            wa, ga = w.ctypes.data, g.ctypes.data
            moved = 3 * n * 4  # read w, read g, write w
            for threads in thread_counts:
                methods = {
                    "gadei": lambda: _native.sgd(wa, ga, n, lr, 0, threads),
                    "plain_c": lambda: _native.plain_sgd(wa, ga, n, lr, threads),
                    "torch_add_": lambda: tw.add_(tg, alpha=-lr),
                    # what the server runs per gradient: the read-only non-finite check, then the update
                    "checked": lambda: (_native.nonfinite(ga, n, threads, 1), _native.sgd(wa, ga, n, lr, 0, threads)),
                }
                torch.set_num_threads(threads)
                seconds = _interleaved(methods, rounds=10 * args.repeats, min_seconds=0.002 if args.quick else 0.01)
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
    finally:
        torch.set_num_threads(torch_threads)
    print("\nkernel: w -= lr * g, GB/s counting 3 streams (read w, read g, write w); median of "
          f"{10 * args.repeats} interleaved samples")
    print(_table(("size", "threads", "gadei", "plain C", "torch add_", "gadei/plain", "gadei/torch"), rows))
    print("\nkernel: Adagrad (s += g^2; w -= lr g / (sqrt(s) + eps)), GB/s counting 5 streams (read w, s, g; "
          f"write w, s), against torch.optim.Adagrad(fused=True).step(); median of {10 * args.repeats} interleaved "
          "samples")
    print(_table(("size", "threads", "gadei", "torch fused", "gadei/torch"),
                 [(f"{r['size_mb']} MB", r["threads"], f"{r['gb_per_s']['gadei']:.1f}",
                   f"{r['gb_per_s']['torch_fused']:.1f}", f"{r['vs_torch']:.2f}x") for r in adagrad_records]))
    print("\nkernel: the server's non-finite check of a float32 gradient (one read-only pass) before w -= lr * g, "
          f"against the update alone; median of {10 * args.repeats} interleaved samples")
    print(_table(("size", "threads", "update ms", "check + update ms", "added"),
                 [(f"{r['size_mb']} MB", r["threads"], f"{r['sgd_ms']:.3f}", f"{r['checked_ms']:.3f}",
                   f"{r['added']:+.0%}") for r in check_records]))
    return {"rows": records, "adagrad": adagrad_records, "nonfinite_check": check_records}


def _bench_adagrad(w: np.ndarray, g: np.ndarray, size: int, thread_counts, args) -> list[dict]:
    """The server's Adagrad kernel against PyTorch's fused CPU Adagrad on the same weights and
    gradient (each keeps its own sums, both start at zero). The gradient must be dense: the
    kernel skips zero elements, so a cleared one would time the skip."""
    from .layout import DTYPE_CODES
    from .modes import ADAGRAD_EPS

    n, lr = w.size, 0.01
    s = _aligned(n)
    s[:] = 0.0
    param = torch.nn.Parameter(torch.from_numpy(w), requires_grad=True)
    param.grad = torch.from_numpy(g)
    optimizer = torch.optim.Adagrad([param], lr=lr, eps=ADAGRAD_EPS, fused=True)
    wa, sa, ga, f32 = w.ctypes.data, s.ctypes.data, g.ctypes.data, DTYPE_CODES["float32"]
    records = []
    for threads in thread_counts:
        methods = {
            "gadei": lambda: _native.adagrad(wa, sa, ga, n, lr, ADAGRAD_EPS, 0, threads, f32),
            "torch_fused": optimizer.step,
        }
        torch.set_num_threads(threads)
        seconds = _interleaved(methods, rounds=10 * args.repeats, min_seconds=0.002 if args.quick else 0.01)
        gbs = {name: 5 * n * 4 / sec / 1e9 for name, sec in seconds.items()}
        records.append({"size_mb": size, "threads": threads, "gb_per_s": gbs, "vs_torch": gbs["gadei"] / gbs["torch_fused"]})
    return records


# ------------------------------------------------------------------ latency


def bench_latency(args) -> dict:
    from .launch import LocalJob
    from .learner import Learner

    results = []
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
                    tail_addr = learner.entry.addr("tail")
                    for gap in (0.0, 0.005):
                        samples = []
                        for _ in range(pushes):
                            if gap:
                                _sleep(gap)
                            target = learner._producer.head + 1
                            start = time.perf_counter_ns()
                            learner.step()
                            while _native.load64(tail_addr) < target:
                                time.sleep(0)  # lets a push thread have the GIL
                            samples.append((time.perf_counter_ns() - start) / 1e3)
                        results.append({"size_mb": size, "push": push, "gap_ms": gap * 1e3,
                                        "median_us": _median(samples), "p90_us": float(np.percentile(samples, 90))})
            local.stop()
        # the copy and the update on their own, on private buffers of the same size
        src = np.ones(n, dtype=np.float32)
        w, g = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.float32)
        threads = settings().threads
        copy_s = _median([_time_it(lambda: _native.copy(g.ctypes.data, src.ctypes.data, n * 4, 1), 0.05)
                          for _ in range(args.repeats)])
        update_s = _median([_time_it(lambda: _native.sgd(w.ctypes.data, g.ctypes.data, n, 0.01, 1, threads), 0.05)
                            for _ in range(args.repeats)])
        for r in results:
            if r["size_mb"] == size:
                r["copy_plus_update_us"] = (copy_s + update_s) * 1e6
                r["ratio"] = r["median_us"] / r["copy_plus_update_us"]
    rows = [(f"{r['size_mb']} MB", r["push"], f"{r['gap_ms']:.0f} ms", f"{r['median_us']:.0f}", f"{r['p90_us']:.0f}",
             f"{r['copy_plus_update_us']:.0f}", f"{r['ratio']:.2f}x") for r in results]
    print(f"\nlatency: push (learner.step) to applied by the server, microseconds; {pushes} pushes each; "
          "a 5 ms gap between pushes lets the server fall asleep on its doorbell")
    print(_table(("gradient", "push", "gap", "median", "p90", "copy+update alone", "ratio"), rows))
    return {"rows": results}


def _sleep(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        time.sleep(max(0.0, end - time.perf_counter()) / 2)


class _Flat(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n))


# ------------------------------------------------------------------ train


def _default_data(args) -> str:
    if args.data:
        return args.data
    base = settings().data_dir or str(Path.cwd().parent / "shared" / "data")
    trec = Path(base) / "trec"
    return f"trec:{trec}" if (trec / "TREC.train").exists() else "generated"


def _bench_model(workload, train, seed: int, vocab: int):
    """The text CNN for `train`; with `vocab`, its embedding table has at least that many rows
    (rows no sample touches stay as initialised, so accuracy does not change)."""
    if not vocab:
        return workload.build_model(train, seed)
    from gadei_workloads import build_textcnn

    return build_textcnn(max(vocab, len(train.vocab)), train.n_labels, seed=seed)


def _train_worker(kind, rank, world, batch, epochs, seed, lr, data, vocab, job, shared, barrier, queue):
    """One training process of a `train` run: plain, hogwild or gadei."""
    torch.set_num_threads(1)
    from gadei_workloads import get
    from gadei_workloads.text import batches

    from .learner import Learner

    workload = get("textcnn")
    train, _ = workload.load_data(data)
    model = shared if shared is not None else _bench_model(workload, train, seed, vocab)
    model.train()
    learner = None
    if kind == "gadei":
        learner = Learner(model, job).attach()
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    barrier.wait()
    start, samples = time.time(), 0
    for epoch in range(epochs):
        for x, y in batches(train, batch, epoch=epoch, seed=seed, shard=rank, shards=world):
            if learner is None:
                optimizer.zero_grad(set_to_none=True)
            workload.backward(model, workload.loss(model, x, y), lr)
            if learner is None:
                optimizer.step()
            else:
                learner.step(samples=len(y))
            samples += len(y)
    end = time.time()
    if learner is not None:
        learner.close()
    state = None
    if kind == "plain":  # NumPy copies travel by value (torch tensors would by fd, gone when we exit)
        state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    queue.put((rank, start, end, samples, state))


def _server_worker(job, data, seed, vocab, world, lr, options, failed):
    """The server of a `gadei` run, through the Python API; stopped with `stop_job`."""
    torch.set_num_threads(1)
    from gadei_workloads import get

    from .server import Server

    try:
        workload = get("textcnn")
        train, _ = workload.load_data(data)
        server = Server(job, model=_bench_model(workload, train, seed, vocab), learners=world, lr=lr, **options)
    except Exception as err:
        failed.put(f"{type(err).__name__}: {err}")
        raise
    try:
        server.serve()
    finally:
        server.close()


def _start_server(ctx, job, data, seed, vocab, world, lr, options, timeout: float = 120.0):
    """Start `_server_worker` and wait until its region is up (or raise what it failed with)."""
    from .errors import GadeiTimeout, RegionNotFound
    from .region import Region

    failed = ctx.Queue()
    proc = ctx.Process(target=_server_worker, args=(job, data, seed, vocab, world, lr, options, failed))
    proc.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            Region.attach(job, readonly=True).close()
            return proc
        except (RegionNotFound, GadeiTimeout):
            pass
        if not proc.is_alive():
            reason = failed.get(timeout=1) if not failed.empty() else f"exit code {proc.exitcode}"
            raise RuntimeError(f"bench job {job!r}: the server did not start: {reason}")
        if time.monotonic() >= deadline:
            proc.kill()
            raise TimeoutError(f"bench job {job!r}: the server published no region within {timeout:g} s")
        time.sleep(0.02)


def _run_train(kind, world, batch, epochs, seed, lr, data, *, vocab: int = 0, options: dict | None = None) -> dict:
    """One timed training run; for `gadei`, `options` are the Server's mode and transport options.

    Returns samples/s, seconds and test accuracy; for `gadei` also the bytes the server read
    per gradient (`bytes_per_step`) and the final version.
    """
    import torch.multiprocessing as mp

    from gadei_workloads import get

    from . import params
    from .launch import stop_job
    from .region import Region, remove

    ctx = mp.get_context("spawn")
    workload = get("textcnn")
    train, test = workload.load_data(data)
    shared = None
    if kind == "hogwild":
        shared = _bench_model(workload, train, seed, vocab)
        shared.share_memory()
    job = f"bench-train-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    server = _start_server(ctx, job, data, seed, vocab, world, lr, options or {}) if kind == "gadei" else None
    procs = []
    extra = {}
    try:
        barrier, queue = ctx.Barrier(world), ctx.Queue()
        procs = [ctx.Process(target=_train_worker,
                             args=(kind, r, world, batch, epochs, seed, lr, data, vocab, job, shared, barrier, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join(60)
        if kind == "plain":
            model = _bench_model(workload, train, seed, vocab)
            model.load_state_dict({k: torch.from_numpy(v) for k, v in results[0][4].items()})
        elif kind == "hogwild":
            model = shared
        else:
            model = _bench_model(workload, train, seed, vocab)
            with Region.attach(job, readonly=True) as region:
                model.load_state_dict(params.state_dict(region.read_spec(), region.weights))
                h = region.header
                extra = {"bytes_per_step": h.get("applied_bytes") / max(1, h.get("applied")),
                         "version": h.get("version")}
            stop_job(job)
    finally:
        for p in procs + ([server] if server else []):
            p.join(30 if p is server else 0)
            if p.is_alive():
                p.kill()
                p.join()
                if p is server:
                    remove(job)  # a killed server leaves its region behind
    start = min(r[1] for r in results)
    end = max(r[2] for r in results)
    samples = sum(r[3] for r in results)
    return {"samples_per_s": samples / (end - start), "seconds": end - start,
            "test_accuracy": workload.evaluate(model, test), **extra}


def bench_train(args) -> dict:
    data = _default_data(args)
    batch_sizes = [2] if args.quick else [1, 2, 4]
    epochs = args.epochs
    seed, lr = 0, 0.01
    runs = [("plain", 1), ("gadei", 1), ("hogwild", 2), ("gadei", 2)]
    records, rows = [], []
    for batch in batch_sizes:
        figures = {f"{kind}-{world}": [] for kind, world in runs}
        for repeat in range(args.repeats):
            for kind, world in runs:
                result = _run_train(kind, world, batch, epochs, seed + repeat, lr, data)
                figures[f"{kind}-{world}"].append(result)
                log.info("train batch %d repeat %d %s-%d: %.0f samples/s, accuracy %.3f", batch, repeat, kind,
                         world, result["samples_per_s"], result["test_accuracy"])
        med = {name: {"samples_per_s": _median([r["samples_per_s"] for r in rs]),
                      "test_accuracy": _median([r["test_accuracy"] for r in rs]), "runs": rs}
               for name, rs in figures.items()}
        record = {"batch": batch, "epochs": epochs, "data": data, "methods": med,
                  "gadei1_vs_plain": med["gadei-1"]["samples_per_s"] / med["plain-1"]["samples_per_s"],
                  "gadei2_vs_hogwild2": med["gadei-2"]["samples_per_s"] / med["hogwild-2"]["samples_per_s"]}
        records.append(record)
        rows.append((batch,) + tuple(f"{med[n]['samples_per_s']:.0f} ({med[n]['test_accuracy']:.1%})"
                                     for n in ("plain-1", "gadei-1", "hogwild-2", "gadei-2"))
                    + (f"{record['gadei1_vs_plain']:.2f}x", f"{record['gadei2_vs_hogwild2']:.2f}x"))
    print(f"\ntrain: text CNN on {data}, {epochs} epoch(s), lr {lr}; samples/s (test accuracy), median of "
          f"{args.repeats} runs")
    print(_table(("batch", "plain 1", "gadei 1", "hogwild 2", "gadei 2", "gadei1/plain", "gadei2/hogwild2"), rows))
    return {"rows": records}


TRANSPORTS = {  # name -> the Server's transport options
    "float32": {},
    "bfloat16": {"grad_dtype": "bfloat16"},
    "row-sparse": {"row_sparse": True},
}
_VOCAB = 20000  # embedding rows of the transport benchmark's text CNN (embedding width 128)


def _shared_data(name: str) -> str | None:
    """The spec of shared data set `name` ('trec', 'sst2') if it is on disk, else None."""
    base = Path(settings().data_dir or Path.cwd().parent / "shared" / "data")
    marker = {"trec": "TREC.train", "sst2": "stsa.binary.train"}[name]
    return f"{name}:{base / name}" if (base / name / marker).exists() else None


def _accuracy_runs(data: str, variants: dict, args, label: str) -> dict:
    """Two learners, mini-batch 2, lr 0.05, `--accuracy-epochs` epochs, once per seed for each
    variant (Server options), interleaved; the mean, median and range of each one's test
    accuracy over the seeds (the mean: seeds move the accuracy by a point or two either way,
    and the median of a few such values jumps by as much), and its median samples/s."""
    epochs = 1 if args.quick else args.accuracy_epochs
    runs = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for name, options in variants.items():
            result = _run_train("gadei", 2, 2, epochs, repeat, 0.05, data, options=options)
            runs[name].append(result)
            log.info("%s %s seed %d: accuracy %.3f, %.0f samples/s", label, name, repeat, result["test_accuracy"],
                     result["samples_per_s"])
    return {name: {"test_accuracy": statistics.mean(r["test_accuracy"] for r in rs),
                   "median_accuracy": _median([r["test_accuracy"] for r in rs]),
                   "min_accuracy": min(r["test_accuracy"] for r in rs),
                   "max_accuracy": max(r["test_accuracy"] for r in rs),
                   "samples_per_s": _median([r["samples_per_s"] for r in rs]),
                   "epochs": epochs, "runs": rs} for name, rs in runs.items()}


def _accuracy_cell(m: dict, base: dict | None = None) -> str:
    """'mean (min-max)' of a variant's test accuracy, and its difference from `base` in points."""
    cell = f"{m['test_accuracy']:.1%} ({m['min_accuracy']:.1%}-{m['max_accuracy']:.1%})"
    if base is not None:
        cell += f" {100 * (m['test_accuracy'] - base['test_accuracy']):+.1f}"
    return cell


def bench_transport(args) -> dict:
    """Bytes per step and samples/s of each transport, one learner + server."""
    data = _default_data(args)
    batch_sizes = [2] if args.quick else [1, 2, 4]
    out = {"speed": []}
    rows = []
    for batch in batch_sizes:
        runs = {name: [] for name in TRANSPORTS}
        for repeat in range(args.repeats):
            for name, options in TRANSPORTS.items():
                result = _run_train("gadei", 1, batch, args.epochs, repeat, 0.01, data, vocab=_VOCAB, options=options)
                runs[name].append(result)
                log.info("transport batch %d %s: %.0f bytes/step, %.0f samples/s", batch, name,
                         result["bytes_per_step"], result["samples_per_s"])
        med = {name: {key: _median([r[key] for r in rs]) for key in ("bytes_per_step", "samples_per_s")}
               for name, rs in runs.items()}
        dense = med["float32"]
        out["speed"].append({"batch": batch, "methods": med, "runs": runs,
                             "fewer_bytes": {n: dense["bytes_per_step"] / m["bytes_per_step"] for n, m in med.items()}})
        rows.append((batch,) + tuple(f"{m['bytes_per_step'] / MB:.2f} MB ({dense['bytes_per_step'] / m['bytes_per_step']:.1f}x"
                                     f" fewer), {m['samples_per_s']:.0f}/s ({m['samples_per_s'] / dense['samples_per_s']:.2f}x)"
                                     for m in med.values()))
    print(f"\ntransport: text CNN, vocabulary {_VOCAB:,} x 128, one learner + server on {data}, {args.epochs} epoch(s), "
          f"lr 0.01; bytes per step (fewer than float32) and samples/s (ratio to float32), median of {args.repeats} runs")
    print(_table(("batch", *TRANSPORTS), rows))
    return out


def bench_accuracy(args) -> dict:
    """Test accuracy of each transport on TREC and SST-2 after the same epochs."""
    out, rows = {}, []
    for name in ("trec", "sst2"):
        spec = _shared_data(name)
        if spec is None or (args.quick and name != "trec"):
            print(f"\naccuracy: {name} skipped ({'quick run' if spec else 'not found under GADEI_DATA_DIR'})")
            continue
        med = _accuracy_runs(spec, TRANSPORTS, args, f"accuracy {name}")
        out[name] = med
        rows.append((name,) + tuple(_accuracy_cell(m, med["float32"]) for m in med.values()))
    if rows:
        epochs = 1 if args.quick else args.accuracy_epochs
        print(f"\naccuracy: text CNN, two learners, batch 2, lr 0.05, {epochs} epoch(s); test accuracy, mean "
              f"(min-max) of {args.repeats} seeds, and points from float32")
        print(_table(("data", *TRANSPORTS), rows))
    return out


MODES = {"async": {"mode": "async"}, "sync": {"mode": "sync"}, "elastic": {"mode": "elastic"}}


def bench_modes(args) -> dict:
    """Accuracy and samples/s of async, sync and elastic with two learners after the same epochs."""
    data = _shared_data("trec") if not args.data else args.data
    if data is None:
        data = _default_data(args)
    med = _accuracy_runs(data, MODES, args, "modes")
    epochs = 1 if args.quick else args.accuracy_epochs
    print(f"\nmodes: text CNN on {data}, two learners, batch 2, lr 0.05, {epochs} epoch(s), mode defaults "
          f"(elastic: alpha 0.1, tau 4); {args.repeats} seeds")
    print(_table(("mode", "test accuracy: mean (min-max)", "median", "samples/s", "updates"),
                 [(name, _accuracy_cell(m), f"{m['median_accuracy']:.1%}", f"{m['samples_per_s']:.0f}",
                   f"{_median([r['version'] for r in m['runs']]):,.0f}") for name, m in med.items()]))
    return med


# ------------------------------------------------------------------ bridge


def bench_bridge(args) -> dict:
    """The MPI bridge's exchange against one MPI_Allreduce of the whole model, under mpiexec.

    Starts `--ranks` ranks of `python -m gadei.bridge` on this machine; each size is one
    model of that many MB of float32.
    """
    import subprocess
    import sys

    from .bridge import local_mpiexec

    sizes = args.sizes or ("1,4" if args.quick else "1,16,64,256")
    argv, env = local_mpiexec(args.ranks, sys.executable, "-m", "gadei.bridge", sizes, str(args.repeats))
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"bench bridge: mpiexec exited {done.returncode}:\n{done.stderr[-3000:]}")
    result = json.loads(lines[0][len("BENCH "):])
    link = result["link"]
    print(f"\nbridge: {result['ranks']} ranks on this machine; link alpha {link['alpha'] * 1e6:.1f} us per message, "
          f"beta {link['beta'] * 1e9:.3f} ns per byte: auto buckets of {result['bucket_bytes'] / MB:.2f} MB "
          f"(median of {result['repeats']}, the slowest rank's)")
    print(_table(["model MB", "exchange", "ms", "GB/s", "wire MB/rank", "x MPI_Allreduce"],
                 [(f"{r['model_mb']:g}", r["variant"], f"{r['seconds'] * 1e3:.2f}", f"{r['bytes_per_s'] / 1e9:.2f}",
                   f"{r['wire_bytes'] / MB:.1f}", f"{r['vs_allreduce']:.2f}") for r in result["rows"]]))
    return result


def bench_gpu(args) -> dict:
    from .bench_gpu import bench_gpu as run

    return run(args)


BENCHES = {"kernel": bench_kernel, "latency": bench_latency, "train": bench_train, "transport": bench_transport,
           "accuracy": bench_accuracy, "modes": bench_modes, "bridge": bench_bridge, "gpu": bench_gpu}


def run_bench(args) -> int:
    unknown = [w for w in args.what if w not in BENCHES]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHES)}")
    built, processors = _native.openmp()
    out = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                       "torch": torch.__version__, "openmp": built, "kernel_threads_default": settings().threads},
           "repeats": args.repeats, "quick": args.quick, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for what in args.what:
        out[what] = BENCHES[what](args)
    Path(args.out).write_text(json.dumps(out, indent=2, default=float))
    print(f"\nsaved to {args.out}")
    return 0
