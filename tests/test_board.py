"""TensorBoard (`gadei.board`): a `gadei run` job writes event files that TensorBoard's own
reader reads back, with the values of metrics.jsonl per epoch, the job's figures as it runs
and its settings as hyperparameters; a fresh run drops the event files of the run before;
without TensorBoard the job runs as before and says once what to install."""

import json
import os
import signal

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from helpers import blobs_job, communicate, small_csv, small_job, unique_name, wait_for
from gadei import board


def _events(folder) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: every point
    events.Reload()
    return events


def test_a_run_writes_event_files_tensorboard_reads_with_its_metrics_and_settings(tmp_path, procs):
    """Read while the job runs (the figures every 2 s), then after it stopped (every epoch)."""
    path = blobs_job(tmp_path, unique_name("board"),
                     train={"learners": 2, "epochs": 500, "patience": 500, "lr": 0.05, "batch": 4})
    stale = tmp_path / "out" / "events.out.tfevents.1.stale"  # of a run before, in a folder that holds nothing else
    stale.parent.mkdir()
    stale.write_bytes(b"")
    run = procs.gadei("run", path, "--quiet")
    folder = tmp_path / "out"

    def shown(tag: str, points: int) -> bool:
        events = _events(folder)
        return tag in events.Tags()["scalars"] and len(events.Scalars(tag)) >= points

    wait_for(lambda: shown("job/samples_per_s", 2) and shown("eval/test_accuracy", 2), 180,
             "TensorBoard to show the job's samples/s twice and two epochs while it runs", interval=1.0)
    run.send_signal(signal.SIGTERM)  # gadei cancel's stop: the rest of its epochs are written at the end
    out, err = communicate(run, 180)
    assert run.returncode == 130, out + err
    assert not stale.exists() and len(list(folder.glob("events.out.tfevents.*"))) == 1
    events = _events(folder)
    tags = events.Tags()["scalars"]

    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) >= 2
    for key, tag in board.EPOCH_TAGS.items():
        expected = [(m["epoch"], float(m[key])) for m in metrics if key in m]
        got = [(s.step, s.value) for s in events.Scalars(tag)] if tag in tags else []
        assert [step for step, _ in got] == [step for step, _ in expected], tag
        assert [value for _, value in got] == pytest.approx([value for _, value in expected], rel=1e-6, abs=1e-6), tag
    for tag in ("eval/test_accuracy", "eval/validation_accuracy", "train/loss", "staleness/mean"):
        assert tag in tags, tags

    rates = events.Scalars("job/samples_per_s")  # every 2 s as it ran, at the weights' version
    assert all(r.step > 0 for r in rates) and any(r.value > 0 for r in rates), rates
    assert [r.step for r in rates] == sorted(r.step for r in rates)
    assert {r.value for r in events.Scalars("job/learners_alive")} <= {0.0, 1.0, 2.0}
    assert all(r.value == 0 for r in events.Scalars("job/restarts"))

    start = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(start).session_start_info.hparams
    assert hparams["lr"].number_value == pytest.approx(0.05) and hparams["learners"].number_value == 2
    assert hparams["mode"].string_value == "async" and hparams["workload"].string_value == "mlp"


@pytest.mark.parametrize("picks", [False, True], ids=["mlp", "auto"])
def test_without_tensorboard_a_run_says_once_what_to_install_and_trains_as_before(tmp_path, procs, picks):
    """Once a job: also where it picks its model (each candidate a run of its own, in its
    supervisor), and in words without a second "gadei:" after `gadei run`'s own."""
    missing = tmp_path / "no-tensorboard" / "tensorboard"  # shadows the installed package: its import fails
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text('raise ImportError("tensorboard is not installed (a test)")\n')
    if picks:
        small_csv(tmp_path)
        path = tmp_path / "job.toml"
        path.write_text(small_job(unique_name("noboard")).replace('workload = "textcnn"', 'workload = "auto"')
                        + '\n[train]\nlearners = 1\nepochs = 2\n\n[output]\nfolder = "out"\n')
    else:
        path = blobs_job(tmp_path, unique_name("noboard"), train={"learners": 1, "epochs": 2})
    env = {"PYTHONPATH": os.pathsep.join(filter(None, (str(missing.parent), os.environ.get("PYTHONPATH"))))}
    run = procs.gadei("run", path, "--quiet", env=env)
    out, err = communicate(run, 300)
    assert run.returncode == 0, out + err
    assert err.count(board.INSTALL) == 1 and "gadei run: gadei:" not in err, err
    assert (tmp_path / "out" / "result.json").exists() and not list((tmp_path / "out").glob("events.out.tfevents.*"))
