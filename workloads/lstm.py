"""An LSTM sentence classifier, the second text workload: embedding -> bidirectional LSTM ->
max over time -> dropout -> linear. Same inputs and outputs as the text CNN (padded token
ids in, label logits out) and the same seeding contract as :func:`.textcnn.build_textcnn`.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LSTMClassifier", "build_lstm"]


class LSTMClassifier(nn.Module):
    """Embedding -> 1-layer bidirectional LSTM over each sentence's words (packed by length) ->
    max over time -> dropout -> linear.

    Args:
        vocab_size: Number of token ids (row 0 is padding).
        n_labels: Number of output classes.
        embed_dim: Embedding width.
        hidden: LSTM units per direction.
        dropout: Dropout probability before the output layer.
        sparse_grad: A sparse embedding gradient (see :class:`.textcnn.TextCNN`).

    Raises:
        ValueError: If a size is not positive or the dropout is outside ``[0, 1)``.
    """

    min_len = 1

    def __init__(self, vocab_size: int, n_labels: int, embed_dim: int = 128, hidden: int = 128,
                 dropout: float = 0.5, sparse_grad: bool = True):
        super().__init__()
        for name, value in {"vocab_size": vocab_size, "n_labels": n_labels, "embed_dim": embed_dim,
                            "hidden": hidden}.items():
            if value < 1:
                raise ValueError(f"LSTMClassifier: {name} must be >= 1, got {value}")
        if not 0 <= dropout < 1:
            raise ValueError(f"LSTMClassifier: dropout must be in [0, 1), got {dropout}")
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0, sparse=sparse_grad)
        self.lstm = nn.LSTM(embed_dim, hidden, batch_first=True, bidirectional=True)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(2 * hidden, n_labels)
        with torch.no_grad():
            self.embedding.weight.uniform_(-0.25, 0.25)
            self.embedding.weight[0].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, n_labels]`` of a batch ``[B, L]`` of token ids padded with 0."""
        # Packed by length, so the backward direction starts at each sentence's last word,
        # not at the padding after it (padding then changes nothing).
        lengths = (x != 0).sum(dim=1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(self.embedding(x), lengths, batch_first=True,
                                                   enforce_sorted=False)
        h, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True,
                                                total_length=x.shape[1])  # [B, L, 2H]
        h = h.masked_fill((x == 0).unsqueeze(-1), float("-inf"))
        pooled = h.amax(dim=1)
        pooled = torch.where(torch.isinf(pooled), torch.zeros_like(pooled), pooled)  # an all-padding row
        return self.out(self.dropout(pooled))


def build_lstm(vocab_size: int, n_labels: int, seed: int = 0, **kw) -> LSTMClassifier:
    """An :class:`LSTMClassifier` whose initial parameters depend only on the arguments (the
    global RNG is neither used nor changed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LSTMClassifier(vocab_size, n_labels, **kw)
