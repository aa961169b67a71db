"""`gadei bench train`, `transport`, `accuracy` and `modes`: the text CNN trained by gadei's
learners and server against a plain PyTorch loop and PyTorch Hogwild, and gadei's transports
and modes against each other."""

import logging
import os
import statistics
import time
from pathlib import Path

import torch

from ..env import settings
from .timing import MB, median, start_server, table

log = logging.getLogger(__name__)


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

    from ..learner import Learner

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
            workload.gradient(model, x, y, lr)
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

    from ..modes import RuleOptions
    from ..server import Server
    from ..transport.options import TransportOptions

    try:
        workload = get("textcnn")
        train, _ = workload.load_data(data)
        server = Server(job, model=_bench_model(workload, train, seed, vocab), learners=world,
                        rule_options=RuleOptions(lr=lr), transport=TransportOptions(**options))
    except Exception as err:
        failed.put(f"{type(err).__name__}: {err}")
        raise
    try:
        server.serve()
    finally:
        server.close()


def _start_server(job, data, seed, vocab, world, lr, options, timeout: float = 120.0):
    """Start `_server_worker` and wait until its region is up (or raise what it failed with)."""
    return start_server(job, _server_worker, (job, data, seed, vocab, world, lr, options), timeout)


def _run_train(kind, world, batch, epochs, seed, lr, data, *, vocab: int = 0, options: dict | None = None) -> dict:
    """One timed training run; for `gadei`, `options` are the Server's mode and transport options.

    Returns samples/s, seconds and test accuracy; for `gadei` also the bytes the server read
    per gradient (`bytes_per_step`) and the final version.
    """
    import torch.multiprocessing as mp

    from gadei_workloads import get

    from .. import params
    from ..launch import stop_job
    from ..region import Region, remove

    ctx = mp.get_context("spawn")
    workload = get("textcnn")
    train, test = workload.load_data(data)
    shared = None
    if kind == "hogwild":
        shared = _bench_model(workload, train, seed, vocab)
        shared.share_memory()
    job = f"bench-train-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    server = _start_server(job, data, seed, vocab, world, lr, options or {}) if kind == "gadei" else None
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
        med = {name: {"samples_per_s": median([r["samples_per_s"] for r in rs]),
                      "test_accuracy": median([r["test_accuracy"] for r in rs]), "runs": rs}
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
    print(table(("batch", "plain 1", "gadei 1", "hogwild 2", "gadei 2", "gadei1/plain", "gadei2/hogwild2"), rows))
    return {"rows": records}


TRANSPORTS = {  # name -> the Server's transport options
    "float32": {},
    "bfloat16": {"grad_dtype": "bfloat16"},
    "row-sparse": {"row_sparse": True},
}
_VOCAB = 20000  # embedding rows of the transport benchmark's text CNN (of the model's width)


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
                   "median_accuracy": median([r["test_accuracy"] for r in rs]),
                   "min_accuracy": min(r["test_accuracy"] for r in rs),
                   "max_accuracy": max(r["test_accuracy"] for r in rs),
                   "samples_per_s": median([r["samples_per_s"] for r in rs]),
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
        med = {name: {key: median([r[key] for r in rs]) for key in ("bytes_per_step", "samples_per_s")}
               for name, rs in runs.items()}
        dense = med["float32"]
        out["speed"].append({"batch": batch, "methods": med, "runs": runs,
                             "fewer_bytes": {n: dense["bytes_per_step"] / m["bytes_per_step"] for n, m in med.items()}})
        rows.append((batch,) + tuple(f"{m['bytes_per_step'] / MB:.2f} MB "
                                     f"({dense['bytes_per_step'] / m['bytes_per_step']:.1f}x fewer), "
                                     f"{m['samples_per_s']:.0f}/s ({m['samples_per_s'] / dense['samples_per_s']:.2f}x)"
                                     for m in med.values()))
    from gadei_workloads.textcnn import EMBED_DIM

    print(f"\ntransport: text CNN, vocabulary {_VOCAB:,} x {EMBED_DIM}, one learner + server on {data}, "
          f"{args.epochs} epoch(s), lr 0.01; bytes per step (fewer than float32) and samples/s (ratio to float32), "
          f"median of {args.repeats} runs")
    print(table(("batch", *TRANSPORTS), rows))
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
        print(table(("data", *TRANSPORTS), rows))
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
    print(table(("mode", "test accuracy: mean (min-max)", "median", "samples/s", "updates"),
                 [(name, _accuracy_cell(m), f"{m['median_accuracy']:.1%}", f"{m['samples_per_s']:.0f}",
                   f"{median([r['version'] for r in m['runs']]):,.0f}") for name, m in med.items()]))
    return med
