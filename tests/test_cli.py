"""The `gadei` command end to end: serve, learn, status, stop, clean, with real processes."""

import glob
import json
import os
import re
import shutil
import tempfile

import pytest
import torch

from helpers import (HERE, blobs_job, command_words, communicate, end_jobs, finish, png_shape, read_line, unique_name,
                     wait_for)
from gadei import GadeiError
from gadei.region import inspect


def _status(procs, job):
    out, _ = finish(procs.gadei("status", job, "--json", "--interval", "0.3"))
    return json.loads(out.splitlines()[-1])


def test_serve_learn_status_stop(job, procs):
    server = procs.gadei("serve", job, "--workload", "textcnn", "--data", "generated", "--learners", "2", "--json")
    wait_for(lambda: inspect(job) is not None and inspect(job).state == "running", 60, "the server's region")
    learner = procs.gadei("learn", job, "--data", "generated", "--epochs", "50", "--json")
    wait_for(lambda: any(entry["pushes"] > 20 for entry in _status(procs, job)["learners"]), 60,
             "pushes to show in status")

    status = _status(procs, job)
    assert status["run_state"] == "serving" and status["server_alive"]
    (entry,) = status["learners"]
    assert entry["pid"] == learner.pid and entry["alive"] and entry["state"] == "active"
    assert entry["device"] == "cpu"
    assert entry["applied"] <= entry["pushes"] <= entry["applied"] + 2
    assert status["rates"]["pushes"][str(entry["learner"])] > 0
    assert status["rates"]["bytes"] > 0
    assert sum(entry["stale_hist"]) == entry["applied"]

    out, _ = finish(procs.gadei("status", job, "--interval", "0.2"))
    assert f"job {job}: serving" in out and "pushes/s" in out and str(learner.pid) in out and " cpu " in out

    finish(procs.gadei("stop", job))
    assert inspect(job) is None  # a clean stop unlinks the region
    stopped = json.loads(finish(server)[0].splitlines()[-1])
    out, err = finish(learner)  # the learner saw the stop and left quietly
    assert stopped["event"] == "stopped" and stopped["applied"] > 20


@pytest.mark.long  # a training run of 10-20 s
def test_learn_evaluates_and_reports_epochs(job, procs):
    server = procs.gadei("serve", job, "--params", "0", "--learners", "1")
    _, err = communicate(server, 60)
    assert server.returncode == 2 and "n_params must be a positive integer" in err

    server = procs.gadei("serve", job, "--workload", "textcnn", "--data", "generated:3", "--seed", "3", "--lr", "0.05")
    wait_for(lambda: inspect(job) is not None, 60, "the server's region")
    learner = procs.gadei("learn", job, "--data", "generated:3", "--seed", "3", "--epochs", "2", "--batch", "8",
                          "--eval", "--json", "--pull", "copy")
    first, second = read_line(learner, 120), read_line(learner, 120)
    finish(learner)
    assert [first["epoch"], second["epoch"]] == [1, 2]
    assert second["version"] > first["version"] > 0
    assert second["test_accuracy"] > 2 / 6 and second["loss"] < first["loss"]  # six labels: twice chance
    finish(procs.gadei("stop", job))
    finish(server)


def test_a_learner_with_another_model_is_refused_before_any_step(job, procs):
    server = procs.gadei("serve", job, "--workload", "textcnn", "--data", "generated:1")
    wait_for(lambda: inspect(job) is not None, 60, "the server's region")
    learner = procs.gadei("learn", job, "--data", "generated:2")  # another vocabulary: other shapes
    _, err = communicate(learner, 120)
    assert learner.returncode == 2
    assert f"job '{job}': model has" in err and "region holds" in err
    finish(procs.gadei("stop", job))
    finish(server)


def test_errors_are_one_line_with_exit_status_2(job, procs):
    for args, message in [
        (("stop", job), f"job '{job}' has no region"),
        (("status", job), f"job '{job}' has no region"),
        (("learn", job, "--data", "nosuch:thing"), "nosuch"),
        (("learn", job, "--shard", "3/2"), "--shard '3/2'"),
        (("serve", "bad/name", "--params", "10"), "job name 'bad/name' is not allowed"),
    ]:
        proc = procs.gadei(*args)
        _, err = communicate(proc, 120)
        assert proc.returncode == 2, (args, err)
        assert message in err and "Traceback" not in err, (args, err)


def test_serve_a_model_factory_and_save_the_final_weights(job, procs, tmp_path):
    saved = tmp_path / "final.pt"
    server = procs.gadei("serve", job, "--model", "worker:make_model", "--lr", "0.5", "--save", saved,
                         env={"PYTHONPATH": str(HERE)})
    wait_for(lambda: inspect(job) is not None and inspect(job).state == "running", 60, "the server's region")
    learner = procs.worker("push", job, "--n", 1000, "--value", 1, "--steps", 4)
    finish(learner)
    finish(procs.gadei("stop", job))
    finish(server)
    state = torch.load(saved, weights_only=True)  # plain PyTorch, no pickled code
    assert list(state) == ["weight", "bias"]
    assert state["weight"].shape == (993,) and state["bias"].shape == (7,)
    assert torch.all(state["weight"] == 2.0 - 0.5 * 4) and torch.all(state["bias"] == 0.0)


def test_launched_learners_are_checked_before_anything_starts(job, procs, tmp_path):
    cases = [
        (["--learner", "--epochs 1"], "give --checkpoint-dir"),
        (["--checkpoint-dir", tmp_path, "--no-supervisor", "--learner", "--epochs 1"], "give --checkpoint-dir"),
        (["--checkpoint-dir", tmp_path, "--learner", "--epochs one"], "not arguments of `gadei learn`"),
        (["--checkpoint-dir", tmp_path, "--learner", "--epochs 1 --start-at 5"], "--start-at is the supervisor's"),
        (["--checkpoint-dir", tmp_path, "--learner", "--epochs 'unclosed"], "No closing quotation"),
        (["--checkpoint-dir", tmp_path, "--watch-interval", "0"], "supervisor interval"),
    ]
    for extra, message in cases:
        serve = procs.gadei("serve", job, "--params", 100, *extra)
        _, err = communicate(serve, 60)
        assert serve.returncode == 2 and message in err, (extra, err)
        assert inspect(job) is None


def test_the_runtime_folder_must_be_ours_and_private(tmp_path, monkeypatch):
    import pytest

    from gadei.env import runtime_dir

    folder = tmp_path / "run"
    monkeypatch.setenv("GADEI_RUNTIME_DIR", str(folder))
    assert runtime_dir() == str(folder) and (folder.stat().st_mode & 0o777) == 0o700
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match="others may write"):
        runtime_dir()


def test_clean_removes_a_dead_supervisors_record_once_its_job_is_gone(job, procs, tmp_path):
    env = {"GADEI_RUNTIME_DIR": str(tmp_path / "run")}
    server = procs.gadei("serve", job, "--params", 100, env=env)
    wait_for(lambda: inspect(job) is not None and inspect(job).state == "running", 60, "the server")
    (tmp_path / "run").mkdir(mode=0o700, exist_ok=True)
    state = tmp_path / "run" / f"{job}.supervisor.json"
    state.write_text("{}")
    finish(procs.gadei("clean", job, env=env))
    assert state.exists()  # the job still runs: `gadei status` shows its launched learners by it
    finish(procs.gadei("stop", job))
    finish(server)
    out, _ = finish(procs.gadei("clean", job, "--dry-run", env=env))
    assert "would remove the dead supervisor's record" in out and state.exists()
    finish(procs.gadei("clean", job, env=env))
    assert not state.exists()


def test_clean_removes_the_records_of_servers_that_are_gone_and_keeps_live_ones(tmp_path, monkeypatch, capsys):
    """A server killed with SIGKILL leaves its record (JOB.server.json) in the runtime folder:
    `gadei clean` removes it (after saying so with --dry-run), and keeps the record of a server
    that still runs (`gadei stop` finds that server by it) and of a job not named."""
    import subprocess
    import sys

    from gadei import _proc
    from gadei.cli import main
    from gadei.server_record import save_server_record

    monkeypatch.setenv("GADEI_RUNTIME_DIR", str(tmp_path / "run"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    started = _proc.start_time(dead.pid)
    dead.wait()
    gone, live, other = (f"rec-{os.getpid()}-{what}" for what in ("gone", "live", "other"))
    save_server_record(gone, dead.pid, started)
    save_server_record(live, os.getpid(), _proc.start_time())
    save_server_record(other, dead.pid, started)
    record = {job: tmp_path / "run" / f"{job}.server.json" for job in (gone, live, other)}
    torn = tmp_path / "run" / f"rec-{os.getpid()}-torn.server.json"
    torn.write_text('{"pid": ')

    assert main(["clean", gone, live, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{gone}: would remove the record of server pid {dead.pid}, which is gone" in out, out
    assert all(path.exists() for path in record.values())
    assert main(["clean", gone, live]) == 0
    out = capsys.readouterr().out
    assert f"{gone}: removed the record of server pid {dead.pid}, which is gone" in out, out
    assert not record[gone].exists() and record[live].exists() and record[other].exists() and torn.exists()
    assert main(["clean", f"rec-{os.getpid()}-torn"]) == 0
    assert "removed an unreadable record of a server" in capsys.readouterr().out and not torn.exists()
    assert live not in out.replace(f"{live}: no region", "")


def test_serve_saves_the_final_weights_private_whatever_the_umask(job, tmp_path):
    """`gadei serve --save` writes the weights 0600 under a umask of 022, as `gadei run` writes
    its model.pt (another local user read them); the server's own save, in this process."""
    from gadei.server import Server

    model = torch.nn.Linear(4, 2)
    server = Server(job, model=model, learners=1)
    try:
        old = os.umask(0o022)
        try:
            server.save(str(tmp_path / "final.pt"))
        finally:
            os.umask(old)
    finally:
        server.close()
    assert (tmp_path / "final.pt").stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["final.pt"]  # no temporary file left
    assert torch.equal(torch.load(tmp_path / "final.pt", weights_only=True)["weight"], model.weight.detach())


@pytest.mark.long  # a bench's --quick run: minutes of timing loops
def test_bench_latency_reports_the_idle_pause_against_both_baselines(procs, tmp_path):
    """A smoke run of `gadei bench latency`: every size, push and gap; for each paused row its
    ratio to the copy and update alone, warm and after the same pause (what the pause costs
    any code), and what the pause added to each."""
    out_file = tmp_path / "latency.json"
    out, _ = finish(procs.gadei("bench", "latency", "--quick", "--repeats", "1", "--out", out_file), 300)
    assert "copy and update alone after the same pause" in out
    assert "a cache line's round trip between the first two CPUs, before, between and after the sizes" in out
    latency = json.loads(out_file.read_text())["latency"]
    assert len(latency["cross_cpu_ns"]) == 3 and all(0 < t < 1e5 for t in latency["cross_cpu_ns"])
    assert [(r["size_mb"], r["push"], r["gap_ms"]) for r in latency["rows"]] == [
        (s, p, g) for s in (1, 16) for p in ("publish", "thread") for g in (0.0, 5.0)]
    assert all(r["median_us"] > 0 and r["ratio"] > 0 for r in latency["rows"])
    wake = latency["wake_up"]
    assert [(w["size_mb"], w["push"]) for w in wake] == [(s, p) for s in (1, 16) for p in ("publish", "thread")]
    for w in wake:
        row = next(r for r in latency["rows"]
                   if (r["size_mb"], r["push"], r["gap_ms"]) == (w["size_mb"], w["push"], 5.0))
        assert w["ratio_to_paused"] == row["median_us"] / row["copy_plus_update_after_pause_us"] > 0
        assert w["pause_us"] == row["copy_plus_update_after_pause_us"] - row["copy_plus_update_us"]


def test_a_local_job_removes_its_temporary_log_folder_unless_something_went_wrong(job, tmp_path, monkeypatch):
    """`gadei bench latency` and `gadei demo` start their processes as a LocalJob: every run
    left a folder of logs in /tmp. It is removed on close, and kept (its path logged) when an
    error leaves the job's `with` block or the caller names it to the user (keep_logs)."""
    import tempfile

    from gadei.local import LocalJob

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for case in ("clean", "kept", "error"):
        name = f"{job}-{case}"
        try:
            with LocalJob(name, ["--params", "1000", "--learners", "1"], []) as local:
                local.start_server()
                folder = local.log_dir
                assert folder.parent == tmp_path and (folder / "server.log").exists()
                local.stop()
                local.keep_logs = case == "kept"
                if case == "error":
                    raise RuntimeError("a failure inside the job's block")
        except RuntimeError:
            assert case == "error"
        assert folder.exists() == (case != "clean"), case
        assert inspect(name) is None


def test_gadei_demo_prints_its_own_lines_and_numbers_learners_as_it_launched_them(procs, tmp_path):
    """The library's log records (`gadei.learner INFO ... attached`) went to the terminal among
    the demo's lines, and the evaluating learner, launched first, could print itself as
    learner 1: its records go to its log file now, and it takes entry 0."""
    out, err = finish(procs.gadei("demo", "--epochs", "1", "--batch", "8", cwd=tmp_path), 300)
    assert " INFO " not in err and " INFO " not in out, out + err
    assert re.search(r"^learner 0 epoch 1: loss [\d.]+, .* test accuracy [\d.]+%$", out, re.M), out
    assert out.splitlines()[-1].startswith("gadei demo: done in "), out


def test_a_killed_gadei_demo_leaves_no_process_and_no_region(procs, tmp_path):
    """A `gadei demo` killed by SIGKILL left its server and learners training on, and the
    server then served its region forever: they stop with it now (`_proc.tie_to_parent`)."""
    import psutil

    demo = procs.gadei("demo", "--epochs", "50", cwd=tmp_path)

    def children():
        return [c for c in psutil.Process(demo.pid).children() if "gadei" in " ".join(c.cmdline())]

    wait_for(lambda: len(children()) == 3 or demo.poll() is not None, 120, "the demo's server and two learners")
    started = children()
    name = next(command_words(c)[command_words(c).index("serve") + 1] for c in started if "serve" in command_words(c))
    wait_for(lambda: inspect(name) is not None or demo.poll() is not None, 120, "the demo's region")
    assert demo.poll() is None, communicate(demo, 10)
    demo.kill()
    demo.wait()
    try:
        gone, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
        wait_for(lambda: inspect(name) is None, 10, f"job {name}'s region to be removed")
    finally:
        for proc in started:
            if proc.is_running():
                proc.kill()
        for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"gadei-{name}-*")):  # the logs a killed demo
            shutil.rmtree(folder, ignore_errors=True)  # keeps for its user: not this test's to leave behind


@pytest.mark.long  # a bench's --quick run: minutes of timing loops
def test_bench_kernel_reports_sgd_adagrad_and_adam_against_torch(procs, tmp_path):
    """A smoke run of `gadei bench kernel`: the tables and the JSON hold every size and thread
    count, for both kernels (the figures themselves are for the README, not for a test)."""
    out_file = tmp_path / "kernel.json"
    out, _ = finish(procs.gadei("bench", "kernel", "--quick", "--repeats", "1", "--out", out_file), 300)
    assert "gadei/torch" in out and "torch fused" in out and "kernel: Adam" in out
    kernel = json.loads(out_file.read_text())["kernel"]
    threads = sorted({1, os.cpu_count()})
    for rows, methods in ((kernel["rows"], {"gadei", "plain_c", "torch_add_"}),
                          (kernel["adagrad"], {"gadei", "torch_fused"}),
                          (kernel["adam"], {"gadei", "torch_fused"})):
        assert [(r["size_mb"], r["threads"]) for r in rows] == [(s, t) for s in (1, 16, 64) for t in threads]
        assert all(set(r["gb_per_s"]) == methods and min(r["gb_per_s"].values()) > 0 for r in rows)
    assert "check + update ms" in out
    assert [(r["size_mb"], r["threads"]) for r in kernel["nonfinite_check"]] == [(s, t) for s in (1, 16, 64)
                                                                                for t in threads]
    assert all(r["checked_ms"] > 0 and r["sgd_ms"] > 0 for r in kernel["nonfinite_check"])


@pytest.mark.long  # a bench's --quick run: minutes of training
def test_bench_quality_quick_reports_gadei_and_pytorch_on_trec(procs, tmp_path):
    """A smoke run of `gadei bench quality --quick` of the text CNN (`--runs`: the n-gram workload,
    auto and scikit-learn have tests of their own): a cut of TREC, one seed, one epoch; the
    table and the JSON hold 1 and 2 learners and the PyTorch baseline, each with a test
    accuracy above chance, the chosen epoch and a wall time; its figure drawn beside --out."""
    from helpers import data_dir, missing

    if not (data_dir() / "trec" / "TREC.train").is_file():
        missing("TREC is not there")
    out_file = tmp_path / "quality.json"
    out, _ = finish(procs.gadei("bench", "quality", "--quick", "--out", out_file, "--runs", "gadei-1,gadei-2,pytorch",
                                "--train", "optimizer=adam,lr=0.001",
                                env={**os.environ, "GADEI_DATA_DIR": str(data_dir())}), 900)
    assert ("epoch chosen" in out and "to best s" in out and "pytorch" in out
            and "gadei-2 optimizer=adam,lr=0.001" in out)
    quality = json.loads(out_file.read_text())["quality"]
    candidate = "gadei-2 optimizer=adam,lr=0.001"
    assert set(quality["summary"]) == {"trec"}
    assert set(quality["summary"]["trec"]) == {"gadei-1", "gadei-2", "pytorch", candidate}
    for config, runs in quality["runs"]["trec"].items():
        assert len(runs) == 1 and runs[0]["epoch"] == 1 and runs[0]["wall_seconds"] > 0, config
        assert 0 < runs[0]["seconds_to_best"] <= runs[0]["wall_seconds"], (config, runs[0])
        assert runs[0]["test_accuracy"] > 0.3, (config, runs[0])  # 6 labels: chance is below 0.25
        assert runs[0]["stopped"] == "cap", config
    runs = quality["runs"]["trec"]
    assert (runs["gadei-2"][0]["optimizer"], runs["gadei-2"][0]["lr"]) == ("adagrad", 0.01)  # the defaults
    assert (runs[candidate][0]["optimizer"], runs[candidate][0]["lr"]) == ("adam", 0.001)  # the candidate's, as run
    ratio = runs["gadei-2"][0]["seconds_to_best"] / runs["gadei-1"][0]["seconds_to_best"]
    assert quality["to_best_2_over_1"]["trec"] == pytest.approx(ratio) and f"trec {ratio:.2f}x" in out
    for config in ("gadei-1", "gadei-2"):  # one evaluation (one epoch): the chosen one, with its time
        [evaluation] = runs[config][0]["evaluations"]
        assert evaluation["seconds"] == pytest.approx(runs[config][0]["seconds_to_best"], abs=0.11), runs[config][0]
    assert "time to 1 learner's chosen validation accuracy" in out and "trec" in quality["to_level_2_over_1"]
    assert quality["plot"] == str(tmp_path / "gadei-bench-quality.png")  # beside --out: its accuracies and times
    assert png_shape(tmp_path / "gadei-bench-quality.png")[:2] == (420, 800)


@pytest.mark.soak  # a bench's --quick run: seven TREC jobs under three daemons, 1-2 minutes (left out of CI)
def test_bench_jobs_quick_runs_1_2_and_4_jobs_side_by_side_under_a_daemon_of_its_own(procs, tmp_path):
    """A smoke run of `gadei bench jobs --quick`: the table and the JSON hold 1, 2 and 4 jobs,
    each run with every job's samples, its wall time, the CPU and threads of every process (a
    daemon, and a server and two learners per job); 1 job is 1.00x itself; N jobs ran side by
    side (each started before the first ended); the daemons and servers it started are gone,
    its folder removed, and the user's own state folder (GADEI_STATE_DIR here) untouched."""
    import glob
    import tempfile

    import psutil

    from helpers import data_dir, missing

    if not (data_dir() / "trec" / "TREC.train").is_file():
        missing("TREC is not there")
    out_file, state = tmp_path / "jobs.json", tmp_path / "users-state"
    folders = os.path.join(tempfile.gettempdir(), "gadei-bench-jobs-*")
    before = set(glob.glob(folders))
    out, _ = finish(procs.gadei("bench", "jobs", "--quick", "--repeats", "1", "--out", out_file,
                                env={**os.environ, "GADEI_DATA_DIR": str(data_dir()), "GADEI_STATE_DIR": str(state)}),
                    600)
    assert "against 1 job" in out and "CPU ms/sample" in out and "threads per process" in out
    jobs = json.loads(out_file.read_text())["jobs"]
    records = {r["jobs"]: r for r in jobs["records"]}
    assert sorted(records) == [1, 2, 4]
    assert records[1]["against_one"] == 1.0
    for n, r in records.items():
        [run] = r["runs"]
        assert run["samples"] == n * jobs["samples_per_job"] > 0
        assert r["samples_per_s"] == pytest.approx(run["samples"] / run["seconds"])
        assert len(run["job_seconds"]) == n and 0 < max(run["job_seconds"]) <= run["seconds"] + 1
        roles = [p["role"] for p in run["processes"]]
        assert roles.count("daemon") == 1 and roles.count("server") == n and roles.count("learner") == 2 * n, roles
        assert all(p["threads"] >= 1 and p["cpu_s"] > 0 for p in run["processes"]), run["processes"]
        first_end = min(ended for _, ended in run["started_ended"])
        assert all(started < first_end for started, _ in run["started_ended"]), run["started_ended"]  # side by side
        assert not any(psutil.pid_exists(p["pid"]) for p in run["processes"] if p["role"] in ("daemon", "server")), \
            "a daemon or server of the bench outlived it"
        assert f"{r['samples_per_s']:.0f}" in out
    assert not state.exists()  # the bench's daemons kept to a state folder of their own
    assert set(glob.glob(folders)) <= before  # and removed it
    machine = json.loads(out_file.read_text())["machine"]
    assert machine["usable_cpus"] >= 1 and "OMP_WAIT_POLICY" in machine
    from gadei import cgroup

    # the limits of the bench's cgroup beside the machine's cores (None where there are none)
    assert (machine["cgroup_cpu_quota"], machine["cgroup_memory_limit"]) == (cgroup.cpu_quota(), cgroup.memory_limit())


def test_bench_quality_times_two_learners_to_one_learners_accuracy():
    """The time to the same accuracy: when run two first reached the validation accuracy of
    run one's chosen model, against when run one reached it."""
    from gadei.bench.quality import to_level

    one = {"validation_accuracy": 0.85, "seconds_to_best": 40.0}
    two = {"evaluations": [{"epoch": 1, "validation_accuracy": 0.80, "seconds": 10.0},
                           {"epoch": 2, "validation_accuracy": 0.86, "seconds": 20.0},
                           {"epoch": 3, "validation_accuracy": 0.90, "seconds": 30.0}]}
    assert to_level(one, two) == 0.5  # epoch 2, the first at or above 0.85
    assert to_level({**one, "validation_accuracy": 0.95}, two) is None  # never reached
    assert to_level({"validation_accuracy": 0.85}, two) is None  # a run without the times


def test_bench_quality_refuses_a_candidate_it_cannot_run(procs, tmp_path):
    """--train that is not KEY=VALUE, or that a job file refuses, is said before any run."""
    from gadei.bench.quality import candidates

    assert candidates(["optimizer=adam, lr=0.001"]) == {"gadei-2 optimizer=adam,lr=0.001":
                                                        {"optimizer": '"adam"', "lr": "0.001"}}
    with pytest.raises(ValueError, match="'lr' is not KEY=VALUE"):
        candidates(["optimizer=adam,lr"])
    with pytest.raises(ValueError, match="learners is the bench's own"):
        candidates(["learners=4"])
    from helpers import data_dir

    bench = procs.gadei("bench", "quality", "--quick", "--out", tmp_path / "q.json", "--train", "optimizer=adamw",
                        env={**os.environ, "GADEI_DATA_DIR": str(data_dir())})
    out, err = communicate(bench, 120)
    assert bench.returncode != 0 and "--train: optimizer=adamw: " in err and "pytorch" not in out, (out, err)


def test_status_shows_every_mode_and_optimizer(procs):
    """The status of a job of every mode and optimizer (adagrad, the job files' default, failed
    with "Unknown format code 'g'"), with the sgd options that show; `gadei status JOB` itself
    for an adagrad job."""
    import uuid

    from gadei import status
    from gadei.region import Region
    from gadei.server import Server

    cases = {"async-adagrad": dict(mode="async", optimizer="adagrad"),
             "consistent-adagrad": dict(mode="consistent", optimizer="adagrad"),
             "sync-adagrad": dict(mode="sync", optimizer="adagrad"),
             "async-sgd": dict(mode="async", momentum=0.9, stale_lr=True, stale_bound=8),
             "consistent-sgd": dict(mode="consistent"),
             "sync-sgd": dict(mode="sync", drop_after=5.0),
             "elastic-sgd": dict(mode="elastic", alpha=0.2, tau=3)}
    tag = uuid.uuid4().hex[:8]
    servers = {}
    try:
        for case, options in cases.items():
            servers[case] = Server(f"test-{tag}-{case}", n_params=100, threads=1, **options)
        shown = {}
        for case, server in servers.items():
            with Region.attach(server.region.job, readonly=True) as region:
                shown[case] = status.format_table(status.read(region), None).splitlines()[0]
            assert f"mode {cases[case]['mode']}, lr 0.01" in shown[case], shown[case]
        for case in ("async-adagrad", "consistent-adagrad", "sync-adagrad"):
            assert ", optimizer adagrad" in shown[case], shown[case]
        assert "momentum 0.9, stale_lr on, stale_bound 8;" in shown["async-sgd"], shown["async-sgd"]
        assert "drop_after 5;" in shown["sync-sgd"] and "alpha 0.2, tau 3;" in shown["elastic-sgd"], shown
        out, err = finish(procs.gadei("status", f"test-{tag}-async-adagrad", "--interval", "0.05"))
        assert "mode async, lr 0.01, optimizer adagrad;" in out and "Traceback" not in err, out + err
    finally:
        for server in servers.values():
            server.close()


def _run_folder(tmp_path):
    """A `gadei run` output folder as the run leaves it (job.toml, maps, model.pt of the initial
    weights), for a small CSV data set; (folder, the data file)."""
    from gadei import jobfile
    from gadei.prepare import prepare as _prepare
    from gadei_workloads import get

    data = tmp_path / "data.csv"
    rows = ["text,label"] + [f"how many {w} are there,NUM" for w in ("cats", "dogs", "cars")] + \
        [f"who is the {w},HUM" for w in ("king", "queen", "boss")]
    data.write_text("\n".join(rows) + "\n")
    path = tmp_path / "job.toml"
    path.write_text(f'[job]\nname = "p"\nworkload = "textcnn"\n[data]\ntrain = "{data}"\nformat = "csv"\n'
                    f'holdout = 0.3\n[output]\nfolder = "{tmp_path / "out"}"\n')
    prepared = _prepare(jobfile.load(path), False, None)
    model = get("textcnn").build_model(prepared.train, prepared.job.train.seed)
    torch.save(model.state_dict(), tmp_path / "out" / "model.pt")
    return tmp_path / "out", data


def test_predict_needs_only_the_output_folder_and_names_a_bad_model_file(procs, tmp_path, capsys):
    """A run folder handed to someone else (its training data gone) still predicts; a crafted,
    truncated or random model.pt, or a labels.json that is not a list of labels, is an error that
    names the file, never a traceback."""
    import pickle
    import random

    folder, data = _run_folder(tmp_path)
    data.unlink()
    out, _ = finish(procs.gadei("predict", folder, "how many birds", "--top", 2))
    assert sorted(line.split()[-1] for line in out.splitlines()) == ["HUM", "NUM"], out

    model = folder / "model.pt"
    good = model.read_bytes()

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo owned",))

    crafted = {"global": lambda: torch.save({"x": Evil()}, model),
               "pickle": lambda: model.write_bytes(pickle.dumps(Evil())),
               "truncated": lambda: model.write_bytes(good[: len(good) // 2]),
               **{f"random {seed}": lambda seed=seed: model.write_bytes(random.Random(seed).randbytes(4096))
                  for seed in range(20)},
               "random pickle-ish": lambda: model.write_bytes(b"\x80\x02" + random.Random(1).randbytes(4096)),
               "empty": lambda: model.write_bytes(b""),
               "not tensors": lambda: torch.save({"x": 1}, model),
               "other shapes": lambda: torch.save({"embedding.weight": torch.zeros(2, 2)}, model)}
    from gadei.cli import main

    for case, write in crafted.items():
        write()
        if case == "global":  # a process of its own: nothing it names may run
            predicted = procs.gadei("predict", folder, "how many birds")
            out, err = communicate(predicted, 60)
            code = predicted.returncode
        else:
            code = main(["predict", str(folder), "how many birds"])
            out, err = capsys.readouterr()
        assert code == 2 and "Traceback" not in err and "owned" not in out, (case, err)
        assert f"gadei: error: {model}: " in err and "weights_only" not in err, (case, err)
        if case == "global":
            assert "it names code (" in err and "nothing was run" in err, err
    model.write_bytes(good)
    labels = folder / "labels.json"
    for odd in ("[]", '["HUM"]', '{"a": 1}', '["HUM", 2]'):
        labels.write_text(odd)
        assert main(["predict", str(folder), "how many birds"]) == 2
        assert f"gadei: error: {labels}: not the list of two labels or more `gadei run` wrote" in \
            capsys.readouterr().err, odd


def test_predict_answers_each_of_several_texts_on_a_line_of_its_own(procs, tmp_path, capsys):
    """`gadei predict FOLDER "A" "B"` predicts each text (the model loaded once): a line each,
    the text first, its top labels after it, texts after an option too; one text keeps its
    label-a-line answer, and an option predict does not know gets predict's own usage (it
    got the top-level usage and "unrecognized arguments")."""
    from gadei.cli import main

    folder, _ = _run_folder(tmp_path)
    texts = ["how many birds", "who is the king", "what"]
    out, _ = finish(procs.gadei("predict", folder, texts[0], "--top", 2, *texts[1:]))
    lines = out.splitlines()
    assert [line.partition(": ")[0] for line in lines] == texts, out
    for line in lines:
        labels = [pair.split()[0] for pair in line.partition(": ")[2].split(", ")]
        assert sorted(labels) == ["HUM", "NUM"], out
    assert main(["predict", str(folder), texts[0], "--top", "2"]) == 0
    one = capsys.readouterr().out.splitlines()
    assert len(one) == 2 and sorted(line.split()[-1] for line in one) == ["HUM", "NUM"], one

    # A label or a text that holds a newline (a quoted CSV field may) keeps to its answer's line.
    (folder / "labels.json").write_text(json.dumps(["HUM", "NUM\nnumber"]))
    assert main(["predict", str(folder), "how many\nbirds", "who", "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("how many\\nbirds: "), lines
    assert all("NUM\\nnumber " in line for line in lines), lines
    assert main(["predict", str(folder), "how many birds"]) == 0
    one = capsys.readouterr().out.splitlines()
    assert len(one) == 2 and "NUM\\nnumber" in {line.split()[-1] for line in one}, one

    with pytest.raises(SystemExit) as exit:
        main(["predict", str(folder), "A", "--tpo", "2"])
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert err.startswith("usage: gadei predict [-h] [--top N] [--json] RUN_DIR TEXT [TEXT ...]\n"), err
    assert "gadei predict: error: unrecognized arguments: --tpo 2" in err, err


def test_predict_reads_texts_from_standard_input_and_answers_in_json_lines(tmp_path):
    """`gadei predict FOLDER -` labels the texts of standard input, one a line (a file of texts
    to label had to be spelled out as arguments), answering a line each in input order, or with
    --json a JSON object each (a text may hold ": ", which the plain line cannot tell apart);
    input that is not one text a line is refused naming the line."""
    import subprocess

    from gadei._proc import gadei_command

    folder, _ = _run_folder(tmp_path)
    texts = ["how many birds", 'who: "the king"', "what \u00e9lan", "who is the queen"]

    def predict(data: bytes, *args):
        done = subprocess.run(gadei_command("predict", folder, *args), input=data, capture_output=True, timeout=120)
        return done.returncode, done.stdout.decode(), done.stderr.decode()

    code, out, err = predict(("\ufeff" + "\r\n".join(texts) + "\n").encode(), "-", "--top", "2")
    assert code == 0, err
    assert [line.rpartition(": ")[0] for line in out.splitlines()] == texts, out
    code, out, err = predict("\n".join(texts[1:]).encode(), "how many birds", "-", "--json")
    assert code == 0, err
    answers = [json.loads(line) for line in out.splitlines()]
    assert [answer["text"] for answer in answers] == texts
    for answer in answers:
        probabilities = [label["probability"] for label in answer["labels"]]
        assert sorted(label["label"] for label in answer["labels"]) == ["HUM", "NUM"]
        assert probabilities == sorted(probabilities, reverse=True) and abs(sum(probabilities) - 1) < 1e-4
    for data, message in ((b"who\n\nwhat\n", "standard input: line 2 is blank; give one text a line"),
                          (b"who\nwh\xffat\n",
                           "standard input: line 2 is not UTF-8 (its byte 3, 0xff: invalid start byte)"),
                          (b"", "standard input: no texts; give one a line")):
        code, out, err = predict(data, "-")
        assert (code, out, err) == (2, "", f"gadei: error: {message}\n")


def test_predict_refuses_a_top_below_1_one_string_for_texts_and_a_folder_that_is_no_run(procs, tmp_path):
    """`--top 0` printed nothing with exit 0 and `--top -1` a torch traceback; Python's
    `predict(folder, "a text")` predicted each character of the text. Each is refused with one
    line naming the value, as is a folder that is no run (it named only a missing job file)."""
    from gadei.predict import predict

    folder, _ = _run_folder(tmp_path)
    runs = {top: procs.gadei("predict", folder, "how many birds", "--top", top) for top in (0, -1)}
    runs["elsewhere"] = procs.gadei("predict", tmp_path / "elsewhere", "how many birds")
    for case, run in runs.items():
        out, err = communicate(run, 120)
        assert run.returncode == 2 and out == "" and "Traceback" not in err, (case, out, err)
        assert len(err.strip().splitlines()) == 1, (case, err)
        assert ("is not a `gadei run` output folder: it holds no job.toml" if case == "elsewhere" else
                f"gadei: error: top = {case}: the number of labels to give for each text, 1 or more") in err, err
    with pytest.raises(GadeiError, match=r"texts = 'how many birds': give a list of texts, not one string"):
        predict(str(folder), "how many birds")
    with pytest.raises(GadeiError, match=r"texts: b'how' is bytes; give texts as strings"):
        predict(str(folder), ["who", b"how"])
    for empty in ("", " \t\n"):  # once answered as for the word <unk>, saying nothing
        with pytest.raises(GadeiError, match=r"no words to predict from; give a text"):
            predict(str(folder), ["who", empty])
    assert [len(best) for best in predict(str(folder), ("how many birds", "who"), top=1)] == [1, 1]


def test_a_command_whose_reader_has_gone_stops_quietly():
    """`gadei logs JOB | head -3` printed a BrokenPipeError traceback once head had its lines: a
    command whose stdout is a pipe with no reader left stops with the shell's 141 (128 +
    SIGPIPE) and nothing on stderr, as cat does."""
    import subprocess

    from gadei._proc import gadei_command

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        done = subprocess.run(gadei_command("daemon", "systemd-unit"), stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, ""), done.stderr


@pytest.mark.parametrize("verb", ["run", "predict", "daemon", "submit", "cancel", "logs", "status", "demo", "stop",
                                  "clean"])
def test_the_row_of_docs_cli_md_names_every_flag_of_the_command(verb):
    """docs/cli.md, "every option": each flag of the commands that run, follow and use jobs is
    in its command's row (the daemon's --metrics-port and --timeout, status's --interval and
    demo's seven flags were in their --help alone)."""
    from pathlib import Path

    from gadei.cli import build_parser

    rows = [line for line in (Path(HERE).parent / "docs" / "cli.md").read_text().splitlines() if line.startswith("| `")]
    row = next(row for row in rows if re.search(rf"`gadei {verb}\b", row.split(" | ")[0]))
    flags = [flag for action in build_parser().verbs[verb]._actions for flag in action.option_strings
             if flag.startswith("--") and flag != "--help"]
    assert [flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", row)] == [], row


def test_gadei_demo_refuses_counts_out_of_range_before_anything_starts(procs):
    """`gadei demo --batch 0` started a server and two learners, which failed (`learners exited
    with [2, 2]; their logs are in ...`, exit 1), `--epochs 0` said `done` after 0 updates and
    `--learners 0` started a server that refused its capacity: each is refused as the job
    file's [train] key is, before a process starts; and so are `gadei learn`'s --batch and
    --epochs (a learner of no job: refused before it looks for one)."""
    runs = {("demo", flag): procs.gadei("demo", flag, value) for flag, value in
            (("--batch", 0), ("--epochs", 0), ("--learners", 0))}  # (a broken check lets them start and end)
    runs.update({("learn", flag): procs.gadei("learn", "no-such-job", flag, 0) for flag in ("--batch", "--epochs")})
    for (verb, flag), run in runs.items():
        out, err = communicate(run, 120)
        assert run.returncode == 2 and out == "", (flag, out, err)
        assert f"gadei {verb}: error: argument {flag}: " in err and "is out of range; allowed: 1 to " in err, err


@pytest.mark.parametrize("argv, allowed", [
    (["status", "--interval", "0"], "'0': allowed: a number above 0"),  # was: rates over no time
    (["status", "--interval", "-1"], "'-1': allowed: a number above 0"),  # was: "sleep length must be non-negative"
    (["status", "--interval", "soon"], "'soon' is not a number; allowed: a number above 0"),
    (["stop", "job", "--timeout", "nan"], "'nan': allowed: a number above 0"),
    (["logs", "job", "--lines", "0"], "'0': allowed: an integer from 1"),
    (["daemon", "--max-jobs", "0"], "'0': allowed: an integer from 1"),
    (["daemon", "stop", "--timeout", "-5"], "'-5': allowed: a number above 0"),
    (["bench", "peers", "--repeats", "0"], "'0': allowed: an integer from 1"),
    (["bench", "scaling", "--batches", "2,,32"], "'2,,32': give mini-batch sizes as integers, comma-separated"),
    (["bench", "threads", "--filters", "100,0"], "'100,0': filter counts must be at least 1"),
    (["learn", "job", "--torch-threads", "0"], "'0': allowed: an integer from 1")])
def test_counts_and_seconds_out_of_range_are_refused_saying_what_is_allowed(argv, allowed, capsys):
    from gadei.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"gadei {argv[0]}: error: argument {argv[-2]}: {allowed}" in err, err


@pytest.mark.parametrize("name, value, said", [("GADEI_CORES", "abc", "is not an integer"),
                                               ("GADEI_CORES", "0", "must be at least 1"),
                                               ("GADEI_THREADS", "-2", "must not be negative"),
                                               ("GADEI_SPIN_US", "soon", "is not a number")])
def test_a_bad_environment_variable_is_refused_in_one_line(procs, name, value, said):
    """A GADEI_* variable that is not a count is refused by every command, naming it, before
    anything runs (it was a traceback from the logging's set-up)."""
    status = procs.gadei("status", env={**os.environ, name: value})
    out, err = communicate(status, 60)
    assert status.returncode == 2 and err.strip() == f"gadei: error: environment variable {name}={value!r} {said}", err


def _tiny_job(tmp_path, name: str, extra: str = "") -> "os.PathLike":
    data = tmp_path / "tiny.csv"
    rows = ["text,label"] + [f"how many {w} are there,NUM" for w in ("cats", "dogs", "cars", "ants")] + \
        [f"who is the {w},HUM" for w in ("king", "queen", "boss", "chef")]
    data.write_text("\n".join(rows) + "\n")
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[job]\nname = "{name}"\nworkload = "textcnn"\n[data]\ntrain = "{data}"\nformat = "csv"\n'
                    f'holdout = 0.25\n[train]\nlearners = 1\nepochs = 2\n[checkpoint]\ninterval = 0.5\n'
                    f'[output]\nfolder = "{tmp_path / name}"\n{extra}')
    return path


def _modes(folder) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mode & 0o777 for p in [folder, *folder.rglob("*")]}


def test_run_outputs_are_private_whatever_the_umask(procs, tmp_path, job):
    """Under a umask of 022 the output folder, model, checkpoints, logs and metrics of a run
    are still 0700/0600 (another local user read them all); [output] private = false leaves
    them to the umask."""
    old = os.umask(0o022)
    try:
        run = procs.gadei("run", _tiny_job(tmp_path, job), "--quiet")
        finish(run, 300)
    finally:
        os.umask(old)
    modes = _modes(tmp_path / job)
    for name in ("model.pt", "job.toml", "labels.json", "vocab.json", "metrics.jsonl", "result.json",
                 "logs/server.log", "logs/supervisor.log", "logs/learner-0.log", "logs/epochs.jsonl"):
        assert modes.pop(name) == 0o600, name
    assert any(name.startswith("checkpoints/") for name in modes)
    assert all(mode == (0o700 if (tmp_path / job / name).is_dir() else 0o600) for name, mode in modes.items()), modes

    from gadei import jobfile
    from gadei.prepare import output_modes as _output_modes

    (tmp_path / "open" / "logs").mkdir(parents=True, mode=0o700)
    (tmp_path / "open" / "logs" / "supervisor.log").touch(mode=0o600)  # as an earlier private run left it
    _output_modes(jobfile.load(_tiny_job(tmp_path, "open", "private = false\n")), 0o022)
    assert _modes(tmp_path / "open") == {".": 0o755, "logs": 0o755, "logs/supervisor.log": 0o644}


def test_run_outputs_follow_the_umask_when_the_job_says_private_false(procs, tmp_path, job):
    """[output] private = false leaves every output to the umask, model.pt too where it is the
    weights the job ended with (no validation set: nothing is chosen); `gadei serve --save`
    writes 0600 only for a job that keeps its outputs private."""
    path = _tiny_job(tmp_path, job, "private = false\n")
    path.write_text(path.read_text().replace("holdout = 0.25\n", "holdout = 0.25\nvalidation_holdout = 0\n"))
    old = os.umask(0o022)
    try:
        finish(procs.gadei("run", path, "--quiet"), 300)
    finally:
        os.umask(old)
    modes = _modes(tmp_path / job)
    assert "checkpoints/best.pt" not in modes  # model.pt is the weights the job ended with
    for name in ("model.pt", "result.json", "logs/server.log"):
        assert modes[name] == 0o644, (name, modes)


def test_a_squatted_region_name_is_a_clear_error_naming_its_owner(procs, tmp_path, job):
    """Another user's object, or a symbolic link, in /dev/shm under the job's region name: `gadei
    run` refuses before anything starts and `gadei serve`, `learn` and `status` say whose it is,
    in one line each; a link is never followed."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to make an object of another user")
    path = f"/dev/shm/gadei-{job}"
    target = tmp_path / "target"
    cases = [("object", "belongs to uid 65534 (nobody)"),
             ("link", f"it is a symbolic link (to '{target}') made by uid 65534"),
             ("own link", f"it is a symbolic link (to '{target}') made by uid 0")]
    jobfile = _tiny_job(tmp_path, job)
    try:
        for case, message in cases:
            if case == "object":
                with open(path, "w"):
                    pass
            else:
                os.symlink(target, path)
            os.lchown(path, 0 if case == "own link" else 65534, 0 if case == "own link" else 65534)
            commands = {"object": [("run", jobfile), ("serve", job, "--params", 10), ("status", job)],
                        "link": [("run", jobfile), ("learn", job)],
                        "own link": [("serve", job, "--params", 10)]}[case]
            started = [procs.gadei(*args) for args in commands]
            for args, proc in zip(commands, started):
                out, err = communicate(proc, 120)
                assert "Traceback" not in err, (case, args, err)
                if args[0] == "status":
                    assert proc.returncode == 0 and message in out, (case, out)
                    continue
                assert proc.returncode == 2 and message in err, (case, args, err)
                if args[0] in ("run", "serve"):
                    assert ("cannot be used on this machine" if case != "own link" else "gadei clean --force") in err
            assert not target.exists() and not (tmp_path / job).exists()  # nothing followed the link, nothing ran
            os.unlink(path)
    finally:
        if os.path.lexists(path):
            os.unlink(path)


@pytest.mark.long  # a bench's --quick run: minutes of timing loops
def test_bench_peers_and_scaling_quick(procs, tmp_path):
    """A smoke run of `gadei bench peers scaling --quick` (what CI runs): every peer trains on
    TREC (gadei 1 and 2 learners, plain PyTorch, Hogwild, DDP over gloo, the RPC parameter
    server) and reports samples/s, accuracy, CPU per sample and the ratios; the scaling curve
    and both figures are drawn, each to --plot's name with its benchmark's (the figures
    themselves are for docs/benchmarks.md)."""
    from helpers import data_dir, missing

    trec = data_dir() / "trec"
    if not (trec / "TREC.train").exists():
        missing(f"TREC under {data_dir()}")
    out_file, plot = tmp_path / "peers.json", tmp_path / "scaling.png"
    out, _ = finish(procs.gadei("bench", "peers", "scaling", "--quick", "--repeats", "1", "--data", f"trec:{trec}",
                                "--out", out_file, "--plot", plot), 600)
    assert "RPC parameter server 1 + 2" in out and "DDP gloo 2 processes" in out and "gadei N / this" in out
    assert out.count("a cache line's round trip between the first two CPUs, before and after each run") == 2  # both
    saved = json.loads(out_file.read_text())
    (row,) = saved["peers"]["rows"]
    assert row["batch"] == 4
    methods = row["methods"]
    assert set(methods) == {"plain-1", "gadei-1", "gadei-2", "hogwild-2", "ddp-2", "rpc-2"}
    for name, m in methods.items():
        (run,) = m["runs"]
        assert m["samples_per_s"] > 0 and m["cpu_s_per_sample"] > 0 and 0 < m["test_accuracy"] <= 1, name
        assert 0 < run["samples"] <= 320 + 8, name  # --quick: about 320 samples
        # how near the two CPUs were, before and after the run (a cache line's round trip)
        assert len(run["cross_cpu_ns"]) == 2 and all(0 < t < 1e5 for t in run["cross_cpu_ns"]), name
    # the synchronous peers take equal steps on every rank; the servers' CPU is counted
    assert methods["ddp-2"]["runs"][0]["samples"] == methods["rpc-2"]["runs"][0]["samples"] == 320
    assert methods["gadei-2"]["server_cpu_s"] > 0 and methods["rpc-2"]["server_cpu_s"] > 0
    assert set(row["ratios"]) == {"gadei-1/plain-1", "gadei-2/hogwild-2", "gadei-2/ddp-2", "gadei-2/rpc-2"}
    (curve,) = saved["scaling"]["curves"]
    assert [p["learners"] for p in curve["gadei"]] == [p["learners"] for p in curve["hogwild"]] == [1, 2]
    assert all(0 < p["server_cpu_share"] < 1 for p in curve["gadei"])
    assert set(saved["scaling"]["smallest_batch"]) == {"gadei", "hogwild"}
    for name in ("peers", "scaling"):  # two benchmarks that draw: --plot's name gets each one's
        assert saved[name]["plot"] == str(tmp_path / f"scaling-{name}.png")
    assert png_shape(tmp_path / "scaling-peers.png")[:2] == (352, 560)  # one panel (batch 4), a bar per method
    assert min(png_shape(tmp_path / "scaling-scaling.png")[:2]) > 0  # a PNG that matplotlib reads back


@pytest.mark.soak  # a bench's --quick run: 12 training runs, 40-80 s (left out of CI for its time)
def test_bench_threads_quick(procs, tmp_path):
    """A smoke run of `gadei bench threads --quick --batches 32`: one gadei learner + server and the
    plain PyTorch loop at mini-batch 32 (the bench's default adds 2: the same code, and most of
    the bench's minutes) and the text CNN at 100 and 400 filters per width, each at 1, 2 and 4
    PyTorch threads (4 over-subscribing a 2-core machine), their training processes running with
    those threads as they report them, and training the model of that size; samples/s, CPU per
    sample and the speed-up over one thread in the table and the JSON."""
    from helpers import data_dir, missing

    from gadei.bench.threads import thread_counts

    trec = data_dir() / "trec"
    if not (trec / "TREC.train").exists():
        missing(f"TREC under {data_dir()}")
    out_file = tmp_path / "threads.json"
    out, _ = finish(procs.gadei("bench", "threads", "--quick", "--repeats", "1", "--batches", "32",
                                "--data", f"trec:{trec}", "--out", out_file), 600)
    assert "1 gadei learner + server against the plain PyTorch loop" in out and "gadei / plain" in out, out
    saved = json.loads(out_file.read_text())["threads"]
    counts = thread_counts(len(os.sched_getaffinity(0)))
    assert counts[:3] == [1, 2, 4] and saved["threads"] == counts and saved["batches"] == [32]
    assert saved["filters"] == [100, 400] and "filters (dense MB)" in out and "400 (5.79)" in out, out
    assert [(r["filters"], r["batch"], r["threads"]) for r in saved["rows"]] == \
        [(f, 32, t) for f in (100, 400) for t in counts]
    sizes = {}
    for row in saved["rows"]:
        for kind in ("plain", "gadei"):
            m = row[kind]
            (run,) = m["runs"]
            assert run["torch_threads"] == [row["threads"]], (kind, row["threads"], run["torch_threads"])
            sizes.setdefault(row["filters"], set()).add(run["parameters"])
            assert m["samples_per_s"] > 0 and m["cpu_s_per_sample"] > 0 and run["samples"] >= row["batch"], kind
        assert row["gadei"]["server_cpu_s"] > 0 and row["plain"]["server_cpu_s"] == 0
        assert row["gadei/plain"] == pytest.approx(row["gadei"]["samples_per_s"] / row["plain"]["samples_per_s"])
    assert all(r["plain"]["speedup"] == r["gadei"]["speedup"] == 1 for r in saved["rows"] if r["threads"] == 1)
    (small,), (large,) = sizes[100], sizes[400]  # every run of a size trained the same model
    dense = {f: next(r["dense_mb"] for r in saved["rows"] if r["filters"] == f) for f in (100, 400)}
    assert dense[400] == pytest.approx(4 * dense[100], rel=0.01)
    assert large - small == pytest.approx((dense[400] - dense[100]) * 1e6 / 4)  # the dense part grew, nothing else


def _dies(code: int, after: float = 0.0) -> None:
    import time

    time.sleep(after)
    if code < 0:
        os.kill(os.getpid(), -code)
    raise SystemExit(code)


@pytest.mark.long  # a training run of 10-20 s
def test_a_peer_that_crashes_is_run_again_and_counted_but_gadei_never_is(monkeypatch):
    """A peer's process killed by a signal (torch's gloo sparse allreduce corrupts the heap in
    about 1 in 5 DDP runs at batch 2 here: malloc abort, SIGSEGV) is a PeerCrashed, and the
    run is made again, its crashes counted for the table; an ordinary failure, or any crash of
    gadei, stays the bench's error."""
    import multiprocessing
    import signal

    from gadei.bench import peers

    ctx = multiprocessing.get_context("spawn")
    said = {-signal.SIGSEGV: "was killed by SIGSEGV (signal 11)", 1: "exited with code 1"}
    for code, error in ((-signal.SIGSEGV, peers.PeerCrashed), (1, RuntimeError)):
        proc = ctx.Process(target=_dies, args=(code,))
        proc.start()
        proc.join(60)
        with pytest.raises(error, match=re.escape(said[code])) as raised:
            peers._collect(ctx.Queue(), [proc], 1, 30, "test")
        assert (type(raised.value) is peers.PeerCrashed) == (code < 0)
    # a crash that its peers beat to the exit (they failed on the closed connection first)
    procs = [ctx.Process(target=_dies, args=(1,)), ctx.Process(target=_dies, args=(-signal.SIGSEGV, 3.0))]
    for proc in procs:
        proc.start()
    procs[0].join(60)
    with pytest.raises(peers.PeerCrashed, match=re.escape(said[-signal.SIGSEGV])):
        peers._collect(ctx.Queue(), procs, 2, 30, "test")
    calls, crashing = [], [2]  # how many calls crash

    def run_peer(kind, world, batch, **run):
        calls.append(kind)
        if len(calls) <= crashing[0]:
            raise peers.PeerCrashed(f"bench {kind} {world}: process 1 was killed by SIGABRT (signal 6)")
        return {"samples_per_s": 1.0}

    monkeypatch.setattr(peers, "run_peer", run_peer)
    result = peers._run_surviving_crashes("ddp", 2, 2, seed=0)
    assert len(calls) == 3 and len(result["crashes"]) == 2 and "SIGABRT (signal 6)" in result["crashes"][0]
    assert peers.summarise([{**result, "test_accuracy": 1, "cpu_s_per_sample": 1, "server_cpu_s": 0, "cpu_s": 1,
                             "seconds": 1}])["crashes"] == 2
    calls.clear()
    with pytest.raises(peers.PeerCrashed):
        peers._run_surviving_crashes("gadei", 2, 2, seed=0)
    assert calls == ["gadei"]
    calls.clear()
    crashing[0] = 100
    with pytest.raises(peers.PeerCrashed):
        peers._run_surviving_crashes("ddp", 2, 2, seed=0)
    assert len(calls) == peers.PEER_RETRIES + 1


@pytest.mark.parametrize("nonfinite", ["skip", "stop"])
def test_a_diverging_job_of_serve_and_learn_trains_on_unless_served_with_nonfinite_stop(procs, tmp_path, request,
                                                                                       nonfinite):
    """Stopping on a loss that turns NaN is `gadei run`'s alone: a job of `gadei serve` and
    `gadei learn` that diverges (lr 10 with momentum 0.9, float16 gradients that overflow to inf)
    trains on to its end, the server skipping and counting its non-finite gradients; with the
    server's `--nonfinite stop`, the job fails on the first one and the learner exits 2 with the
    reason. Both commands' --help say so."""
    for command, phrase in (("learn", "A loss that turns NaN or infinite does not stop it"),
                            ("serve", "A training loss that turns NaN or infinite stops a job of `gadei run` alone")):
        helped = " ".join(communicate(procs.gadei(command, "--help"), 60)[0].split())
        assert phrase in helped and "--nonfinite stop" in helped, helped
    name = unique_name("nan")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 2, "batch": 16, "lr": 10, "momentum": 0.9})
    request.addfinalizer(lambda: end_jobs(name))
    # float16 gradients: a diverging step's gradient overflows to inf (16 runs of 16 here; with float32, some runs
    # settled on a huge but finite loss, their ReLUs dead)
    server = procs.gadei("serve", name, "--job-file", path, "--learners", "1", "--nonfinite", nonfinite,
                         "--grad-dtype", "float16")
    wait_for(lambda: (found := inspect(name)) is not None and found.state == "running", 60, "the server's region")
    learner = procs.gadei("learn", name, "--job-file", path, "--json")
    out, err = communicate(learner, 120)
    if nonfinite == "skip":
        assert learner.returncode == 0, err[-3000:]
        epochs = [json.loads(line) for line in out.splitlines() if '"epoch"' in line]
        assert len(epochs) == 2 and epochs[-1]["nonfinite_skipped"] > 0, out  # trained on to its end
        finish(procs.gadei("stop", name), 60)
        communicate(server, 60)
        assert server.returncode == 0
    else:
        assert learner.returncode == 2, out + err[-3000:]
        assert f"job {name!r} failed: " in err and "non-finite value" in err, err  # "1 non-finite value", or values
        assert "(NaN or inf); nonfinite is 'stop'" in err, err
        _, said = communicate(server, 60)
        assert server.returncode == 2 and "lower the learning rate" in said, (server.returncode, said[-3000:])
