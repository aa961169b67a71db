"""Job files: a training job as a TOML file, parsed (standard library `tomllib`) into a typed,
validated `Job` before anything starts.

    [job]
    name = "trec"                 # the job's name (its region is gadei-<name>)
    workload = "auto"             # a built-in workload, or "auto" (the default): train the candidates
                                  # (gadei_workloads.CANDIDATES) and hand back their mean, or one alone
                                  # where it is a standard error better on validation (gadei.ensemble)
    priority = 0                  # the daemon starts a waiting job of a higher priority first (default 0)

    [data]
    train = "trec/TREC.train"     # a file; per-label: a list of files, or a folder
    test = "trec/TREC.test"       # optional: without it, `holdout` of train is held out
    format = "trec"               # csv, tsv, jsonl, label-text, trec, per-label; numeric: npz, csv (default:
                                  # per-label for a folder or a list, else what the extension says: .csv ...)
    header = true                 # csv/tsv: the first row names the columns (false: none; columns by number)
    text_column = "text"          # csv/tsv/jsonl: the column (key) of the text; a number is a position (1: the first)
    label_column = "label"        # csv/tsv/jsonl: the column (key) of the label (header = false: 1, text 2)
    encoding = "utf-8"
    fallback_encoding = "latin-1" # optional: read a file that is not `encoding` with this
    holdout = 0.1                 # share of train held out as the test set when there is none
    validation = "trec/dev.txt"   # optional: the file the model is chosen on (same format as train);
    validation_holdout = 0.1      # without it, this share of train (each label's) is held out for that; 0: none
                                  # (train on all of it to the epochs cap; model.pt is the last weights)
    max_words = 1000              # a longer text is cut to its first this many words (counted as it is read)

    [train]
    learners = 2
    mode = "async"                # async, consistent, sync, elastic
    batch = 2                     # default: 2 below 10k samples, 4 up to 100k, 32 above
    optimizer = "adagrad"         # adagrad, adam (usual lr 0.001) or sgd (default: adagrad; elastic mode: sgd)
    nonfinite = "skip"            # a gradient with NaN or inf: skip it and count it (default), or stop the job
    lr = 0.01
    epochs = 20                   # the cap; default: about 120,000 updates, 3 to 40 epochs
    patience = 3                  # stop when the validation accuracy did not improve for this many evaluations
    seed = 0
    devices = "cpu"               # "cpu", "auto" (every visible GPU, else the CPU) or "cuda:0,cuda:1", round-robin
    threads = "auto"              # each learner's PyTorch intra-op threads; auto: the cores less one for the
                                  # server, shared by the learners (one each where that is all there is)

    [checkpoint]
    interval = 60                 # seconds
    keep = 3

    [transport]                   # how gradients travel: gadei.transport.options.TransportOptions (docs/jobs.md)

    [output]
    folder = "runs/trec"          # default: runs/<name> next to the job file
    private = true                # the folder 0700, its files 0600, whatever the umask (default); false: the umask's

    [bridge]                      # optional: under `mpiexec -n NODES gadei run`, join the nodes' jobs;
    strategy = "average"          # its keys are gadei.bridge.options.BridgeOptions (docs/jobs.md lists them)

Relative paths are taken from the job file's folder. Every refusal (`JobFileError`) names
the file, the field, the value and what is allowed: an unknown section or key (with the
section that takes it, or the closest known one), a wrong type or range, a file that does not exist. Data problems
(empty data, a label column that is not there, fewer than two labels, a file that does not
decode) are found by `gadei.data.load_job`, also before anything starts.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import device
from .bridge.options import BridgeOptions
from .checkpoint import CheckpointOptions
from .env import usable_cores
from .errors import GadeiError
from .modes import MODES, RuleOptions
from .options import check as check_option
from .options import declared, job_keys, option, said
from .transport.options import MAX_ROWS, TransportOptions

FORMATS = ("csv", "tsv", "jsonl", "label-text", "trec", "per-label", "npz")
NUMERIC_FORMATS = ("csv", "npz")
MAX_LEARNERS = 64
MAX_THREADS = 1024  # [train] threads: PyTorch intra-op threads of one learner
MAX_PATH = 4096  # characters of a path (Linux's PATH_MAX)
MAX_TEXT = 1024  # characters of any other string of a job file
AUTO = "auto"  # [job] workload: the job picks its model among the candidates (docs/jobs.md, "workload = auto")


class JobFileError(GadeiError, ValueError):
    """A job file that cannot run as written (the message says where and why)."""


@dataclass(frozen=True)
class Data:
    train: tuple[Path, ...]
    test: tuple[Path, ...] | None = None
    format: str = "csv"
    header: bool = True
    text_column: str | int = "text"  # a header name, or a position (1 = the first column)
    label_column: str | int = "label"
    encoding: str = "utf-8"
    fallback_encoding: str | None = None
    holdout: float = 0.1
    validation: tuple[Path, ...] | None = None  # None: `validation_holdout` of train is held out for validation
    validation_holdout: float = 0.1  # 0: no validation set (a bridged node's job: its bridge chooses nothing)
    max_words: int = 1000  # a text's words trained on and predicted from (a longer one is cut): bounds the memory


def _devices(value: str) -> str:
    """[train] devices: "cpu", "auto" or devices that exist here (CUDA on a machine without it
    is refused before anything starts)."""
    try:
        for name in device.parse_devices(value):
            if name != "auto":
                device.resolve(name)
    except (ValueError, RuntimeError, OverflowError, GadeiError) as err:  # torch.device's, for an index too large
        raise ValueError(f'{err}; allowed: "cpu", "auto" (every visible GPU, else the CPU) or devices such as '
                         '"cuda:0,cuda:1" (learners are spread over them round-robin)') from None
    return value


@dataclass(frozen=True)
class Train(RuleOptions):
    """A job's [train] section: the update rule's options (`gadei.modes.RuleOptions`, declared there: lr,
    momentum, optimizer, adam_beta1, adam_beta2, adam_eps, stale_lr, stale_bound, alpha, tau, drop_after,
    nonfinite) and the job's own. What depends on the data (batch, epochs, and the optimizer: adagrad, or sgd
    in elastic mode) and what depends on the machine (threads) is chosen by `Job.with_defaults` where the
    file leaves it out; `given` holds the keys the file gave a value ("auto" is none: the option's own choice)."""

    learners: int = option(2, "learners the job trains with", low=1, high=MAX_LEARNERS, flag=False)
    mode: str = option("async", "update rule: async (Hogwild ASGD), consistent (ASGD, pulls never see half an "
                       "update), sync (SSGD rounds), elastic (EASGD)", choices=MODES)
    batch: int | None = option(None, "mini-batch size", low=1, high=10**9,
                               shown="2 below 10,000 samples, 4 up to 100,000, 32 above")
    epochs: int | None = option(None, "the most passes over the training data (training stops earlier when the "
                                "validation accuracy stopped improving: patience)", low=1, high=10**9,
                                shown="about 120,000 updates, 3 to 40")
    patience: int = option(3, "evaluations in a row that did not raise the validation accuracy before training "
                           "stops", low=1, high=10**6)
    seed: int = option(0, "seed of the initial weights, the data order and a held-out split", low=0, high=2**32 - 1)
    devices: str = option("cpu", 'where learners train, round-robin: "cpu", "auto" (every visible GPU, else the CPU) '
                          'or devices such as "cuda:0,cuda:1"', check=_devices,
                          allowed='"cpu", "auto" (every visible GPU, else the CPU) or devices such as "cuda:0,cuda:1"')
    threads: int | None = option(None, "each learner's PyTorch intra-op threads (torch.set_num_threads); auto: the "
                                 "usable cores less one for the server, shared by the learners, at least one each",
                                 low=1, high=MAX_THREADS, auto=True, flag=False,
                                 allowed=f'an integer from 1 to {MAX_THREADS:,}, or "auto" (the cores less one for the '
                                 'server, shared by the learners)')
    given: frozenset = field(default=frozenset(), compare=False, repr=False)

    @property
    def learner_threads(self) -> int:
        """Each learner's PyTorch threads: [train] threads, or `auto_threads` of the learners."""
        return self.threads if self.threads is not None else auto_threads(self.learners)

    @property
    def rule(self) -> RuleOptions:
        """The update rule's options of this job."""
        return RuleOptions(**{f.name: getattr(self, f.name) for f in declared(RuleOptions)})


@dataclass(frozen=True)
class Job:
    """A job as its file says (paths absolute); `with_defaults` fills what depends on the data."""

    name: str
    workload: str
    data: Data
    train: Train = field(default_factory=Train)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    transport: TransportOptions = field(default_factory=TransportOptions)
    output: Path = Path("runs")
    private: bool = True  # [output] private: the output folder 0700 and its files 0600, whatever the umask
    bridge: BridgeOptions | None = None  # None: the job runs on one node
    path: Path | None = None
    priority: int = 0  # [job] priority: the daemon starts a waiting job of a higher one first

    def with_defaults(self, samples: int, rows=None) -> tuple["Job", list[str]]:
        """The job with the size-dependent defaults chosen for `samples` training samples,
        and a line per choice (for people); `rows(batch)`: the most embedding rows a mini-batch
        of the training set touches (a text set's, `gadei_workloads.text.rows_touched`)."""
        chosen = []
        train, transport = self.train, self.transport
        if train.batch is None:
            batch = default_batch(samples)
            train = replace(train, batch=batch)
            chosen.append(f"batch = {batch} (default for {samples:,} training samples: 2 below 10,000, 4 up to "
                          "100,000, 32 above)")
        if "optimizer" not in train.given:
            optimizer = "sgd" if train.mode == "elastic" else "adagrad"
            train = replace(train, optimizer=optimizer, given=train.given | {"optimizer"})
            why = (": elastic learners take their own sgd steps)" if train.mode == "elastic" else
                   ": per-weight steps, fast on sparse text features)")
            chosen.append(f"optimizer = {optimizer} (default{why}")
        if "lr" not in train.given and train.optimizer != "adam" and self.workload != AUTO:  # each candidate's own
            from gadei_workloads import get

            lr = get(self.workload).lr
            if lr is not None and lr != train.lr:
                train = replace(train, lr=lr, given=train.given | {"lr"})
                chosen.append(f"lr = {lr:g} (default of the {self.workload} workload: a step of {train.optimizer} "
                              "moves a few dozen rows of its table, each by about the learning rate)")
        if train.epochs is None:
            epochs = default_epochs(samples, train.batch)
            train = replace(train, epochs=epochs)
            chosen.append(f"epochs = {epochs} (default: about {UPDATES:,} updates of mini-batch "
                          f"{train.batch} over {samples:,} samples, 3 to {MAX_EPOCHS} epochs; the cap: "
                          f"training stops when {train.patience} evaluations did not raise the validation accuracy)")
        if train.threads is None:  # the job as run says the threads its learners take (job.toml, `gadei learn`)
            train = replace(train, threads=train.learner_threads)
        devices, line = device.choose(device.parse_devices(train.devices))
        if line is not None:
            train = replace(train, devices=",".join(devices))
            chosen.append(line)
        touched = 0 if rows is None or transport.max_rows or transport.row_sparse is False else rows(train.batch)
        if touched > MAX_ROWS:  # the rings carry every row-sparse gradient of a batch of the longest texts
            transport = replace(transport, max_rows=touched)
            chosen.append(f"max_rows = {touched:,} (auto: the most table rows a mini-batch of {train.batch} of the "
                          f"training set touches, more than the {MAX_ROWS:,} it takes otherwise)")
        bridge = None if self.bridge is None else self.bridge.scheduled()
        return replace(self, train=train, transport=transport, bridge=bridge), chosen

    def for_node(self, node: int, nodes: int) -> "Job":
        """The job of node `node` of `nodes` in a bridged run (`mpiexec -n NODES gadei run`): its
        own job name `<name>-r<node>` and output folder `<folder>/node-<node>`, so that nodes
        may share a machine (and a file system); dense gradients, and no validation share held
        out of train (the model is the one the nodes' bridge agrees on, not chosen)."""
        from .region import check_job_name

        name = f"{self.name}-r{node}"
        try:
            check_job_name(name)
        except GadeiError:
            where = self.path.name if self.path else "job"
            raise JobFileError(f"{where}: [job] name = {self.name!r}: node {node} of {nodes} runs it as {name!r}, "
                               "which is longer than a job name may be; allowed: up to "
                               f"{63 - (len(name) - len(self.name))} characters") from None
        transport = self.transport
        if transport.row_sparse is None:  # the bridge moves every row: a bridged node's gradients stay dense
            transport = replace(transport, row_sparse=False)
        data = self.data
        if data.validation is None:  # the nodes' model is the one their bridge agrees on: nothing is chosen on a
            data = replace(data, validation_holdout=0.0)  # validation share, so none is held out of train
        return replace(self, name=name, output=self.output / f"node-{node}", transport=transport, data=data)

    def to_toml(self) -> str:
        """The job as TOML, every field written (the job as run)."""
        sections = {
            "job": {"name": self.name, "workload": self.workload, "priority": self.priority},
            "data": asdict(self.data),
            "train": _table(self.train),  # threads None (not yet chosen: `with_defaults`) is written "auto"
            "checkpoint": asdict(self.checkpoint),
            "transport": _table(self.transport),  # row_sparse None is written "auto"
            "output": {"folder": self.output, "private": self.private},
        }
        if self.bridge is not None:
            sections["bridge"] = _table(self.bridge)
        return toml_text(sections)


def toml_text(sections: dict[str, dict]) -> str:
    """Tables of a job file's values (booleans, numbers, strings, paths, lists of them; a None
    is left out) as TOML text: the one writer of job files (the job as run, a job the daemon
    was given as a dict).

    Raises:
        ValueError: a value TOML does not hold as given (it would read back otherwise).
    """
    text = "".join(f"[{section}]\n" + "".join(f"{key} = {_toml_value(value)}\n" for key, value in table.items()
                                               if value is not None) + "\n"
                   for section, table in sections.items())
    written = {section: {k: _plain(v) for k, v in table.items() if v is not None}
               for section, table in sections.items()}
    if tomllib.loads(text) != written:
        raise ValueError(f"cannot be written as TOML: {text!r:.300}")
    return text


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        return float.__repr__(value)  # a NumPy float too ("1e-05", not "np.float64(1e-05)")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    return json.dumps(str(value), ensure_ascii=False)  # JSON's escapes are TOML's (control characters included)


def _plain(value):
    """`value` as TOML reads it back: paths as strings, tuples as lists."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, float) and not isinstance(value, bool):
        return float(value)
    return value


def _table(options) -> dict:
    """A declared part's job-file keys and values (`auto` options left to the part: "auto")."""
    table = {}
    for f in declared(type(options)):
        if f.metadata["option"]["job"]:
            value = getattr(options, f.name)
            table[f.name] = "auto" if value is None and f.metadata["option"]["auto"] else value
    return table


def default_batch(samples: int) -> int:
    """DESIGN.md's conservative mini-batch: 2 below 10k samples, 4 up to 100k, 32 above."""
    return 2 if samples < 10_000 else 4 if samples <= 100_000 else 32


def auto_threads(learners: int, cores: int | None = None) -> int:
    """[train] threads = "auto": each learner's PyTorch intra-op threads, so that the learners'
    threads and the server fit the `cores` (default: `usable_cores()`): one core for the
    server, the rest shared by the learners, and one each where that is all there is (as
    torchrun sets OMP_NUM_THREADS=1): 2 learners on 2 cores get 1 each, on 16 cores 7 each.
    The same rule for GPU learners: their threads run the host's share of a step (the data,
    the launches, the transports' copies), and a GPU job's learners share the cores as a CPU
    job's do."""
    cores = usable_cores() if cores is None else cores
    return max(1, (cores - 1) // max(1, learners))


UPDATES = 120_000
MAX_EPOCHS = 40


def default_epochs(samples: int, batch: int) -> int:
    """The epoch cap: epochs for about `UPDATES` updates, between 3 and MAX_EPOCHS. Training
    stops earlier when the validation accuracy stops improving ([train] patience), so the cap
    only matters to the sets that keep improving, and for those a longer one costs time, not
    accuracy. At 60,000 updates (adagrad; 14 epochs of mini-batch 2) banking77 still improved
    at the cap (89.6% on seed 0); at 120,000 patience stopped it on 2 seeds of 3, and the
    median of 3 seeds is 90.2% (docs/benchmarks.md, "The model's width"). Every other shared
    set stops on patience within 10 epochs."""
    per_epoch = max(1, math.ceil(samples / batch))
    return min(MAX_EPOCHS, max(3, math.ceil(UPDATES / per_epoch)))


# ------------------------------------------------------------------ parsing

# key -> (kind, required): kinds are checked by _value below. The sections of options declared
# with `gadei.options.option` take their keys, and their checks, from those declarations.
DECLARED = {"train": Train, "checkpoint": CheckpointOptions, "transport": TransportOptions, "bridge": BridgeOptions}
_SCHEMA = {
    "job": {"name": ("name", True), "workload": ("workload", False), "priority": ("priority", False)},
    "data": {"train": ("paths", True), "test": ("paths", False), "format": ("format", False),
             "header": ("bool", False), "text_column": ("column", False), "label_column": ("column", False),
             "encoding": ("encoding", False),
             "fallback_encoding": ("encoding", False), "holdout": ("fraction", False),
             "validation": ("paths", False), "validation_holdout": ("fraction or 0", False),
             "max_words": ("words", False)},
    **{section: {key: ("declared", False) for key in job_keys(cls)} for section, cls in DECLARED.items()},
    "output": {"folder": ("text", False), "private": ("bool", False)},
}


def load(path: str | os.PathLike, *, data_files: bool = True) -> Job:
    """Parse and check the job file at `path`; `data_files`: also that its data files exist
    (a run folder's job.toml is read without them by `gadei predict`).

    Raises:
        JobFileError: the file is missing or not TOML, or a section, key or value is not
            allowed (the message names the file, the field, the value and what is allowed).
    """
    try:
        path = Path(path).resolve()
        # utf-8-sig: a byte-order mark (Windows editors save one) is dropped, as in data files
        data = _read_job_file(path)
        raw = tomllib.loads(data.decode("utf-8-sig"))
    except OSError as err:
        raise JobFileError(f"job file {str(path)!r}: {err.strerror}") from None
    except RuntimeError as err:  # Python 3.11's Path.resolve on a symbolic link loop (RecursionError is one too)
        why = ("nested more than Python's recursion limit allows" if isinstance(err, RecursionError) else
               "a symbolic link loop")
        raise JobFileError(f"job file {str(path)!r}: {why}") from None
    except UnicodeDecodeError as err:
        from gadei_workloads.files import byte_order_mark

        wide = {"utf-16": "UTF-16", "utf-32": "UTF-32"}.get(byte_order_mark(data))
        raise JobFileError(f"job file {str(path)!r}: not UTF-8 text (line {data.count(10, 0, err.start) + 1}, byte "
                           f"{err.start:,}: {err.reason})" + (f"; it is {wide} (it starts with a {wide} byte-order "
                                                              "mark), and a TOML file is UTF-8: save it as UTF-8"
                                                              if wide else "")) from None
    except tomllib.TOMLDecodeError as err:
        raise JobFileError(f"job file {str(path)!r}: not valid TOML: {err}") from None
    return parse(raw, path, data_files=data_files)


MAX_JOB_FILE = 1 << 20  # bytes: a job file names its data, it does not hold it
MAX_PRIORITY = 1_000_000  # [job] priority, either way


def _read_job_file(path: Path) -> bytes:
    """The bytes of the job file at `path`: a regular file of at most MAX_JOB_FILE bytes (a
    device such as /dev/zero, a FIFO or a huge file is refused, never read without end)."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    with open(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise JobFileError(f"job file {str(path)!r}: not a regular file")
        data = handle.read(MAX_JOB_FILE + 1)
    if len(data) > MAX_JOB_FILE:
        raise JobFileError(f"job file {str(path)!r}: {info.st_size:,} bytes, more than a job file may be "
                           f"({MAX_JOB_FILE:,}); it names its data files, it does not hold them")
    return data


def parse(raw: dict, path: Path, *, data_files: bool = True) -> Job:
    """Check a parsed job file (`path` names it in errors and anchors relative paths);
    `data_files`: also that its data files exist."""
    where = path.name
    for section in raw:
        if section not in _SCHEMA:
            raise JobFileError(f"{where}: unknown section [{section}]{_close(section, _SCHEMA)}; allowed: "
                               f"{', '.join(f'[{s}]' for s in _SCHEMA)}")
        if not isinstance(raw[section], dict):
            raise JobFileError(f"{where}: {section} must be a section ([{section}]), not a value")
    values: dict[str, dict] = {}
    for section, keys in _SCHEMA.items():
        given = raw.get(section, {})
        for key in given:
            if key not in keys:
                raise JobFileError(f"{where}: [{section}] unknown key {key!r}{_close(key, keys, section)}; allowed: "
                                   f"{', '.join(keys)}")
        values[section] = {}
        for key, (kind, required) in keys.items():
            if key not in given:
                if required:
                    raise JobFileError(f"{where}: [{section}] {key} is missing; it is required")
                continue
            values[section][key] = _value(where, section, key, kind, given[key], path.parent)
    job = values["job"]
    job.setdefault("workload", AUTO)
    data = dict(values["data"])
    from gadei_workloads import KINDS
    from gadei_workloads.files import format_of

    data.setdefault("format", format_of(data["train"]))
    if data["format"] is None:
        raise JobFileError(f"{where}: [data] format is missing, and {data['train'][0].name!r} does not say it (a .csv, "
                           f".tsv, .jsonl or .npz file, or a per-label folder); allowed: {', '.join(FORMATS)}")

    _check_auto(where, job["workload"], data, raw)
    numeric = job["workload"] != AUTO and KINDS[job["workload"]] == "numeric"
    allowed = NUMERIC_FORMATS if numeric else tuple(f for f in FORMATS if f != "npz")
    if data["format"] not in allowed:
        raise JobFileError(f"{where}: [data] format = {data['format']!r}: workload {job['workload']!r} reads "
                           f"{'numeric feature vectors' if numeric else 'text'}; allowed: {', '.join(allowed)}")
    _check_columns(where, data, numeric)
    if data_files:
        _check_data_files(where, data)
    train = values["train"]
    if train.get("optimizer", "sgd") != "sgd" and train.get("mode") == "elastic":
        raise JobFileError(f"{where}: [train] optimizer = {train['optimizer']!r} with mode = 'elastic': elastic "
                           "learners take their own local steps; allowed with elastic: sgd")
    try:
        Train(**train).rule.check(train.get("mode", "async"))
    except ValueError as err:
        raise JobFileError(f"{where}: [train]: {err}") from None
    bridge = _check_bridge(where, raw, values["bridge"], train)
    output = values["output"].get("folder")
    output = (_absolute(output, path.parent, f"{where}: [output] folder = {output!r}", follow=False) if output else
              path.parent / "runs" / job["name"])
    return Job(name=job["name"], workload=job["workload"], priority=job.get("priority", 0), data=Data(**data),
               train=Train(**values["train"], given=frozenset(k for k, v in values["train"].items() if v is not None)),
               checkpoint=CheckpointOptions(**values["checkpoint"]), transport=TransportOptions(**values["transport"]),
               output=output,
               private=values["output"].get("private", True), bridge=bridge, path=path)


def _check_auto(where: str, workload: str, data: dict, raw: dict) -> None:
    """A job that picks its model (workload "auto", also where it names none) trains text
    candidates and chooses on a validation set: numeric features, no validation set and a bridged
    job (whose nodes agree on their model rather than choose one) are refused, naming a workload."""
    if workload != AUTO:
        return
    from gadei_workloads import CANDIDATES

    said = (f"[job] workload = {AUTO!r}" if "workload" in raw.get("job", {}) else
            f"[job] workload is not given, so it is {AUTO!r}")
    picks = (f"{said} (the job trains {' and '.join(CANDIDATES)} and hands back their mean, or one alone where it is "
             "better on validation)")
    if data["format"] == "npz":
        raise JobFileError(f"{where}: {picks}, but format 'npz' holds numeric features; for those set "
                           "workload = \"mlp\"")
    if data.get("validation_holdout") == 0.0 and not data.get("validation"):
        raise JobFileError(f"{where}: {picks}, but [data] validation_holdout = 0 leaves no validation set to "
                           "choose on; give [data] validation or a share to hold out, or name a workload")
    if "bridge" in raw:
        raise JobFileError(f"{where}: {picks}, but a [bridge] job's model is the one its nodes agree on, not one "
                           "chosen on validation; name a workload")


def _check_bridge(where: str, raw: dict, given: dict, train: dict) -> BridgeOptions | None:
    """The [bridge] section, or None without one. The bridge writes its move through a ring as
    one slot, which the server applies as sent outside the update rule; sync rounds cannot
    take it (gadei.bridge.LocalNode)."""
    if "bridge" not in raw:
        return None
    options = BridgeOptions(**given)
    written = raw["bridge"]  # a value as the file has it (every = 2, not 2.0), for the message

    def shown(key, value) -> str:
        return f"{key} = {_shown(written[key] if written.get(key) == value else value)}"

    conflict = options.conflict(shown)
    if conflict is not None:
        raise JobFileError(f"{where}: [bridge] {conflict}")
    if raw.get("transport", {}).get("row_sparse") is True:
        raise JobFileError(f"{where}: [transport] row_sparse = true with a [bridge] section: the bridge moves every "
                           "row of the weights; allowed with [bridge]: false or \"auto\" (dense on a bridged node)")
    if train.get("mode") == "sync":
        raise JobFileError(f"{where}: [train] mode = 'sync' with a [bridge] section: the bridge would be a member of "
                           "every round; allowed with [bridge]: async, consistent, elastic")
    return options


def _close(word: str, known, section: str = "") -> str:
    """A refusal's hint: the other section that takes key `word` (of `section`), else a close one."""
    home = [s for s, keys in _SCHEMA.items() if section and s != section and word in keys]
    match = home or difflib.get_close_matches(word, list(known), n=1)
    return "" if not match else f" (it belongs in [{match[0]}])" if home else f" (did you mean {match[0]!r}?)"


def _type_name(value) -> str:
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)


def _shown(value, limit: int = 100) -> str:
    """A value as a message shows it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _value(where: str, section: str, key: str, kind: str, value, base: Path):
    field_ = f"{where}: [{section}] {key} = {_shown(value)}"

    def refuse(allowed: str):
        raise JobFileError(f"{field_} is {_type_name(value)}; allowed: {allowed}")

    for text in (value if isinstance(value, list) else [value]):
        if isinstance(text, str):
            _check_text(field_, text, MAX_PATH if kind in ("paths", "text") else MAX_TEXT)
    if kind == "declared":
        try:
            return check_option(DECLARED[section], key, value)
        except ValueError as err:
            raise JobFileError(said(field_, err)) from None

    if kind in ("text", "name", "workload", "format", "encoding"):
        if not isinstance(value, str) or not value.strip():
            refuse("a non-empty string")
        if kind == "encoding":
            try:
                "\n".encode(value)
            except LookupError:
                raise JobFileError(f"{field_}: not a text encoding Python knows; allowed: e.g. utf-8, latin-1, "
                                   "cp1252, utf-16") from None
        if kind == "name":
            from .region import check_job_name

            try:
                check_job_name(value)
            except GadeiError as err:
                raise JobFileError(f"{field_}: {err}") from None
        if kind == "workload":
            from gadei_workloads import KINDS

            if value not in KINDS and value != AUTO:
                raise JobFileError(f"{field_}: unknown workload{_close(value, [*KINDS, AUTO])}; allowed: "
                                   f"{AUTO!r} (the job picks its model), {', '.join(sorted(KINDS))}")
        choices = {"format": FORMATS}.get(kind)
        if choices and value not in choices:
            raise JobFileError(f"{field_}: not a {kind}{_close(value, choices)}; allowed: {', '.join(choices)}")
        return value
    if kind == "priority":
        if isinstance(value, bool) or not isinstance(value, int):
            refuse("an integer (higher starts first)")
        if not -MAX_PRIORITY <= value <= MAX_PRIORITY:
            raise JobFileError(f"{field_} is out of range; allowed: an integer from -{MAX_PRIORITY:,} to "
                               f"{MAX_PRIORITY:,} (higher starts first)")
        return value
    if kind == "column":
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if not 1 <= value <= 100_000:
                raise JobFileError(f"{field_} is out of range; allowed: a column name, or a number from 1 (the first "
                                   "column) to 100,000")
            return value
        refuse("a column name (string) or a column number (1 is the first)")
    if kind == "paths":
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(v, str) and v.strip() for v in items):
            refuse("a path (string) or, for per-label, a list of paths or a folder")
        return tuple(_absolute(v, base, field_) for v in items)
    if kind == "bool":
        if not isinstance(value, bool):
            refuse("true or false")
        return value
    if kind == "words":
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**6:
            raise JobFileError(f"{field_} is not allowed; allowed: an integer from 1 to 1,000,000 (words)")
        return value
    if kind in ("fraction", "fraction or 0"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            refuse("a number")
        value = float(value)
        if kind == "fraction or 0" and value == 0.0:
            return value
        if not 0.0 < value < 0.5:
            if kind == "fraction or 0":
                raise JobFileError(f"{field_} is out of range; allowed: 0 (no validation set) or more than 0 and less "
                                   "than 0.5")
            raise JobFileError(f"{field_} is out of range; allowed: more than 0 and less than 0.5")
        return value
    raise AssertionError(kind)


def _check_text(field_: str, text: str, limit: int) -> None:
    """A string the job as run (`Job.to_toml`) can hold and a person can read: no control
    characters (a newline in a name would break job.toml), at most `limit` characters."""
    bad = next((c for c in text if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c in "\u2028\u2029"), None)
    if bad is not None:
        raise JobFileError(f"{field_}: holds the control character {bad!r}; allowed: printable characters")
    if len(text) > limit:
        raise JobFileError(f"{field_}: {len(text):,} characters; allowed: up to {limit:,}")


def _absolute(path: str, base: Path, field_: str, follow: bool = True) -> Path:
    """`path` from the job file's folder `base`. `follow=False` (the output folder) keeps a
    symbolic link as one, so that the output checks see it and refuse it, as they refuse an
    absolute one."""
    try:
        p = Path(os.path.expanduser(path))
        if p.is_absolute():
            return p
        return (base / p).resolve() if follow else Path(os.path.normpath(base / p))
    except OSError as err:
        raise JobFileError(f"{field_}: {err.strerror}") from None
    except RuntimeError:  # Python 3.11's Path.resolve on a symbolic link loop
        raise JobFileError(f"{field_}: a symbolic link loop") from None


def _check_columns(where: str, data: dict, numeric: bool) -> None:
    """Column options that fit the format: `header` is for csv/tsv; without a header, columns
    are numbers (label 1 and text 2 unless given); jsonl names keys."""
    fmt = data["format"]
    if data.get("header") is False and fmt not in ("csv", "tsv"):
        raise JobFileError(f"{where}: [data] header = {str(data['header']).lower()}: only csv and tsv files have a "
                           f"header row, not format {fmt!r}")
    if not data.get("header", True):
        data.setdefault("label_column", 1)
        if not numeric:
            data.setdefault("text_column", 2)
    for key in ("text_column", "label_column"):
        value = data.get(key)
        if isinstance(value, str) and not data.get("header", True):
            raise JobFileError(f"{where}: [data] {key} = {value!r} names a column, but header = false; allowed: "
                               "its number (1 is the first column)")
        if isinstance(value, int) and fmt == "jsonl":
            raise JobFileError(f"{where}: [data] {key} = {value}: jsonl names keys; allowed: a key (string)")


def _check_data_files(where: str, data: dict) -> None:
    from gadei_workloads.files import data_file_problem, is_folder

    per_label = data["format"] == "per-label"
    for key in ("train", "validation", "test"):
        paths = data.get(key)
        if paths is None:
            continue
        if per_label and len(paths) == 1 and is_folder(paths[0]):
            try:
                files = tuple(sorted(p for p in paths[0].iterdir() if p.is_file() and not p.name.startswith(".")))
            except OSError as err:
                raise JobFileError(f"{where}: [data] {key} = {str(paths[0])!r}: {err.strerror}") from None
            if len(files) < 2:
                raise JobFileError(f"{where}: [data] {key} = {str(paths[0])!r}: a per-label folder needs one file per "
                                   f"label (at least two), it holds {len(files)}")
            data[key] = paths = files
        if not per_label and len(paths) != 1:
            raise JobFileError(f"{where}: [data] {key}: format {data['format']!r} reads one file, not "
                               f"{len(paths)}; only per-label takes a list")
        for p in paths:
            problem = data_file_problem(p)
            if problem is not None:
                raise JobFileError(f"{where}: [data] {key} = {str(p)!r}: {problem}")
