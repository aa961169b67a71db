"""`gadei bridge`: one MPI rank per node joins the nodes' jobs into one."""

import logging

from ..errors import GadeiError

log = logging.getLogger("gadei.cli")


def cmd_bridge(args) -> int:
    from ..bridge import BridgeOptions, main as bridge_main

    bucket = None if args.bucket_mb == "auto" else _number_arg("--bucket-mb", args.bucket_mb)
    options = BridgeOptions(strategy=args.strategy, interval=args.interval, every=args.every, alpha=args.alpha,
                      bucket_mb=bucket, float16=args.float16, timeout=args.timeout,
                      checkpoint_dir=args.checkpoint_dir, save=args.save, json=args.json,
                      trace=args.trace)
    return bridge_main(args.job, options, per_rank=args.job_per_rank)


def _number_arg(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise GadeiError(f"{name} {text!r}: expected a number or 'auto'") from None


def add_parser(sub) -> None:
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
    p.add_argument("--trace", metavar="DIR", help="write each exchange's vectors to DIR/rank-R/N.npz (the weights sent, "
                   "the target, elastic's centre, gossip's pair): a copy of the model per exchange, for tests and "
                   "debugging")
    p.set_defaults(func=cmd_bridge)
