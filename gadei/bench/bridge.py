"""`gadei bench bridge`: the MPI bridge's exchange against one MPI_Allreduce, ranks started
with mpiexec on this machine (the measurement itself: gadei.bridge.measurement)."""

import json
import os

from .._proc import how_it_ended, python_command
from .timing import MB, table


def bench_bridge(args) -> dict:
    """The MPI bridge's exchange against one MPI_Allreduce of the whole model, under mpiexec.

    Starts `--ranks` ranks of `python -m gadei.bridge` on this machine; each size is one
    model of that many MB of float32.
    """
    import subprocess

    from ..bridge import local_mpiexec

    sizes = args.sizes or ("1,4" if args.quick else "1,16,64,256")
    argv, env = local_mpiexec(args.ranks, *python_command("gadei.bridge", sizes, args.repeats))
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"bench bridge: mpiexec {how_it_ended(done.returncode)}:\n{done.stderr[-3000:]}")
    result = json.loads(lines[0][len("BENCH "):])
    link = result["link"]
    print(f"\nbridge: {result['ranks']} ranks on this machine; link alpha {link['alpha'] * 1e6:.1f} us per message, "
          f"beta {link['beta'] * 1e9:.3f} ns per byte: auto buckets of {result['bucket_bytes'] / MB:.2f} MB "
          f"(median of {result['repeats']}, the slowest rank's)")
    print(table(["model MB", "exchange", "ms", "GB/s", "wire MB/rank", "x MPI_Allreduce"],
                 [(f"{r['model_mb']:g}", r["variant"], f"{r['seconds'] * 1e3:.2f}", f"{r['bytes_per_s'] / 1e9:.2f}",
                   f"{r['wire_bytes'] / MB:.1f}", f"{r['vs_allreduce']:.2f}") for r in result["rows"]]))
    return result
