"""`gadei run` (a job file in the foreground) and `gadei predict` (a finished run's model)."""

import logging

log = logging.getLogger("gadei.cli")


def cmd_run(args) -> int:
    # A stop (SIGTERM, SIGINT: Ctrl-C) from here on ends the run while the job is checked (nothing
    # written yet), then is recorded and passed on to the job's supervisor once it runs
    # (`run.JobRun`), never a death that leaves half a folder; a process that starts this one held
    # keeps them blocked until now (`launch.spawn(held=True)`).
    from ..launch import take_stops

    asked: list[int] = []
    if not args.check:
        take_stops(lambda sig, _frame: asked.append(sig))
    from ..prepare import check_job
    from ..run import run_job

    if args.check:
        for line in check_job(args.jobfile, resume=args.resume):
            print(line, flush=True)
        print("check passed", flush=True)
        return 0
    return run_job(args.jobfile, quiet=args.quiet, resume=args.resume, asked=asked)


MAX_STDIN_TEXTS = 64 << 20  # bytes of texts `gadei predict RUN -` reads from standard input
SHOWN_TEXT = 200  # characters of a text its line shows, for people (--json gives it whole)


def cmd_predict(args) -> int:
    import json
    import sys

    from ..predict import predict

    texts = list(args.text)
    if "-" in texts:  # the texts of standard input, one a line, in its place
        at = texts.index("-")
        texts[at:at + 1] = texts_of(sys.stdin.buffer.read(MAX_STDIN_TEXTS + 1), "standard input")
    answers = predict(args.run_dir, texts, top=args.top)
    if args.json:  # a JSON object a line, for programs (a text may hold ": " or a newline)
        for text, best in zip(texts, answers):
            print(json.dumps({"text": text, "labels": [{"label": label, "probability": round(probability, 6)}
                                                       for label, probability in best]}, ensure_ascii=False))
        return 0
    if len(answers) == 1 and "-" not in args.text:  # one text given: a label a line
        for label, probability in answers[0]:
            print(f"{probability:7.2%}  {one_line(label)}")
        return 0
    for text, best in zip(texts, answers):  # several: one line each, the text first (a long one's start)
        shown = text if len(text) <= SHOWN_TEXT else text[:SHOWN_TEXT - 3] + "..."
        print(f"{one_line(shown)}: " + ", ".join(f"{one_line(label)} {probability:.2%}" for label, probability in best))
    return 0


def one_line(text: str) -> str:
    """`text` with its control characters escaped (a newline as \\n), so that a label or text
    that holds one (a quoted CSV field may) keeps to its answer's line."""
    import unicodedata

    return "".join(c.encode("unicode_escape").decode() if unicodedata.category(c) == "Cc" else c for c in text)


def texts_of(data: bytes, where: str) -> list[str]:
    """The texts in `data`, one a line (UTF-8, a byte-order mark dropped; lines end at \\n or
    \\r\\n); GadeiError naming `where` and the line for bytes that are not UTF-8, a blank line,
    no line at all, or more than MAX_STDIN_TEXTS bytes."""
    from ..errors import GadeiError

    if len(data) > MAX_STDIN_TEXTS:
        raise GadeiError(f"{where}: more than {MAX_STDIN_TEXTS >> 20} MiB of texts; give them in parts")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line, column = data.count(b"\n", 0, err.start) + 1, err.start - data.rfind(b"\n", 0, err.start)
        raise GadeiError(f"{where}: line {line} is not UTF-8 (its byte {column:,}, 0x{data[err.start]:02x}: "
                         f"{err.reason})") from None
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    if lines[-1] == "":  # the newline that ends the last line
        lines.pop()
    if not lines:
        raise GadeiError(f"{where}: no texts; give one a line")
    blank = next((number for number, line in enumerate(lines, 1) if not line.strip()), None)
    if blank:
        raise GadeiError(f"{where}: line {blank} is blank; give one text a line")
    return lines


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run a job file in the foreground: its supervisor, server, learners, outputs",
                       description="Check a job file and its data (any problem is refused before anything "
                       "starts), fill in the defaults, run the job under its supervisor, which restarts what crashes, "
                       "print progress (a Ctrl-C stops the job with a checkpoint to go on from; one while the job file "
                       "and data are checked ends it, writing nothing), and leave the model "
                       "chosen on validation, result.json, the label and "
                       "vocabulary maps, metrics.jsonl, accuracy.png, TensorBoard event files (with TensorBoard "
                       "installed), checkpoints and logs in its output folder "
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
                   "progress; only [train] epochs, patience, devices and threads and the [checkpoint] settings may "
                   "differ from that run's job.toml")
    p.set_defaults(func=cmd_run, log_default="WARNING")  # its own lines say what the library logs

    p = sub.add_parser("predict", help="the top labels of a finished run's model for one text or several",
                       description="Load the model, label and vocabulary maps of a `gadei run` output folder "
                       "and print the most likely labels of each TEXT with their probabilities: for one text a label "
                       "a line, for several (or those of standard input, `-`) one line each (`TEXT: LABEL P, LABEL P, "
                       "...`), or with --json a JSON object a line. Quote a text of several words: each argument is a "
                       "text of its own.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a `gadei run` output folder")
    p.add_argument("text", metavar="TEXT", nargs="+", help="a text (quote a text of several words); "
                   "for a numeric workload, the features separated by commas; - reads texts from standard input, "
                   "one a line (UTF-8)")
    p.add_argument("--top", type=int, default=3, metavar="N", help="labels to print (default 3)")
    p.add_argument("--json", action="store_true", help='a JSON object a line for each text: {"text": ..., '
                   '"labels": [{"label": ..., "probability": ...}, ...]}, the likeliest first')
    p.set_defaults(func=cmd_predict, intermixed=True)
