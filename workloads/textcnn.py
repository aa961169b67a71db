"""The text-classification model the learners train: Kim 2014's sentence CNN (CNN-rand).

Token ids from :mod:`.text` go in, label logits come out; :func:`build_textcnn` makes
the same initial parameters in every process for a given seed.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import nn

__all__ = ["EMBED_DIM", "TextCNN", "build_textcnn"]

logger = logging.getLogger(__name__)

EMBED_DIM = 300
"""The embedding width: Kim 2014's. At 128 the model missed TREC's and SST-2's accuracy
targets whichever way it was trained (docs/benchmarks.md, "The model's width")."""

SMALL_INPUT = 128
"""A CPU batch of at most this many token positions (sentences x length) is convolved as one
matrix product over its windows (`_windows_product`) instead of by ``nn.Conv1d``: on one
thread 1.9x faster at a mini-batch of 1 and 1.75x at 2 (forward and backward, sentences of
about 12 tokens), level at about 16 x 12, slower above (0.75x at 32 x 20)."""


class TextCNN(nn.Module):
    """Embedding -> parallel 1-D convolutions -> ReLU -> max over the sentence's windows ->
    dropout -> linear.

    The embeddings are trained from scratch ("CNN-rand") and initialised uniformly in
    ``[-0.25, 0.25]`` as in Kim 2014; the padding row (id 0) stays zero. The max-pool takes the
    windows that lie inside the sentence (the first window alone where the sentence is shorter
    than the filter), so a sentence's logits and gradients are the same however far its batch
    pads it: in training, in evaluation and in ``gadei predict``.

    Args:
        vocab_size: Number of token ids (row 0 is padding).
        n_labels: Number of output classes.
        embed_dim: Embedding width (:data:`EMBED_DIM`).
        widths: Convolution widths, one filter bank per width.
        filters: Filters per width.
        dropout: Dropout probability before the output layer.
        max_norm: Kim's constraint: each row of the output layer's weights is kept at L2
            norm at most this (0: none). In a parameter server the learner cannot rescale
            the shared weights, so :meth:`constrain_grads` adds the rescaling to the
            gradient, as the correction the server's ``w -= lr * g`` then applies.
        sparse_grad: Make the embedding's gradient sparse (only the rows of the batch's
            tokens). Same SGD maths; at small mini-batches it saves almost all the work of
            the embedding's backward pass. A gadei learner adds it into the dense ring slot
            (an index-add); `torch.optim.SGD` applies it sparsely.

    Raises:
        ValueError: If a size is not positive or the dropout is outside ``[0, 1)``.
    """

    def __init__(
        self,
        vocab_size: int,
        n_labels: int,
        embed_dim: int = EMBED_DIM,
        widths: Sequence[int] = (3, 4, 5),
        filters: int = 100,
        dropout: float = 0.5,
        max_norm: float = 3.0,
        sparse_grad: bool = True,
    ):
        super().__init__()
        sizes = {"vocab_size": vocab_size, "n_labels": n_labels, "embed_dim": embed_dim,
                 "filters": filters, "widths": min(widths, default=0)}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"TextCNN: {name} must be >= 1, got {value}")
        if not 0 <= dropout < 1:
            raise ValueError(f"TextCNN: dropout must be in [0, 1), got {dropout}")
        if max_norm < 0:
            raise ValueError(f"TextCNN: max_norm must be >= 0, got {max_norm}")
        self.min_len = max(widths)
        self.max_norm = max_norm
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0, sparse=sparse_grad)
        self.convs = nn.ModuleList(nn.Conv1d(embed_dim, filters, w) for w in widths)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(filters * len(widths), n_labels)
        with torch.no_grad():
            self.embedding.weight.uniform_(-0.25, 0.25)
            self.embedding.weight[0].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Classifies a batch of sentences.

        Args:
            x: LongTensor ``[B, L]`` of token ids, padded with 0 after each sentence's words
                (id 0 is only padding), ``L`` at least the widest filter (:attr:`min_len`).

        Returns:
            Logits ``[B, n_labels]``.
        """
        if x.shape[1] < self.min_len:
            raise ValueError(
                f"TextCNN: input length {x.shape[1]} is shorter than the widest filter "
                f"{self.min_len}; pad the batch"
            )
        h = self.embedding(x)  # [B, L, E]
        lengths = (x != 0).sum(dim=1, keepdim=True)  # [B, 1]: padding is only at the end
        starts = torch.arange(x.shape[1], device=x.device)  # each window's first position
        small = x.device.type == "cpu" and x.numel() <= SMALL_INPUT
        if not small:
            h = h.transpose(1, 2)  # [B, E, L]
        pooled = []
        for conv in self.convs:
            width = conv.kernel_size[0]
            a = torch.relu(_windows_product(h, conv) if small else conv(h).transpose(1, 2))  # [B, windows, filters]
            # Only the windows inside the sentence (its first one if it is shorter than the
            # filter): a window over padding beyond them would make a sentence's logits depend on
            # how far its batch padded it. A ReLU'd value is >= 0, so a 0 leaves the maximum as is.
            inside = starts[: a.shape[1]] <= (lengths - width).clamp(min=0)
            pooled.append(a.masked_fill(~inside.unsqueeze(-1), 0.0).amax(dim=1))
        return self.out(self.dropout(torch.cat(pooled, dim=1)))


    @torch.no_grad()
    def constrain_grads(self, lr: float) -> None:
        """Adds to the output layer's gradient the step that brings each of its weight rows
        back to norm :attr:`max_norm` (Kim 2014's max-norm constraint): applied with ``w -=
        lr * g`` it is the projection followed by the gradient step. Call it after
        ``backward()`` with the learning rate the update will use."""
        if not self.max_norm or self.out.weight.grad is None:
            return
        w = self.out.weight
        scale = (self.max_norm / w.norm(dim=1, keepdim=True).clamp(min=1e-12)).clamp(max=1.0)
        w.grad.add_(w * (1.0 - scale), alpha=1.0 / lr)


def _windows_product(h: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """``conv`` over ``h`` ``[B, L, E]`` as one matrix product: each window of ``w`` positions,
    its ``E x w`` values laid out as the filters' weights are (``[filters, E, w]``), times the
    filters. The same sums as the convolution; ``[B, L - w + 1, filters]``."""
    windows = h.unfold(1, conv.kernel_size[0], 1)  # [B, L - w + 1, E, w]
    return windows.flatten(2) @ conv.weight.flatten(1).t() + conv.bias


def build_textcnn(vocab_size: int, n_labels: int, seed: int = 0, **kw) -> TextCNN:
    """Builds a :class:`TextCNN` whose initial parameters depend only on the arguments.

    The global RNG is neither used nor changed, so every learner building with the same
    seed gets bit-identical parameters.

    Args:
        vocab_size: Number of token ids.
        n_labels: Number of output classes.
        seed: Initialisation seed.
        **kw: Further :class:`TextCNN` arguments (``embed_dim``, ``widths``, ...).

    Returns:
        The model, in training mode.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TextCNN(vocab_size, n_labels, **kw)
    n_params = sum(p.numel() for p in model.parameters())
    logger.debug("TextCNN: vocab %d, labels %d, seed %d, %d parameters",
                 vocab_size, n_labels, seed, n_params)
    return model
