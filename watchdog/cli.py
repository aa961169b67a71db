"""The `gadei watchdog` command, run as `python -m gadei_watchdog` (how `gadei serve` and `gadei
watchdog` start a job's watchdog): its arguments, made from `WatchdogSettings`' declarations
(`gadei.watchdog_options`), and what it runs."""

import argparse

from gadei import console, options
from gadei.errors import GadeiError
from gadei.watchdog_options import DESCRIPTION, WatchdogSettings, add_arguments

from . import Watchdog


def command(args) -> int:
    """Run the watchdog the arguments describe, to its end (its exit code)."""
    if args.adopt:
        return Watchdog.adopt(args.job).run()
    if not args.checkpoint_dir:
        raise GadeiError("gadei watchdog: give --checkpoint-dir (or --adopt)")
    settings = options.from_args(WatchdogSettings, args)
    try:
        settings.check()
    except ValueError as err:
        raise GadeiError(str(err)) from None
    dog = Watchdog(args.job, settings)
    dog.learners.resume(args.progress)
    return dog.run()


def main(argv=None) -> int:
    """`python -m gadei_watchdog JOB ...`: the same as `gadei watchdog JOB ...`."""
    parser = argparse.ArgumentParser(prog="gadei watchdog", description=DESCRIPTION)
    add_arguments(parser)
    return console.run(command, parser.parse_args(argv), prog="gadei watchdog")
