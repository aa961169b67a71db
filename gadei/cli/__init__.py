"""The `gadei` command: serve a job, attach learners, watch, stop, clean up, benchmark.

Tables and progress go to people on stderr/stdout; `--json` switches a command to JSON
lines on stdout for programs. Errors gadei raises on purpose print one line and exit 2.
"""

import argparse
import sys

from .. import __version__, console
from .._proc import tie_to_parent
from ..errors import GadeiError
from .common import job_file_defaults
from . import bench, bridge, clean, daemon, demo, learn, run, serve, status, stop


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gadei", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"gadei {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(sub)
    run.add_parser(sub)
    daemon.add_parser(sub)
    learn.add_parser(sub)
    status.add_parser(sub)
    stop.add_parser(sub)
    clean.add_parser(sub)
    demo.add_parser(sub)
    bridge.add_parser(sub)
    bench.add_parser(sub)
    parser.verbs = sub.choices  # name -> the verb's parser
    return parser


def command() -> None:
    """The `gadei` program (its console script): `main` on this process's arguments, then the
    process ends with its code (`console.leave`)."""
    console.leave(main())


def main(argv=None) -> int:
    tie_to_parent()  # first: a process of a demo's or a bench's job ends with it
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        defaults = job_file_defaults(argv)
    except GadeiError as err:
        print(f"gadei: error: {err}", file=sys.stderr)
        return 2
    if defaults:
        parser.verbs[argv[0]].set_defaults(**defaults)
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "intermixed", False):  # positionals after an option (`predict RUN A --top 2 B`)
        args = parser.verbs[args.command].parse_intermixed_args(argv[1:], namespace=args)
    elif extra:  # the verb's own parser answers, with its usage
        parser.verbs[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = argv  # how this command was started (a supervisor starts its server with it)
    return console.run(args.func, args)
