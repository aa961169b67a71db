"""Tests of the workloads package: tokenizer, vocabulary, loaders, batching and model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import gadei_workloads
from gadei_workloads import specs, text, topics
from gadei_workloads.text import TextDataset, Vocab, batches, tokenize
from gadei_workloads.textcnn import build_textcnn
from helpers import IN_CI

DATA_DIR = Path(
    os.environ.get("GADEI_DATA_DIR")
    or Path(__file__).resolve().parents[1].parent / "shared" / "data"
)
TREC_DIR = DATA_DIR / "trec"
needs_trec = pytest.mark.skipif(  # under CI=true a missing data set fails the test instead (helpers.missing)
    not (TREC_DIR / "TREC.train").is_file() and not IN_CI,
    reason=f"TREC data not found in {TREC_DIR} (set GADEI_DATA_DIR)",
)


SST2_DIR = DATA_DIR / "sst2"
needs_sst2 = pytest.mark.skipif(
    not (SST2_DIR / "stsa.binary.train").is_file() and not IN_CI,
    reason=f"SST-2 data not found in {SST2_DIR} (set GADEI_DATA_DIR)",
)


def _write_trec(folder: Path, train: str, test: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "TREC.train").write_bytes(train.encode("latin-1"))
    (folder / "TREC.test").write_bytes(test.encode("ascii"))
    return folder


def _indexed_dataset(n: int) -> TextDataset:
    """Sample i has label i and i+1 tokens, so batches reveal which samples they hold."""
    vocab = Vocab(["<pad>", "<unk>", "w"])
    return TextDataset(
        ids=[[2] * (i + 1) for i in range(n)],
        labels=list(range(n)),
        label_names=[str(i) for i in range(n)],
        vocab=vocab,
    )


# --- tokenizer and vocabulary ------------------------------------------------------


def test_tokenize_lowercases_and_splits_punctuation():
    assert tokenize("Who wrote 'Hamlet', (the play)?") == [
        "who", "wrote", "hamlet", ",", "(", "the", "play", ")", "?",
    ]


def test_tokenize_splits_contractions_and_strips_accents():
    assert tokenize("Don't café's x-ray!") == ["do", "n't", "cafe", "'s", "x", "ray", "!"]
    assert tokenize("  ...  ") == []


def test_tokenize_reads_ascii_and_other_texts_alike():
    """ASCII texts skip the accent folding (NFKD, then dropping combining marks), which leaves
    them as they are: the tokens are those of the folding path, for texts of every kind of
    character."""
    import random
    import re
    import unicodedata

    from gadei_workloads.text import _TOKEN_RE

    def folded(text):
        text = "".join(ch for ch in unicodedata.normalize("NFKD", text) if not unicodedata.combining(ch))
        return _TOKEN_RE.findall(text.lower())

    draw = random.Random(0)
    alphabet = [chr(c) for c in range(128)] + list("éÉàçñüßﬁ½²İ́ ") + ["don't", "It's", "Q&A"]
    texts = ["".join(draw.choices(alphabet, k=draw.randint(0, 40))) for _ in range(5000)]
    texts += ["Don't stop", "CAFE'S (new)!", "x-ray, 42?", "It'd", "A\tb\nc"]
    for each in texts:
        assert tokenize(each) == folded(each), each
    assert sum(each.isascii() for each in texts) > 100 and re.search("[^ -~]", "".join(texts))


@pytest.mark.parametrize("tokens, max_size, min_count", [(None, 20000, 1), ("ngrams", 1_000_000, 1),
                                                          ("ngrams", 40, 2), (None, 12, 3)])
def test_a_split_is_encoded_as_the_vocabulary_built_from_its_tokens_says(tokens, max_size, min_count):
    """`encode_splits` numbers each training token as first seen and never keeps the tokens as
    strings; the vocabulary, ids and labels are those of `Vocab.build` over the tokens and
    `Vocab.encode` of each row: ties by token, min_count and max_size kept, an unseen token 1, a
    token spelled as padding or unknown their ids."""
    import random

    from gadei_workloads.ngram import ngrams
    from gadei_workloads.text import encode_splits

    make = ngrams if tokens == "ngrams" else (lambda words: words)
    draw = random.Random(1)
    words = [f"w{i}" for i in range(60)] + ["<pad>", "<unk>"]
    rows = [([draw.choice(words) for _ in range(draw.randint(0, 12))], draw.choice("abc")) for _ in range(300)]
    train, validation, test = rows[:200], rows[200:250], rows[250:] + [(["never", "seen"], "a")]
    sets = encode_splits(train, validation, test, name="x", validation_source="v", test_source="t",
                         tokens=make if tokens else None, max_size=max_size, min_count=min_count)
    vocab = Vocab.build([make(w) for w, _ in train], max_size=max_size, min_count=min_count)
    assert sets[0].vocab == vocab and len(vocab) <= max_size
    for dataset, split in zip(sets, (train, validation, test)):
        assert dataset.ids == [vocab.encode(make(w)) for w, _ in split]
        assert [dataset.label_names[i] for i in dataset.labels] == [label for _, label in split]
    assert sets[2].ids[-1][-1] == 1 and any(0 in ids for ids in sets[0].ids)


def test_vocab_orders_by_count_and_maps_unknown_to_one():
    vocab = Vocab.build([["b", "a", "b", "e"], ["d", "c", "a", "b"]])
    assert vocab.decode(range(len(vocab))) == ["<pad>", "<unk>", "b", "a", "c", "d", "e"]  # ties: alphabetically
    assert Vocab.build([["b", "e", "d", "c", "a", "b"]], max_size=4).decode(range(4)) == ["<pad>", "<unk>", "b", "a"]
    assert vocab.encode(["a", "zzz", "<pad>"]) == [3, 1, 0]


def test_vocab_max_size_and_min_count():
    texts = [["a"] * 3 + ["b"] * 2 + ["c"]]
    assert len(Vocab.build(texts, max_size=3)) == 3
    assert Vocab.build(texts, min_count=2).encode(["a", "b", "c"]) == [2, 3, 1]
    with pytest.raises(ValueError, match="max_size"):
        Vocab.build(texts, max_size=1)


def test_vocab_json_round_trip():
    vocab = Vocab.build([tokenize("the cat sat on the mat"), tokenize("a dog!")])
    again = Vocab.from_json(json.loads(json.dumps(vocab.to_json())))
    assert again == vocab
    assert again.encode(tokenize("the dog sat")) == vocab.encode(tokenize("the dog sat"))
    with pytest.raises(ValueError, match="tokens"):
        Vocab.from_json({"words": []})
    with pytest.raises(ValueError, match="start with"):
        Vocab.from_json({"tokens": ["a", "b"]})


# --- loaders -----------------------------------------------------------------------


@needs_trec
def test_trec_counts_and_labels():
    train, test = text.load_trec(TREC_DIR)
    assert (len(train), len(test)) == (5452, 500)
    assert train.label_names == ["ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM"]
    assert test.vocab is train.vocab and test.label_names is train.label_names
    assert np.bincount(train.labels).tolist() == [86, 1162, 1250, 1223, 835, 896]
    assert any(1 in ids for ids in test.ids)  # words unseen in training map to <unk>
    fine_train, fine_test = text.load_trec(TREC_DIR, fine=True)
    assert fine_train.n_labels == 50 and "NUM:dist" in fine_train.label_names


def test_trec_bad_line_names_file_and_line(tmp_path):
    folder = _write_trec(tmp_path, "NUM:dist How far ?\n\nnolabel here\n", "NUM:dist Far ?\n")
    with pytest.raises(ValueError, match=r"TREC\.train:3"):
        text.load_trec(folder)


def test_trec_unknown_test_label_is_an_error(tmp_path):
    folder = _write_trec(tmp_path, "NUM:dist How far ?\n", "LOC:city Where ?\n")
    with pytest.raises(ValueError, match=r"'LOC'.*|TREC\.test") as info:
        text.load_trec(folder)
    assert "'LOC'" in str(info.value) and "TREC.test" in str(info.value)


def test_trec_reads_latin1_training_file(tmp_path):
    folder = _write_trec(tmp_path, "HUM:ind Who is Pel\xe9 ?\n", "HUM:ind Who is Pele ?\n")
    train, test = text.load_trec(folder)
    assert train.vocab.decode(train.ids[0]) == ["who", "is", "pele", "?"]
    assert test.ids == train.ids


def test_generated_is_deterministic_per_seed():
    a_train, a_test = topics.generate_topics(seed=5, n_train=500, n_test=100)
    b_train, b_test = topics.generate_topics(seed=5, n_train=500, n_test=100)
    c_train, _ = topics.generate_topics(seed=6, n_train=500, n_test=100)
    assert a_train.ids == b_train.ids and a_test.labels == b_test.labels
    assert a_train.vocab == b_train.vocab and a_train.label_names == b_train.label_names
    assert a_train.ids != c_train.ids


def test_generated_shape_matches_arguments():
    train, test = topics.generate_topics(seed=1, n_train=800, n_test=200, n_labels=4)
    assert (len(train), len(test), train.n_labels) == (800, 200, 4)
    assert all(5 <= len(ids) <= 30 for ids in train.ids)
    assert len(set(map(tuple, train.ids))) > 790  # sentences are not copies of each other
    with pytest.raises(ValueError, match="label_noise"):
        topics.generate_topics(label_noise=1.5)


@needs_sst2
def test_sst2_counts_and_labels():
    train, test = specs.load(f"sst2:{SST2_DIR}")
    assert (len(train), len(test)) == (6920, 1821)
    assert train.label_names == ["0", "1"] and test.vocab is train.vocab
    assert np.bincount(train.labels).tolist() == [3310, 3610]


def test_sst2_bad_line_names_file_and_line(tmp_path):
    (tmp_path / "stsa.binary.train").write_text("1 a fine film\n0\n", encoding="utf-8")
    (tmp_path / "stsa.binary.test").write_text("1 good\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"stsa\.binary\.train:2: expected 'LABEL sentence'"):
        text.load_sst2(tmp_path)
    (tmp_path / "stsa.binary.train").write_text("1 a fine film\n", encoding="utf-8")
    (tmp_path / "stsa.binary.test").write_text("2 good\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"label '2' does not occur"):
        text.load_sst2(tmp_path)


def test_load_spec():
    train, _ = specs.load("generated:3")
    assert train.ids == topics.generate_topics(seed=3)[0].ids
    with pytest.raises(ValueError, match="'generated:SEED'"):
        specs.load("mnist")
    with pytest.raises(ValueError, match="not an integer"):
        specs.load("generated:x")


# --- batches -----------------------------------------------------------------------


@pytest.mark.parametrize("shards,batch_size", [(1, 4), (2, 2), (3, 5)])
def test_shards_cover_every_sample_once_per_epoch(shards, batch_size):
    data = _indexed_dataset(23)
    orders = []
    for epoch in range(2):
        seen = []
        for shard in range(shards):
            for x, y in batches(data, batch_size, epoch=epoch, seed=7, shard=shard, shards=shards):
                assert x.shape[0] == y.shape[0] <= batch_size
                seen.extend(y.tolist())
        assert sorted(seen) == list(range(23))
        orders.append(seen)
    assert orders[0] != orders[1]  # each epoch has its own permutation


def test_shards_interleave_one_permutation():
    data = _indexed_dataset(10)
    whole = [int(v) for _, y in batches(data, 3, epoch=1, seed=2) for v in y]
    for shard in range(3):
        part = [
            int(v) for _, y in batches(data, 3, epoch=1, seed=2, shard=shard, shards=3) for v in y
        ]
        assert part == whole[shard::3]


def test_batches_pad_to_longest_but_at_least_min_len():
    data = _indexed_dataset(8)
    for x, y in batches(data, 3, epoch=0, seed=0):
        lengths = (x != 0).sum(dim=1)
        assert lengths.tolist() == [int(v) + 1 for v in y]  # padding is 0, after the words
        assert x.shape[1] == max(5, int(lengths.max()))
        assert x.dtype == y.dtype == torch.long
    (x, _), = batches(_indexed_dataset(3), 3, epoch=0, seed=0)  # all shorter than min_len
    assert x.shape == (3, 5)


def test_batches_reject_bad_shard():
    with pytest.raises(ValueError, match="shard 2 of 2"):
        next(batches(_indexed_dataset(4), 2, epoch=0, seed=0, shard=2, shards=2))


# --- model and registry ------------------------------------------------------------


def test_textcnn_small_batches_compute_what_its_convolutions_compute(monkeypatch):
    """A small CPU batch goes through the text CNN as matrix products over its windows (faster
    at a mini-batch of a few sentences): the logits and every gradient are the convolutions'
    (`nn.Conv1d` over the same weights, the path of every larger batch), to float rounding."""
    from gadei_workloads import textcnn

    model = build_textcnn(60, 4, seed=2, dropout=0.0)
    padded = torch.tensor([[7, 8, 9, 10, 0, 0, 0, 0, 0], [3, 4, 5, 6, 7, 8, 9, 10, 11]])
    largest = textcnn.SMALL_INPUT
    for x in (torch.randint(1, 60, (2, 9)), torch.randint(1, 60, (1, 5)), padded):
        assert x.numel() <= largest
        y = torch.tensor([1, 3][: len(x)])
        grads = []
        for small in (largest, 0):
            monkeypatch.setattr(textcnn, "SMALL_INPUT", small)
            model.zero_grad(set_to_none=True)
            logits = model(x)
            torch.nn.functional.cross_entropy(logits, y).backward()
            grads.append((logits, {n: p.grad.to_dense() for n, p in model.named_parameters()}))
        (got, got_grads), (expected, expected_grads) = grads
        assert torch.allclose(got, expected, atol=1e-6)
        for name in expected_grads:
            assert torch.allclose(got_grads[name], expected_grads[name], atol=1e-6), name


def test_textcnn_pools_only_the_windows_inside_each_sentence():
    """A sentence's logits and gradients do not depend on how far its batch padded it, in the
    small-batch path and the convolutions' alike: the max-pool leaves out the windows that
    only padding extends past the sentence (a padded position's ReLU'd bias would otherwise be
    a filter's maximum, so training, validation and `gadei predict` would see other models)."""
    model = build_textcnn(60, 4, seed=2, dropout=0.0)
    with torch.no_grad():
        for conv in model.convs:  # a padded position's activation is its bias: make it count
            conv.bias.uniform_(0.2, 0.5)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 4, 5, 6, 11):
        ids = torch.randint(1, 60, (n,), generator=gen)
        seen = []
        for length, rows in ((max(n, model.min_len), 1), (max(n, model.min_len) + 4, 1), (40, 1), (40, 8)):
            x = torch.zeros(rows, length, dtype=torch.long)
            x[:, :n] = ids
            model.zero_grad(set_to_none=True)
            logits = model(x)[:1]
            logits.sum().backward()
            seen.append((logits.detach(), model.convs[0].weight.grad.clone()))
        for logits, grad in seen[1:]:
            assert torch.allclose(logits, seen[0][0], atol=1e-5), n
            assert torch.allclose(grad, seen[0][1], atol=1e-5), n


def test_accuracy_labels_each_sentence_as_alone():
    """A sentence's label in an evaluation does not depend on the sentences batched with it:
    the accuracy of a set is the share that the model labels right one sentence at a time, as
    `gadei predict` does (with the text CNN's padded positions made to count, were they pooled)."""
    workload = gadei_workloads.get("textcnn")
    train, test = topics.generate_topics(seed=3, n_train=300, n_test=400, min_len=1, max_len=60)
    model = workload.build_model(train, 0)
    with torch.no_grad():
        for conv in model.convs:  # a padded position's activation is its bias: make it count
            conv.bias.uniform_(0.0, 0.5)
    model.eval()
    alone = 0
    with torch.no_grad():
        for ids, label in zip(test.ids, test.labels):
            x = torch.tensor([ids + [0] * max(0, model.min_len - len(ids))])
            alone += int(model(x).argmax(dim=1).item() == label)
    assert workload.evaluate(model, test) == alone / len(test)


def test_model_is_deterministic_by_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = build_textcnn(50, 3, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(999)
    b = build_textcnn(50, 3, seed=4)
    c = build_textcnn(50, 3, seed=5)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embedding.weight, c.embedding.weight)
    assert torch.count_nonzero(a.embedding.weight[0]) == 0  # padding row


def test_model_output_shape_and_short_input_error():
    model = build_textcnn(50, 3, embed_dim=16, filters=8)
    assert model(torch.randint(50, (4, 7))).shape == (4, 3)
    with pytest.raises(ValueError, match="shorter than the widest filter 5"):
        model(torch.zeros(2, 4, dtype=torch.long))


def test_registry_and_training_learns_generated_data():
    with pytest.raises(ValueError, match="known: lstm, mlp, ngram, textcnn"):
        gadei_workloads.get("resnet")
    model, acc = _train_on_generated("textcnn", epochs=1, lr=0.1)
    assert model.training  # evaluate restores the mode
    assert acc > 0.6, f"one epoch on generated data reached only {acc:.3f} (chance 0.17)"


def test_the_lstm_is_deterministic_by_seed_ignores_padding_and_learns_generated_data():
    from gadei_workloads import build_lstm

    a, b = build_lstm(60, 4, seed=3), build_lstm(60, 4, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    a.eval()
    x = torch.tensor([[5, 6, 7]])
    padded = torch.tensor([[5, 6, 7, 0, 0, 0]])
    assert torch.allclose(a(x), a(padded), atol=1e-6)  # padding (after the words) changes nothing
    _, acc = _train_on_generated("lstm", epochs=2, lr=0.5)
    assert acc > 0.6, f"two epochs on generated data reached only {acc:.3f} (chance 0.17)"


def _train_on_generated(name: str, epochs: int, lr: float):
    """(model, test accuracy) after `epochs` of plain SGD, mini-batch 8, on generated topics."""
    workload = gadei_workloads.get(name)
    train, test = topics.generate_topics(seed=1, n_train=1500, n_test=300)
    model = workload.build_model(train, 0)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps: extra threads only contend on a busy machine
    try:
        for epoch in range(epochs):
            for x, y in batches(train, 8, epoch=epoch, seed=0):
                optimizer.zero_grad(set_to_none=True)
                workload.loss(model, x, y).backward()
                optimizer.step()
        return model, workload.evaluate(model, test)
    finally:
        torch.set_num_threads(threads)
