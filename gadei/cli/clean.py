"""`gadei clean`: remove what crashed servers and dead supervisors left behind (regions,
supervisors' records, server records)."""

import logging
import os
import sys

from ..errors import GadeiError

log = logging.getLogger("gadei.cli")


def cmd_clean(args) -> int:
    from ..region import SHM_DIR, inspect, list_jobs, remove

    jobs = args.jobs or list_jobs()
    removed = 0
    for job in jobs:
        found = inspect(job)
        if found is None:
            if args.jobs:
                print(f"{job}: no region")
            continue
        if found.state in ("running", "starting"):
            print(f"{job}: kept: served by live pid {found.server_pid} (use `gadei stop {job}`)")
            continue
        if found.state == "other-user":
            print(f"{job}: kept: {found.problem}")
            continue
        if found.state == "foreign" and not args.force:
            print(f"{job}: kept: {found.problem} (use --force to remove it)")
            continue
        what = "leftover of dead server pid %d" % found.server_pid if found.state == "leftover" else found.problem
        if args.dry_run:
            print(f"{job}: would remove {SHM_DIR}/gadei-{job} ({what}, {found.size / 1e6:.1f} MB)")
            continue
        remove(job)
        removed += 1
        print(f"{job}: removed {SHM_DIR}/gadei-{job} ({what}, {found.size / 1e6:.1f} MB)")
    _clean_supervisor_records(args)
    _clean_server_records(args)
    if not args.dry_run:
        print(f"gadei: removed {removed} region(s)", file=sys.stderr)
    return 0


def _clean_supervisor_records(args) -> None:
    """Remove the records of supervisors that died (a live one removes its own at its end), once
    their job has no region."""
    from ..region import inspect
    from ..supervisor import saved_jobs

    try:
        saved = saved_jobs()
    except PermissionError as err:
        print(f"gadei: runtime folder skipped: {err}", file=sys.stderr)
        return
    for job, path in saved.items():
        try:
            if (args.jobs and job not in args.jobs) or inspect(job) is not None:
                continue
        except GadeiError:  # not a job name gadei writes: not ours to remove
            continue
        if args.dry_run:
            print(f"{job}: would remove the dead supervisor's record {path}")
            continue
        os.unlink(path)
        print(f"{job}: removed the dead supervisor's record {path}")


def _clean_server_records(args) -> None:
    """Remove the records of servers that are gone (`JOB.server.json`, kept outside the region
    for `gadei stop`); a live server's record stays."""
    from ..server_record import gone_server_records

    try:
        gone = gone_server_records(args.jobs)
    except PermissionError as err:
        print(f"gadei: server records skipped: {err}", file=sys.stderr)
        return
    for job, path, which in gone:
        what = f"the record of {which}, which is gone" if which.startswith("server") else f"{which} of a server"
        if args.dry_run:
            print(f"{job}: would remove {what} ({path})")
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        print(f"{job}: removed {what} ({path})")


def add_parser(sub) -> None:
    p = sub.add_parser("clean", help="remove regions left behind by crashed servers (and dead supervisors' and "
                       "dead servers' records)")
    p.add_argument("jobs", nargs="*", help="jobs to clean (default: all of this user's leftovers)")
    p.add_argument("--force", action="store_true", help="also remove objects that are not readable gadei regions")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed")
    p.set_defaults(func=cmd_clean)
