"""A job that picks its model (`workload = "auto"`, also where a job file names none): the job
file's checks, the choice among the candidates' results, and real jobs: `gadei run` trains the
candidates cheapest first and hands back the one with the best validation accuracy, saying which
and each one's figures in its lines, result.json and `gadei status`; `gadei predict` and
`gadei.Client` (through the daemon) read what it handed back; a stopped one goes on with `--resume`,
and one whose supervisor is killed under a new one, with the candidate it was training."""

import json
import os
import signal
import textwrap

import pytest
import torch

import gadei
import gadei_workloads
from gadei import checkpoint, ensemble, jobfile, outputs
from gadei.errors import GadeiError
from gadei.jobfile import JobFileError
from gadei.predict import predict
from helpers import communicate, finish, small_job, start_daemon, trec_job, unique_name, wait_for


def _auto(body: str, workload: str | None = None) -> str:
    """A job file's text with its [job] workload line gone (None), or set to `workload`."""
    line = next(each for each in body.splitlines() if each.startswith("workload = "))
    return body.replace(line + "\n", "" if workload is None else f'workload = "{workload}"\n', 1)


@pytest.mark.parametrize("edit, message", [
    (lambda b: _auto(b).replace('format = "csv"', 'format = "npz"'),
     "[job] workload is not given, so it is 'auto' (the job trains ngram and textcnn and hands back their mean, or one "
     "alone where it is better on validation), but format 'npz' holds numeric features; for those set "
     "workload = \"mlp\""),
    (lambda b: _auto(b, "auto") + "validation_holdout = 0\n",
     "[job] workload = 'auto' (the job trains ngram and textcnn and hands back their mean, or one alone where it is "
     "better on validation), but [data] "
     "validation_holdout = 0 leaves no validation set to choose on"),
    (lambda b: _auto(b) + "[bridge]\n", "but a [bridge] job's model is the one its nodes agree on, not one chosen on "
                                        "validation; name a workload"),
    (lambda b: _auto(b, "autoo"), "[job] workload = 'autoo': unknown workload (did you mean 'auto'?); allowed: 'auto' "
                                  "(the job picks its model), lstm, mlp, ngram, textcnn"),
], ids=["numeric", "no-validation", "bridged", "misspelt"])
def test_auto_is_refused_where_the_job_cannot_choose_naming_what_to_give(small, edit, message):
    path = small / "job.toml"
    path.write_text(edit(textwrap.dedent(small_job())))
    with pytest.raises(JobFileError) as err:
        jobfile.load(path)
    assert message in str(err.value), err.value


def test_a_job_file_that_names_no_workload_picks_its_model_and_one_that_names_one_gets_it(small):
    """No workload, or "auto": the candidates, each with its own defaults (the n-gram model's lr)
    and vocabulary, cheapest first by the cost estimate; a named workload is that one alone. What
    cannot run a job that picks its model (`gadei serve --job-file`, a workload by that name) says so."""
    from gadei.cli.common import job_file_defaults
    from gadei.prepare import check

    path = small / "job.toml"
    for body in (_auto(small_job()), _auto(small_job(), "auto")):
        path.write_text(body)
        job = jobfile.load(path)
        assert job.workload == jobfile.AUTO
        prepared = check(job, resume=False)
        assert [c.job.workload for c in prepared.candidates] == ["ngram", "textcnn"]  # the cheaper first
        assert [e.workload for e in prepared.estimates] == ["ngram", "textcnn"]
        assert prepared.estimates[0].epoch_flops < prepared.estimates[1].epoch_flops
        assert [c.job.train.lr for c in prepared.candidates] == [gadei_workloads.get("ngram").lr, 0.01]
        assert [c.job.output for c in prepared.candidates] == [job.output / "candidates" / w for w in
                                                               ("ngram", "textcnn")]
        assert len(prepared.candidates[0].train.vocab) > len(prepared.candidates[1].train.vocab)  # its bigrams
        assert 'workload = "auto"' in prepared.job.to_toml()
    path.write_text(_auto(small_job(), "ngram"))
    assert check(jobfile.load(path), resume=False).candidates is None
    path.write_text(_auto(small_job()))
    with pytest.raises(GadeiError, match="workload 'auto' is a job that picks its model among several"):
        job_file_defaults(["serve", "x", "--job-file", str(path)])
    with pytest.raises(ValueError, match="'auto' is a job file's: the job trains ngram, textcnn and keeps their mean "
                                         "or the better"):
        gadei_workloads.get("auto")


def _candidate(folder, workload, result, model=True):
    where = folder / "candidates" / workload
    where.mkdir(parents=True)
    if result is not None:
        (where / "result.json").write_text(json.dumps(result))
    if model:
        (where / "model.pt").write_bytes(b"")


def test_the_choice_is_the_best_validation_accuracy_of_the_candidates_that_handed_back_a_model(tmp_path):
    """A tie goes to the lower validation loss, then to the cheaper (the one that trained first);
    a candidate that failed or diverged, or has no model, is not chosen; the job's folder then
    predicts with the chosen candidate's folder."""
    (tmp_path / "candidates").mkdir()
    (tmp_path / outputs.ORDER).write_text(json.dumps({"order": ["a", "b", "c", "d"]}))
    _candidate(tmp_path, "a", {"outcome": "done", "validation_accuracy": 0.8, "validation_loss": 0.5})
    _candidate(tmp_path, "b", {"outcome": "done", "validation_accuracy": 0.8, "validation_loss": 0.4})
    _candidate(tmp_path, "c", {"outcome": "failed", "validation_accuracy": 0.9, "validation_loss": 0.1})
    _candidate(tmp_path, "d", {"outcome": "done", "validation_accuracy": 0.95}, model=False)
    found = outputs.candidates(tmp_path)
    assert [c.workload for c in found] == ["a", "b", "c", "d"]
    assert outputs.chosen(found).workload == "b"
    found[1].result["validation_loss"] = 0.5
    assert outputs.chosen(found).workload == "a"  # level: the cheaper
    assert outputs.chosen(found[2:]) is None
    assert [c.final for c in found] == [True, True, False, True]
    with pytest.raises(GadeiError, match="has not chosen one"):
        outputs.model_folders(tmp_path)
    (tmp_path / "result.json").write_text(json.dumps({"workload": "b"}))  # one older than "members"
    assert outputs.model_folders(tmp_path) == [tmp_path / "candidates" / "b"]
    (tmp_path / "result.json").write_text(json.dumps({"workload": "a+b", "members": ["a", "b"]}))
    assert outputs.model_folders(tmp_path) == [tmp_path / "candidates" / "a", tmp_path / "candidates" / "b"]
    for odd in (["a", "e"], "a", [], [["a"]]):
        (tmp_path / "result.json").write_text(json.dumps({"workload": "a+e", "members": odd}))
        with pytest.raises(GadeiError, match=r'result.json: its "members" \(.*\) are not a list of its candidates '
                                             r"\(a, b, c, d\)"):
            outputs.model_folders(tmp_path)
    assert outputs.candidates(tmp_path / "candidates" / "b") is None  # a candidate's folder is a run's
    assert outputs.model_folders(tmp_path / "candidates" / "b") == [tmp_path / "candidates" / "b"]


def test_the_mean_is_handed_back_unless_one_candidate_alone_is_a_standard_error_better(tmp_path):
    """On 500 validation samples a mean of 90% has a standard error of 1.34 points: a candidate
    alone at 91.3% does not beat it, one at 91.4% does; the choice line says which and why. Each
    member weighs in inverse proportion to its validation error (none: as half a sample's), and
    weights that result.json says otherwise than `gadei run` writes them are refused, named."""
    from gadei.ensemble import Mean, beats, standard_error, weigh, weights_of

    assert weigh({"a": 0.9, "b": 0.8}, 500) == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    assert weigh({"a": 1.0, "b": 0.5}, 500) == pytest.approx({"a": 1000 / 1002, "b": 2 / 1002})
    assert weights_of({"weights": {"a": 0.25, "b": 0.75}}, ["a", "b"], tmp_path) == [0.25, 0.75]
    assert weights_of({}, ["a", "b"], tmp_path) == [0.5, 0.5] and weights_of({}, ["a"], tmp_path) == [1.0]
    for odd in ({"a": 0.25}, {"a": 0.5, "b": "0.5"}, {"a": 2.0, "b": -1.0}, [0.5, 0.5], {"a": True, "b": 0.0}):
        with pytest.raises(GadeiError, match="are not a weight from 0 to 1 for each of a, b, adding up to 1"):
            weights_of({"weights": odd}, ["a", "b"], tmp_path / "result.json")

    assert standard_error(0.9, 500) == pytest.approx(0.0134164, abs=1e-6)
    mean = Mean(["a", "b"], 0.9, 500, 0.88, 400)
    assert beats(mean, 0.913) and beats(mean, 0.85) and not beats(mean, 0.914)
    figures = [{"workload": "a", "validation_accuracy": 0.913, "seconds": 2.0},
               {"workload": "b", "validation_accuracy": 0.85, "seconds": 20.0}]
    said = ensemble.choice_line({"workload": "a+b", "members": ["a", "b"], "validation_accuracy": 0.9,
                                "weights": {"a": 0.633, "b": 0.367}, "candidates": figures,
                                "mean": {"validation_accuracy": 0.9, "validation_samples": 500}})
    assert said == ("the mean of a and b (weights 0.63, 0.37), validation accuracy 90.00%, within a standard error "
                    "(1.34%) of the best alone (a 91.30% in 2 s, b 85.00% in 20 s)"), said
    for alone, than in ((0.9, "level with"), (0.899, "above")):  # once "above" where it was level
        figures[0]["validation_accuracy"] = alone
        said = ensemble.choice_line({"workload": "a+b", "members": ["a", "b"], "validation_accuracy": 0.9,
                                    "weights": {"a": 0.5, "b": 0.5}, "candidates": figures,
                                    "mean": {"validation_accuracy": 0.9, "validation_samples": 500}})
        assert f"validation accuracy 90.00%, {than} the best alone (a {alone:.2%} in 2 s" in said, said
    figures[0]["validation_accuracy"] = 0.92
    said = ensemble.choice_line({"workload": "a", "members": ["a"], "candidates": figures,
                                "mean": {"validation_accuracy": 0.9, "validation_samples": 500}})
    assert said == ("a, the best validation accuracy of 2 candidates (a 92.00% in 2 s, b 85.00% in 20 s; their "
                    "mean 90.00%, more than a standard error (1.34%) below a)"), said


def test_a_resumed_job_goes_on_with_the_first_candidate_that_had_not_ended_for_good(tmp_path):
    """Without a checkpoint of it, from its start, where one before it ended for good; with every
    one ended and no result.json of the job's own (its supervisor died making the choice), the
    choice; with nothing ended and no checkpoint, or the job's result written, nothing."""
    (tmp_path / "candidates").mkdir()
    (tmp_path / outputs.ORDER).write_text(json.dumps({"order": ["a", "b"]}))
    _candidate(tmp_path, "a", None, model=False)
    _candidate(tmp_path, "b", None, model=False)
    assert outputs.going_on(tmp_path) is None  # nothing to go on with: the same command starts it again
    (tmp_path / "candidates" / "a" / "result.json").write_text(json.dumps({"outcome": "done"}))
    where = outputs.going_on(tmp_path)
    assert (where.folder, where.found, where.kept) == (tmp_path / "candidates" / "b", None, ["a"])
    assert str(where) == "candidate b from its start, keeping a"
    (tmp_path / "candidates" / "b" / "result.json").write_text(json.dumps({"outcome": "failed"}))
    assert outputs.going_on(tmp_path).folder == tmp_path / "candidates" / "b"  # a failed one is trained again
    (tmp_path / "candidates" / "b" / "result.json").write_text(json.dumps({"outcome": "diverged"}))
    assert str(outputs.going_on(tmp_path)) == "the choice, keeping a, b"
    (tmp_path / "result.json").write_text(json.dumps({"outcome": "done", "workload": "a"}))
    assert outputs.going_on(tmp_path) is None


def _status(name: str) -> dict | None:
    """The job's `gadei status --json` line (None while it has no region)."""
    from helpers import Procs

    procs = Procs()
    try:
        proc = procs.gadei("status", name, "--json", "--interval", "0.1")
        out, _ = communicate(proc, 60)
    finally:
        procs.reap()
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return next((line for line in lines if line.get("job") == name), None)


def test_a_job_file_that_names_no_workload_trains_the_candidates_and_hands_back_the_better(tmp_path, procs,
                                                                                             monkeypatch):
    """TREC, 2 learners, 1 epoch each: the n-gram model trains first (cheaper), then the text CNN;
    `gadei status` says which candidate trains while it runs; `gadei run` says each candidate's end
    and, last, which model it chose and why; result.json names the chosen model (the candidates'
    mean unless one alone is a standard error better on validation), each candidate's figures,
    the mean's, and the chosen model's; model.pt is the chosen model's; `gadei predict` reads the
    job's folder and each candidate's. Then the choice made again over the same candidates, with
    the text CNN's model spoilt two ways: one that always says the same label, given as much
    weight as the n-gram model, drags the mean down, and the n-gram model alone is handed back;
    one that knows nothing (every label as likely) leaves the n-gram model's answers to the mean,
    which is handed back, and predicts their mean, each weighted by its validation error."""

    name = unique_name("auto")
    path = tmp_path / "job.toml"
    path.write_text(_auto(trec_job(name, train={"learners": 2, "epochs": 1})))
    run = procs.gadei("run", path)
    seen = wait_for(lambda: (_status(name) or {}).get("picking") or run.poll() is not None, 240,
                    "gadei status to say which candidate trains")
    out, err = communicate(run, 600)
    assert run.returncode == 0, out + err
    assert isinstance(seen, dict) and seen["training"] in ("ngram", "textcnn"), seen
    assert [c["workload"] for c in seen["candidates"]] == ["ngram", "textcnn"]
    assert "auto (picks its model among ngram, textcnn) on 4,906 training / 546 validation / 500 test" in out, out
    assert "candidates, cheapest first by an epoch's arithmetic: 1. ngram (" in out
    assert "ngram: chose lr = 0.2 (default of the ngram workload" in out
    folder = tmp_path / "out"
    result = json.loads((folder / "result.json").read_text())
    figures = {c["workload"]: c for c in result["candidates"]}
    assert list(figures) == ["ngram", "textcnn"] and all(c["outcome"] == "done" for c in figures.values())
    assert all(0 < c["seconds"] < result["seconds"] for c in figures.values())
    assert out.index("candidate 1 of 2, ngram: done in") < out.index("candidate 2 of 2, textcnn: done in")
    best = max(figures, key=lambda w: figures[w]["validation_accuracy"])
    # each candidate's validation accuracy, which the choice is made by, is its model's as predict sees it (the text
    # CNN's was once measured on sentences padded to their batch's longest: 1-2 points off)
    alone = ensemble.measure([folder / "candidates" / w for w in figures]).alone
    assert alone == {w: c["validation_accuracy"] for w, c in figures.items()}, (alone, figures)
    mean = result["mean"]
    assert mean["validation_samples"] == 546 and 0.8 < mean["validation_accuracy"] <= 1, mean
    wins = figures[best]["validation_accuracy"] <= mean["validation_accuracy"] + ensemble.standard_error(
        mean["validation_accuracy"], 546)
    assert result["outcome"] == "done" and result["members"] == (["ngram", "textcnn"] if wins else [best]), result
    assert result["workload"] == ("ngram+textcnn" if wins else best)
    chosen = mean if wins else figures[best]
    assert result["validation_accuracy"] == chosen["validation_accuracy"]
    assert result["test_accuracy"] == chosen["test_accuracy"] > 0.8
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"gadei run: job {name} done in") and f"chose {ensemble.choice_line(result)}" in last, last
    said = (f"(ngram {figures['ngram']['validation_accuracy']:.2%} in {figures['ngram']['seconds']:.0f} s, textcnn "
            f"{figures['textcnn']['validation_accuracy']:.2%} in {figures['textcnn']['seconds']:.0f} s")
    assert said in last and (
        f"chose the mean of ngram and textcnn (weights {mean['weights']['ngram']:.2f}, "
        f"{mean['weights']['textcnn']:.2f}), validation accuracy {mean['validation_accuracy']:.2%}" if wins
        else f"chose {best}, the best validation accuracy of 2 candidates") in last, last
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [m["workload"] for m in metrics] == ["ngram", "textcnn"]
    assert (folder / "accuracy.png").is_file() and (folder / "candidates" / best / "accuracy.png").is_file()
    for where in (folder, folder / "candidates" / "ngram", folder / "candidates" / "textcnn"):
        asked = procs.gadei("predict", where, "How far is it from Denver to Aspen ?")
        said, err = finish(asked, 60)
        assert said.splitlines()[0].split()[-1] == "NUM", said + err

    def state(where):
        return torch.load(where / "model.pt", weights_only=True)

    def choose_again():
        return outputs.conclude(jobfile.load(folder / "job.toml"), outputs.Ending(0, finished=True), since=None)

    def probabilities(where, text="Who wrote Hamlet ?"):
        return dict(predict(str(where), [text], top=6)[0])

    cnn = folder / "candidates" / "textcnn"
    spoilt = {key: torch.zeros_like(value) for key, value in state(cnn).items()}
    spoilt["out.bias"][0] = 50.0  # every text: the first label
    torch.save(spoilt, cnn / "model.pt")
    with monkeypatch.context() as patch:  # as much weight as the n-gram model: the mean is always the first label
        patch.setattr(ensemble, "weigh", lambda accuracies, samples: {name: 0.5 for name in accuracies})
        result = choose_again()
    assert result["workload"] == "ngram" and result["members"] == ["ngram"], result
    assert result["mean"]["validation_accuracy"] < 0.5 and "more than a standard error" in result["choice"], result
    assert result["test_accuracy"] == figures["ngram"]["test_accuracy"]
    assert all(torch.equal(state(folder)[k], v) for k, v in state(folder / "candidates" / "ngram").items())
    assert probabilities(folder) == probabilities(folder / "candidates" / "ngram")
    line = outputs.summary(jobfile.load(folder / "job.toml"), result)  # the model it chose, not when training stopped
    assert f"; ngram stopped by {result['stopped']}, its model of epoch {result['epoch']} (validation" in line, line
    spoilt["out.bias"][0] = 0.0  # every label as likely
    torch.save(spoilt, cnn / "model.pt")
    result = choose_again()
    assert result["workload"] == "ngram+textcnn" and result["members"] == ["ngram", "textcnn"], result
    assert result["validation_accuracy"] == figures["ngram"]["validation_accuracy"], result  # the n-gram's answers
    assert result["test_accuracy"] == pytest.approx(figures["ngram"]["test_accuracy"]), result
    assert "level with the best alone" in result["choice"] and "epoch" not in result, result
    mine = state(folder)
    assert sorted(mine) == sorted([f"ngram.{k}" for k in state(folder / "candidates" / "ngram")]
                                  + [f"textcnn.{k}" for k in spoilt])
    alone, labels = probabilities(folder / "candidates" / "ngram"), len(json.loads((cnn / "labels.json").read_text()))
    weights = result["weights"]
    assert weights["ngram"] > 0.5 and weights["ngram"] + weights["textcnn"] == pytest.approx(1), weights
    assert probabilities(folder) == pytest.approx({k: weights["ngram"] * p + weights["textcnn"] / labels
                                                   for k, p in alone.items()}), alone
    line = outputs.summary(jobfile.load(folder / "job.toml"), result)
    assert "chose the mean of ngram and textcnn (weights " in line and "model " in line, line
    (cnn / "job.toml").rename(cnn / "gone.toml")  # a member's folder that lost its job file: said so
    with pytest.raises(GadeiError, match=f"is not a finished `gadei run` folder: {cnn / 'job.toml'} is missing"):
        predict(str(folder), ["Who wrote Hamlet ?"])


def test_an_auto_job_through_the_daemon_and_the_client(small, procs, daemon_env, monkeypatch):
    """A job dict that names no workload, submitted to the daemon: its progress followed by the
    client is each candidate's epochs in turn, its result and model are the chosen one's, the
    client predicts with it, `gadei status` names the choice and `gadei logs` each candidate's logs."""
    for key, value in daemon_env.items():
        monkeypatch.setenv(key, value)
    name = unique_name("auto-d")
    daemon = start_daemon(procs, daemon_env)
    client = gadei.Client(poll=0.1)
    job = {"job": {"name": name}, "data": {"train": "train.csv", "format": "csv", "label_column": "category"},
           "train": {"learners": 1, "epochs": 2}}
    record = client.submit(job, base=small)
    progress = list(client.follow(record, timeout=300))
    done = client.wait(name, timeout=0)
    assert done.state == "done", done
    assert [(p["workload"], p["epoch"]) for p in progress] == [("ngram", 1), ("ngram", 2), ("textcnn", 1),
                                                                ("textcnn", 2)]
    result = client.result(name)
    assert result["workload"] in ("ngram", "textcnn", "ngram+textcnn") and [
        c["workload"] for c in result["candidates"]] == ["ngram", "textcnn"]
    assert client.model_path(name) == small / "runs" / name / "model.pt"
    answers = client.predict(name, ["sentence number 7, about dogs"], top=2)
    assert answers == predict(str(small / "runs" / name), ["sentence number 7, about dogs"], top=2)
    alone = [dict(predict(str(small / "runs" / name / "candidates" / member), ["sentence number 7, about dogs"],
                          top=9)[0]) for member in result["members"]]
    weights = [result.get("weights", {}).get(member, 1.0) for member in result["members"]]
    assert dict(answers[0]) == pytest.approx({label: sum(w * a[label] for w, a in zip(weights, alone))
                                              for label, _ in answers[0]})
    table, _ = finish(procs.gadei("status", env=daemon_env))
    assert f"chose {ensemble.choice_line(result)}" in table, table
    logs = list(client.logs(name, lines=2))
    for workload in ("ngram", "textcnn"):
        assert f"==> {small / 'runs' / name / 'candidates' / workload / 'logs' / 'server.log'} <==" in logs, logs
    finish(procs.gadei("daemon", "stop", env=daemon_env))
    communicate(daemon, 30)


@pytest.mark.long  # two TREC runs and a stop between them: about two minutes
def test_a_stopped_auto_job_goes_on_with_the_candidate_it_was_training(tmp_path, procs):
    """Stopped while its second candidate (the text CNN) trains: the first's result is kept as it
    was (not trained again), the second goes on from the stop's checkpoint of it, the job hands
    back the better of the two, and its folder predicts."""
    from helpers import job_version

    name = unique_name("auto-resume")
    path = tmp_path / "job.toml"
    path.write_text(_auto(trec_job(name, train={"learners": 2, "epochs": 2}, checkpoint={"interval": 600}), "auto"))
    folder = tmp_path / "out"
    first = folder / "candidates" / "ngram" / "result.json"
    run = procs.gadei("run", path, "--quiet")
    wait_for(lambda: first.is_file() and job_version(name) >= 500 or run.poll() is not None, 300,
             "the text CNN, the second candidate, to make 500 updates")
    kept = first.read_text()
    run.send_signal(signal.SIGTERM)
    out, err = communicate(run, 120)
    assert run.returncode == 130 and "--resume" in out, out + err
    stopped = json.loads((folder / "result.json").read_text())
    assert stopped["outcome"] == "stopped" and stopped["workload"] == "ngram", stopped  # the model so far
    assert [c["outcome"] for c in stopped["candidates"]] == ["done", "stopped"]
    assert "candidate textcnn, epoch" in out and "the model chosen so far, ngram's epoch" in out, out
    resumed = procs.gadei("run", path, "--resume")
    out, err = communicate(resumed, 900)
    assert resumed.returncode == 0, out + err
    assert "resuming with candidate textcnn's checkpoint ckpt-" in out and ", keeping ngram" in out, out
    assert "candidate 1 of 2, ngram" not in out and "candidate 2 of 2, textcnn: done" in out, out
    assert first.read_text() == kept  # the finished candidate is not trained again
    second = json.loads((folder / "candidates" / "textcnn" / "result.json").read_text())
    assert second["outcome"] == "done" and len(second["runs"]) == 2, second
    result = json.loads((folder / "result.json").read_text())
    assert result["outcome"] == "done" and len(result["runs"]) == 2 and "seconds_in_all" in result, result
    best = max(result["candidates"], key=lambda c: c["validation_accuracy"])["workload"]
    assert result["workload"] == "+".join(result["members"]) and result["members"] in (["ngram", "textcnn"], [best])
    answers = predict(str(folder), ["Who wrote Hamlet ?"], top=1)
    assert answers[0][0][0] == "HUM", answers


@pytest.mark.long  # a TREC job of two candidates and a new supervisor: about two minutes
def test_a_killed_supervisor_of_an_auto_job_is_replaced_by_one_that_goes_on_with_its_candidate(tmp_path, procs):
    """SIGKILL of the job's supervisor while the second candidate trains: `gadei run` starts a new
    one that keeps the first candidate's result and goes on with the second from its newest
    checkpoint, in the same run: the second's seconds count from its own start, not the job's."""
    from gadei.region import Region
    from gadei.supervisor import registered
    from helpers import end_jobs, job_version

    name = unique_name("auto-kill")
    path = tmp_path / "job.toml"
    path.write_text(_auto(trec_job(name, train={"learners": 2, "epochs": 2}, checkpoint={"interval": 2})))
    folder = tmp_path / "out"
    first, second = folder / "candidates" / "ngram", folder / "candidates" / "textcnn"

    def training_second() -> bool:
        # a checkpoint of the supervisor's (one that records the learners' progress): the server's
        # own at its stop does not, and one that training ended before leaves a resume nothing to go on from
        return ((first / "result.json").is_file() and job_version(name) >= 200
                and checkpoint.latest(second / "checkpoints", with_progress=True) is not None)

    try:
        run = procs.gadei("run", path, "--quiet")
        wait_for(lambda: training_second() or run.poll() is not None, 300,
                 "the text CNN, the second candidate, to make 200 updates and a checkpoint of its progress")
        kept = (first / "result.json").read_text()
        with Region.attach(name, readonly=True) as region:
            pid = registered(region)[0]
        os.kill(pid, signal.SIGKILL)
        out, err = communicate(run, 600)
        assert run.returncode == 0, out + err
        assert f"its supervisor (pid {pid}) was killed by SIGKILL" in err, err
        assert "a new one goes on from candidate textcnn's checkpoint ckpt-" in err and ", keeping ngram" in err, err
        assert (first / "result.json").read_text() == kept
        result = json.loads((folder / "result.json").read_text())
        ngram, textcnn = ({c["workload"]: c for c in result["candidates"]}[w] for w in ("ngram", "textcnn"))
        assert result["outcome"] == "done" and textcnn["outcome"] == "done", result
        assert len(result["runs"]) == 1 and len(json.loads((second / "result.json").read_text())["runs"]) == 1
        # from its own start (the first candidate's end), across both supervisors: the job's less the first's
        rest = result["seconds"] - ngram["seconds"]
        assert rest - 5.0 <= textcnn["seconds"] <= rest + 1.0, result
        assert result["written_by"] != pid
    finally:
        end_jobs(name)

