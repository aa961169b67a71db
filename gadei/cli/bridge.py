"""`gadei bridge`: one MPI rank per node joins the nodes' jobs into one."""

from ..bridge.mpi import BridgeError
from ..bridge.options import SCHEDULES, BridgeOptions
from ..options import add_arguments, as_flag, from_args


def cmd_bridge(args) -> int:
    from ..bridge import main as bridge_main

    options = from_args(BridgeOptions, args)
    conflict = options.conflict(as_flag)  # before MPI: refused as a job file's [bridge] refuses it (argparse
    # already refused --interval with --every: alternatives in the usage)
    if conflict is not None:
        raise BridgeError(conflict)
    return bridge_main(args.job, options, per_rank=args.job_per_rank)


def add_parser(sub) -> None:
    p = sub.add_parser("bridge", help="one MPI rank per node: join the nodes' jobs into one (average, elastic, gossip)",
                       description="Run under `mpiexec --enable-recovery --runtime-options error-nonzero-status=false "
                       "-n NODES gadei bridge JOB ...`, one rank per node. Each rank attaches to its node's job like a "
                       "learner (serve it with one learner entry to spare, async, consistent or elastic mode, float32 "
                       "dense gradients) and exchanges the weights with the other nodes; the local server applies the "
                       "move once, as sent, outside its update rule. A node whose job finished (its supervisor stopped "
                       "it after every launched learner finished) takes part with its final weights until every node "
                       "finished (gossip: joins a final average), and that is the job's model (--save). If a "
                       "peer does not answer within "
                       "--timeout, average and elastic end every rank's exchanges (exit 3, after a checkpoint with "
                       "--checkpoint-dir) and gossip stops pairing with it; the local jobs keep training.")
    p.add_argument("job", help="the local job; '{rank}' in it is replaced by this rank's number")
    add_arguments(p, BridgeOptions, exclusive=(SCHEDULES,))
    p.add_argument("--job-per-rank", action="store_true", help="rank r attaches to job JOB-r (nodes simulated on "
                   "one machine)")
    p.set_defaults(func=cmd_bridge)
