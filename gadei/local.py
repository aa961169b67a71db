"""A job's server and learners as this process's children, without a supervisor (`LocalJob`):
how `gadei demo`, `gadei bench latency` and `server` and the end-to-end tests run a job. Every
process is `python -m gadei serve|learn ...` (`gadei.launch.spawn`), readiness is polled with a
deadline, the children end with this process (`gadei._proc.TIED_TO`), and `close()` reaps every
child (SIGKILL for whatever did not stop in time)."""

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from . import _proc
from ._proc import gadei_command
from .errors import GadeiError, GadeiTimeout, JobRunning, RegionNotFound
from .launch import spawn, stop_job
from .protocol import Deadline
from .region import Region, inspect, remove

log = logging.getLogger(__name__)

_POLL = 0.02


class LocalJob:
    """A server and its learners as child processes.

    Args:
        job: the job name.
        serve_args: arguments after `gadei serve JOB`.
        learner_args: one list of arguments after `gadei learn JOB` per learner.
        log_dir: where each child's output goes (`server.log`, `learner-<i>.log`); by
            default a temporary folder, which `close()` removes unless `keep_logs` was set
            or an exception leaves the `with` block (then its path is logged).
        env: extra environment variables for the children.
        inherit: learner indices whose standard output goes to this process's stdout (their log
            records still go to their log files: a command's own output is not mixed with them).
    """

    def __init__(self, job: str, serve_args: list[str], learner_args: list[list[str]], *,
                 log_dir: str | None = None, env: dict | None = None, inherit: tuple[int, ...] = ()):
        self.job = job
        self.serve_args = serve_args
        self.learner_args = learner_args
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"gadei-{job}-"))
        self._temporary = log_dir is None
        self.keep_logs = False  # True: close() leaves a temporary log folder (its caller names it to the user)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # its processes stop when this one ends, however it ends (`_proc.tie_to_parent`)
        self.env = {**os.environ, **(env or {}), _proc.TIED_TO: str(os.getpid())}
        self.inherit = inherit
        self.server: subprocess.Popen | None = None
        self.learners: list[subprocess.Popen] = []
        self._files = []

    def _spawn(self, args: list[str], log_name: str, inherit: bool = False) -> subprocess.Popen:
        handle = open(self.log_dir / log_name, "wb")
        self._files.append(handle)
        return spawn(gadei_command(*args), log=handle, session=False, env=self.env, keep_stdout=inherit)

    def log(self, name: str) -> str:
        """The output a child wrote so far (`server` or `learner-<i>`)."""
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def start_server(self, timeout: float = 120.0) -> None:
        """Start the server and wait until its region is published."""
        found = inspect(self.job)
        if found is not None:
            raise JobRunning(f"job {self.job!r} already has a region ({found.state})")
        oom_kills = _proc.oom_kills()
        self.server = self._spawn(["serve", self.job, *self.serve_args], "server.log")
        deadline = Deadline(timeout)
        while True:
            if self.server.poll() is not None:
                how = _proc.how_it_ended(self.server.returncode, oom_kills)
                raise GadeiError(f"job {self.job!r}: the server {how}:\n{self.log('server')[-3000:]}")
            try:
                Region.attach(self.job, readonly=True).close()
                return
            except (RegionNotFound, GadeiTimeout):
                pass
            if deadline.expired():
                raise GadeiTimeout(f"job {self.job!r}: server did not publish its region within {timeout:g} s")
            time.sleep(_POLL)

    def start_learners(self) -> None:
        for i, args in enumerate(self.learner_args):
            self.learners.append(self._spawn(["learn", self.job, *args], f"learner-{i}.log", i in self.inherit))

    def start(self, timeout: float = 120.0) -> "LocalJob":
        self.start_server(timeout)
        self.start_learners()
        return self

    def wait_learners(self, timeout: float) -> list[int]:
        """Wait for every learner to exit; their return codes.

        Raises:
            GadeiTimeout: some learner still runs after `timeout` seconds.
        """
        deadline = Deadline(timeout)
        codes = []
        for i, proc in enumerate(self.learners):
            try:
                codes.append(proc.wait(timeout=deadline.left()))
            except subprocess.TimeoutExpired:
                raise GadeiTimeout(f"job {self.job!r}: learner {i} still runs after {timeout:g} s") from None
        return codes

    def stop(self, timeout: float = 60.0) -> int:
        """Stop the server cleanly (as `gadei stop` does); its return code."""
        if self.server is None:
            return 0
        if self.server.poll() is None:
            stop_job(self.job, timeout)
        try:
            return self.server.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise GadeiTimeout(f"job {self.job!r}: server process did not exit within {timeout:g} s") from None

    def close(self) -> None:
        """Kill whatever still runs, reap every child, close the log files; remove a
        temporary log folder unless `keep_logs`."""
        for proc in [*self.learners, self.server]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in [*self.learners, self.server]:
            if proc is not None:
                proc.wait()
        for handle in self._files:
            handle.close()
        found = inspect(self.job)
        if found is not None and found.state == "leftover":
            remove(self.job)
        if self._temporary and not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "LocalJob":
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None and self._temporary:
            self.keep_logs = True
            log.warning("job %r: its processes' logs are in %s", self.job, self.log_dir)
        self.close()
