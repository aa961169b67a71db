"""A job's learning curves as a figure (`figure`): what `gadei.outputs` draws into accuracy.png.

The figure is matplotlib's object-oriented one on the Agg canvas, as matplotlib advises for a
program that writes files: pyplot, its global state and its backends are never imported (a
tenth of a second of every job's CPU).
"""


def load() -> None:
    """Import matplotlib on `figure`'s backend ahead of the plot: a job's supervisor does while
    its job trains, so that the job's outputs do not wait for the import (about half a second on
    2 cores) once it ends. An import that fails here fails again in the plot, which says so."""
    try:
        import matplotlib.backends.backend_agg  # noqa: F401
        import matplotlib.figure  # noqa: F401
    except Exception:  # noqa: BLE001 - `plot` reports it
        pass


def figure(metrics: list[dict], title: str, chosen: tuple | dict | None = None, mean: dict | None = None):
    """accuracy.png's figure: validation and test accuracy against epochs and against seconds
    since the job's start (metrics.jsonl's `seconds_since_start`, the time base of result.json's
    `seconds_to_best`; where no record has it, the epochs' training seconds added up), the
    chosen model marked: `chosen`, result.json's (epoch, seconds_to_best), else the last epoch
    whose model was the best so far; and, where the records carry them, a second row against
    epochs: the evaluating learner's samples/s, and the staleness of the job's applied
    gradients (the epoch's mean, the largest so far).

    A job that picks its model has records of each candidate (each with its "workload"): each
    candidate's curves are drawn in a colour of its own, `chosen` maps a workload to its
    model's (epoch, seconds) where that candidate was handed back or is in the mean, and `mean`
    (result.json's "mean", where the mean was handed back) draws its validation and test
    accuracy as lines across, starred when its last member's model was made."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    since_start = any("seconds_since_start" in m for m in metrics)
    groups: dict[str, list[dict]] = {}
    for m in metrics:
        groups.setdefault(m.get("workload", ""), []).append(m)
    seconds = {name: _seconds(records, since_start) for name, records in groups.items()}
    pace = any(key in m for m in metrics for key in ("samples_per_s", "staleness_mean", "staleness_max"))
    fig = Figure(figsize=(10, 7 if pace else 4), dpi=100)
    FigureCanvasAgg(fig)  # its canvas: no screen
    axes = fig.subplots(2 if pace else 1, 2, squeeze=False)
    by_epoch, by_time = axes[0]
    by_time.sharey(by_epoch)
    marks = chosen if isinstance(chosen, dict) else {"": chosen}
    for i, (name, records) in enumerate(groups.items()):
        for key, label, style in (("validation_accuracy", "validation", "o-"), ("test_accuracy", "test", "s--")):
            points = [(m["epoch"], 100 * m[key]) for m in records if key in m]
            if not points:
                continue
            fmt, look = ("o-", {"label": label}) if len(groups) == 1 else \
                (style, {"color": f"C{i}", "label": f"{name}: {label}"})
            by_epoch.plot([e for e, _ in points], [a for _, a in points], fmt, **look)
            timed = [(seconds[name][e], a) for e, a in points if e in seconds[name]]
            by_time.plot([t for t, _ in timed], [a for _, a in timed], fmt, **look)
        mark = marks.get(name)
        if mark is None and len(groups) == 1:
            best = [m for m in records if m.get("best")]
            mark = (best[-1]["epoch"], seconds[name].get(best[-1]["epoch"])) if best else None
        elif mark is not None and not since_start:  # the time axis is the epochs' training seconds: the chosen epoch's
            mark = (mark[0], seconds[name].get(mark[0]))
        if mark is not None:
            epoch, at = mark
            line = {"color": "grey", "linestyle": "--"} if len(groups) == 1 else {"color": f"C{i}", "linestyle": ":"}
            said = f"chosen: epoch {epoch:g}" if len(groups) == 1 else f"{name}'s model: epoch {epoch:g}"
            by_epoch.axvline(epoch, **line, label=said)
            if at is not None:
                by_time.axvline(at, **line)
    if mean:
        _mean(by_epoch, by_time, mean)
    by_epoch.set_xlabel("epoch")
    by_epoch.set_ylabel("accuracy (%)")
    by_time.set_xlabel("seconds since the job's start" if since_start else "seconds of training")
    if any("validation_accuracy" in m or "test_accuracy" in m for m in metrics):
        if len(groups) == 1:
            by_epoch.legend(loc="lower right", fontsize=10)
        else:  # 8 entries: in room left below the curves
            low, high = by_epoch.get_ylim()
            by_epoch.set_ylim(low - 0.5 * (high - low), high)
            by_epoch.legend(loc="lower center", fontsize=7, ncol=2)
    if pace:
        _pace(axes[1], groups)
    from matplotlib.ticker import MaxNLocator

    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        if ax.get_xlabel() == "epoch":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no epoch 2.5
    fig.suptitle(f"gadei job {title}")
    fig.tight_layout()
    return fig


def _seconds(records: list[dict], since_start: bool) -> dict:
    """epoch -> its x on the time axis: seconds since the job's start, else the epochs' training
    seconds added up."""
    seconds, total = {}, 0.0
    for m in records:
        total += m.get("epoch_seconds", 0.0)
        if not since_start:
            seconds[m["epoch"]] = total
        elif "seconds_since_start" in m:  # unknown for the records of a run whose time is unknown
            seconds[m["epoch"]] = m["seconds_since_start"]
    return seconds


def _mean(by_epoch, by_time, mean: dict) -> None:
    """The candidates' mean: its validation and test accuracy across both plots, starred on the
    time plot when it was made (`mean["seconds_to_best"]`, where known)."""
    at = mean.get("seconds_to_best")
    for key, label, style in (("validation_accuracy", "validation", "-"), ("test_accuracy", "test", "--")):
        if isinstance(mean.get(key), (int, float)):
            accuracy = 100 * mean[key]
            by_epoch.axhline(accuracy, color="black", linestyle=style, linewidth=1,
                             label=f"the mean (chosen): {label} {accuracy:.1f}%")
            by_time.axhline(accuracy, color="black", linestyle=style, linewidth=1)
            if isinstance(at, (int, float)):
                by_time.plot([at], [accuracy], "*", color="black", markersize=10)


def _pace(axes, groups: dict[str, list[dict]]) -> None:
    """accuracy.png's second row: samples/s, and staleness, against epochs (each candidate's, in
    its colour, where the job picked its model)."""
    rate, stale = axes
    several = len(groups) > 1
    for i, (name, metrics) in enumerate(groups.items()):
        points = [(m["epoch"], m["samples_per_s"]) for m in metrics if isinstance(m.get("samples_per_s"), (int, float))]
        rate.plot([e for e, _ in points], [r for _, r in points], marker="o", color=f"C{i}" if several else "tab:green",
                  **({"label": name} if several else {}))
        for key, label, style in (("staleness_mean", "mean in the epoch", "o-"),
                                  ("staleness_max", "largest so far", "s--")):
            points = [(m["epoch"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
            if points:
                stale.plot([e for e, _ in points], [s for _, s in points], style,
                           **({"color": f"C{i}", "label": f"{name}: {label}"} if several else {"label": label}))
    rate.set_ylim(bottom=0)
    rate.set_xlabel("epoch")
    rate.set_ylabel("samples/s")
    rate.set_title("learner 0's samples/s", fontsize=10)
    if several:
        rate.legend(loc="best", fontsize=8)
    stale.set_ylim(0, stale.get_ylim()[1] * 1.4)  # room above the lines for the legend
    stale.set_xlabel("epoch")
    stale.set_ylabel("versions")
    stale.set_title("staleness of the applied gradients", fontsize=10)
    if stale.lines:
        stale.legend(loc="best", fontsize=8)
