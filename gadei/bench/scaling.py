"""`gadei bench scaling`: samples/s of the text CNN against the number of learners (1 to 4,
over-subscribing a 2-core machine), gadei's learners + server beside PyTorch Hogwild's
processes, with the share of the CPU the gadei server took; and, for each N, the smallest
mini-batch at which N learners beat one plain PyTorch process (the question of the
paper's Table 8), on this machine. The curve is drawn with matplotlib (`--plot`).

The runs are those of `gadei bench peers` (gadei.bench.peers.run_peer: same model, data,
epochs, seed and lr); `gadei bench peers scaling` makes the runs both need once, all
interleaved together.
"""

import logging

from .figure import plot_path, pyplot, save
from .peers import (LABELS, QUICK_LIMIT, _batches, lr_for, model_name, placement_of, print_threads, scaling_methods,
                    shared_runs, summarise, workload_of)
from .timing import table
from .train import _default_data

log = logging.getLogger(__name__)


def bench_scaling(args) -> dict:
    data = _default_data(args)
    workload = workload_of(args)
    lr = lr_for(workload)
    limit = QUICK_LIMIT if args.quick else 0
    raw = shared_runs(args, data, lr, limit)
    learners = sorted({n for kind, n in scaling_methods(args.quick) if kind == "gadei"})
    curves, rows = [], []
    for batch in _batches(args):
        plain = summarise(raw[("plain", 1, batch)])
        point = {"batch": batch, "plain": plain["samples_per_s"], "gadei": [], "hogwild": []}
        for n in learners:
            g, h = summarise(raw[("gadei", n, batch)]), summarise(raw[("hogwild", n, batch)])
            share = g["server_cpu_s"] / g["cpu_s"] if g["cpu_s"] else float("nan")
            cores = g["server_cpu_s"] / g["seconds"] if g["seconds"] else float("nan")
            point["gadei"].append({"learners": n, "samples_per_s": g["samples_per_s"],
                                   "test_accuracy": g["test_accuracy"], "server_cpu_share": share,
                                   "server_cores": cores, "cpu_s_per_sample": g["cpu_s_per_sample"], "runs": g["runs"]})
            point["hogwild"].append({"learners": n, "samples_per_s": h["samples_per_s"],
                                     "test_accuracy": h["test_accuracy"], "cpu_s_per_sample": h["cpu_s_per_sample"],
                                     "runs": h["runs"]})
            rows.append((batch, n, f"{g['samples_per_s']:.0f}", f"{h['samples_per_s']:.0f}",
                         f"{g['samples_per_s'] / h['samples_per_s']:.2f}x", f"{plain['samples_per_s']:.0f}",
                         f"{share:.0%} ({cores:.2f} cores)"))
        curves.append(point)
    beat = smallest_batches(curves, learners)
    print(f"\nscaling: {model_name(workload)} on {data}, {args.epochs} epoch(s)"
          f"{f' (quick: {limit} samples)' if limit else ''}, lr {lr}; "
          f"samples/s against learners, medians of {args.repeats} interleaved runs")
    print(table(("batch", "learners", "gadei", "Hogwild", "gadei / Hogwild", "plain 1 process",
                 "gadei server's CPU share"), rows))
    for batch in _batches(args):
        print(f"batch {batch}: ", end="")
        print_threads(scaling_methods(args.quick), raw, batch)
    where = placement_of([r for rs in raw.values() for r in rs])
    if where:
        print(where)
    print("\nthe smallest mini-batch (of those measured) at which N learners beat one plain process:")
    print(table(("learners", "gadei", "Hogwild"),
                [(n, beat["gadei"][str(n)] or "none", beat["hogwild"][str(n)] or "none") for n in learners]))
    out = {"workload": workload, "data": data, "epochs": args.epochs, "lr": lr, "limit": limit, "curves": curves,
           "smallest_batch": beat}
    path = plot_path(args, "scaling")
    if path:
        title = (f"{model_name(workload)} on {data.split(':')[0]}, {args.epochs} epoch(s), lr {lr}, "
                 f"median of {args.repeats}")
        out["plot"] = save(figure(curves, learners), path, title)
    return out


def smallest_batches(curves: list[dict], learners) -> dict:
    """For gadei and Hogwild, per N: the smallest measured batch where N beat the plain loop (None: none)."""
    out = {}
    for kind in ("gadei", "hogwild"):
        out[kind] = {}
        for i, n in enumerate(learners):
            wins = [c["batch"] for c in curves if c[kind][i]["samples_per_s"] > c["plain"]]
            out[kind][str(n)] = min(wins) if wins else None
    return out


def figure(curves: list[dict], learners):
    """Samples/s against learners, one panel per mini-batch: gadei and Hogwild, the plain loop
    as a line, and the gadei server's share of the CPU on a second axis."""
    fig, axes = pyplot().subplots(1, len(curves), figsize=(3.2 * len(curves) + 0.8, 3.6), squeeze=False)
    for ax, c in zip(axes[0], curves):
        ax.plot(learners, [p["samples_per_s"] for p in c["gadei"]], "o-", label=LABELS["gadei"], color="tab:blue")
        ax.plot(learners, [p["samples_per_s"] for p in c["hogwild"]], "s--", label=LABELS["hogwild"],
                color="tab:orange")
        ax.axhline(c["plain"], color="grey", linestyle=":", label="plain PyTorch, 1 process")
        ax.set_title(f"batch {c['batch']}")
        ax.set_xlabel("learners / processes")
        ax.set_xticks(list(learners))
        ax.set_ylim(bottom=0)
        share = ax.twinx()
        share.bar(learners, [100 * p["server_cpu_share"] for p in c["gadei"]], width=0.25, alpha=0.2,
                  color="tab:blue", label="gadei server's CPU share")
        share.set_ylim(0, 100)
        share.tick_params(labelsize=7)
        if c is curves[-1]:
            share.set_ylabel("server's share of CPU %", fontsize=8)
    axes[0][0].set_ylabel("samples/s")
    axes[0][0].legend(fontsize=7, loc="lower right")
    return fig
