"""Users' labelled text files in the formats they upload, read into (tokens, label) rows.

Formats (`format` of a job file's `[data]`):

| format | one sample is | label from |
|---|---|---|
| `csv` | a row of a CSV file with a header (quoted fields may hold newlines) | column `label_column` |
| `tsv` | a row of a tab-separated file with a header | column `label_column` |
| `jsonl` | one JSON object per line | key `label_column` |
| `label-text` | a line `LABEL text...` (the first word is the label) | the first word |
| `trec` | a line `COARSE:fine text...` | the coarse label |
| `per-label` | a line of a file whose name is the label | the file name: `positive.txt` -> `positive`, `custrev.pos` -> `pos` |

The text is `text_column` for csv/tsv/jsonl. Files are decoded with `encoding`; a file
that does not decode is read with `fallback` when one is given, else refused with the
byte offset. Lines are split on `\\n` only (Latin-1 files may hold byte 0x85, which
`str.splitlines()` would take for a line break). Every refusal names the file and line.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from pathlib import Path

from .text import tokenize

log = logging.getLogger(__name__)

FORMATS = ("csv", "tsv", "jsonl", "label-text", "trec", "per-label")
Rows = list[tuple[list[str], str]]


class DataError(ValueError):
    """A data file that cannot be read as the job says (the message names file and line)."""


def decode(path: Path, encoding: str, fallback: str | None = None) -> str:
    """The text of `path`; DataError when it is missing or does not decode."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DataError(f"data file {str(path)!r}: {err.strerror}") from None
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as err:
        if fallback:
            log.warning("%s is not %s (byte %d); reading it as %s", path, encoding, err.start, fallback)
            try:
                return raw.decode(fallback)
            except UnicodeDecodeError as again:
                err = again
                encoding = fallback
        raise DataError(f"data file {str(path)!r} is not {encoding} (byte {err.start:,}: {err.reason}); set "
                        "[data] encoding, or fallback_encoding (e.g. \"latin-1\")") from None
    except LookupError:
        raise DataError(f"[data] encoding {encoding!r} is not a text encoding Python knows") from None


def read(paths: list[Path], fmt: str, *, text_column: str = "text", label_column: str = "label",
         encoding: str = "utf-8", fallback: str | None = None) -> Rows:
    """Every sample of `paths` (one file, or for per-label one file per label) as
    (tokens, label) rows. Raises DataError naming the file and line of the first problem."""
    if fmt not in FORMATS:
        raise DataError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    rows: Rows = []
    for path in paths:
        text = decode(path, encoding, fallback)
        if fmt in ("csv", "tsv"):
            rows += _table(path, text, "\t" if fmt == "tsv" else ",", text_column, label_column)
        elif fmt == "jsonl":
            rows += _jsonl(path, text, text_column, label_column)
        else:
            rows += _lines(path, text, fmt)
    if not rows:
        raise DataError(f"{', '.join(map(str, paths))}: no samples")
    return rows


def label_of_file(path: Path) -> str:
    """The label a per-label file names: `positive.txt` -> `positive`, `custrev.pos` -> `pos`."""
    name = path.name[:-4] if path.name.lower().endswith(".txt") else path.name
    return name.rsplit(".", 1)[-1] if "." in name else name


def _lines(path: Path, text: str, fmt: str) -> Rows:
    rows = []
    file_label = label_of_file(path) if fmt == "per-label" else None
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.strip()
        if not line:
            continue
        if fmt == "per-label":
            sentence, label = line, file_label
        else:
            label, _, sentence = line.partition(" ")
            if fmt == "trec":
                coarse, colon, fine = label.partition(":")
                label = coarse if colon and coarse and fine else ""
            if not label or not sentence.strip():
                expected = "COARSE:fine text" if fmt == "trec" else "LABEL text"
                raise DataError(f"{path}:{lineno}: expected {expected!r} ({fmt} format), got {line[:60]!r}")
        rows.append((tokenize(sentence), label))
    return rows


def _table(path: Path, text: str, delimiter: str, text_column: str, label_column: str) -> Rows:
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    header = reader.fieldnames or []
    for kind, column in (("text_column", text_column), ("label_column", label_column)):
        if column not in header:
            raise DataError(f"{path}: [data] {kind} = {column!r} is not a column of its header (columns: "
                            f"{', '.join(map(repr, header)) or 'none'})")
    rows = []
    try:
        for record in reader:
            sentence, label = record.get(text_column), record.get(label_column)
            if sentence is None or label is None:
                raise DataError(f"{path}:{reader.line_num}: the row has fewer fields than the header")
            if not sentence.strip() and not label.strip():
                continue
            if not label.strip():
                raise DataError(f"{path}:{reader.line_num}: empty label in column {label_column!r}")
            rows.append((tokenize(sentence), label.strip()))
    except csv.Error as err:
        raise DataError(f"{path}:{reader.line_num}: not {'TSV' if delimiter == chr(9) else 'CSV'}: {err}") from None
    return rows


def _jsonl(path: Path, text: str, text_column: str, label_column: str) -> Rows:
    rows = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise DataError(f"{path}:{lineno}: not a JSON object: {err}") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno}: a JSON line must be an object, not {type(record).__name__}")
        for kind, key in (("text_column", text_column), ("label_column", label_column)):
            if key not in record:
                raise DataError(f"{path}:{lineno}: [data] {kind} = {key!r} is not a key of the object (keys: "
                                f"{', '.join(map(repr, record)) or 'none'})")
        label = record[label_column]
        if isinstance(label, (dict, list)) or label is None or str(label).strip() == "":
            raise DataError(f"{path}:{lineno}: label {label!r} in {label_column!r} is not a plain value")
        rows.append((tokenize(str(record[text_column])), str(label).strip()))
    return rows
