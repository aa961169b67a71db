"""`gadei watchdog JOB ...`: the supervisor of a running job. This command becomes the
supervisor's own program (`python -m gadei_watchdog` with the same arguments, same pid): gadei
starts the supervisor as a process and never imports it (`gadei_watchdog` uses gadei). Its
arguments are checked here first, by the same declarations (`gadei.supervisor`)."""

from .. import supervisor
from .._proc import python_command


def cmd_watchdog(args) -> int:
    from ..launch import become

    given = args.argv[args.argv.index("watchdog") + 1:]  # as typed: the supervisor parses them again
    become(python_command(supervisor.PROGRAM, *given))
    return 1  # not reached: exec returns only by raising


def add_parser(sub) -> None:
    p = sub.add_parser("watchdog", help=supervisor.HELP, description=supervisor.DESCRIPTION)
    supervisor.add_arguments(p)
    p.set_defaults(func=cmd_watchdog)
