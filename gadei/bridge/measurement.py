"""The measurement `gadei bench bridge` (gadei.bench.bridge) runs under mpiexec (`python -m
gadei.bridge SIZES REPEATS`): the bridge's allreduce against one MPI_Allreduce of the whole model."""

import json
import random
import statistics
import time
from dataclasses import asdict

import numpy as np

from .mpi import mpi
from .wire import MB, Wire, measure_link


def benchmark(sizes_mb: list[float], repeats: int, timeout: float = 120.0) -> dict | None:
    """Exchange time and bytes/s of the bridge's allreduce against one MPI_Allreduce of the whole model.

    Collective over COMM_WORLD; rank 0 returns the figures, the others None. Variants per
    size: one blocking MPI_Allreduce (the baseline), and the bridge's polled non-blocking
    allreduce unbucketed, in auto-sized buckets, and each of those with float16 on the wire.
    Each figure is the median of `repeats` runs, the variants interleaved.
    """
    MPI = mpi()
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    link = measure_link(comm, timeout)
    bucket = link.bucket_bytes()
    rows = []
    for mb in sizes_mb:
        n = int(mb * MB) // 4
        x = np.random.default_rng(comm.Get_rank()).standard_normal(n).astype(np.float32)
        out = np.empty_like(x)
        variants = {
            "MPI_Allreduce": None,
            "bridge": Wire(comm, 0, False, timeout),
            "bridge+buckets": Wire(comm, bucket, False, timeout),
            "bridge+float16": Wire(comm, 0, True, timeout),
            "bridge+buckets+float16": Wire(comm, bucket, True, timeout),
        }
        times = {name: [] for name in variants}
        wire_bytes = {}
        for rep in range(repeats + 1):
            order = list(variants)
            random.Random(rep).shuffle(order)
            for name in order:
                wire = variants[name]
                comm.Barrier()
                start = time.perf_counter()
                if wire is None:
                    comm.Allreduce(x, out, op=MPI.SUM)
                else:
                    before = wire.sent
                    wire.allreduce_sum(x, out)
                    wire_bytes[name] = wire.sent - before
                seconds = time.perf_counter() - start
                if rep:  # the first round warms up (page faults, connections)
                    times[name].append(seconds)
        worst = {name: np.empty(1) for name in variants}
        for name in variants:  # the slowest rank's median is the exchange's time
            value = np.array([statistics.median(times[name])])
            comm.Allreduce(value, worst[name], op=MPI.MAX)
        wire_bytes["MPI_Allreduce"] = 2 * x.nbytes * (comm.Get_size() - 1) // comm.Get_size()
        base = float(worst["MPI_Allreduce"][0])
        for name in variants:
            seconds = float(worst[name][0])
            rows.append({"model_mb": mb, "variant": name, "seconds": seconds, "bytes_per_s": x.nbytes / seconds,
                         "wire_bytes": wire_bytes[name], "vs_allreduce": seconds / base})
        del x, out
    if comm.Get_rank():
        return None
    return {"ranks": comm.Get_size(), "repeats": repeats, "link": asdict(link), "bucket_bytes": bucket, "rows": rows}


def main(argv: list[str]) -> int:
    """`python -m gadei.bridge SIZES REPEATS`, started by `gadei bench bridge` under mpiexec."""
    MPI = mpi()
    sizes = [float(s) for s in argv[0].split(",")]
    result = benchmark(sizes, int(argv[1]))
    if result is not None:
        print("BENCH " + json.dumps(result), flush=True)
    MPI.Finalize()
    return 0
