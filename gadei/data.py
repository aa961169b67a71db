"""Where a process's training data comes from: a data spec resolved to (train, validation,
test), a job file's [data] read into its data sets (`load_job`), and a prepared job's sets
written as encoded for a supervisor that is not forked with them (`save_encoded`, `read_encoded`).

A spec is what `--data` takes: a workload's own (`generated`, `generated:SEED`,
`trec:FOLDER`, `trec-fine:FOLDER`, `sst2:FOLDER`; see `gadei_workloads.specs.load`), a shared
data set's bare name (`trec`, found under GADEI_DATA_DIR), or `job:JOBFILE`, the [data] of a
job file (how `gadei run` hands its data to the server and learners it starts). Job files
are gadei's, so that last form is resolved here and not by the workloads, which import
nothing of gadei.
"""

import contextlib
import gc
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from . import jobfile
from .env import settings
from .errors import GadeiError

log = logging.getLogger(__name__)


def resolve(spec: str) -> str:
    """The spec with a shared data set's bare name ('trec') resolved against GADEI_DATA_DIR."""
    name, _, rest = spec.partition(":")
    if rest or name in ("generated", "job"):
        return spec
    base = settings().data_dir
    if base is None:
        raise GadeiError(f"--data {spec!r}: give a folder ({name}:FOLDER) or set GADEI_DATA_DIR")
    return f"{name}:{os.path.join(base, name)}"


def has_validation(job: jobfile.Job) -> bool:
    """Whether the job chooses its model on a validation set: one it names, or a share held out of
    its training set (`load_job`; a share of 0, as a bridged node's job has, is none)."""
    return bool(job.data.validation) or job.data.validation_holdout > 0


def workload_model(name: str, spec: str | None, seed: int):
    """(workload, train, validation, test, model): the built-in workload `name`, its data
    (`spec`, or the workload's default; validation None unless the data is a job file's, see
    `load`) and its model built for the training set with `seed`."""
    from gadei_workloads import get

    workload = get(name)
    train, validation, test = load(workload, spec or workload.default_data)
    return workload, train, validation, test, workload.build_model(train, seed)


_kept: dict[tuple[str, str], tuple] = {}  # (workload, spec) -> its sets, read by `keep`


def keep(spec: str, workload: str, sets: tuple | None = None) -> None:
    """Keep `spec`'s sets for the built-in workload `workload` (`sets`, or read now where this
    process has none kept): `load` answers with them in this process and in the processes forked
    from it (a job's data is read once: by `gadei run` as it checks the job, or its supervisor,
    and the processes forked from them find it read: `gadei.zygote`)."""
    from gadei_workloads import get

    key = (workload, _key(spec))
    if sets is not None or key not in _kept:
        _kept[key] = sets if sets is not None else load(get(workload), spec)


def _key(spec: str) -> str:
    spec = resolve(spec)
    kind, _, path = spec.partition(":")
    return f"job:{os.path.realpath(path)}" if kind == "job" and path else spec


def load(workload, spec: str):
    """(train, validation, test) of `spec` for `workload` (a `gadei_workloads.Workload`):
    a job file's validation set (its [data] validation, or the share of train it holds out);
    None for the other specs, which name a training and a test set only. Those `keep` read are
    not read again."""
    kept = _kept.get((workload.name, _key(spec)))
    if kept is not None:
        return kept
    spec = resolve(spec)
    kind, _, path = spec.partition(":")
    if kind == "job":
        if not path:
            raise GadeiError(f"--data {spec!r}: give the job file, job:JOBFILE")
        job = jobfile.load(path)
        return read_encoded(job) or load_job(job)
    train, test = workload.load_data(spec)
    return train, None, test


# What one process holds of a text set, in bytes (CPython 3.11, 64-bit), measured: 451,361 rows of a
# 50 MB CSV, 16.3 million uni- and bigram ids, a vocabulary of 1,000,000, took 423 MiB once read.
_ROW_BYTES = 120  # a row's list (56) and its places in the set's lists of rows and labels, with slack
_ID_BYTES = 10  # an id's place in its row's list (8), with slack: each id is one int object, the vocabulary's
_VOCABULARY_BYTES = 240  # a token: its string, its int, its places in the vocabulary's dict and list


def footprint(sets) -> int:
    """The bytes one process holds of a job's (train, validation, test) sets (None: no such set),
    the vocabulary they share counted once: what the daemon counts each process of the job to hold
    a share of (`gadei.daemon.resources`)."""
    total, vocabularies = 0, {}
    for each in sets:
        if each is None:
            continue
        if hasattr(each, "x"):  # numeric features: the arrays
            total += each.x.nbytes + each.labels.nbytes
            continue
        total += _ROW_BYTES * len(each.ids) + _ID_BYTES * sum(map(len, each.ids))
        vocabularies[id(each.vocab)] = len(each.vocab)
    return total + _VOCABULARY_BYTES * sum(vocabularies.values())


# ------------------------------------------------------------------ a job's sets, as encoded

ENCODED = "encoded-data.npz"
"""In a prepared job's output folder: its text sets as `gadei.prepare` encoded them, for a
supervisor that is not forked with them (a daemon's job: its supervisor is forked by the
daemon's zygote), which reads them there instead of reading and encoding the files again (half
a minute for 150,000 rows); while the job.toml beside it and its data files are unchanged
(`fingerprint`). The job's supervisor removes it at the job's end (`forget_encoded`)."""
_SPLITS = ("train", "validation", "test")


def save_encoded(job: jobfile.Job, sets: tuple) -> None:
    """Write the prepared job's (train, validation, test) text sets to ENCODED in its output
    folder, beside the job.toml they were made for (numeric sets are not written: reading their
    arrays again is quick); where that fails (a full disk), say so in the log and go on."""
    import itertools

    import numpy as np
    from gadei_workloads.text import TextDataset

    from .files import replace

    train = sets[0]
    if not isinstance(train, TextDataset):
        return
    arrays = {"fingerprint": np.array(fingerprint(job, job.output / "job.toml")), "workload": np.array(job.workload),
              "vocab": _json_bytes(train.vocab.to_json()["tokens"]), "labels": _json_bytes(train.label_names)}
    for split, dataset in zip(_SPLITS, sets):
        if dataset is not None:
            arrays[f"{split}_ids"] = np.fromiter(itertools.chain.from_iterable(dataset.ids), np.int32)
            arrays[f"{split}_ends"] = np.cumsum([len(ids) for ids in dataset.ids], dtype=np.int64)
            arrays[f"{split}_labels"] = np.asarray(dataset.labels, dtype=np.int32)
    try:
        replace(job.output / ENCODED, lambda f: np.savez(f, **arrays), private=job.private)
    except OSError as err:  # a full disk: the supervisor reads the files instead
        log.warning("%s: not written (%s); the job's supervisor reads its data files", job.output / ENCODED, err)


def read_encoded(job: jobfile.Job) -> tuple | None:
    """(train, validation, test) of the prepared job as `save_encoded` wrote them beside its job.toml
    (`job.path`); None where there are none, or none for this job.toml and these data files (or
    the file does not read as `save_encoded` writes it: said in the log), and the files are read."""
    import zipfile

    import numpy as np

    path = job.path.parent / ENCODED if job.path else None
    if path is None or not path.is_file():
        return None
    try:
        made_of = fingerprint(job, job.path)
    except OSError:
        return None  # a data file is gone: reading the files says which
    try:
        with np.load(path, allow_pickle=False) as found:
            if str(found["fingerprint"]) != made_of or str(found["workload"]) != job.workload:
                return None
            with _uncollected():
                sets = _sets(job, {name: found[name] for name in found.files})
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as err:
        log.warning("%s: not read (%s); reading the job's data files instead", path, err)
        return None
    log.info("job %s: its data read from %s, as encoded when the job was prepared (%s training samples)", job.name,
             path, f"{len(sets[0]):,}")
    return sets


def _sets(job: jobfile.Job, found: dict) -> tuple:
    """The text sets of `save_encoded`'s arrays, each checked. ValueError: they do not hold up."""
    import json

    import numpy as np
    from gadei_workloads.text import TextDataset, Vocab

    vocab = Vocab(json.loads(found["vocab"].tobytes()))  # ValueError where it is not a vocabulary
    label_names = json.loads(found["labels"].tobytes())
    if not isinstance(label_names, list) or len(label_names) < 2 or not all(isinstance(n, str) for n in label_names):
        raise ValueError("its labels are not a list of names")
    pool = np.array(list(range(len(vocab))), dtype=object)  # one int object for each id, as `encode_splits` makes
    sets = []
    for split in _SPLITS:
        if f"{split}_ids" not in found:
            sets.append(None)
            continue
        ids, ends, labels = found[f"{split}_ids"], found[f"{split}_ends"], found[f"{split}_labels"]
        if not _holds_together(ids, ends, labels, len(vocab), len(label_names)):
            raise ValueError(f"its {split} set does not hold together")
        flat = pool[ids].tolist()
        rows = [flat[a:b] for a, b in zip([0, *ends[:-1].tolist()], ends.tolist())]
        sets.append(TextDataset(rows, labels.tolist(), label_names, vocab, name=f"job {job.name} ({split})"))
    if sets[0] is None or sets[2] is None:
        raise ValueError("it holds no train or no test set")
    return tuple(sets)


def _holds_together(ids, ends, labels, ids_below: int, labels_below: int) -> bool:
    """A set's arrays as `save_encoded` writes them: ids and labels in range, a row's end for
    each label, the ends in order and the last one the count of ids."""
    import numpy as np

    if (ids.dtype, ends.dtype, labels.dtype) != (np.int32, np.int64, np.int32) or len(ends) != len(labels):
        return False
    if len(ids) != (int(ends[-1]) if len(ends) else 0) or len(ends) and (ends[0] < 0 or (np.diff(ends) < 0).any()):
        return False
    return (not len(ids) or 0 <= ids.min() and ids.max() < ids_below) and \
        (not len(labels) or 0 <= labels.min() and labels.max() < labels_below)


def forget_encoded(folder) -> None:
    """Remove the job's sets `save_encoded` wrote in its output folder `folder` (the job ended)."""
    (Path(folder) / ENCODED).unlink(missing_ok=True)


def data_files(section: jobfile.Data) -> tuple[Path, ...]:
    """Every file a job's [data] names: its train, test and validation files."""
    return (*section.train, *(section.test or ()), *(section.validation or ()))


def fingerprint(job: jobfile.Job, job_file) -> str:
    """What the data sets of `job` are made of: its job file `job_file` (its [data], workload and
    seed say what is read and how it is split; the job as run, its output folder's job.toml, for
    `save_encoded`) and each data file's path, size and time of its last change.

    Raises:
        OSError: the job file or a data file cannot be read.
    """
    import hashlib

    digest = hashlib.sha256(Path(job_file).read_bytes())
    for path in data_files(job.data):
        found = os.stat(path)
        digest.update(f"\0{os.path.realpath(path)}\0{found.st_size}\0{found.st_mtime_ns}".encode())
    return digest.hexdigest()


def _json_bytes(value):
    """`value` as JSON, in a byte array (an array file holds no strings of any length)."""
    import json

    import numpy as np

    return np.frombuffer(json.dumps(value, ensure_ascii=False).encode(), dtype=np.uint8)


def load_job(job: jobfile.Job, reports: list | None = None, texts: "Texts | None" = None):
    """The job's (train, validation, test) datasets: vocabulary and labels from train; test
    from its file or held out of train ([data] holdout); validation, on which the model is
    chosen and training stops, from its file or held out of what is left of train ([data]
    validation_holdout), each label's share, with the job's seed: the same split in every
    process; None when there is none (validation_holdout = 0: a bridged node's job, or one
    that trains on all of train to its epochs cap). The test set never chooses anything. Each text file's
    `gadei_workloads.files.FileReport` (lines read, samples kept, what was left out and why)
    is appended to `reports`. `texts`: the job's text files as `read_texts` read them already
    (the candidates of a job that picks its model share one reading; their [data] and seed are
    the job's), encoded here for the job's workload.

    Raises:
        jobfile.JobFileError: a data file does not parse, is empty, lacks a column, or the training
            set has fewer than two labels (names the file and line where there is one).
    """
    from gadei_workloads import get
    from gadei_workloads.text import encode_splits

    workload = get(job.workload)
    if workload.kind == "numeric":
        return _load_arrays(job, reports)
    texts = texts if texts is not None else read_texts(job, reports)
    try:
        with _uncollected():
            return encode_splits(texts.train, texts.validation, texts.test, name=f"job {job.name}",
                                 validation_source=texts.validation_source, test_source=texts.test_source,
                                 tokens=workload.tokens, max_size=workload.max_vocab)
    except ValueError as err:
        key = "validation" if str(err).startswith(texts.validation_source) else "test"
        raise jobfile.JobFileError(f"{job.path.name if job.path else 'job'}: [data] {key}: {err}") from None


@dataclass(frozen=True)
class Texts:
    """A job's text files read and split (`read_texts`), before a workload encodes them: (words,
    label) rows of each split, and where the validation and test rows came from, in words."""

    train: list
    validation: list | None
    test: list
    validation_source: str
    test_source: str


def read_texts(job: jobfile.Job, reports: list | None = None) -> Texts:
    """The job's text files read ([data] train, test, validation) and split as `load_job` says,
    its FileReports appended to `reports`; JobFileError as `load_job` raises it."""
    from gadei_workloads.files import DataError, read
    from gadei_workloads.text import hold_out

    d = job.data
    where = job.path.name if job.path else "job"
    options = dict(text_column=d.text_column, label_column=d.label_column, header=d.header, encoding=d.encoding,
                   fallback=d.fallback_encoding, reports=reports, max_words=d.max_words)
    try:
        with _uncollected():
            train = read(list(d.train), d.format, **options)
            test = read(list(d.test), d.format, **options) if d.test else None
            validation = read(list(d.validation), d.format, **options) if d.validation else None
    except DataError as err:
        raise jobfile.JobFileError(f"{where}: [data]: {err}") from None
    check_labels([label for _, label in train], job)
    source = f"job {job.name}"
    if test is None:
        train, test = hold_out(train, d.holdout, job.train.seed)
        test_source = f"{source}: held-out {d.holdout:.0%} of train"
    else:
        test_source = ", ".join(map(str, d.test))
    if validation is None and d.validation_holdout > 0:
        train, validation = hold_out(train, d.validation_holdout, job.train.seed, stream=VALIDATION_STREAM)
        validation_source = f"{source}: held-out {d.validation_holdout:.0%} of train for validation"
    else:
        validation_source = ", ".join(map(str, d.validation or ()))
    return Texts(train, validation, test, validation_source, test_source)


@contextlib.contextmanager
def _uncollected():
    """Python's cyclic garbage collector held off while a data set's rows are made (as it was
    before, after): none of its millions of lists and tuples is in a cycle, and every pass of
    the collector over its older objects walks them all (most of the time of making the rows of
    150,000 samples of `read_encoded`'s arrays, a tenth of reading their CSV)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


VALIDATION_STREAM = 104729  # the validation split's random stream (the test hold-out's is another)


def check_labels(labels: list[str], job: jobfile.Job) -> None:
    """The training set's labels are classes: at least two, and fewer than half as many as
    samples. JobFileError otherwise: more labels than that is a column of values or texts
    named as the labels (columns swapped, a regression target), which trained a model of a
    class a sample with nothing held out to validate or test it (a label with one sample
    stays in train)."""
    from collections import Counter

    counts = Counter(labels)
    where = job.path.name if job.path else "job"
    if len(counts) < 2:
        raise jobfile.JobFileError(f"{where}: [data] train: {len(labels):,} samples but only the label "
                                   f"{next(iter(counts))!r}; a classifier needs at least two labels")
    if len(counts) > len(labels) / 2:
        single = sum(1 for count in counts.values() if count == 1)
        column = "its 'y'" if job.data.format == "npz" else f"[data] label_column = {job.data.label_column!r}"
        raise jobfile.JobFileError(
            f"{where}: [data] train: {len(counts):,} labels for {len(labels):,} samples ({single:,} of them seen "
            f"once, e.g. {next(label for label, count in counts.items() if count == 1)[:40]!r}): a classifier learns "
            f"labels that recur, and nothing can be held out to validate or test one seen once; does {column} hold "
            "the classes, not values or texts?")


def _load_arrays(job: jobfile.Job, reports: list | None):
    """(train, validation, test) ArrayDatasets of a numeric job (see gadei_workloads.numeric)."""
    from gadei_workloads.files import DataError
    from gadei_workloads.numeric import hold_out, make_split, read_arrays

    d = job.data
    where = job.path.name if job.path else "job"
    try:
        options = dict(header=d.header, encoding=d.encoding, fallback=d.fallback_encoding, reports=reports)
        train = read_arrays(d.train[0], d.format, d.label_column, **options)
        test = read_arrays(d.test[0], d.format, d.label_column, **options) if d.test else None
        validation = read_arrays(d.validation[0], d.format, d.label_column, **options) if d.validation else None
        check_labels(train[1], job)
        if test is None:
            train, test = hold_out(train, d.holdout, job.train.seed)
            source = f"job {job.name}: held-out {d.holdout:.0%} of train"
        else:
            source = str(d.test[0])
        validation_set = None
        if validation is None and d.validation_holdout > 0:
            train, validation = hold_out(train, d.validation_holdout, job.train.seed, stream=VALIDATION_STREAM)
            validation_source = f"job {job.name}: held-out {d.validation_holdout:.0%} of train for validation"
        elif validation is not None:
            validation_source = str(d.validation[0])
        if validation is not None:
            _, validation_set = make_split(train, validation, name=f"job {job.name}",
                                           test_source=validation_source, split="validation")
        train_set, test_set = make_split(train, test, name=f"job {job.name}", test_source=source)
        return train_set, validation_set, test_set
    except DataError as err:
        raise jobfile.JobFileError(f"{where}: [data]: {err}") from None
