"""The n-gram workload: a fastText-style linear classifier over a sentence's word uni- and
bigrams (Joulin et al. 2017, "Bag of Tricks for Efficient Text Classification").

:func:`ngrams` turns a sentence's words into the tokens its vocabulary indexes: each distinct
word and each distinct bigram, with a marker before the first word and after the last, so
that "<s> how" (a question's first word) and "how" inside a sentence are apart. The data
readers apply it before the vocabulary is built (:attr:`.Workload.tokens`), so the table has
one row for each n-gram of the training set and nothing is hashed; an n-gram the training set
never had is the unknown token, which the model leaves out. A sentence is the mean of its
n-grams' rows (an ``nn.EmbeddingBag`` with sparse gradients: a mini-batch touches a few dozen
rows of a table of tens of thousands, which gadei's rings carry as rows), and a linear layer
maps that mean to the labels. The model is a function of the vocabulary's size and the label
count, so ``gadei predict`` rebuilds it from the maps a run leaves.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["LR", "MAX_VOCAB", "NgramClassifier", "build_ngram", "dimension_for", "ngrams"]

logger = logging.getLogger(__name__)

MAX_VOCAB = 1_000_000
"""The most n-grams a table holds (the most frequent are kept; a set of 10,000 sentences has
about 100,000)."""
LR = 0.2
"""The workload's default learning rate (of Adagrad, the server's default update): a sentence
is the mean of a few dozen rows, each of which moves by about the learning rate in its first
steps; at 0.01 (the text CNN's) a row took tens of epochs to move as far."""
_GATHER = 16_384  # floats: a batch's rows up to which numpy gathers them faster than torch's embedding_bag
START, END = "<s>", "</s>"  # no word is either: the tokenizer keeps letters, digits and ( ) , ! ? only


def ngrams(words: Sequence[str]) -> list[str]:
    """A sentence's distinct word uni- and bigrams, in order of first appearance.

    Args:
        words: The sentence's words (:func:`.text.tokenize`).

    Returns:
        Each word once, then each bigram once, as ``"first second"``, the sentence's start and
        end marked (``"<s> how"``, ``"? </s>"``). An empty sentence has the one bigram
        ``"<s> </s>"``.
    """
    marked = [START, *words, END]
    return list(dict.fromkeys([*words, *(f"{a} {b}" for a, b in zip(marked, marked[1:]))]))


def dimension_for(n_labels: int) -> int:
    """The width of the rows for ``n_labels`` labels: 16, or the next power of two at or above
    the label count where that is more (the mean of the rows is all the linear layer sees, so
    it needs room to keep every label apart: 128 for 77 intents)."""
    return max(16, 1 << (n_labels - 1).bit_length())


class NgramClassifier(nn.Module):
    """The mean of a sentence's n-gram rows -> linear layer (fastText's supervised model).

    Rows are initialised uniformly in ``[-1/dim, 1/dim]`` and the output layer at zero, as
    fastText does. Row 0 is padding and row 1 the unknown n-gram: neither is in a mean, so
    neither is trained.

    Args:
        vocab_size: Number of n-gram ids (the table's rows).
        n_labels: Number of output classes.
        dim: Width of the rows (default :func:`dimension_for` of the labels).
        sparse_grad: The table's gradient as the rows a mini-batch touched (gadei's rings
            carry them as rows; ``torch.optim.SGD`` applies them sparsely).

    Raises:
        ValueError: If a size is not positive.
    """

    min_len = 1

    def __init__(self, vocab_size: int, n_labels: int, dim: int | None = None, sparse_grad: bool = True):
        super().__init__()
        dim = dimension_for(n_labels) if dim is None else dim
        for name, value in {"vocab_size": vocab_size, "n_labels": n_labels, "dim": dim}.items():
            if value < 1:
                raise ValueError(f"NgramClassifier: {name} must be >= 1, got {value}")
        self.embedding = nn.EmbeddingBag(vocab_size, dim, mode="mean", sparse=sparse_grad, padding_idx=0)
        self.out = nn.Linear(dim, n_labels)
        with torch.no_grad():
            self.embedding.weight.uniform_(-1.0 / dim, 1.0 / dim)
            self.embedding.weight[0].zero_()
            self.out.weight.zero_()
            self.out.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, n_labels]`` of a batch ``[B, L]`` of n-gram ids padded with 0 (a
        sentence with no known n-gram gets the output layer's bias alone)."""
        return self.out(self.embedding(x.masked_fill(x == 1, 0)))

    @torch.no_grad()
    def accumulate_grads(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``cross_entropy(self(x), y).backward()`` does, in closed form, as fastText
        computes it: the gradient added to each parameter's ``.grad`` (the table's as the rows
        the batch touched, sparse where ``.grad`` is None or sparse). Autograd's bookkeeping
        costs more than the arithmetic of a model this small, and so does each of torch's
        operators on arrays this small: on the CPU the arithmetic is numpy's (on the same
        memory), but for the products, which stay torch's (its threads, `torch.set_num_threads`;
        numpy's BLAS would start threads of its own on a larger mini-batch).

        On the CPU only (`x`, `y` and the model there): on a GPU autograd's kernels are the
        ones to use (`Workload.gradient` takes them there).

        Returns:
            The batch's mean loss and how many of its sentences the model got right (0-d).
        """
        # the parameters from the modules' own tables (`self.embedding.weight` costs a few us a step)
        table = self._modules["embedding"]._parameters["weight"]
        out_weight, out_bias = self._modules["out"]._parameters["weight"], self._modules["out"]._parameters["bias"]
        ids, labels = x.numpy(), y.numpy()
        known = ids > 1  # neither padding (0) nor the unknown n-gram (1): what the mean takes
        per_sentence = known.sum(axis=1)
        counts = np.maximum(per_sentence, 1).astype(np.float32)[:, None]
        if ids.size * table.shape[1] <= _GATHER:  # a few rows: numpy's gather and sum cost least
            mean = torch.from_numpy((table.numpy()[ids] * known[..., None]).sum(axis=1) / counts)
        else:  # many: torch's kernel of the forward pass, a fixed cost of some tens of us, then little a row
            mean = nn.functional.embedding_bag(torch.from_numpy(np.where(known, ids, 0)), table, mode="mean",
                                               padding_idx=0)
        logits = torch.addmm(out_bias, mean, out_weight.t()).numpy()
        log_p = logits - logits.max(axis=1, keepdims=True)
        log_p -= np.log(np.exp(log_p).sum(axis=1, keepdims=True))
        batch = np.arange(len(labels))
        d_logits = np.exp(log_p)
        d_logits[batch, labels] -= 1.0
        d_logits /= len(labels)
        loss = -log_p[batch, labels].sum(dtype=np.float32) / np.float32(len(labels))
        d_logits_t = torch.from_numpy(d_logits)
        d_mean = torch.mm(d_logits_t, out_weight).numpy() / counts
        _add(out_weight, torch.mm(d_logits_t.t(), mean))
        _add(out_bias, torch.from_numpy(d_logits.sum(axis=0)))
        # the table's rows, coalesced: each n-gram's once, in order of the n-grams, the rows of an n-gram in
        # several sentences summed here (numpy's sum took 14 us at a batch of 4 on TREC; `torch.Tensor.coalesce`,
        # which a row-sparse push and SGD's sparse update call on a gradient that is not coalesced, 37)
        touched = ids[known]  # row-major: each sentence's n-grams in turn, as np.repeat lays out their rows
        order = np.argsort(touched)
        touched = touched[order]
        rows = np.repeat(d_mean, per_sentence, axis=0)[order]
        firsts = np.flatnonzero(np.concatenate(([True], touched[1:] != touched[:-1])))
        if len(firsts) < len(touched):
            touched, rows = touched[firsts], np.add.reduceat(rows, firsts, axis=0)
        _add(table, torch.sparse_coo_tensor(torch.from_numpy(touched[None]), torch.from_numpy(rows), table.shape,
                                            check_invariants=False, is_coalesced=True))
        return torch.from_numpy(np.asarray(loss)), torch.from_numpy(np.asarray((log_p.argmax(axis=1) == labels).sum()))


def _add(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Accumulate `grad` into `param.grad`, as backward does (a dense `.grad`, such as a view of
    a gadei ring slot, is added to in place; a sparse one is set where there is none)."""
    if param.grad is None:
        param.grad = grad
    elif param.grad.is_sparse:
        param.grad = param.grad + grad
    elif grad.is_sparse:
        grad = grad.coalesce()
        param.grad.index_add_(0, grad.indices()[0], grad.values())
    else:
        param.grad.add_(grad)


def build_ngram(vocab_size: int, n_labels: int, seed: int = 0, **kw) -> NgramClassifier:
    """An :class:`NgramClassifier` whose initial parameters depend only on the arguments (the
    global RNG is neither used nor changed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = NgramClassifier(vocab_size, n_labels, **kw)
    logger.debug("NgramClassifier: %d n-grams, width %d, labels %d, seed %d", vocab_size,
                 model.embedding.embedding_dim, n_labels, seed)
    return model
