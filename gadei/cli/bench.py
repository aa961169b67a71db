"""`gadei bench`: gadei measured side by side with its alternatives."""

import logging
import signal

from .common import at_least, int_list

log = logging.getLogger("gadei.cli")


def cmd_bench(args) -> int:
    from ..bench import run_bench

    signal.signal(signal.SIGTERM, _stopped)
    signal.signal(signal.SIGHUP, _stopped)
    return run_bench(args)


def _stopped(sig, _frame):
    """A bench stopped by SIGTERM or SIGHUP ends as a Ctrl-C ends it, unwinding: what it started
    is stopped on the way out (a Ray head shut down, its temporary folders removed, a daemon of
    its own stopped), where the signal's default action left them behind; the exit code says the
    signal (128 + its number), as the shell's would."""
    raise SystemExit(128 + sig)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure gadei against its alternatives, side by side")
    p.add_argument("what", nargs="*", default=["kernel", "latency", "train"],
                   help="kernel, latency, train, transport, accuracy, modes, bridge, gpu, peers, scaling, quality, "
                   "server, threads, jobs, service (default: the first three)")
    p.add_argument("--repeats", type=at_least(1), default=5, help="repeated runs (for accuracy and modes: seeds "
                   "0..N-1); medians are reported, for accuracies the mean and range (default 5)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and steps (a smoke run)")
    p.add_argument("--out", default="gadei-bench.json", help="where to save the figures as JSON")
    p.add_argument("--data", default=None, help="train, transport, modes, peers, scaling, threads: data set "
                   "(default: trec under GADEI_DATA_DIR or ../shared/data, else generated)")
    p.add_argument("--epochs", type=at_least(1), default=None, help="train, transport, peers, scaling, threads: "
                   "epochs per run (default 1); service: each job's (default 3; --quick 1)")
    p.add_argument("--accuracy-epochs", type=at_least(1), default=4,
                   help="accuracy, modes: epochs per run (default 4)")
    p.add_argument("--sets", help="quality: shared data sets, comma-separated (default trec,sst2,subj,cr,banking77; "
                   "--quick: a cut of trec)")
    p.add_argument("--runs", metavar="RUN,...",
                   help="quality: the runs, comma-separated, of gadei-1, gadei-2, pytorch (the text CNN with 1 and 2 "
                   "learners, its PyTorch loop), ngram-2 (the n-gram workload, 2 learners), auto-2 (a job file "
                   "that names no workload: both trained, their mean or the better handed back; 2 learners), "
                   "sklearn-svc, sklearn-lr (scikit-learn on the same n-grams: pip install 'gadei[bench]'), sklearn "
                   "(both); default: all")
    p.add_argument("--workload", choices=("textcnn", "ngram"), default="textcnn",
                   help="peers, scaling: the model trained (default textcnn; ngram: the n-gram workload, by the plain "
                   "loop, gadei and Hogwild, at its lr 0.2)")
    p.add_argument("--train", action="append", default=[], metavar="KEY=VALUE,...",
                   help="quality: a candidate setting of job-file [train] keys (e.g. optimizer=adam,lr=0.001), run "
                   "with 2 learners beside the defaults; repeat it for more candidates")
    p.add_argument("--sizes", help="bridge: model sizes in MB, comma-separated (default 1,16,64,256; --quick 1,4)")
    p.add_argument("--ranks", type=at_least(1), default=2, help="bridge: MPI ranks started on this machine (default 2)")
    p.add_argument("--device", default="cuda:0", help="gpu: the GPU measured (default cuda:0; cpu: a smoke run of "
                   "the harness, figures meaningless)")
    p.add_argument("--mps", action="store_true", help="gpu: also run the learners sharing the GPU under a CUDA MPS "
                   "daemon of the bench's own (nvidia-cuda-mps-control), beside the runs without")
    p.add_argument("--batches", type=int_list(1, "mini-batch sizes"),
                   help="peers, scaling, threads: mini-batch sizes, comma-separated (default 1,2,4,32; --quick 4; "
                   "threads: 2,32)")
    p.add_argument("--filters", type=int_list(1, "filter counts"),
                   help="threads: the text CNN's filters per convolution width, comma-separated (default 100,400: "
                   "the workload's model and one 4 times as large; one whose runs cannot fit the memory is "
                   "refused)")
    p.add_argument("--jobs", type=int_list(1, "job counts"), metavar="N,...",
                   help="service: the queues' lengths, comma-separated (default 8,32; --quick 2)")
    p.add_argument("--systems", metavar="SYSTEM,...",
                   help="service: the systems the queue goes through, comma-separated, of gadei (a daemon of the "
                   "bench's own), ray (Ray Jobs on a local head of its own: pip install 'gadei[bench]'), loop-1 and "
                   "loop-2 (a loop of the plain PyTorch script, one and two at a time); default: all")
    p.add_argument("--max-jobs", metavar="N", default=None,
                   help="service: passed to the bench's gadei daemon (default: none, the daemon's own default)")
    p.add_argument("--questions", type=at_least(10), default=None, metavar="N",
                   help="service: each job trains on TREC's first N training questions, a tenth held out for "
                   "validation, and is tested on TREC's 500 test questions (default 1000)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="peers, scaling, quality, gpu: where to draw the figure beside the tables (default "
                   "gadei-bench-<name>.png beside --out; with several of them, PNG's name gets -<name>; none: no "
                   "figure)")
    p.set_defaults(func=cmd_bench)
