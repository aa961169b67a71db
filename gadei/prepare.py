"""A job made ready to run, before anything starts: `gadei run`'s (and `gadei submit`'s) checks of
the job file, its data, the region's name and the output folder (`check`, `check_output`),
the defaults filled in, the point a resumed run goes on from (`resume_point`), and the output
folder's job.toml, maps and placement (`prepare`), which the job's supervisor runs from; what
`gadei run` says of the job before it starts (`describe`).

A job that picks its model (`workload = "auto"`) is made ready with its candidates: each one's
job (the candidate's workload, its defaults) and data (its vocabulary), ordered cheapest first by
`gadei_workloads.cost`, and written to its own run folder (`outputs.candidate_folder`) with the
order (`outputs.ORDER`); a resumed one keeps the candidates that ended for good as they are.

`place` everywhere here: where the job runs (`gadei.placement`: on this machine alone, or as one
node of a bridged job).
"""

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import claim, data, jobfile, outputs
from .env import cores_said, learners_openmp_env, usable_cores
from .errors import GadeiError, JobRunning
from .outputs import AFRESH, RUN, finished, go_on
from .placement import NODE, Local
from .transport.options import TransportOptions


@dataclass
class Prepared:
    """A checked job (defaults filled in), its data, what was chosen for it, the checkpoint it
    resumes from; its output folder holds the job as run and the maps."""

    job: jobfile.Job
    train: object
    test: object
    chosen: list[str]
    read: list  # a gadei_workloads.files.FileReport per data file
    found: object = None
    validation: object = None  # the set the model is chosen on ([data] validation or held out of train)
    by: str = RUN  # the command that started the job (RUN or SUBMIT): what the run says to go on with it names it
    candidates: list["Prepared"] | None = None  # a job that picks its model: each candidate's, cheapest first
    going_on: object = None  # a resumed run: where it goes on (`outputs.GoOn`; `found` is its checkpoint)
    estimates: list | None = None  # the candidates' `gadei_workloads.cost.Estimate`s, in their order
    claim: object = None  # `prepare`d: this run's claim on the output folder (`gadei.claim.take`), held to its end


def check_job(path: str, *, resume: bool = False, by: str = RUN) -> list[str]:
    """`gadei run --check`: every check `gadei run` makes before it starts (the job file, the
    region's name, the data, the output folder), starting nothing and writing nothing; the
    lines `gadei run` prints before it starts.

    Raises:
        GadeiError: (JobFileError among them) the one-line reason the job would be refused.
    """
    job = jobfile.load(path)
    prepared = check(job, resume, Local(), by=by)
    return describe(prepared, Local())


def check(job: jobfile.Job, resume: bool, place=None, *, by: str = RUN, checked: Prepared | None = None) -> Prepared:
    """Everything that can be refused, before anything starts, writing nothing; `by`: the
    command that starts the job (RUN or SUBMIT), which the refusals name. The output folder is
    checked before the data is read (a large set takes minutes), so a job refused for its folder
    is refused at once. `checked`: this job as checked before, its data files unchanged since
    (`data.fingerprint`; the daemon's submit, then its start): its data sets are taken, not read
    again, and everything else is checked again."""
    place = place or Local()
    job = place.job(job)
    _check_folder(job, resume, by)
    read: list = list(checked.read) if checked is not None else []
    sets = {c.job.workload: (c.train, c.validation, c.test) for c in checked.candidates or [checked]} \
        if checked is not None else None
    picked, estimates = (_candidates(job, read, by, sets) if job.workload == jobfile.AUTO else (None, None))
    if picked is None:
        train, validation, test = sets[job.workload] if sets is not None else data.load_job(job, read)
    else:
        train, validation, test = picked[0].train, picked[0].validation, picked[0].test
    job, chosen = job.with_defaults(len(train), _rows(train))
    where = resume_point(job, nodes=place.size) if resume else None
    return Prepared(job, train, test, chosen, read, where.found if where else None, validation, by, picked, where,
                    estimates)


def _check_folder(job: jobfile.Job, resume: bool, by: str, claimed: bool = False) -> None:
    """What can be refused of the job's name and output folder without its data: the region's
    name taken by another's or a running job's, a folder that cannot take the run, one that
    another run claims now (`gadei.claim`; `claimed`: this one does), what it holds of earlier runs."""
    from .region import check_name_free, inspect

    found = inspect(job.name)
    check_name_free(job.name, found)  # another user's (or a foreign) object in the region's place: say whose, now
    if found is not None and found.state in ("running", "starting"):  # a second run would share its folder
        raise JobRunning(f"job {job.name!r} runs now (its server is pid {found.server_pid}), and a job runs once at a "
                         f"time: wait for it to end, stop it (`gadei stop {job.name}`), or give this one another "
                         "[job] name")
    check_output(job)
    if not claimed:
        claim.check(job.output)
    _check_runs(job, resume, by)


def _check_runs(job: jobfile.Job, resume: bool, by: str) -> None:
    """What the output folder holds of earlier runs, as far as it is judged without the job's data:
    a new run needs a folder no run got far in, a resumed one a run with a checkpoint to go on
    with (`resume_point` then compares the job, its defaults filled in, and verifies the checkpoint)."""
    out = job.output
    if resume:
        if not (out / "job.toml").is_file():
            raise GadeiError(f"--resume: {out} holds no run to go on with (no job.toml)")
        if outputs.going_on(out, verify=False) is None:
            _nothing_to_go_on(job)
    elif outputs.trained(out):
        done = finished(out)
        if done:
            raise GadeiError(f"output folder {out} holds a previous run: {done}; {AFRESH}")
        if outputs.going_on(out, verify=False) is None:  # it ended before a checkpoint recorded its learners' progress
            raise GadeiError(f"output folder {out} holds a previous run, and {outputs.again(job, by)}")
        raise GadeiError(f"output folder {out} holds a previous run (checkpoints/); go on with it with "
                         f"{go_on(job.path, by)}, or set another [output] folder, or remove that one")


def _nothing_to_go_on(job: jobfile.Job) -> None:
    """Refuse a resume of the run in the job's output folder, which has nothing to go on with."""
    out = job.output
    done = finished(out)
    if done:
        raise GadeiError(f"--resume: {done}: there is nothing to go on with; {AFRESH}")
    folder = out / (outputs.CANDIDATES if job.workload == jobfile.AUTO else "checkpoints")
    raise GadeiError(f"--resume: no checkpoint in {folder} that verifies and records the learners' progress, "
                     f"so there is nothing to go on with; {AFRESH}")


def _candidates(job: jobfile.Job, read: list, by: str, sets: dict | None) -> tuple[list[Prepared], list]:
    """A job that picks its model: each candidate's job (its workload, its own output folder, the
    defaults for it) and data (`sets`' by workload, where a check before read them), ordered
    cheapest first (`gadei_workloads.cost`); and the estimates."""
    from gadei_workloads import CANDIDATES
    from gadei_workloads.cost import cheapest_first, estimate

    prepared = {}
    texts = data.read_texts(job, read) if sets is None else None  # read once, encoded for each candidate's workload
    for workload in CANDIDATES:
        candidate = dataclasses.replace(job, workload=workload,
                                        output=outputs.candidate_folder(job.output, workload))
        train, validation, test = sets[workload] if sets is not None else data.load_job(candidate, texts=texts)
        candidate, chosen = candidate.with_defaults(len(train), _rows(train))
        prepared[workload] = Prepared(candidate, train, test, chosen, [], None, validation, by)
    estimates = cheapest_first([estimate(w, p.train) for w, p in prepared.items()])
    return [prepared[e.workload] for e in estimates], estimates


def _rows(train):
    """`rows(batch)` of a text training set (`jobfile.Job.with_defaults`); None for numeric features."""
    from gadei_workloads.text import TextDataset, rows_touched

    return (lambda batch: rows_touched(train, batch)) if isinstance(train, TextDataset) else None


# What `gadei run` writes in its output folder, by kind: an earlier run's of another kind stops it.
_OUTPUT_FOLDERS = ("logs", "checkpoints", outputs.CANDIDATES)
_OUTPUT_FILES = ("job.toml", "labels.json", "vocab.json", "features.json", "node.json", "model.pt", "result.json",
                 "metrics.jsonl", "accuracy.png", data.ENCODED)


def check_output(job: jobfile.Job) -> None:
    """The job's output folder can take a run, checked without writing: it is a folder (not a
    file, a device or a symbolic link) or can be made one in the nearest folder above that
    exists, you may write in it, and what it holds of an earlier run is of the kind a run
    writes (logs/ and checkpoints/ folders, job.toml and the other outputs files).

    Raises:
        GadeiError: naming the job file, the folder and what is wrong with it.
    """
    import stat

    out = job.output
    where = f"{job.path.name if job.path else 'job'}: [output] folder {str(out)!r}"

    def kind(path: Path):
        try:
            return os.lstat(path).st_mode
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            raise GadeiError(f"{where}: cannot be made, a folder above it is a file") from None
        except (OSError, ValueError) as err:
            raise GadeiError(f"{where}: {path.name}: {getattr(err, 'strerror', None) or err}") from None

    def storable(folder: Path, what: str) -> None:
        found = os.statvfs(folder)
        if found.f_flag & os.ST_RDONLY:
            raise GadeiError(f"{where}: {what} on a read-only file system")
        if found.f_blocks == 0:  # procfs, sysfs: no file can be made there, whatever access() says
            raise GadeiError(f"{where}: {what} on a file system that holds no files (such as /proc or /sys)")

    mode = kind(out)
    if mode is None:
        above = out.parent
        while kind(above) is None:
            above = above.parent
        if not stat.S_ISDIR(os.stat(above).st_mode):
            raise GadeiError(f"{where}: cannot be made, {str(above)!r} is not a folder")
        if not os.access(above, os.W_OK | os.X_OK):
            raise GadeiError(f"{where}: cannot be made, you may not write in {str(above)!r}")
        storable(above, "cannot be made, the folder above it is")
        return
    if stat.S_ISLNK(mode):
        raise GadeiError(f"{where}: is a symbolic link; allowed: a folder (give the folder it points to)")
    if not stat.S_ISDIR(mode):
        raise GadeiError(f"{where}: is not a folder")
    if not os.access(out, os.W_OK | os.X_OK):
        raise GadeiError(f"{where}: you may not write in it")
    storable(out, "it is")
    for name in _OUTPUT_FOLDERS + _OUTPUT_FILES:
        mode = kind(out / name)
        if mode is None:
            continue
        folder = name in _OUTPUT_FOLDERS
        if not (stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode)):
            raise GadeiError(f"{where}: its {name} is not a {'folder' if folder else 'file'} (a run writes one "
                             "there); remove it or set another [output] folder")


def prepare(job: jobfile.Job, resume: bool, place=None, by: str = RUN, encoded: bool = False,
            checked: Prepared | None = None) -> Prepared:
    """Everything that can be refused, before anything starts (`check`, with the data sets of
    `checked` where given); then the output folder made ready: an earlier run's outputs gone
    (`outputs.forget`), the job as run (job.toml), the maps, and where it runs (node.json, for a
    bridged node); `encoded`: its data sets too, as encoded here, for a supervisor that is not
    forked with them (`gadei.data.save_encoded`)."""
    place = place or Local()
    prepared = check(job, resume, place, by=by, checked=checked)
    job = prepared.job
    mask = os.umask(0o077)  # what this process creates now is private until the job's modes are known
    try:
        output_modes(job, mask)
        prepared.claim = claim.take(job.output, job.private)
        try:  # a run that took the folder between `check`'s look and the claim ended since, or still
            _check_folder(job, resume, by, claimed=True)  # starts: what it left (or its region) is looked at again
            os.umask(0o077 if job.private else mask)
            _write(prepared, place, resume, encoded and prepared.candidates is None)
            if prepared.candidates is not None:
                _write_candidates(prepared, mask, encoded)
        except BaseException:  # not made ready: the folder is free for the next run at once
            prepared.claim.close()
            raise
    finally:
        os.umask(mask)
    return prepared


def _write(prepared: Prepared, place, resume: bool, encoded: bool = False) -> None:
    job, train, out = prepared.job, prepared.train, prepared.job.output
    outputs.forget(out, resume)  # an earlier run's outputs are not this run's
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "job.toml").write_text(job.to_toml())
    if encoded:
        data.save_encoded(job, (train, prepared.validation, prepared.test))
    else:
        data.forget_encoded(out)  # an earlier run's, of another job.toml
    (out / "labels.json").write_text(json.dumps(train.label_names, ensure_ascii=False))
    if prepared.candidates is not None:
        return  # each candidate's vocabulary is its own (`_write_candidates`)
    if train.vocab is not None:
        (out / "vocab.json").write_text(json.dumps(train.vocab.to_json(), ensure_ascii=False))
    else:  # numeric features: predict standardises with the training set's statistics
        (out / "features.json").write_text(json.dumps({"features": train.features, "mean": train.mean.tolist(),
                                                       "std": train.std.tolist()}))
    node = place.record(job)
    if node is not None:
        (out / NODE).write_text(json.dumps(dataclasses.asdict(node)) + "\n")


def _write_candidates(prepared: Prepared, mask: int, encoded: bool) -> None:
    """Each candidate's run folder made ready, as `_write` makes a job's, and their order
    (`outputs.ORDER`). A resumed run keeps those that ended for good as they are, goes on with the
    others that reached a checkpoint that records the learners' progress, and starts the rest
    afresh (`outputs.afresh`)."""
    from . import checkpoint

    out = prepared.job.output
    before = {c.workload: c for c in (outputs.candidates(out) or [])} if prepared.going_on is not None else {}
    for candidate in prepared.candidates:
        job = candidate.job
        kept = before.get(job.workload)
        if kept is not None and kept.final:
            continue
        goes_on = kept is not None and checkpoint.latest(job.output / "checkpoints", with_progress=True) is not None
        output_modes(job, mask)
        if not goes_on:
            outputs.afresh(job.output)
        _write(candidate, Local(), goes_on, encoded)
    order = {"order": [c.job.workload for c in prepared.candidates],
             "by": "an epoch's arithmetic, then parameters (gadei_workloads.cost.cheapest_first)",
             "estimates": [dataclasses.asdict(e) for e in prepared.estimates]}
    (out / outputs.ORDER).write_text(json.dumps(order, indent=1) + "\n")


def output_modes(job: jobfile.Job, mask: int) -> None:
    """Make the output folder private ([output] private, the default): folders 0700 and files
    0600 whatever the umask, what an earlier run or the daemon left there closed the same way
    (the job's supervisor, and so every process of the job, creates its files so too). With
    private = false the umask `mask` decides, and what the daemon created private is opened up
    to it."""
    import stat

    out = job.output
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise GadeiError(f"output folder {out} is not a folder" + (" (a symbolic link)" if out.is_symlink() else ""))
    if job.private:
        dir_mode, file_mode = 0o700, 0o600
    else:
        dir_mode, file_mode = 0o777 & ~mask, 0o666 & ~mask
    out.mkdir(parents=True, exist_ok=True)
    if out.stat().st_uid != os.geteuid():
        raise GadeiError(f"output folder {out} belongs to uid {out.stat().st_uid}, not to you (uid {os.geteuid()})")
    folders = [out] + [p for p in (out / "logs", out / "checkpoints") if p.is_dir() and not p.is_symlink()]
    for folder in folders:
        os.chmod(folder, dir_mode)
        if folder == out and not job.private:
            continue  # an earlier private run's files stay as they were
        for entry in folder.iterdir():
            info = entry.lstat()
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                os.chmod(entry, file_mode if job.private else (stat.S_IMODE(info.st_mode) | file_mode))


def describe(prepared: Prepared, place) -> list[str]:
    """What `gadei run` prints before it starts (and `gadei run --check`): the job, each data
    file's read line, the chosen defaults, the node, the output folder, the resume point."""
    job, train, test, found = prepared.job, prepared.train, prepared.test, prepared.found
    t = job.train
    picked = prepared.candidates
    lines = [f"{prepared.by}: job {job.name}: "
             + (f"{job.workload} (picks its model among {', '.join(c.job.workload for c in picked)})" if picked else
                job.workload)
             + f" on {len(train):,} training / "
             + (f"{len(prepared.validation):,} validation / " if prepared.validation is not None else "")
             + f"{len(test):,} test samples, "
             f"{train.n_labels} labels" + ("" if picked else f", vocabulary {len(train.vocab):,}"
                                           if train.vocab is not None else f", {train.features} features")
             + f"; {t.learners} learners, {t.mode}, {t.optimizer}, mini-batch {t.batch}, "
             + ("" if picked else f"lr {t.lr:g}, ")
             + (f"at most {t.epochs} epochs (patience {t.patience})" if prepared.validation is not None else
                f"{t.epochs} epoch{'s' if t.epochs != 1 else ''} (no validation set)") + f", seed {t.seed}"]
    lines += [f"  read {report}" for report in prepared.read]
    lines += [f"  chose {line}" for line in prepared.chosen]
    if picked:
        lines += _candidate_lines(prepared)
    lines.append(f"  learners: {_threads_line(t)}")
    lines += place.describe(job)
    lines.append(f"  output: {job.output}" + (f" (each candidate's run in {outputs.CANDIDATES}/<workload>)"
                                              if picked else ""))
    if prepared.going_on is not None and (found is None or prepared.going_on.kept):
        lines.append(f"  resuming with {prepared.going_on}")
    if found is not None:
        lines.append(f"  resuming from {found.path.name} (version {found.version:,}, progress "
                     + ", ".join(f"learner {k}: {v if v == 'done' else f'{v:,} samples'}" for k, v in
                                 sorted(found.progress.items())) + ")")
    return lines


def _candidate_lines(prepared: Prepared) -> list[str]:
    """A job that picks its model: its candidates in the order they train, with what each costs
    (`gadei_workloads.cost`) and what was chosen for each alone (its lr)."""
    costs = []
    for i, (candidate, cost) in enumerate(zip(prepared.candidates, prepared.estimates), 1):
        costs.append(f"{i}. {cost.workload} (vocabulary {len(candidate.train.vocab):,}, {cost.parameters:,} "
                     f"parameters, {cost.epoch_flops / 1e9:,.2g} GFLOP an epoch, lr {candidate.job.train.lr:g})")
    lines = ["  candidates, cheapest first by an epoch's arithmetic: " + ", ".join(costs)
             + "; each trains to its own patience, and their mean is handed back unless one alone is better on "
               "validation by more than a standard error"]
    for candidate in prepared.candidates:
        lines += [f"  {candidate.job.workload}: chose {line}" for line in candidate.chosen
                  if line not in prepared.chosen]
    return lines


def _threads_line(t: jobfile.Train) -> str:
    """How many PyTorch threads each learner takes, and why ([train] threads)."""
    n, cores, where = t.learner_threads, usable_cores(), cores_said()
    said = f"{t.learners} x {n} PyTorch thread{'s' if n != 1 else ''}"
    if "threads" in t.given:
        over = t.learners * n + 1 > cores
        asleep = "; their idle threads sleep (OMP_WAIT_POLICY=PASSIVE)" if learners_openmp_env(t.learners, n) else ""
        return said + " ([train] threads" + (f"; with the server more than the {where}{asleep}" if over else "") + ")"
    if cores - 1 >= t.learners:
        return said + f" (auto: {where}: one for the server, {cores - 1} for the learners)"
    return said + f" (auto: {where}: one for the server, and one thread a learner at least)"


def _compared(section) -> dict:
    """A job file section's fields that say what the job is (not `Train.given`); [transport]'s
    max_rows as the rows a gradient carries, so that "auto" and the rows it takes compare equal
    (a run of a gadei before "auto" wrote the number)."""
    fields = {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.compare}
    if isinstance(section, TransportOptions):
        fields["max_rows"] = section.rows
    return fields


def resume_point(job: jobfile.Job, *, nodes: int = 1) -> outputs.GoOn:
    """Where a resumed run goes on (`outputs.going_on`): the newest checkpoint of its output folder
    that says how far each learner got (a supervisor's periodic one, or the one it takes at a stop;
    the server's own stop checkpoint does not, so up to one checkpoint interval is trained again);
    a job that picks its model goes on with the candidate it was training, from such a checkpoint
    of it, or from its start where a candidate before it ended for good. The folder's
    job.toml must be this job with at most other [train] epochs, patience, devices or threads
    and [checkpoint] settings: the learners' schedules (data, shards, mini-batch, seed) must be
    the ones the progress counts in, and the update rule, the rings' format and the bridge the
    ones the checkpoint's state was made by; a bridged node's folder (node.json) must come from a
    run of as many `nodes`, whose shards these are."""
    out = job.output
    before = jobfile.load(out / "job.toml")  # there: `check` looked (`_check_runs`)
    free = {("train", "epochs"), ("train", "devices"), ("train", "patience"),  # none changes a learner's schedule
            ("train", "threads")}
    changed = []
    for section in ("data", "train", "transport"):
        now, was = _compared(getattr(job, section)), _compared(getattr(before, section))
        changed += [f"[{section}] {key}" for key, value in was.items()
                    if (section, key) not in free and now[key] != value]
    changed += [f"[job] {key}" for key in ("name", "workload") if getattr(job, key) != getattr(before, key)]
    if (job.bridge is None) != (before.bridge is None):
        changed.append("[bridge] (" + ("added" if before.bridge is None else "removed") + ")")
    elif job.bridge is not None:
        changed += [f"[bridge] {key}" for key, value in _compared(before.bridge).items()
                    if getattr(job.bridge, key) != value]
    if changed:
        raise GadeiError(f"--resume: the job differs from the run in {out} in " + ", ".join(changed)
                         + " (only [train] epochs, patience, devices and threads and the [checkpoint] settings may "
                         "change); run it with another [output] folder instead")
    try:
        before_nodes = json.loads((out / NODE).read_text())["nodes"]
    except FileNotFoundError:
        before_nodes = 1
    if before_nodes != nodes:
        raise GadeiError(f"--resume: the run in {out} ran on {before_nodes} node(s), this one on {nodes}: the "
                         "learners' shards would differ; go on with as many MPI ranks, or run it with another "
                         "[output] folder")
    where = outputs.going_on(out)
    if where is None:  # its checkpoints do not verify (`_check_runs` found one)
        _nothing_to_go_on(job)
    return where


