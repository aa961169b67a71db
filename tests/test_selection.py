"""Validation-driven training (issue 20): the model selection kept crash safely, the one
decision that ends every learner's schedule, and `gadei run` handing back the best model."""

import dataclasses
import json
import os
import time
import threading

import pytest
import torch

import gadei
from gadei import selection
from gadei.errors import GadeiError
from gadei.layout import TRAIN_ON, TRAIN_STOP_PATIENCE
from helpers import blobs_job, data_dir, end_jobs, finish, missing, trec_job, unique_name, wait_for
from worker import Flat


def _weights(value: float) -> dict:
    return {"weight": torch.full((3,), value)}


def test_the_best_evaluation_is_kept_and_patience_ends_training(tmp_path):
    chosen = selection.Selection.open(tmp_path, patience=2)
    E = selection.Evaluation
    assert chosen.offer(E(1, 10, 0.70, 0.9), _weights(1.0))
    assert chosen.offer(E(2, 20, 0.80, 0.8), _weights(2.0))
    assert not chosen.offer(E(3, 30, 0.80, 0.85), _weights(3.0))  # a tie with a higher loss is no better
    assert chosen.stopped is None and chosen.since_best == 1
    # a restart (a new process) goes on with the same best and the same count
    again = selection.Selection.open(tmp_path, patience=2)
    assert again.best == E(2, 20, 0.80, 0.8) and again.since_best == 1 and again.evaluations == 3
    assert not again.offer(E(4, 40, 0.79, 0.7), _weights(4.0))
    assert again.stopped == "patience"
    assert selection.Selection.open(tmp_path, patience=2).stopped == "patience"
    assert torch.equal(selection.best_weights(tmp_path)["weight"], torch.full((3,), 2.0))
    assert selection.read_state(tmp_path)["best"]["epoch"] == 2


def test_a_tie_with_a_lower_loss_is_kept_and_counts_toward_patience(tmp_path):
    """Patience counts evaluations that did not raise the best validation accuracy (its words
    say so): a tie that lowers the loss becomes the best model, and counts one. Counted as an
    improvement, an easy set's ever lower loss kept its job training to the epoch cap."""
    chosen = selection.Selection.open(tmp_path, patience=2)
    E = selection.Evaluation
    assert chosen.offer(E(1, 10, 1.0, 0.30), _weights(1.0))
    assert chosen.offer(E(2, 20, 1.0, 0.20), _weights(2.0)) and chosen.since_best == 1
    assert chosen.stopped is None
    assert chosen.offer(E(3, 30, 1.0, 0.10), _weights(3.0))
    assert chosen.stopped == "patience" and chosen.best.epoch == 3
    assert torch.equal(selection.best_weights(tmp_path)["weight"], torch.full((3,), 3.0))


def test_evaluations_of_training_the_job_undid_leave_the_patience_count(tmp_path):
    """A job that goes back to an older checkpoint (a restarted supervisor, a resumed run) trains
    some epochs again: their first evaluations no longer count toward patience, so a job whose
    patience is as long as its epochs trains them all. Counted twice, a job of 60 epochs and
    patience 60 that went back two epochs stopped at epoch 59 (the CI dry run of ecea28f)."""
    E = selection.Evaluation
    chosen = selection.Selection.open(tmp_path, patience=3)
    assert chosen.offer(E(1, 10, 1.0, 0.3), _weights(1.0))
    for epoch in (2, 3):
        chosen.offer(E(epoch, epoch * 10, 1.0, 0.3), _weights(epoch))
    assert chosen.since_best == 2
    # the job went back into epoch 2: its evaluations of epochs 2 and 3 are undone
    again = selection.Selection.open(tmp_path, patience=3)
    again.offer(E(2, 21, 1.0, 0.3), _weights(2.1))
    assert again.stopped is None and again.since_best == 1
    assert [h["epoch"] for h in again.history] == [1, 2] and again.history[1]["version"] == 21
    again.offer(E(3, 31, 1.0, 0.3), _weights(3.1))
    assert again.stopped is None
    again.offer(E(4, 41, 1.0, 0.3), _weights(4.1))
    assert again.stopped == "patience" and again.evaluations == 6
    # the best came from undone training: it stays the model, and the count starts again
    fresh = selection.Selection.open(tmp_path / "b", patience=2)
    fresh.offer(E(1, 10, 0.5, 0.9), _weights(1.0))
    fresh.offer(E(2, 20, 0.9, 0.5), _weights(2.0))
    fresh.offer(E(2, 21, 0.8, 0.6), _weights(2.1))
    assert fresh.best.version == 20 and fresh.since_best == 1 and fresh.stopped is None


def test_a_best_model_newer_than_the_state_file_is_believed(tmp_path):
    """A crash between writing best.pt and best.json: the weights' own record wins."""
    chosen = selection.Selection.open(tmp_path, patience=3)
    chosen.offer(selection.Evaluation(1, 10, 0.5, 1.0), _weights(1.0))
    state = (tmp_path / selection.BEST_STATE).read_text()
    chosen.offer(selection.Evaluation(2, 20, 0.6, 0.9), _weights(2.0))
    (tmp_path / selection.BEST_STATE).write_text(state)  # as if the crash came before best.json
    again = selection.Selection.open(tmp_path, patience=3)
    assert again.best.epoch == 2 and again.since_best == 0
    (tmp_path / selection.BEST_STATE).write_text("{not json")
    with pytest.raises(GadeiError, match="not a model selection's state"):
        selection.Selection.open(tmp_path, patience=3)


def test_result_says_how_long_after_the_start_the_chosen_model_was_made(tmp_path):
    """result.json's seconds_to_best: from the job's start to the evaluation that chose the
    model handed back (the time to the final model); none where the job's runs are unknown, or
    for a best kept by a selection older than the evaluations' times (read as before)."""
    from gadei import jobfile, outputs
    from helpers import small_job

    (tmp_path / "job.toml").write_text(small_job("picked") + '\n[output]\nfolder = "out"\n')
    job = jobfile.load(tmp_path / "job.toml", data_files=False)
    folder = job.output / "checkpoints"
    chosen = selection.Selection.open(folder, patience=3)
    E = selection.Evaluation
    chosen.offer(E(1, 10, 0.7, 0.9, at=1000.0), _weights(1.0))
    chosen.offer(E(2, 20, 0.8, 0.8, at=1030.5), _weights(2.0))
    chosen.offer(E(3, 30, 0.7, 0.8, at=1060.0), _weights(3.0))
    done = outputs.Ending(0, True)
    fields = outputs.hand_back(job, done, [{"started": 990.0, "seconds": 0.0}])
    assert (fields["epoch"], fields["seconds_to_best"]) == (2, 40.5)
    # resumed after it, the runs before unknown (killed before writing result.json)
    assert "seconds_to_best" not in outputs.hand_back(job, done, None)
    state = json.loads((folder / selection.BEST_STATE).read_text())
    del state["best"]["at"]
    (folder / selection.BEST_STATE).write_text(json.dumps(state))
    assert selection.Selection.open(folder, patience=3).best.epoch == 2
    fields = outputs.hand_back(job, done, [{"started": 990.0, "seconds": 0.0}])
    assert fields["epoch"] == 2 and "seconds_to_best" not in fields


def test_a_restarted_learners_catch_up_fills_only_an_epoch_its_last_run_did_not_record(tmp_path):
    """Learner 0 killed between an epoch's last step and its record: the restarted one records
    that epoch ("restarted"); metrics.jsonl keeps an epoch's own record where there is one,
    and the selection counts an epoch's evaluation once."""
    from gadei import outputs

    (tmp_path / "logs").mkdir()
    lines = [{"event": "epoch", "learner": 0, "epoch": 1, "loss": 0.5, "validation_accuracy": 0.7},
             {"event": "epoch", "learner": 0, "epoch": 2, "version": 9, "restarted": True, "validation_accuracy": 0.8},
             {"event": "epoch", "learner": 0, "epoch": 1, "version": 5, "restarted": True},
             {"event": "epoch", "learner": 0, "epoch": 3, "loss": 0.3, "validation_accuracy": 0.9}]
    (tmp_path / outputs.EPOCHS).write_text("".join(json.dumps(line) + "\n" for line in lines))
    metrics = outputs.write_metrics(tmp_path)
    assert [m["epoch"] for m in metrics] == [1, 2, 3]
    assert metrics[0]["loss"] == 0.5 and "restarted" not in metrics[0]  # epoch 1's own record stays
    assert metrics[1]["restarted"] and metrics[1]["validation_accuracy"] == 0.8  # epoch 2 had none
    chosen = selection.Selection.open(tmp_path / "sel", patience=3)
    chosen.offer(selection.Evaluation(1, 10, 0.7, 0.9), _weights(1.0))
    assert chosen.evaluated(1) and not chosen.evaluated(2)
    assert selection.Selection.open(tmp_path / "sel", patience=3).evaluated(1)


@pytest.mark.parametrize("into, counted", [(0, False), (40, False), (40, True)],
                         ids=["at-the-epochs-end", "within-the-next-epoch", "counted-not-recorded"])
def test_a_restarted_evaluating_learner_evaluates_the_epoch_its_last_run_did_not(procs, tmp_path, into, counted):
    """Learner 0 killed after epoch 1's last step, before its evaluation of epoch 1 was made (the
    evaluation runs on a thread while it trains on, so a restart `into` samples into epoch 2 can
    find it unmade too): the restarted learner (`--start-at`, as its supervisor starts it)
    evaluates epoch 1 first, in a record that says "restarted", and the selection holds it. Killed
    between the selection's count of it and its record (`counted`), the record is made from the
    count, which is not made twice."""
    from gadei.data import load_job
    from gadei import jobfile

    name = unique_name("catch-up")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 2, "batch": 8, "lr": 0.05})
    train, _, _ = load_job(jobfile.load(path))
    records, best = tmp_path / "epochs.jsonl", tmp_path / "best"
    made = selection.Evaluation(epoch=1, version=7, validation_accuracy=0.25, validation_loss=2.5, at=1.0e9)
    if counted:
        selection.Selection.open(best, patience=3).offer(made, {})
    server = procs.gadei("serve", name, "--job-file", path, "--learners", "1")
    try:
        learner = procs.gadei("learn", name, "--job-file", path, "--json", "--entry", "0", "--eval", "--validate",
                              "--best", best, "--records", records, "--start-at", len(train) + into)
        finish(learner, 120)
        finish(procs.gadei("stop", name), 60)
        finish(server, 60)
    finally:
        end_jobs(name)
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    epochs = [line for line in lines if line["event"] == "epoch"]
    assert [(e["epoch"], e.get("restarted", False)) for e in epochs] == [(1, True), (2, False)], lines
    assert all("validation_accuracy" in e and "test_accuracy" in e for e in epochs), epochs
    history = json.loads((best / selection.BEST_STATE).read_text())["history"]
    assert [h["epoch"] for h in history] == [1, 2], history
    if counted:
        assert history[0] == dataclasses.asdict(made), history
        assert (epochs[0]["validation_accuracy"], epochs[0]["validation_loss"], epochs[0]["evaluated_at"]) == \
            (0.25, 2.5, 1.0e9), epochs[0]


def test_large_data_sets_are_evaluated_within_an_epoch_too():
    """Above EVALUATE_SAMPLES training samples the evaluating learner evaluates every
    EVALUATE_SAMPLES of the job's samples (its shard's share), besides each epoch's end."""
    from gadei.trainer import _Chooser

    chooser = _Chooser(None, None, None, None, every=100)
    due = [position for position in range(0, 450, 4) if chooser.due(position, per_epoch=450)]
    assert due == [100, 200, 300, 400]
    chooser.new_epoch()
    assert chooser.due(100, per_epoch=450) and not chooser.due(448, per_epoch=300)  # the epoch's end is its own
    assert not any(_Chooser(None, None, None, None).due(p, 450) for p in range(450))  # small data: epochs only


def test_one_learners_decision_ends_every_learners_training(job):
    """The evaluating learner decides once (the first decision stands); every learner of the
    job sees it between steps."""
    server = gadei.Server(job, model=Flat(64, 0.0), lr=0.1)
    thread = threading.Thread(target=server.serve, kwargs={"grace": 2.0}, daemon=True)
    thread.start()
    try:
        with gadei.Learner(Flat(64, 0.0), job) as deciding, gadei.Learner(Flat(64, 0.0), job) as other:
            for learner in (deciding, other):
                for p in learner.model.parameters():
                    p.grad.fill_(1.0)
                learner.step()
            assert deciding.training_ended == other.training_ended == TRAIN_ON
            assert wait_for(lambda: server.version >= 2, 10, "both gradients applied")
            deciding.refresh()
            assert deciding.end_training(TRAIN_STOP_PATIENCE)
            assert not other.end_training(TRAIN_STOP_PATIENCE + 1)  # decided already
            assert wait_for(lambda: other.training_ended == TRAIN_STOP_PATIENCE, 10, "the other learner to see it")
            assert server.region.header.get("train_stop_version") == 2
    finally:
        server.request_stop()
        thread.join(30)
        server.close()


def test_the_log_says_in_words_why_patience_ended_training(procs, tmp_path):
    """The evaluating learner's log and result.json say why training ended in words: patience
    ran out, and for how many evaluations (once the log said "reason 1", the header's code).
    The small job reaches 100% validation accuracy within a few epochs: patience 1 ends it."""
    name = unique_name("words")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 20, "patience": 1, "lr": 0.05})
    try:
        finish(procs.gadei("run", path, "--quiet"), 300)
    finally:
        end_jobs(name)
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["stopped"] == "patience", result
    words = "patience ran out: the validation accuracy did not improve for 1 evaluation"
    log = (tmp_path / "out" / "logs" / "learner-0.log").read_text()
    ended = [line for line in log.splitlines() if "ended the job's training" in line]
    assert len(ended) == 1 and ended[0].endswith(": " + words), ended
    assert result["reason"] == words, result
    # the evaluation that decided ran while learner 0 trained on: nothing it trained after the
    # decision was evaluated, offered to the selection or reported
    history = json.loads((tmp_path / "out" / "checkpoints" / selection.BEST_STATE).read_text())["history"]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [h["epoch"] for h in history] == list(range(1, len(history) + 1)), \
        (metrics, history)


def test_an_evaluation_that_fails_on_its_thread_fails_the_learner(tmp_path):
    """The evaluating learner evaluates on a thread of its own while it trains on; what that
    evaluation raises (here: best.pt cannot be written, a folder is in its place) is raised on
    the learner's own thread when it next waits for an evaluation, as it was when it evaluated
    in line, so the learner fails (and its supervisor restarts it) rather than train on unchosen."""
    (tmp_path / "best" / selection.BEST_MODEL).mkdir(parents=True)
    chooser, model = _chooser(tmp_path, "failing")
    reported = []
    chooser.later(_Attached(), model.state_dict(), 1, {"epoch": 1}, reported.append)
    with pytest.raises(GadeiError, match="cannot write .*best.pt: Is a directory"):
        chooser.wait()
    assert reported == []
    chooser.wait()  # raised once


def _chooser(tmp_path, name: str, monkeypatch=None, slow: float = 0.0):
    """The evaluating learner's `_Chooser` of a small job (its model, in eval mode), keeping the
    best in tmp_path/best; `slow`: seconds each offer to the selection takes first (a large
    model's best.pt)."""
    from gadei import jobfile
    from gadei.data import load_job
    from gadei.trainer import _Chooser
    from gadei_workloads import get

    job = jobfile.load(blobs_job(tmp_path, unique_name(name)))
    workload = get(job.workload)
    train, validation, _ = load_job(job)
    model = workload.build_model(train, 0)
    model.eval()
    if slow:
        offer = selection.Selection.offer

        def slowly(self, evaluation, weights):
            time.sleep(slow)
            return offer(self, evaluation, weights)

        monkeypatch.setattr(selection.Selection, "offer", slowly)
    return _Chooser(workload, validation, model, selection.Selection.open(tmp_path / "best", 3)), model


class _Attached:
    """What `_Chooser` uses of the learner whose weights it evaluates: its version, its beat."""

    version = 7

    def __init__(self):
        self.beats = []

    def beat(self):
        self.beats.append(time.monotonic())


def test_the_evaluating_learner_beats_while_it_waits_for_a_slow_evaluation(tmp_path, monkeypatch):
    """An evaluation that takes a while (a large model's best.pt: 1.2 GB took 11 s to write)
    does not make the learner that waits for it look hung to its supervisor (no beat for
    `interval * max_missed`, 10 s by default): it beats at least every second while it waits."""
    chooser, model = _chooser(tmp_path, "slow", monkeypatch, slow=3.5)
    learner, reported = _Attached(), []
    chooser.later(learner, model.state_dict(), 1, {"epoch": 1}, reported.append)
    waited = time.monotonic()
    chooser.wait()
    beats = [waited, *learner.beats]
    assert len(reported) == 1 and (tmp_path / "best" / selection.BEST_MODEL).is_file()
    assert time.monotonic() - waited >= 3, "the evaluation was not slow: the test proves nothing"
    assert len(learner.beats) >= 3 and max(b - a for a, b in zip(beats, beats[1:])) < 2.0, beats


def test_a_stop_during_an_evaluation_waits_for_it_so_the_metrics_hold_the_epoch_the_selection_kept(tmp_path,
                                                                                                     monkeypatch):
    """The job stopped (`JobStopped` out of a step) while the evaluating learner's evaluation ran
    on its thread: the learner leaves only once that evaluation is offered and reported, so the
    epoch the selection kept (best.pt, best.json) has its record in the job's metrics; the
    learner exited at once and the record was lost ("stopped after 20 s (epoch 1 of 40)" where
    the model handed back was epoch 2's)."""
    from gadei.errors import JobStopped

    chooser, model = _chooser(tmp_path, "stopped", monkeypatch, slow=1.5)
    reported = []
    with pytest.raises(JobStopped):
        with chooser:
            chooser.later(_Attached(), model.state_dict(), 2, {"epoch": 2}, reported.append)
            raise JobStopped("the job was stopped")
    assert [r["epoch"] for r in reported] == [2] and reported[0]["best"]
    assert selection.Selection.open(tmp_path / "best", 3).best.epoch == 2


@pytest.mark.long  # TREC until patience stops it: most of a minute
def test_gadei_run_stops_on_patience_and_hands_back_the_best_model(procs, tmp_path):
    """Patience 1 on TREC with the default learning rate (the validation accuracy peaks within a
    few epochs): training ends before the cap for both learners, model.pt is the best
    validation model, result.json says which and why, metrics.jsonl has the validation figures.
    (At lr 0.2 the 300-wide model learned slowly and once improved until the cap.)"""
    if not (data_dir() / "trec" / "TREC.train").is_file():
        missing("TREC is not there")
    job_name = f"sel-{os.getpid()}"
    (tmp_path / "job.toml").write_text(trec_job(job_name, output=tmp_path / "out",
                                                train={"learners": 2, "epochs": 12, "patience": 1}))
    started = time.time()
    out, err = finish(procs.gadei("run", str(tmp_path / "job.toml")), 600)
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert result["stopped"] == "patience", (out, err, result)
    seen = [(m["epoch"], m.get("validation_accuracy")) for m in metrics]
    assert len(metrics) < 12 and all("validation_accuracy" in m and "validation_loss" in m for m in metrics), seen
    best = max(metrics, key=lambda m: (m["validation_accuracy"], -m["validation_loss"]))
    assert result["epoch"] == best["epoch"] and result["validation_accuracy"] == best["validation_accuracy"]
    # the time to the chosen model: after its epochs were trained, before the run ended
    trained = sum(m["epoch_seconds"] for m in metrics if m["epoch"] <= best["epoch"])
    assert trained - 2 <= result["seconds_to_best"] < result["seconds"], (trained, result)
    assert f"reached after {result['seconds_to_best']:.0f} s" in out
    # one time base: the evaluation's own time, from the run's start (gadei run starts after this test's clock)
    assert 0 <= best["evaluated_at"] - started - result["seconds_to_best"] < 5, (started, best, result)
    # the ETA counts to the epoch cap, and says that patience may end the run sooner
    etas = [line for line in out.splitlines() if "ETA" in line]
    assert etas and all("at the epoch cap (patience may stop it sooner)" in line for line in etas), out
    # patience 1: one evaluation that did not raise the validation accuracy (a tie kept for its loss counts)
    reached = min(m["epoch"] for m in metrics if m["validation_accuracy"] == best["validation_accuracy"])
    assert metrics[-1]["epoch"] == reached + 1, seen
    # model.pt is the best model's weights, not the last ones
    saved = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    kept = selection.best_weights(tmp_path / "out" / "checkpoints")
    assert all(torch.equal(saved[k], kept[k]) for k in kept)
    # the other learner ended its schedule there too: it did not run to the cap
    logs = (tmp_path / "out" / "logs" / "learner-1.log").read_text()
    epochs_1 = [json.loads(line)["epoch"] for line in logs.splitlines() if line.startswith('{"event": "epoch"')]
    assert max(epochs_1, default=0) < 12


def test_the_eta_says_patience_may_stop_the_job_sooner_only_where_it_can():
    """gadei run's ETA counts to the epoch cap; it adds "patience may stop it sooner" where
    patience can (the first evaluation is always the best so far, so it takes patience + 1
    evaluations, and one at the cap is no sooner), not for 3 epochs with patience 2 (the
    TREC run with patience 1 says it: `test_gadei_run_stops_on_patience_and_hands_back_the_best_model`).
    A training set above EVALUATE_SAMPLES is evaluated within its epochs too."""
    from gadei import jobfile
    from gadei.run import patience_may_stop
    from gadei.trainer import EVALUATE_SAMPLES

    assert patience_may_stop(jobfile.Train(epochs=12, patience=1), 5_000)
    assert patience_may_stop(jobfile.Train(epochs=3, patience=1), 5_000)
    assert not patience_may_stop(jobfile.Train(epochs=3, patience=2), 5_000)
    assert not patience_may_stop(jobfile.Train(epochs=3, patience=5), 5_000)
    assert patience_may_stop(jobfile.Train(epochs=2, patience=3), 3 * EVALUATE_SAMPLES + 1)  # 4 evaluations an epoch
