"""`gadei run job.toml`: one job from its job file, in the foreground, with a live progress line.

Everything that can be wrong with the job file and its data is found before anything
starts (`gadei.jobfile`). Then the job runs as `gadei serve` with a watchdog that launches
the learners (`--learner`), so a crashed learner or server is restarted from its last
checkpoint (see the README's Checkpoints section). The output folder gets:

    job.toml        the job as run, with the defaults filled in (its processes read this one)
    labels.json     label names, index = the model's output
    vocab.json      the vocabulary (`gadei_workloads.text.Vocab.from_json` reads it); numeric
                    workloads: features.json (feature count, training mean and std)
    model.pt        the model chosen on the validation set (the best of learner 0's evaluations
                    after each epoch, see gadei.selection), a state dict plain
                    `torch.load(weights_only=True)` reads
    result.json     that model's epoch and version, its validation accuracy and its test accuracy
                    (evaluated on the whole test set at the end), why training stopped (patience,
                    cap, cancelled), whether the run finished, its seconds
    metrics.jsonl   one JSON line per epoch of learner 0: loss, train accuracy (its own mini-batches,
                    with dropout, as it trained), validation loss and accuracy, test accuracy,
                    samples/s, seconds, and the staleness of the job's gradients (mean over the
                    epoch, max so far)
    accuracy.png    validation and test accuracy against epochs and against time
    checkpoints/    crash-safe checkpoints, the last `keep`; best.pt and best.json, the model
                    selection (gadei.selection)
    logs/           the server's and watchdog's log (serve.log) and each learner's

Across nodes: a job with a [bridge] section started as `mpiexec -n NODES gadei run job.toml`
runs on each rank as that node's job (`_Node`): job `<name>-r<rank>`, output folder
`<folder>/node-<rank>` (the files above, and node.json: the node, the node count and its
learners' shards; logs/bridge.log: the bridge's JSON lines; result.json's "bridge": what it
did), one ring more than learners for the bridge, which this process runs in a thread
once its job serves, and learner i trains shard rank*L + i of NODES*L.
"""

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import device, jobfile, outputs
from ._proc import gadei_command
from .errors import GadeiError

log = logging.getLogger(__name__)


def run_job(path: str, *, quiet: bool = False, resume: bool = False) -> int:
    """Run the job file at `path` to its end; 0 when it finished and wrote its model.
    `resume`: go on with the run its output folder holds (see `resume_point`).

    A job with a [bridge] section started as more than one MPI rank (`mpiexec -n NODES gadei
    run job.toml`) runs as node `rank` of NODES (`_Node`); alone, or as one rank, it runs as
    any job on one node."""
    job = jobfile.load(path)
    node = _Node.launched(job)
    if node is None:
        return _run(_prepare(job, resume, None), quiet)
    return node.run(job, quiet=quiet, resume=resume)


@dataclass
class _Prepared:
    """A checked job (defaults filled in), its data, what was chosen for it, the checkpoint it
    resumes from; its output folder holds the job as run and the maps."""

    job: jobfile.Job
    train: object
    test: object
    chosen: list[str]
    read: list  # a gadei_workloads.files.FileReport per data file
    found: object = None
    validation: object = None


def check_job(path: str, *, resume: bool = False) -> list[str]:
    """`gadei run --check`: every check `gadei run` makes before it starts (the job file, the
    region's name, the data, the output folder), starting nothing and writing nothing; the
    lines `gadei run` prints before it starts.

    Raises:
        GadeiError: (JobFileError among them) the one-line reason the job would be refused.
    """
    job = jobfile.load(path)
    prepared = _check(job, resume, None, remove_model=False)
    return _describe(prepared, None)


def _check(job: jobfile.Job, resume: bool, node: "_Node | None", *, remove_model: bool = True) -> _Prepared:
    """Everything that can be refused, before anything starts, writing nothing."""
    from .region import check_name_free

    if node is not None:
        job = job.for_node(node.rank, node.size)
    check_name_free(job.name)  # another user's (or a foreign) object in the region's place: say whose, now
    read: list = []
    train, validation, test = jobfile.load_data(job, read)
    job, chosen = job.with_defaults(len(train))
    out = job.output
    check_output(job)
    found = None
    if resume:
        found = resume_point(job, nodes=node.size if node else 1, remove_model=remove_model)
    elif (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir()):
        raise GadeiError(f"output folder {out} holds a previous run (checkpoints/); go on with it with "
                         "`gadei run --resume`, or set another [output] folder, or remove that one")
    return _Prepared(job, train, test, chosen, read, found, validation)


# What `gadei run` writes in its output folder, by kind: an earlier run's of another kind stops it.
_OUTPUT_FOLDERS = ("logs", "checkpoints")
_OUTPUT_FILES = ("job.toml", "labels.json", "vocab.json", "features.json", "node.json", "model.pt", "result.json",
                 "metrics.jsonl", "accuracy.png")


def check_output(job: jobfile.Job) -> None:
    """The job's output folder can take a run, checked without writing: it is a folder (not a
    file, a device or a symbolic link) or can be made one in the nearest folder above that
    exists, you may write in it, and what it holds of an earlier run is of the kind a run
    writes (logs/ and checkpoints/ folders, job.toml and the other outputs files).

    Raises:
        GadeiError: naming the job file, the folder and what is wrong with it.
    """
    import stat

    out = job.output
    where = f"{job.path.name if job.path else 'job'}: [output] folder {str(out)!r}"

    def kind(path: Path):
        try:
            return os.lstat(path).st_mode
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            raise GadeiError(f"{where}: cannot be made, a folder above it is a file") from None
        except (OSError, ValueError) as err:
            raise GadeiError(f"{where}: {path.name}: {getattr(err, 'strerror', None) or err}") from None

    def storable(folder: Path, what: str) -> None:
        found = os.statvfs(folder)
        if found.f_flag & os.ST_RDONLY:
            raise GadeiError(f"{where}: {what} on a read-only file system")
        if found.f_blocks == 0:  # procfs, sysfs: no file can be made there, whatever access() says
            raise GadeiError(f"{where}: {what} on a file system that holds no files (such as /proc or /sys)")

    mode = kind(out)
    if mode is None:
        above = out.parent
        while kind(above) is None:
            above = above.parent
        if not stat.S_ISDIR(os.stat(above).st_mode):
            raise GadeiError(f"{where}: cannot be made, {str(above)!r} is not a folder")
        if not os.access(above, os.W_OK | os.X_OK):
            raise GadeiError(f"{where}: cannot be made, you may not write in {str(above)!r}")
        storable(above, "cannot be made, the folder above it is")
        return
    if stat.S_ISLNK(mode):
        raise GadeiError(f"{where}: is a symbolic link; allowed: a folder (give the folder it points to)")
    if not stat.S_ISDIR(mode):
        raise GadeiError(f"{where}: is not a folder")
    if not os.access(out, os.W_OK | os.X_OK):
        raise GadeiError(f"{where}: you may not write in it")
    storable(out, "it is")
    for name in _OUTPUT_FOLDERS + _OUTPUT_FILES:
        mode = kind(out / name)
        if mode is None:
            continue
        folder = name in _OUTPUT_FOLDERS
        if not (stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode)):
            raise GadeiError(f"{where}: its {name} is not a {'folder' if folder else 'file'} (a run writes one "
                             "there); remove it or set another [output] folder")


def _prepare(job: jobfile.Job, resume: bool, node: "_Node | None") -> _Prepared:
    """Everything that can be refused, before anything starts (`_check`); the output folder's job.toml and maps."""
    prepared = _check(job, resume, node)
    job, train, out = prepared.job, prepared.train, prepared.job.output
    _output_modes(job)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "job.toml").write_text(job.to_toml())
    (out / "labels.json").write_text(json.dumps(train.label_names, ensure_ascii=False))
    if train.vocab is not None:
        (out / "vocab.json").write_text(json.dumps(train.vocab.to_json(), ensure_ascii=False))
    else:  # numeric features: predict standardises with the training set's statistics
        (out / "features.json").write_text(json.dumps({"features": train.features, "mean": train.mean.tolist(),
                                                       "std": train.std.tolist()}))
    if node is not None:
        (out / "node.json").write_text(json.dumps({"node": node.rank, "nodes": node.size,
                                                   "shards": node.shards(job.train.learners)}) + "\n")
    return prepared


def _output_modes(job: jobfile.Job) -> None:
    """Make the output folder private ([output] private, the default): this process and every
    process it starts (server, watchdog, learners: the model, checkpoints, logs, metrics) create
    files 0600 and folders 0700 whatever the umask it was given, and what an earlier run or
    the daemon left there (logs/run.log) is closed the same way. With private = false the
    umask decides, and what the daemon created private is opened up to it."""
    import stat

    out = job.output
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise GadeiError(f"output folder {out} is not a folder" + (" (a symbolic link)" if out.is_symlink() else ""))
    if job.private:
        os.umask(0o077)
        dir_mode, file_mode = 0o700, 0o600
    else:
        mask = os.umask(0o077)
        os.umask(mask)
        dir_mode, file_mode = 0o777 & ~mask, 0o666 & ~mask
    out.mkdir(parents=True, exist_ok=True)
    if out.stat().st_uid != os.geteuid():
        raise GadeiError(f"output folder {out} belongs to uid {out.stat().st_uid}, not to you (uid {os.geteuid()})")
    folders = [out] + [p for p in (out / "logs", out / "checkpoints") if p.is_dir() and not p.is_symlink()]
    for folder in folders:
        os.chmod(folder, dir_mode)
        if folder == out and not job.private:
            continue  # an earlier private run's files stay as they were
        for entry in folder.iterdir():
            info = entry.lstat()
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                os.chmod(entry, file_mode if job.private else (stat.S_IMODE(info.st_mode) | file_mode))


def _describe(prepared: _Prepared, node: "_Node | None") -> list[str]:
    """What `gadei run` prints before it starts (and `gadei run --check`): the job, each data
    file's read line, the chosen defaults, the node, the output folder, the resume point."""
    job, train, test, found = prepared.job, prepared.train, prepared.test, prepared.found
    t = job.train
    lines = [f"gadei run: job {job.name}: {job.workload} on {len(train):,} training / "
             f"{len(prepared.validation):,} validation / {len(test):,} test samples, "
             f"{train.n_labels} labels, " + (f"vocabulary {len(train.vocab):,}" if train.vocab is not None else
                                             f"{train.features} features")
             + f"; {t.learners} learners, {t.mode}, {t.optimizer}, mini-batch {t.batch}, lr {t.lr:g}, "
             f"at most {t.epochs} epochs (patience {t.patience}), seed {t.seed}"]
    lines += [f"  read {report}" for report in prepared.read]
    lines += [f"  chose {line}" for line in prepared.chosen]
    if node is not None:
        b = job.bridge
        lines.append(f"  node {node.rank} of {node.size}: learners' shards {', '.join(node.shards(t.learners))}; "
                     f"bridge {b.strategy}, "
                     + (f"every {b.every:g} s" if b.every is not None else f"every {b.interval} versions")
                     + f", buckets {b.bucket_mb if b.bucket_mb == 'auto' else f'{b.bucket_mb:g} MB'}"
                     + (", float16" if b.float16 else "") + f", timeout {b.timeout:g} s; lr {node.lr(job):g} per node"
                     + ("" if b.node_lr else f" (lr {t.lr:g} x {node.shares(job)}: "
                        + (f"{node.size} nodes and the centre share" if b.strategy == "elastic" else
                           f"{node.size} nodes average") + " each node's progress)"))
    elif job.bridge is not None:
        lines.append("  one node, so no bridge ([bridge] joins the nodes of `mpiexec -n NODES gadei run`)")
    lines.append(f"  output: {job.output}")
    if found is not None:
        lines.append(f"  resuming from {found.path.name} (version {found.version:,}, progress "
                     + ", ".join(f"learner {k}: {v if v == 'done' else f'{v:,} samples'}" for k, v in
                                 sorted(found.progress.items())) + ")")
    return lines


def _run(prepared: _Prepared, quiet: bool, node: "_Node | None" = None) -> int:
    """Start the job's server, watchdog and learners (and the node's bridge), follow it to its
    end, write the outputs; the exit code."""
    job, train, test, found = prepared.job, prepared.train, prepared.test, prepared.found
    out = job.output
    as_run = out / "job.toml"
    t = job.train
    for line in _describe(prepared, node):
        print(line, flush=True)
    spec = f"job:{as_run}"
    learner = ["--workload", job.workload, "--data", spec, "--seed", str(t.seed), "--epochs", str(t.epochs),
               "--batch", str(t.batch), "--json"]
    rings = t.learners + (1 if node is not None else 0)  # a bridged node's bridge takes a ring of its own
    command = [*gadei_command("serve", job.name), "--workload", job.workload, "--data", spec,
               "--seed", str(t.seed), "--lr", str(node.lr(job) if node is not None else t.lr), "--mode", t.mode,
               "--optimizer", t.optimizer, "--nonfinite", t.nonfinite,
               "--learners", str(rings),
               "--checkpoint-dir", str(out / "checkpoints"), "--checkpoint-every", str(job.checkpoint.interval),
               "--keep", str(job.checkpoint.keep), "--log-dir", str(out / "logs"), "--save", str(out / "model.pt"),
               "--json"] + (["--resume", str(found.path)] if found is not None else [])
    shards = node.shards(t.learners) if node is not None else [f"{i}/{t.learners}" for i in range(t.learners)]
    devices = device.spread(tuple(t.devices.split(",")), t.learners)
    if set(devices) != {"cpu"}:
        print("  learners' devices: " + ", ".join(f"{i}: {d}" for i, d in enumerate(devices)), flush=True)
    for i, shard in enumerate(shards):
        # One learner evaluates and decides for the job; a bridged node's does not choose (the
        # nodes' model is the one their bridge agrees on, and they stop at the cap together).
        evaluates = ["--eval"] + (["--validate", "--patience", str(t.patience), "--best", str(out / "checkpoints")]
                                  if node is None else [])
        extra = ["--shard", shard] + (evaluates if i == 0 else []) + (["--device", devices[i]]
                                                                        if devices[i] != "cpu" else [])
        command.append("--learner=" + " ".join(shlex.quote(a) for a in [*learner, *extra]))
    started = time.monotonic()
    with open(out / "logs" / "serve.log", "ab") as serve_log:
        serve = subprocess.Popen(command, stdout=serve_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=node.child_environment() if node is not None else None)
    bridge = node.start_bridge(job, serve) if node is not None else None

    def stop(*_):
        raise KeyboardInterrupt  # SIGTERM (gadei cancel) stops the job as Ctrl-C does

    signal.signal(signal.SIGTERM, stop)
    try:
        if node is None:
            _follow(job, serve, len(train), started, quiet)
        else:  # the progress of this node's share of each epoch
            _follow(job, serve, len(train) / node.size, started, quiet, f"node {node.rank}: ")
    except _Diverged:
        print(f"\ngadei run: job {job.name}: the training loss is not finite; stopping the job", file=sys.stderr,
              flush=True)
        serve.send_signal(signal.SIGTERM)
        interrupted = True
    except KeyboardInterrupt:
        interrupted = True
        print(f"\ngadei run: stopping the job {job.name}", flush=True)
        _checkpoint_progress(job)
        serve.send_signal(signal.SIGTERM)
    else:
        interrupted = False
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the job is stopping: let it finish
    code = serve.wait()
    if bridge is not None:
        node.stop_bridge(bridge, out / "model.pt")
    metrics = outputs.write_metrics(out)
    if metrics:
        outputs.plot(metrics, out / "accuracy.png", job.name)
    elapsed = time.monotonic() - started
    diverged = _diverged(job, metrics)
    if diverged is not None:
        print(f"gadei run: {diverged}; its outputs and logs are in {out}", file=sys.stderr, flush=True)
        return DIVERGED
    if code != 0 or not (out / "model.pt").exists():
        print(f"gadei run: job {job.name} failed (serve exited {code}); see {out / 'logs'}", file=sys.stderr)
        return 1
    if node is None:  # a bridged run's model is the one the nodes agreed on
        outputs.hand_back_best(out)
    result = outputs.write_result(job, train, test, out, elapsed, finished=not interrupted,
                     bridge=node.summary(bridge) if node is not None else None)
    accuracy = (f", stopped by {result['stopped']}" + (f", chose epoch {result['epoch']} (validation accuracy "
                f"{result['validation_accuracy']:.2%})" if "epoch" in result else "")
                + f", test accuracy {result['test_accuracy']:.2%}")
    if interrupted:
        last = metrics[-1] if metrics else {}
        print(f"gadei run: job {job.name} stopped after {elapsed:.0f} s (epoch {last.get('epoch', 0)} of "
              f"{job.train.epochs}{accuracy}); its weights so far are in {out / 'model.pt'}; go on with "
              f"`gadei run --resume {job.path}`", flush=True)
        return 130  # as a shell reports a Ctrl-C'd command
    print(f"gadei run: job {job.name} done in {elapsed:.0f} s{accuracy}; model {out / 'model.pt'}", flush=True)
    return 0


class _Node:
    """This process as node `rank` of `size` of a bridged job: rank r of `mpiexec -n NODES
    gadei run job.toml` runs its own node's job (`Job.for_node`) with one ring more than
    learners, for the bridge, which this process runs in a thread (`gadei.bridge.Background`)
    once its job serves. Learner i of node r trains shard r*L + i of NODES*L, so the nodes
    together see each sample once per epoch: the work of one node with NODES*L learners."""

    def __init__(self, comm, options):
        self.comm, self.options = comm, options
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.clean = False  # MPI may be finalised: no request in flight, no peer lost

    @classmethod
    def launched(cls, job: jobfile.Job) -> "_Node | None":
        """This node, when the job has a [bridge] and the MPI launcher started more than one rank
        (only then is MPI loaded)."""
        if job.bridge is None:
            return None
        from . import bridge

        if bridge.launched_ranks() < 2:
            return None
        b = job.bridge
        options = bridge.Options(strategy=b.strategy, interval=b.interval, every=b.every, alpha=b.alpha,
                                 bucket_mb=None if b.bucket_mb == "auto" else float(b.bucket_mb),
                                 float16=b.float16, timeout=b.timeout)
        MPI = bridge.mpi()
        comm = MPI.COMM_WORLD
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        options.check(comm.Get_size())
        return cls(comm, options)

    def shards(self, learners: int) -> list[str]:
        return [f"{self.rank * learners + i}/{self.size * learners}" for i in range(learners)]

    def shares(self, job: jobfile.Job) -> int:
        """Among how many models each node's progress is shared: the N nodes' (average and
        gossip average them), or N + 1 with elastic, whose moves keep the sum of the nodes'
        weights and the centre."""
        return self.size + (1 if job.bridge.strategy == "elastic" else 0)

    def lr(self, job: jobfile.Job) -> float:
        """The rate each node serves at: [bridge] node_lr, or [train] lr x shares. [train] lr is
        one node's rate; a node's progress counts 1/shares in the joint model, so each node
        steps at shares x lr (the linear scaling rule of data-parallel SGD)."""
        return job.bridge.node_lr or job.train.lr * self.shares(job)

    def child_environment(self) -> dict:
        from .bridge import child_environment

        return child_environment()

    def run(self, job: jobfile.Job, *, quiet: bool, resume: bool) -> int:
        """Prepare this node's job, agree with the other nodes that every one could (and that
        their schedules fit together), run it with its bridge, and end MPI."""
        from .bridge import finalize

        try:
            prepared = _prepare(job, resume, self)
        except Exception:  # the others must not wait for this node into their timeout
            self._agree(None)
            raise
        self._agree(prepared)
        code = _run(prepared, quiet, self)
        return finalize(self.clean, code, self.options.timeout)

    def _agree(self, prepared: _Prepared | None) -> None:
        """Every rank says whether it is ready and what its schedule is; all start, or none.

        Raises:
            GadeiError: another rank could not prepare its job, their schedules differ (the
                shards would not cover the data once), or a rank did not answer in time.
        """
        import numpy as np

        from .bridge import LinkDown, mpi, wait_all

        MPI = mpi()
        t = prepared.job.train if prepared else None
        mine = np.array([1, t.learners, t.epochs, t.batch, t.seed, len(prepared.train)] if prepared else [0] * 6,
                        dtype=np.int64)
        low, high = np.empty_like(mine), np.empty_like(mine)
        try:
            wait_all([self.comm.Iallreduce(mine, low, op=MPI.MIN), self.comm.Iallreduce(mine, high, op=MPI.MAX)],
                     time.monotonic() + self.options.timeout, "the nodes agreeing to start")
        except LinkDown as err:
            self.clean = False
            raise GadeiError(f"node {self.rank}: {err}; not starting (is every rank running `gadei run` on the same "
                             "job file?)") from None
        self.clean = True
        if not low[0]:
            self._end()
            if prepared is None:
                return  # this node's own error follows
            raise GadeiError(f"node {self.rank}: another node could not prepare its job (see its error); nothing "
                             "started")
        names = ("[train] learners", "[train] epochs", "[train] batch", "[train] seed", "training samples")
        differ = [f"{name} {lo} to {hi}" for name, lo, hi in zip(names, low[1:], high[1:]) if lo != hi]
        if differ:
            self._end()
            raise GadeiError(f"node {self.rank}: the nodes' jobs differ in " + ", ".join(differ) + "; the learners' "
                             "shards would not cover the data once: run the same job file (and data) on every node")

    def _end(self) -> None:
        """MPI ends here (no job started): every rank knows, nothing is in flight."""
        from .bridge import mpi

        mpi().Finalize()

    def start_bridge(self, job: jobfile.Job, serve: subprocess.Popen):
        """This node's bridge, in a thread: it attaches once the job serves, its events go to
        logs/bridge.log (JSON lines)."""
        from .bridge import Background

        events = open(job.output / "logs" / "bridge.log", "a")

        def on_event(record: dict) -> None:
            events.write(json.dumps(record) + "\n")
            events.flush()

        self._events = events
        return Background(job.name, self.options, ended=lambda: serve.poll() is not None, on_event=on_event).start()

    def stop_bridge(self, bridge, model: Path) -> None:
        """After the local job ended: wait for the bridge to leave the exchanges (the others
        learn it at the next one, within a quarter of the timeout), or, when the job finished,
        for every node to finish (it takes part with its final weights meanwhile, as long as
        the exchanges go on), and write the model they agreed on into `model`."""
        quiet = self.options.timeout + 30
        while not bridge.join(1.0):
            if time.monotonic() - bridge.last_event > quiet:
                log.error("node %d: the bridge made no exchange for %g s after the job ended; not waiting for it",
                          self.rank, quiet)
                break
        self.clean = bridge.clean and bridge.report is not None
        if bridge.bridge is not None and bridge.bridge.final is not None:
            bridge.bridge.save_final(str(model))
            print(f"gadei run: node {self.rank}: every node finished; {model} holds the model they agreed on",
                  flush=True)
        self._events.close()
        report = bridge.report
        if report is not None:
            print(f"gadei run: node {self.rank}: bridge {report.strategy}: {report.exchanges:,} exchanges, "
                  f"{report.published:,} moves, {report.bytes_sent / (1 << 20):,.1f} MB sent; {report.reason}"
                  + (f"; lost ranks {report.lost}" if report.lost else ""), flush=True)
        else:
            print(f"gadei run: node {self.rank}: no bridge ran: {bridge.error}", file=sys.stderr, flush=True)

    def summary(self, bridge) -> dict:
        """result.json's "bridge": this node, and what its bridge did."""
        from dataclasses import asdict

        record = {"node": self.rank, "nodes": self.size, "strategy": self.options.strategy}
        if bridge.report is not None:
            record.update({k: v for k, v in asdict(bridge.report).items() if k not in ("rank", "job", "strategy")})
        else:
            record["reason"] = f"no bridge ran: {bridge.error}"
        return record


def resume_point(job: jobfile.Job, *, remove_model: bool = True, nodes: int = 1):
    """The checkpoint a resumed run goes on from: the newest one of its output folder that says
    how far each learner got (a watchdog's periodic or final-stage one; the server's own stop
    checkpoint does not, so up to one checkpoint interval is trained again). The folder's
    job.toml must be this job with at most more epochs: the learners' schedules (data,
    shards, mini-batch, seed) must be the ones the progress counts in; a bridged node's
    folder (node.json) must come from a run of as many `nodes`, whose shards these are."""
    from . import checkpoint

    out = job.output
    as_run = out / "job.toml"
    if not as_run.is_file():
        raise GadeiError(f"--resume: {out} holds no run to go on with (no job.toml)")
    before = jobfile.load(as_run)
    free = {("train", "epochs"), ("train", "devices"), ("train", "patience")}  # none changes a learner's schedule
    changed = [f"[{section}] {key}" for section in ("data", "train")
               for key, value in vars(getattr(before, section)).items()
               if (section, key) not in free and getattr(getattr(job, section), key) != value]
    changed += [f"[job] {key}" for key in ("name", "workload") if getattr(job, key) != getattr(before, key)]
    if changed:
        raise GadeiError(f"--resume: the job differs from the run in {out} in " + ", ".join(changed)
                         + " (only [train] epochs, patience and devices may change); run it with another [output] "
                         "folder instead")
    try:
        before_nodes = json.loads((out / "node.json").read_text())["nodes"]
    except FileNotFoundError:
        before_nodes = 1
    if before_nodes != nodes:
        raise GadeiError(f"--resume: the run in {out} ran on {before_nodes} node(s), this one on {nodes}: the learners' "
                         "shards would differ; go on with as many MPI ranks, or run it with another [output] folder")
    found = checkpoint.latest(out / "checkpoints", with_progress=True)
    if found is None:
        raise GadeiError(f"--resume: no checkpoint in {out / 'checkpoints'} that verifies and records the learners' "
                         "progress")
    if remove_model and (out / "model.pt").exists():
        (out / "model.pt").unlink()  # the resumed run writes its own final weights
    return found


def _checkpoint_progress(job: jobfile.Job, attempts: int = 5) -> None:
    """Before a stop: a checkpoint that records how far each launched learner got (from the
    watchdog's saved table and the learners' rings, under the server's hold), so that
    `gadei run --resume` goes on from here; the server's own stop checkpoint cannot say."""
    from gadei_watchdog.launched import Learners, load_state

    from . import checkpoint
    from .region import Region

    try:
        _, table = load_state(job.name)
        region = Region.attach(job.name)
    except (FileNotFoundError, GadeiError):
        return  # no watchdog or no job (yet): nothing to record
    with region:
        learners = Learners(job.name, table, str(job.output / "logs"), max_restarts=1, window=1.0, backoff=0.0)
        for _ in range(attempts):
            try:
                taken = checkpoint.take(region, job.output / "checkpoints", keep=job.checkpoint.keep,
                                        progress=learners.progress)
                print(f"gadei run: checkpoint {taken.path.name} at version {taken.version:,} (resume with "
                      f"`gadei run --resume {job.path}`)", flush=True)
                return
            except checkpoint.CheckpointError as err:  # e.g. the watchdog's is being taken: try again
                log.warning("checkpoint before stopping: %s", err)
                time.sleep(0.2)


def _follow(job, serve: subprocess.Popen, train_size: float, started: float, quiet: bool, label: str = "") -> None:
    """Print a progress line every 2 s until the job's server exits: epochs done (updates x
    mini-batch over the training set, or a bridged node's share of it), the last evaluated
    epoch's loss and accuracy, samples/s, version, ETA. On a terminal the line is rewritten
    in place, unless `label` (a bridged node's, which starts its lines) says that other
    ranks write to the same terminal (mpiexec gives each rank one)."""
    overwrite = sys.stdout.isatty() and not label
    from . import status
    from .region import Region

    before = None
    width = 0
    while serve.poll() is None:
        time.sleep(2.0 if before is not None else 0.2)
        diverged = _diverged(job, [outputs.last_epoch(job.output)])
        if diverged is not None:
            raise diverged
        try:
            with Region.attach(job.name, readonly=True) as region:
                now = status.read(region)
        except GadeiError:
            continue
        if before is None or quiet:
            before = now
            continue
        rate = status.rates(before, now)
        samples_per_s = sum(rate.samples.values())
        epoch = outputs.last_epoch(job.output)
        done = min(job.train.epochs * train_size, now.version * job.train.batch)
        left = (job.train.epochs * train_size - done) / samples_per_s if samples_per_s > 0 else float("nan")
        line = (f"  {label}epoch {done / train_size:.2f}/{job.train.epochs}"
                + (f"; after epoch {epoch['epoch']}: loss {epoch['loss']:.3f}" if "loss" in epoch else "")
                + (f", test accuracy {epoch['test_accuracy']:.1%}" if "test_accuracy" in epoch else "")
                + f", {samples_per_s:,.0f} samples/s, version {now.version:,}"
                + (f", ETA {left:.0f} s" if left == left else "")
                + f", {time.monotonic() - started:.0f} s")
        if overwrite:
            print("\r" + line.ljust(width), end="", flush=True)
            width = len(line)
        else:
            print(line, flush=True)
        before = now
    if overwrite:
        print(flush=True)


DIVERGED = 3  # `gadei run`'s exit code when the training loss became NaN or infinite


class _Diverged(GadeiError):
    """The evaluating learner's epoch loss is NaN or infinite: training diverged."""


def _diverged(job: jobfile.Job, metrics: list[dict]) -> _Diverged | None:
    """The first epoch of `metrics` whose loss is not finite, as the error that stops the job."""
    import math

    for record in metrics:
        loss = record.get("loss")
        if isinstance(loss, (int, float)) and not math.isfinite(loss):
            return _Diverged(f"job {job.name}: the training loss is {loss} after epoch {record.get('epoch')}: "
                             f"training diverged; the learning rate is likely too high (lr {job.train.lr:g}), "
                             "lower [train] lr")
    return None


