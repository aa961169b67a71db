"""`gadei bench service`: a queue of small jobs through gadei's daemon, through Ray Jobs and
through a loop of a plain PyTorch script one and two at a time, side by side (issue 46).

Every job is the same: the text CNN on TREC's first `--questions` training questions (1,000;
a tenth of them held out for validation, seeded: 900 training, 100 validation) and its 500
test questions, `--epochs` epochs (3), everything else the job file's defaults (for 900
questions: 2 learners, Adagrad, lr 0.01, mini-batch 2). N such jobs (`--jobs`, 8 and 32) are
submitted at once to each system (`--systems`):

gadei    a `gadei daemon` of the bench's own (`gadei.bench.daemon`: its own runtime and state
         folders), the N job files (alike but for each one's name and output folder) submitted
         through `gadei.Client`; as many run at once as the daemon's default lets, or
         `--max-jobs`, passed to it.
ray      a local Ray head of the bench's own with the usable cores as its CPUs
         (`gadei.bench.ray_jobs`), each job the plain script (`gadei.bench.plain_job`: the same
         model, split, optimizer, lr, mini-batch and epochs, one process of one thread)
         submitted through `JobSubmissionClient` with `entrypoint_num_cpus=1`.
loop-1   the plain script on each job file, one after the other (a shell's `for` loop).
loop-2   the same, two at a time (`xargs -P 2`).

For each system and N: the wall time from the first submit to the last job's end, jobs per
minute, each job's submit to done (median and 95th percentile), submit to its first gradient
and its start to its first gradient (medians), the first job's submit to its first gradient
(the queue empty, the cores free), and the test accuracy (median, min-max); and gadei's jobs
per minute against each peer's. The moments, each as the system itself has them:

- submit: the bench's clock as it hands the job over (`Client.submit`, `submit_job`); a loop's
  jobs are all submitted as the loop starts.
- start: when the system started the job's processes: the daemon's record (`started`); the
  plain script's own process (its start time from the kernel; under Ray, the driver's).
- first gradient: the plain script's first backward's end, which it reports; gadei's first
  gradient applied, which its server records: result.json's run start and
  `seconds_to_first_update` (`gadei.outputs.first_update_at`).
- done: when the system saw the job end: the daemon's record (`ended`: its runner learns of a
  supervisor's end from the zygote at once), Ray's (`end_time`), the loop's (the process's exit).

Each run starts its service fresh (a new daemon, a new Ray head, whose starts are not timed)
and stops it after. `--repeats` runs of each system and N, the systems in a shuffled order in
each repeat and N; each figure is the median of the runs' figures, the accuracy's over every
job of every run.
"""

import json
import logging
import random
import shlex
import statistics
import subprocess
import tempfile
import threading
import time
import tomllib
from pathlib import Path

from .._proc import wait_or_kill
from ..env import usable_cores
from ..outputs import first_update_at
from . import plain_job
from .daemon import BenchDaemon
from .quality import job_file, set_data
from .timing import median, table

log = logging.getLogger(__name__)

WHAT = "gadei bench service"
SYSTEMS = ("gadei", "ray", "loop-1", "loop-2")
PEERS = SYSTEMS[1:]
JOBS = (8, 32)
QUICK_JOBS = (2,)
EPOCHS = 3
QUICK_EPOCHS = 1
QUESTIONS = 1000  # TREC's first training questions, a tenth held out for validation
SEED = 0  # every job's: the jobs are alike
JOB_TIMEOUT = 300.0  # seconds a run may take per job in its queue (on top of RUN_TIMEOUT)
RUN_TIMEOUT = 120.0
TARGETS = {"ray": 1.5, "loop-2": 1.1}  # issue 46: gadei's jobs per minute at least this against the peer's
FIRST_GRADIENT_TARGET = 0.5  # issue 46: seconds from submit to the first gradient where cores are free (median)


def chosen_systems(text: str | None) -> tuple[str, ...]:
    """--systems as the systems it names, in SYSTEMS' order; all of them without it.

    Raises:
        ValueError: a name that is not a system.
    """
    if not text:
        return SYSTEMS
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(SYSTEMS))
    if unknown or not names:
        raise ValueError(f"--systems {text!r}: unknown system(s) {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(SYSTEMS)}")
    return tuple(s for s in SYSTEMS if s in names)


def bench_service(args) -> dict:
    """Every chosen system x N x repeat, the systems shuffled within each repeat and N; the
    table, the ratios, the targets, and every run's figures and jobs."""
    systems = chosen_systems(getattr(args, "systems", None))
    if "ray" in systems:
        from .ray_jobs import check_installed

        check_installed()  # said now, not after the first runs
    counts = tuple(getattr(args, "jobs", None) or (QUICK_JOBS if args.quick else JOBS))
    epochs = args.epochs or (QUICK_EPOCHS if args.quick else EPOCHS)
    questions = getattr(args, "questions", None) or QUESTIONS
    max_jobs = getattr(args, "max_jobs", None)
    repeats = max(1, args.repeats)
    runs = []
    with tempfile.TemporaryDirectory(prefix="gadei-bench-service-") as tmp:
        folder = Path(tmp)
        data = set_data("trec", folder, first=questions, what=WHAT)
        for repeat in range(repeats):
            for n in counts:
                order = list(systems)
                random.Random(f"{repeat}-{n}").shuffle(order)
                for system in order:
                    where = folder / f"r{repeat}-n{n}-{system}"
                    where.mkdir()
                    paths = [job_file(where, f"trec-{i}", data, learners=None, seed=SEED, epochs=epochs)
                             for i in range(n)]
                    jobs = RUNNERS[system](paths, where, timeout=RUN_TIMEOUT + JOB_TIMEOUT * n, max_jobs=max_jobs)
                    run = {"system": system, "jobs": n, "repeat": repeat, **figures(jobs), "records": jobs}
                    runs.append(run)
                    print(f"  {n} jobs, {system}, repeat {repeat}: {run['wall_s']:.1f} s, "
                          f"{run['jobs_per_min']:.1f} jobs/min", flush=True)
        settings = _settings(runs)  # gadei's from its outputs, still there
    summary = {n: {s: _summary([r for r in runs if r["jobs"] == n and r["system"] == s]) for s in systems}
               for n in counts}
    ratios = {n: {peer: by["gadei"]["jobs_per_min"] / by[peer]["jobs_per_min"] for peer in PEERS if peer in by}
              for n, by in summary.items() if "gadei" in by}
    print(f"\nservice: queues of {' and '.join(map(str, counts))} alike jobs submitted at once: the text CNN on "
          f"TREC's first {questions:,} training questions and its test questions, {epochs} epoch(s), the job file's "
          f"defaults ({_said(settings, max_jobs)}); medians of {repeats} run(s), the systems shuffled in each; "
          f"{usable_cores()} usable cores")
    rows = []
    for n, by in summary.items():
        for system, s in by.items():
            against = "" if system == "gadei" or n not in ratios else f"{ratios[n][system]:.2f}x"
            rows.append([system, n, f"{s['wall_s']:.1f}", f"{s['jobs_per_min']:.1f}", against,
                         f"{s['done_median_s']:.1f}", f"{s['done_p95_s']:.1f}", _seconds(s["first_median_s"]),
                         _seconds(s["start_to_first_median_s"]), _seconds(s["first_job_first_s"]),
                         f"{s['accuracy_median']:.1%} ({s['accuracy_min']:.1%}-{s['accuracy_max']:.1%})"])
    print(table(("system", "jobs", "wall s", "jobs/min", "gadei against it", "to done s", "p95", "to 1st gradient s",
                 "from start", "1st job's", "test accuracy, median (min-max)"), rows))
    print("to done s and p95: each job's submit to done, median and 95th percentile; to 1st gradient s: each job's "
          "submit to its first gradient, median (the time in the queue included), from start: from its processes' "
          "start, 1st job's: the first job's submit to it (the queue empty, the cores free). gadei's first gradient: "
          "the first one its job's server applied (result.json's seconds_to_first_update); the peers': the plain "
          "script's first backward")
    targets = _targets(summary, ratios)
    for line in targets["lines"]:
        print(line)
    return {"jobs": list(counts), "epochs": epochs, "questions": questions, "systems": list(systems),
            "max_jobs": max_jobs, "repeats": repeats, "settings": settings,
            "summary": {str(n): by for n, by in summary.items()},
            "ratios": {str(n): by for n, by in ratios.items()}, "targets": targets["met"], "runs": runs}


# ---------------------------------------------------------------------------- the systems
# Each takes the job files of one queue and hands back one record a job: its `submitted`,
# `started`, `first_gradient` and `ended` (wall clock, seconds since 1970; `first_gradient`
# None where not known) and its `test_accuracy`.

def run_gadei(paths: list[Path], folder: Path, *, timeout: float, max_jobs: str | None = None) -> list[dict]:
    """The queue through a daemon of the bench's own, submitted through `gadei.Client`."""
    flags = ("--max-jobs", str(max_jobs)) if max_jobs else ()
    submitted = {}
    with BenchDaemon(folder / "daemon", *flags, what=WHAT) as daemon:
        for path in paths:
            at = time.time()
            submitted[daemon.submit(path)] = at
        records = daemon.wait_ended(list(submitted), timeout)
    jobs = []
    for record in records:
        if record["state"] != "done":
            raise RuntimeError(f"{WHAT}: gadei job {record['name']} {record['state']}: {record['message']}")
        output = Path(record["output"])
        result = json.loads((output / "result.json").read_text())
        jobs.append({"job": record["name"], "submitted": submitted[record["name"]], "started": record["started"],
                     "first_gradient": first_update_at(result), "ended": record["ended"],
                     "test_accuracy": result["test_accuracy"], "output": str(output)})
    return jobs


def run_ray(paths: list[Path], folder: Path, *, timeout: float, max_jobs: str | None = None) -> list[dict]:
    """The queue as Ray Jobs on a head of the bench's own: the plain script, one CPU a job."""
    from .ray_jobs import RayHead

    submitted = {}
    with RayHead(cpus=usable_cores()) as head:
        for path in paths:
            at = time.time()
            submitted[head.submit(shlex.join(plain_job.command(path)))] = at
        infos = head.wait_ended(list(submitted), timeout)
    jobs = []
    for info in infos:
        if info["status"] != "SUCCEEDED":
            raise RuntimeError(f"{WHAT}: Ray job {info['job']} {info['status']}: {info['message']}: "
                               f"{info['logs'][-2000:]}")
        report = _report(info["logs"], f"Ray job {info['job']}")
        jobs.append({"job": info["job"], "submitted": submitted[info["job"]], "started": report["started"],
                     "first_gradient": report["first_gradient_at"], "ended": info["ended"],
                     "test_accuracy": report["test_accuracy"], "plain": _plain_settings(report)})
    return jobs


def run_loop(paths: list[Path], at_once: int, *, timeout: float) -> list[dict]:
    """The queue through the plain script, `at_once` processes at a time, each taking the next
    job file as one ends (`xargs -P`). Stopped (Ctrl-C, SIGTERM), no job starts and the running
    ones are killed."""
    queue = list(enumerate(paths))
    jobs: list[dict | None] = [None] * len(paths)
    errors: list[str] = []
    running: set[subprocess.Popen] = set()
    lock = threading.Lock()
    submitted = time.time()
    deadline = time.monotonic() + timeout

    def worker():
        while True:
            with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
                with lock:
                    if not queue or errors:
                        return
                    i, path = queue.pop(0)
                    proc = subprocess.Popen(plain_job.command(path), stdin=subprocess.DEVNULL, stdout=out, stderr=err)
                    running.add(proc)
                try:
                    code = wait_or_kill(proc, max(1.0, deadline - time.monotonic()), f"{WHAT}: {path.name}")
                finally:
                    with lock:
                        running.discard(proc)
                ended = time.time()
                if time.monotonic() >= deadline:  # killed by `wait_or_kill`
                    errors.append(f"{path.name}: not done within the run's {timeout:g} s")
                    return
                out.seek(0)
                err.seek(0)
                if code != 0:
                    errors.append(f"{path.name}: the plain script exited with {code}: {err.read()[-2000:]}")
                    return
                report = _report(out.read(), path.name)
            jobs[i] = {"job": path.stem, "submitted": submitted, "started": report["started"],
                       "first_gradient": report["first_gradient_at"], "ended": ended,
                       "test_accuracy": report["test_accuracy"], "plain": _plain_settings(report)}

    threads = [threading.Thread(target=worker, name=f"bench-loop-{k}") for k in range(at_once)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:  # stopped: no job starts, the running ones are killed (their threads reap them)
        with lock:
            queue.clear()
            for proc in running:
                proc.kill()
        for t in threads:
            t.join()
        raise
    if errors:
        raise RuntimeError(f"{WHAT}: loop of {at_once}: {errors[0]}")
    return jobs


def _loop(at_once: int):
    def run(paths: list[Path], folder: Path, *, timeout: float, max_jobs: str | None = None) -> list[dict]:
        return run_loop(paths, at_once, timeout=timeout)

    return run


RUNNERS = {"gadei": run_gadei, "ray": run_ray, "loop-1": _loop(1), "loop-2": _loop(2)}


def _report(stdout: str, what: str) -> dict:
    """The plain script's report: the last line of its output that is a JSON object."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    raise RuntimeError(f"{WHAT}: {what}: the plain script's output ends without its report: {stdout[-2000:]}")


def _plain_settings(report: dict) -> dict:
    return {key: report.get(key) for key in ("optimizer", "lr", "batch", "samples")}


# ---------------------------------------------------------------------------- the figures

def figures(jobs: list[dict]) -> dict:
    """One run's figures from its jobs' records: the wall time from the first submit to the
    last end, jobs per minute, submit to done (median, 95th percentile), submit to the first
    gradient and start to the first gradient (medians), the first job's submit to its first
    gradient, the test accuracies."""
    start, end = min(j["submitted"] for j in jobs), max(j["ended"] for j in jobs)
    wall = end - start
    done = [j["ended"] - j["submitted"] for j in jobs]
    known = [j for j in jobs if j["first_gradient"] is not None]
    first_job = min(jobs, key=lambda j: (j["submitted"], j["started"]))
    return {"wall_s": wall, "jobs_per_min": 60.0 * len(jobs) / wall,
            "done_median_s": median(done), "done_p95_s": percentile(done, 95),
            "first_median_s": median([j["first_gradient"] - j["submitted"] for j in known]) if known else None,
            "start_to_first_median_s": median([j["first_gradient"] - j["started"] for j in known]) if known else None,
            "first_job_first_s": (first_job["first_gradient"] - first_job["submitted"]
                                  if first_job["first_gradient"] is not None else None),
            "accuracy": [j["test_accuracy"] for j in jobs]}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of `values`, linear between the two nearest ranks (numpy's default)."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def _summary(runs: list[dict]) -> dict:
    """The median of each figure over the runs of one system and N; accuracy over all their jobs."""
    def med(key):
        values = [r[key] for r in runs if r[key] is not None]
        return median(values) if values else None

    accuracy = [a for r in runs for a in r["accuracy"]]
    return {**{key: med(key) for key in ("wall_s", "jobs_per_min", "done_median_s", "done_p95_s", "first_median_s",
                                         "start_to_first_median_s", "first_job_first_s")},
            "accuracy_median": statistics.median(accuracy), "accuracy_min": min(accuracy),
            "accuracy_max": max(accuracy), "runs": len(runs)}


def _targets(summary: dict, ratios: dict) -> dict:
    """Issue 46's targets against each N's figures: met or missed, and a line saying so each N."""
    met, lines = {}, []
    for n, by in summary.items():
        if "gadei" not in by:
            continue
        checks = {f"jobs/min against {peer} >= {goal}x": (ratios[n][peer], ratios[n][peer] >= goal, "x")
                  for peer, goal in TARGETS.items() if peer in ratios[n]}
        first = by["gadei"]["first_job_first_s"]
        if first is not None:
            checks[f"first job's submit to first gradient <= {FIRST_GRADIENT_TARGET} s"] = (
                first, first <= FIRST_GRADIENT_TARGET, " s")
        met[str(n)] = {name: ok for name, (_, ok, _) in checks.items()}
        lines.append(f"issue 46's targets at {n} jobs: " + "; ".join(
            f"{name}: {value:.2f}{unit}, {'met' if ok else 'missed'}" for name, (value, ok, unit) in checks.items()))
    return {"met": met, "lines": lines}


def _settings(runs: list[dict]) -> dict:
    """What the jobs ran with: gadei's job as run (its output folder's job.toml, the defaults
    filled in) and the plain script's (its report, with the samples of each split); None for a
    system not run."""
    gadei = next((j for r in runs if r["system"] == "gadei" for j in r["records"]), None)
    plain = next((j["plain"] for r in runs if r["system"] != "gadei" for j in r["records"]), None)
    if gadei is not None:
        train = tomllib.loads((Path(gadei["output"]) / "job.toml").read_text()).get("train", {})
        gadei = {key: train.get(key) for key in ("learners", "optimizer", "lr", "batch")}
    return {"gadei": gadei, "plain": plain}


def _said(settings: dict, max_jobs: str | None) -> str:
    """The settings in words, for the table's heading."""
    gadei, plain = settings["gadei"], settings["plain"]
    words = []
    if gadei is not None:
        words.append(f"gadei: {gadei['learners']} learners, {gadei['optimizer']}, lr {gadei['lr']}, mini-batch "
                     f"{gadei['batch']}, its daemon " + (f"with --max-jobs {max_jobs}" if max_jobs else
                                                          "at its default --max-jobs"))
    if plain is not None:
        samples = plain["samples"]
        words.append(f"the plain script: {plain['optimizer']}, lr {plain['lr']}, mini-batch {plain['batch']}, 1 "
                     f"thread, {samples['train']:,} training, {samples['validation']:,} validation, "
                     f"{samples['test']:,} test samples")
    return "; ".join(words)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"

