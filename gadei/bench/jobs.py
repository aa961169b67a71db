"""`gadei bench jobs`: several jobs side by side under one daemon, against one job alone.

The daemon runs up to `--max-jobs` jobs at once, each with a server of its own (docs/daemon.md).
For N = 1, 2 and 4 the bench starts a real `gadei daemon --max-jobs N` on a state and runtime
folder of its own (a temporary folder: the user's own daemon is never touched), submits N
identical job files (the text CNN on TREC from the shared data, 2 learners each, EPOCHS
epochs; `--quick`: TREC cut to its first QUICK_SAMPLES questions, one epoch, so that starting
the processes is most of the time), waits until all have ended, and
reports the total samples/s over the wall time from the first job's start to the last one's
end (the daemon's records; it notices an end within its poll, half a second), against one
job alone. While the jobs run it reads every process of theirs (the supervisor, the server,
the learners) and the daemon every SAMPLE_EVERY seconds: CPU seconds over its life
(all threads) and the most OS threads it had, so that N idle servers spinning together show
as a server's CPU seconds, and the CPU seconds per sample, growing with N. The CPU a process
spends after its last reading is missed (up to SAMPLE_EVERY seconds of each), so the CPU
figures are a little low, alike for every N.

Each figure is the median of `--repeats` runs, the values of N in a shuffled order within each
repeat so that the machine's drift falls on all of them alike.
"""

import json
import logging
import os
import random
import tempfile
import threading
from pathlib import Path

import psutil

from .daemon import BenchDaemon
from .quality import job_file, set_data
from .timing import median, process_cpu_s, process_threads, table

log = logging.getLogger(__name__)

JOBS = (1, 2, 4)
LEARNERS = 2
EPOCHS = 2
QUICK_SAMPLES = 1000  # --quick: TREC's first training questions, one epoch
SAMPLE_EVERY = 0.1  # seconds between two readings of the jobs' processes
TIMEOUT = 1800.0  # seconds one daemon's jobs may take in all


def bench_jobs(args) -> dict:
    repeats = max(1, args.repeats)
    with tempfile.TemporaryDirectory(prefix="gadei-bench-jobs-") as tmp:
        folder = Path(tmp)
        data = set_data("trec", folder, first=QUICK_SAMPLES if args.quick else None, what="gadei bench jobs")
        epochs = 1 if args.quick else EPOCHS
        samples = _samples_per_job(folder, data, epochs)
        runs = []
        for repeat in range(repeats):
            counts = list(JOBS)
            random.Random(repeat).shuffle(counts)
            for n in counts:
                run = _side_by_side(folder / f"r{repeat}-n{n}", data, n, seed=repeat, epochs=epochs, samples=samples)
                runs.append({"repeat": repeat, **run})
                log.info("repeat %d, %d job(s): %.0f samples/s over %.1f s", repeat, n, run["samples_per_s"],
                         run["seconds"])
    records = []
    for n in JOBS:
        mine = [r for r in runs if r["jobs"] == n]
        records.append({"jobs": n, "samples_per_s": median([r["samples_per_s"] for r in mine]),
                        "seconds": median([r["seconds"] for r in mine]),
                        "job_seconds": median([s for r in mine for s in r["job_seconds"]]),
                        "cpu_s_per_sample": median([r["cpu_s_per_sample"] for r in mine]),
                        "server_cpu_s": median([p["cpu_s"] for r in mine for p in r["processes"]
                                                if p["role"] == "server"]),
                        "cores": median([r["cpu_s"] / r["seconds"] for r in mine]), "runs": mine})
    one = records[0]["samples_per_s"]
    for r in records:
        r["against_one"] = r["samples_per_s"] / one
    cut = f"TREC cut to its first {QUICK_SAMPLES:,} questions" if args.quick else "TREC"
    print(f"\njobs: N identical jobs (text CNN on {cut}, {LEARNERS} learners, {epochs} epoch(s), {samples:,} samples "
          f"each) under one `gadei daemon --max-jobs N`; samples/s of all jobs over the wall time from the first "
          f"start to the last end; CPU of every process of the jobs and of the daemon; medians of {repeats} "
          f"run(s), N shuffled; {len(os.sched_getaffinity(0))} usable cores")
    print(table(("jobs", "samples/s", "against 1 job", "wall s", "each job's s", "CPU ms/sample", "cores busy",
                 "a server's CPU s"),
                [(r["jobs"], f"{r['samples_per_s']:.0f}", f"{r['against_one']:.2f}x", f"{r['seconds']:.1f}",
                  f"{r['job_seconds']:.1f}", f"{1e3 * r['cpu_s_per_sample']:.2f}", f"{r['cores']:.2f}",
                  f"{r['server_cpu_s']:.2f}") for r in records]))
    print("threads per process (the most seen, first run):")
    for r in records:
        print(f"  {r['jobs']} job(s): {_threads(r['runs'][0]['processes'])}")
    return {"learners": LEARNERS, "epochs": epochs, "samples_per_job": samples, "quick": args.quick,
            "records": records}


def _samples_per_job(folder: Path, data: dict, epochs: int) -> int:
    """The samples one job trains on: its training split (what is left after the test and
    validation hold-outs) times the epochs."""
    from .. import jobfile
    from ..data import load_job

    path = job_file(folder, "trec", data, learners=LEARNERS, seed=0, epochs=epochs)
    train = load_job(jobfile.load(path))[0]
    path.unlink()
    return len(train) * epochs


def _side_by_side(folder: Path, data: dict, n: int, *, seed: int, epochs: int, samples: int) -> dict:
    """One daemon with --max-jobs `n` and `n` jobs submitted to it at once; their wall time, samples/s, CPU."""
    with BenchDaemon(folder, "--max-jobs", str(n), what="gadei bench jobs") as daemon:
        with _Readings(str(folder), daemon.pid) as readings:
            names = [daemon.submit(job_file(folder, f"trec-{i}", data, learners=LEARNERS, seed=seed, epochs=epochs))
                     for i in range(n)]
            jobs = daemon.wait_ended(names, TIMEOUT)
    failed = [j for j in jobs if j["state"] != "done"]
    if failed:
        bad = failed[0]
        raise RuntimeError(f"gadei bench jobs: job {bad['name']} {bad['state']}: {bad['message']}")
    start, end = min(j["started"] for j in jobs), max(j["ended"] for j in jobs)
    processes = readings.processes()
    cpu = sum(p["cpu_s"] for p in processes)
    return {"jobs": n, "samples": n * samples, "seconds": end - start, "samples_per_s": n * samples / (end - start),
            "job_seconds": [json.loads((Path(j["output"]) / "result.json").read_text())["seconds"] for j in jobs],
            "started_ended": [(j["started"], j["ended"]) for j in jobs],
            "cpu_s": cpu, "cpu_s_per_sample": cpu / (n * samples), "processes": processes}


class _Readings:
    """Every SAMPLE_EVERY seconds, in a thread: the CPU seconds and OS threads of each process
    whose command line names `marker` (the bench's folder: every process of its jobs), and of
    the daemon (`daemon_pid`); the last reading of each is kept."""

    def __init__(self, marker: str, daemon_pid: int):
        self.marker, self.daemon_pid = marker, daemon_pid
        self.seen: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-jobs-readings", daemon=True)

    def __enter__(self):
        self._read()  # the daemon before any job
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            self._read()

    def _read(self) -> None:
        for proc in psutil.process_iter(["pid", "cmdline"]):
            pid, cmdline = proc.info["pid"], proc.info["cmdline"] or []
            if pid != self.daemon_pid and not any(self.marker in a for a in cmdline):
                continue
            try:
                cpu, threads = process_cpu_s(pid), process_threads(pid)
            except psutil.Error:  # it ended between the listing and the reading
                continue
            old = self.seen.get(pid, {})
            self.seen[pid] = {"role": "daemon" if pid == self.daemon_pid else _role(cmdline), "pid": pid,
                              "cpu_s": cpu, "threads": max(threads, old.get("threads", 0))}

    def processes(self) -> list[dict]:
        return sorted(self.seen.values(), key=lambda p: (ROLES.index(p["role"]), p["pid"]))


ROLES = ("daemon", "supervisor", "server", "learner", "other")


def _role(cmdline: list[str]) -> str:
    """What a job's process is, from its command line: its supervisor (`python -m gadei_watchdog`),
    `gadei serve` (the server), `gadei learn` (a learner)."""
    if any("gadei_watchdog" in a for a in cmdline):
        return "supervisor"
    for word, role in (("serve", "server"), ("learn", "learner")):
        if word in cmdline:
            return role
    return "other"


def _threads(processes: list[dict]) -> str:
    """'daemon 5, supervisor 3 (x2), server 4 (x2), learner 2-3 (x4), ...': the most OS threads each
    process had, by role (the range over that role's processes, and how many there were)."""
    roles: dict[str, list[int]] = {}
    for p in processes:
        roles.setdefault(p["role"], []).append(p["threads"])
    return ", ".join(f"{role} {min(n)}{'' if min(n) == max(n) else f'-{max(n)}'}{f' (x{len(n)})' if len(n) > 1 else ''}"
                     for role, n in roles.items())
