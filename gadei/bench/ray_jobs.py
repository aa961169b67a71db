"""Ray Jobs as `gadei bench service` runs them, its peer service: a local Ray head of the
bench's own (`ray.init(address="local")`: a new instance whatever else runs, with its
dashboard, which job submission goes through, and its files in a folder of the bench's),
started and stopped around each run; each job a command submitted through
`ray.job_submission.JobSubmissionClient` with `entrypoint_num_cpus=1`, so that the head runs
as many at once as it has CPUs; each job's status, times and logs as Ray reports them.

Ray is the bench's extra, not gadei's: `pip install 'gadei[bench]'`.
"""

import logging
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

from ..errors import GadeiError
from ..protocol import Deadline

log = logging.getLogger(__name__)

INSTALL = "pip install 'gadei[bench]'"
LOOK_EVERY = 0.1  # seconds between two looks at the jobs waited for
STOP_TIMEOUT = 30.0  # seconds for a job stopped by the bench (it failed) to end


def check_installed() -> None:
    """Raise GadeiError saying what to install where Ray (with its dashboard) is missing."""
    try:
        import ray.job_submission  # noqa: F401
        import ray.dashboard  # noqa: F401
    except ImportError as err:
        raise GadeiError(f"gadei bench service: Ray Jobs need ray with its dashboard (ray[default]), which is not "
                         f"installed ({err}); install it with {INSTALL}, or leave Ray out (--systems without ray)"
                         ) from None


class RayHead:
    """A local Ray head with `cpus` CPUs, from `with` to the end of it; jobs submitted to it and
    waited for. Its files go to a temporary folder of its own, removed after it: one directly in
    the temporary folder (/tmp), since Ray's sockets are made in it and a socket's path may
    not exceed 107 bytes.

        with RayHead(cpus=2) as head:
            ids = [head.submit(command) for command in commands]
            for info in head.wait_ended(ids, timeout=600): ...

    A job not seen to end is stopped when the block ends, then the head is shut down (every
    process it started with it).
    """

    def __init__(self, cpus: int):
        self.cpus = cpus
        self.folder: Path | None = None
        self.client = None
        self.live: list[str] = []

    def __enter__(self) -> "RayHead":
        check_installed()
        import ray
        from ray.job_submission import JobSubmissionClient

        self.folder = Path(tempfile.mkdtemp(prefix="gadei-ray-"))
        taken = signal.getsignal(signal.SIGTERM)  # `gadei bench`'s, which ray.init replaces with its own
        try:  # a stop (SIGTERM: `gadei bench` unwinds) while the head starts shuts down what it started so far
            context = ray.init(address="local", num_cpus=self.cpus, include_dashboard=True,
                               dashboard_port=_free_port(), _temp_dir=str(self.folder), logging_level=logging.WARNING,
                               log_to_driver=False, configure_logging=False)
            self.client = JobSubmissionClient(f"http://{context.dashboard_url}")
        except BaseException:
            self._shutdown()
            raise
        finally:
            if callable(taken):
                signal.signal(signal.SIGTERM, taken)
        return self

    def __exit__(self, *exc) -> None:
        try:
            for job in self.live:
                try:
                    self.client.stop_job(job)
                except Exception as err:  # it ended meanwhile
                    log.info("gadei bench service: Ray job %s: %s", job, err)
            if self.live:
                self.wait_ended(list(self.live), STOP_TIMEOUT)
        except Exception as err:
            log.warning("gadei bench service: Ray jobs did not stop (%s); shutting the head down", err)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def submit(self, entrypoint: str) -> str:
        """Submit `entrypoint` (a shell command) as a job of one CPU; its submission id."""
        job = self.client.submit_job(entrypoint=entrypoint, entrypoint_num_cpus=1)
        self.live.append(job)
        return job

    def wait_ended(self, jobs: list[str], timeout: float) -> list[dict]:
        """Once every one of `jobs` has ended (succeeded, failed or stopped): for each, its
        `job` id, `status`, `message`, `started` and `ended` (wall clock, seconds since 1970, as
        Ray recorded them) and `logs` (its driver's output).

        Raises:
            TimeoutError: some had not ended within `timeout` seconds.
        """
        deadline = Deadline(timeout)
        while True:
            infos = [self.client.get_job_info(job) for job in jobs]
            if all(info.status.is_terminal() for info in infos):
                break
            if deadline.expired():
                raise TimeoutError(f"gadei bench service: {sum(not i.status.is_terminal() for i in infos)} of "
                                   f"{len(jobs)} Ray jobs still pending or running after {timeout:g} s")
            time.sleep(LOOK_EVERY)
        self.live = [j for j in self.live if j not in jobs]
        return [{"job": job, "status": info.status.value, "message": info.message or "",
                 "started": info.start_time / 1e3 if info.start_time else None,
                 "ended": info.end_time / 1e3 if info.end_time else None, "logs": self.client.get_job_logs(job)}
                for job, info in zip(jobs, infos)]


def _free_port() -> int:
    """A TCP port on loopback that nothing listens on now (the dashboard's: Ray's default, 8265,
    may be another user's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

