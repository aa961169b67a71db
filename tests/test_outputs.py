"""A run's outputs (`gadei.outputs`): what result.json and the run's last line say of a
resumed run's time; what accuracy.png shows."""

import json
import re
import signal

from gadei import outputs
from helpers import blobs_job, communicate, end_jobs, finish, job_version, unique_name, wait_for


def test_a_resumed_run_says_its_seconds_with_the_runs_it_resumed(tmp_path, procs):
    """result.json's `seconds` is this run's; `seconds_in_all` adds the runs it resumed (from
    the stopped run's result.json, which the resumed run replaces), and the last line says both
    (once it said only the resumed part, as if the job had taken that long)."""
    name = unique_name("goon")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 6, "patience": 6, "lr": 0.05},
                     checkpoint={"interval": 1})
    out = tmp_path / "out"
    try:
        run = procs.gadei("run", path, "--quiet")
        wait_for(lambda: job_version(name) >= 300, 180, "the job to make 300 updates", interval=0.05)
        run.send_signal(signal.SIGTERM)  # `gadei cancel`'s path: checkpoint the progress, then stop
        said, err = communicate(run, 120)
        assert run.returncode == 130 and "stopped after" in said and "with the runs it resumed" not in said, said + err
        stopped = json.loads((out / "result.json").read_text())
        assert stopped["seconds"] > 0 and "seconds_in_all" not in stopped, stopped

        said, _ = finish(procs.gadei("run", path, "--resume", "--quiet"), 300)
        result = json.loads((out / "result.json").read_text())
        assert result["finished"] and result["seconds_in_all"] == round(stopped["seconds"] + result["seconds"], 1)
        took = re.search(r"done in (\d+) s \((\d+) s with the runs it resumed\)", said)
        assert took, said
        assert abs(int(took[2]) - int(took[1]) - stopped["seconds"]) <= 1, (said, stopped)
        # a real run's records carry samples/s and staleness: accuracy.png has their row too
        assert _png_shape(out / "accuracy.png")[:2] == (700, 1000)
    finally:
        end_jobs(name)


def test_a_run_resumed_after_a_kill_that_left_no_result_says_nothing_of_the_time_before(tmp_path):
    """A run killed before any process wrote its result.json leaves its time unknown: the
    resumed run keeps none (rather than the older runs' time, which would undercount), and
    neither does a run that is not resumed."""
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "result.json").write_text(json.dumps({"seconds": 30.0, "seconds_in_all": 50.0}))
    outputs.forget(out, resume=True)
    assert json.loads((out / outputs.EARLIER).read_text()) == {"seconds": 50.0}
    assert not (out / "result.json").exists()
    outputs.forget(out, resume=True)  # the resumed run was killed: no result.json of it
    assert not (out / outputs.EARLIER).exists()
    (out / "result.json").write_text(json.dumps({"seconds": 30.0}))
    outputs.forget(out)
    assert not (out / outputs.EARLIER).exists()


def _png_shape(path) -> tuple:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    return matplotlib.image.imread(path).shape


def _records(pace: bool) -> list[dict]:
    keys = ("samples_per_s", "staleness_mean", "staleness_max")
    return [{"epoch": e, "validation_accuracy": 0.5 + 0.05 * e, "test_accuracy": 0.5 + 0.04 * e, "epoch_seconds": 2.0,
             "best": e == 2, **({k: v for k, v in zip(keys, (900.0 + e, 1.0 + e / 10, 2 + e))} if pace else {})}
            for e in (1, 2, 3)]


def test_accuracy_png_shows_samples_per_s_and_staleness_in_panels_of_their_own(tmp_path):
    """Records with samples/s and staleness (metrics.jsonl's) get a second row of panels against
    epochs, one for samples/s, one for the staleness's mean and largest, each with its own axis,
    the accuracies' panels as before; records without them (an older run's) keep one row."""
    import matplotlib.pyplot as plt

    fig = outputs.figure(_records(pace=True), "job")
    accuracy, by_time, rate, stale = fig.axes
    assert [ax.get_ylabel() for ax in fig.axes] == ["accuracy (%)", "", "samples/s", "versions"]
    assert rate.get_xlabel() == stale.get_xlabel() == accuracy.get_xlabel() == "epoch"
    assert [list(line.get_ydata()) for line in rate.lines] == [[901.0, 902.0, 903.0]]
    assert {line.get_label(): list(line.get_ydata()) for line in stale.lines} == {
        "mean in the epoch": [1.1, 1.2, 1.3], "largest so far": [3, 4, 5]}
    assert accuracy.get_shared_y_axes().joined(accuracy, by_time)
    assert not rate.get_shared_y_axes().joined(rate, stale)
    plt.close(fig)
    fig = outputs.figure(_records(pace=False), "job")
    assert [ax.get_ylabel() for ax in fig.axes] == ["accuracy (%)", ""]
    plt.close(fig)
    # the file, accuracy.png: taller with the second row
    outputs.plot(_records(pace=True), tmp_path / "accuracy.png", "job")
    outputs.plot(_records(pace=False), tmp_path / "old.png", "job")
    assert _png_shape(tmp_path / "accuracy.png")[:2] == (700, 1000) and _png_shape(tmp_path / "old.png")[:2] == (400, 1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accuracy.png", "old.png"]  # no temporary file left


def test_staleness_max_is_the_largest_so_far_when_a_learner_leaves():
    """metrics.jsonl's `staleness_max` is the largest staleness of the job's gradients so far, as
    the docs say: a ring owner that leaves takes its own largest with it (it once fell from 9 to
    7 in a real run), and one that pushed nothing in an epoch still counts."""
    from gadei.trainer import _Staleness

    class Fed(_Staleness):  # the region's counters as `status.read` gives them, one snapshot per call
        def __init__(self, snapshots):
            self.snapshots = iter(snapshots)
            super().__init__(region=None)

        def _counts(self):
            return next(self.snapshots)

    staleness = Fed([{}, {(0, 10): (18.0, 6, 9), (1, 11): (4.0, 4, 2)},  # owner (entry, pid): (sum, applied, max)
                     {(1, 11): (10.0, 8, 3)},  # learner 0 left with its 9
                     {(1, 11): (10.0, 8, 3)}])  # nothing applied
    assert staleness.since_last() == {"staleness_mean": 2.2, "staleness_max": 9}
    assert staleness.since_last() == {"staleness_mean": 1.5, "staleness_max": 9}
    assert staleness.since_last() == {"staleness_mean": 0.0, "staleness_max": 9}
