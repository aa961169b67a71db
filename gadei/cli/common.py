"""What the verbs share: JSON lines for programs, a model and data from --workload/--data/--seed
or --model."""

import argparse
import importlib
import logging

from .. import data, options
from ..errors import GadeiError

log = logging.getLogger("gadei.cli")


def workload_model(args):
    """(workload, train, validation, test, model) for --workload/--data/--seed (`gadei.data.workload_model`)."""
    return data.workload_model(args.workload, args.data, args.seed)


def factory_model(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise GadeiError(f"--model {spec!r}: expected MODULE:CALLABLE, e.g. mypkg.models:build")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise GadeiError(f"--model {spec!r}: {err}") from err
    return factory()


def add_workload(p, required: bool) -> None:
    p.add_argument("--workload", required=required, help="built-in workload (textcnn, ngram, lstm, mlp)")
    p.add_argument("--data", help="data set: 'generated', 'generated:SEED', 'trec:FOLDER', 'sst2:FOLDER', or "
                   "'trec' / 'sst2' (under GADEI_DATA_DIR); default: the workload's generated set")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initial weights and the data order")


JOB_FILE = "--job-file"


def job_file_defaults(argv: list[str]) -> dict | None:
    """The defaults a `--job-file FILE` of `gadei serve` or `gadei learn` gives (the verb's
    parser takes them as its defaults, so a flag given as well wins), or None without one.
    This is how `gadei run` hands a job to the processes it starts: the job as run (its
    output folder's job.toml), not its options re-encoded as flags; a flag given as well wins
    over the file (a bridged node's --lr)."""
    from .. import jobfile, options
    from ..modes import RuleOptions
    from ..transport.options import TransportOptions

    path = None
    for i, arg in enumerate(argv):
        if arg == JOB_FILE and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith(JOB_FILE + "="):
            path = arg.partition("=")[2]
    if path is None or not argv or argv[0] not in ("serve", "learn"):
        return None
    job = jobfile.load(path)
    if job.workload == jobfile.AUTO:
        raise GadeiError(f"{JOB_FILE} {path}: workload {jobfile.AUTO!r} is a job that picks its model among several: "
                         "`gadei run` (or the daemon) trains each candidate from its own folder, "
                         f"{job.output / 'candidates' / 'WORKLOAD' / 'job.toml'}; give one of those")
    t = job.train
    values = dict(workload=job.workload, data=f"job:{job.path}", seed=t.seed)
    if argv[0] == "serve":
        values.update(mode=t.mode, checkpoint_every=job.checkpoint.interval, keep=job.checkpoint.keep,
                      private=job.private,
                      **{f.name: getattr(t, f.name) for f in options.declared(RuleOptions)},
                      **{f.name: getattr(job.transport, f.name) for f in options.declared(TransportOptions)})
    else:
        if t.epochs is None or t.batch is None:
            raise GadeiError(f"{JOB_FILE} {path}: [train] epochs and batch must be given (the job as `gadei run` "
                             "ran it, in its output folder, has them)")
        values.update(epochs=t.epochs, batch=t.batch, patience=t.patience, torch_threads=t.learner_threads)
    return values


def add_job_file(p) -> None:
    p.add_argument(JOB_FILE, metavar="FILE", help="take the job's workload, data, seed and options from this job "
                   "file (a flag given as well wins); how `gadei run` starts its processes")


def at_least(low: float, kind=int, *, above: bool = False):
    """An argparse type: a `kind` (int or float) of at least `low` (`above`: more than `low`),
    so that `--lines 0` or `--interval -1` is refused with what is allowed, not met later as a
    traceback or a silent nonsense (a rate over no time)."""
    what = "an integer" if kind is int else "a number"
    allowed = f"{what} {'above' if above else 'from'} {low:g}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}; allowed: {allowed}") from None
        if value != value or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"{text!r}: allowed: {allowed}")
        return value

    parse.__name__ = kind.__name__
    return parse


def int_list(low: int, what: str):
    """An argparse type: comma-separated integers, each at least `low` (`what` they are, for
    the error: "mini-batch sizes"), as a list; `--batches 2,,x` is refused with what is allowed."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(item) for item in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give {what} as integers, comma-separated") from None
        if any(value < low for value in values):
            raise argparse.ArgumentTypeError(f"{text!r}: {what} must be at least {low}")
        return values

    parse.__name__ = "list of integers"
    return parse


def train_value(name: str):
    """An argparse type: an integer checked as a job file's [train] `name` is (its range,
    declared in `gadei.jobfile.Train`), so that `gadei demo --batch 0` or `gadei learn
    --epochs 0` is refused before a process starts."""

    def parse(text: str) -> int:
        from ..jobfile import Train

        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; allowed: "
                                             f"{options.allowed(Train, name)}") from None
        try:
            return options.check(Train, name, value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(options.said(text, err)) from None

    parse.__name__ = "int"
    return parse
