"""What the tests share: unique names, data sets, real child processes that are always reaped,
and waits with deadlines (`wait_for`), never fixed sleeps. Import it as `from helpers import
...`; the fixtures that use it are in conftest.py.

A dependency CI installs (the shared data sets, MPI) is `missing()`: the test is skipped with
the reason on a developer's machine, and fails under CI=true, where a skip would hide a
broken install.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from gadei import protocol
from gadei._proc import gadei_command

IN_CI = os.environ.get("CI") == "true"


def missing(what: str):
    """Skip the calling test because `what` is missing; under CI=true, fail it instead."""
    if IN_CI:
        pytest.fail(f"{what}, and CI=true: CI installs it, so this is a broken install, not a skip")
    pytest.skip(what)


HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"


def data_dir() -> Path:
    """The shared data sets: GADEI_DATA_DIR, else ../shared/data next to the repository."""
    return Path(os.environ.get("GADEI_DATA_DIR") or HERE.parent.parent / "shared" / "data")


def trec_job(name: str, output="out", **sections: dict) -> str:
    """The text of a job file that trains the text CNN on TREC (the calling test is skipped
    where TREC is missing); `sections` adds sections, e.g. train={"learners": 2, "lr": 0.05}."""
    trec = data_dir() / "trec"
    if not (trec / "TREC.train").is_file():
        missing(f"TREC is not at {trec} (set GADEI_DATA_DIR)")
    body = {"job": {"name": name, "workload": "textcnn"},
            "data": {"train": str(trec / "TREC.train"), "test": str(trec / "TREC.test"), "format": "trec",
                     "encoding": "latin-1"},
            **sections, "output": {"folder": str(output)}}

    def value(v) -> str:
        return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else repr(v)

    return "\n".join(f"[{section}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in keys.items())
                     for section, keys in body.items())


def small_csv(folder: Path) -> Path:
    """A small text data set, `folder`/train.csv: 40 sentences about cats and dogs (columns text
    and category, the labels alternating): a job file on it (format "csv", label_column
    "category") parses and loads in well under a second. The `small` fixture writes it."""
    rows = [f'"sentence number {i}, about {"dogs" if i % 2 else "cats"}",{"dog" if i % 2 else "cat"}' for i in range(40)]
    path = folder / "train.csv"
    path.write_text("text,category\n" + "\n".join(rows) + "\n")
    return path


def job_processes(*names: str) -> list[psutil.Process]:
    """Live processes (not zombies, not this one) whose command line names one of the jobs
    `names`: a job's `gadei run`, server, watchdog and learners each carry its name (or its
    folder's) in their arguments, whoever their parent is."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        line = " ".join(proc.info["cmdline"] or [])
        if proc.pid != os.getpid() and proc.info["status"] != psutil.STATUS_ZOMBIE and any(n in line for n in names):
            found.append(proc)
    return found


def end_jobs(*names: str, timeout: float = 10, keep_regions: bool = False) -> None:
    """Kill every process of the jobs `names` (`job_processes`: those that are not this test's
    children too, a restarted server, an orphaned learner), wait up to `timeout` s for each
    (and kill again while any is left, up to 6 x `timeout`),
    and remove the jobs' regions (unless `keep_regions`: the test still looks at them): what a
    test leaves behind, whatever it did."""
    from gadei.region import inspect, remove

    deadline = protocol.Deadline(6 * timeout)  # again while any is left: a watchdog killed after its
    while (left := job_processes(*names)) and not deadline.expired():  # server may have started another
        for proc in left:
            try:
                proc.kill()
                proc.wait(timeout)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired):
                pass
    for name in () if keep_regions else names:
        if inspect(name) is not None:
            remove(name)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.01):
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` s
    (`gadei.protocol.wait_for`, the one copy of this loop)."""
    return protocol.wait_for(predicate, timeout, what, interval=interval, error=pytest.fail.Exception)


class Procs:
    """Child processes of one test; `reap()` kills and waits for whatever is left."""

    def __init__(self):
        self.children: list[subprocess.Popen] = []

    def start(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        """`python ARGS...` with this Python."""
        return self.spawn([sys.executable, *map(str, args)], env)

    def spawn(self, argv: list[str], env: dict | None = None, cwd=None) -> subprocess.Popen:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        # One thread per stream drains it: a child never blocks on a full pipe, and lines
        # are handed over through a queue (select() on a buffered pipe misses lines).
        proc.lines = queue.Queue()
        proc.err_lines = []
        proc.readers = [
            threading.Thread(target=_drain, args=(proc.stdout, proc.lines.put), daemon=True),
            threading.Thread(target=_drain, args=(proc.stderr, proc.err_lines.append), daemon=True),
        ]
        for reader in proc.readers:
            reader.start()
        self.children.append(proc)
        return proc

    def worker(self, *args) -> subprocess.Popen:
        return self.start(WORKER, *args)

    def gadei(self, *args, env: dict | None = None, cwd=None) -> subprocess.Popen:
        return self.spawn(gadei_command(*args), env, cwd)

    def reap(self) -> None:
        for proc in self.children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.children:
            proc.wait()
            for reader in proc.readers:
                reader.join(10)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def _drain(stream, put) -> None:
    for line in stream:
        put(line)


def _rest(proc: subprocess.Popen) -> tuple[str, str]:
    """After `proc` exited: what it printed that no read_line took, and all of its stderr."""
    for reader in proc.readers:
        reader.join(10)
    out = []
    while not proc.lines.empty():
        out.append(proc.lines.get())
    return "".join(out), "".join(proc.err_lines)


def communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """Wait up to `timeout` for `proc` to exit; its remaining (stdout, stderr). Fails the test on timeout."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{proc.args} did not finish in {timeout} s:\n{_rest(proc)[1][-3000:]}")
    return _rest(proc)


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    """Wait for `proc` to exit 0 within `timeout`; its (stdout not yet read, stderr)."""
    out, err = communicate(proc, timeout)
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{err[-3000:]}"
    return out, err


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def read_line(proc: subprocess.Popen, timeout: float) -> dict:
    """The next JSON line `proc` prints (its stdout), within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = proc.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            if proc.poll() is not None:
                pytest.fail(f"{proc.args} ended (rc {proc.returncode}) without a line:\n{_rest(proc)[1][-3000:]}")
            pytest.fail(f"{proc.args} printed no line within {timeout} s")
        if line.startswith("{"):
            return json.loads(line)
