"""Shared test fixtures: unique job names, real child processes that are always reaped.

Tests wait for readiness by polling with a deadline (`wait_for`), never by sleeping a fixed
time, and every region a test's job created is removed at the end even if the test failed.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from gadei._proc import gadei_command
from gadei.region import inspect, remove

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
        pytest.skip(f"TREC is not at {trec} (set GADEI_DATA_DIR)")
    body = {"job": {"name": name, "workload": "textcnn"},
            "data": {"train": str(trec / "TREC.train"), "test": str(trec / "TREC.test"), "format": "trec",
                     "encoding": "latin-1"},
            **sections, "output": {"folder": str(output)}}

    def value(v) -> str:
        return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else repr(v)

    return "\n".join(f"[{section}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in keys.items())
                     for section, keys in body.items())


def wait_for(predicate, timeout: float, what: str, interval: float = 0.01):
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"waited {timeout:g} s for {what}")
        time.sleep(interval)


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


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true",
                     help="also run the long opt-in tests (marked soak: the rest of the fault-injection suite)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: end-to-end training runs of a few minutes (in the default suite; -m 'not slow' skips them)"
    )
    config.addinivalue_line("markers", "soak: long runs, skipped unless --soak is given")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="a long soak run: give --soak to run it")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _runtime_dir(tmp_path_factory):
    """Watchdogs keep their state in GADEI_RUNTIME_DIR, the daemon its job records in
    GADEI_STATE_DIR: the suite's go to folders of its own (every child inherits them), never
    into the user's."""
    folder = tmp_path_factory.mktemp("runtime")
    folder.chmod(0o700)
    saved = {name: os.environ.get(name) for name in ("GADEI_RUNTIME_DIR", "GADEI_STATE_DIR")}
    os.environ["GADEI_RUNTIME_DIR"] = str(folder)
    os.environ["GADEI_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    yield folder
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def job():
    """A job name no other test (or test run) uses; its region is removed afterwards."""
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    yield name
    if inspect(name) is not None:
        remove(name)


@pytest.fixture
def procs():
    children = Procs()
    yield children
    children.reap()
