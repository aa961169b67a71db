"""The n-gram workload (gadei_workloads.ngram): its tokens, its model, and a job file of it run
by `gadei run` with the server's defaults, its table travelling as rows, and `gadei predict` on
what it handed back."""

import json
import statistics

import pytest
import torch

import gadei_workloads
from gadei_workloads import ngram, text, topics
from gadei_workloads.ngram import build_ngram, dimension_for, ngrams
from helpers import communicate, data_dir, job_text, missing, tiered, trec_job, unique_name


def test_a_sentences_ngrams_are_its_distinct_words_and_bigrams_with_its_ends_marked():
    assert ngrams(["how", "far", "?"]) == ["how", "far", "?", "<s> how", "how far", "far ?", "? </s>"]
    assert ngrams(["no", "no", "no"]) == ["no", "<s> no", "no no", "no </s>"]  # each once: present or not
    assert ngrams([]) == ["<s> </s>"]
    assert [dimension_for(n) for n in (2, 6, 16, 17, 77, 150)] == [16, 16, 16, 32, 128, 256]


def test_the_model_is_seeded_and_leaves_padding_and_unknown_ngrams_out():
    a, b = build_ngram(50, 3, seed=2), build_ngram(50, 3, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embedding.weight, build_ngram(50, 3, seed=3).embedding.weight)
    assert a.embedding.sparse  # the table's gradient is the rows a mini-batch touched
    with torch.no_grad():
        a.out.weight.normal_()  # fastText starts the output layer at zero: make the rows show
    x = torch.tensor([[5, 6, 7]])
    for same in ([[5, 6, 7, 0, 0]], [[5, 1, 6, 7, 1]]):  # padding, an n-gram training never had
        assert torch.allclose(a(x), a(torch.tensor(same)), atol=1e-6)
    a(torch.tensor([[5, 1, 6]])).sum().backward()
    assert set(a.embedding.weight.grad.coalesce().indices()[0].tolist()) == {5, 6}


def test_the_closed_form_gradient_is_autograds_and_adds_to_the_gradients_there():
    """A learner's step takes the n-gram classifier's gradient in closed form
    (`Workload.gradient`): it must be what backward gives, for padding, unknown n-grams, an
    n-gram twice in a sentence, a sentence with none known, and added to a dense .grad that is
    there (a ring slot's view), as backward adds."""
    workload = gadei_workloads.get("ngram")
    model = build_ngram(40, 5, seed=1)
    with torch.no_grad():
        model.out.weight.normal_()  # fastText starts it at zero: the rows' gradient would be zero
        model.out.bias.normal_()
    x = torch.tensor([[5, 6, 7, 0, 0], [5, 1, 9, 9, 3], [1, 1, 0, 0, 0], [12, 13, 14, 15, 39]])
    y = torch.tensor([0, 4, 2, 1])
    reference = build_ngram(40, 5, seed=1)
    reference.load_state_dict(model.state_dict())
    logits = reference(x)
    expected = torch.nn.functional.cross_entropy(logits, y)
    expected.backward()
    loss, right = workload.gradient(model, x, y, None)
    assert torch.allclose(loss, expected, atol=1e-6) and right.item() == (logits.argmax(1) == y).sum().item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad.is_sparse == q.grad.is_sparse, name
        assert torch.allclose(p.grad.to_dense(), q.grad.to_dense(), atol=1e-6), name
    rows = model.embedding.weight.grad  # coalesced: each row once (5 in two sentences, 9 twice in one)
    assert rows.is_coalesced() and rows.indices()[0].tolist() == [3, 5, 6, 7, 9, 12, 13, 14, 15, 39]
    for p in model.parameters():
        p.grad = None
    workload.gradient(model, torch.tensor([[1, 0], [0, 0]]), torch.tensor([1, 2]), None)  # no n-gram known at all
    assert model.embedding.weight.grad._nnz() == 0 and model.out.bias.grad.abs().sum() > 0
    # a second step adds to what is there, a dense .grad in place (a ring slot's view stays one)
    for p, q in zip(model.parameters(), reference.parameters()):
        p.grad = q.grad.to_dense().clone()
    slots = [p.grad for p in model.parameters()]
    workload.gradient(model, x, y, None)
    for p, q, slot in zip(model.parameters(), reference.parameters(), slots):
        assert p.grad is slot and torch.allclose(p.grad, 2 * q.grad.to_dense(), atol=1e-6)
    # a batch of many rows (torch's kernel sums them, not numpy), n-grams in several sentences
    big = torch.randint(0, 40, (48, 30), generator=torch.Generator().manual_seed(0))
    labels = torch.arange(48) % 5
    assert big.numel() * model.embedding.embedding_dim > ngram._GATHER
    for m in (model, reference):
        for p in m.parameters():
            p.grad = None
    torch.nn.functional.cross_entropy(reference(big), labels).backward()
    workload.gradient(model, big, labels, None)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad.to_dense(), q.grad.to_dense(), atol=1e-6), name


def test_the_ngram_workload_indexes_bigrams_and_learns_generated_data():
    workload = gadei_workloads.get("ngram")
    train, test = workload.load_data("generated:1")
    assert "<s>" not in train.vocab.decode(range(len(train.vocab)))  # markers only inside bigrams
    assert any(" " in token for token in train.vocab.decode(range(len(train.vocab))))
    words, _ = topics.generate_topics(seed=1)
    assert len(train.vocab) > 3 * len(words.vocab)  # a row per bigram of the training set
    model = workload.build_model(train, 0)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=workload.lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: a second thread only contends (10x as long on a busy machine)
    try:
        with torch.sparse.check_sparse_tensor_invariants(enable=False):  # its default, said: no warning
            for x, y in text.batches(train, 16, epoch=0, seed=0):
                optimizer.zero_grad()
                workload.gradient(model, x, y, None)  # as a learner takes it (the closed form)
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    assert workload.evaluate(model, test) > 0.7  # one epoch (chance: 0.17)


def test_a_job_file_of_the_ngram_workload_trains_with_its_defaults_and_predicts(tmp_path, procs):
    """`workload = "ngram"` and nothing tuned: the workload's learning rate is chosen, the table
    travels through the rings as rows (the server says so), one epoch of TREC with 2 learners
    hands back a model above 85%, and `gadei predict` reads the output folder."""
    name = unique_name("ngram")
    body = trec_job(name, train={"learners": 2, "epochs": 1}).replace('"textcnn"', '"ngram"')
    path = tmp_path / "job.toml"
    path.write_text(body)
    run = procs.gadei("run", path)
    out, err = communicate(run, 300)
    assert run.returncode == 0, out + err
    assert "ngram on 4,906 training / 546 validation / 500 test samples" in out, out
    assert "chose lr = 0.2 (default of the ngram workload" in out, out
    folder = tmp_path / "out"
    assert "1 row-sparse table" in (folder / "logs" / "server.log").read_text()
    tokens = json.loads((folder / "vocab.json").read_text())["tokens"]
    assert "<s> how" in tokens and "how" in tokens
    state = torch.load(folder / "model.pt", weights_only=True)
    assert state["embedding.weight"].shape == (len(tokens), 16)
    assert json.loads((folder / "result.json").read_text())["test_accuracy"] > 0.85
    predicted = procs.gadei("predict", folder, "How far is it from Denver to Aspen ?")
    out, err = communicate(predicted, 60)
    assert predicted.returncode == 0 and out.splitlines()[0].split()[-1] == "NUM", out + err


def test_a_job_of_long_texts_at_a_large_batch_trains_and_predicts(tmp_path, procs):
    """Texts of 1,200-1,500 words at mini-batch 8: each is cut to its first 1,000 words (said),
    a mini-batch of them touches about 16,000 rows of the table, twice what a gradient carries
    by default, so the job's rings are made for it (said), and the job ends done (where its
    learners used to die on their first gradient, and the job failed once they were given up);
    `gadei predict` of a text of 15,000 words answers."""
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(3_000)]
    rows = ["text,label"] + [" ".join([("good", "bad")[i % 2]] + rng.sample(words, rng.randint(1_200, 1_500)))
                             + f",{('pos', 'neg')[i % 2]}" for i in range(120)]  # each word once: 2,001 n-grams cut
    (tmp_path / "long.csv").write_text("\n".join(rows) + "\n")
    path = tmp_path / "job.toml"
    path.write_text(job_text({"job": {"name": unique_name("long"), "workload": "ngram"},
                              "data": {"train": "long.csv", "format": "csv"},
                              "train": {"batch": 8, "epochs": 2}, "output": {"folder": "out"}}))
    run = procs.gadei("run", path)
    out, err = communicate(run, 300)
    assert run.returncode == 0, out + err
    assert "long.csv: 121 lines, 120 samples; cut to their first 1,000 words ([data] max_words): 120 samples" in out
    assert "chose max_rows = 16,009 (auto" in out, out
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["outcome"] == "done" and result["stopped"] == "cap", result
    predicted = procs.gadei("predict", tmp_path / "out", " ".join(rng.choices(words, k=15_000)), "good")
    out, err = communicate(predicted, 60)
    assert predicted.returncode == 0 and len(out.splitlines()) == 2, out + err
    assert len(out.splitlines()[0]) < 300  # a long text's line shows its start


def test_the_cost_estimate_puts_the_ngram_model_before_the_text_cnn():
    """What phase 2's `workload = "auto"` will order its candidates by: each workload's
    parameters as built, and an epoch's arithmetic, which is far less for the n-gram model."""
    from gadei_workloads.cost import cheapest_first, estimate

    found = {}
    for name in ("textcnn", "ngram", "lstm"):
        workload = gadei_workloads.get(name)
        train, _ = workload.load_data("generated:1")
        found[name] = estimate(name, train)
        assert found[name].parameters == sum(p.numel() for p in workload.build_model(train, 0).parameters())
    assert [e.workload for e in cheapest_first(list(found.values()))][0] == "ngram"
    assert found["textcnn"].epoch_flops > 100 * found["ngram"].epoch_flops
    assert found["ngram"].sparse_rows > 1.5 * found["textcnn"].sparse_rows  # its words (each once) and bigrams


# The medians of 3 seeds that a job file naming the n-gram workload, or none (auto: the
# candidates' mean, as a rule), with nothing tuned and 2 learners, hands back (what `gadei bench
# quality --runs ngram-2,auto-2 --repeats 3` runs), each a floor a point or so under what it
# measured (docs/benchmarks.md, "quality: the n-gram workload" and "The candidates' mean"): a
# floor, not issue 47's target, which one seed's move of a point on CR's 377 test reviews can
# cross. CR's n-gram median (about 30 s) in the long tier, where test_accuracy.py holds TREC's
# median of the n-gram workload (a job file of its own, two learners against one); the auto
# medians (CR's 90-120 s on a quiet machine, over 200 s on a slow one: CI's time) and the larger
# sets as soak runs. Auto's choice itself is tested in the default tier (tests/test_choice.py).
FLOORS = {"ngram": {"trec": 0.895, "cr": 0.79, "sst2": 0.81, "subj": 0.92, "banking77": 0.895},
          "auto": {"trec": 0.905, "cr": 0.80, "sst2": 0.815, "subj": 0.922, "banking77": 0.905}}


CASES = [(name, workload) for name in ("trec", "cr", "sst2", "subj", "banking77") for workload in ("ngram", "auto")]


@pytest.mark.parametrize("name, workload", tiered(CASES, default=[], soak=[c for c in CASES if c != ("cr", "ngram")]))
def test_a_job_file_with_nothing_tuned_reaches_its_accuracy(name, workload, tmp_path):
    from gadei.bench.quality import job_file, run_gadei, set_data

    if not (data_dir() / name).is_dir():
        missing(f"{name} is not at {data_dir() / name} (set GADEI_DATA_DIR)")
    data = set_data(name, tmp_path, base=data_dir())
    results = [run_gadei(job_file(tmp_path, name, data, learners=2, seed=seed, workload=workload))
               for seed in range(3)]
    accuracy = statistics.median(r["test_accuracy"] for r in results)
    print(f"{name}: {workload}, 2 learners, median {accuracy:.2%} ("
          + ", ".join(f"{r['test_accuracy']:.2%} by {r.get('workload') or workload} "
                      + (f"at epoch {r['epoch']} " if "epoch" in r else "") + f"in {r['wall_seconds']:.0f} s"
                      for r in results) + ")")
    assert accuracy >= FLOORS[workload][name], results


@pytest.mark.long  # two TREC runs and a stop between them: most of a minute
def test_a_stopped_ngram_job_goes_on_with_resume_and_predicts(tmp_path, procs):
    """The workload's own defaults (its lr) are the job as run: `gadei run --resume` of the same
    file is not refused as a change, goes on from the stop's checkpoint to the end, and the
    folder it finishes predicts."""
    import signal

    from helpers import job_version, wait_for

    name = unique_name("ngram-resume")
    path = tmp_path / "job.toml"
    path.write_text(trec_job(name, train={"learners": 2, "epochs": 3}, checkpoint={"interval": 600})
                    .replace('"textcnn"', '"ngram"'))
    run = procs.gadei("run", path, "--quiet")
    wait_for(lambda: job_version(name) >= 500, 120, "the job to make 500 updates")
    run.send_signal(signal.SIGTERM)
    out, err = communicate(run, 120)
    assert run.returncode == 130 and "--resume" in out, out + err
    resumed = procs.gadei("run", path, "--resume", "--quiet")
    out, err = communicate(resumed, 600)
    assert resumed.returncode == 0 and "resuming from" in out and "done in" in out, out + err
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["finished"] and result["test_accuracy"] > 0.85, result
    predicted = procs.gadei("predict", tmp_path / "out", "Who wrote Hamlet ?")
    out, err = communicate(predicted, 60)
    assert predicted.returncode == 0 and out.splitlines()[0].split()[-1] == "HUM", out + err
