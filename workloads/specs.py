"""Data specs: a string that names a text data set, read into a ``(train, test)`` pair of
:class:`.text.TextDataset` (a workload's ``load_data``; ``gadei.data`` adds ``"job:JOBFILE"``)."""

from __future__ import annotations

from .text import TextDataset, Tokens, load_banking77, load_sst2, load_trec
from .topics import generate_topics


def load(spec: str, *, tokens: Tokens | None = None, max_size: int = 20000) -> tuple[TextDataset, TextDataset]:
    """Loads a data set named by a spec string.

    Args:
        spec: One of ``"generated"``, ``"generated:SEED"``, ``"trec:FOLDER"`` (6 coarse
            labels), ``"trec-fine:FOLDER"`` (50 fine labels), ``"sst2:FOLDER"`` or ``"banking77:FOLDER"``
            (``gadei.data`` adds ``"job:JOBFILE"``, the ``[data]`` of a job file).
        tokens: What the vocabulary indexes of a sentence's words (None: the words), see
            :func:`encode_split`.
        max_size: The most ids of the vocabulary of a file's data set, see :meth:`Vocab.build`.

    Returns:
        ``(train, test)``.

    Raises:
        ValueError: If the spec is not one of the forms above.
    """
    kind, colon, arg = spec.partition(":")
    if kind == "generated":
        if not colon:
            return generate_topics(tokens=tokens)
        try:
            seed = int(arg)
        except ValueError:
            raise ValueError(f"data spec {spec!r}: seed {arg!r} is not an integer") from None
        return generate_topics(seed=seed, tokens=tokens)
    if kind in ("trec", "trec-fine") and arg:
        return load_trec(arg, fine=kind == "trec-fine", tokens=tokens, max_size=max_size)
    if kind == "sst2" and arg:
        return load_sst2(arg, tokens=tokens, max_size=max_size)
    if kind == "banking77" and arg:
        return load_banking77(arg, tokens=tokens, max_size=max_size)
    raise ValueError(
        f"data spec {spec!r} is not understood; use 'generated', 'generated:SEED', "
        "'trec:FOLDER', 'trec-fine:FOLDER', 'sst2:FOLDER' or 'banking77:FOLDER'"
    )
