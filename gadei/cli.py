"""The `gadei` command: serve a job, attach learners, watch, stop, clean up, benchmark.

Tables and progress go to people on stderr/stdout; `--json` switches a command to JSON
lines on stdout for programs. Errors gadei raises on purpose print one line and exit 2.
"""

import argparse
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time

import gadei_watchdog.cli as watchdog_cli

from . import __version__, console, data
from ._proc import python_command
from .errors import GadeiError
from .modes import NONFINITE

log = logging.getLogger("gadei.cli")


def _emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


# ------------------------------------------------------------------ models and data


def _workload_model(args):
    """(workload, train, test, model) for --workload/--data/--seed."""
    from gadei_workloads import get

    workload = get(args.workload)
    train, test = data.load(workload, args.data or workload.default_data)
    return workload, train, test, workload.build_model(train, args.seed)


def _factory_model(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise GadeiError(f"--model {spec!r}: expected MODULE:CALLABLE, e.g. mypkg.models:build")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise GadeiError(f"--model {spec!r}: {err}") from err
    return factory()


# ------------------------------------------------------------------ commands


def cmd_serve(args) -> int:
    from .server import Server

    if args.adopt:
        return _adopt(args)
    if args.workload is None and args.model is None and args.params is None:
        raise GadeiError("gadei serve: give the initial weights with --workload, --model or --params")
    if args.learner and (not args.checkpoint_dir or args.no_watchdog):
        raise GadeiError("--learner: launched learners are run by the job's watchdog; give --checkpoint-dir "
                         "(and no --no-watchdog)")
    learners = [_learner_args(text) for text in args.learner]
    model = None
    if args.workload:
        model = _workload_model(args)[3]
    elif args.model:
        model = _factory_model(args.model)
    resume = None
    if args.resume:
        from . import checkpoint

        if os.path.isfile(args.resume):
            resume = checkpoint.load(args.resume)
        else:
            resume = checkpoint.latest(args.resume)
            if resume is None:
                raise GadeiError(f"--resume {args.resume}: no checkpoint there that reads and verifies")
    server = Server(
        args.job,
        model=model,
        n_params=args.params,
        mode=args.mode,
        lr=args.lr,
        momentum=args.momentum,
        optimizer=args.optimizer,
        stale_lr=args.stale_lr,
        stale_bound=args.stale_bound,
        alpha=args.alpha,
        tau=args.tau,
        drop_after=args.drop_after,
        nonfinite=args.nonfinite,
        grad_dtype=args.grad_dtype,
        row_sparse=args.row_sparse,
        max_rows=args.max_rows,
        learners=args.learners,
        slots=args.slots,
        threads=args.threads,
        spin_us=args.spin_us,
        replace=args.replace,
        resume=resume,
    )
    restarts = [t for t in os.environ.get("GADEI_RESTARTS", "").split(",") if t.strip()]
    server.region.header.set("restarts", len(restarts))  # this server is a watchdog's restart number n
    dog = None
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: server.request_stop())
        if args.checkpoint_dir and not args.no_watchdog:
            dog = _start_watchdog(args, learners, resume.progress if resume is not None else None)
        print(f"gadei: serving job {args.job!r} (pid {os.getpid()}); stop it with `gadei stop {args.job}`",
              file=sys.stderr, flush=True)
        report = server.serve(grace=args.grace)
        code = 0
        if args.checkpoint_dir:
            from .checkpoint import CheckpointError

            try:
                server.write_checkpoint(args.checkpoint_dir, keep=args.keep)
            except CheckpointError as err:  # the weights still go to --save
                print(f"gadei: error: no checkpoint at stop: {err}", file=sys.stderr, flush=True)
                code = 1
        if args.save:
            server.save(args.save)
        if args.json:
            h, entries = server.region.header, [server.region.entry(i) for i in range(server.region.shape.capacity)]
            _emit({"event": "stopped", "job": args.job, "applied": report.applied, "seconds": report.seconds,
                   "version": report.version, "applied_total": h.get("applied"),
                   "resumed_applied": h.get("resumed_applied"),
                   "published": sum(e.get("head") for e in entries),
                   "discarded": sum(e.get("discarded") for e in entries),
                   "nonfinite_skipped": h.get("nonfinite_skipped")})
    finally:
        server.close()
        if dog is not None:
            try:
                dog.wait(timeout=60)  # it sees the job stopped within one interval and reaps its learners
            except subprocess.TimeoutExpired:
                dog.kill()
                dog.wait()
            if dog.returncode == 4:  # gadei_watchdog.LEARNERS_FAILED
                print(f"gadei: error: job {args.job!r} ended without some launched learners: the watchdog gave "
                      f"up on them (see their logs in {args.log_dir or args.checkpoint_dir})", file=sys.stderr)
                code = 1
    return code


def _start_watchdog(args, learners: list[list[str]], progress: dict | None) -> subprocess.Popen:
    """The job's watchdog, in its own session (a Ctrl-C meant for the server does not reach
    it, and it outlives a server that crashes, to restart it). It launches `learners`, from
    `progress` (a resumed checkpoint's) when there is one."""
    restart, skip = [], False
    for arg in args.argv:  # the server is restarted without the learners: the watchdog keeps those
        if skip:
            skip = False
        elif arg == "--learner":
            skip = True
        elif not arg.startswith("--learner="):
            restart.append(arg)
    command = [*python_command("gadei_watchdog", args.job), "--checkpoint-dir", args.checkpoint_dir,
               "--every", str(args.checkpoint_every), "--keep", str(args.keep), "--restart", json.dumps(restart),
               "--interval", str(args.watch_interval), "--max-missed", str(args.max_missed),
               "--max-restarts", str(args.max_restarts)]
    if args.log_dir:
        command += ["--log-dir", args.log_dir]
    if learners:
        command += ["--learners", json.dumps(learners)]
        if progress:
            command += ["--progress", json.dumps(progress)]
    return subprocess.Popen(command, start_new_session=True)


def _learner_args(text: str) -> list[str]:
    """`--learner '--epochs 8 --shard 0/2'`: the arguments after `gadei learn JOB`, checked now."""
    import shlex

    try:
        args = shlex.split(text)
    except ValueError as err:
        raise GadeiError(f"--learner {text!r}: {err}") from None
    parser = build_parser()
    try:
        parsed = parser.parse_args(["learn", "JOB", *args])
    except SystemExit:
        raise GadeiError(f"--learner {text!r}: not arguments of `gadei learn` (see `gadei learn --help`)") from None
    if parsed.start_at:
        raise GadeiError(f"--learner {text!r}: --start-at is the watchdog's to set")
    return args


def _adopt(args) -> int:
    """`gadei serve --adopt JOB`: a new watchdog takes over a running job whose watchdog died."""
    from gadei_watchdog.launched import load_state

    from .region import Region, inspect

    found = inspect(args.job)
    if found is None or found.state != "running":
        raise GadeiError(f"job {args.job!r} has no running server to adopt" + (f" ({found.state})" if found else ""))
    try:
        saved, _ = load_state(args.job)
    except FileNotFoundError:
        raise GadeiError(f"job {args.job!r}: no watchdog state to adopt on this machine; start a watchdog with "
                         f"`gadei watchdog {args.job} --checkpoint-dir DIR`") from None
    folder = saved.get("log_dir") or saved["checkpoint_dir"]
    os.makedirs(folder, exist_ok=True)
    out_path = os.path.join(folder, "watchdog.log")
    with open(out_path, "ab") as out:  # detached: it must not hold this command's output open
        dog = subprocess.Popen(python_command("gadei_watchdog", args.job, "--adopt"), stdout=out,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    with Region.attach(args.job, readonly=True) as region:
        while region.header.get("watchdog_pid") != dog.pid:
            if dog.poll() is not None:
                raise GadeiError(f"job {args.job!r}: the adopting watchdog exited with {dog.returncode}")
            if time.monotonic() >= deadline:
                dog.kill()
                raise GadeiError(f"job {args.job!r}: the adopting watchdog did not register within 60 s")
            time.sleep(0.05)
    print(f"gadei: job {args.job!r} adopted by watchdog pid {dog.pid}; its log: {out_path}", file=sys.stderr,
          flush=True)
    return 0


def cmd_learn(args) -> int:
    import torch

    from .device import resolve
    from .learner import Learner

    device = resolve(args.device)  # a CUDA device on a machine without one fails here, before the data loads
    torch.set_num_threads(args.torch_threads)
    workload, train, test, model = _workload_model(args)
    model.to(device)
    batches = workload.batches

    shard, shards = _shard(args.shard)
    if args.start_at < 0:
        raise GadeiError(f"--start-at {args.start_at}: must be >= 0")
    # Dropout masks: each learner (and each restart of one) draws its own, reproducibly. Left
    # at torch's fixed default seed, every learner would use the same mask at the same step,
    # which weakens dropout (on SST-2, two learners ended 1-2 points below one).
    torch.manual_seed(hash((args.seed, shard, shards, args.start_at)) & 0x7FFF_FFFF_FFFF_FFFF)
    per_epoch = len(range(shard, len(train), shards))
    first_epoch, skip = divmod(args.start_at, per_epoch) if per_epoch else (args.epochs, 0)
    model.train()
    started = time.monotonic()
    samples = 0
    with Learner(model, args.job, pull=args.pull, push=args.push, device=device) as learner:
        staleness = _Staleness(learner.region)
        for epoch in range(first_epoch, args.epochs):
            epoch_start, steps, seen = time.monotonic(), 0, 0
            loss_sum = torch.zeros((), device=device)  # summed on the device: no GPU wait per step
            correct = torch.zeros((), dtype=torch.int64, device=device)
            for x, y in batches(train, args.batch, epoch=epoch, seed=args.seed, shard=shard, shards=shards):
                if skip > 0:  # a restarted learner: these samples' gradients are in the weights already
                    skip -= len(y)
                    continue
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss, right = workload.loss_and_correct(model, x, y)
                workload.backward(model, loss, learner.constraint_lr)
                learner.step(samples=len(y))
                loss_sum += loss.detach()
                steps += 1
                samples += len(y)
                seen += len(y)
                correct += right
            record = {
                "event": "epoch", "job": args.job, "learner": learner.learner_id, "epoch": epoch + 1,
                "loss": loss_sum.item() / max(1, steps), "train_accuracy": correct.item() / max(1, seen), "steps": steps,
                "samples_per_s": steps and (samples / (time.monotonic() - started)),
                "epoch_seconds": time.monotonic() - epoch_start, "version": learner.version,
                **staleness.since_last(), "nonfinite_skipped": learner.region.header.get("nonfinite_skipped"),
            }
            if args.eval:
                learner.refresh()
                record["test_accuracy"] = workload.evaluate(model, test)
                model.train()
            _report(args, record)
    return 0


class _Staleness:
    """The job's gradient staleness (versions between the weights a gradient was computed on
    and the version it was applied at), over every learner of the region, between two calls.
    Counted per ring owner, so a learner that leaves or is restarted does not skew it."""

    def __init__(self, region):
        self.region = region
        self.last = self._counts()

    def _counts(self) -> dict[tuple[int, int], tuple[float, int, int]]:
        from . import status

        return {(l.learner, l.pid): (l.stale_mean * l.applied, l.applied, l.stale_max)
                for l in status.read(self.region).learners}

    def since_last(self) -> dict:
        """`staleness_mean` of the gradients applied since the last call (all learners) and
        `staleness_max`, the largest any of them had."""
        now = self._counts()
        stale = applied = most = 0
        for owner, (total, count, top) in now.items():
            before_total, before_count, before_top = self.last.get(owner, (0.0, 0, 0))
            if count > before_count:
                stale += total - before_total
                applied += count - before_count
                most = max(most, top)  # the owner's largest ever; its new gradients are among them
        self.last = now
        return {"staleness_mean": round(stale / applied, 3) if applied else 0.0, "staleness_max": most}


def _report(args, record: dict) -> None:
    if args.json:
        _emit(record)
        return
    acc = f", test accuracy {record['test_accuracy']:.2%}" if "test_accuracy" in record else ""
    print(f"learner {record['learner']} epoch {record['epoch']}: loss {record['loss']:.4f}, "
          f"{record['samples_per_s']:.0f} samples/s, version {record['version']:,}{acc}", flush=True)


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise GadeiError(f"--shard {text!r}: expected INDEX/COUNT, e.g. 0/2") from None
    if not 0 <= index < count:
        raise GadeiError(f"--shard {text!r}: INDEX must be in 0..COUNT-1")
    return index, count


def cmd_status(args) -> int:
    from . import status
    from .region import Region, inspect, list_jobs

    queued = _daemon_jobs(args.job)
    if queued:
        if args.json:
            _emit({"event": "daemon-jobs", "jobs": queued})
        else:
            from .daemon import format_jobs

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
                _emit({**after.to_json(), "rates": rate.__dict__, "state": found.state})
            else:
                print(status.format_table(after, rate) + ("" if found.state == "running" else "  (LEFTOVER: server gone)"))
        if not args.watch:
            return 0


def _daemon_jobs(job: str | None) -> list[dict]:
    """The daemon's job records (all, or `job`'s), [] when no daemon runs or it has no such job."""
    from .daemon import request, socket_path

    try:
        answer = request(socket_path(), {"op": "status", "job": job}, timeout=5)
    except (OSError, ValueError, GadeiError):  # no daemon, a stopped one (timeout), or one that hung up
        return []
    return answer.get("jobs", []) if answer.get("ok") else []


def cmd_daemon(args) -> int:
    from . import daemon

    if args.action == "stop":
        pid = daemon.stop(timeout=args.timeout)
        print(f"gadei: daemon (pid {pid}) stopped; running jobs go on and the next daemon finds them",
              file=sys.stderr)
        return 0
    if args.action == "systemd-unit":
        print(daemon.systemd_unit(), end="")
        return 0
    daemon.Daemon(max_jobs=args.max_jobs).serve_forever()
    return 0


def cmd_submit(args) -> int:
    from .daemon import client

    job = client({"op": "submit", "jobfile": os.path.abspath(args.jobfile), "resume": args.resume})["job"]
    print(f"gadei: job {job['name']} queued; output in {job['output']}; `gadei status {job['name']}`, "
          f"`gadei logs {job['name']}`, `gadei cancel {job['name']}`")
    return 0


def cmd_cancel(args) -> int:
    from .daemon import client

    job = client({"op": "cancel", "job": args.job})["job"]
    print(f"gadei: job {job['name']} {job['state']}: {job['message']}")
    return 0


def cmd_logs(args) -> int:
    from .daemon import client

    print(client({"op": "logs", "job": args.job, "lines": args.lines})["text"])
    return 0


def cmd_stop(args) -> int:
    from .launch import stop_job

    stop_job(args.job, timeout=args.timeout)
    print(f"gadei: job {args.job!r} stopped", file=sys.stderr)
    return 0


def cmd_clean(args) -> int:
    from .region import SHM_DIR, inspect, list_jobs, remove

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
    _clean_watchdog_states(args)
    if not args.dry_run:
        print(f"gadei: removed {removed} region(s)", file=sys.stderr)
    return 0


def _clean_watchdog_states(args) -> None:
    """Remove the saved state of watchdogs that died with no one adopting their job, once
    the job has no region (nothing is left to adopt)."""
    import glob

    from .env import runtime_dir
    from .region import inspect

    try:
        folder = runtime_dir()
    except PermissionError as err:
        print(f"gadei: runtime folder skipped: {err}", file=sys.stderr)
        return
    for path in glob.glob(os.path.join(folder, "*.watchdog.json")):
        job = os.path.basename(path)[: -len(".watchdog.json")]
        try:
            if (args.jobs and job not in args.jobs) or inspect(job) is not None:
                continue
        except GadeiError:  # not a job name gadei writes: not ours to remove
            continue
        if args.dry_run:
            print(f"{job}: would remove the dead watchdog's state {path}")
            continue
        os.unlink(path)
        print(f"{job}: removed the dead watchdog's state {path}")


def cmd_run(args) -> int:
    from .run import run_job

    return run_job(args.jobfile, quiet=args.quiet, resume=args.resume)


def cmd_predict(args) -> int:
    from .run import predict

    for label, probability in predict(args.run_dir, args.text, top=args.top):
        print(f"{probability:7.2%}  {label}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args)


def cmd_bridge(args) -> int:
    from .bridge import Options, main as bridge_main

    bucket = None if args.bucket_mb == "auto" else _number_arg("--bucket-mb", args.bucket_mb)
    options = Options(strategy=args.strategy, interval=args.interval, every=args.every, alpha=args.alpha,
                      bucket_mb=bucket, float16=args.float16, timeout=args.timeout,
                      checkpoint_dir=args.checkpoint_dir, save=args.save, json=args.json)
    return bridge_main(args.job, options, per_rank=args.job_per_rank)


def _number_arg(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise GadeiError(f"{name} {text!r}: expected a number or 'auto'") from None


def cmd_bench(args) -> int:
    from .bench import run_bench

    return run_bench(args)


# ------------------------------------------------------------------ the parser


def _add_workload(p, required: bool) -> None:
    p.add_argument("--workload", required=required, help="built-in workload (textcnn, lstm, mlp)")
    p.add_argument("--data", help="data set: 'generated', 'generated:SEED', 'trec:FOLDER', 'sst2:FOLDER', or "
                   "'trec' / 'sst2' (under GADEI_DATA_DIR); default: the workload's generated set")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initial weights and the data order")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gadei", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"gadei {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="create a job's region and apply its learners' gradients",
                       description="Create the job's shared region and run the server's apply loop until "
                       "`gadei stop JOB`, SIGTERM or Ctrl-C. Initial weights come from --workload or --model "
                       "(deterministic for a seed), or, with --params, from the first learner that attaches.")
    p.add_argument("job")
    p.add_argument("--adopt", action="store_true", help="start a new watchdog that takes over the running JOB "
                   "(its old watchdog died), with the old one's settings and launched learners; nothing else")
    init = p.add_mutually_exclusive_group()
    init.add_argument("--workload", help="build the initial model of this built-in workload (textcnn, lstm, mlp)")
    init.add_argument("--model", help="MODULE:CALLABLE returning the initial torch.nn.Module")
    init.add_argument("--params", type=int, help="only the parameter count; the first learner uploads weights")
    p.add_argument("--data", help="data set the workload's model is sized for (see `gadei learn --help`)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's initial weights")
    p.add_argument("--mode", choices=("async", "consistent", "sync", "elastic"), default="async",
                   help="update rule: async (Hogwild ASGD, default), consistent (ASGD, pulls never see half an "
                   "update), sync (SSGD rounds), elastic (EASGD)")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    p.add_argument("--momentum", type=float, default=0.0, help="momentum kept by the server (default 0: none)")
    p.add_argument("--optimizer", choices=("sgd", "adagrad"), default="sgd",
                   help="the server's update: sgd (w -= lr g) or adagrad (per weight, lr divided by the root of "
                   "the sum of its squared gradients; async, consistent, sync) (default sgd)"),
    p.add_argument("--stale-lr", action="store_true", help="async/consistent: divide lr by each gradient's staleness")
    p.add_argument("--stale-bound", type=int, default=0,
                   help="async/consistent: no gradient applied more than K versions late (default 0: no bound)")
    p.add_argument("--alpha", type=float, default=0.1, help="elastic: moving rate (default 0.1)")
    p.add_argument("--tau", type=int, default=4, help="elastic: local steps between exchanges (default 4)")
    p.add_argument("--drop-after", type=float, default=10.0,
                   help="sync/stale-bound: seconds without a heartbeat before a learner is left out (default 10)")
    p.add_argument("--nonfinite", choices=NONFINITE, default="skip",
                   help="a gradient with NaN or inf values: skip it and count it (`gadei status` shows the count; "
                   "default), or stop the job with an error (stop)")
    p.add_argument("--grad-dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="gradients in the rings as float32 (default), float16 or bfloat16")
    p.add_argument("--row-sparse", action="store_true",
                   help="embedding tables travel as the rows a mini-batch touched (needs --workload or --model)")
    p.add_argument("--max-rows", type=int, default=8192,
                   help="row-sparse: most distinct rows of a table in one gradient (default 8192)")
    p.add_argument("--learners", type=int, default=8, help="most learners attached at once (default 8)")
    p.add_argument("--slots", type=int, default=2, help="gradient slots per learner ring (default 2)")
    p.add_argument("--threads", type=int, help="OpenMP threads of the update kernel (default GADEI_THREADS)")
    p.add_argument("--spin-us", type=float, help="microseconds to spin for work before sleeping (GADEI_SPIN_US)")
    p.add_argument("--replace", action="store_true", help="replace a region left behind by a crashed server")
    p.add_argument("--grace", type=float, default=5.0, help="seconds to wait for learners to leave on stop")
    p.add_argument("--save", help="write the final weights here (a state dict torch.load reads)")
    p.add_argument("--checkpoint-dir", help="checkpoints go here: the job's watchdog takes one every "
                   "--checkpoint-every seconds and restarts a crashed server from the newest; one more at clean stop")
    p.add_argument("--checkpoint-every", type=float, default=60.0, help="seconds between checkpoints (default 60)")
    p.add_argument("--no-watchdog", action="store_true", help="with --checkpoint-dir: no watchdog, only the "
                   "checkpoint at clean stop")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept in --checkpoint-dir (default 3)")
    p.add_argument("--resume", metavar="DIR|FILE", help="go on from the newest valid checkpoint in DIR, or from "
                   "the checkpoint FILE (weights, version, momentum or Adagrad sums; launched learners from its progress); the "
                   "model must match")
    p.add_argument("--watch-interval", type=float, default=0.5,
                   help="the watchdog's seconds between looks and beats (default 0.5)")
    p.add_argument("--max-missed", type=int, default=20, help="beats a process may miss before the watchdog "
                   "counts it as hung (default 20)")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts of the server, and of each launched "
                   "learner, within 300 s before the watchdog gives up (default 3)")
    p.add_argument("--log-dir", help="where the watchdog's launched learners and restarted servers write their "
                   "logs (default: --checkpoint-dir)")
    p.add_argument("--learner", action="append", default=[], metavar="ARGS",
                   help="with --checkpoint-dir: the watchdog launches a learner `gadei learn JOB ARGS` (one "
                   "quoted string; repeat for more), restarts it where it was if it dies, and stops the job "
                   "when every launched learner is done")
    p.add_argument("--json", action="store_true", help="print a JSON line when stopped")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("run", help="run a job file in the foreground: server, watchdog, learners, outputs",
                       description="Check a job file and its data (any problem is refused before anything "
                       "starts), fill in the defaults, run the job with a watchdog that restarts what crashes, "
                       "print progress, and leave the model, label and vocabulary maps, metrics.jsonl, "
                       "checkpoints and logs in its output folder. See the README's Job files section. A job "
                       "file with a [bridge] section run as `mpiexec -n NODES gadei run JOB.toml` runs one node per "
                       "rank: rank R runs job NAME-rR in FOLDER/node-R with one ring more for the bridge, which it "
                       "runs itself once its job serves (see the README's Across nodes section); alone, or as one "
                       "rank, the file runs on one node.")
    p.add_argument("jobfile", help="the job's TOML file")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--resume", action="store_true", help="go on with the run in the job's output folder (one that "
                   "was cancelled, failed, or ended early) from its newest checkpoint that records the learners' "
                   "progress; only [train] epochs may differ from that run's job.toml")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("daemon", help="run queued job files for this user (training as a service)",
                       description="Accept job files from `gadei submit` on a Unix socket in this user's runtime "
                       "folder (mode 0600; another user's request is refused by its peer uid), queue them and run up "
                       "to --max-jobs at once with `gadei run`. Job records are kept on disk: a restarted daemon "
                       "knows every job's state and output, and finds jobs that ran on without it. One daemon per "
                       "state folder (a lock). See docs/daemon.md.")
    p.add_argument("action", nargs="?", choices=("run", "stop", "systemd-unit"), default="run",
                   help="run: serve in the foreground until `gadei daemon stop`, SIGTERM or Ctrl-C (default); "
                   "stop: stop the running daemon and wait until it has; systemd-unit: print a systemd user unit "
                   "that runs it")
    p.add_argument("--max-jobs", type=int, default=1, help="jobs run at once (default 1)")
    p.add_argument("--timeout", type=float, default=30.0, help="stop: seconds to wait for it (default 30)")
    p.set_defaults(func=cmd_daemon)

    p = sub.add_parser("submit", help="queue a job file with the daemon (checked first)")
    p.add_argument("jobfile")
    p.add_argument("--resume", action="store_true", help="go on with the (cancelled or failed) run in the job's "
                   "output folder, as `gadei run --resume`")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("cancel", help="cancel a queued or running daemon job (its checkpoints and logs stay)")
    p.add_argument("job")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("logs", help="the last lines of a daemon job's logs")
    p.add_argument("job")
    p.add_argument("--lines", type=int, default=50, help="lines per log (default 50)")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("predict", help="the top labels of a finished run's model for a text",
                       description="Load the model, label and vocabulary maps of a `gadei run` output folder "
                       "and print the most likely labels of TEXT with their probabilities.")
    p.add_argument("run_dir", help="a `gadei run` output folder")
    p.add_argument("text")
    p.add_argument("--top", type=int, default=3, help="labels to print (default 3)")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("learn", help="train a built-in workload as one learner of a job",
                       description="Attach to a served job and train a built-in workload on one shard of "
                       "its data, pushing every gradient and pulling new weights.")
    p.add_argument("job")
    _add_workload(p, required=False)
    p.set_defaults(workload="textcnn")
    p.add_argument("--epochs", type=int, default=1, help="passes over this learner's shard (default 1)")
    p.add_argument("--batch", type=int, default=2, help="mini-batch size (default 2)")
    p.add_argument("--shard", default="0/1", help="INDEX/COUNT: this learner's share of the data (default 0/1)")
    p.add_argument("--device", default="cpu", help="where this learner trains: cpu (default), cuda or cuda:N "
                   "(device transports: staging on the GPU, copy streams, a page-locked region)")
    p.add_argument("--pull", choices=("view", "copy", "local", "device"), default=None,
                   help="how weights reach the model: view (shared, Hogwild), copy (pull thread) or local "
                   "(elastic); default: the job's mode decides (view; copy when consistent; local when elastic)")
    p.add_argument("--push", choices=("publish", "thread", "weights", "device"), default=None,
                   help="how gradients reach the ring: publish (default), thread, weights (elastic, the default there)")
    p.add_argument("--eval", action="store_true", help="evaluate on the test set after every epoch")
    p.add_argument("--torch-threads", type=int, default=1, help="PyTorch intra-op threads (default 1)")
    p.add_argument("--start-at", type=int, default=0, metavar="SAMPLES",
                   help="skip this many samples of the schedule (epochs x shard): a restarted learner goes on "
                   "where its gradients in the weights end (the watchdog sets it)")
    p.add_argument("--json", action="store_true", help="JSON lines instead of text")
    p.set_defaults(func=cmd_learn)

    p = sub.add_parser("watchdog", help=watchdog_cli.HELP, description=watchdog_cli.DESCRIPTION)
    watchdog_cli.add_arguments(p)
    p.set_defaults(func=watchdog_cli.command)

    p = sub.add_parser("status", help="the daemon's jobs, and each running job's learners, rates and staleness")
    p.add_argument("job", nargs="?", help="the job (default: every job on this machine)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between the two samples of a rate")
    p.add_argument("--watch", action="store_true", help="repeat until interrupted")
    p.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("stop", help="stop a job cleanly: apply what was pushed, unlink the region")
    p.add_argument("job")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the server (default 30)")
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("clean", help="remove regions left behind by crashed servers (and dead watchdogs' state)")
    p.add_argument("jobs", nargs="*", help="jobs to clean (default: all of this user's leftovers)")
    p.add_argument("--force", action="store_true", help="also remove objects that are not readable gadei regions")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed")
    p.set_defaults(func=cmd_clean)

    p = sub.add_parser("demo", help="train the text CNN with one server and two learners, end to end")
    p.add_argument("--data", default="generated", help="data set (default: generated, needs no files)")
    p.add_argument("--learners", type=int, default=2, help="learner processes (default 2)")
    p.add_argument("--epochs", type=int, default=3, help="epochs over the training set (default 3)")
    p.add_argument("--batch", type=int, default=2, help="mini-batch size (default 2)")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="write the trained weights here")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bridge", help="one MPI rank per node: join the nodes' jobs into one (average, elastic, gossip)",
                       description="Run under `mpiexec --enable-recovery --runtime-options error-nonzero-status=false "
                       "-n NODES gadei bridge JOB ...`, one rank per node. Each rank attaches to its node's job like a "
                       "learner (serve it with one learner entry to spare, async, consistent or elastic mode, float32 "
                       "dense gradients) and exchanges the weights with the other nodes; the local server applies the "
                       "move once, as sent, outside its update rule. A node whose job finished (its watchdog stopped it "
                       "after every launched learner finished) takes part with its final weights until every node "
                       "finished (gossip: joins a final average), and that is the job's model (--save). If a "
                       "peer does not answer within "
                       "--timeout, average and elastic end every rank's exchanges (exit 3, after a checkpoint with "
                       "--checkpoint-dir) and gossip stops pairing with it; the local jobs keep training.")
    p.add_argument("job", help="the local job; '{rank}' in it is replaced by this rank's number")
    p.add_argument("--strategy", choices=("average", "elastic", "gossip"), default="average",
                   help="average: allreduce of the deltas, every node ends an exchange with the mean model; elastic: "
                   "nodes pulled towards a global centre with moving rate --alpha; gossip: average with one random "
                   "peer at a time, even ranks asking, odd ranks answering (default average)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--interval", type=int, metavar="N", help="exchange after N local versions (default 100)")
    when.add_argument("--every", type=float, metavar="S", help="exchange every S seconds instead")
    p.add_argument("--alpha", type=float, help="elastic: moving rate (default 0.9 / nodes)")
    p.add_argument("--bucket-mb", default="auto", metavar="B|auto", help="megabytes per message; 0: the whole model "
                   "in one; auto (default): sized from the measured latency and per-byte cost")
    p.add_argument("--float16", action="store_true", help="float16 on the wire, float32 sums")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any wait on a peer may last (default 60)")
    p.add_argument("--job-per-rank", action="store_true", help="rank r attaches to job JOB-r (nodes simulated on "
                   "one machine)")
    p.add_argument("--checkpoint-dir", help="average/elastic: when a peer is lost, write a checkpoint of the local job here")
    p.add_argument("--save", metavar="PATH", help="once every node's job finished, write the model they agreed on here "
                   "(average, elastic: the last exchange's; gossip: the mean of the final weights); '{rank}' is "
                   "replaced by this rank's number")
    p.add_argument("--json", action="store_true", help="JSON lines on stdout: ready, one per exchange, ended")
    p.set_defaults(func=cmd_bridge)

    p = sub.add_parser("bench", help="measure gadei against its alternatives, side by side")
    p.add_argument("what", nargs="*", default=["kernel", "latency", "train"],
                   help="kernel, latency, train, transport, accuracy, modes, bridge, gpu (default: the first three)")
    p.add_argument("--repeats", type=int, default=5, help="repeated runs (for accuracy and modes: seeds 0..N-1); medians are reported, "
                   "for accuracies the mean and range (default 5)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and steps (a smoke run)")
    p.add_argument("--out", default="gadei-bench.json", help="where to save the figures as JSON")
    p.add_argument("--data", default=None, help="train, transport, modes: data set (default: trec under GADEI_DATA_DIR or "
                   "../shared/data, else generated)")
    p.add_argument("--epochs", type=int, default=1, help="train, transport: epochs per run (default 1)")
    p.add_argument("--accuracy-epochs", type=int, default=4,
                   help="accuracy, modes: epochs per run (default 4)")
    p.add_argument("--sizes", help="bridge: model sizes in MB, comma-separated (default 1,16,64,256; --quick 1,4)")
    p.add_argument("--ranks", type=int, default=2, help="bridge: MPI ranks started on this machine (default 2)")
    p.add_argument("--device", default="cuda:0", help="gpu: the GPU measured (default cuda:0; cpu: a smoke run of "
                   "the harness, figures meaningless)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # how this command was started (the watchdog restarts a server with it)
    return console.run(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
