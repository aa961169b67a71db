"""A daemon of a bench's own: `gadei daemon` started on a runtime and state folder of the
bench's (the user's daemon and job records are never touched), job files submitted to it
and waited for through `gadei.Client`, and the daemon stopped with whatever it still runs.
`gadei bench jobs` and `gadei bench service` drive gadei's daemon through this, as a user
would: its command line and its client, nothing of its insides."""

import logging
import os
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from .._proc import gadei_command, how_it_ended
from ..protocol import Deadline, wait_for

log = logging.getLogger(__name__)

START_TIMEOUT = 60.0  # seconds for the daemon's socket to appear
STOP_TIMEOUT = 30.0  # seconds for a cancelled job, and then the daemon, to end
LOOK_EVERY = 0.1  # seconds between two looks at the jobs waited for


class BenchDaemon:
    """`gadei daemon FLAGS...` in `folder` (its runtime folder `folder`/run, its state
    `folder`/state, its log `folder`/daemon.log), from `with` to the end of it.

        with BenchDaemon(folder, "--max-jobs", "2", what="gadei bench jobs") as daemon:
            names = [daemon.submit(path) for path in job_files]
            records = daemon.wait_ended(names, timeout=600)

    A job submitted and not seen to end is cancelled when the block ends (the bench failed):
    a daemon's jobs outlive it, so it is not enough to stop the daemon.
    """

    def __init__(self, folder: Path, *flags: str, what: str = "gadei bench"):
        self.folder, self.flags, self.what = Path(folder), flags, what
        self.socket = str(self.folder / "run" / "daemon.sock")
        self.process: subprocess.Popen | None = None
        self.live: list[str] = []  # submitted and not yet seen to end

    @property
    def pid(self) -> int:
        return self.process.pid

    def __enter__(self) -> "BenchDaemon":
        run_dir = self.folder / "run"
        run_dir.mkdir(parents=True, mode=0o700)
        env = {**os.environ, "GADEI_RUNTIME_DIR": str(run_dir), "GADEI_STATE_DIR": str(self.folder / "state")}
        with open(self.folder / "daemon.log", "wb") as daemon_log:
            self.process = subprocess.Popen(gadei_command("daemon", *self.flags), env=env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=daemon_log)
        try:
            wait_for(lambda: os.path.exists(self.socket) or self.process.poll() is not None, START_TIMEOUT,
                     f"{self.what}: the daemon's socket")
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.what}: the daemon {how_it_ended(self.process.returncode)}: "
                                   f"{(self.folder / 'daemon.log').read_text()[-2000:]}")
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def client(self):
        from ..daemon import Client

        return Client(self.socket)

    def submit(self, path: Path) -> str:
        """Queue the job file `path`; its job's name.

        Raises:
            RuntimeError: the daemon refused it (its reason).
        """
        from ..errors import GadeiError

        try:
            name = self.client().submit(path).name
        except GadeiError as err:
            raise RuntimeError(f"{self.what}: the daemon refused {path}: {err}") from None
        self.live.append(name)
        return name

    def wait_ended(self, names: list[str], timeout: float) -> list[dict]:
        """The daemon's records (as dicts) of the jobs `names` once none is queued or running.

        Raises:
            TimeoutError: some were still queued or running after `timeout` seconds.
        """
        deadline = Deadline(timeout)
        while True:
            jobs = [asdict(j) for j in self.client().jobs() if j.name in names]
            if all(j["state"] not in ("queued", "running") for j in jobs):
                self.live = [n for n in self.live if n not in names]
                return jobs
            if deadline.expired():
                raise TimeoutError(f"{self.what}: {sum(j['state'] in ('queued', 'running') for j in jobs)} of "
                                   f"{len(names)} jobs still queued or running after {timeout:g} s")
            time.sleep(LOOK_EVERY)

    def _stop(self) -> None:
        """Cancel the jobs still live, then stop the daemon (killed if it does not answer)."""
        if self.process is None:
            return
        if self.live and self.process.poll() is None:
            from ..errors import DaemonRefused, NoSuchJob

            try:
                for name in self.live:
                    try:
                        self.client().cancel(name)
                    except (DaemonRefused, NoSuchJob):  # it ended meanwhile, or was never queued
                        pass
                self.wait_ended(list(self.live), STOP_TIMEOUT)
            except Exception as err:  # it does not answer: each job is stopped as `gadei stop` does
                log.warning("%s: the daemon did not cancel its jobs (%s); stopping them", self.what, err)
        if self.process.poll() is None:
            try:
                self.client().stop_daemon(timeout=STOP_TIMEOUT)
                self.process.wait(STOP_TIMEOUT)
            except Exception as err:  # it does not answer: it is killed
                log.warning("%s: the daemon did not stop (%s); killing it", self.what, err)
                self.process.kill()
        self.process.wait()
        for name in self.live:  # what a cancel did not end (a daemon that did not answer)
            done = subprocess.run(gadei_command("stop", name, "--timeout", str(STOP_TIMEOUT)),
                                  env={**os.environ, "GADEI_RUNTIME_DIR": str(self.folder / "run")},
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True)
            if done.returncode != 0:  # it had not started, or had ended: nothing to stop
                log.info("%s: job %s: %s", self.what, name, done.stderr.strip()[-500:])
        self.live = []
