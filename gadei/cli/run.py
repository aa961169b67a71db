"""`gadei run` (a job file in the foreground) and `gadei predict` (a finished run's model)."""

import logging
import shlex

log = logging.getLogger("gadei.cli")


def cmd_run(args) -> int:
    from ..prepare import RUN, SUBMIT, check_job
    from ..run import run_job

    by = SUBMIT if args.submitted else RUN
    if args.check:
        for line in check_job(args.jobfile, resume=args.resume, by=by):
            print(line, flush=True)
        print("check passed", flush=True)
        return 0
    return run_job(args.jobfile, quiet=args.quiet, resume=args.resume, by=by)


def cmd_predict(args) -> int:
    from ..predict import predict

    for label, probability in predict(args.run_dir, args.text, top=args.top):
        print(f"{probability:7.2%}  {label}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a job file in the foreground: server, watchdog, learners, outputs",
                       description="Check a job file and its data (any problem is refused before anything "
                       "starts), fill in the defaults, run the job with a watchdog that restarts what crashes, "
                       "print progress, and leave the model chosen on validation, result.json, the label and "
                       "vocabulary maps, metrics.jsonl, accuracy.png, checkpoints and logs in its output folder "
                       "(docs/jobs.md). A job "
                       "file with a [bridge] section run as `mpiexec -n NODES gadei run JOB.toml` runs one node per "
                       "rank: rank R runs job NAME-rR in FOLDER/node-R with one ring more for the bridge, which it "
                       "runs itself once its job serves (docs/bridge.md); alone, or as one "
                       "rank, the file runs on one node.")
    p.add_argument("jobfile", help="the job's TOML file")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--check", action="store_true", help="make every check a run makes before it starts (the job "
                   "file, its data, the output folder, the region's name), print what the run would print before "
                   "starting and 'check passed'; start nothing, write nothing (exit 0, or 2 with the reason)")
    p.add_argument("--resume", action="store_true", help="go on with the run in the job's output folder (one that "
                   "was cancelled, failed, or ended early) from its newest checkpoint that records the learners' "
                   "progress; only [train] epochs, patience, devices and threads may differ from that run's job.toml")
    p.add_argument("--submitted", action="store_true", help="the job was submitted to the daemon, which runs it so: "
                   "what the run says to go on with it names `gadei submit --resume` (default: `gadei run --resume`)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("predict", help="the top labels of a finished run's model for a text",
                       description="Load the model, label and vocabulary maps of a `gadei run` output folder "
                       "and print the most likely labels of TEXT with their probabilities.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `gadei run` output folder")
    p.add_argument("text", metavar="TEXT", help="one text (quote a text of several words)")
    p.add_argument("--top", type=int, default=3, metavar="N", help="labels to print (default 3)")
    p.set_defaults(func=cmd_predict, leftover=_more_texts)


def _more_texts(args, extra: list[str]) -> str | None:
    """What `gadei predict` says of arguments left over (`gadei.cli.main`): words of an unquoted
    text; None for an option it does not know."""
    if any(arg.startswith("-") for arg in extra):
        return None
    texts = [args.text, *extra]
    return (f"argument TEXT: one text, got {len(texts)} ({', '.join(map(repr, texts))}): quote a text of several "
            f"words, e.g. gadei predict {args.run_dir} {shlex.quote(' '.join(texts))}")
