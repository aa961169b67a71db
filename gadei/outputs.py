"""A run's outputs in its folder, written in one place whoever sees the job end: metrics.jsonl
from the learners' epoch records, the plot (accuracy.png), model.pt made the model chosen on
the validation set, and result.json (the job's outcome, which model was chosen and why
training stopped, its test accuracy); and the record of how the job ended that they are
decided from (`END`). This module is the only one that writes them (tests/test_owners.py
holds it): whoever sees the job end calls `conclude` (the end record as it saw it, then the
outputs), or `record_end` where it records the end before the outputs can be written (the
job's server still stops, a bridge still ends); the callers decide only when, and why.

One writer wins. `gadei run` holds `logs/run.lock` (an exclusive `flock`) from before it
starts the job until it has written the outputs (`Owner`); the job's watchdog, which
outlives a killed `gadei run`, records how the job ended in `logs/watchdog-end.json` and
writes the outputs itself only when it can take that lock (the `gadei run` is gone), and so
does the daemon for a job whose `gadei run` died, and the job's server for a job it failed
when its watchdog and its `gadei run` both died and no new watchdog could take over
(`gadei.custody`). Whoever writes holds the lock, writes each
file beside its place and renames it there, result.json last: a result.json exists only
whole, and once it exists the others read it instead of writing (`conclude`). A writer that is
killed mid-way lets go of the lock with its life, and the next one writes it all again.

result.json's "outcome" is one of OUTCOMES, decided from what every writer can see: the
watchdog's end record (the job finished, was stopped, or failed: the server died for good,
a launched learner was given up, the server stopped the job as failed), the model the
server wrote at its stop, and the evaluating learner's losses (not finite: diverged).

One time base for a job however many runs it took: seconds since the job's start, the start
of its first run (when its `gadei run` took the output folder, `Owner`), counting only the
time its runs ran (`job_seconds`). result.json's "runs" are each run's start (wall clock) and
seconds, "seconds" this run's, a resumed run's "seconds_in_all" all of them (`forget` carries
the earlier runs over from their result.json before it removes it: `EARLIER`); its
"seconds_to_best" (the chosen model's time), metrics.jsonl's "seconds_since_start" (each
epoch's evaluation) and accuracy.png's time axis are in that base, and so is `gadei run`'s
last line (`gadei.run.report`).
"""

import fcntl
import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from . import board, data, jobfile
from .errors import GadeiError
from .protocol import Deadline

LOCK = "logs/run.lock"  # held by the run's owner (`gadei run`) and by whoever writes the outputs
END = "logs/watchdog-end.json"  # the watchdog's record of how the job ended
EARLIER = "logs/earlier-runs.json"  # a resumed run's record of the runs it goes on from (start, seconds)
DONE, STOPPED, FAILED, DIVERGED = "done", "stopped", "failed", "diverged"
OUTCOMES = (DONE, STOPPED, FAILED, DIVERGED)
_RUN_FILES = ("result.json", "metrics.jsonl", "accuracy.png", "watchdog-end.json")


@dataclass
class Ending:
    """How the watchdog saw the job end (its exit code, `gadei.watchdog_record`'s codes: 0 the job
    stopped, 3 the server died for good, 4 launched learners were given up, 5 the server
    stopped the job as failed), whether the job had finished (every launched learner done),
    and why, in words."""

    code: int
    finished: bool
    reason: str = ""
    pid: int = 0
    time: float = 0.0


def write_ending(out: Path, ending: Ending) -> None:
    """The end record (`END`) as `ending` says, atomically (`record_end` stamps it with its writer)."""
    _replace(out / END, json.dumps(asdict(ending)) + "\n")


def record_end(out: Path, ending: Ending) -> None:
    """Record how the job ended (`END`) as this process saw it now: `ending`'s code, finished
    and reason, with this process's pid and the time (the daemon tells by them whether its
    writer still lives: `gadei.daemon.jobs._job_alive`)."""
    write_ending(out, replace(ending, pid=os.getpid(), time=time.time()))


def read_ending(out: Path) -> Ending | None:
    try:
        return Ending(**json.loads((out / END).read_text()))
    except (FileNotFoundError, ValueError, TypeError):
        return None


def forget(out: Path, resume: bool = False) -> None:
    """Before a run (or a resumed one) starts: the outputs and end record of the run before it
    are not this one's, nor its TensorBoard event files unless this run resumes it. A resumed
    run keeps the runs it goes on from (`EARLIER`: their starts and seconds, from their
    result.json's "runs"), the job's time base; where the run before it left no result.json
    (it was killed), they are unknown, and so is the job's time base for this run."""
    earlier = _valid_runs((read_result(out) or {}).get("runs")) if resume else None
    try:
        (out / EARLIER).unlink()
    except FileNotFoundError:
        pass
    if resume:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        _replace(out / EARLIER, json.dumps({"runs": earlier}) + "\n")
    if not resume:  # a resumed run's TensorBoard curves go on from those of the runs before it
        board.forget(out)
    for name in _RUN_FILES:
        for folder in (out, out / "logs"):
            try:
                (folder / name).unlink()
            except FileNotFoundError:
                pass


class Owner:
    """`gadei run`'s hold on its run (`LOCK`) from before the job starts until its outputs
    are written: while it holds it, the watchdog leaves the outputs to it.

    Raises:
        GadeiError: another live process owns a run in this folder.
    """

    def __init__(self, out: Path):
        self.path = out / LOCK
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise GadeiError(f"output folder {out}: another process runs a job there (it holds {self.path})") from None
        self.started = time.time()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps({"pid": os.getpid(), "started": self.started}).encode(), 0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def owned(out: Path) -> bool:
    """Some live process holds the run's lock (its `gadei run`, or a writer of its outputs)."""
    try:
        fd = os.open(out / LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def started(out: Path) -> float | None:
    """When the run's owner started it (wall clock), from its lock file."""
    try:
        return float(json.loads((out / LOCK).read_text())["started"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def _valid_runs(runs) -> list[dict] | None:
    """result.json's "runs" as a list of {"started", "seconds"}; None where it is not one."""
    if not isinstance(runs, list) or not runs:
        return None
    if not all(isinstance(r, dict) and all(isinstance(r.get(k), (int, float)) for k in ("started", "seconds"))
               for r in runs):
        return None
    return [{"started": r["started"], "seconds": r["seconds"]} for r in runs]


def _earlier_runs(out: Path) -> list[dict] | None:
    """The runs this run goes on from (`EARLIER`): [] for a run that resumed none, None where
    they are unknown (a run before it was killed before writing its result.json)."""
    try:
        record = json.loads((out / EARLIER).read_text())
    except FileNotFoundError:
        return []
    except ValueError:
        return None
    return _valid_runs(record.get("runs")) if isinstance(record, dict) else None


def job_seconds(at, runs: list[dict] | None) -> float | None:
    """Seconds since the job's start at the wall clock `at`, in the job's time base: the
    seconds of the runs (`runs`, result.json's, in order) before the one `at` fell in, plus
    those from that run's start to `at`. None where unknown: no runs, no `at`, or an `at`
    before the first run (a selection older than the evaluations' times gives 0)."""
    if not runs or not isinstance(at, (int, float)):
        return None
    took, base = None, 0.0
    for run in runs:
        if at >= run["started"]:
            took = round(base + at - run["started"], 1)
        base += run["seconds"]
    return took


def read_result(out: Path) -> dict | None:
    try:
        return json.loads((out / "result.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def conclude(out: Path, *, ending: Ending | None = None, job: jobfile.Job | None = None,
             owner: Owner | None = None, leave_to_owner: bool = False, interrupted: bool = False, note: str = "",
             bridge: dict | None = None, wait: float = 600.0) -> dict | None:
    """Conclude the job that ran in `out`: record how it ended (`ending`, as this process saw
    it: `record_end`), then write the run's outputs (metrics.jsonl, accuracy.png, result.json)
    unless another process wrote them already; result.json's content either way.

    `job`: the job as the caller loaded it; else its job.toml in `out`, loaded only when the
    outputs are written. `owner`: the caller holds the run's lock (`gadei run`); otherwise the
    lock is taken here, waiting up to `wait` seconds for a writer that holds it.
    `leave_to_owner`: while another live process holds the run's lock (its `gadei run`), the
    outputs are left to it (None is returned). `interrupted`: the caller stopped the job
    (Ctrl-C, `gadei cancel`) before it finished. `note`: what the caller saw go wrong, for
    result.json's reason when the job failed without an end record.

    Raises:
        GadeiError: the lock was held for longer than `wait` seconds, or job.toml is not a job.
        OSError: a file could not be written.
    """
    if ending is not None:
        record_end(out, ending)
    if leave_to_owner and owned(out):
        return None
    if job is None:
        job = jobfile.load(out / "job.toml")
    fd = owner.fd if owner is not None else _lock(out, wait)
    try:
        found = read_result(out)
        if found is not None:
            return found
        return _write(job, interrupted, note, bridge, owner.started if owner is not None else started(out))
    finally:
        if owner is None:
            os.close(fd)


def _lock(out: Path, wait: float) -> int:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    deadline = Deadline(wait)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if deadline.expired():
                os.close(fd)
                raise GadeiError(f"{out / LOCK} is still held after {wait:g} s: another process writes the run's "
                                 "outputs") from None
            deadline.sleep(0.1)


def outcome(job: jobfile.Job, metrics: list[dict], ending: Ending | None, interrupted: bool,
            note: str) -> tuple[str, str]:
    """(one of OUTCOMES, a sentence saying why) for a job that ended."""
    out = job.output
    for record in metrics:
        loss = record.get("loss")
        if isinstance(loss, (int, float)) and not math.isfinite(loss):
            return DIVERGED, (f"the training loss is {loss} after epoch {record.get('epoch')}: training diverged; "
                              f"the learning rate is likely too high (lr {job.train.lr:g}), lower [train] lr")
    if ending is not None and ending.code != 0:
        return FAILED, ending.reason or f"the watchdog ended with {ending.code}"
    if not (out / "model.pt").exists():
        if interrupted and not note:  # stopped while it started: nothing trained, nothing went wrong
            return STOPPED, "stopped (by its `gadei run`) before the job wrote a model"
        return FAILED, note or "the job ended without writing its model (see its logs)"
    if ending is not None and ending.finished and not interrupted:
        return DONE, "every learner finished its epochs"
    if ending is None and note:
        return FAILED, note
    return STOPPED, "stopped before its end" + (" (by its `gadei run`)" if interrupted else "")


def _write(job: jobfile.Job, interrupted: bool, note: str, bridge: dict | None, since: float | None) -> dict:
    out = job.output
    earlier = _earlier_runs(out)
    # the job's runs (this one's seconds are known at its end: nothing comes after it)
    runs = earlier + [{"started": since, "seconds": 0.0}] if since and earlier is not None else None
    metrics = write_metrics(out, runs)
    ending = read_ending(out)
    kind, reason = outcome(job, metrics, ending, interrupted, note)
    result = {"job": job.name, "outcome": kind, "finished": kind == DONE, "reason": reason}
    if (out / "model.pt").exists() and kind in (DONE, STOPPED):
        result.update(chosen(job, kind, runs))
        if result["stopped"] == "patience":
            from .selection import ran_out

            result["reason"] = ran_out(job.train.patience)
    if metrics:
        plot(metrics, out / "accuracy.png", job.name,
             (result["epoch"], result.get("seconds_to_best")) if "epoch" in result else None)
    if (out / "model.pt").exists():
        result.update(evaluate(job))
    seconds = round(time.time() - since, 1) if since else None
    result["seconds"] = seconds
    if runs is not None:
        runs[-1]["seconds"] = seconds
        result["runs"] = runs
        if earlier:
            result["seconds_in_all"] = round(sum(run["seconds"] for run in runs), 1)
    result.update({"learners": job.train.learners, "epochs": job.train.epochs, "patience": job.train.patience,
                   "written_by": os.getpid()})
    if bridge is not None:
        result["bridge"] = bridge
    _replace(out / "result.json", json.dumps(result, indent=1) + "\n")
    return result


def chosen(job: jobfile.Job, kind: str, runs: list[dict] | None = None) -> dict:
    """Hand back the model chosen on the validation set: model.pt becomes checkpoints/best.pt
    (learner 0's best evaluation, `gadei.selection`) in place of the weights the job ended
    with, and result.json's fields say which evaluation it is (epoch, version, validation
    accuracy and loss, and `seconds_to_best`: when it was made, in the job's time base of its
    `runs`, `job_seconds`) and why training stopped: "patience" (the validation accuracy stopped
    improving), "cap" (the [train] epochs ran out) or "cancelled" (the job was stopped before
    either). A run without a selection (a bridged node's: the nodes' model is the one their
    bridge agreed on) keeps its last weights and says only why it stopped. Safe to repeat: a
    writer killed mid-way leaves model.pt whole, and the next one copies best.pt again."""
    import torch

    from . import selection

    folder = job.output / "checkpoints"
    state = selection.read_state(folder) or {}
    stopped = "patience" if state.get("stopped") == "patience" else "cap" if kind == DONE else "cancelled"
    fields: dict = {"stopped": stopped}
    weights = selection.best_weights(folder)
    if weights is None:
        return fields
    _replace_with(job.output / "model.pt", lambda tmp: torch.save(weights, tmp))
    best = state.get("best") or {}
    fields.update({key: best[key] for key in ("epoch", "version", "validation_accuracy", "validation_loss")
                   if key in best})
    took = job_seconds(best.get("at"), runs)
    if took is not None:
        fields["seconds_to_best"] = took
    fields["evaluations"] = state.get("evaluations", 0)
    return fields


def evaluate(job: jobfile.Job) -> dict:
    """model.pt's test accuracy, evaluated on the whole test set (the test set chooses nothing)."""
    import torch
    from gadei_workloads import get

    train, _, test = data.load_job(job)
    workload = get(job.workload)
    model = workload.build_model(train, job.train.seed)
    model.load_state_dict(torch.load(job.output / "model.pt", weights_only=True))
    return {"test_accuracy": workload.evaluate(model, test), "test_samples": len(test)}


def _replace(path: Path, text: str) -> None:
    _replace_with(path, lambda tmp: tmp.write_text(text))


def _replace_with(path: Path, write) -> None:
    """Write `path` whole or not at all: `write(tmp)` beside it, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def epoch_records(out: Path) -> list[dict]:
    """The evaluating learner's epoch records (learner 0 writes JSON lines to its log)."""
    path = out / "logs" / "learner-0.log"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        if line.startswith('{"event": "epoch"'):
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def last_epoch(out: Path) -> dict:
    records = epoch_records(out)
    return records[-1] if records else {}


def write_metrics(out: Path, runs: list[dict] | None = None) -> list[dict]:
    """metrics.jsonl: per epoch of the evaluating learner (a restarted one's epochs replace the
    lost ones; its catch-up record of the epoch it went on after, "restarted", is kept only
    where the epoch has no record of its own: its last run was killed before writing it), each
    with `seconds_since_start`, when its evaluation was made in the job's time base (`runs`,
    `job_seconds`; absent where unknown)."""
    by_epoch: dict[int, dict] = {}
    for record in epoch_records(out):
        if record.get("restarted") and record["epoch"] in by_epoch:
            continue
        by_epoch[record["epoch"]] = {k: v for k, v in record.items() if k not in ("event", "job", "learner")}
    metrics = [by_epoch[e] for e in sorted(by_epoch)]
    for record in metrics:
        took = job_seconds(record.get("evaluated_at"), runs)
        if took is not None:
            record["seconds_since_start"] = took
    _replace(out / "metrics.jsonl", "".join(json.dumps(record) + "\n" for record in metrics))
    return metrics


def load_plotting() -> None:
    """Import matplotlib on `figure`'s backend ahead of `plot`: `gadei run` does while its job
    trains, so that the job's outputs do not wait for the import (about half a second on 2
    cores) once it ends. An import that fails here fails again in `plot`, which says so."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no screen
        import matplotlib.pyplot  # noqa: F401
    except Exception:  # noqa: BLE001 - `plot` reports it
        pass


def plot(metrics: list[dict], path: Path, title: str, chosen: tuple | None = None) -> None:
    """accuracy.png (`figure`), written whole or not at all."""
    fig = figure(metrics, title, chosen)
    import matplotlib.pyplot as plt  # on the backend `figure` chose

    _replace_with(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)


def figure(metrics: list[dict], title: str, chosen: tuple | None = None):
    """accuracy.png's figure: validation and test accuracy against epochs and against seconds
    since the job's start (metrics.jsonl's `seconds_since_start`, the time base of result.json's
    `seconds_to_best`; where no record has it, the epochs' training seconds added up), the
    chosen model marked: `chosen`, result.json's (epoch, seconds_to_best), else the last epoch
    whose model was the best so far; and, where the records carry them, a second row against
    epochs: the evaluating learner's samples/s, and the staleness of the job's applied
    gradients (the epoch's mean, the largest so far)."""
    import matplotlib

    matplotlib.use("Agg")  # no screen
    import matplotlib.pyplot as plt

    since_start = any("seconds_since_start" in m for m in metrics)
    seconds, total = {}, 0.0
    for m in metrics:
        total += m.get("epoch_seconds", 0.0)
        if not since_start:
            seconds[m["epoch"]] = total
        elif "seconds_since_start" in m:  # unknown for the records of a run whose time is unknown
            seconds[m["epoch"]] = m["seconds_since_start"]
    pace = any(key in m for m in metrics for key in ("samples_per_s", "staleness_mean", "staleness_max"))
    fig, axes = plt.subplots(2 if pace else 1, 2, figsize=(10, 7 if pace else 4), squeeze=False)
    by_epoch, by_time = axes[0]
    by_time.sharey(by_epoch)
    for key, label in (("validation_accuracy", "validation"), ("test_accuracy", "test")):
        points = [(m["epoch"], 100 * m[key]) for m in metrics if key in m]
        if not points:
            continue
        by_epoch.plot([e for e, _ in points], [a for _, a in points], marker="o", label=label)
        timed = [(seconds[e], a) for e, a in points if e in seconds]
        by_time.plot([t for t, _ in timed], [a for _, a in timed], marker="o", label=label)
    if chosen is None:
        best = [m for m in metrics if m.get("best")]
        chosen = (best[-1]["epoch"], seconds.get(best[-1]["epoch"])) if best else None
    elif not since_start:  # the time axis is the epochs' training seconds: the chosen epoch's
        chosen = (chosen[0], seconds.get(chosen[0]))
    if chosen is not None:
        epoch, at = chosen
        by_epoch.axvline(epoch, color="grey", linestyle="--", label=f"chosen: epoch {epoch:g}")
        if at is not None:
            by_time.axvline(at, color="grey", linestyle="--")
    by_epoch.set_xlabel("epoch")
    by_epoch.set_ylabel("accuracy (%)")
    by_time.set_xlabel("seconds since the job's start" if since_start else "seconds of training")
    if any("validation_accuracy" in m or "test_accuracy" in m for m in metrics):
        by_epoch.legend(loc="lower right")
    if pace:
        _pace(axes[1], metrics)
    from matplotlib.ticker import MaxNLocator

    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        if ax.get_xlabel() == "epoch":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no epoch 2.5
    fig.suptitle(f"gadei job {title}")
    fig.tight_layout()
    return fig


def _pace(axes, metrics: list[dict]) -> None:
    """accuracy.png's second row: samples/s, and staleness, against epochs."""
    rate, stale = axes
    points = [(m["epoch"], m["samples_per_s"]) for m in metrics if isinstance(m.get("samples_per_s"), (int, float))]
    rate.plot([e for e, _ in points], [r for _, r in points], marker="o", color="tab:green")
    rate.set_ylim(bottom=0)
    rate.set_xlabel("epoch")
    rate.set_ylabel("samples/s")
    rate.set_title("learner 0's samples/s", fontsize=10)
    for key, label, style in (("staleness_mean", "mean in the epoch", "o-"), ("staleness_max", "largest so far", "s--")):
        points = [(m["epoch"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
        if points:
            stale.plot([e for e, _ in points], [s for _, s in points], style, label=label)
    stale.set_ylim(bottom=0)
    stale.set_xlabel("epoch")
    stale.set_ylabel("versions")
    stale.set_title("staleness of the applied gradients", fontsize=10)
    if stale.lines:
        stale.legend(loc="upper left", fontsize=8)
