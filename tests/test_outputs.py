"""A run's outputs (`gadei.outputs`): what result.json and the run's last line say of a
resumed run's time and of a server that refused to start; what accuracy.png shows."""

import json
import os
import signal
import time

import pytest

from gadei import curves, jobfile, outputs
from gadei._proc import gadei_command
from gadei.errors import GadeiError
from helpers import blobs_job, communicate, end_jobs, files_up_to, finish, missing, png_shape, unique_name, wait_for


def test_the_chosen_models_time_is_one_figure_in_every_place_a_user_reads_it(tmp_path, procs):
    """One run to its end: result.json's seconds_to_best, metrics.jsonl's seconds since the
    job's start of the chosen epoch, accuracy.png's chosen line and time axis, and the last
    line's "reached after" are one figure, and "done in" is result.json's seconds (once
    accuracy.png said 5.9 s, result.json 9.8 s and the last line 10 s: three time bases).
    The same for a resumed run: `test_a_resumed_run_says_its_seconds_with_the_runs_it_resumed`."""
    name = unique_name("once")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 3, "patience": 3, "lr": 0.05, "batch": 8})
    try:
        launched = time.time()
        said, _ = finish(procs.gadei("run", path, "--quiet"), 300)
    finally:
        end_jobs(name)
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["finished"] and "seconds_in_all" not in result, result
    assert f"done in {result['seconds']:.0f} s, stopped by cap, chose epoch" in said, said
    _one_time_base(tmp_path / "out", said, tmp_path / "again.png", launched, before=0.0)


@pytest.mark.long  # two runs of the job, one stopped and one resumed: half a minute on 2 cores
def test_a_resumed_run_says_its_seconds_with_the_runs_it_resumed(tmp_path, procs):
    """result.json's `seconds` is this run's; `seconds_in_all` adds the runs it resumed (from
    the stopped run's result.json, which the resumed run replaces), and the last line says both
    (once it said only the resumed part, as if the job had taken that long). The chosen model's
    time is one figure in one time base, seconds since the job's start, in result.json,
    metrics.jsonl, accuracy.png and the last line, for the stopped run and the resumed one
    (`_one_time_base`; once accuracy.png put the resumed run's epochs at seconds since its own
    start, and the first run's at their training seconds added up)."""
    name = unique_name("goon")
    # 30 epochs: the stop sent after the first lands while the job runs (6 ended first on a quick machine)
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 30, "patience": 30, "lr": 0.05},
                     checkpoint={"interval": 1})
    out = tmp_path / "out"
    try:
        launched = time.time()
        run = procs.gadei("run", path, "--quiet")
        wait_for(lambda: outputs.epoch_records(out / outputs.EPOCHS), 180, "the job's first epoch", interval=0.05)
        run.send_signal(signal.SIGTERM)  # `gadei cancel`'s path: checkpoint the progress, then stop
        said, err = communicate(run, 120)
        assert run.returncode == 130 and "stopped after" in said and "with the runs it resumed" not in said, said + err
        assert " INFO " not in said + err, said + err  # its own lines say the checkpoint, not the library's records
        stopped = json.loads((out / "result.json").read_text())
        assert stopped["seconds"] > 0 and "seconds_in_all" not in stopped, stopped
        first = _one_time_base(out, said, tmp_path / "again.png", launched, before=0.0)
        assert f"stopped after {stopped['seconds']:.0f} s" in said, said

        launched = time.time()
        said, _ = finish(procs.gadei("run", path, "--resume", "--quiet"), 300)
        result = json.loads((out / "result.json").read_text())
        assert result["finished"] and result["seconds_in_all"] == round(stopped["seconds"] + result["seconds"], 1)
        assert f"done in {result['seconds']:.0f} s ({result['seconds_in_all']:.0f} s with the runs it resumed)" \
            in said, said
        # the chosen model's time in the same base: the stopped run's, or after its seconds
        if result["version"] == stopped["version"]:
            assert result["seconds_to_best"] == stopped["seconds_to_best"], (result, stopped)
        else:
            assert result["seconds_to_best"] >= stopped["seconds"], (result, stopped)
        both = _one_time_base(out, said, tmp_path / "again.png", launched, before=stopped["seconds"])
        # the stopped run's epochs keep their times; the resumed run's go on after them
        assert all(both[at] == took for at, took in first.items() if at in both), (first, both)
        assert set(both) - set(first), both
        # a real run's records carry samples/s and staleness: accuracy.png has their row too
        assert png_shape(out / "accuracy.png")[:2] == (700, 1000)
    finally:
        end_jobs(name)


def _one_time_base(out, said: str, again, launched: float, before: float) -> dict:
    """The chosen model's time where a user reads it, in one time base (seconds since the job's
    start: the runs before this one, `before` seconds, then from this run's start, which came
    after this test's clock read `launched`): result.json's seconds_to_best, metrics.jsonl's
    seconds_since_start of its epoch, accuracy.png's (the figure of those records with the
    chosen model at that time: drawn again into `again`, it is the same picture) and the last
    line's "reached after" (rounded as it prints). Each epoch's seconds since the start, by its
    evaluation's wall clock."""
    result = json.loads((out / "result.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the chosen epoch's record is of the weights model.pt holds: its test accuracy is result.json's
    assert [(m["version"], m["test_accuracy"]) for m in metrics if m["epoch"] == result["epoch"]] == \
        [(result["version"], result["test_accuracy"])], (metrics, result)
    took = result["seconds_to_best"]
    assert [m["seconds_since_start"] for m in metrics if m["epoch"] == result["epoch"]] == [took], (result, metrics)
    assert f"(validation accuracy {result['validation_accuracy']:.2%}, reached after {took:.0f} s)" in said, said
    times = [m["seconds_since_start"] for m in metrics]
    # accuracy.png: the figure whose time axis is those seconds, its chosen line at `took`
    import matplotlib.pyplot as plt

    fig = curves.figure(metrics, result["job"], (result["epoch"], took))
    by_time = fig.axes[1]
    assert by_time.get_xlabel() == "seconds since the job's start"
    drawn = [list(line.get_xdata()) for line in by_time.lines]
    assert drawn == [times, times, [took, took]], (drawn, times, took)  # validation, test, the chosen line
    plt.close(fig)
    outputs.plot(metrics, again, result["job"], (result["epoch"], took))
    assert again.read_bytes() == (out / "accuracy.png").read_bytes()
    # the time base: the job's start, counting the runs before this one; each epoch not before the
    # one before (to 0.1 s: two quick epochs may share a figure)
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= result.get("seconds_in_all",
                                                                                     result["seconds"]), metrics
    assert result["runs"][-1]["seconds"] == result["seconds"] and result["runs"][-1]["started"] >= launched, result
    for m in metrics:
        if m["evaluated_at"] >= result["runs"][-1]["started"]:  # this run's: after the runs before it
            assert before <= m["seconds_since_start"] <= before + m["evaluated_at"] - launched + 0.1, (before, m)
    return {m["evaluated_at"]: m["seconds_since_start"] for m in metrics}


def test_a_run_resumed_after_a_kill_that_left_no_result_says_nothing_of_the_time_before(tmp_path):
    """A run killed before any process wrote its result.json leaves the job's runs unknown: the
    resumed run keeps none (rather than the older runs' time, which would undercount), and
    neither does a run that is not resumed."""
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    runs = [{"started": 1000.0, "seconds": 20.0}, {"started": 2000.0, "seconds": 30.0}]
    (out / "result.json").write_text(json.dumps({"seconds": 30.0, "seconds_in_all": 50.0, "runs": runs}))
    outputs.forget(out, resume=True)
    assert json.loads((out / outputs.EARLIER).read_text()) == {"runs": runs}
    assert not (out / "result.json").exists()
    outputs.forget(out, resume=True)  # the resumed run was killed: no result.json of it
    assert json.loads((out / outputs.EARLIER).read_text()) == {"runs": None}
    assert outputs.job_seconds(2010.0, outputs._earlier_runs(out)) is None
    (out / "result.json").write_text(json.dumps({"seconds": 30.0, "runs": runs[:1]}))
    outputs.forget(out)
    assert not (out / outputs.EARLIER).exists() and outputs._earlier_runs(out) == []


def test_conclude_writes_the_outputs_of_the_end_its_supervisor_saw(tmp_path):
    """`outputs.conclude`, as a job's supervisor calls it at the end it decided: a job whose
    server died for good is failed with the reason, and metrics.jsonl and result.json (last) are
    written; one stopped as it started is stopped before a model, not failed; one whose every
    learner finished hands back the weights it ended with (no validation: nothing chosen) and is
    done, with the supervisor's note."""
    import torch

    from gadei import checkpoint

    job = jobfile.load(blobs_job(tmp_path, unique_name("concl"), train={"learners": 1, "epochs": 1}))
    out = job.output
    (out / "logs").mkdir(parents=True)
    before = time.time()
    result = outputs.conclude(job, outputs.Ending(3, False, False, "the server died for good"), since=before)
    assert (result["outcome"], result["reason"]) == (outputs.FAILED, "the server died for good"), result
    assert outputs.read_result(out) == result and (out / "metrics.jsonl").exists() and not (out / "model.pt").exists()
    assert result["written_by"] == os.getpid() and 0 <= result["seconds"] <= time.time() - before + 0.1, result
    result = outputs.conclude(job, outputs.Ending(0, False, True), since=before)
    assert (result["outcome"], result["reason"]) == (outputs.STOPPED, "stopped before the job wrote a model")
    from gadei import data
    from gadei_workloads import get

    train, _, _ = data.load_job(job)
    weights = {k: torch.full_like(v, 0.5) for k, v in get(job.workload).build_model(train, 0).state_dict().items()}
    final = checkpoint.save(out / "checkpoints", checkpoint.Checkpoint(job.name, 7, 7, weights))
    result = outputs.conclude(job, outputs.Ending(0, True, True, "the stop came after training ended", str(final)),
                              since=before)
    assert result["outcome"] == outputs.DONE and "the stop came after training ended" in result["reason"], result
    handed = torch.load(out / "model.pt", weights_only=True)
    assert all(torch.equal(handed[k], v) for k, v in weights.items()) and "test_accuracy" in result


def test_a_result_json_that_holds_no_json_object_is_no_result(tmp_path):
    """result.json is read from disk: half of one, or JSON that is not an object (a list, a
    string), is no result; a job that picks its model then says it has chosen none (`gadei
    predict`, `gadei status`), where a list once ended in a traceback."""
    (tmp_path / outputs.ORDER).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / outputs.ORDER).write_text(json.dumps({"order": ["ngram", "textcnn"]}))
    for text in ('{"outcome": "done"', "[1]", '"done"', "", '{"outcome": "done"}'):
        (tmp_path / "result.json").write_text(text)
        assert outputs.read_result(tmp_path) == (None if text != '{"outcome": "done"}' else {"outcome": "done"})
        with pytest.raises(GadeiError, match="has not chosen one"):
            outputs.model_folders(tmp_path)


def test_an_order_json_not_as_gadei_run_writes_it_names_no_candidates(tmp_path):
    """order.json is read from disk: an "order" that is not a list of workloads' names (a
    number, a path that leaves the folder, a string read as its letters) names no candidate
    folder; where a number in it once ended `gadei predict` and `gadei status` in a traceback."""
    (tmp_path / outputs.ORDER).parent.mkdir(parents=True, exist_ok=True)
    for order in ([1, 2], ["../../elsewhere"], "ngram", {"ngram": 1}, None, ["ngram", ""]):
        (tmp_path / outputs.ORDER).write_text(json.dumps({"order": order}))
        assert outputs.candidates(tmp_path) is None, order
        assert outputs.model_folders(tmp_path) == [tmp_path]
    (tmp_path / outputs.ORDER).write_text(json.dumps({"order": ["ngram", "textcnn"]}))
    assert [c.workload for c in outputs.candidates(tmp_path)] == ["ngram", "textcnn"]


def test_outputs_that_cannot_be_written_fail_the_job_in_a_result_json_that_says_which_and_why(tmp_path):
    """A full disk at the job's end: model.pt cannot be written. Its supervisor crashed with
    torch.save's traceback, no result.json, and `gadei run` said only that the supervisor exited
    with code 1. Now result.json alone is written: the job failed, with the file and the reason,
    after the reason the job had already failed for. Files past a size limit fail as on a full
    disk (RLIMIT_FSIZE, in a process of its own); result.json is smaller than the limit."""
    import subprocess
    import sys

    import torch

    from gadei import checkpoint, data
    from gadei_workloads import get

    job = jobfile.load(blobs_job(tmp_path, unique_name("full"), train={"learners": 1, "epochs": 1}))
    (job.output / "logs").mkdir(parents=True)
    train, _, _ = data.load_job(job)
    weights = {k: torch.full_like(v, 0.5) for k, v in get(job.workload).build_model(train, 0).state_dict().items()}
    final = checkpoint.save(job.output / "checkpoints", checkpoint.Checkpoint(job.name, 7, 7, weights))
    assert sum(v.numel() for v in weights.values()) * 4 > 8192
    script = files_up_to(8192) + f"""
import json, sys, time
from gadei import jobfile, outputs
job = jobfile.load({str(job.path)!r})
for code, reason in ((0, ""), (4, "the supervisor gave up on launched learners [0]")):
    ending = outputs.Ending(code, True, False, reason, {str(final)!r})
    print(json.dumps(outputs.conclude(job, ending, since=time.time())))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    why = f"its outputs could not be written: {job.output / 'model.pt'}: File too large"
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["outcome"], r["reason"]) for r in results] == [
        (outputs.FAILED, why), (outputs.FAILED, f"the supervisor gave up on launched learners [0]; {why}")], results
    assert outputs.read_result(job.output) == results[-1] and not (job.output / "model.pt").exists()
    assert "failed: its outputs could not be written" in outputs.summary(job, results[0])


def test_the_test_accuracy_of_the_chosen_model_is_the_one_its_learner_measured(tmp_path):
    """result.json's test accuracy of a model chosen at an epoch's end is the figure the
    evaluating learner reported for that epoch, measured on the same weights (its epoch and
    version match): the job's end does not evaluate it again. Where no record matches (another
    version), model.pt is evaluated."""
    import torch

    from gadei import data, selection
    from gadei_workloads import get

    job = jobfile.load(blobs_job(tmp_path, unique_name("tacc"), train={"learners": 1, "epochs": 2}))
    out = job.output
    (out / "logs").mkdir(parents=True)
    workload = get(job.workload)
    train, _, test = data.load_job(job)
    weights = workload.build_model(train, 0).state_dict()
    kept = selection.Selection.open(out / "checkpoints", patience=3)
    kept.offer(selection.Evaluation(2, 20, 0.7, 0.9, at=time.time()), weights)
    record = {"event": "epoch", "job": job.name, "learner": 0, "epoch": 2, "version": 20, "test_accuracy": 0.123}
    (out / outputs.EPOCHS).write_text(json.dumps(record) + "\n")
    done = outputs.Ending(0, True)
    result = outputs.conclude(job, done, since=time.time())
    assert (result["epoch"], result["test_accuracy"], result["test_samples"]) == (2, 0.123, len(test)), result
    (out / outputs.EPOCHS).write_text(json.dumps({**record, "version": 21}) + "\n")
    model = workload.build_model(train, 0)
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    assert outputs.conclude(job, done, since=time.time())["test_accuracy"] == workload.evaluate(model, test) != 0.123


def test_a_resumed_runs_chosen_model_counts_the_seconds_of_the_runs_it_resumed(tmp_path):
    """result.json's seconds_to_best is in the job's time base, that of its seconds_in_all and
    of metrics.jsonl's seconds_since_start: a resumed run counts the seconds of the runs
    before it, for a best it made itself and for one a run before it made (as that run gave
    it). Once it counted from the resumed run's start (12 s for a model made 62 s into the
    job), and said nothing of a best made before it."""
    import torch

    from gadei import jobfile, selection
    from helpers import small_job

    (tmp_path / "job.toml").write_text(small_job("again") + '\n[output]\nfolder = "out"\n')
    job = jobfile.load(tmp_path / "job.toml", data_files=False)
    out = job.output
    kept = selection.Selection.open(out / "checkpoints", patience=3)
    E = selection.Evaluation
    kept.offer(E(1, 10, 0.7, 0.9, at=1000.0), {"weight": torch.full((3,), 1.0)})
    kept.offer(E(2, 20, 0.8, 0.8, at=1030.5), {"weight": torch.full((3,), 2.0)})
    stopped, done = outputs.Ending(0, False, True), outputs.Ending(0, True)
    first = outputs.hand_back(job, stopped, [{"started": 990.0, "seconds": 0.0}])  # the first run: 990 to 1040
    assert first["seconds_to_best"] == 40.5
    runs = [{"started": 990.0, "seconds": 50.0}]
    (out / "result.json").write_text(json.dumps({**first, "outcome": outputs.STOPPED, "seconds": 50.0, "runs": runs}))
    outputs.forget(out, resume=True)
    runs = outputs._earlier_runs(out) + [{"started": 2000.0, "seconds": 0.0}]
    # resumed at 2000: the model chosen so far is the first run's, 40.5 s into the job
    assert outputs.hand_back(job, done, runs)["seconds_to_best"] == 40.5
    kept.offer(E(3, 30, 0.9, 0.7, at=2012.0), {"weight": torch.full((3,), 3.0)})
    # a better one 12 s into the resumed run: 50 + 12 s into the job
    resumed = outputs.hand_back(job, done, runs)
    assert (resumed["epoch"], resumed["seconds_to_best"]) == (3, 62.0)
    # resumed again (the second run took 30 s): its best, as the second run gave it; one of
    # the third run 5 s in, 85 s into the job
    runs[-1]["seconds"] = 30.0
    (out / "result.json").write_text(json.dumps({**resumed, "seconds": 30.0, "seconds_in_all": 80.0, "runs": runs}))
    outputs.forget(out, resume=True)
    runs = outputs._earlier_runs(out) + [{"started": 3000.0, "seconds": 0.0}]
    assert outputs.hand_back(job, done, runs)["seconds_to_best"] == 62.0
    assert [outputs.job_seconds(at, runs) for at in (1000.0, 2012.0, 3005.0, 980.0)] == [10.0, 62.0, 85.0, None]


def _records(pace: bool) -> list[dict]:
    keys = ("samples_per_s", "staleness_mean", "staleness_max")
    return [{"epoch": e, "validation_accuracy": 0.5 + 0.05 * e, "test_accuracy": 0.5 + 0.04 * e, "epoch_seconds": 2.0,
             "best": e == 2, **({k: v for k, v in zip(keys, (900.0 + e, 1.0 + e / 10, 2 + e))} if pace else {})}
            for e in (1, 2, 3)]



def test_a_server_that_refuses_to_start_says_why_in_result_json_and_the_last_line(tmp_path, procs):
    """`gadei run` where /dev/shm cannot hold the job's region (a container's /dev/shm is 64 MB
    unless `--shm-size` says otherwise; here a tmpfs of 16 KB in a mount namespace of the
    run's own): the server refuses in one line, its stop record says it, and the run's last line
    and result.json say that line, not only "the server exited with code 2"."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        missing("root and unshare (util-linux), for a /dev/shm of the test's own")
    name = unique_name("shmless")
    path = blobs_job(tmp_path, name, train={"learners": 2, "epochs": 1})
    run = procs.spawn(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=16k tmpfs /dev/shm && exec "$@"', "sh",
                       *gadei_command("run", path)])
    out, err = communicate(run, 120)
    assert run.returncode == 1, out + err
    said = (f"the server did not start: job {name!r}: cannot reserve ")
    assert f"gadei run: job {name} failed: {said}" in err and "No space left on device" in err, err
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["outcome"] == "failed" and result["reason"].startswith(said), result

def test_accuracy_png_shows_samples_per_s_and_staleness_in_panels_of_their_own(tmp_path):
    """Records with samples/s and staleness (metrics.jsonl's) get a second row of panels against
    epochs, one for samples/s, one for the staleness's mean and largest, each with its own axis,
    the accuracies' panels as before; records without them (an older run's) keep one row."""
    import matplotlib.pyplot as plt

    fig = curves.figure(_records(pace=True), "job")
    accuracy, by_time, rate, stale = fig.axes
    assert [ax.get_ylabel() for ax in fig.axes] == ["accuracy (%)", "", "samples/s", "versions"]
    assert rate.get_xlabel() == stale.get_xlabel() == accuracy.get_xlabel() == "epoch"
    assert [list(line.get_ydata()) for line in rate.lines] == [[901.0, 902.0, 903.0]]
    assert {line.get_label(): list(line.get_ydata()) for line in stale.lines} == {
        "mean in the epoch": [1.1, 1.2, 1.3], "largest so far": [3, 4, 5]}
    assert accuracy.get_shared_y_axes().joined(accuracy, by_time)
    assert not rate.get_shared_y_axes().joined(rate, stale)
    plt.close(fig)
    fig = curves.figure(_records(pace=False), "job")
    assert [ax.get_ylabel() for ax in fig.axes] == ["accuracy (%)", ""]
    plt.close(fig)
    # the file, accuracy.png: taller with the second row
    outputs.plot(_records(pace=True), tmp_path / "accuracy.png", "job")
    outputs.plot(_records(pace=False), tmp_path / "old.png", "job")
    assert (png_shape(tmp_path / "accuracy.png")[:2] == (700, 1000)
            and png_shape(tmp_path / "old.png")[:2] == (400, 1000))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accuracy.png", "old.png"]  # no temporary file left


def test_accuracy_png_of_a_job_that_picked_its_model_shows_every_candidate_and_the_mean():
    """A job that picked its model (metrics.jsonl has each candidate's epochs, each with its
    "workload"): accuracy.png draws each candidate's validation and test curves in a colour of
    its own, each member's model marked at its epoch and time, and the mean that was handed back
    as its validation and test accuracy across both panels, starred when it was made (it once
    drew the best member's curve alone)."""
    import matplotlib.pyplot as plt

    # staleness as a real auto job's: one candidate's largest far above the rest, from its first epoch
    ngram = [{**r, "workload": "ngram", "seconds_since_start": 1.0 * r["epoch"], "staleness_max": 53}
             for r in _records(pace=True)]
    textcnn = [{**r, "workload": "textcnn", "validation_accuracy": r["validation_accuracy"] - 0.1,
                "seconds_since_start": 10.0 * r["epoch"], "staleness_max": 6} for r in _records(pace=True)]
    mean = {"validation_accuracy": 0.7, "test_accuracy": 0.69, "seconds_to_best": 20.0}
    fig = curves.figure(ngram + textcnn, "job", {"ngram": (3, 3.0), "textcnn": (2, 20.0)}, mean)
    by_epoch, by_time, rate, stale = fig.axes
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in by_epoch.lines}
    assert drawn["ngram: validation"][0] == [1, 2, 3] and drawn["ngram: validation"][1] == pytest.approx([55, 60, 65])
    assert drawn["textcnn: validation"][1] == pytest.approx([45.0, 50.0, 55.0])
    assert drawn["ngram's model: epoch 3"][0] == [3, 3] and drawn["textcnn's model: epoch 2"][0] == [2, 2]
    assert drawn["the mean (chosen): validation 70.0%"][1] == [70.0, 70.0]
    assert drawn["the mean (chosen): test 69.0%"][1] == [69.0, 69.0]
    timed = [list(line.get_xdata()) for line in by_time.lines]
    assert [1.0, 2.0, 3.0] in timed and [10.0, 20.0, 30.0] in timed and [20.0] in timed, timed  # the star: when
    colours = {label: by_epoch.lines[i].get_color() for i, label in enumerate(drawn)}
    assert colours["ngram: validation"] == colours["ngram: test"] != colours["textcnn: validation"]
    assert sorted(line.get_label() for line in rate.lines) == ["ngram", "textcnn"]
    fig.canvas.draw()  # where each legend goes is chosen as it is drawn
    for panel in (by_epoch, rate, stale):  # a legend hides no point of its panel's curves (two once did)
        box = panel.get_legend().get_window_extent()
        hidden = [xy for line in panel.lines if line.get_marker() not in (None, "", "None")
                  for xy in line.get_xydata() if box.contains(*panel.transData.transform(xy))]
        assert not hidden, (panel.get_title(), hidden)
    plt.close(fig)


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
