"""`gadei serve`: create a job's region and run the server's apply loop (and its watchdog)."""

import argparse
import logging
import os
import signal
import subprocess
import sys
import time

from .._proc import how_it_ended, python_command
from ..console import last_error
from ..env import restarts as recent_restarts
from ..errors import GadeiError
from ..launch import spawn, take_stops, wait_or_kill

from .. import options, watchdog_options
from ..checkpoint import CheckpointOptions
from ..modes import MODES, RuleOptions
from ..protocol import Deadline
from ..transport.options import TransportOptions
from ..watchdog_options import WatchdogSettings
from ..watchdog_record import LEARNERS_FAILED
from . import learn
from .common import add_job_file, emit, factory_model, workload_model

log = logging.getLogger("gadei.cli")

CUSTODY_INTERVAL = 2.0  # seconds (at least) between the server's looks for a job left without watchdog and owner


def cmd_serve(args) -> int:
    if args.adopt:
        return _adopt(args)
    # SIGTERM/SIGINT stop the server cleanly from the start, before the imports and the model
    # (torch: seconds): one that comes before the server exists is taken once it does (it then
    # stops at once, removes its region and, having served nothing, writes no checkpoint and no
    # --save); one that comes once its region can be seen (published inside Server(): `gadei stop`
    # may come at once) stops it as on `gadei stop`. A server that `gadei run` started held them
    # blocked until here (`launch.spawn(held=True)`): not even a stop sent at once is a death.
    asked: list[int] = []
    server = None

    def stop(sig, _frame) -> None:
        asked.append(sig)
        if server is not None:
            server.request_stop()

    previous = take_stops(stop)
    from ..server import Server

    if args.workload is None and args.model is None and args.params is None:
        raise GadeiError("gadei serve: give the initial weights with --workload, --model or --params")
    if args.learner and (not args.checkpoint_dir or args.no_watchdog):
        raise GadeiError("--learner: launched learners are run by the job's watchdog; give --checkpoint-dir "
                         "(and no --no-watchdog)")
    learners = [_learner_args(text) for text in args.learner]
    watching = _watchdog_settings(args, learners) if args.checkpoint_dir and not args.no_watchdog else None
    model = None
    if args.workload:
        model = workload_model(args)[-1]
    elif args.model:
        model = factory_model(args.model)
    resume = None
    if args.resume:
        from .. import checkpoint

        if os.path.isfile(args.resume):
            resume = checkpoint.load(args.resume)
        else:
            resume = checkpoint.latest(args.resume)
            if resume is None:
                raise GadeiError(f"--resume {args.resume}: no checkpoint there that reads and verifies")
    try:
        server = Server(args.job, model=model, n_params=args.params, mode=args.mode,
                        rule_options=options.from_args(RuleOptions, args),
                        transport=options.from_args(TransportOptions, args),
                        learners=args.learners, threads=args.threads, spin_us=args.spin_us, replace=args.replace,
                        resume=resume)
    except BaseException:  # Server removed what it had made
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        raise
    early = bool(asked)  # stopped before it served: what it would write is what it started from
    if early:
        server.request_stop()
    restarts = recent_restarts()
    server.region.header.set("restarts", len(restarts))  # this server is a watchdog's restart number n
    dog = custody = None
    try:
        if watching is not None and not asked:
            dog = _start_watchdog(args.job, watching, resume.progress if resume is not None else None)
        if args.outputs and args.checkpoint_dir:  # a `gadei run` job's server (or one its watchdog restarted)
            from ..custody import Custody
            from pathlib import Path

            awaited = dog is not None or bool(restarts)  # a watchdog registers: ours, or the one that restarted us
            custody = Custody(server.region, Path(args.outputs), server.request_stop,
                              max(args.watch_interval, CUSTODY_INTERVAL),
                              args.watch_interval * args.max_missed if awaited else None).start()
        print(f"gadei: serving job {args.job!r} (pid {os.getpid()}); stop it with `gadei stop {args.job}`",
              file=sys.stderr, flush=True)
        report = server.serve(grace=args.grace)
        code = 0
        if early:
            print(f"gadei: job {args.job!r} stopped before it served: no checkpoint, nothing saved", file=sys.stderr,
                  flush=True)
        elif args.checkpoint_dir:
            from ..checkpoint import CheckpointError

            try:
                server.write_checkpoint(args.checkpoint_dir, keep=args.keep)
            except CheckpointError as err:  # the weights still go to --save
                print(f"gadei: error: no checkpoint at stop: {err}", file=sys.stderr, flush=True)
                code = 1
        if args.save and not early:
            server.save(args.save, private=args.private)
        if args.json:
            from ..ring import published

            h, entries = server.region.header, [server.region.entry(i) for i in range(server.region.shape.capacity)]
            emit({"event": "stopped", "job": args.job, "applied": report.applied, "seconds": report.seconds,
                   "version": report.version, "applied_total": h.get("applied"),
                   "resumed_applied": h.get("resumed_applied"),
                   "published": published(server.region),
                   "discarded": sum(e.get("discarded") for e in entries),
                   "nonfinite_skipped": h.get("nonfinite_skipped")})
    finally:
        if custody is not None:
            custody.close()
        server.close()
        if custody is not None:
            custody.write_outputs()  # after the stop: what no watchdog or `gadei run` is left to write
        if dog is not None:  # it sees the job stopped within one interval and reaps its learners
            wait_or_kill(dog, 60.0, f"job {args.job!r}: the watchdog")
            if dog.returncode == LEARNERS_FAILED:
                print(f"gadei: error: job {args.job!r} ended without some launched learners: the watchdog gave "
                      f"up on them (see their logs in {args.log_dir or args.checkpoint_dir})", file=sys.stderr)
                code = 1
    return code


def _watchdog_settings(args, learners: list[list[str]]) -> WatchdogSettings:
    """The settings of the job's watchdog, from this command's flags, checked before anything
    starts: it launches `learners`, and restarts the server with this command's arguments
    less the learners (the watchdog keeps those)."""
    restart, skip = [], False
    for arg in args.argv:
        if skip:
            skip = False
        elif arg == "--learner":
            skip = True
        elif not arg.startswith("--learner="):
            restart.append(arg)
    settings = WatchdogSettings(checkpoint_dir=args.checkpoint_dir, every=args.checkpoint_every, keep=args.keep,
                                interval=args.watch_interval, max_missed=args.max_missed,
                                max_restarts=args.max_restarts, restart=restart, learners=learners,
                                log_dir=args.log_dir, outputs=args.outputs)
    try:
        settings.check()
    except ValueError as err:
        raise GadeiError(f"gadei serve: {err}") from None
    return settings


def _start_watchdog(job: str, settings: WatchdogSettings, progress: dict | None) -> subprocess.Popen:
    """The job's watchdog, in its own session (a Ctrl-C meant for the server does not reach
    it, and it outlives a server that crashes, to restart it). It launches its learners, from
    `progress` (a resumed checkpoint's) when there is one."""
    return spawn(watchdog_options.command(job, settings, progress if settings.learners else None))


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
        raise GadeiError(f"--learner {text!r}: --start-at is the watchdog's to set")
    return args


def _adopt(args) -> int:
    """`gadei serve --adopt JOB`: a new watchdog takes over a running job whose watchdog died."""
    from ..watchdog_record import load_state

    from ..custody import live_watchdog
    from ..region import Region, inspect

    found = inspect(args.job)
    if found is None or found.state != "running":
        raise GadeiError(f"job {args.job!r} has no running server to adopt" + (f" ({found.state})" if found else ""))
    live = live_watchdog(args.job)
    if live:
        raise GadeiError(f"job {args.job!r} already has a live watchdog (pid {live}): nothing to adopt")
    try:
        saved, _ = load_state(args.job)
    except FileNotFoundError:
        raise GadeiError(f"job {args.job!r}: no watchdog state to adopt on this machine; start a watchdog with "
                         f"`gadei watchdog {args.job} --checkpoint-dir DIR`") from None
    folder = saved.get("log_dir") or saved["checkpoint_dir"]
    os.makedirs(folder, exist_ok=True)
    out_path = os.path.join(folder, "watchdog.log")
    dog = spawn(python_command("gadei_watchdog", args.job, "--adopt"), log=out_path)  # detached: it must not
    # hold this command's output open
    deadline = Deadline(60)
    with Region.attach(args.job, readonly=True) as region:
        while region.header.get("watchdog_pid") != dog.pid:
            if dog.poll() is not None:
                live = live_watchdog(args.job)
                if live:  # another process adopted the job at the same moment: the header took one of us
                    raise GadeiError(f"job {args.job!r} was adopted by watchdog pid {live} at the same moment; this "
                                     "one stood down")
                raise GadeiError(f"job {args.job!r}: the adopting watchdog {how_it_ended(dog.returncode)}"
                                 + _last_error(out_path) + f" (see {out_path})")
            if deadline.expired():
                dog.kill()
                raise GadeiError(f"job {args.job!r}: the adopting watchdog did not register within 60 s")
            time.sleep(0.05)
    print(f"gadei: job {args.job!r} adopted by watchdog pid {dog.pid}; its log: {out_path}", file=sys.stderr,
          flush=True)
    return 0


def _last_error(log_path: str) -> str:
    """": " and the last error a watchdog wrote to its log (`gadei watchdog: error: ...`), or ""."""
    said = last_error(log_path, "gadei watchdog")
    return f": {said}" if said else ""


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
    p.add_argument("--adopt", action="store_true", help="start a new watchdog that takes over the running JOB "
                   "(its old watchdog died), with the old one's settings and launched learners; nothing else")
    init = p.add_mutually_exclusive_group()
    init.add_argument("--workload", help="build the initial model of this built-in workload (textcnn, ngram, lstm, mlp)")
    init.add_argument("--model", help="MODULE:CALLABLE returning the initial torch.nn.Module")
    init.add_argument("--params", type=int, help="only the parameter count; the first learner uploads weights")
    p.add_argument("--data", help="data set the workload's model is sized for (see `gadei learn --help`)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's initial weights")
    p.add_argument("--mode", choices=MODES, default="async",
                   help="update rule: async (Hogwild ASGD, default), consistent (ASGD, pulls never see half an "
                   "update), sync (SSGD rounds), elastic (EASGD)")
    options.add_arguments(p.add_argument_group("update rule (gadei.modes.RuleOptions)"), RuleOptions)
    options.add_arguments(p.add_argument_group("transport (gadei.transport.options.TransportOptions)"), TransportOptions)
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
    p.add_argument("--checkpoint-dir", help="checkpoints go here: the job's watchdog takes one every "
                   "--checkpoint-every seconds and restarts a crashed server from the newest; one more at clean stop")
    p.add_argument("--checkpoint-every", type=float, default=CheckpointOptions.interval,
                   help="seconds between checkpoints (default %(default)g)")
    p.add_argument("--no-watchdog", action="store_true", help="with --checkpoint-dir: no watchdog, only the "
                   "checkpoint at clean stop")
    p.add_argument("--keep", type=int, default=CheckpointOptions.keep,
                   help="checkpoints kept in --checkpoint-dir (default %(default)d)")
    p.add_argument("--resume", metavar="DIR|FILE", help="go on from the newest valid checkpoint in DIR, or from "
                   "the checkpoint FILE (weights, version, momentum or Adagrad sums; launched learners from its progress); the "
                   "model must match")
    p.add_argument("--watch-interval", type=float, default=WatchdogSettings.interval,
                   help="the watchdog's seconds between looks and beats (default %(default)g)")
    p.add_argument("--max-missed", type=int, default=WatchdogSettings.max_missed, help="beats a process may miss before the "
                   "watchdog counts it as hung (default %(default)d)")
    p.add_argument("--max-restarts", type=int, default=WatchdogSettings.max_restarts, help="restarts of the server, and of "
                   f"each launched learner, within {WatchdogSettings.window:g} s before the watchdog gives up (default %(default)d)")
    p.add_argument("--log-dir", help="where the watchdog's launched learners and restarted servers write their "
                   "logs (default: --checkpoint-dir)")
    p.add_argument("--outputs", metavar="FOLDER", help="a `gadei run` output folder: when the job ends, the watchdog "
                   "records how (logs/watchdog-end.json) and, if the `gadei run` that started the job is gone, writes "
                   "its outputs (metrics.jsonl, accuracy.png, result.json); with --checkpoint-dir, the server starts a "
                   "new watchdog (--adopt) when the watchdog and the `gadei run` are both gone, or fails the job "
                   "with the reason when none can take over")
    p.add_argument("--learner", action="append", default=[], metavar="ARGS",
                   help="with --checkpoint-dir: the watchdog launches a learner `gadei learn JOB ARGS` (one "
                   "quoted string; repeat for more), restarts it where it was if it dies, and stops the job "
                   "when every launched learner is done")
    p.add_argument("--json", action="store_true", help="print a JSON line when stopped")
    p.set_defaults(func=cmd_serve)
