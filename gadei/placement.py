"""Where a job runs: on this machine alone (`Local`, the null placement), or as one node of a
bridged job (`Bridged`: `mpiexec -n NODES gadei run job.toml` with a [bridge] section). The job
layer (`gadei.prepare`, `gadei.run`, the supervisor) asks its placement the few things a node
changes, and never which one it has: the job a node runs (name `<name>-r<rank>`, folder
`<folder>/node-<rank>`), its learners' shards (learner i of node r trains shard r*L + i of
NODES*L), its rate, the ring its bridge takes, whether learner 0 chooses the model on
validation, what `gadei run` says of it, and the bridge itself: the rank runs it in a thread once
the job serves, and leaves its record (`gadei.bridge.record`) for the node's supervisor. The
placement is recorded in the output folder (node.json: `NodeRecord`).
"""

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import _proc
from .bridge import record
from .errors import GadeiError

log = logging.getLogger(__name__)

NODE = "node.json"  # a bridged node's placement, in its output folder


@dataclass
class NodeRecord:
    """A bridged node as its output folder records it (node.json)."""

    node: int
    nodes: int
    shards: list[str]
    lr: float
    timeout: float  # the bridge's timeout: how long the supervisor waits for its record (`gadei.bridge.record`)
    host: list = field(default_factory=list)  # the rank's process that runs the bridge: [pid, start time]


def read_node(out: Path) -> NodeRecord | None:
    """The node the output folder `out` was prepared for; None for a job on one node.

    Raises:
        GadeiError: node.json is there but not a node's record.
    """
    try:
        raw = json.loads((out / NODE).read_text())
        return NodeRecord(**raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as err:
        raise GadeiError(f"{out / NODE}: not a bridged node's record ({err})") from None


def of(job) -> "Local":
    """The placement of `job` for this process: `Bridged` where the job has a [bridge] and the MPI
    launcher started more than one rank (only then is MPI loaded), else `Local`."""
    from .bridge.mpiexec import launched_ranks

    if job.bridge is None or launched_ranks() < 2:
        return Local()
    from .bridge.mpi import mpi

    MPI = mpi()
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    job.bridge.check(comm.Get_size())
    return Bridged(comm, job.bridge)


class Local:
    """A job on this machine alone: the null placement."""

    rank, size = 0, 1
    label = ""  # what starts each progress line
    chooses = True  # learner 0 chooses the model on validation
    forks = True  # `gadei run` may fork the job's supervisor from itself (`gadei.zygote`): no MPI runtime in it

    def job(self, job):
        return job

    def shards(self, learners: int) -> list[str]:
        return [f"{i}/{learners}" for i in range(learners)]

    def lr(self, job) -> float:
        return job.train.lr

    def describe(self, job) -> list[str]:
        if job.bridge is not None:
            return ["  one node, so no bridge ([bridge] joins the nodes of `mpiexec -n NODES gadei run`)"]
        return []

    def record(self, job) -> NodeRecord | None:
        return None

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def agree(self, prepared) -> None:
        pass

    def start(self, job, ended) -> None:
        pass

    def poll(self, job) -> None:
        pass

    def end(self, code: int) -> int:
        return code


class Bridged(Local):
    """This process as node `rank` of `size` of a bridged job (an MPI rank of `mpiexec -n NODES
    gadei run job.toml`), with its bridge in a thread (`gadei.bridge.Background`) once its job
    serves."""

    chooses = False
    forks = False  # an MPI process does not fork

    def __init__(self, comm, options):
        self.comm, self.options = comm, options
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.label = f"node {self.rank}: "
        self.clean = False  # MPI may be finalised: no request in flight, no peer lost
        self._bridge = None
        self._events = None
        self._ended_at: float | None = None

    def job(self, job):
        return job.for_node(self.rank, self.size)

    def shards(self, learners: int) -> list[str]:
        return [f"{self.rank * learners + i}/{self.size * learners}" for i in range(learners)]

    def shares(self, job) -> int:
        """Among how many models each node's progress is shared: the N nodes' (average and
        gossip average them), or N + 1 with elastic, whose moves keep the sum of the nodes'
        weights and the centre."""
        return self.size + (1 if job.bridge.strategy == "elastic" else 0)

    def lr(self, job) -> float:
        """The rate each node serves at: [bridge] node_lr, or [train] lr x shares. [train] lr is
        one node's rate; a node's progress counts 1/shares in the joint model, so each node
        steps at shares x lr (the linear scaling rule of data-parallel SGD)."""
        return job.bridge.node_lr or job.train.lr * self.shares(job)

    def describe(self, job) -> list[str]:
        b, t = job.bridge, job.train
        return [f"  node {self.rank} of {self.size}: learners' shards {', '.join(self.shards(t.learners))}; "
                f"bridge {b.strategy}, " + (f"every {b.every:g} s" if b.every is not None else
                                            f"every {b.interval} versions")
                + f", buckets {'auto' if b.bucket_mb is None else f'{b.bucket_mb:g} MB'}"
                + (", float16" if b.float16 else "") + f", timeout {b.timeout:g} s; lr {self.lr(job):g} per node"
                + ("" if b.node_lr else f" (lr {t.lr:g} x {self.shares(job)}: "
                   + (f"{self.size} nodes and the centre share" if b.strategy == "elastic" else
                      f"{self.size} nodes average") + " each node's progress)")]

    def record(self, job) -> NodeRecord:
        return NodeRecord(self.rank, self.size, self.shards(job.train.learners), self.lr(job), job.bridge.timeout,
                          [os.getpid(), _proc.start_time()])

    def environment(self) -> dict[str, str]:
        from .bridge.mpiexec import child_environment

        return child_environment()  # the job's processes must not take themselves for ranks

    def agree(self, prepared) -> None:
        """Every rank says whether it prepared its job and what its schedule is; all start, or none
        (`prepared` None: this one could not, and its own error follows).

        Raises:
            GadeiError: another rank could not prepare its job, their schedules differ (the
                shards would not cover the data once), or a rank did not answer in time.
        """
        from .bridge.mpi import LinkDown, mpi, wait_all
        from .protocol import Deadline

        MPI = mpi()
        t = prepared.job.train if prepared else None
        mine = np.array([1, t.learners, t.epochs, t.batch, t.seed, len(prepared.train)] if prepared else [0] * 6,
                        dtype=np.int64)
        low, high = np.empty_like(mine), np.empty_like(mine)
        try:
            wait_all([self.comm.Iallreduce(mine, low, op=MPI.MIN), self.comm.Iallreduce(mine, high, op=MPI.MAX)],
                     Deadline(self.options.timeout), "the nodes agreeing to start")
        except LinkDown as err:
            self.clean = False
            raise GadeiError(f"node {self.rank}: {err}; not starting (is every rank running `gadei run` on the same "
                             "job file?)") from None
        self.clean = True
        if not low[0]:
            mpi().Finalize()  # no job started: every rank knows, nothing is in flight
            if prepared is None:
                return
            raise GadeiError(f"node {self.rank}: another node could not prepare its job (see its error); nothing "
                             "started")
        names = ("[train] learners", "[train] epochs", "[train] batch", "[train] seed", "training samples")
        differ = [f"{name} {lo} to {hi}" for name, lo, hi in zip(names, low[1:], high[1:]) if lo != hi]
        if differ:
            mpi().Finalize()
            raise GadeiError(f"node {self.rank}: the nodes' jobs differ in " + ", ".join(differ) + "; the learners' "
                             "shards would not cover the data once: run the same job file (and data) on every node")

    def start(self, job, ended) -> None:
        """This node's bridge, in a thread: it attaches once the job serves (`ended()`: the job is
        over, no wait for it to serve then), its events go to logs/bridge.log (JSON lines)."""
        from .bridge.mpiexec import Background

        events = open(job.output / "logs" / "bridge.log", "a")

        def on_event(record: dict) -> None:
            events.write(json.dumps(record) + "\n")
            events.flush()

        self._events = events
        self._bridge = Background(job.name, self.options, ended=ended, on_event=on_event).start()

    def poll(self, job) -> None:
        """Once the bridge ended (or made no exchange for its timeout plus QUIET seconds after the
        job stopped serving): the agreed model saved, the bridge's record written, once."""
        bridge = self._bridge
        if bridge is None or (job.output / record.END).exists():
            return
        if not bridge.join(0):
            serving = bridge.serving()
            if serving:
                self._ended_at = None
                return
            self._ended_at = self._ended_at or time.monotonic()
            quiet = self.options.timeout + record.QUIET
            if time.monotonic() - max(self._ended_at, bridge.last_event) < quiet:
                return
            log.error("node %d: the bridge made no exchange for %g s after the job ended; not waiting for it",
                      self.rank, quiet)
        self.clean = bridge.clean and bridge.report is not None
        end = record.leave(job.output, bridge, self.rank, self.size, self.options.strategy, job.private)
        self._events.close()
        if end.model is not None:
            print(f"gadei run: node {self.rank}: every node finished; the model they agreed on is the job's",
                  flush=True)
        report = bridge.report
        if report is not None:
            print(f"gadei run: node {self.rank}: bridge {report.strategy}: {report.exchanges:,} exchanges, "
                  f"{report.published:,} moves, {report.bytes_sent / (1 << 20):,.1f} MB sent; {report.reason}"
                  + (f"; lost ranks {report.lost}" if report.lost else ""), flush=True)
        else:
            print(f"gadei run: node {self.rank}: {end.summary['reason']}", flush=True)

    def end(self, code: int) -> int:
        """After the node's job ran, with exit status `code`: end MPI; the exit status."""
        from .bridge.exchange import finalize

        return finalize(self.clean, code, self.options.timeout)
