"""Shared test fixtures: unique job names, real child processes that are always reaped.

Tests wait for readiness by polling with a deadline (`wait_for`), never by sleeping a fixed
time, and every region a test's job created is removed at the end even if the test failed.
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gadei.region import inspect, remove

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"


def data_dir() -> Path:
    """The shared data sets: GADEI_DATA_DIR, else ../shared/data next to the repository."""
    return Path(os.environ.get("GADEI_DATA_DIR") or HERE.parent.parent / "shared" / "data")


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
        proc = subprocess.Popen(
            [sys.executable, *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.children.append(proc)
        return proc

    def worker(self, *args) -> subprocess.Popen:
        return self.start(WORKER, *args)

    def gadei(self, *args, env: dict | None = None) -> subprocess.Popen:
        return self.start("-m", "gadei", *args, env=env)

    def reap(self) -> None:
        for proc in self.children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.children:
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    """Wait for `proc` to exit 0 within `timeout`; its (stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish in {timeout} s:\n{err[-3000:]}")
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{err[-3000:]}"
    return out, err


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def read_line(proc: subprocess.Popen, timeout: float) -> dict:
    """The next JSON line `proc` prints (its stdout), within `timeout` seconds."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                pytest.fail(f"{proc.args} printed no line within {timeout} s")
            line = proc.stdout.readline()
            if not line:
                err = proc.stderr.read() if proc.poll() is not None else ""
                pytest.fail(f"{proc.args} ended (rc {proc.poll()}) without a line:\n{err[-3000:]}")
            if line.startswith("{"):
                return json.loads(line)
    finally:
        sel.close()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: end-to-end training runs of a few minutes (in the default suite; -m 'not slow' skips them)"
    )


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
