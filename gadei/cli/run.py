"""`gadei run` (a job file in the foreground) and `gadei predict` (a finished run's model)."""

import logging

log = logging.getLogger("gadei.cli")


def cmd_run(args) -> int:
    # A stop (SIGTERM: `gadei cancel`; SIGINT: Ctrl-C) from here on is recorded and taken once the
    # job is prepared (`run.JobRun`), never a death that leaves no result.json; the daemon starts
    # this process with them held until now (`launch.spawn(held=True)`).
    from ..launch import take_stops

    asked: list[int] = []
    if not args.check:
        take_stops(lambda sig, _frame: asked.append(sig))
    from ..prepare import RUN, SUBMIT, check_job
    from ..run import run_job

    by = SUBMIT if args.submitted else RUN
    if args.check:
        for line in check_job(args.jobfile, resume=args.resume, by=by):
            print(line, flush=True)
        print("check passed", flush=True)
        return 0
    return run_job(args.jobfile, quiet=args.quiet, resume=args.resume, by=by, asked=asked)


def cmd_predict(args) -> int:
    from ..predict import predict

    answers = predict(args.run_dir, args.text, top=args.top)
    if len(answers) == 1:  # one text: a label a line
        for label, probability in answers[0]:
            print(f"{probability:7.2%}  {label}")
        return 0
    for text, best in zip(args.text, answers):  # several: one line each, the text first
        print(f"{text}: " + ", ".join(f"{label} {probability:.2%}" for label, probability in best))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a job file in the foreground: server, watchdog, learners, outputs",
                       description="Check a job file and its data (any problem is refused before anything "
                       "starts), fill in the defaults, run the job with a watchdog that restarts what crashes, "
                       "print progress, and leave the model chosen on validation, result.json, the label and "
                       "vocabulary maps, metrics.jsonl, accuracy.png, TensorBoard event files (with TensorBoard installed), "
                       "checkpoints and logs in its output folder "
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
    p.set_defaults(func=cmd_run, log_default="WARNING")  # its own lines say what the library logs

    p = sub.add_parser("predict", help="the top labels of a finished run's model for one text or several",
                       description="Load the model, label and vocabulary maps of a `gadei run` output folder "
                       "and print the most likely labels of each TEXT with their probabilities: for one text a label "
                       "a line, for several one line each (`TEXT: LABEL P, LABEL P, ...`). Quote a text of several "
                       "words: each argument is a text of its own.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `gadei run` output folder")
    p.add_argument("text", metavar="TEXT", nargs="+", help="a text (quote a text of several words); "
                   "for a numeric workload, the features separated by commas")
    p.add_argument("--top", type=int, default=3, metavar="N", help="labels to print (default 3)")
    p.set_defaults(func=cmd_predict, intermixed=True)
