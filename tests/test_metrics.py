"""The daemon's Prometheus figures (`gadei daemon --metrics-port`), scraped over real HTTP while
its jobs run: jobs per state, a running job's version moving with its updates/s and samples/s,
learners alive; served on loopback only, with no job data beyond the figures; without
prometheus_client the daemon refuses the port and says what to install."""

import os
import re
import urllib.request

import psutil
from prometheus_client.parser import text_string_to_metric_families

from helpers import blobs_job, communicate, daemon_jobs, finish, job_processes, start_daemon, unique_name, wait_for
from gadei.daemon import metrics
from gadei.region import inspect, remove


def _scrape(url: str) -> tuple[str, dict]:
    """The page as text, and its samples: {(name, frozenset(labels)): value}."""
    with urllib.request.urlopen(url, timeout=30) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return text, samples


def _job(tmp_path, name: str):
    folder = tmp_path / name
    folder.mkdir()
    return blobs_job(folder, name, train={"learners": 2, "epochs": 500, "patience": 500, "batch": 4, "lr": 0.01})


def test_a_scrape_shows_the_jobs_and_a_running_jobs_figures_move(tmp_path, procs, daemon_env):
    names = [unique_name("prom"), unique_name("prom")]
    try:
        _scrapes_while_jobs_run(tmp_path, procs, daemon_env, names)
    finally:  # the job runs in a session of its own: a failed check must not leave it running
        for proc in job_processes(*names):
            proc.kill()
        for name in names:
            if inspect(name) is not None:
                remove(name)


def _scrapes_while_jobs_run(tmp_path, procs, env, names):
    daemon = start_daemon(procs, env, "--metrics-port", 0)
    said = re.compile(r"Prometheus metrics on (http://127\.0\.0\.1:(\d+)/metrics)")
    wait_for(lambda: any(said.search(line) for line in daemon.err_lines) or daemon.poll() is not None, 60,
             "the daemon to say where its metrics are")
    url, port = next(said.search(line).groups() for line in daemon.err_lines if said.search(line))
    listening = [c for c in psutil.Process(daemon.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert [(c.laddr.ip, c.laddr.port) for c in listening] == [("127.0.0.1", int(port))]  # loopback only

    _, samples = _scrape(url)
    assert samples["gadei_daemon_uptime_seconds", frozenset()] > 0
    assert all(samples["gadei_jobs", frozenset({("state", s)})] == 0
               for s in ("queued", "running", "done", "failed", "cancelled"))
    refused = samples["gadei_daemon_requests_refused_total", frozenset()]

    running, queued = names
    for name in names:
        finish(procs.gadei("submit", _job(tmp_path, name), env=env))
    bad = procs.gadei("submit", tmp_path / "no-such-job.toml", env=env)
    communicate(bad, 60)
    assert bad.returncode != 0
    wait_for(lambda: daemon_jobs(procs, env)[running]["state"] == "running", 60, "the first job to start")

    job = frozenset({("job", running)})
    seen = []

    def moving() -> bool:
        seen.append(_scrape(url))
        now = seen[-1][1]
        return (len(seen) >= 2 and now.get(("gadei_job_updates_per_second", job), 0) > 0
                and now.get(("gadei_job_learners_alive", job)) == 2)

    wait_for(moving, 180, "a scrape to show the running job's updates/s with both learners alive", interval=1.0)
    text, samples = seen[-1]
    assert samples["gadei_jobs", frozenset({("state", "running")})] == 1
    assert samples["gadei_jobs", frozenset({("state", "queued")})] == 1
    assert samples["gadei_daemon_requests_refused_total", frozenset()] >= refused + 1
    versions = [s.get(("gadei_job_version", job)) for _, s in seen]
    assert versions[-1] > 0 and versions[-1] >= max(v for v in versions if v is not None)
    per_s = samples["gadei_job_updates_per_second", job]
    assert samples["gadei_job_samples_per_second", job] == per_s * 4  # x the job's mini-batch
    assert samples["gadei_job_restarts", job] == 0
    assert ("gadei_job_version", frozenset({("job", queued)})) not in samples  # figures of running jobs only
    assert str(tmp_path) not in text and ".toml" not in text  # no job data beyond the figures

    for name in names:
        finish(procs.gadei("cancel", name, env=env))
    wait_for(lambda: _scrape(url)[1]["gadei_jobs", frozenset({("state", "cancelled")})] == 2, 120,
             "a scrape to show both jobs cancelled")
    wait_for(lambda: all(daemon_jobs(procs, env)[n]["pid"] == 0 for n in names), 120, "the cancelled jobs to end")
    assert not any(name == "gadei_job_version" for name, _ in _scrape(url)[1])
    finish(procs.gadei("daemon", "stop", env=env))
    communicate(daemon, 30)


def test_without_prometheus_client_the_daemon_refuses_the_port_and_says_what_to_install(tmp_path, procs,
                                                                                       daemon_env):
    missing = tmp_path / "no-prometheus" / "prometheus_client"  # shadows the installed package: its import fails
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text('raise ImportError("prometheus_client is not installed (a test)")\n')
    env = {**daemon_env, "PYTHONPATH": os.pathsep.join(filter(None, (str(missing.parent),
                                                                    os.environ.get("PYTHONPATH"))))}
    daemon = procs.gadei("daemon", "--metrics-port", 0, env=env)
    _, err = communicate(daemon, 60)
    assert daemon.returncode == 2 and metrics.INSTALL in err, err
    assert not os.path.exists(os.path.join(daemon_env["GADEI_RUNTIME_DIR"], "daemon.sock"))
