"""The `gadei` command end to end: serve, learn, status, stop, clean, with real processes."""

import json
import os

import torch

from conftest import HERE, communicate, finish, read_line, wait_for
from gadei.region import inspect


def _status(procs, job):
    out, _ = finish(procs.gadei("status", job, "--json", "--interval", "0.3"))
    return json.loads(out.splitlines()[-1])


def test_serve_learn_status_stop(job, procs):
    server = procs.gadei("serve", job, "--workload", "textcnn", "--data", "generated", "--learners", "2", "--json")
    wait_for(lambda: inspect(job) is not None and inspect(job).state == "running", 60, "the server's region")
    learner = procs.gadei("learn", job, "--data", "generated", "--epochs", "50", "--json")
    wait_for(lambda: any(l["pushes"] > 20 for l in _status(procs, job)["learners"]), 60, "pushes to show in status")

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
    assert 0.0 <= first["test_accuracy"] <= 1.0 and second["loss"] < first["loss"]
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
        (["--checkpoint-dir", tmp_path, "--no-watchdog", "--learner", "--epochs 1"], "give --checkpoint-dir"),
        (["--checkpoint-dir", tmp_path, "--learner", "--epochs one"], "not arguments of `gadei learn`"),
        (["--checkpoint-dir", tmp_path, "--learner", "--epochs 1 --start-at 5"], "--start-at is the watchdog's"),
        (["--checkpoint-dir", tmp_path, "--learner", "--epochs 'unclosed"], "No closing quotation"),
    ]
    for extra, message in cases:
        serve = procs.gadei("serve", job, "--params", 100, *extra)
        _, err = communicate(serve, 60)
        assert serve.returncode == 2 and message in err, (extra, err)
        assert inspect(job) is None
    adopt = procs.gadei("serve", "--adopt", job)
    _, err = communicate(adopt, 60)
    assert adopt.returncode == 2 and f"job {job!r} has no running server to adopt" in err


def test_the_runtime_folder_must_be_ours_and_private(tmp_path, monkeypatch):
    import pytest

    from gadei.env import runtime_dir

    folder = tmp_path / "run"
    monkeypatch.setenv("GADEI_RUNTIME_DIR", str(folder))
    assert runtime_dir() == str(folder) and (folder.stat().st_mode & 0o777) == 0o700
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match="others may write"):
        runtime_dir()


def test_clean_removes_a_dead_watchdogs_state_once_its_job_is_gone(job, procs, tmp_path):
    env = {"GADEI_RUNTIME_DIR": str(tmp_path / "run")}
    server = procs.gadei("serve", job, "--params", 100, env=env)
    wait_for(lambda: inspect(job) is not None and inspect(job).state == "running", 60, "the server")
    (tmp_path / "run").mkdir(mode=0o700, exist_ok=True)
    state = tmp_path / "run" / f"{job}.watchdog.json"
    state.write_text("{}")
    finish(procs.gadei("clean", job, env=env))
    assert state.exists()  # the job still runs: a new watchdog may adopt it
    finish(procs.gadei("stop", job))
    finish(server)
    out, _ = finish(procs.gadei("clean", job, "--dry-run", env=env))
    assert "would remove the dead watchdog's state" in out and state.exists()
    finish(procs.gadei("clean", job, env=env))
    assert not state.exists()


def test_bench_kernel_reports_sgd_and_adagrad_against_torch(procs, tmp_path):
    """A smoke run of `gadei bench kernel`: the tables and the JSON hold every size and thread
    count, for both kernels (the figures themselves are for the README, not for a test)."""
    out_file = tmp_path / "kernel.json"
    out, _ = finish(procs.gadei("bench", "kernel", "--quick", "--repeats", "1", "--out", out_file), 300)
    assert "gadei/torch" in out and "torch fused" in out
    kernel = json.loads(out_file.read_text())["kernel"]
    threads = sorted({1, os.cpu_count()})
    for rows, methods in ((kernel["rows"], {"gadei", "plain_c", "torch_add_"}), (kernel["adagrad"], {"gadei", "torch_fused"})):
        assert [(r["size_mb"], r["threads"]) for r in rows] == [(s, t) for s in (1, 16, 64) for t in threads]
        assert all(set(r["gb_per_s"]) == methods and min(r["gb_per_s"].values()) > 0 for r in rows)
    assert "check + update ms" in out
    assert [(r["size_mb"], r["threads"]) for r in kernel["nonfinite_check"]] == [(s, t) for s in (1, 16, 64)
                                                                                for t in threads]
    assert all(r["checked_ms"] > 0 and r["sgd_ms"] > 0 for r in kernel["nonfinite_check"])
