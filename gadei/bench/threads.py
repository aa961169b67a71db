"""`gadei bench threads`: when more PyTorch threads per learner pay, and when they do not.

One gadei learner + server (`gadei.bench.peers.run_peer`, the learner in its own process)
against the plain single-process PyTorch loop, the text CNN on the same data, epochs, seed and
lr, each process training with 1, 2 and 4 PyTorch intra-op threads (more on a larger machine,
up to the cores less one; 4 even on 2 cores, over-subscribing it on purpose: what a learner
given more threads than the machine has costs) at mini-batches 2 and 32 (`--batches`), with
the text CNN's 100 filters per width and with 400 (`--filters`: a model 4 times as large). For
each: samples/s and CPU milliseconds per sample (every process, the server's included), the
speed-up over one thread, and gadei's ratio to the plain loop at the same threads. A small
mini-batch's step splits poorly across threads (on 2 cores a second thread gave 1.1x at
batch 2, at 1.7x the CPU per sample); a large one's matrix products split well (1.4-1.6x at
batch 32), and so do a larger model's: that is where `[train] threads`
(`gadei.jobfile.auto_threads`) pays for the cores it takes. Each figure is the median of
`--repeats` runs, the runs of a repeat in shuffled order.
"""

import logging
import os

import psutil

from ..cgroup import memory_available
from ..jobfile import usable_cores
from .peers import QUICK_LIMIT, interleaved_runs, placement_of, run_peer
from .timing import median, table
from .train import _default_data

log = logging.getLogger(__name__)

THREADS = (1, 2, 4, 8, 16, 32)
BATCHES = (2, 32)
FILTERS = (100, 400)  # the text CNN's filters per convolution width: the workload's, and a model 4 times as large
OVERSUBSCRIBE = 4  # threads measured even where the machine has fewer cores
# float32 copies of the model a run holds at once, about: gadei's region (the weights and two
# ring slots) and its learner's model; the plain loop's weights and gradients
RUN_COPIES = 4
METHODS = ("plain", "gadei")
LABELS = {"plain": "plain PyTorch", "gadei": "gadei 1 learner"}


def thread_counts(cores: int) -> list[int]:
    """The threads measured on `cores` usable cores: 1, 2, 4 whatever the cores, and more up to
    the cores less one (the server's)."""
    return [t for t in THREADS if t <= max(OVERSUBSCRIBE, cores - 1)]


def model_sizes(data: str, filters: list[int]) -> dict[int, tuple[int, int]]:
    """The text CNN's (parameters, dense parameters) with each of `filters` filters per width,
    built on PyTorch's meta device (shapes without memory). Dense: all but the embedding table,
    whose gradient is sparse: what a step's convolutions and the server's dense update touch."""
    import torch
    from gadei_workloads import get

    from .peer_workers import model_for

    workload = get("textcnn")
    train, _ = workload.load_data(data)
    sizes = {}
    for f in filters:
        with torch.device("meta"):
            model = model_for(workload, train, 0, f)
        params = list(model.named_parameters())
        sizes[f] = (sum(p.numel() for _, p in params),
                    sum(p.numel() for name, p in params if not name.startswith("embedding.")))
    return sizes


def check_fits(sizes: dict[int, tuple[int, int]], available: int, where: str = "this machine has") -> None:
    """Refuse (ValueError) a filter count whose runs would hold more float32 copies of the
    model (RUN_COPIES) than `available` bytes of memory (what `where` has), before any run
    starts: a process that outgrows the machine is killed by the kernel, not told why."""
    for f, (params, _) in sizes.items():
        need = RUN_COPIES * 4 * params
        if need > available:
            raise ValueError(f"--filters {f:,}: the text CNN would have {params:,} parameters ({4 * params / 1e9:,.1f} "
                             f"GB of float32 weights), and a run holds about {RUN_COPIES} copies of them "
                             f"({need / 1e9:,.1f} GB), where {where} {available / 1e9:,.1f} GB available: "
                             "use fewer filters")


def memory_to_count_on() -> tuple[int, str]:
    """The bytes of memory a bench's runs can have, and whose figure it is: the machine's
    available memory, or less where this process's cgroup limits it (a container's memory
    limit, which the machine's figure knows nothing of)."""
    available, where = psutil.virtual_memory().available, "this machine has"
    limited = memory_available()
    if limited is not None and limited < available:
        available, where = limited, "this process's cgroup (a container's memory limit) has"
    return available, where


def bench_threads(args) -> dict:
    data = _default_data(args)
    batches = getattr(args, "batches", None) or list(BATCHES)
    filters = getattr(args, "filters", None) or list(FILTERS)
    cores = usable_cores()
    counts = thread_counts(cores)
    lr = 0.01
    keys = [(kind, threads, batch, f) for kind in METHODS for threads in counts for batch in batches for f in filters]
    sizes = model_sizes(data, filters)
    check_fits(sizes, *memory_to_count_on())

    def run(key: tuple[str, int, int, int], repeat: int) -> dict:
        kind, threads, batch, f = key
        # --quick: at least 20 steps of the larger batches, so that a step's time is measured
        limit = max(QUICK_LIMIT, 20 * batch) if args.quick else 0
        result = run_peer(kind, 1, batch, epochs=args.epochs, seed=repeat, lr=lr, data=data, limit=limit,
                          threads=threads, filters=f)
        log.info("repeat %d batch %d filters %d %s %d threads: %.0f samples/s, %.2f CPU ms/sample", repeat, batch,
                 f, kind, threads, result["samples_per_s"], 1e3 * result["cpu_s_per_sample"])
        return result

    runs = interleaved_runs(keys, args.repeats, run)
    dense = {f: 4 * sizes[f][1] / 1e6 for f in filters}  # MB
    records = []
    for f in filters:
        for batch in batches:
            med = {(kind, t): {k: median([r[k] for r in runs[(kind, t, batch, f)]])
                               for k in ("samples_per_s", "cpu_s_per_sample", "test_accuracy", "server_cpu_s")}
                   for kind in METHODS for t in counts}
            for t in counts:
                row = {"filters": f, "dense_mb": dense[f], "batch": batch, "threads": t}
                for kind in METHODS:
                    m = med[(kind, t)]
                    row[kind] = {**m, "speedup": m["samples_per_s"] / med[(kind, counts[0])]["samples_per_s"],
                                 "runs": runs[(kind, t, batch, f)]}
                row["gadei/plain"] = row["gadei"]["samples_per_s"] / row["plain"]["samples_per_s"]
                records.append(row)
    limit = f" (quick: about {QUICK_LIMIT} samples, or 20 mini-batches)" if args.quick else ""
    print(f"\nthreads: text CNN on {data}, 1 gadei learner + server against the plain PyTorch loop, each with 1 to "
          f"{counts[-1]} PyTorch threads, {args.epochs} epoch(s){limit}, lr {lr}, seeds 0..{args.repeats - 1}; medians "
          f"of {args.repeats} interleaved runs; {cores} usable cores (CPU ms/sample: every process, the server's "
          "included)")
    print(table(("filters (dense MB)", "batch", "threads", "plain samples/s", "CPU ms/sample", "x 1 thread",
                 "gadei samples/s", "CPU ms/sample", "x 1 thread", "gadei / plain"),
                [(f"{r['filters']} ({r['dense_mb']:.2f})", r["batch"],
                  r["threads"] if r["threads"] <= cores else f"{r['threads']} (> {cores} cores)",
                  f"{r['plain']['samples_per_s']:.0f}", f"{1e3 * r['plain']['cpu_s_per_sample']:.2f}",
                  f"{r['plain']['speedup']:.2f}x", f"{r['gadei']['samples_per_s']:.0f}",
                  f"{1e3 * r['gadei']['cpu_s_per_sample']:.2f}", f"{r['gadei']['speedup']:.2f}x",
                  f"{r['gadei/plain']:.2f}x") for r in records]))
    where = placement_of([r for rs in runs.values() for r in rs])
    if where:
        print(where)
    return {"data": data, "epochs": args.epochs, "lr": lr, "cores": cores, "cpus": os.cpu_count(), "threads": counts,
            "batches": batches, "filters": filters, "rows": records}
