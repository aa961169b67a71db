"""A run's outputs in its folder, written once, at the job's end, by the job's supervisor (the one process that decides
that the job ended, and how: `conclude`): metrics.jsonl from the learners' epoch records, the plot (accuracy.png),
model.pt (the model chosen on the validation set, else the weights the job ended with) and result.json last (the
job's outcome, which model was chosen and why training stopped, its test accuracy). This module is the only one that
writes them, and only the supervisor calls it to (tests/test_owners.py holds both); a run's clients (`gadei run`,
the daemon) read result.json (`read_result`) and say what it says (`summary`, `exit_code`). Each file is written
beside its place and renamed there (a reader never sees half of one); result.json, last, says the rest are there.

result.json's "outcome" is one of OUTCOMES, decided from how the supervisor saw the job end (`Ending`: the job
finished, was stopped, or failed: the server died for good, a launched learner was given up, the server stopped
the job as failed), the model there is to hand back, and the evaluating learner's losses (not finite: diverged).

One time base for a job however many runs it took: seconds since the job's start, the start of its first run (when
its supervisor started), counting only the time its runs ran (`job_seconds`). result.json's "runs" are each run's
start (wall clock) and seconds, "seconds" this run's, a resumed run's "seconds_in_all" all of them (`forget` carries
the earlier runs over from their result.json before it removes it: `EARLIER`); its "seconds_to_best" (the chosen
model's time), metrics.jsonl's "seconds_since_start" (each epoch's evaluation) and accuracy.png's time axis are in
that base, and so is `gadei run`'s last line (`summary`).

A job that picks its model (`workload = "auto"`) trains its candidates one after another, each a run of its own in
candidates/<workload>/ (`candidates`: their order, cheapest first, is ORDER, written by `gadei.prepare`), whose
outputs its supervisor writes as each ends; at the job's end the job's own are the choice's (`conclude`): the chosen
model's model.pt and plot (a candidate's, or the candidates' mean: `gadei.ensemble`), every candidate's epochs in
metrics.jsonl, and a result.json that names the chosen model and each candidate's outcome, validation accuracy and
seconds. `gadei predict` reads the chosen candidate's folder, or each member's of the mean (`model_folders`);
`--resume` goes on with the candidate it was training (`going_on`), keeping those that ended for good.
"""

import json
import logging
import math
import os
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from . import board, data, ensemble, files, jobfile, zygote
from .errors import GadeiError

EARLIER = "logs/earlier-runs.json"  # a resumed run's record of the runs it goes on from (start, seconds)
EPOCHS = "logs/epochs.jsonl"  # the evaluating learner's records (`gadei learn --records`), a JSON line each
DONE, STOPPED, FAILED, DIVERGED = "done", "stopped", "failed", "diverged"
OUTCOMES = (DONE, STOPPED, FAILED, DIVERGED)
EXIT_CODES = {DONE: 0, STOPPED: 130, FAILED: 1, DIVERGED: 3}  # `gadei run`'s, by outcome (130: as for a Ctrl-C)
_RUN_FILES = ("result.json", "metrics.jsonl", "accuracy.png", "model.pt")  # and EPOCHS, unless resumed
CANDIDATES = "candidates"  # a job that picks its model: each candidate's run folder, candidates/<workload>
ORDER = "candidates/order.json"  # the order they train in, cheapest first, and the estimates it was made by


@dataclass
class Ending:
    """How the job's supervisor saw the job end.

    Attributes:
        code: why its watch ended (`gadei.supervisor`'s codes: 0 the job stopped, 3 the server
            died for good, 4 launched learners were given up, 5 the server stopped the job as
            failed).
        finished: every launched learner finished its schedule.
        stopped: a stop was asked (Ctrl-C, `gadei cancel`, `gadei stop`) before training ended.
        reason: why, in words, where it did not end well; else a note ("the stop came after
            training ended").
        final: the weights the job ended with (the server's checkpoint at its stop, or a
            bridged node's agreed model), handed back where no model was chosen on validation.
        first_applied: when (time.time()) the job's first gradient was applied; 0: unknown.
    """

    code: int = 0
    finished: bool = False
    stopped: bool = False
    reason: str = ""
    final: str | None = None
    first_applied: float = 0.0


def forget(out: Path, resume: bool = False) -> None:
    """Before a run (or a resumed one) starts: the outputs of the run before are not this one's
    (nor what a writer of them killed mid-write left), nor its TensorBoard event files unless
    this run resumes it. A resumed run keeps the runs it goes on from (`EARLIER`: their starts
    and seconds, from their result.json's "runs"), the job's time base; where the run before it
    left no result.json (its supervisor was killed), they are unknown, and so is the job's time
    base for this run."""
    earlier = _valid_runs((read_result(out) or {}).get("runs")) if resume else None
    (out / EARLIER).unlink(missing_ok=True)
    if resume:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        files.replace(out / EARLIER, json.dumps({"runs": earlier}) + "\n")
    if not resume:  # a resumed run's TensorBoard curves go on from those of the runs before it
        board.forget(out)
    for name in _RUN_FILES + (() if resume else (EPOCHS,)):  # a resumed run's epochs go on from the ones before
        (out / name).unlink(missing_ok=True)
    files.remove_orphans(out, _RUN_FILES)  # what a writer killed mid-write left


def _valid_runs(runs) -> list[dict] | None:
    """result.json's "runs" as a list of {"started", "seconds"}; None where it is not one."""
    if not isinstance(runs, list) or not runs or not all(
            isinstance(r, dict) and all(isinstance(r.get(k), (int, float)) for k in ("started", "seconds"))
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
    """`out`'s result.json; None where there is none, or no JSON object (half a file, another's)."""
    try:
        found = json.loads((out / "result.json").read_text())
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError):
        return None
    return found if isinstance(found, dict) else None


# ------------------------------------------------------------------ a job that picks its model


@dataclass
class Candidate:
    """One candidate of a job that picks its model, as its folder shows it.

    Attributes:
        workload: its workload's name.
        folder: its run folder (candidates/<workload>/ in the job's output folder).
        result: its result.json (None while it has not ended, or not started).
    """

    workload: str
    folder: Path
    result: dict | None

    @property
    def final(self) -> bool:
        """It ended for good (done, or diverged): a resumed job keeps its result and trains it no more."""
        return self.result is not None and self.result.get("outcome") in (DONE, DIVERGED)

    @property
    def eligible(self) -> bool:
        """It handed back a model chosen on validation (done, or stopped with a model so far)."""
        return self.result is not None and self.result.get("outcome") in (DONE, STOPPED) and \
            isinstance(self.result.get("validation_accuracy"), (int, float)) and (self.folder / "model.pt").is_file()


def candidate_folder(out: Path, workload: str) -> Path:
    """Where candidate `workload` of the job in `out` runs (a run folder of its own)."""
    return out / CANDIDATES / workload


def candidates(out: Path) -> list[Candidate] | None:
    """The candidates of the job in `out`, in the order they train (ORDER), each with its
    result.json; None for a job that names its workload, or an ORDER not as `gadei run` writes it
    (its "order" not a list of workloads' names, each a folder's)."""
    try:
        order = json.loads((out / ORDER).read_text())["order"]
    except (FileNotFoundError, NotADirectoryError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(order, list) or not all(isinstance(w, str) and w.isidentifier() for w in order):
        return None
    return [Candidate(w, candidate_folder(out, w), read_result(candidate_folder(out, w))) for w in order]


def chosen(found: list[Candidate]) -> Candidate | None:
    """The candidate whose model the job hands back: the best validation accuracy among those
    that handed one back (on a tie, the lower validation loss, then the one that trained first:
    the cheaper); None where none did."""
    best = None
    for c in found:
        if c.eligible and (best is None or (c.result["validation_accuracy"], -c.result.get("validation_loss", 0.0)) >
                           (best.result["validation_accuracy"], -best.result.get("validation_loss", 0.0))):
            best = c
    return best


def model_folders(out: Path) -> list[Path]:
    """The run folders whose job.toml, maps and model.pt make the model the job in `out` hands
    back: `out`; for a job that picks its model, the chosen candidate's, or each member's of the
    candidates' mean it chose (result.json's "members", `gadei.ensemble`).

    Raises:
        GadeiError: the job picks its model and has not chosen one (its result.json names none), or
            its result.json's "members" are not its candidates.
    """
    found = candidates(out)
    if found is None:
        return [out]
    result = read_result(out) or {}
    members = result.get("members") or [result.get("workload")]  # a result.json older than "members"
    named = [c.workload for c in found]
    if "members" in result and not (isinstance(members, list) and all(m in named for m in members)):
        raise GadeiError(f"{out / 'result.json'}: its \"members\" ({members!r}) are not a list of its candidates "
                         f"({', '.join(named)}), as `gadei run` writes it")
    if members[0] not in named:
        raise GadeiError(f"{out}: the job picks its model among {', '.join(c.workload for c in found)} and has not "
                         "chosen one (its result.json names none): it has not ended, or no candidate handed back a "
                         f"model; each candidate's own folder is in {out / CANDIDATES}")
    return [candidate_folder(out, workload) for workload in members]


@dataclass
class GoOn:
    """Where `--resume` of a stopped run goes on (`going_on`).

    Attributes:
        folder: the run folder whose training goes on: the job's, or the candidate's it was training
            (the job's too where every candidate ended for good: only the choice is left to make).
        found: the checkpoint it goes on from (a `gadei.checkpoint.Checkpoint`); None: a candidate
            that starts afresh after those before it ended for good.
        kept: the candidates that ended for good, whose results are kept.
    """

    folder: Path
    found: object
    kept: list[str]

    def __str__(self) -> str:
        at = f"checkpoint {self.found.path.name} (version {self.found.version:,})" if self.found else ""
        kept = f", keeping {', '.join(self.kept)}" if self.kept else ""
        if self.folder.parent.name == CANDIDATES:
            return f"candidate {self.folder.name}" + (f"'s {at}" if at else " from its start") + kept
        return f"the choice{kept}" if not at else at


def going_on(out: Path, verify: bool = True) -> GoOn | None:
    """Where `--resume` of the run in `out` goes on: its newest checkpoint that records the
    learners' progress; for a job that picks its model, the first candidate that has not ended for
    good, from its newest such checkpoint, or from its start where a candidate before it ended
    for good (where all did and the job's own result.json is missing, its supervisor died making
    the choice: that is left). None: nothing to go on with (the run finished, or never got that
    far). `verify=False`: for words, the tensors not checked (`checkpoint.load`; a resume does)."""
    from . import checkpoint

    found = candidates(out)
    if found is None:
        at = checkpoint.latest(out / "checkpoints", with_progress=True, verify=verify)
        return GoOn(out, at, []) if at is not None else None
    kept = [c.workload for c in found if c.final]
    for c in found:
        if not c.final:
            at = checkpoint.latest(c.folder / "checkpoints", with_progress=True, verify=verify)
            return GoOn(c.folder, at, kept) if at is not None or kept else None
    # every candidate ended for good: the choice is left where its supervisor died before writing it
    return GoOn(out, None, kept) if found and read_result(out) is None else None


def trained(out: Path) -> bool:
    """Whether a run in `out` got as far as a checkpoint (of its own, or of a candidate's)."""
    folders = [out / "checkpoints", *(out / CANDIDATES).glob("*/checkpoints")]
    return any(f.is_dir() and any(f.iterdir()) for f in folders)


def afresh(folder: Path) -> None:
    """A candidate that starts from its beginning: what an attempt of it left (its outputs, epoch
    records, checkpoints and model selection) is not this one's."""
    forget(folder)
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)


def conclude(job: jobfile.Job, ending: Ending, *, since: float | None, bridge: dict | None = None) -> dict:
    """Write the outputs of the job that ran in `job.output` and ended as `ending` says:
    metrics.jsonl, accuracy.png, model.pt, and result.json last; result.json's content. Its
    supervisor alone calls this, once, at the job's end. `since`: when this run started (wall
    clock), the job's time base; `bridge`: what a bridged node's bridge did, for result.json.
    Where one cannot be written (a full disk), result.json alone is: the job failed, and why.

    Raises:
        OSError: not even result.json could be written.
    """
    earlier = _earlier_runs(job.output)
    # the job's runs (this one's seconds are known at its end: nothing comes after it)
    runs = earlier + [{"started": since, "seconds": 0.0}] if since and earlier is not None else None
    try:
        return _conclude(job, ending, since, runs, earlier, bridge)
    except OSError as err:
        why = f"its outputs could not be written: {f'{err.filename}: ' if err.filename else ''}{err.strerror or err}"
        result = {"job": job.name, "outcome": FAILED, "finished": False,
                  "reason": f"{ending.reason}; {why}" if ending.reason and ending.code else why}
        return _finish(job, result, since, runs, earlier, ending.first_applied)


def _conclude(job: jobfile.Job, ending: Ending, since: float | None, runs: list[dict] | None,
              earlier: list[dict] | None, bridge: dict | None) -> dict:
    out = job.output
    if job.workload == jobfile.AUTO:
        return _finish(job, _choice(job, ending, runs), since, runs, earlier, ending.first_applied)
    metrics = write_metrics(out, runs)
    handed = hand_back(job, ending, runs, chooses=bridge is None)
    kind, reason = outcome(job, metrics, ending, model=(out / "model.pt").exists())
    result = {"job": job.name, "outcome": kind, "finished": kind == DONE, "reason": reason}
    if (out / "model.pt").exists() and kind in (DONE, STOPPED):
        result.update(handed)
        if result.get("stopped") == "patience":
            from .selection import ran_out

            result["reason"] = ran_out(job.train.patience)
        if kind == DONE and ending.reason:
            result["reason"] += f" ({ending.reason})"
    if metrics:
        plot(metrics, out / "accuracy.png", job.name,
             (result["epoch"], result.get("seconds_to_best")) if "epoch" in result else None)
    if (out / "model.pt").exists():
        result.update(evaluate(job, metrics, result))
    if bridge is not None:
        result["bridge"] = bridge
    return _finish(job, result, since, runs, earlier, ending.first_applied)


def _finish(job: jobfile.Job, result: dict, since: float | None, runs: list[dict] | None,
            earlier: list[dict] | None, first: float) -> dict:
    """result.json's times and the job's settings added, and it written (last): its content.
    `first`: when the job's first gradient was applied (0: unknown)."""
    out = job.output
    seconds = round(time.time() - since, 1) if since else None
    result["seconds"] = seconds
    if since and isinstance(first, (int, float)) and first >= since:
        result["seconds_to_first_update"] = round(first - since, 3)
    if runs is not None:
        runs[-1]["seconds"] = seconds
        result["runs"] = runs
        if earlier:
            result["seconds_in_all"] = round(sum(run["seconds"] for run in runs), 1)
    result.update({"learners": job.train.learners, "epochs": job.train.epochs, "patience": job.train.patience,
                   "written_by": os.getpid()})
    files.replace(out / "result.json", json.dumps(result, indent=1) + "\n")
    return result


def _choice(job: jobfile.Job, ending: Ending, runs: list[dict] | None) -> dict:
    """The outputs of a job that picks its model, once its candidates ended as their result.json
    say (written as each ended): model.pt and accuracy.png the chosen model's, metrics.jsonl
    every candidate's epochs (each with its "workload"), and result.json's fields: the chosen
    "workload" (a candidate's, or the candidates' mean, `gadei.ensemble`: "ngram+textcnn") and its
    "members", why ("choice"), each candidate's figures ("candidates") and the mean's ("mean"),
    and the chosen model's (a candidate's epoch; validation accuracy, seconds to it in the job's
    time base, test accuracy)."""
    from . import params, selection

    out = job.output
    found = candidates(out) or []
    best = chosen(found)
    metrics = []
    for c in found:
        for record in (_read_metrics(c.folder) if c.result is not None else []):
            record = {"workload": c.workload, **record}
            took = job_seconds(record.get("evaluated_at"), runs)
            record.pop("seconds_since_start", None)  # the candidate's own time base: the job's instead
            metrics.append({**record, **({"seconds_since_start": took} if took is not None else {})})
    files.replace(out / "metrics.jsonl", "".join(json.dumps(record) + "\n" for record in metrics))
    kind, reason = _choice_outcome(found, best, ending)
    result = {"job": job.name, "outcome": kind, "finished": kind == DONE, "reason": reason,
              "workload": best.workload if best else None,
              "candidates": [figures(c) for c in found]}
    if best is None:
        return result
    named, fields = ensemble.choose([c.folder for c in found if c.eligible], best.workload)
    members = [c for c in found if c.workload in named]
    result.update(members=named, **fields)
    if len(members) > 1:
        params.save(ensemble.state([c.folder for c in members]), str(out / "model.pt"), private=job.private)
    else:
        import torch

        params.save(torch.load(best.folder / "model.pt", weights_only=True), str(out / "model.pt"),
                    private=job.private)
        result.update({key: best.result[key] for key in ("epoch", "version", "validation_accuracy",
                                                         "validation_loss", "evaluations", "stopped",
                                                         "test_accuracy", "test_samples") if key in best.result})
    result["choice"] = ensemble.choice_line(result)
    took = [job_seconds(((selection.read_state(c.folder / "checkpoints") or {}).get("best") or {}).get("at"), runs)
            for c in members]
    if None not in took:  # the mean's: when its last member's model was made
        result["seconds_to_best"] = max(took)
    if result.get("stopped") == "patience":
        result["reason"] += f"; {best.workload}'s {selection.ran_out(job.train.patience)}"
    marks = {c.workload: (c.result["epoch"], at) for c, at in zip(members, took) if "epoch" in c.result}
    if metrics:
        plot(metrics, out / "accuracy.png", f"{job.name}: " + (
            f"the mean of {' and '.join(named)} (chosen)" if len(members) > 1 else f"{best.workload} (chosen)"),
            marks, {**result["mean"], "seconds_to_best": result.get("seconds_to_best")} if len(members) > 1 else None)
    return result


def _read_metrics(folder: Path) -> list[dict]:
    try:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def figures(c: Candidate) -> dict:
    """A candidate's line of result.json's "candidates": its outcome and why where it did not
    finish, the epoch and validation accuracy of its model, its test accuracy, and its seconds
    (with its runs before, where it was resumed)."""
    r = c.result
    if r is None:
        return {"workload": c.workload, "outcome": None}
    figures = {"workload": c.workload, "outcome": r.get("outcome")}
    if r.get("outcome") != DONE:
        figures["reason"] = r.get("reason")
    figures.update({key: r[key] for key in ("epoch", "validation_accuracy", "validation_loss", "test_accuracy",
                                            "stopped") if key in r})
    seconds = r.get("seconds_in_all", r.get("seconds"))
    if isinstance(seconds, (int, float)):
        figures["seconds"] = seconds
    return figures


def _choice_outcome(found: list[Candidate], best: Candidate | None, ending: Ending) -> tuple[str, str]:
    """(one of OUTCOMES, why) of a job that picks its model: stopped where a stop came before every
    candidate ended; done where one handed back a model (a candidate that failed or diverged is
    named); else diverged where every candidate that ended diverged, failed otherwise."""
    ended = [c for c in found if c.result is not None]
    trouble = "; ".join(f"{c.workload} {c.result.get('outcome')}: {c.result.get('reason')}" for c in ended
                        if c.result.get("outcome") in (FAILED, DIVERGED))
    if ending.stopped:
        if not any(c.result is not None and (c.folder / "model.pt").is_file() for c in found):
            return STOPPED, "stopped before the job wrote a model"
        return STOPPED, "stopped before its end" + (f" ({ending.reason})" if ending.reason else "")
    if best is not None:
        return DONE, f"every candidate ended ({len(ended)} of {len(found)})" + (f"; {trouble}" if trouble else "")
    if ended and all(c.result.get("outcome") == DIVERGED for c in ended):
        return DIVERGED, ended[0].result.get("reason", "")
    return FAILED, ending.reason or f"no candidate handed back a model: {trouble or 'see the logs'}"


def outcome(job: jobfile.Job, metrics: list[dict], ending: Ending, model: bool) -> tuple[str, str]:
    """(one of OUTCOMES, a sentence saying why) for a job that ended as `ending` says, with or
    without a `model` to hand back."""
    for record in metrics:
        loss = record.get("loss")
        if isinstance(loss, (int, float)) and not math.isfinite(loss):
            return DIVERGED, (f"the training loss is {loss} after epoch {record.get('epoch')}: training diverged; "
                              f"the learning rate is likely too high (lr {job.train.lr:g}), lower [train] lr")
    if ending.code != 0:
        return FAILED, ending.reason or f"the supervisor ended with {ending.code}"
    if not model:
        if ending.stopped and not ending.reason:  # stopped while it started: nothing trained, nothing went wrong
            return STOPPED, "stopped before the job wrote a model"
        return FAILED, ending.reason or "the job ended without a model (see its logs)"
    if ending.finished:
        return DONE, "every learner finished its epochs"
    return STOPPED, "stopped before its end" + (f" ({ending.reason})" if ending.reason else "")


def hand_back(job: jobfile.Job, ending: Ending, runs: list[dict] | None = None, chooses: bool = True) -> dict:
    """model.pt: the model chosen on the validation set (learner 0's best evaluation,
    checkpoints/best.pt: `gadei.selection`) where one was chosen (`chooses`: not a bridged node,
    whose model is the one its bridge agreed on), else the weights the job ended with
    (`ending.final`); and result.json's fields that say which evaluation it is (epoch, version,
    validation accuracy and loss, and `seconds_to_best`: when it was made, in the job's time
    base of its `runs`, `job_seconds`) and why training stopped: "patience" (the validation
    accuracy stopped improving), "cap" (the [train] epochs ran out) or "cancelled" (the job was
    stopped before either)."""
    from . import params, selection

    folder = job.output / "checkpoints"
    state = selection.read_state(folder) or {}
    stopped = "patience" if state.get("stopped") == "patience" else "cap" if ending.finished and not \
        ending.stopped else "cancelled"
    fields: dict = {"stopped": stopped}
    weights = selection.best_weights(folder) if chooses else None
    if weights is None:
        weights = _final_weights(ending.final) if ending.final else None
        if weights is not None:
            params.save(weights, str(job.output / "model.pt"), private=job.private)
        return fields
    params.save(weights, str(job.output / "model.pt"), private=job.private)
    best = state.get("best") or {}
    fields.update({key: best[key] for key in ("epoch", "version", "validation_accuracy", "validation_loss")
                   if key in best})
    took = job_seconds(best.get("at"), runs)
    if took is not None:
        fields["seconds_to_best"] = took
    fields["evaluations"] = state.get("evaluations", 0)
    return fields


def _final_weights(path: str):
    """The state dict a stop checkpoint (`ckpt-N.pt`) or a saved model file holds; None where unreadable."""
    import torch

    from . import checkpoint

    try:
        if os.path.basename(path).startswith("ckpt-"):
            return checkpoint.load(path).model
        return torch.load(path, weights_only=True)
    except (OSError, RuntimeError, GadeiError, ValueError) as err:
        logging.getLogger(__name__).error("%s: cannot read the job's final weights: %s", path, err)
        return None


RUN, SUBMIT = "gadei run", "gadei submit"  # the commands that start a job: in the foreground, or by the daemon
AFRESH = "to run the job again, set another [output] folder or remove that one"


def go_on(path: Path | str | None, by: str = RUN, resume: bool = True) -> str:
    """The command that goes on with the stopped run of the job file `path`: `gadei run --resume
    JOB.toml`, or, for a job the daemon runs (`by` SUBMIT), `gadei submit --resume JOB.toml`
    (not `resume`: the command without --resume); the path quoted for a shell."""
    return f"`{by}{' --resume' if resume else ''}{f' {shlex.quote(str(path))}' if path else ''}`"


def finished(out: Path) -> str | None:
    """The run in the output folder `out` finished (its result.json says outcome done), in
    words (when, and why training stopped); None for any other run, or none."""
    result = read_result(out)
    if result is None or result.get("outcome") != DONE:
        return None
    try:
        when = time.strftime(" on %Y-%m-%d at %H:%M:%S", time.localtime((out / "result.json").stat().st_mtime))
    except OSError:
        when = ""
    why = f", stopped by {result['stopped']}" if result.get("stopped") else ""
    return f"the run in {out} finished (outcome done{when}{why})"


def summary(job: jobfile.Job, result: dict, by: str = RUN, elapsed: float | None = None) -> str:
    """The job's outcome (result.json) in one line for people ("job NAME done in ..."): `gadei
    run`'s last line, the supervisor's, the daemon's record. `by`: the command that started the
    job, which a stopped run's line names to go on with it; `elapsed`: seconds, said only where
    result.json has none."""
    out = job.output
    accuracy = f", test accuracy {result['test_accuracy']:.2%}" if "test_accuracy" in result else ""
    # result.json's seconds, the job's time base: as "reached after" counts
    seconds = result["seconds"] if isinstance(result.get("seconds"), (int, float)) else elapsed or 0.0
    took = f"{seconds:.0f} s" + (f" ({result['seconds_in_all']:.0f} s with the runs it resumed)"
                                 if isinstance(result.get("seconds_in_all"), (int, float)) else "")
    kind = result.get("outcome")
    if kind == DIVERGED:
        return f"job {job.name}: {result['reason']}; its outputs and logs are in {out}"
    if kind != DONE and kind != STOPPED:
        return f"job {job.name} failed: {result.get('reason', 'no result.json says how it ended')}; " \
               f"see {out / 'logs'}"
    # the chosen model (`hand_back`): its time in the job's time base too
    reached = f", reached after {result['seconds_to_best']:.0f} s" if "seconds_to_best" in result else ""
    best = (f"epoch {result['epoch']:g} (validation accuracy {result['validation_accuracy']:.2%}{reached})"
            if "epoch" in result else "")
    picked = f"{result['workload']}'s " if result.get("workload") else ""  # a job that picks its model
    mean = len(result.get("members") or ()) > 1  # the candidates' mean (`gadei.ensemble`): no epoch of its own
    if mean:
        picked, best = "", f"the mean, {result['workload']} (validation accuracy {result['validation_accuracy']:.2%}" \
            f"{reached})"
    if kind == STOPPED:
        found = candidates(out)
        where = going_on(out, verify=False) if found else None  # the candidate it was training: its epochs
        last = last_epoch(where.folder if where else out)
        if not (out / "model.pt").exists():
            model = "before it wrote a model"
        else:
            model = (f"the model chosen so far, {picked}{best}, is in" if best else "its weights so far are in") + \
                f" {out / 'model.pt'}"
        training = f"candidate {where.folder.name}, " if where and where.folder != out else ""
        epochs = result.get("epochs", job.train.epochs)  # the run's: the job file may leave them to the defaults
        return (f"job {job.name} stopped after {took} ({training}epoch {last.get('epoch', 0)} of "
                f"{epochs}{'' if picked or mean else accuracy}); {model}; {again(job, by)}")
    chose = (f", stopped by {result['stopped']}" if "stopped" in result else "") + (f", chose {best}" if best else "")
    if mean:
        chose = f", chose {ensemble.choice_line(result)}"
    elif picked:  # which candidate and why; then its model, as a job's
        chose = (f", chose {ensemble.choice_line(result)}; {result['workload']}"
                 + (f" stopped by {result['stopped']}" if "stopped" in result else "")
                 + (f", its model of {best}" if best else ""))
    return f"job {job.name} done in {took}{chose}{accuracy}; model {out / 'model.pt'}"


def again(job: jobfile.Job, by: str) -> str:
    """How to go on with a stopped run, as its output folder allows: `--resume` from a checkpoint
    that records the learners' progress, or, stopped before any was taken (while it started),
    the same command again, which a folder without checkpoints takes (`prepare.check`)."""
    if going_on(job.output, verify=False) is not None:
        return f"go on with {go_on(job.path, by)}"
    if not trained(job.output):
        command = go_on(job.path, by, resume=False) if job.path else "the same command"
        return f"it had not started training; start it again with {command}"
    folder = job.output / (CANDIDATES if candidates(job.output) is not None else "checkpoints")
    return f"no checkpoint in {folder} records the learners' progress, so there is nothing to go on with; {AFRESH}"


def exit_code(result: dict | None) -> int:
    """`gadei run`'s exit code for a job that ended as `result` (result.json) says: 0 done, 130
    stopped, 1 failed (also where no result.json says), 3 diverged."""
    return EXIT_CODES.get((result or {}).get("outcome"), 1)


def first_update_at(result: dict) -> float | None:
    """When (time.time()) the job whose result.json is `result` had its first gradient applied,
    in its last run: that run's start and `seconds_to_first_update` after it. None where
    result.json does not say (no update recorded, or a malformed record)."""
    runs, seconds = result.get("runs"), result.get("seconds_to_first_update")
    last = runs[-1] if isinstance(runs, list) and runs and isinstance(runs[-1], dict) else {}
    started = last.get("started")
    return started + seconds if isinstance(started, (int, float)) and isinstance(seconds, (int, float)) else None


def evaluate(job: jobfile.Job, metrics: list[dict] = (), handed: dict | None = None) -> dict:
    """model.pt's test accuracy, on the whole test set (the test set chooses nothing). Where
    model.pt is an epoch's evaluated model (`handed`: its epoch and version, `hand_back`'s) and
    that epoch's record in `metrics` has the test accuracy the evaluating learner measured on
    the same weights, that figure; else model.pt evaluated here."""
    import torch
    from gadei_workloads import get

    workload = get(job.workload)
    # the sets its supervisor read (`data.keep`)
    train, _, test = data.load(workload, f"job:{job.path}") if job.path else data.load_job(job)
    epoch, version = (handed or {}).get("epoch"), (handed or {}).get("version")
    measured = [r.get("test_accuracy") for r in metrics if (r.get("epoch"), r.get("version")) == (epoch, version)]
    if epoch is not None and measured and isinstance(measured[-1], float):
        return {"test_accuracy": measured[-1], "test_samples": len(test)}
    with zygote.one_thread():  # its supervisor may fork after (the next candidate of a job that picks its model)
        model = workload.build_model(train, job.train.seed)
        model.load_state_dict(torch.load(job.output / "model.pt", weights_only=True))
        accuracy = workload.evaluate(model, test)
    return {"test_accuracy": accuracy, "test_samples": len(test)}


def epoch_records(path: Path) -> list[dict]:
    """The evaluating learner's epoch records in `path` (its --records, a JSON line each: a run's `out / EPOCHS`)."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "epoch":
            records.append(record)
    return records


def last_epoch(out: Path) -> dict:
    return (epoch_records(out / EPOCHS) or [{}])[-1]


def write_metrics(out: Path, runs: list[dict] | None = None) -> list[dict]:
    """metrics.jsonl: per epoch of the evaluating learner (a restarted one's epochs replace the
    lost ones; its catch-up record of the epoch it went on after, "restarted", is kept only
    where the epoch has no record of its own: its last run was killed before writing it), each
    with `seconds_since_start`, when its evaluation was made in the job's time base (`runs`,
    `job_seconds`; absent where unknown)."""
    by_epoch: dict[int, dict] = {}
    for record in epoch_records(out / EPOCHS):
        if record.get("restarted") and record["epoch"] in by_epoch:
            continue
        by_epoch[record["epoch"]] = {k: v for k, v in record.items() if k not in ("event", "job", "learner")}
    metrics = [by_epoch[e] for e in sorted(by_epoch)]
    for record in metrics:
        took = job_seconds(record.get("evaluated_at"), runs)
        if took is not None:
            record["seconds_since_start"] = took
    files.replace(out / "metrics.jsonl", "".join(json.dumps(record) + "\n" for record in metrics))
    return metrics


def plot(metrics: list[dict], path: Path, title: str, chosen: tuple | dict | None = None,
         mean: dict | None = None) -> None:
    """accuracy.png (`gadei.curves.figure`), written whole or not at all: the figure drawn once,
    its pixels saved by Pillow (matplotlib's own dependency) at a low zlib level, RGB. The job
    waits for it (its outputs are written before it ends): 0.10 s (0.08 to draw, 0.02 to save)
    where savefig took 0.15 s, compressing the alpha channel too, for a file 3% larger."""
    import numpy
    from PIL import Image

    from .curves import figure

    fig = figure(metrics, title, chosen, mean)
    fig.canvas.draw()
    pixels = Image.fromarray(numpy.asarray(fig.canvas.buffer_rgba())[..., :3])
    files.replace(path, lambda out: pixels.save(out, format="png", compress_level=1))
