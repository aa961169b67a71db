"""`gadei status`: the daemon's jobs, and each running job's learners, rates and staleness."""

import logging
import sys
import time

from ..errors import GadeiError
from ..console import emit
from .common import at_least
from .daemon import FROM_DISK, daemon_jobs

log = logging.getLogger("gadei.cli")


def cmd_status(args) -> int:
    from .. import status
    from ..region import Region, inspect, list_jobs

    queued, source = daemon_jobs(args.job)
    if queued:
        if args.json:
            emit({"event": "daemon-jobs", "jobs": queued, "daemon": source})
        else:
            from ..daemon import format_jobs

            if source != "answered":
                print(f"gadei: {FROM_DISK[source]}", file=sys.stderr)
            print(format_jobs(queued))
    jobs = [args.job] if args.job else list_jobs()
    if not jobs:
        if not queued:
            print("no gadei jobs on this machine", file=sys.stderr)
        return 0
    while True:
        for job in jobs:
            found = inspect(job)
            if found is None:
                if args.job and not queued:
                    raise GadeiError(f"job {job!r} has no region")
                continue  # it stopped since we listed it
            if found.state in ("foreign", "other-user"):
                print(f"job {job}: {found.state}: {found.problem}")
                continue
            if found.state == "starting":
                print(f"job {job}: starting: server pid {found.server_pid} is still creating its region")
                continue
            try:
                region = Region.attach(job, readonly=True)
            except GadeiError as err:  # e.g. the job stopped since inspect looked
                if args.job:
                    raise
                print(f"job {job}: {err}", file=sys.stderr)
                continue
            with region:
                before = status.read(region)
                time.sleep(args.interval)
                after = status.read(region)
            rate = status.rates(before, after)
            if args.json:
                emit({**after.to_json(), "rates": rate.__dict__, "state": found.state})
            else:
                print(status.format_table(after, rate)
                      + ("" if found.state == "running" else "  (LEFTOVER: server gone)"))
        if not args.watch:
            return 0


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="the daemon's jobs, and each running job's learners, rates and staleness",
                       description="The daemon's jobs (while no daemon runs, the job records it left on disk, as it "
                       "last recorded them), then each running job's server, supervisor, learners, rates and "
                       "staleness, read from its region without writing to it.")
    p.add_argument("job", nargs="?", help="the job (default: every job on this machine)")
    p.add_argument("--interval", type=at_least(0, float, above=True), default=0.5,
                   help="seconds between the two samples of a rate")
    p.add_argument("--watch", action="store_true", help="repeat until interrupted")
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    p.set_defaults(func=cmd_status)
