"""The benchmarks' pictures: where each is drawn (`--plot`) and how it is saved (matplotlib,
Agg, imported only when a benchmark draws), so that every figure beside a table is made the
same way."""

from pathlib import Path

# the benchmarks that draw a figure beside their tables
DRAWN = ("peers", "scaling", "quality", "gpu")


def plot_path(args, name: str) -> str | None:
    """Where benchmark `name` draws its figure: `--plot` when this command draws one figure; with
    several, `--plot`'s name with `-<name>` before the suffix (`figs.png`: `figs-peers.png`);
    without `--plot`, `gadei-bench-<name>.png` beside `--out`. None: `--plot none` (draw nothing)."""
    given = getattr(args, "plot", None)
    if given is not None and given.lower() == "none":
        return None
    if given:
        drawn = [w for w in getattr(args, "what", [name]) if w in DRAWN]
        if len(set(drawn)) <= 1:
            return given
        path = Path(given)
        return str(path.with_name(f"{path.stem}-{name}{path.suffix or '.png'}"))
    return str(Path(getattr(args, "out", None) or ".").parent / f"gadei-bench-{name}.png")


def pyplot():
    """matplotlib.pyplot on the Agg backend (no screen needed), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str, title: str) -> str:
    """Title `fig`, lay it out (unless it was made with a layout), write it to `path` as a PNG
    (its folder made) and close it."""
    fig.suptitle(title, fontsize=8 if fig.get_figwidth() > 5 else 6)
    if fig.get_layout_engine() is None:  # a figure laid out as it was made keeps its layout
        fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    print(f"plot: {path}")
    return path
