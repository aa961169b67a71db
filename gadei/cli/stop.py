"""`gadei stop`: stop a job cleanly."""

import logging
import sys

from .common import at_least

log = logging.getLogger("gadei.cli")


def cmd_stop(args) -> int:
    from ..launch import stop_job

    stop_job(args.job, timeout=args.timeout)
    print(f"gadei: job {args.job!r} stopped", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("stop", help="stop a job cleanly: apply what was pushed, unlink the region")
    p.add_argument("job")
    p.add_argument("--timeout", type=at_least(0, float, above=True), default=30.0,
                   help="seconds to wait for the server (default 30)")
    p.set_defaults(func=cmd_stop)
