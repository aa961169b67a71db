"""`gadei bench`: gadei measured side by side with its best alternative, in one run.

kernel   the update kernel's GB/s against a plain in-place C loop and `torch.Tensor.add_`
         on the same buffers, 1 MB to 256 MB, one thread and all threads; and the Adagrad
         kernel against PyTorch's fused CPU Adagrad.
latency  push-to-applied time of 1 MB and 16 MB gradients (a learner publishes, the server
         applies) against the time the copy and the update take on their own.
train    samples/s and test accuracy of the text CNN at mini-batch 1, 2 and 4: one learner
         + server against a plain single-process PyTorch loop, and two learners against
         PyTorch Hogwild with two processes (torch.multiprocessing, share_memory).
transport  bytes per step and samples/s of float32, bfloat16 and row-sparse gradients
         (text CNN, 20k x 128 embedding, one learner + server) at mini-batch 1, 2 and 4.
accuracy the test accuracy each of those transports reaches on TREC and SST-2 with two
         learners after the same epochs (mean and range over seeds).
modes    test accuracy and samples/s of async, sync and elastic with two learners on TREC
         after the same epochs.
bridge   the MPI bridge's exchange (time, GB/s, bytes on the wire) against one blocking
         MPI_Allreduce of the whole model, unbucketed, in buckets sized from the measured
         latency and per-byte cost, and each with float16 on the wire; models of --sizes MB,
         --ranks ranks started with mpiexec on this machine.
peers    the text CNN (--workload ngram: the n-gram workload) trained by gadei (1, 2, 4 learners)
         against a plain PyTorch loop, Hogwild (2, 4 processes), DDP over gloo (2, 4; also with
         lr x N) and PyTorch's RPC parameter server (1 + 2, 1 + 4) at mini-batch 1, 2, 4 and 32:
         samples/s, test accuracy, CPU seconds per sample, and gadei's ratio to each
         (gadei.bench.peers); drawn to --plot.
scaling  samples/s against learners (1 to 4) of gadei and Hogwild at the same batches, the
         gadei server's share of the CPU, and the smallest batch at which N learners beat one
         plain process; plotted to --plot (gadei.bench.scaling).
quality  what a job file with nothing tuned hands back on each shared data set (TREC, SST-2,
         Subj, CR, banking77): the chosen model's test accuracy (median and range over
         --repeats seeds), the epoch chosen on validation and the wall time, of the text CNN
         with 1 and 2 learners beside a plain PyTorch loop (Adam, mini-batch 32, the same
         validation stopping), and of the n-gram workload with 2 learners beside scikit-learn's
         LinearSVC and LogisticRegression on the same n-grams (gadei.bench.quality,
         gadei.bench.reference); --sets picks sets, --runs runs; drawn to --plot.
server   the `gadei serve` process's CPU seconds per 1,000 applied updates with a kernel team
         of 1, 2, 4 and 8 threads, one learner pushing at a fixed pace, against the kernel's
         own work: what idle or spinning threads cost (gadei.bench.server).
threads  one gadei learner + server against the plain PyTorch loop at 1, 2 and 4 PyTorch threads
         per process (more up to the cores on a larger machine), mini-batches 2 and 32, and the text
         CNN at 100 and 400 filters per width (--filters): samples/s, CPU ms per sample, the
         speed-up over one thread: when a learner's threads pay (gadei.bench.threads, `[train]
         threads`).
jobs     N identical jobs (text CNN on TREC, 2 learners) side by side under one `gadei daemon
         --max-jobs N`, N = 1, 2, 4: the total samples/s against one job alone, the CPU
         seconds per sample and the threads of every process (gadei.bench.jobs).
service  a queue of small jobs (the text CNN on TREC's first 1,000 questions, 3 epochs), 8 and
         32 of them submitted at once, through gadei's daemon, Ray Jobs and a loop of a plain
         PyTorch script one and two at a time: wall, jobs per minute, submit to done, submit
         to the first gradient, test accuracy, and gadei's jobs per minute against each
         (gadei.bench.service).
gpu      GPU learners (gadei.bench.gpu): per-step time of one GPU learner + server against a
         plain PyTorch GPU loop, samples/s and GPU busy fraction with 1-8 learners on one GPU,
         the transports' copy bandwidth against pinned copies; needs CUDA (--device); drawn to --plot.

Every figure is the median of `--repeats` runs, the methods interleaved within each run so
that the machine's noise falls on all of them alike; ratios are of the medians. The tables
are printed and everything is saved as JSON (`--out`); peers, scaling, quality and gpu also
draw their figures as PNGs (`--plot`, default gadei-bench-<name>.png beside --out,
gadei.bench.figure), each JSON part saying where (its "plot").
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from .. import cgroup
from ..env import settings, usable_cores
from ..transport.slot import openmp
from .bridge import bench_bridge
from .gpu import bench_gpu
from .jobs import bench_jobs
from .kernel import bench_kernel
from .latency import bench_latency
from .peers import bench_peers
from .scaling import bench_scaling
from .server import bench_server
from .service import bench_service
from .threads import bench_threads
from .quality import bench_quality
from .train import bench_accuracy, bench_modes, bench_train, bench_transport

BENCHES = {"kernel": bench_kernel, "latency": bench_latency, "train": bench_train, "transport": bench_transport,
           "accuracy": bench_accuracy, "modes": bench_modes, "bridge": bench_bridge, "gpu": bench_gpu,
           "peers": bench_peers, "scaling": bench_scaling, "quality": bench_quality, "server": bench_server,
           "threads": bench_threads, "jobs": bench_jobs, "service": bench_service}
OWN_EPOCHS = ("service",)  # benches that choose their own default for --epochs; every other's is 1


def run_bench(args) -> int:
    unknown = [w for w in args.what if w not in BENCHES]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; choose from {sorted(BENCHES)}")
    if getattr(args, "data", None):
        from ..data import resolve

        args.data = resolve(args.data)  # a shared data set's bare name ('trec'), as `gadei learn --data` takes it
    built, processors = openmp()
    # the cores this process counts on (its affinity, its cgroup's CPU quota, or GADEI_CORES) beside the machine's,
    # and its cgroup's limits (None: none); the settings the user gave (None: the learners and peers run at
    # OpenMP's defaults, gadei's servers passive)
    out = {"machine": {"cpus": os.cpu_count(), "usable_cpus": usable_cores(), "cgroup_cpu_quota": cgroup.cpu_quota(),
                       "cgroup_memory_limit": cgroup.memory_limit(),
                       "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                       "GADEI_THREADS": os.environ.get("GADEI_THREADS"), "GADEI_CORES": os.environ.get("GADEI_CORES"),
                       "platform": platform.platform(), "python": platform.python_version(),
                       "torch": torch.__version__, "openmp": built, "kernel_threads_default": settings().threads},
           "repeats": args.repeats, "quick": args.quick, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for what in args.what:
        mine = argparse.Namespace(**vars(args))
        if mine.epochs is None and what not in OWN_EPOCHS:
            mine.epochs = 1
        out[what] = BENCHES[what](mine)
    Path(args.out).write_text(json.dumps(out, indent=2, default=float))
    print(f"\nsaved to {args.out}")
    return 0
