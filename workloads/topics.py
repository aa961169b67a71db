"""The generated data set: sentences of made-up words, each label a topic whose words its
sentences favour (``"generated"`` and ``"generated:SEED"`` of :func:`.specs.load`), for a job or
a test that needs text without files: the same seed gives the same sets in every process."""

from __future__ import annotations

import numpy as np

from .text import TextDataset, Tokens, _encode_split

_CONSONANTS = list("bdfgklmnprstvz") + ["ch", "sh", "th"]
_VOWELS = list("aeiou") + ["ai", "ou"]
_CODAS = ["", "", "", "n", "r", "s", "l"]


def _make_words(rng: np.random.Generator, n: int) -> list[str]:
    """Draws ``n`` distinct pronounceable words of 1-3 consonant-vowel syllables."""
    words: dict[str, None] = {}
    while len(words) < n:
        k = 4 * (n - len(words))
        n_syll = rng.choice([1, 2, 2, 3, 3], size=k)
        cons = rng.integers(len(_CONSONANTS), size=(k, 3))
        vows = rng.integers(len(_VOWELS), size=(k, 3))
        codas = rng.integers(len(_CODAS), size=k)
        for i in range(k):
            syll = "".join(_CONSONANTS[cons[i, j]] + _VOWELS[vows[i, j]] for j in range(n_syll[i]))
            words.setdefault(syll + _CODAS[codas[i]], None)
            if len(words) == n:
                break
    return list(words)


def generate_topics(
    seed: int = 0,
    n_train: int = 4000,
    n_test: int = 1000,
    n_labels: int = 6,
    vocab_words: int = 3000,
    *,
    topic_words: int = 40,
    shared_topic_words: int = 10,
    p_topic: float = 0.4,
    p_other_topic: float = 0.04,
    min_len: int = 5,
    max_len: int = 30,
    label_noise: float = 0.03,
    tokens: Tokens | None = None,
) -> tuple[TextDataset, TextDataset]:
    """Generates a topic-classification data set of made-up words; no files needed.

    Each label has ``topic_words`` topical words, ``shared_topic_words`` of them shared
    with each of its two neighbouring labels (so some words point to two labels). A sentence of
    uniform length in ``[min_len, max_len]`` draws each token from its label's topic
    (Zipfian over the topic words) with probability ``p_topic``, from a random other
    label's topic with probability ``p_other_topic``, and otherwise from a Zipfian
    background over all words. Then ``label_noise`` of the labels (train and test) are
    replaced by a random other label. Short sentences with no or ambiguous topical
    words, plus the label noise, keep a text CNN at roughly 85-95% test accuracy.

    The result depends only on the arguments (bit-identical for a seed), and takes
    well under a second for the defaults.

    Args:
        seed: Seed of the generator.
        n_train: Training sentences.
        n_test: Test sentences.
        n_labels: Number of labels (>= 2).
        vocab_words: Distinct words in the language (>= labels * topic words).
        topic_words: Topical words per label.
        shared_topic_words: Of those, how many are shared with each neighbouring label
            (``2 * shared_topic_words < topic_words``).
        p_topic: Per-token probability of a word from the sentence's own topic.
        p_other_topic: Per-token probability of a word from another label's topic.
        min_len: Shortest sentence, in tokens.
        max_len: Longest sentence, in tokens.
        label_noise: Fraction of labels replaced by a random wrong label.
        tokens: What the vocabulary indexes of a sentence's words (None: the words), see
            :func:`encode_split`; every token of the training set gets an id.

    Returns:
        ``(train, test)`` sharing one vocabulary and label map, built from train.

    Raises:
        ValueError: If an argument is out of range.
    """
    _check_generate_args(
        n_train=n_train, n_test=n_test, n_labels=n_labels, vocab_words=vocab_words,
        topic_words=topic_words, shared_topic_words=shared_topic_words, p_topic=p_topic,
        p_other_topic=p_other_topic, min_len=min_len, max_len=max_len, label_noise=label_noise,
    )
    rng = np.random.default_rng(seed)
    words = _make_words(rng, vocab_words)
    label_names = [f"{w}_topic" for w in _make_words(np.random.default_rng([seed, 1]), n_labels)]

    # Label k's table: its own words, the block it shares with label k+1 and the block
    # label k-1 shares with it; columns shuffled per label so shared words get mixed ranks.
    own = topic_words - 2 * shared_topic_words
    pool = rng.permutation(vocab_words)[: n_labels * (own + shared_topic_words)]
    own_words = pool[: n_labels * own].reshape(n_labels, own)
    shared = pool[n_labels * own :].reshape(n_labels, shared_topic_words)
    topics = np.concatenate([own_words, shared, np.roll(shared, 1, axis=0)], axis=1)
    topics = rng.permuted(topics, axis=1)

    n = n_train + n_test
    labels = rng.integers(n_labels, size=n)
    lengths = rng.integers(min_len, max_len + 1, size=n)
    total = int(lengths.sum())
    token_label = np.repeat(labels, lengths)
    kind = rng.random(total)
    other = (token_label + rng.integers(1, n_labels, size=total)) % n_labels
    # Which topic each token comes from; -1 = the background.
    source = np.where(kind < p_topic + p_other_topic, other, -1)
    source = np.where(kind < p_topic, token_label, source)

    # Background: Zipfian over all words, the ranks assigned to words at random.
    zipf_bg = 1.0 / np.arange(1, vocab_words + 1) ** 1.07
    rank_to_word = rng.permutation(vocab_words)
    background = rank_to_word[rng.choice(vocab_words, size=total, p=zipf_bg / zipf_bg.sum())]
    zipf_topic = 1.0 / np.arange(1, topics.shape[1] + 1) ** 0.8
    in_topic = rng.choice(topics.shape[1], size=total, p=zipf_topic / zipf_topic.sum())
    topical = topics[np.maximum(source, 0), in_topic]
    drawn = np.where(source >= 0, topical, background)

    noisy = rng.random(n) < label_noise
    labels = np.where(noisy, (labels + rng.integers(1, n_labels, size=n)) % n_labels, labels)

    bounds = np.concatenate([[0], np.cumsum(lengths)])
    rows = [
        ([words[t] for t in drawn[bounds[i] : bounds[i + 1]]], label_names[labels[i]])
        for i in range(n)
    ]
    return _encode_split(
        rows[:n_train], rows[n_train:], name=f"generated:{seed}",
        test_source=f"generated:{seed}",
        max_size=vocab_words + 2 if tokens is None else n_train * (2 * max_len + 1) + 2,  # every token of train
        min_count=1, tokens=tokens,
    )


def _check_generate_args(**kw: float) -> None:
    """Raises ValueError naming the first out-of-range argument of generate_topics."""
    checks = [
        ("n_train", kw["n_train"] >= 1),
        ("n_test", kw["n_test"] >= 1),
        ("n_labels", kw["n_labels"] >= 2),
        ("topic_words", kw["topic_words"] >= 1),
        ("shared_topic_words", 0 <= 2 * kw["shared_topic_words"] < kw["topic_words"]),
        ("vocab_words", kw["vocab_words"] >= kw["n_labels"] * kw["topic_words"]),
        ("p_topic", 0 <= kw["p_topic"] <= 1),
        ("p_other_topic", 0 <= kw["p_other_topic"] <= 1 - kw["p_topic"]),
        ("min_len", kw["min_len"] >= 1),
        ("max_len", kw["max_len"] >= kw["min_len"]),
        ("label_noise", 0 <= kw["label_noise"] < 1),
    ]
    for name, ok in checks:
        if not ok:
            raise ValueError(f"generate_topics: {name}={kw[name]!r} is out of range")
