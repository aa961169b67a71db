"""`gadei bench quality`: what a job file with nothing tuned hands back, on the shared data sets.

For each shared data set (TREC, SST-2, Subj, CR, banking77; `--sets` picks some) it writes a
job file that sets only the data, the learners and the seed, runs it with `gadei run` (the
defaults choose the update rule, learning rate, mini-batch, epoch cap and patience; the
model is chosen on the validation set), once per seed with 1 and with 2 learners, and
reports the test accuracy of the model handed back (median and range over the seeds), the
epoch that was chosen, the seconds to it (from the start of the run to the evaluation that
chose it: 2 learners' against 1 learner's is issue 20's time to the final model; and, since
2 learners often go on to a better model, their time to the validation accuracy of 1
learner's model, seed by seed) and the wall time, beside a plain single-process PyTorch
loop (Adam, lr 0.001, mini-batch 32) on the same training, validation and test split with
the same validation-based stopping: the strong baseline a user could write in a few lines.

Beside the text CNN, the n-gram workload (`ngram-2`: a job file that names `workload =
"ngram"` and sets the same keys, 2 learners) and scikit-learn's `LinearSVC` and
`LogisticRegression` with their default settings on the same n-grams of the same split
(`sklearn-svc`, `sklearn-lr`; `gadei.bench.reference`, scikit-learn being the bench's extra:
`pip install 'gadei[bench]'`). And a job file that names no workload (`auto-2`: `workload =
"auto"`, 2 learners), which trains both and hands back their mean or the better on validation: its wall time
against the text CNN's alone with 2 learners, on the same seeds side by side, is issue 47's
"at most 1.3x". `--runs` picks some of the runs.

`--train KEY=VALUE,...` adds a candidate: gadei with 2 learners and those [train] keys set
(`--train optimizer=adam,lr=0.001`), on the same sets and seeds, interleaved with the rest,
so that a change of the defaults is chosen by measurement (issue 20).

`--quick` is a smoke run cheap enough for a test: TREC cut to its first 600 training
questions, one seed, an epoch cap of 1.
"""

import json
import logging
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from .._proc import gadei_command, how_it_ended
from ..env import settings
from .figure import plot_path, pyplot, save
from .timing import table

log = logging.getLogger(__name__)

# Each shared data set as a job file's [data], paths relative to the shared data folder.
SETS = {
    "trec": {"train": "trec/TREC.train", "test": "trec/TREC.test", "format": "trec",
             "fallback_encoding": "latin-1"},
    "sst2": {"train": "sst2/stsa.binary.train", "validation": "sst2/stsa.binary.dev",
             "test": "sst2/stsa.binary.test", "format": "label-text"},
    "subj": {"train": ["subj/subj.objective", "subj/subj.subjective"], "format": "per-label",
             "encoding": "latin-1"},
    "cr": {"train": ["cr/custrev.neg", "cr/custrev.pos"], "format": "per-label"},
    "banking77": {"train": "banking77/train.csv", "test": "banking77/test.csv", "format": "csv",
                  "text_column": "text", "label_column": "category"},
}
QUICK_SAMPLES = 600  # --quick: TREC's first training questions
QUICK_EPOCHS = 1
BASELINE = {"optimizer": "adam", "lr": 1e-3, "batch": 32}
RUNS = ("gadei-1", "gadei-2", "pytorch", "ngram-2", "auto-2", "sklearn-svc", "sklearn-lr")  # the text CNN's first 3
LEARNERS = {"gadei-1": 1, "gadei-2": 2, "ngram-2": 2, "auto-2": 2}
WORKLOADS = {"ngram-2": "ngram", "sklearn-svc": "ngram", "sklearn-lr": "ngram", "auto-2": "auto"}  # else textcnn


def data_dir() -> Path:
    return Path(settings().data_dir or Path.cwd().parent / "shared" / "data")


def job_file(folder: Path, name: str, data: dict, *, learners: int | None, seed: int, epochs: int | None = None,
             train: dict | None = None, workload: str = "textcnn") -> Path:
    """A job file of `workload` for data set `name` that sets only its data, learners (None:
    the default's) and seed (and, for a smoke run, the epoch cap; for a candidate, its `train`
    keys, TOML values); its output folder is `folder`/runs/<job>."""
    def value(v):
        return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")

    job = f"q-{name}-{learners or 'd'}l-s{seed}-{time.monotonic_ns() % 1_000_000}"
    lines = ["[job]", f'name = "{job}"', f'workload = "{workload}"', "", "[data]"]
    lines += [f"{key} = {value(v)}" for key, v in data.items()]
    lines += ["", "[train]", *([f"learners = {learners}"] if learners else []), f"seed = {seed}"]
    lines += [f"epochs = {epochs}"] if epochs else []
    lines += [f"{key} = {setting}" for key, setting in (train or {}).items()]  # TOML values already
    lines += ["", "[output]", f'folder = "{folder / "runs" / job}"', ""]
    path = folder / f"{job}.toml"
    path.write_text("\n".join(lines))
    return path


def run_gadei(path: Path) -> dict:
    """`gadei run` the job file; its result.json, with the wall time of the whole command."""
    started = time.monotonic()
    done = subprocess.run([*gadei_command("run", str(path)), "--quiet"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    wall = time.monotonic() - started
    from .. import jobfile

    from ..outputs import model_folders

    out = jobfile.load(path).output
    if done.returncode != 0 or not (out / "result.json").exists():
        raise RuntimeError(f"gadei run {path} {how_it_ended(done.returncode)}: {done.stdout[-2000:]}")
    result = json.loads((out / "result.json").read_text())
    result["wall_seconds"] = round(wall, 1)
    result["evaluations"] = _evaluations(out)
    # the job as run, the defaults filled in (a job that picks its model: the chosen candidate's, or the first
    # member's of the candidates' mean)
    ran = jobfile.load(model_folders(out)[0] / "job.toml", data_files=False).train
    result.update(optimizer=ran.optimizer, lr=ran.lr, batch=ran.batch)
    return result


def _evaluations(out: Path) -> list[dict]:
    """Every validation evaluation of the run in `out`: its epoch, validation accuracy and the
    seconds since the job's start to it (the selection's history, `gadei.selection`, in the
    time base of result.json's seconds_to_best: `gadei.outputs.job_seconds`)."""
    from .. import outputs, selection

    runs = (outputs.read_result(out) or {}).get("runs")
    history = (selection.read_state(outputs.model_folders(out)[0] / "checkpoints") or {}).get("history", [])
    timed = [(h, outputs.job_seconds(h.get("at"), runs)) for h in history]
    return [{"epoch": h["epoch"], "validation_accuracy": h["validation_accuracy"], "seconds": seconds}
            for h, seconds in timed if seconds is not None]


def to_level(one: dict, two: dict) -> float | None:
    """How long run `two` took to first reach the validation accuracy of the model run `one`
    handed back, against how long `one` took to it: the time to the same accuracy (None: `two`
    never reached it, or a run without the times)."""
    level, took = one.get("validation_accuracy"), one.get("seconds_to_best")
    if level is None or not took:
        return None
    reached = [e["seconds"] for e in two.get("evaluations", []) if e["validation_accuracy"] >= level]
    return reached[0] / took if reached else None


def run_pytorch(path: Path, *, patience: int | None = None, epochs: int | None = None) -> dict:
    """The baseline on the job file's own split: one process, Adam lr 0.001, mini-batch 32,
    the validation accuracy evaluated after every epoch, the best kept, stopped after the
    job's patience (the defaults') evaluations without improvement or at the job's epoch cap
    (`gadei.bench.plain_job`)."""
    from .plain_job import train

    return train(path, optimizer=BASELINE["optimizer"], lr=BASELINE["lr"], batch=BASELINE["batch"], epochs=epochs,
                 patience=patience)


def candidates(specs: list[str]) -> dict[str, dict]:
    """`--train` specs as {label: {key: TOML value}}: "optimizer=adam,lr=0.001" becomes
    {"optimizer": '"adam"', "lr": "0.001"} (a value that is not TOML is a string).

    Raises:
        ValueError: a spec that is not KEY=VALUE,..., or sets learners or seed (the bench's own).
    """
    import tomllib

    found = {}
    for spec in specs:
        train = {}
        for item in spec.split(","):
            key, eq, value = (part.strip() for part in item.partition("="))
            if not eq or not key or not value:
                raise ValueError(f"--train {spec!r}: {item!r} is not KEY=VALUE (e.g. --train optimizer=adam,lr=0.001)")
            if key in ("learners", "seed"):
                raise ValueError(f"--train {spec!r}: {key} is the bench's own (2 learners, seeds 0..repeats-1)")
            try:
                tomllib.loads(f"v = {value}")
            except tomllib.TOMLDecodeError:
                value = json.dumps(value)
            train[key] = value
        found["gadei-2 " + ",".join(f"{k}={v.strip(chr(34))}" for k, v in train.items())] = train
    return found


def chosen_runs(text: str | None) -> tuple[str, ...]:
    """--runs as the runs it names, in RUNS' order ("sklearn" is both references); all of RUNS
    without it.

    Raises:
        ValueError: a name that is not a run.
    """
    if not text:
        return RUNS
    names = {n.strip() for n in text.split(",") if n.strip()}
    if "sklearn" in names:
        names = (names - {"sklearn"}) | {"sklearn-svc", "sklearn-lr"}
    unknown = sorted(names - set(RUNS))
    if unknown or not names:
        raise ValueError(f"--runs {text!r}: unknown run(s) {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(RUNS)} or sklearn (both references)")
    return tuple(r for r in RUNS if r in names)


def _run(config: str, path: Path, epochs: int | None) -> dict:
    """One run of `config` on the job file `path`."""
    if config == "pytorch":
        return run_pytorch(path, epochs=epochs)
    if config.startswith("sklearn-"):
        from .reference import run_sklearn

        return run_sklearn(path, config.partition("-")[2])
    return run_gadei(path)


def bench_quality(args) -> dict:
    """Every chosen set x run (the text CNN with 1 and 2 learners, its PyTorch loop, the n-gram
    workload with 2 learners, scikit-learn's references; `--runs`) x seed, interleaved (the
    machine's noise falls on all alike); the table, and every run's figures."""
    names = (args.sets.split(",") if getattr(args, "sets", None) else list(SETS)) if not args.quick else ["trec"]
    unknown = [n for n in names if n not in SETS]
    if unknown:
        raise ValueError(f"--sets: unknown data set(s) {', '.join(unknown)}; choose from {', '.join(SETS)}")
    seeds = [0] if args.quick else list(range(args.repeats))
    epochs = QUICK_EPOCHS if args.quick else None
    trained = candidates(getattr(args, "train", None) or [])
    configs = (*chosen_runs(getattr(args, "runs", None)), *trained)
    if any(c.startswith("sklearn-") for c in configs):
        from .reference import check_installed

        check_installed()  # said now, not after the first runs
    runs: dict = {name: {c: [] for c in configs} for name in names}
    with tempfile.TemporaryDirectory(prefix="gadei-quality-") as tmp:
        folder = Path(tmp)
        if trained:  # a candidate a job file refuses is said now, not after the first runs
            from .. import jobfile

            data = set_data(names[0], folder, first=QUICK_SAMPLES if args.quick else None, what="gadei bench quality")
            for label, train in trained.items():
                try:
                    jobfile.load(job_file(folder, names[0], data, learners=2, seed=0, train=train))
                except jobfile.JobFileError as err:
                    raise ValueError(f"--train: {label[len('gadei-2 '):]}: {err}") from None
        for name in names:
            data = set_data(name, folder, first=QUICK_SAMPLES if args.quick else None, what="gadei bench quality")
            for seed in seeds:
                for config in configs:
                    workload = WORKLOADS.get(config, "textcnn")
                    path = job_file(folder, name, data, learners=LEARNERS.get(config, 2), seed=seed, epochs=epochs,
                                    train=trained.get(config), workload=workload)
                    result = _run(config, path, epochs)
                    result["seed"] = seed
                    runs[name][config].append(result)
                    said = (f"epoch {result['epoch']}" if result.get("epoch") is not None else
                            "the candidates' mean" if len(result.get("members") or ()) > 1 else "no epoch")
                    log.info("quality %s %s seed %d: test accuracy %.2f%%, %s, %.0f s", name, config, seed,
                             100 * result["test_accuracy"], said, result["wall_seconds"])
    summary = {name: {c: _summary(rs) for c, rs in by.items()} for name, by in runs.items()}
    rows = []
    for name, by in summary.items():
        for config, s in by.items():
            to_best = "-" if s["seconds_to_best"] is None else f"{s['seconds_to_best']:.0f}"
            epochs_ = s["epochs"] if not config.startswith("sklearn") else "-"
            rows.append([name, config, f"{s['median']:.1%} ({s['min']:.1%}-{s['max']:.1%})", epochs_,
                         to_best, f"{s['wall_seconds']:.1f}" if s["wall_seconds"] < 10 else f"{s['wall_seconds']:.0f}"])
    print("\nquality: test accuracy of the model handed back, median (range) over seeds " + ",".join(map(str, seeds))
          + "; the epoch chosen on validation; median seconds from the start to the chosen model's evaluation"
          + " (to best) and to the end (wall)")
    print(table(["set", "run", "test accuracy", "epoch chosen", "to best s", "wall s"], rows))
    out = {"seeds": seeds, "quick": args.quick, "baseline": BASELINE, "candidates": trained, "summary": summary,
           "runs": runs}
    if "gadei-1" in configs and "gadei-2" in configs:
        out.update(_one_against_two(summary, runs))
    if "ngram-2" in configs:
        out["ngram"] = _ngram_against_the_others(summary)
    if "auto-2" in configs and "gadei-2" in configs:
        out["auto"] = _auto_against_the_text_cnn(summary, runs)
    path = plot_path(args, "quality")
    if path:
        title = (f"gadei bench quality: a job file with nothing tuned, seeds {','.join(map(str, seeds))}"
                 + (" (quick: a cut of TREC, 1 epoch)" if args.quick else ""))
        out["plot"] = save(figure(summary), path, title)
    return out


def _one_against_two(summary: dict, runs: dict) -> dict:
    """The text CNN's 2 learners against 1: the time to the chosen model, and to 1 learner's
    chosen validation accuracy; printed, and their JSON."""
    speedup = {name: _ratio(by["gadei-2"]["seconds_to_best"], by["gadei-1"]["seconds_to_best"])
               for name, by in summary.items()}
    print("2 learners' time to the chosen model against 1 learner's (issue 20's target: at most 0.65x): "
          + ", ".join(f"{name} {'-' if r is None else f'{r:.2f}x'}" for name, r in speedup.items()))
    same = {name: [to_level(one, two) for one, two in zip(by["gadei-1"], by["gadei-2"])] for name, by in runs.items()}
    level = {name: statistics.median(r for r in ratios if r is not None) if any(r is not None for r in ratios)
             else None for name, ratios in same.items()}
    print("2 learners' time to 1 learner's chosen validation accuracy (same seed) against 1 learner's, median: "
          + ", ".join(f"{name} {'-' if level[name] is None else f'{level[name]:.2f}x'} (reached on "
                      f"{sum(r is not None for r in ratios)} of {len(ratios)} seeds)" for name, ratios in same.items()))
    return {"to_best_2_over_1": speedup, "to_level_2_over_1": level}


def _ngram_against_the_others(summary: dict) -> dict:
    """Per set, the n-gram workload's median test accuracy against scikit-learn's best (points)
    and its median wall time against the text CNN's with 2 learners; printed, and their JSON."""
    found = {}
    for name, by in summary.items():
        mine = by["ngram-2"]
        references = [by[r]["median"] for r in ("sklearn-svc", "sklearn-lr") if r in by]
        found[name] = {"over_sklearn_points": 100 * (mine["median"] - max(references)) if references else None,
                       "wall_over_textcnn": _ratio(mine["wall_seconds"], by.get("gadei-2", {}).get("wall_seconds"))}
    print("the n-gram workload (2 learners) against scikit-learn's best reference, test accuracy in points (issue 47: "
          "at least -0.5), and its wall time against the text CNN's with 2 learners (issue 47: at most 0.2x): "
          + ", ".join(f"{name} " + ("-" if f["over_sklearn_points"] is None else f"{f['over_sklearn_points']:+.1f}")
                      + " / " + ("-" if f["wall_over_textcnn"] is None else f"{f['wall_over_textcnn']:.2f}x")
                      for name, f in found.items()))
    return found


def _auto_against_the_text_cnn(summary: dict, runs: dict) -> dict:
    """Per set, the job that picks its model (2 learners) against the text CNN alone with 2
    learners, run side by side on the same seeds: the median of its wall times over the CNN's
    median (issue 47: at most 1.3x), and how often it chose each candidate; printed, and their JSON."""
    found = {}
    for name, by in summary.items():
        chose = [r.get("workload") for r in runs[name]["auto-2"]]
        # the same run less what its other candidates took: the text CNN's part of it, start and end included
        own = [_ratio(r["wall_seconds"], r["wall_seconds"] - sum(c.get("seconds", 0) for c in r.get("candidates", [])
                                                                  if c["workload"] != "textcnn"))
               for r in runs[name]["auto-2"]]
        found[name] = {"wall_over_textcnn": _ratio(by["auto-2"]["wall_seconds"], by["gadei-2"]["wall_seconds"]),
                       "wall_over_its_textcnn": statistics.median(own) if None not in own else None,
                       "chose": {w: chose.count(w) for w in sorted(set(chose), key=str)}}
    print("a job that picks its model (auto, 2 learners): its median wall time against the text CNN's alone with 2 "
          "learners (issue 47: at most 1.3x); in brackets, the median of each auto run's wall time against the same "
          "run less its other candidates' seconds (what they add to training the text CNN, without the seeds' "
          "spread in how long the CNN trains), and the candidates it chose: "
          + ", ".join(f"{name} " + ("-" if f["wall_over_textcnn"] is None else f"{f['wall_over_textcnn']:.2f}x")
                      + " (" + ("-" if f["wall_over_its_textcnn"] is None else f"{f['wall_over_its_textcnn']:.2f}x")
                      + "; chose " + ", ".join(f"{w} {n}" for w, n in f["chose"].items()) + ")"
                      for name, f in found.items()))
    return found


def figure(summary: dict):
    """Per data set, each run's (gadei 1 and 2 learners, PyTorch, each candidate) test accuracy,
    the median with the seeds' range, and the median seconds to the chosen model, the wall
    time behind it."""
    import numpy as np

    sets = list(summary)
    configs = list(summary[sets[0]])
    fig, (accuracy, seconds) = pyplot().subplots(1, 2, figsize=(max(8.0, 2.2 * len(sets) + 5), 4.2),
                                                 layout="constrained")  # room for the legend under them
    x, width = np.arange(len(sets)), 0.8 / len(configs)
    for i, config in enumerate(configs):
        at = x - 0.4 + width * (i + 0.5)
        s = [summary[name][config] for name in sets]
        median = [100 * v["median"] for v in s]
        spread = [[max(0.0, m - 100 * v["min"]) for m, v in zip(median, s)],
                  [max(0.0, 100 * v["max"] - m) for m, v in zip(median, s)]]
        accuracy.bar(at, median, width, yerr=spread, capsize=2, label=config, color=f"C{i}")
        seconds.bar(at, [v["wall_seconds"] for v in s], width, color=f"C{i}", alpha=0.25)
        seconds.bar(at, [v["seconds_to_best"] or 0 for v in s], width, color=f"C{i}", label=config)
    for ax in (accuracy, seconds):
        ax.set_xticks(x, sets)
        ax.grid(True, axis="y", alpha=0.3)
    lowest = min(v["min"] for by in summary.values() for v in by.values())
    accuracy.set_ylim(max(0.0, 100 * lowest - 10), 100)
    accuracy.set_ylabel("test accuracy (%), median and range")
    accuracy.set_title("the model handed back", fontsize=9)
    fig.legend(*accuracy.get_legend_handles_labels(), loc="outside lower center", ncols=min(len(configs), 4),
               fontsize=7)  # under both panels: over the bars, it hid them
    seconds.set_ylabel("seconds, median")
    seconds.set_title("to the chosen model (the whole run: light)", fontsize=9)
    return fig


def _summary(results: list[dict]) -> dict:
    accuracy = [r["test_accuracy"] for r in results]
    to_best = [r["seconds_to_best"] for r in results if r.get("seconds_to_best") is not None]
    return {"median": statistics.median(accuracy), "min": min(accuracy), "max": max(accuracy),
            # the candidates' mean an auto job handed back has no epoch of its own
            "epochs": "/".join(str(r["epoch"]) if "epoch" in r else "mean" for r in results),
            "seconds_to_best": statistics.median(to_best) if len(to_best) == len(results) else None,
            "wall_seconds": statistics.median(r["wall_seconds"] for r in results)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def set_data(name: str, folder: Path, *, first: int | None = None, base: Path | None = None,
             what: str = "gadei bench") -> dict:
    """The job file's [data] of shared set `name`, absolute paths under `base` (default
    `data_dir()`); `first`: its training file cut to its first `first` lines (TREC's
    questions, a line each), written to `folder`.

    Raises:
        FileNotFoundError: a file of the set is not there (`what`, the bench, says it).
    """
    base = data_dir() if base is None else base
    data = dict(SETS[name])
    for key in ("train", "validation", "test"):
        if key in data:
            data[key] = [str(base / p) for p in data[key]] if isinstance(data[key], list) else str(base / data[key])
    missing = [p for key in ("train", "validation", "test") for p in
               (data.get(key) if isinstance(data.get(key), list) else [data.get(key)]) if p and not Path(p).exists()]
    if missing:
        raise FileNotFoundError(f"{what}: {missing[0]} is not there (the shared data sets are looked for in "
                                f"GADEI_DATA_DIR, else ../shared/data)")
    if first:
        lines = Path(data["train"]).read_bytes().split(b"\n")[:first]
        cut = folder / f"{Path(data['train']).name}.first-{first}"
        cut.write_bytes(b"\n".join(lines) + b"\n")
        data["train"] = str(cut)
    return data
