"""The `gadei watchdog` command, also run as `python -m gadei_watchdog` (how `gadei serve`
starts a job's watchdog): its arguments, made from `WatchdogSettings`' declarations, and what it runs."""

import argparse
import json

from gadei import console, options
from gadei.errors import GadeiError

from . import WatchdogSettings, Watchdog

_D = WatchdogSettings(checkpoint_dir="")  # the defaults
HELP = "watch a running job, checkpoint it, restart what dies"
DESCRIPTION = ("Attach to a running job, report dead or hung learners and server, and take a checkpoint between "
               "two updates every --every seconds; launch --learners and restart them when they die; restart a dead "
               "server (--restart). Ends when the job stops (0; 4 when it gave up on a launched learner) or its "
               "server is dead for good (3).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("job")
    add("--adopt", action="store_true", help="take over from this job's dead watchdog: its settings and launched "
        "learners (as `gadei serve --adopt JOB`, in the foreground)")
    add("--checkpoint-dir", help="where checkpoints go (required unless --adopt)")
    add("--every", type=float, default=_D.every, help="seconds between checkpoints (default %(default)g)")
    add("--keep", type=int, default=_D.keep, help="checkpoints kept (default %(default)d)")
    options.add_arguments(parser, WatchdogSettings)  # --interval --max-missed --max-restarts --window --backoff
    add("--restart", metavar="JSON", help="the gadei arguments that started the server, as a JSON list: when it "
        "dies, start it again with them plus --replace --no-watchdog --resume (gadei serve passes this)")
    add("--learners", metavar="JSON", help="learners to launch and keep running: a JSON list of argument lists of "
        "`gadei learn JOB` (gadei serve --learner passes this)")
    add("--progress", metavar="JSON", help="how far each launched learner got, from the checkpoint the server "
        "resumed from: they start there (gadei serve --resume passes this)")
    add("--log-dir", help="where launched processes write their logs (default: --checkpoint-dir)")
    add("--outputs", metavar="FOLDER", help="a `gadei run` output folder: when the job ends, record how "
        "(logs/watchdog-end.json) and, if the `gadei run` that started it is gone, write its outputs")


def command(args) -> int:
    """Run the watchdog the arguments describe, to its end (its exit code)."""
    restart = None
    if args.restart:
        restart = _json("--restart", args.restart, _is_arguments, "a JSON list of gadei arguments")
    if args.adopt:
        return Watchdog.adopt(args.job).run()
    if not args.checkpoint_dir:
        raise GadeiError("gadei watchdog: give --checkpoint-dir (or --adopt)")
    learners = []
    if args.learners:
        learners = _json("--learners", args.learners, lambda v: isinstance(v, list) and all(map(_is_arguments, v)),
                         "a JSON list of lists of arguments")
    settings = WatchdogSettings(checkpoint_dir=args.checkpoint_dir, every=args.every, keep=args.keep,
                        interval=args.interval, max_missed=args.max_missed, restart=restart,
                        max_restarts=args.max_restarts, window=args.window, learners=learners,
                        backoff=args.backoff, log_dir=args.log_dir, outputs=args.outputs)
    try:
        settings.check()
    except ValueError as err:
        raise GadeiError(str(err)) from None
    progress = {}
    if args.progress:
        progress = _json("--progress", args.progress, lambda v: isinstance(v, dict),
                         "a checkpoint's progress, a JSON object")
    dog = Watchdog(args.job, settings)
    dog.learners.resume(progress)
    return dog.run()


def _is_arguments(value) -> bool:
    return isinstance(value, list) and all(isinstance(a, str) for a in value)


def _json(flag: str, text: str, fits, expected: str):
    """The JSON value of `flag`'s `text`, when `fits` says it has the shape expected (plain
    checks, not `assert`: `python -O` would drop those).

    Raises:
        GadeiError: naming the flag, its value and what was `expected`.
    """
    try:
        value = json.loads(text)
    except ValueError:
        pass
    else:
        if fits(value):
            return value
    raise GadeiError(f"{flag} {text!r}: expected {expected}")


def main(argv=None) -> int:
    """`python -m gadei_watchdog JOB ...`: the same as `gadei watchdog JOB ...`."""
    parser = argparse.ArgumentParser(prog="gadei watchdog", description=DESCRIPTION)
    add_arguments(parser)
    return console.run(command, parser.parse_args(argv), prog="gadei watchdog")
