"""Processes the bridge tests start.

    python tests/bridge_worker.py serve JOB [JOB ...] [--n N] [--mode M] [--lr LR] [--learners L]
        Several jobs' servers in one process (one thread each: the nodes of a simulated
        cluster cost one Python start, not one each). Job k's weights start as N(0, 1)
        draws of seed k (the first job seed 0, the next 1, ...). Prints {"ready": pid}; on
        SIGTERM stops every job and prints {"stopped": [applied per job]}.

    python tests/bridge_worker.py train JOB [JOB ...] [--n N] [--delay S]
        One learner per job (a thread each) that pushes the same gradient at every step:
        job k's is N(0, 1) draws of seed 1000 + k (`gradient(k)`), one step every S
        seconds, so between two exchanges each node's weights move by its own multiple of
        its own vector. Prints {"training": pid} once every learner made a step; ends when the jobs stop, printing
        {"steps": [per job]}.

    mpiexec -n R python tests/bridge_worker.py wire N
        Every rank sums seeded vectors of N float32 with the bridge's wire in each
        configuration (whole, buckets, float16, both) and a gossip-style swap with a
        neighbour, and prints one JSON line: its largest error against the exact float64
        sum, and a checksum of each result (equal on every rank where it must be).

    mpiexec ... : -n 1 python tests/bridge_worker.py slow-asker N BUCKET_MB HOLD
        The last rank speaks gossip's asking side to rank 1 by hand, with a model of N
        float32 in buckets of BUCKET_MB: it asks, and once rank 1 acknowledged it prints
        {"event": "acked", "n": k, "pid": ...}, keeps rank 1 waiting HOLD seconds, then sends
        its weights and takes the answer; again and again, until killed.
"""

import argparse
import json
import os
import signal
import sys
import threading

import numpy as np
import torch


class Vector(torch.nn.Module):
    """One parameter of n values drawn from N(0, 1) with `seed`."""

    def __init__(self, n: int, seed: int):
        super().__init__()
        values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
        self.weight = torch.nn.Parameter(torch.from_numpy(values))


def serve(args) -> int:
    import gadei

    rule = gadei.RuleOptions(lr=args.lr, optimizer=args.optimizer, momentum=args.momentum)
    servers = [gadei.Server(job, model=Vector(args.n, seed), mode=args.mode, rule_options=rule, learners=args.learners,
                            threads=1, spin_us=0) for seed, job in enumerate(args.jobs)]
    reports = [None] * len(servers)

    def run(i):
        reports[i] = servers[i].serve(grace=2.0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(servers))]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for thread in threads:
        thread.start()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    stop.wait()
    for server in servers:
        server.request_stop()
    for thread in threads:
        thread.join(30)
    print(json.dumps({"stopped": [r.applied if r else None for r in reports]}), flush=True)
    for server in servers:
        server.close()
    return 0


def gradient(k: int, n: int) -> np.ndarray:
    """The gradient `train` pushes at every step of the k-th job."""
    return np.random.default_rng(1000 + k).standard_normal(n).astype(np.float32)


def train(args) -> int:
    import time

    import gadei

    steps = [0] * len(args.jobs)
    stepped = [threading.Event() for _ in args.jobs]

    def run(k: int, job: str) -> None:
        model = Vector(args.n, k)
        g = torch.from_numpy(gradient(k, args.n))
        with gadei.Learner(model, job, pull="copy", timeout=60) as learner:  # a stopped job ends the block
            while True:
                if model.weight.grad is None:
                    model.weight.grad = torch.zeros_like(model.weight)
                model.weight.grad.copy_(g)
                learner.step(samples=1)
                steps[k] += 1
                stepped[k].set()
                time.sleep(args.delay)
        stepped[k].set()

    threads = [threading.Thread(target=run, args=(k, job)) for k, job in enumerate(args.jobs)]
    for thread in threads:
        thread.start()
    for event in stepped:
        event.wait()
    print(json.dumps({"training": os.getpid()}), flush=True)
    for thread in threads:
        thread.join()
    print(json.dumps({"steps": steps}), flush=True)
    return 0


def wire(args) -> int:
    from gadei.bridge import Link, Wire, mpi

    MPI = mpi()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = args.n
    vectors = [np.random.default_rng(100 + r).standard_normal(n).astype(np.float32) for r in range(size)]
    exact = np.sum(np.array(vectors, dtype=np.float64), axis=0)
    bucket = Link(alpha=2e-5, beta=1e-9).bucket_bytes()  # what auto picks on a fast link: 0.37 MB
    configs = {"whole": (0, False), "buckets": (bucket, False), "small-buckets": (4096 * 4, False),
               "float16": (0, True), "buckets+float16": (bucket, True)}
    out = {"rank": rank, "bucket_bytes": bucket, "error": {}, "checksum": {}, "bytes": {}}
    for name, (bucket_bytes, half) in configs.items():
        w = Wire(comm, bucket_bytes, half, timeout=60)
        result = np.empty(n, dtype=np.float32)
        w.allreduce_sum(vectors[rank], result)
        out["error"][name] = float(np.abs(result - exact).max())
        out["checksum"][name] = float(np.sum(result.astype(np.float64) * np.arange(n)))
        out["bytes"][name] = w.sent
    # a swap with the neighbour (ranks 0<->1, 2<->3, ...): each receives the other's vector
    peer = rank ^ 1
    if peer < size:
        for name, (bucket_bytes, half) in configs.items():
            w = Wire(comm, bucket_bytes, half, timeout=60)
            got = np.empty(n, dtype=np.float32)
            w.swap(peer, vectors[rank], got, 30, 30, what="test swap")
            out["error"][f"swap-{name}"] = float(np.abs(got - vectors[peer]).max())
    print(json.dumps(out), flush=True)
    MPI.Finalize()
    return 0


def slow_asker(args) -> int:
    import time

    from gadei.bridge import Wire, mpi
    from gadei.bridge.gossip import _ACK, _BUSY, _DATA, _REPLY, _REQ

    MPI = mpi()
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank, passive = comm.Get_rank(), 1
    wire = Wire(comm, int(args.bucket_mb * (1 << 20)) // 4 * 4, False, timeout=60)
    weights = np.zeros(args.n, dtype=np.float32)
    out = np.empty_like(weights)
    answer = np.empty(1, dtype=np.int64)
    for ident in range(1, 1 << 30):
        comm.Send(np.array([ident], dtype=np.int64), passive, _REQ)
        status = MPI.Status()
        while True:  # ACK or BUSY for this request (answers to older ones are skipped)
            comm.Recv(answer, passive, MPI.ANY_TAG, status)
            if status.Get_tag() in (_ACK, _BUSY) and int(answer[0]) == ident:
                break
        if status.Get_tag() == _BUSY:
            time.sleep(0.01)
            continue
        print(json.dumps({"event": "acked", "rank": rank, "n": ident, "pid": os.getpid(), "t": time.time()}),
              flush=True)
        time.sleep(args.hold)
        wire.swap(passive, weights, out, _DATA, _REPLY, what="the slow asker's swap")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve")
    p.add_argument("jobs", nargs="+")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--mode", default="async")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--momentum", type=float, default=0.0)
    p.set_defaults(func=serve)
    p = sub.add_parser("train")
    p.add_argument("jobs", nargs="+")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--delay", type=float, default=0.002)
    p.set_defaults(func=train)
    p = sub.add_parser("wire")
    p.add_argument("n", type=int)
    p.set_defaults(func=wire)
    p = sub.add_parser("slow-asker")
    p.add_argument("n", type=int)
    p.add_argument("bucket_mb", type=float)
    p.add_argument("hold", type=float)
    p.set_defaults(func=slow_asker)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
