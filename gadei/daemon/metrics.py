"""The daemon's figures in the Prometheus text format (`gadei daemon --metrics-port PORT`),
served over HTTP on loopback only (127.0.0.1), with `prometheus_client`: off by default.

Exposed, computed at each scrape from the daemon's job records and the running jobs' regions
(read only), and nothing of a job beyond them (no paths, no data, no settings):

    gadei_daemon_uptime_seconds                 since the daemon started
    gadei_daemon_requests_refused_total         requests answered with an error
    gadei_jobs{state}                           jobs per state: queued, running, done, failed, cancelled
    gadei_job_version{job}                      per running job: the weights' version (updates applied)
    gadei_job_updates_per_second{job}           its updates/s since the scrape before (0 at the first)
    gadei_job_samples_per_second{job}           the same in samples (updates x the job's mini-batch)
    gadei_job_restarts{job}                     times its supervisor restarted its server
    gadei_job_learners_alive{job}               its learners whose process is alive

`prometheus_client` is an optional extra (`pip install 'gadei[prometheus]'`); asking for the
port without it is refused with what to install.
"""

import threading
import time
from pathlib import Path

from ..errors import GadeiError

INSTALL = "pip install 'gadei[prometheus]'"
LOOPBACK = "127.0.0.1"


class MetricsUnavailable(GadeiError):
    """`--metrics-port` without prometheus_client installed."""


def serve(daemon, port: int, states: tuple[str, ...], running: str):
    """Serve `daemon`'s figures on http://127.0.0.1:`port`/metrics from a thread of this
    process; the HTTP server (its `server_port` is the port bound: `port` 0 picks a free one;
    `shutdown()` ends it). `states`: the job states to count, `running` the one of running jobs.

    Raises:
        MetricsUnavailable: prometheus_client is not installed.
        GadeiError: the port cannot be bound.
    """
    try:
        from prometheus_client import start_http_server
        from prometheus_client.registry import CollectorRegistry
    except ImportError:
        raise MetricsUnavailable(f"--metrics-port needs prometheus_client: {INSTALL}") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(daemon, states, running))
    try:
        server, _ = start_http_server(port, addr=LOOPBACK, registry=registry)
    except OSError as err:
        raise GadeiError(f"--metrics-port {port}: cannot serve on {LOOPBACK}:{port}: {err.strerror or err}") from None
    return server


class _Collector:
    """prometheus_client's custom collector: each scrape reads the daemon's state now."""

    def __init__(self, daemon, states: tuple[str, ...], running: str):
        self.daemon, self.states, self.running = daemon, states, running
        self._lock = threading.Lock()  # scrapes may overlap
        self._last: dict[str, tuple[float, int]] = {}  # job -> (monotonic seconds, version) of the scrape before
        self._batch: dict[str, int] = {}  # job -> mini-batch, from its job file as run

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        daemon = self.daemon
        yield GaugeMetricFamily("gadei_daemon_uptime_seconds", "Seconds since the gadei daemon started",
                                value=time.monotonic() - daemon.started)
        yield CounterMetricFamily("gadei_daemon_requests_refused", "Requests the daemon answered with an error",
                                  value=daemon.refused)
        with daemon.lock:
            records = [(r.name, r.state, r.output) for r in daemon.records.values()]
        jobs = GaugeMetricFamily("gadei_jobs", "Jobs the daemon knows, per state", labels=["state"])
        for state in self.states:
            jobs.add_metric([state], sum(1 for _, s, _ in records if s == state))
        yield jobs
        families = {name: GaugeMetricFamily(f"gadei_job_{name}", text, labels=["job"]) for name, text in (
            ("version", "The running job's weights' version (updates applied)"),
            ("updates_per_second", "The running job's updates per second since the scrape before"),
            ("samples_per_second", "The running job's samples per second since the scrape before"),
            ("restarts", "Times the running job's supervisor restarted its server"),
            ("learners_alive", "The running job's learners whose process is alive"))}
        with self._lock:
            running = {name: output for name, state, output in records if state == self.running}
            for name in list(self._last):
                if name not in running:
                    del self._last[name]
            for name, output in sorted(running.items()):
                figures = self._job(name, output)
                if figures is not None:
                    for key, value in figures.items():
                        families[key].add_metric([name], value)
        yield from families.values()

    def _job(self, name: str, output: str) -> dict | None:
        """The running job's figures, or None while it has no region (starting, ending)."""
        from ..region import Region
        from ..status import read

        try:
            with Region.attach(name, readonly=True) as region:
                status = read(region)
        except GadeiError:
            return None
        now = time.monotonic()
        before = self._last.get(name)
        self._last[name] = (now, status.version)
        per_s = 0.0
        if before is not None and status.version >= before[1] and now > before[0]:
            per_s = (status.version - before[1]) / (now - before[0])
        return {"version": status.version, "updates_per_second": per_s,
                "samples_per_second": per_s * self._batch_of(name, output), "restarts": status.restarts,
                "learners_alive": sum(1 for learner in status.learners if learner.alive)}

    def _batch_of(self, name: str, output: str) -> int:
        if name not in self._batch:
            from .. import jobfile

            try:
                self._batch[name] = jobfile.load(Path(output) / "job.toml").train.batch or 0
            except (GadeiError, OSError):
                return 0  # not written yet: the job is starting
        return self._batch[name]
