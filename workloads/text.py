"""Text data for the workloads: files or a generator (:mod:`.topics`) -> tokens -> ids -> padded batches.

A learner asks :func:`.specs.load` for a ``(train, test)`` pair of :class:`TextDataset`, then
iterates :func:`batches` once per epoch over its shard, and measures with
:func:`accuracy`. Both sets share one :class:`Vocab` and one label map, each built from
the training set only, so every learner of a job encodes text identically.
"""

from __future__ import annotations

import collections
import logging
import re
import unicodedata
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

__all__ = [
    "PAD",
    "UNK",
    "TextDataset",
    "Vocab",
    "accuracy",
    "batches",
    "probabilities",
    "load_trec",
    "rows_touched",
    "tokenize",
]

logger = logging.getLogger(__name__)

PAD = "<pad>"
UNK = "<unk>"

# Contractions split off as their own token ("don't" -> "do n't"), the other tokens are
# runs of letters/digits and the punctuation Kim 2014 keeps; everything else separates.
Tokens = Callable[[list[str]], list[str]]
"""What a vocabulary indexes of a sentence's words: the words (None), or a workload's tokens of
them (the n-gram workload's uni- and bigrams, :func:`.ngram.ngrams`)."""

_TOKEN_RE = re.compile(r"[a-z0-9]+(?=n't)|n't|'(?:s|ve|re|d|ll|m)\b|[a-z0-9]+|[(),!?]")


def tokenize(text: str) -> list[str]:
    """Split a sentence into lower-case words and punctuation, after Kim 2014's clean_str.

    Accents are stripped (``café`` -> ``cafe``), the text is lower-cased, contractions
    are split off (``don't`` -> ``do n't``, ``it's`` -> ``it 's``), and ``( ) , ! ?``
    become tokens of their own. Any other character (quotes, hyphens, periods, symbols)
    only separates words.

    Args:
        text: One sentence.

    Returns:
        The tokens, possibly empty.
    """
    if not text.isascii():  # ASCII has no accents to strip (NFKD leaves it as it is): most texts, read fast
        text = unicodedata.normalize("NFKD", text)
        text = "".join(ch for ch in text if not unicodedata.combining(ch))
    return _TOKEN_RE.findall(text.lower())


class Vocab:
    """A token <-> id map; id 0 is the padding token, id 1 the unknown token.

    Build it with :meth:`build` from the training texts; it is frozen afterwards.
    """

    def __init__(self, tokens: Sequence[str]):
        """Wraps an explicit token list (use :meth:`build` to count a corpus).

        Args:
            tokens: All tokens in id order; must start with ``<pad>``, ``<unk>`` and
                hold no duplicates.

        Raises:
            ValueError: If the list does not start with the two special tokens or
                holds a token twice.
        """
        tokens = list(tokens)
        if tokens[:2] != [PAD, UNK]:
            raise ValueError(f"vocab: must start with {[PAD, UNK]}, starts with {tokens[:2]}")
        self._itos = tokens
        self._stoi = {tok: i for i, tok in enumerate(tokens)}
        if len(self._stoi) != len(tokens):
            dupes = [t for t, n in collections.Counter(tokens).items() if n > 1]
            raise ValueError(f"vocab: duplicate tokens {dupes[:5]}")

    @classmethod
    def build(
        cls, texts: Iterable[Sequence[str]], max_size: int = 20000, min_count: int = 1
    ) -> Vocab:
        """Counts tokenised texts and keeps the most frequent tokens.

        Ties in frequency are broken alphabetically so the result does not depend on
        the order of the texts.

        Args:
            texts: Token lists (the training set only).
            max_size: Most ids in all, the two special tokens included.
            min_count: A token seen fewer times maps to ``<unk>``.

        Returns:
            The vocabulary.

        Raises:
            ValueError: If ``max_size`` < 2 or ``min_count`` < 1.
        """
        counts: collections.Counter[str] = collections.Counter()
        for tokens in texts:
            counts.update(tokens)
        return cls.of_counts(counts, max_size=max_size, min_count=min_count)

    @classmethod
    def of_counts(cls, counts: dict[str, int], max_size: int = 20000, min_count: int = 1) -> Vocab:
        """The vocabulary :meth:`build` makes of texts whose tokens were counted to ``counts``."""
        if max_size < 2:
            raise ValueError(f"vocab: max_size must be >= 2 (pad and unk), got {max_size}")
        if min_count < 1:
            raise ValueError(f"vocab: min_count must be >= 1, got {min_count}")
        kept = [t for t, n in counts.items() if n >= min_count and t not in (PAD, UNK)]
        kept.sort()  # alphabetically, then by count: the sorts are stable (twice as fast as one on (-count, token))
        kept.sort(key=counts.__getitem__, reverse=True)
        return cls([PAD, UNK, *kept[: max_size - 2]])

    def __len__(self) -> int:
        return len(self._itos)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocab) and self._itos == other._itos

    def __repr__(self) -> str:
        return f"Vocab({len(self)} tokens)"

    def encode(self, tokens: Sequence[str]) -> list[int]:
        """Maps tokens to ids; unknown tokens map to 1 (``<unk>``)."""
        stoi = self._stoi
        return [stoi.get(tok, 1) for tok in tokens]

    def decode(self, ids: Sequence[int]) -> list[str]:
        """Maps ids back to tokens (padding included)."""
        return [self._itos[i] for i in ids]

    def to_json(self) -> dict:
        """Returns a JSON-serialisable form: ``{"tokens": [...]}`` in id order."""
        return {"tokens": list(self._itos)}

    @classmethod
    def from_json(cls, data: dict) -> Vocab:
        """Rebuilds a vocabulary from :meth:`to_json` output.

        Raises:
            ValueError: If ``data`` has no ``tokens`` list.
        """
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list):
            raise ValueError(
                f"vocab: expected a dict with a 'tokens' list, got {type(data).__name__}"
            )
        return cls(tokens)


@dataclass
class TextDataset:
    """Encoded sentences and their labels.

    Attributes:
        ids: Token ids per sentence (variable length, no padding).
        labels: Label index per sentence, into ``label_names``.
        label_names: Label strings, index = label id (shared by train and test).
        vocab: The vocabulary the ids refer to (shared by train and test).
        name: Where the data came from, for logs (``"trec:/path (train)"``).
    """

    ids: list[list[int]]
    labels: list[int]
    label_names: list[str]
    vocab: Vocab
    name: str = ""

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.labels):
            raise ValueError(
                f"dataset {self.name!r}: {len(self.ids)} sentences but {len(self.labels)} labels"
            )

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def n_labels(self) -> int:
        """Number of distinct labels (the model's output size)."""
        return len(self.label_names)


def _encode_split(
    train: list[tuple[list[str], str]],
    test: list[tuple[list[str], str]],
    *,
    name: str,
    test_source: str,
    max_size: int,
    min_count: int,
    tokens: Tokens | None = None,
) -> tuple[TextDataset, TextDataset]:
    """Builds vocab and label map from ``train`` and encodes both splits with them (each row's
    words made into ``tokens(words)`` first, where given).

    A row's tokens are made once and never kept as strings: each is numbered as it is first
    seen, the numbers counted, and the vocabulary :meth:`Vocab.build` would make of those
    counts maps each number to its id. (The n-gram workload's tokens of a large set, kept as
    strings until the vocabulary was built, took several times the memory of its words.)"""
    label_names = sorted({label for _, label in train})
    label_ids = {label: i for i, label in enumerate(label_names)}
    for _, label in test:
        if label not in label_ids:
            raise ValueError(
                f"{test_source}: label {label!r} does not occur in the training set "
                f"(known: {', '.join(label_names)})"
            )
    seen: collections.defaultdict[str, int] = collections.defaultdict()  # train's tokens, numbered as first seen
    seen.default_factory = seen.__len__
    number = seen.__getitem__
    numbers, ends = array("q"), []  # every row's numbers, one after another (8 bytes a token); where each row ends
    for words, _ in train:
        numbers.extend(map(number, tokens(words) if tokens is not None else words))
        ends.append(len(numbers))
    flat = np.frombuffer(numbers, dtype=np.int64)
    counts = np.bincount(flat, minlength=len(seen)).tolist()  # by number: in the order `seen` holds the tokens
    vocab = Vocab.of_counts(dict(zip(seen, counts)), max_size=max_size, min_count=min_count)
    ids = vocab.encode(list(seen))  # a number's id (a token not kept: unknown)
    del seen, counts, flat
    train_ids = list(map(ids.__getitem__, numbers))  # one int object for each id, not each token
    del numbers
    starts = [0, *ends[:-1]]

    def dataset(rows: list, split: str, encoded: list[list[int]]) -> TextDataset:
        return TextDataset(
            ids=encoded,
            labels=[label_ids[label] for _, label in rows],
            label_names=label_names,
            vocab=vocab,
            name=f"{name} ({split})",
        )

    return (dataset(train, "train", [train_ids[a:b] for a, b in zip(starts, ends)]),
            dataset(test, "test", encode_rows(vocab, test, tokens)))


def encode_rows(vocab: Vocab, rows: list[tuple[list[str], str]], tokens: Tokens | None) -> list[list[int]]:
    """The ids of each (words, label) row's tokens (``tokens(words)``, or the words)."""
    return [vocab.encode(tokens(words) if tokens is not None else words) for words, _ in rows]


def encode_split(
    train: list[tuple[list[str], str]],
    test: list[tuple[list[str], str]],
    *,
    name: str,
    test_source: str,
    max_size: int = 20000,
    min_count: int = 1,
    tokens: Tokens | None = None,
) -> tuple[TextDataset, TextDataset]:
    """(train, test) datasets from (words, label) rows: vocabulary and label map from train;
    ``tokens`` makes a row's words into what the vocabulary indexes (a workload's
    :attr:`Workload.tokens`, such as the n-gram workload's uni- and bigrams; None: the words).

    Raises:
        ValueError: a test label does not occur in train (naming ``test_source``).
    """
    return _encode_split(train, test, name=name, test_source=test_source, max_size=max_size, min_count=min_count,
                         tokens=tokens)


def encode_splits(
    train: list[tuple[list[str], str]],
    validation: list[tuple[list[str], str]] | None,
    test: list[tuple[list[str], str]],
    *,
    name: str,
    validation_source: str,
    test_source: str,
    max_size: int = 20000,
    min_count: int = 1,
    tokens: Tokens | None = None,
) -> tuple[TextDataset, TextDataset, TextDataset]:
    """(train, validation, test) datasets from (words, label) rows: vocabulary and label map
    from train only; validation None when there are no validation rows (None); ``tokens`` as
    for :func:`encode_split`.

    Raises:
        ValueError: a validation or test label does not occur in train (the message starts
            with ``validation_source`` or ``test_source``).
    """
    train_set, test_set = _encode_split(train, test, name=name, test_source=test_source, max_size=max_size,
                                        min_count=min_count, tokens=tokens)
    if validation is None:
        return train_set, None, test_set
    label_ids = {label: i for i, label in enumerate(train_set.label_names)}
    for _, label in validation:
        if label not in label_ids:
            raise ValueError(f"{validation_source}: label {label!r} does not occur in the training set "
                             f"(known: {', '.join(train_set.label_names)})")
    validation_set = TextDataset(ids=encode_rows(train_set.vocab, validation, tokens),
                                 labels=[label_ids[label] for _, label in validation],
                                 label_names=train_set.label_names, vocab=train_set.vocab, name=f"{name} (validation)")
    return train_set, validation_set, test_set


def rows_touched(dataset: TextDataset, batch: int) -> int:
    """The most distinct ids (rows of the model's embedding table, padding's among them) one
    mini-batch of ``batch`` samples of ``dataset`` can hold: those of its ``batch`` samples that
    hold the most, added up."""
    import heapq

    return 1 + sum(heapq.nlargest(batch, (len(set(ids)) for ids in dataset.ids)))


def hold_out(
    rows: list[tuple[list[str], str]], fraction: float, seed: int, stream: int = 7919
) -> tuple[list[tuple[list[str], str]], list[tuple[list[str], str]]]:
    """Splits ``rows`` into (train, held out): ``fraction`` of each label, at least one,
    chosen with ``seed`` (the same split in every process); a label with a single sample
    stays in train. ``stream`` tells splits of one seed apart (the test hold-out's is the
    default, a validation hold-out takes another)."""
    rng = np.random.default_rng([seed, stream])
    by_label: dict[str, list[int]] = {}
    for i, (_, label) in enumerate(rows):
        by_label.setdefault(label, []).append(i)
    held: set[int] = set()
    for label in sorted(by_label):
        members = by_label[label]
        if len(members) < 2:
            continue
        k = max(1, int(round(fraction * len(members))))
        held.update(members[j] for j in rng.permutation(len(members))[:k])
    train = [row for i, row in enumerate(rows) if i not in held]
    test = [row for i, row in enumerate(rows) if i in held]
    return train, test


def _read_rows(path: Path, encoding: str, kind: str, expected: str, parse) -> list[tuple[list[str], str]]:
    """Reads one sample per line: ``parse(line) -> (text, label)`` or None where the line is
    not of the form ``expected``; returns (tokens, label) pairs. ``kind`` names the file in errors."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise FileNotFoundError(f"{kind} file {str(path)!r}: {err.strerror}") from err
    rows = []
    # Split on b"\n" only: str.splitlines() would also split on Latin-1 control bytes.
    for lineno, line in enumerate(raw.decode(encoding).split("\n"), start=1):
        line = line.strip()
        if not line:
            continue
        parsed = parse(line)
        if parsed is None or not parsed[0].strip():
            raise ValueError(f"{path}:{lineno}: expected {expected!r}, got {line[:60]!r}")
        rows.append((tokenize(parsed[0]), parsed[1]))
    if not rows:
        raise ValueError(f"{path}: no samples")
    return rows


def _read_trec_file(path: Path, encoding: str, fine: bool) -> list[tuple[list[str], str]]:
    """Parses ``COARSE:fine question text`` lines into (tokens, label) pairs."""

    def parse(line: str):
        label, _, text = line.partition(" ")
        coarse, colon, fine_label = label.partition(":")
        if colon and coarse and fine_label:
            return text, label if fine else coarse
        return None

    return _read_rows(path, encoding, "TREC", "COARSE:fine question text", parse)


def load_trec(
    folder: str | Path, fine: bool = False, *, max_size: int = 20000, min_count: int = 1, tokens: Tokens | None = None
) -> tuple[TextDataset, TextDataset]:
    """Loads the TREC question-classification set (5,452 train / 500 test).

    Args:
        folder: Directory holding ``TREC.train`` (Latin-1) and ``TREC.test`` (ASCII).
        fine: Use the 50 fine labels (named ``COARSE:fine``) instead of the 6 coarse ones.
        max_size: Vocabulary size limit, see :meth:`Vocab.build`.
        min_count: Vocabulary frequency cut-off, see :meth:`Vocab.build`.
        tokens: What the vocabulary indexes of a sentence's words (None: the words), see
            :func:`encode_split`.

    Returns:
        ``(train, test)`` sharing one vocabulary and label map, built from train.

    Raises:
        FileNotFoundError: If a file is missing.
        ValueError: If a line cannot be parsed (naming file and line) or a test label
            does not occur in the training set.
    """
    folder = Path(folder)
    train_path, test_path = folder / "TREC.train", folder / "TREC.test"
    # The test file is ASCII; Latin-1 decodes it identically and never fails.
    train = _read_trec_file(train_path, "latin-1", fine)
    test = _read_trec_file(test_path, "latin-1", fine)
    name = f"trec{'-fine' if fine else ''}:{folder}"
    return _encode_split(
        train, test, name=name, test_source=str(test_path), max_size=max_size, min_count=min_count, tokens=tokens
    )


def _read_labelled_lines(path: Path, encoding: str) -> list[tuple[list[str], str]]:
    """Parses ``LABEL sentence`` lines (SST-2's ``stsa.binary.*``) into (tokens, label) pairs."""

    def parse(line: str):
        label, _, text = line.partition(" ")
        return (text, label) if label else None

    return _read_rows(path, encoding, "SST-2", "LABEL sentence", parse)


def load_sst2(
    folder: str | Path, *, max_size: int = 20000, min_count: int = 1, tokens: Tokens | None = None
) -> tuple[TextDataset, TextDataset]:
    """Loads SST-2 (binary sentence sentiment, 6,920 train / 1,821 test; the dev split is unused).

    ``folder`` holds ``stsa.binary.train`` and ``stsa.binary.test`` (UTF-8, one ``LABEL
    sentence`` per line, label 0 or 1); the other arguments, the result and the errors are
    those of :func:`load_trec`.
    """
    folder = Path(folder)
    train_path, test_path = folder / "stsa.binary.train", folder / "stsa.binary.test"
    train = _read_labelled_lines(train_path, "utf-8")
    test = _read_labelled_lines(test_path, "utf-8")
    return _encode_split(
        train, test, name=f"sst2:{folder}", test_source=str(test_path), max_size=max_size, min_count=min_count,
        tokens=tokens,
    )


def load_banking77(folder: str | Path, *, max_size: int = 20000, min_count: int = 1,
                   tokens: Tokens | None = None) -> tuple[TextDataset, TextDataset]:
    """Loads banking77 (77 intents, about 10,000 train / 3,080 test sentences).

    ``folder`` holds ``train.csv`` and ``test.csv`` (UTF-8 CSV with a header, columns ``text``
    and ``category``: the same samples a job file's ``format = "csv"`` reads); the other
    arguments, the result and the errors are those of :func:`load_trec`.
    """
    import csv

    def read(path: Path) -> list[tuple[list[str], str]]:
        with open(path, newline="", encoding="utf-8") as f:
            return [(tokenize(row["text"]), row["category"]) for row in csv.DictReader(f)]

    folder = Path(folder)
    train_path, test_path = folder / "train.csv", folder / "test.csv"
    train, test = read(train_path), read(test_path)
    return _encode_split(
        train, test, name=f"banking77:{folder}", test_source=str(test_path), max_size=max_size, min_count=min_count,
        tokens=tokens,
    )


def batches(
    dataset: TextDataset,
    batch_size: int,
    *,
    epoch: int,
    seed: int,
    shard: int = 0,
    shards: int = 1,
    min_len: int = 5,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yields one epoch of padded mini-batches from one shard of the data.

    The epoch's order is a permutation seeded by ``(seed, epoch)``, the same in every
    learner; shard ``i`` of ``n`` takes positions ``i, i+n, i+2n, ...`` of it, so ``n``
    learners together see every sample exactly once per epoch. Nothing is dropped: the
    last batch may be smaller, and shards may differ by one sample.

    Args:
        dataset: The data.
        batch_size: Samples per batch (>= 1).
        epoch: Epoch number (selects the permutation).
        seed: Job seed (selects the permutation).
        shard: This learner's shard, in ``[0, shards)``.
        shards: Number of shards.
        min_len: Pad every batch to at least this length (the widest filter of a CNN).

    Yields:
        ``(x, y)``: ``x`` a LongTensor ``[B, L]`` padded with 0 to the longest sentence
        of the batch (at least ``min_len``), ``y`` a LongTensor ``[B]`` of labels.

    Raises:
        ValueError: If ``batch_size``, ``shards``, ``shard``, ``epoch`` or ``seed`` is
            out of range.
    """
    if batch_size < 1:
        raise ValueError(f"batches: batch_size must be >= 1, got {batch_size}")
    if shards < 1 or not 0 <= shard < shards:
        raise ValueError(f"batches: shard {shard} of {shards} is out of range")
    if epoch < 0 or seed < 0:
        raise ValueError(f"batches: epoch ({epoch}) and seed ({seed}) must be >= 0")
    order = np.random.default_rng([seed, epoch]).permutation(len(dataset))[shard::shards]
    for start in range(0, len(order), batch_size):
        yield _padded(dataset, order[start : start + batch_size], min_len)


def _padded(dataset: TextDataset, idx, min_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``idx`` of ``dataset``: ids padded with 0 to the longest (at least ``min_len``), labels."""
    rows = [dataset.ids[i] for i in idx]
    x = torch.zeros(len(rows), max(min_len, max(map(len, rows))), dtype=torch.long)
    for r, ids in enumerate(rows):
        if ids:
            x[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return x, torch.tensor([int(dataset.labels[i]) for i in idx], dtype=torch.long)


def evaluation_batches(model: nn.Module, dataset: TextDataset,
                       batch_size: int = 256) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """``(indices, x, y)``: ``dataset`` in batches as every evaluation takes it (:func:`accuracy`,
    :func:`probabilities`, the evaluating learner's validation): sentences batched with others
    of their length, each padded only to the model's ``min_len`` as ``gadei predict`` pads one.
    The models leave padding out of their pooling, so this changes no label; it saves the work of
    padding a sentence to its batch's longest."""
    shortest = getattr(model, "min_len", 1)
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(dataset.ids):
        by_length.setdefault(max(shortest, len(ids)), []).append(i)
    for indices in by_length.values():
        for start in range(0, len(indices), batch_size):
            batch = indices[start : start + batch_size]
            yield (batch, *_padded(dataset, batch, shortest))


def accuracy(model: nn.Module, dataset: TextDataset, batch_size: int = 256) -> float:
    """Fraction of ``dataset`` the model labels correctly (eval mode, no gradients; the model's
    training mode restored after), in :func:`evaluation_batches`."""
    was_training = model.training
    model.eval()
    correct = 0
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for _, x, y in evaluation_batches(model, dataset, batch_size):
                correct += int((model(x.to(device)).argmax(dim=1).cpu() == y).sum())
    finally:
        model.train(was_training)
    return correct / len(dataset) if len(dataset) else float("nan")


def probabilities(model: nn.Module, dataset: TextDataset, batch_size: int = 256) -> torch.Tensor:
    """Each sample's label probabilities (the softmax of the model's outputs), a ``(len(dataset),
    labels)`` tensor on the CPU in the dataset's order; evaluated as :func:`accuracy` evaluates,
    so that its argmax is what :func:`accuracy` counts."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = torch.zeros(len(dataset), dataset.n_labels)
    try:
        with torch.no_grad():
            for indices, x, _ in evaluation_batches(model, dataset, batch_size):
                out[torch.tensor(indices)] = torch.softmax(model(x.to(device)), dim=-1).float().cpu()
    finally:
        model.train(was_training)
    return out
