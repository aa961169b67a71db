"""`gadei bench peers`: gadei against what a PyTorch user would pick instead to train small
mini-batches on one machine, the same model (the text CNN), data, epochs, seed and lr for all:
one plain PyTorch process, Hogwild, DistributedDataParallel over gloo, and PyTorch's RPC
parameter server (see `gadei.bench.peer_workers` for how each is written).

DDP and the RPC parameter server average N gradients per update, so after the same epochs
they made 1/N of the updates the asynchronous ones made; `ddp-lr` is DDP with lr x N, the
usual linear scaling, which reaches the others' accuracy (the fair comparison at equal
accuracy). Each figure is the median of `--repeats` runs; in every repeat the methods run
in a shuffled order, so that the machine's noise falls on all of them alike. Before and
after each run the bench measures how near the host placed the CPUs (`timing.cross_cpu_ns`):
on a virtual machine that changes for seconds at a time, and with it what data crossing
between the CPUs costs; each table says so under it.
"""

import logging
import os
import random
import socket
import time

import torch

from .. import _proc
from .figure import plot_path, pyplot, save
from .timing import cross_cpu_ns, median, placement, start_server, table
from .train import _default_data

log = logging.getLogger(__name__)

LABELS = {"plain": "plain PyTorch", "gadei": "gadei", "hogwild": "Hogwild", "ddp": "DDP gloo",
          "ddp-lr": "DDP gloo, lr x N", "rpc": "RPC parameter server"}
PEERS = ("plain", "hogwild", "ddp", "ddp-lr", "rpc")
BATCHES = (1, 2, 4, 32)
SCALING_LEARNERS = (1, 2, 3, 4)
QUICK_LIMIT = 320  # samples a --quick run trains on (all processes together)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_peer(kind: str, world: int, batch: int, *, epochs: int, seed: int, lr: float, data: str, limit: int = 0,
             options: dict | None = None, timeout: float = 3600.0, threads: int = 1,
             filters: int | None = None, workload: str = "textcnn") -> dict:
    """One timed training run of `kind` with `world` learners (processes, trainers).

    Returns samples/s, seconds, samples, test accuracy (of the trained model, whose size is
    `parameters`), CPU seconds of every process over
    its training loop (`cpu_s`, the server's or parameter server's part in `server_cpu_s`),
    CPU seconds per sample, the PyTorch threads the training processes reported
    (`torch_threads`, each value once), and `processes`: each process's role, rank (None for a
    server), pid, CPU seconds and OS threads at the end of its loop, servers first.
    `limit`: stop after about this many samples (smoke runs). `options`: the gadei Server's
    options. `threads`: the PyTorch threads of the plain process, of each Hogwild process and
    of each gadei learner (the others keep one). `filters`: the text CNN's filters per
    convolution width, for the plain loop, Hogwild and gadei (None: the workload's, 100).
    `workload`: what is trained (the text CNN; "ngram": the n-gram workload, by the plain loop,
    Hogwild and gadei only).
    """
    from gadei_workloads import get

    from . import peer_workers as w

    if filters is not None and kind not in ("plain", "hogwild", "gadei"):
        raise ValueError(f"{kind}: only the plain loop, Hogwild and gadei take a model size (filters)")
    if workload != "textcnn" and kind not in ("plain", "hogwild", "gadei"):
        raise ValueError(f"{kind}: only the plain loop, Hogwild and gadei train the {workload} workload")
    name = workload
    ctx = _context()
    workload = get(name)
    train, test = workload.load_data(data)
    queue = ctx.Queue()
    lr_used = lr * world if kind == "ddp-lr" else lr
    procs, server, shared, job = [], None, None, None
    expected = world
    oom_kills = _proc.oom_kills()
    try:
        if kind in ("plain", "hogwild"):
            if kind == "hogwild":
                shared = w.model_for(workload, train, seed, filters)
                shared.share_memory()
            barrier = ctx.Barrier(world)
            procs = [ctx.Process(target=w.local_worker,
                                 args=(kind, r, world, batch, epochs, seed, lr, data, limit, shared, barrier, queue),
                                 kwargs={"threads": threads, "filters": filters, "workload": name})
                     for r in range(world)]
        elif kind == "gadei":
            job = f"bench-peers-{os.getpid()}-{time.monotonic_ns() % 10**9}"
            server = _start_server(job, (data, seed, world, lr, options or {}, filters, name), queue)
            barrier = ctx.Barrier(world)
            procs = [ctx.Process(target=w.gadei_learner,
                                 args=(r, world, batch, epochs, seed, lr, data, limit, job, barrier, queue),
                                 kwargs={"threads": threads, "filters": filters, "workload": name})
                     for r in range(world)]
        elif kind in ("ddp", "ddp-lr"):
            port = free_port()
            procs = [ctx.Process(target=w.ddp_worker, args=(r, world, batch, epochs, seed, lr_used, data, limit, port,
                                                            queue)) for r in range(world)]
        elif kind == "rpc":
            port = free_port()
            procs = [ctx.Process(target=w.rpc_worker,
                                 args=(r, world, batch, epochs, seed, lr, data, limit, port, queue))
                     for r in range(world + 1)]
            expected = world + 2  # the trainers', the server's CPU and the final model
        else:
            raise ValueError(f"unknown method {kind!r}; choose from gadei, {', '.join(PEERS)}")
        for p in procs:
            p.start()
        results = _collect(queue, procs + ([server] if server else []), expected, timeout, f"{kind} {world}",
                           oom_kills)
        state = next((r["state"] for r in results if r.get("state") is not None), None)
        if kind == "hogwild":
            model = shared
        else:
            model = w.model_for(workload, train, seed, filters)
            if kind == "gadei":
                model.load_state_dict(_gadei_weights(job))
            else:
                model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        if kind == "gadei":
            from ..launch import stop_job

            stop_job(job)
            results += _collect(queue, [server], 1, 60, "gadei server", oom_kills)
    finally:
        _reap(procs, server, job)
    trained = [r for r in results if r["rank"] >= 0 and r.get("start") is not None]
    start, end = min(r["start"] for r in trained), max(r["end"] for r in trained)
    samples = sum(r["samples"] for r in trained)
    cpu = sum(r["cpu"] for r in results if "cpu" in r)
    server_cpu = sum(r["cpu"] for r in results if r["rank"] == -1)
    reports = sorted((r for r in results if "role" in r), key=lambda r: r["rank"])  # a server's rank is -1: first
    processes = [{"role": r["role"], "rank": None if r["rank"] == -1 else r["rank"], "pid": r["pid"], "cpu_s": r["cpu"],
                  "threads": r["threads"]} for r in reports]
    return {"method": kind, "learners": world, "batch": batch, "lr": lr_used, "samples": samples,
            "seconds": end - start, "samples_per_s": samples / (end - start),
            "test_accuracy": workload.evaluate(model, test),
            "parameters": sum(p.numel() for p in model.parameters()),
            "cpu_s": cpu, "server_cpu_s": server_cpu, "cpu_s_per_sample": cpu / samples,
            "torch_threads": sorted({r["torch_threads"] for r in trained}), "processes": processes}


def _context():
    """Fresh processes from a fork server that imported torch and the workloads once (a run's
    start then takes a fork, not seconds of imports per process; nothing of this process's
    threads or OpenMP state is inherited, unlike a plain fork). Its OpenMP runtime has
    OpenMP's defaults, as a learner's: gadei's servers are spawned (`_start_server`)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "gadei_workloads.registry", "gadei.bench.peer_workers", "gadei.learner"])
    return ctx


def _start_server(job: str, args: tuple, queue, timeout: float = 120.0):
    """Start the gadei server of a run and wait until its region is up (or raise what it failed
    with). Spawned, not from the learners' fork server (`timing.start_server`): its kernel's
    idle threads sleep, as `gadei serve`'s do, while the learners keep OpenMP's defaults."""
    from .peer_workers import gadei_server

    return start_server(job, gadei_server, (job, *args, queue), timeout)


def _gadei_weights(job: str) -> dict:
    from .. import params
    from ..region import Region

    with Region.attach(job, readonly=True) as region:
        return params.state_dict(region.read_spec(), region.weights)


class PeerCrashed(RuntimeError):
    """A process of a run was killed by a signal (a crash in the peer's own code, such as the
    heap corruption torch's gloo sparse allreduce causes in some DDP runs at small batches)."""


PEER_RETRIES = 3  # a peer's run that crashed is run again (its crashes counted) at most this many times


def _collect(queue, procs, n: int, timeout: float, what: str, oom_kills: int | None = None) -> list[dict]:
    """`n` reports from `queue`; raises if a process died first (PeerCrashed: by a signal; how,
    with `_proc.oom_kills()` as read when the run started) or `timeout` passed."""
    import queue as queues

    from ..protocol import Deadline

    got, deadline = [], Deadline(timeout)
    while len(got) < n:
        try:
            got.append(queue.get(timeout=1.0))
            continue
        except queues.Empty:
            pass
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead:
            # the others of a run whose process crashed fail too (gloo: "connection reset by
            # peer"), often before the crashed one is gone (it may still be writing its core):
            # give them a moment, and name the crash where there is one
            settle = Deadline(min(5.0, deadline.left()))  # one moment for them all, not one each
            for p in procs:
                p.join(timeout=settle.left())
            dead = sorted((p for p in procs if p.exitcode not in (None, 0)), key=lambda p: p.exitcode >= 0)
            error = PeerCrashed if dead[0].exitcode < 0 else RuntimeError
            raise error(f"bench {what}: process {dead[0].pid} {_proc.how_it_ended(dead[0].exitcode, oom_kills)}")
        if deadline.expired():
            raise TimeoutError(f"bench {what}: {len(got)} of {n} reports after {timeout:g} s")
    return got


def _reap(procs, server, job) -> None:
    from ..region import remove

    for p in procs + ([server] if server else []):
        if p.pid is None:  # never started (a start before it failed): nothing to reap, and join would raise
            continue
        p.join(30 if p is server else 10)
        if p.is_alive():
            p.kill()
            p.join()
            if p is server:
                remove(job)  # a killed server leaves its region behind


def scaling_methods(quick: bool) -> list[tuple[str, int]]:
    """The runs of `gadei bench scaling`: the plain loop, and gadei and Hogwild with 1 to 4 learners."""
    learners = (1, 2) if quick else SCALING_LEARNERS
    return [("plain", 1)] + [(kind, n) for kind in ("gadei", "hogwild") for n in learners]


def workload_of(args) -> str:
    """The workload the command's peers train (--workload; the text CNN without it)."""
    return getattr(args, "workload", None) or "textcnn"


def lr_for(workload: str) -> float:
    """The learning rate every method of a peers run trains `workload` with (plain SGD for all):
    the text CNN's 0.01, or the workload's own default (the n-gram workload's 0.2)."""
    from gadei_workloads import get

    return 0.01 if workload == "textcnn" else get(workload).lr or 0.01


def model_name(workload: str) -> str:
    """The workload's model, for the tables' titles."""
    return {"textcnn": "text CNN", "ngram": "n-gram model (sparse EmbeddingBag)"}.get(workload, workload)


def methods(quick: bool, workload: str = "textcnn") -> list[tuple[str, int]]:
    """The runs of `gadei bench peers`; for another workload than the text CNN, the plain loop,
    gadei and Hogwild only (DDP and the RPC server are the text CNN's)."""
    if workload != "textcnn":
        return [m for m in methods(quick) if m[0] in ("plain", "gadei", "hogwild")]
    if quick:
        return [("plain", 1), ("gadei", 1), ("gadei", 2), ("hogwild", 2), ("ddp", 2), ("rpc", 2)]
    return [("plain", 1), ("gadei", 1), ("gadei", 2), ("gadei", 4), ("hogwild", 2), ("hogwild", 4), ("ddp", 2),
            ("ddp", 4), ("ddp-lr", 2), ("ddp-lr", 4), ("rpc", 2), ("rpc", 4)]


_DONE: dict = {}  # (id(args), method, learners, batch) -> runs: `peers scaling` in one command share them


def shared_runs(args, data: str, lr: float, limit: int) -> dict:
    """The runs of every benchmark of this command that trains peers (`peers`, `scaling`),
    made once, all interleaved together; by (method, learners, batch)."""
    wanted = []
    if "peers" in args.what:
        wanted += methods(args.quick, workload_of(args))
    if "scaling" in args.what:
        wanted += [m for m in scaling_methods(args.quick) if m not in wanted]
    keys = [(kind, world, batch) for kind, world in wanted for batch in _batches(args)]
    missing = [k for k in keys if (id(args), *k) not in _DONE]
    if missing:
        for key, rs in interleaved_runs(missing, args.repeats, _peer_run(args, data, lr, limit)).items():
            _DONE[(id(args), *key)] = rs
    return {k: _DONE[(id(args), *k)] for k in keys}


def interleaved_runs(keys: list[tuple], repeats: int, run) -> dict:
    """`run(key, repeat)` for every key of `keys`, `repeats` times, in a shuffled order each
    repeat (the same seed, `repeat`, for all of them in it), each with how near the CPUs were
    before and after it (`cross_cpu_ns`); the runs by key."""
    out = {key: [] for key in keys}
    rng = random.Random(0)
    for repeat in range(repeats):
        order = list(out)
        rng.shuffle(order)
        for key in order:
            before = cross_cpu_ns()
            result = run(key, repeat)
            result["cross_cpu_ns"] = [before, cross_cpu_ns()]
            out[key].append(result)
    return out


def _peer_run(args, data: str, lr: float, limit: int):
    """The run of one (method, learners, batch) of `peers` and `scaling`, for `interleaved_runs`."""
    def run(key: tuple[str, int, int], repeat: int) -> dict:
        kind, world, batch = key
        result = _run_surviving_crashes(kind, world, batch, epochs=args.epochs, seed=repeat, lr=lr, data=data,
                                        limit=limit, workload=workload_of(args))
        log.info("repeat %d batch %d %s %d: %.0f samples/s, accuracy %.3f, %.2f CPU ms/sample", repeat, batch, kind,
                 world, result["samples_per_s"], result["test_accuracy"], 1e3 * result["cpu_s_per_sample"])
        return result

    return run


def _run_surviving_crashes(kind: str, world: int, batch: int, **run) -> dict:
    """`run_peer`, again after a crash of a peer's process (up to PEER_RETRIES times): a
    user would run it again too; the crashes are counted in the result ("crashes") and shown
    in the table. gadei's runs are never run again: a crash of gadei is the bench's error."""
    crashes = []
    while True:
        try:
            result = run_peer(kind, world, batch, **run)
        except PeerCrashed as err:
            if kind == "gadei" or len(crashes) >= PEER_RETRIES:
                raise
            crashes.append(str(err))
            log.warning("%s; running it again (crash %d)", err, len(crashes))
            continue
        result["crashes"] = crashes
        return result


def placement_of(runs: list[dict]) -> str | None:
    """The line on how near the CPUs were around these runs (None where none was measured)."""
    return placement([t for r in runs for t in r.get("cross_cpu_ns") or ()])


def summarise(rs: list[dict]) -> dict:
    keys = ("samples_per_s", "test_accuracy", "cpu_s_per_sample", "server_cpu_s", "cpu_s", "seconds")
    return {**{k: median([r[k] for r in rs]) for k in keys}, "crashes": sum(len(r.get("crashes", ())) for r in rs),
            "runs": rs}


def threads_line(kind: str, world: int, runs: list[dict]) -> str:
    """One method's OS threads per process at the end of its loop, by role, in its first run:
    'gadei 2 learners: server 3, learners 2, 2'."""
    processes = runs[0].get("processes", []) if runs else []
    roles: dict[str, list[str]] = {}
    for p in processes:
        roles.setdefault(p["role"], []).append(str(p["threads"]))
    plural = {role: role + ("es" if role.endswith("s") else "s") for role in roles}  # processes, learners
    parts = [f"{plural[role] if len(n) > 1 else role} {', '.join(n)}" for role, n in roles.items()]
    return f"{LABELS[kind]} {_who(kind, world)}: {'; '.join(parts) or 'not recorded'}"


def print_threads(names, raw: dict, batch: int) -> None:
    """Under a table: the OS threads per process of each method (`threads_line`) at `batch`."""
    print("threads per process (OS threads at the end of each one's loop, first run):")
    for kind, world in names:
        print("  " + threads_line(kind, world, raw[(kind, world, batch)]))


def bench_peers(args) -> dict:
    data = _default_data(args)
    batches = _batches(args)
    workload = workload_of(args)
    lr = lr_for(workload)
    runs = methods(args.quick, workload)
    limit = QUICK_LIMIT if args.quick else 0
    raw = shared_runs(args, data, lr, limit)
    records = []
    for batch in batches:
        med = {f"{kind}-{world}": summarise(raw[(kind, world, batch)]) for kind, world in runs}
        ratios = {}
        for name, m in med.items():
            kind, world = name.rsplit("-", 1)
            mine = med.get(f"gadei-{world}")
            if kind != "gadei" and mine is not None:
                ratios[f"gadei-{world}/{name}"] = mine["samples_per_s"] / m["samples_per_s"]
        if "gadei-1" in med and "plain-1" in med:
            ratios["gadei-1/plain-1"] = med["gadei-1"]["samples_per_s"] / med["plain-1"]["samples_per_s"]
        records.append({"batch": batch, "methods": med, "ratios": ratios})
        print(f"\npeers: {model_name(workload)} on {data}, batch {batch}, {args.epochs} epoch(s)"
              f"{' (quick: ' + str(limit) + ' samples)' if limit else ''}, "
              f"lr {lr}, seeds 0..{args.repeats - 1}; medians of {args.repeats} interleaved runs")
        rows = []
        for kind, world in runs:
            m = med[f"{kind}-{world}"]
            mine = med.get(f"gadei-{world}")
            ratio = "" if kind == "gadei" or mine is None else f"{mine['samples_per_s'] / m['samples_per_s']:.2f}x"
            if kind == "plain" and "gadei-1" in med:
                ratio = f"{med['gadei-1']['samples_per_s'] / m['samples_per_s']:.2f}x (gadei 1)"
            crashed = f" ({m['crashes']} crashed, run again)" if m["crashes"] else ""
            rows.append((f"{LABELS[kind]} {_who(kind, world)}{crashed}", f"{m['samples_per_s']:.0f}",
                         f"{m['test_accuracy']:.1%}", f"{1e3 * m['cpu_s_per_sample']:.2f}", ratio))
        print(table(("method", "samples/s", "test accuracy", "CPU ms/sample", "gadei N / this"), rows))
        print_threads(runs, raw, batch)
        where = placement_of([r for m in med.values() for r in m["runs"]])
        if where:
            print(where)
    out = {"workload": workload, "data": data, "epochs": args.epochs, "lr": lr, "limit": limit, "rows": records}
    path = plot_path(args, "peers")
    if path:
        title = (f"{model_name(workload)} on {data.split(':')[0]}, {args.epochs} epoch(s), lr {lr}, "
                 f"median of {args.repeats}: samples/s, test accuracy at each bar")
        out["plot"] = save(figure(records, runs), path, title)
    return out


COLOURS = {"gadei": "tab:blue", "plain": "tab:grey", "hogwild": "tab:orange", "ddp": "tab:green",
           "ddp-lr": "tab:olive", "rpc": "tab:red"}


def figure(records: list[dict], runs: list[tuple[str, int]]):
    """One panel per mini-batch: each method's samples/s as a bar, its test accuracy written at
    the bar's end, the methods in the table's order (gadei's bars in blue)."""
    names = [f"{kind}-{world}" for kind, world in runs]
    labels = [f"{LABELS[kind]} {_who(kind, world)}" for kind, world in runs]
    fig, axes = pyplot().subplots(1, len(records), figsize=(3.4 * len(records) + 2.2, 0.32 * len(runs) + 1.6),
                                  squeeze=False, sharey=True)
    for ax, record in zip(axes[0], records):
        rates = [record["methods"][n]["samples_per_s"] for n in names]
        bars = ax.barh(range(len(names)), rates, color=[COLOURS[kind] for kind, _ in runs])
        for bar, name in zip(bars, names):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {record['methods'][name]['test_accuracy']:.0%}", va="center", fontsize=7)
        ax.set_title(f"batch {record['batch']}", fontsize=9)
        ax.set_xlabel("samples/s")
        ax.set_xlim(0, 1.25 * max(rates))  # room for the accuracies
        ax.grid(True, axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(names)), labels, fontsize=7)
    axes[0][0].invert_yaxis()  # the table's order, top to bottom
    return fig


def _who(kind: str, world: int) -> str:
    if kind == "rpc":
        return f"1 + {world}"
    return f"{world} learner{'s' if world > 1 else ''}" if kind == "gadei" else \
        f"{world} process{'es' if world > 1 else ''}"


def _batches(args) -> list[int]:
    """--batches (checked by the command line's parser), else this bench's."""
    return getattr(args, "batches", None) or ([4] if args.quick else list(BATCHES))
