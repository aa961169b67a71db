"""`gadei run job.toml` on each rank of an MPI launch (`mpiexec -n NODES gadei run job.toml`,
the job file with a [bridge] section): this process as one node of a bridged job, `BridgedRun`
(its shards, its rate, the agreement to start, its bridge's thread, and what the bridge did
for result.json). `gadei.run.run_job` asks `BridgedRun.launched` whether it is one."""

import json
import logging
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .. import jobfile
from ..errors import GadeiError
from ..prepare import Prepared
from ..prepare import prepare as prepare_job  # this class has a `prepare` of its own
from ..protocol import Deadline
from .mpi import LinkDown, mpi, wait_all
from .mpiexec import Background, child_environment, launched_ranks
from .exchange import finalize

log = logging.getLogger(__name__)


class BridgedRun:
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
    def launched(cls, job: jobfile.Job) -> "BridgedRun | None":
        """This node, when the job has a [bridge] and the MPI launcher started more than one rank
        (only then is MPI loaded)."""
        if job.bridge is None:
            return None
        if launched_ranks() < 2:
            return None
        options = job.bridge  # the job file's [bridge] is the bridge's own BridgeOptions
        MPI = mpi()
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
        return child_environment()

    def prepare(self, job: jobfile.Job, resume: bool) -> Prepared:
        """Prepare this node's job and agree with the other nodes that every one could (and
        that their schedules fit together); then `gadei.run.JobRun` runs it with its bridge,
        and `end` ends MPI."""
        try:
            prepared = prepare_job(job, resume, self)
        except Exception:  # the others must not wait for this node into their timeout
            self._agree(None)
            raise
        self._agree(prepared)
        return prepared

    def end(self, code: int) -> int:
        """After the node's job ran, with exit status `code`: end MPI; the exit status."""
        return finalize(self.clean, code, self.options.timeout)

    def _agree(self, prepared: Prepared | None) -> None:
        """Every rank says whether it is ready and what its schedule is; all start, or none.

        Raises:
            GadeiError: another rank could not prepare its job, their schedules differ (the
                shards would not cover the data once), or a rank did not answer in time.
        """
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
        mpi().Finalize()

    def start_bridge(self, job: jobfile.Job, serve: subprocess.Popen):
        """This node's bridge, in a thread: it attaches once the job serves, its events go to
        logs/bridge.log (JSON lines)."""
        events = open(job.output / "logs" / "bridge.log", "a")

        def on_event(record: dict) -> None:
            events.write(json.dumps(record) + "\n")
            events.flush()

        self._events = events
        return Background(job.name, self.options, ended=lambda: serve.poll() is not None, on_event=on_event).start()

    def stop_bridge(self, bridge, model: Path, private: bool = True) -> None:
        """After the local job ended: wait for the bridge to leave the exchanges (the others
        learn it at the next one, within a quarter of the timeout), or, when the job finished,
        for every node to finish (it takes part with its final weights meanwhile, as long as
        the exchanges go on), and write the model they agreed on into `model` (`private`: the
        job's [output] private)."""
        quiet = self.options.timeout + 30
        while not bridge.join(1.0):
            if time.monotonic() - bridge.last_event > quiet:
                log.error("node %d: the bridge made no exchange for %g s after the job ended; not waiting for it",
                          self.rank, quiet)
                break
        self.clean = bridge.clean and bridge.report is not None
        if bridge.bridge is not None and bridge.bridge.final is not None:
            bridge.bridge.save_final(str(model), private=private)
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
        record = {"node": self.rank, "nodes": self.size, "strategy": self.options.strategy}
        if bridge.report is not None:
            record.update({k: v for k, v in asdict(bridge.report).items() if k not in ("rank", "job", "strategy")})
        else:
            record["reason"] = f"no bridge ran: {bridge.error}"
        return record
