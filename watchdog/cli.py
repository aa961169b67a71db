"""The supervisor's command, `python -m gadei_watchdog` (how gadei starts a job's supervisor, and
what `gadei serve --checkpoint-dir` becomes): its arguments, made from `SupervisorSettings`'
declarations (`gadei.supervisor`), and what it runs: a job file's supervisor (`JOB --job-file FILE`), or
the supervisor of a job whose server's arguments it is given (JOB --server ...)."""

import argparse
import sys

from gadei import console, options
from gadei._proc import how_it_ended
from gadei.errors import GadeiError
from gadei.server_record import REFUSED
from gadei.supervisor import DESCRIPTION, SERVER_DEAD, SupervisorSettings, add_arguments

from . import job
from .supervisor import Supervisor


def command(args) -> int:
    """Run the supervisor the arguments describe, to its end (its exit code)."""
    if args.job_file:
        return job.run(args.job_file, name=args.job, resume=args.resume, by=args.by, named=args.named, since=args.since,
                       claim=args.claim)
    if not args.job:
        raise GadeiError("give JOB (and the arguments of its server) or --job-file")
    if not args.checkpoint_dir:
        raise GadeiError("give --checkpoint-dir")
    settings = options.from_args(SupervisorSettings, args)
    try:
        settings.check()
    except ValueError as err:
        raise GadeiError(str(err)) from None
    from gadei.launch import take_stops

    progress = args.progress
    if settings.learners and not progress:
        settings.server, progress = _resume_point(settings.server)
    supervisor = Supervisor(args.job, settings, progress=progress)
    take_stops(lambda sig, _frame: supervisor.ask_stop())
    code = supervisor.run()
    record = supervisor.server_ended()
    if code == SERVER_DEAD and record is not None and record.outcome == REFUSED:  # as the server alone would say
        raise GadeiError(record.reason)
    if code == 0 and supervisor.server_code:  # it stopped the job, and failed at its stop (its last checkpoint)
        print(f"gadei supervisor: error: the server {how_it_ended(supervisor.server_code)} at its stop (see its log)",
              file=sys.stderr, flush=True)
        return 1
    return code


def _resume_point(args: list[str]) -> tuple[list[str], dict]:
    """The server's arguments with its --resume (the last one counts, as for argparse) made the
    checkpoint its launched learners go on from: a folder is the newest checkpoint there that
    records their progress (a newer one without it, a stopped server's own, holds updates the
    learners would train again); and that progress. Without --resume: as given, and {}.

    Raises:
        GadeiError: the checkpoint, or every one in the folder, records no progress of the
            learners (a stopped server's own): learners launched from their start would apply
            again what its weights hold. The server alone (`gadei serve --resume`, no
            --learner) may go on from it."""
    import os

    from gadei import checkpoint

    at, given = None, None
    for i, arg in enumerate(args):
        if arg == "--resume" and i + 1 < len(args):
            at, given = (i, i + 2), args[i + 1]
        elif arg.startswith("--resume="):
            at, given = (i, i + 1), arg.partition("=")[2]
    if given is None:
        return args, {}
    found = checkpoint.load(given) if os.path.isfile(given) else checkpoint.latest(given, with_progress=True)
    if found is None and checkpoint.latest(given) is None:
        return args, {}  # nothing there: the server says so
    if found is None or not found.progress:
        raise GadeiError(f"--resume {given}: {'no checkpoint there records' if found is None else 'it does not record'}"
                         " how far the launched learners got (a stopped server's own checkpoint does not), so they "
                         "would train again what its weights hold; resume from a checkpoint the supervisor took, or "
                         "the server alone (`gadei serve --resume` without --learner)")
    return [*args[:at[0]], "--resume", str(found.path), *args[at[1]:]], found.progress


def main(argv=None) -> int:
    """`python -m gadei_watchdog ...`: a job's supervisor (what `gadei serve --checkpoint-dir` runs)."""
    parser = argparse.ArgumentParser(prog="gadei supervisor", description=DESCRIPTION)
    add_arguments(parser)
    return console.run(command, parser.parse_args(argv), prog="gadei supervisor")
