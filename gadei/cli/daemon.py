"""`gadei daemon` and the requests it takes: `submit`, `cancel`, `logs`, each through
`gadei.Client`."""

import logging
import sys
from dataclasses import asdict

from ..errors import GadeiError
from .common import at_least

log = logging.getLogger("gadei.cli")


def cmd_daemon(args) -> int:
    from .. import daemon

    if args.action == "stop":
        pid = daemon.Client(timeout=args.timeout).stop_daemon(timeout=args.timeout)
        print(f"gadei: daemon (pid {pid}) stopped; running jobs go on and the next daemon finds them",
              file=sys.stderr)
        return 0
    if args.action == "systemd-unit":
        print(daemon.systemd_unit(), end="")
        return 0
    daemon.Daemon(max_jobs=args.max_jobs, metrics_port=args.metrics_port).serve_forever()
    return 0


def cmd_submit(args) -> int:
    from ..daemon import Client

    job = Client().submit(args.jobfile, resume=args.resume)
    print(f"gadei: job {job.name} queued; output in {job.output}; `gadei status {job.name}`, "
          f"`gadei logs {job.name}`, `gadei cancel {job.name}`")
    return 0


def cmd_cancel(args) -> int:
    from ..daemon import Client

    job = Client().cancel(args.job)
    print(f"gadei: job {job.name} {job.state}: {job.message}")
    return 0


def cmd_logs(args) -> int:
    from ..daemon import Client, NoDaemon
    from ..daemon.jobs import job_logs, read_records, state_dir

    printed = False
    try:
        for line in Client().logs(args.job, args.lines, follow=args.follow):
            print(line, flush=args.follow)
            printed = True
    except NoDaemon as err:  # the logs are on disk all the same: found by the record the daemon left
        if printed:  # it stopped while they were followed
            raise
        folder = state_dir(create=False)
        record = read_records(folder).get(args.job)
        if record is None:
            raise GadeiError(f"{err}; and no job {args.job!r} is recorded in {folder / 'jobs'}") from None
        print(f"gadei: {FROM_DISK['not running']}" + (" (not followed)" if args.follow else ""), file=sys.stderr)
        print(job_logs(record, args.lines))
    return 0


# What `gadei status` and `gadei logs` say when the job records are read from disk (`daemon_jobs`)
FROM_DISK = {"not running": "the daemon is not running: the job records as it left them (`gadei daemon` brings them "
             "up to date)",
             "no answer": "the daemon did not answer: the job records as it last wrote them"}


def daemon_jobs(job: str | None) -> tuple[list[dict], str]:
    """The daemon's job records (all, or `job`'s; [] when it has no such job) and where they
    come from: "answered" (the daemon's answer) or, when no daemon answers, the records it left on
    disk, and why (a key of FROM_DISK: "not running", or "no answer" from a stopped or hung
    daemon)."""
    from ..daemon import Client
    from ..daemon.jobs import read_records, state_dir
    from ..errors import DaemonRefused, NoDaemon

    client = Client(timeout=5)
    try:
        return [asdict(r) for r in ([client.job(job)] if job is not None else client.jobs())], "answered"
    except DaemonRefused:  # e.g. no such job
        return [], "answered"
    except NoDaemon:
        source = "not running"
    except GadeiError:  # a stopped daemon (timeout), or one that hung up
        source = "no answer"
    records = sorted(read_records(state_dir(create=False)).values(), key=lambda r: r.submitted)
    return [asdict(r) for r in records if job is None or r.name == job], source


def _max_jobs(text: str) -> int | None:
    """--max-jobs: "auto" (None) or a count of at least 1."""
    return None if text == "auto" else at_least(1)(text)


def add_parser(sub) -> None:
    p = sub.add_parser("daemon", help="run queued job files for this user (training as a service)",
                       description="Accept job files from `gadei submit` on a Unix socket in this user's runtime "
                       "folder (mode 0600; another user's request is refused by its peer uid), queue them and run "
                       "each when what it needs is free (or up to --max-jobs N at once), under its own supervisor (as "
                       "`gadei run` runs one), started warm from a process that has imported what a job needs. Job "
                       "records are kept on disk: a restarted daemon knows every job's state and output, and finds "
                       "jobs that ran on without it. One daemon per state folder (a lock). See docs/daemon.md.")
    p.add_argument("action", nargs="?", choices=("run", "stop", "systemd-unit"), default="run",
                   help="run: serve in the foreground until `gadei daemon stop`, SIGTERM or Ctrl-C (default); "
                   "stop: stop the running daemon and wait until it has; systemd-unit: print a systemd user unit "
                   "that runs it")
    p.add_argument("--max-jobs", type=_max_jobs, default=None, metavar="auto|N",
                   help="auto (default): a waiting job starts when the cores (its learners' threads and one for its "
                   "server), memory and /dev/shm it needs are free, by [job] priority then submit order, a later job "
                   "that fits before an earlier one that does not; `gadei status` says what a waiting job waits for, "
                   "and a job that could never fit is refused at submit. N: up to N jobs at once, each counting on "
                   "its share of the cores (GADEI_CORES: the cores / N) for its learners' threads and its server")
    p.add_argument("--timeout", type=at_least(0, float, above=True), default=30.0,
                   help="stop: seconds to wait for it (default 30)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="run: serve the daemon's figures (jobs per state; per running job its version, updates/s, "
                   "samples/s, restarts, learners alive; uptime, requests refused) in the Prometheus text format on "
                   "http://127.0.0.1:PORT/metrics, loopback only (0: any free port, which it prints); needs "
                   "`pip install 'gadei[prometheus]'` (default: off)")
    p.set_defaults(func=cmd_daemon)

    p = sub.add_parser("submit", help="queue a job file with the daemon (checked first)")
    p.add_argument("jobfile", help="the job's TOML file (as for `gadei run`)")
    p.add_argument("--resume", action="store_true", help="go on with the (cancelled or failed) run in the job's "
                   "output folder, as `gadei run --resume`")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("cancel", help="cancel a queued or running daemon job (its checkpoints and logs stay)")
    p.add_argument("job", help="the job's name, as `gadei submit` printed it and `gadei status` lists it")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("logs", help="the last lines of a daemon job's logs",
                       description="The last lines of a daemon job's logs (logs/supervisor.log, server.log and each "
                       "learner's in its output folder); while no daemon runs, found by the job record it left on "
                       "disk. A job that never started (cancelled while queued) has none, and this says so. --follow: "
                       "then the lines they gain, as they are written, until the job has ended (a queued job is waited "
                       "for).")
    p.add_argument("job", help="the job's name, as `gadei submit` printed it and `gadei status` lists it")
    p.add_argument("--lines", type=at_least(1), default=50, help="lines per log (default 50)")
    p.add_argument("--follow", "-f", action="store_true", help="then the lines the logs gain, until the job ends")
    p.set_defaults(func=cmd_logs)
