"""`gadei serve`: create a job's region and run the server's apply loop, leaving a stop record;
with --checkpoint-dir, the job under a supervisor (this command becomes it)."""

import argparse
import logging
import os
import signal
import sys
from dataclasses import asdict

from .. import options
from ..checkpoint import CheckpointOptions
from ..console import emit
from ..env import restarts as recent_restarts
from ..errors import GadeiError
from ..launch import take_stops
from ..modes import MODES, RuleOptions
from ..server_record import EARLY, FAILED, REFUSED, STOPPED, StopRecord, write_stop_record
from ..supervisor import SupervisorSettings
from ..transport.options import TransportOptions
from . import learn
from .common import add_job_file, factory_model, workload_model

log = logging.getLogger("gadei.cli")

def cmd_serve(args) -> int:
    if args.checkpoint_dir and not args.no_supervisor:
        return _supervised(args)
    # SIGTERM/SIGINT stop the server cleanly from the start, before the imports and the model
    # (torch: seconds): one that comes before the server exists is taken once it does (it then
    # stops at once, removes its region and, having served nothing, writes no checkpoint and no
    # --save); one that comes once its region can be seen (published inside Server(): `gadei stop`
    # may come at once) stops it as on `gadei stop`. A server that its supervisor started held them
    # blocked until here (`launch.spawn(held=True)`): not even a stop sent at once is a death.
    asked: list[int] = []
    server = None

    def stop(sig, _frame) -> None:
        asked.append(sig)
        if server is not None:
            server.request_stop()

    previous = take_stops(stop)
    record = StopRecord(args.job, REFUSED)
    try:
        try:
            server = _server(args)
        except BaseException:  # Server removed what it had made
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            raise
        return _serve(args, server, asked, record)
    except BaseException as err:
        if record.outcome in (REFUSED, FAILED) and not record.reason:
            record.reason = str(err) if isinstance(err, (GadeiError, ValueError, OSError)) else \
                f"{type(err).__name__}: {err}"
        raise
    finally:
        if args.stop_record:
            write_stop_record(args.stop_record, record)
        if args.json:
            emit({"event": "stopped", **asdict(record)})


def _server(args):
    """The server the arguments describe: its region made, its initial weights in it."""
    from ..server import Server

    if args.workload is None and args.model is None and args.params is None:
        raise GadeiError("gadei serve: give the initial weights with --workload, --model or --params")
    if args.learner:
        raise GadeiError("--learner: launched learners are run by the job's supervisor; give --checkpoint-dir "
                         "(and no --no-supervisor)")
    model = None
    if args.workload:
        model = workload_model(args)[-1]
    elif args.model:
        model = factory_model(args.model)
    resume = None
    if args.resume:
        resume = _resume_from(args.resume)
    return Server(args.job, model=model, n_params=args.params, mode=args.mode,
                  rule_options=options.from_args(RuleOptions, args),
                  transport=options.from_args(TransportOptions, args),
                  learners=args.learners, threads=args.threads, spin_us=args.spin_us, replace=args.replace,
                  resume=resume)


def _resume_from(given: str):
    from .. import checkpoint

    if os.path.isfile(given):
        return checkpoint.load(given)
    found = checkpoint.latest(given)
    if found is None:
        raise GadeiError(f"--resume {given}: no checkpoint there that reads and verifies")
    return found


def _serve(args, server, asked: list[int], record: StopRecord) -> int:
    """Serve until stopped; the stop checkpoint and --save; the exit code. `record` says how it ended."""
    early = bool(asked)  # stopped before it served: what it would write is what it started from
    if early:
        server.request_stop()
    server.region.header.set("restarts", len(recent_restarts()))  # this server is its supervisor's restart number n
    try:
        print(f"gadei: serving job {args.job!r} (pid {os.getpid()}); stop it with `gadei stop {args.job}`",
              file=sys.stderr, flush=True)
        try:
            report = server.serve(grace=args.grace)
        except GadeiError as err:  # it stopped the job as failed: the reason is in the region too
            record.outcome, record.reason = FAILED, server.failure() or str(err)
            raise
        record.outcome = EARLY if early else STOPPED
        code = 0
        if early:
            print(f"gadei: job {args.job!r} stopped before it served: no checkpoint, nothing saved", file=sys.stderr,
                  flush=True)
        elif args.checkpoint_dir:
            from ..checkpoint import CheckpointError

            try:
                record.checkpoint = str(server.write_checkpoint(args.checkpoint_dir, keep=args.keep))
            except CheckpointError as err:  # the weights still go to --save
                print(f"gadei: error: no checkpoint at stop: {err}", file=sys.stderr, flush=True)
                code = 1
        if args.save and not early:
            server.save(args.save, private=args.private)
        from ..ring import published

        h, entries = server.region.header, [server.region.entry(i) for i in range(server.region.shape.capacity)]
        record.applied, record.seconds, record.version = report.applied, report.seconds, report.version
        record.first_applied = report.first_applied or 0.0
        record.applied_total, record.resumed_applied = h.get("applied"), h.get("resumed_applied")
        record.published = published(server.region)
        record.discarded = sum(e.get("discarded") for e in entries)
        record.nonfinite_skipped = h.get("nonfinite_skipped")
        return code
    finally:
        server.close()


def _supervised(args) -> int:
    """`gadei serve ... --checkpoint-dir DIR`: the job under a supervisor. This process becomes
    the job's supervisor (`python -m gadei_watchdog`, same pid), which starts the server with these
    arguments (and --no-supervisor) as its child, launches the --learner learners, checkpoints the
    job and restarts what dies; the settings are checked here first."""
    from .. import supervisor
    from ..launch import become

    restart, skip = [], False  # this command's arguments less the learners (the supervisor keeps those)
    for arg in args.argv:
        if skip:
            skip = False
        elif arg == "--learner":
            skip = True
        elif not arg.startswith("--learner="):
            restart.append(arg)
    settings = SupervisorSettings(checkpoint_dir=args.checkpoint_dir, every=args.checkpoint_every, keep=args.keep,
                                  interval=args.watch_interval, max_missed=args.max_missed,
                                  max_restarts=args.max_restarts, server=restart,
                                  learners=[_learner_args(text) for text in args.learner], log_dir=args.log_dir)
    try:
        settings.check()
    except ValueError as err:
        raise GadeiError(f"gadei serve: {err}") from None
    become(supervisor.command(args.job, settings))
    return 1  # not reached: exec returns only by raising


def _learner_args(text: str) -> list[str]:
    """`--learner '--epochs 8 --shard 0/2'`: the arguments after `gadei learn JOB`, checked now."""
    import shlex

    try:
        args = shlex.split(text)
    except ValueError as err:
        raise GadeiError(f"--learner {text!r}: {err}") from None
    parser = argparse.ArgumentParser(prog="gadei")
    learn.add_parser(parser.add_subparsers())
    try:
        parsed = parser.parse_args(["learn", "JOB", *args])
    except SystemExit:
        raise GadeiError(f"--learner {text!r}: not arguments of `gadei learn` (see `gadei learn --help`)") from None
    if parsed.start_at:
        raise GadeiError(f"--learner {text!r}: --start-at is the supervisor's to set")
    return args


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="create a job's region and apply its learners' gradients",
                       description="Create the job's shared region and run the server's apply loop until "
                       "`gadei stop JOB`, SIGTERM or Ctrl-C. Initial weights come from --workload or --model "
                       "(deterministic for a seed), or, with --params, from the first learner that attaches. A "
                       "training loss that turns NaN or infinite stops a job of `gadei run` alone; served so, its "
                       "non-finite gradients are skipped and counted (--nonfinite skip) and the learners train on, "
                       "unless --nonfinite stop: the job stops as failed on the first one, with the reason.")
    p.add_argument("job")
    add_job_file(p)
    init = p.add_mutually_exclusive_group()
    init.add_argument("--workload",
                      help="build the initial model of this built-in workload (textcnn, ngram, lstm, mlp)")
    init.add_argument("--model", help="MODULE:CALLABLE returning the initial torch.nn.Module")
    init.add_argument("--params", type=int, help="only the parameter count; the first learner uploads weights")
    p.add_argument("--data", help="data set the workload's model is sized for (see `gadei learn --help`)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's initial weights")
    p.add_argument("--mode", choices=MODES, default="async",
                   help="update rule: async (Hogwild ASGD, default), consistent (ASGD, pulls never see half an "
                   "update), sync (SSGD rounds), elastic (EASGD)")
    options.add_arguments(p.add_argument_group("update rule (gadei.modes.RuleOptions)"), RuleOptions)
    options.add_arguments(p.add_argument_group("transport (gadei.transport.options.TransportOptions)"),
                          TransportOptions)
    p.add_argument("--learners", type=int, default=8, help="most learners attached at once (default 8)")
    p.add_argument("--threads", type=int, help="the most OpenMP threads of the update kernel: one per 262,144 "
                   "elements of an update (default GADEI_THREADS)")
    p.add_argument("--spin-us", type=float, help="the most microseconds to spin for the next gradient, while they "
                   "come less than 200 us apart (GADEI_SPIN_US)")
    p.add_argument("--replace", action="store_true", help="replace a region left behind by a crashed server")
    p.add_argument("--grace", type=float, default=5.0, help="seconds to wait for learners to leave on stop")
    p.add_argument("--save", help="write the final weights here (a state dict torch.load reads; mode 0600 whatever "
                   "the umask, as `gadei run`'s model.pt, unless the --job-file says [output] private = false)")
    p.set_defaults(private=True)  # a --job-file's [output] private (`job_file_defaults`)
    p.add_argument("--checkpoint-dir", help="checkpoints go here, and the job runs under a supervisor: this command "
                   "becomes it, which starts the server (its child), takes a checkpoint every --checkpoint-every "
                   "seconds and restarts a crashed server from the newest; the server writes one more at its stop")
    p.add_argument("--checkpoint-every", type=float, default=CheckpointOptions.interval,
                   help="seconds between checkpoints (default %(default)g)")
    p.add_argument("--no-supervisor", action="store_true", help="with --checkpoint-dir: no supervisor, only the "
                   "server's checkpoint at its stop (how a supervisor starts the server)")
    p.add_argument("--keep", type=int, default=CheckpointOptions.keep,
                   help="checkpoints kept in --checkpoint-dir (default %(default)d)")
    p.add_argument("--resume", metavar="DIR|FILE", help="go on from the newest valid checkpoint in DIR, or from "
                   "the checkpoint FILE (weights, version, momentum or Adagrad sums; launched learners from its "
                   "progress); the model must match")
    p.add_argument("--watch-interval", type=float, default=SupervisorSettings.interval,
                   help="the supervisor's seconds between looks and beats (default %(default)g)")
    p.add_argument("--max-missed", type=int, default=SupervisorSettings.max_missed, help="beats a process may miss "
                   "before the supervisor counts it as hung (default %(default)d)")
    p.add_argument("--max-restarts", type=int, default=SupervisorSettings.max_restarts, help="restarts of the server, "
                   f"and of each launched learner, within {SupervisorSettings.window:g} s before the supervisor "
                   "gives up (default %(default)d)")
    p.add_argument("--log-dir", help="where the server (restarted ones too) and the launched learners write their "
                   "logs under a supervisor (default: --checkpoint-dir)")
    p.add_argument("--learner", action="append", default=[], metavar="ARGS",
                   help="with --checkpoint-dir: the supervisor launches a learner `gadei learn JOB ARGS` (one "
                   "quoted string; repeat for more), restarts it where it was if it dies, and stops the job "
                   "when every launched learner is done")
    p.add_argument("--stop-record", metavar="FILE", help="write how this server ended here, as JSON (outcome: "
                   "stopped, failed, refused or early; the reason; its gradients applied, published, discarded; its "
                   "stop checkpoint): what its supervisor reads")
    p.add_argument("--json", action="store_true", help="print the same record as a JSON line when it ends "
                   '({"event": "stopped", ...})')
    p.set_defaults(func=cmd_serve)
