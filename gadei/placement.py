"""Where a job runs: on this machine alone (`Local`, the null placement), or as one node of a
bridged job (`Bridged`: `mpiexec -n NODES gadei run job.toml` with a [bridge] section). The job
layer (`gadei.prepare`, `gadei.run`, the supervisor) asks its placement the few things a node
changes, and never which one it has: the job a node runs (`job`: name `<name>-r<rank>`, folder
`<folder>/node-<rank>`), its learners' shards (learner i of node r trains shard r*L + i of
NODES*L, so the nodes together see each sample once per epoch), its rate, the ring its bridge
takes, whether learner 0 chooses the model on validation (a node's model is the one the bridges
agree on instead), what `gadei run` says of it, and, for a bridged node, the bridge itself.

A bridged node's `gadei run` (an MPI rank) prepares the node's job, agrees with the other
ranks that every node could (`agree`), starts the job's supervisor, and runs the node's bridge
in a thread once the job serves (`start`). When the bridge ends (every node finished, or it
gave up), the rank saves the agreed model (logs/bridge-agreed.pt) and writes the bridge's record
(`BRIDGE_END`, `BridgeEnd`): what the node's supervisor, which alone writes the job's outputs,
waits for at the job's end, to hand that model back as model.pt and say what the bridge did in
result.json. The placement is recorded in the output folder (node.json: `NodeRecord`), where
the supervisor and a resumed run read it.
"""

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import _proc
from .errors import GadeiError

log = logging.getLogger(__name__)

NODE = "node.json"  # a bridged node's placement, in its output folder
BRIDGE_END = "logs/bridge-end.json"  # the bridge's record, written by the rank when its bridge ended
BRIDGE_MODEL = "logs/bridge-agreed.pt"  # the model the nodes agreed on, which the rank saves there
QUIET = 30.0  # seconds beyond its timeout a bridge may make no exchange once its job ended, before it is given up


@dataclass
class NodeRecord:
    """A bridged node as its output folder records it (node.json)."""

    node: int
    nodes: int
    shards: list[str]
    lr: float
    timeout: float  # the bridge's timeout: how long the supervisor waits for its record, beyond QUIET
    host: list = field(default_factory=list)  # the rank's process that runs the bridge: [pid, start time]


@dataclass
class BridgeEnd:
    """What a node's bridge did (result.json's "bridge"), and the model the nodes agreed on (a path,
    or None where it ended without one)."""

    summary: dict
    model: str | None = None


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


def read_bridge_end(out: Path) -> BridgeEnd | None:
    try:
        return BridgeEnd(**json.loads((out / BRIDGE_END).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def wait_bridge(out: Path, node: NodeRecord) -> BridgeEnd | None:
    """At a bridged node's end (its server stopped), its supervisor waits here for the bridge's
    record, while the rank that runs the bridge lives, for at most its timeout plus QUIET
    seconds beyond the quiet the rank itself allows; None where none came."""
    from .protocol import Deadline

    deadline = Deadline(2 * (node.timeout + QUIET))
    while not deadline.expired():
        found = read_bridge_end(out)
        if found is not None:
            return found
        if node.host and not _proc.alive(*node.host):
            found = read_bridge_end(out)  # written just before it ended
            if found is None:
                log.error("node %d: the rank that ran its bridge (pid %d) is gone without its record", node.node,
                          node.host[0])
            return found
        deadline.sleep(0.1)
    log.error("node %d: no record of its bridge within %g s", node.node, deadline.seconds)
    return None


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
    extra_rings = 0
    chooses = True  # learner 0 chooses the model on validation

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

    def __init__(self, comm, options):
        self.comm, self.options = comm, options
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.label = f"node {self.rank}: "
        self.extra_rings = 1  # the bridge's own ring
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
        if bridge is None or (job.output / BRIDGE_END).exists():
            return
        if not bridge.join(0):
            serving = bridge.serving()
            if serving:
                self._ended_at = None
                return
            self._ended_at = self._ended_at or time.monotonic()
            quiet = self.options.timeout + QUIET
            if time.monotonic() - max(self._ended_at, bridge.last_event) < quiet:
                return
            log.error("node %d: the bridge made no exchange for %g s after the job ended; not waiting for it",
                      self.rank, quiet)
        self.clean = bridge.clean and bridge.report is not None
        model = None
        if bridge.bridge is not None and bridge.bridge.final is not None:
            model = str(job.output / BRIDGE_MODEL)
            bridge.bridge.save_final(model, private=job.private)
            print(f"gadei run: node {self.rank}: every node finished; the model they agreed on is the job's",
                  flush=True)
        report = bridge.report
        summary = {"node": self.rank, "nodes": self.size, "strategy": self.options.strategy}
        if report is not None:
            summary.update({k: v for k, v in asdict(report).items() if k not in ("rank", "job", "strategy")})
            print(f"gadei run: node {self.rank}: bridge {report.strategy}: {report.exchanges:,} exchanges, "
                  f"{report.published:,} moves, {report.bytes_sent / (1 << 20):,.1f} MB sent; {report.reason}"
                  + (f"; lost ranks {report.lost}" if report.lost else ""), flush=True)
        else:
            summary["reason"] = f"no bridge ran: {bridge.error}"
            print(f"gadei run: node {self.rank}: no bridge ran: {bridge.error}", flush=True)
        self._events.close()
        path = job.output / BRIDGE_END
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(BridgeEnd(summary, model))) + "\n")
        os.replace(tmp, path)

    def end(self, code: int) -> int:
        """After the node's job ran, with exit status `code`: end MPI; the exit status."""
        from .bridge.exchange import finalize

        return finalize(self.clean, code, self.options.timeout)
