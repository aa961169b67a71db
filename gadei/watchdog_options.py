"""A job's watchdog as gadei starts it: its settings (`WatchdogSettings`, each declared once),
the flags they make (`gadei watchdog`, `python -m gadei_watchdog`: `add_arguments`), and the
command line that hands them to the watchdog's process (`command`), written and read back by
the same declarations (`gadei.options.to_argv`, `from_args`). The watchdog (`gadei_watchdog`)
runs as a process of its own and uses gadei; gadei starts it, and never imports it."""

import argparse
import json
from dataclasses import dataclass

from . import options
from ._proc import python_command
from .checkpoint import CheckpointOptions
from .options import option, same_as

HELP = "watch a running job, checkpoint it, restart what dies"
DESCRIPTION = ("Attach to a running job, report dead or hung learners and server, and take a checkpoint between "
               "two updates every --every seconds; launch --learners and restart them when they die; restart a dead "
               "server (--restart). Ends when the job stops (0; 4 when it gave up on a launched learner) or its "
               "server is dead for good (3).")


def _strings(value: list) -> list:
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"holds {json.dumps(item)}, not a string; allowed: a JSON list of strings")
    return value


def _argument_lists(value: list) -> list:
    for item in value:
        if not isinstance(item, list) or not all(isinstance(a, str) for a in item):
            raise ValueError(f"holds {json.dumps(item)}, not a list of strings; allowed: a JSON list of lists of "
                             "strings")
    return value


@dataclass
class WatchdogSettings:
    """How a watchdog watches: what `gadei serve` starts it with, what `gadei watchdog` takes
    as flags, and what it saves for a watchdog that adopts the job (`--adopt`)."""

    checkpoint_dir: str = option("", "where checkpoints go (and, by default, launched processes' logs); required "
                                 "unless --adopt", metavar="DIR")
    every: float = same_as(CheckpointOptions, "interval")  # a job file's [checkpoint] interval
    keep: int = same_as(CheckpointOptions, "keep")
    interval: float = option(0.5, "seconds between looks and beats", low=0, low_open=True, high=3600)
    max_missed: int = option(20, "beats a process may miss before it counts as hung", low=1, high=10**6)
    restart: list[str] | None = option(None, "the gadei arguments that started the server: when it dies, start it "
                                       "again with them plus --replace --no-watchdog --resume (gadei serve passes "
                                       "this); none: it is not restarted", allowed="a JSON list of strings",
                                       check=_strings)
    max_restarts: int = option(3, "restarts of the server, and of each launched learner, within the window before "
                               "giving up", low=1, high=10**6)
    window: float = option(300.0, "seconds over which restarts are counted", low=0, low_open=True, high=10**9)
    learners: list[list[str]] = option([], "learners to launch and keep running: the arguments after `gadei learn "
                                       "JOB` of each (gadei serve --learner passes this); each gets `--entry N`, its place in "
                                       "the list, unless it names an entry",
                                       allowed="a JSON list of lists of strings", check=_argument_lists)
    backoff: float = option(1.0, "seconds before a dead learner's first restart, doubling with each", low=0, high=3600)
    log_dir: str | None = option(None, "where launched processes write their logs", metavar="DIR",
                                 shown="--checkpoint-dir")
    outputs: str | None = option(None, "a `gadei run` output folder: when the job ends, record how "
                                 "(logs/watchdog-end.json) and, if the `gadei run` that started it is gone, write its "
                                 "outputs", metavar="FOLDER")

    def check(self) -> None:
        """Raises ValueError naming the first setting whose value is not allowed."""
        try:
            options.check_all(self)
        except ValueError as err:
            raise ValueError(f"watchdog {err}") from None


def _progress(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint's progress; allowed: a JSON object")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The watchdog's arguments: JOB, --adopt, a flag for each setting, --progress."""
    parser.add_argument("job")
    parser.add_argument("--adopt", action="store_true", help="take over from this job's dead watchdog: its settings "
                        "and launched learners (as `gadei serve --adopt JOB`, in the foreground)")
    options.add_arguments(parser, WatchdogSettings)
    parser.add_argument("--progress", metavar="JSON", type=_progress, default={}, help="how far each launched "
                        "learner got, from the checkpoint the server resumed from: they start there (gadei serve "
                        "--resume passes this)")


def command(job: str, settings: WatchdogSettings, progress: dict | None = None) -> list[str]:
    """The command line that runs the watchdog of `job` with `settings` (its launched learners
    starting from `progress`, a checkpoint's)."""
    return python_command("gadei_watchdog", job, *options.to_argv(settings),
                          *([f"--progress={json.dumps(progress)}"] if progress else []))
