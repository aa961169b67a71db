"""`gadei watchdog JOB ...`: a job's watchdog. This command becomes the watchdog's own program
(`python -m gadei_watchdog` with the same arguments, same pid): gadei starts the watchdog as a
process and never imports it (`gadei_watchdog` uses gadei). Its arguments are checked here
first, by the same declarations (`gadei.watchdog_options`)."""

from .. import watchdog_options
from .._proc import python_command


def cmd_watchdog(args) -> int:
    from ..launch import become

    given = args.argv[args.argv.index("watchdog") + 1:]  # as typed: the watchdog parses them again
    become(python_command("gadei_watchdog", *given))
    return 1  # not reached: exec returns only by raising


def add_parser(sub) -> None:
    p = sub.add_parser("watchdog", help=watchdog_options.HELP, description=watchdog_options.DESCRIPTION)
    watchdog_options.add_arguments(p)
    p.set_defaults(func=cmd_watchdog)
