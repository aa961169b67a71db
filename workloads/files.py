"""Users' labelled text files in the formats they upload, read exactly into (tokens, label)
rows, or refused with the file and line of the problem; never silently changed.

Formats (`format` of a job file's `[data]`):

| format | one sample is | label from |
|---|---|---|
| `csv` | a row of a CSV file (RFC 4180 quoting; a quoted field may hold a few newlines) | column `label_column` |
| `tsv` | a line of a tab-separated file (plain: a `"` is an ordinary character) | column `label_column` |
| `jsonl` | one JSON object per line | key `label_column` |
| `label-text` | a line `LABEL text...` (the first word is the label) | the first word |
| `trec` | a line `COARSE:fine text...` | the coarse label |
| `per-label` | a line of a file whose name is the label | the file name: `positive.txt` -> `positive`, `custrev.pos` -> `pos` |

csv/tsv files have a header row naming the columns, or, with `header=False`, none: then
columns are given by number (1 is the first). A column named by an integer is taken by
position in either case.

Lines end at `\\n`, `\\r\\n` or a lone `\\r`, and nowhere else (Latin-1 files may hold byte
0x85, which `str.splitlines()` would take for a line break). A byte-order mark is dropped; a
file that starts with a UTF-16 or UTF-32 one (Excel's "Unicode text", PowerShell's files) is
refused unless `encoding` is that encoding, naming it. A file is decoded with `encoding`;
when it does not decode and `fallback` is given, only the lines that do not decode are read
with `fallback` (the report counts them), so a file of mixed encodings keeps its UTF-8 lines
intact. A file with a NUL byte is refused as binary (or, where every other byte is one, as
UTF-16 without a byte-order mark), an empty file as empty.

What is left out, and why, is counted in a `FileReport` per file (`gadei run` prints it):
blank lines, rows whose text is empty, rows whose label is blank, a header row repeated
inside the file. Everything else that does not read as the format says is refused. A sample
longer than `max_words` words is cut to its first `max_words` (`read`), and counted too: one
text of millions of words would otherwise take a learner's memory (a text CNN's activations grow
with its batch's longest sample) and more table rows than a gradient carries.
"""  # noqa: E501 (a markdown table: one row a line)

from __future__ import annotations

import array
import codecs
import csv
import errno
import io
import os
import json
import logging
import re
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


log = logging.getLogger(__name__)

FORMATS = ("csv", "tsv", "jsonl", "label-text", "trec", "per-label")
Rows = list[tuple[list[str], str]]
Column = str | int  # a header name, or a position (1 = the first column)

# A quoted CSV field that spans more lines than this is taken for an unbalanced quote (the
# longest one in banking77 spans 5): reading on would merge the rows after it into one.
MAX_QUOTED_LINES = 50
# Room for one field of a CSV file (the csv module's default is 128 KiB).
MAX_FIELD_CHARS = 64 << 20
# The largest data file read (bytes): it is read whole into memory; a larger one is refused
# before a byte of it is read.
MAX_DATA_FILE = 2 << 30
_LINE_BREAK = re.compile("\r\n|\r|\n")
_LINE_BREAK_BYTES = re.compile(b"(\r\n|\r|\n)")
# UTF-32's little-endian mark begins with UTF-16's: it is looked for first
_BYTE_ORDER_MARKS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8"),
                     (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
_PLURAL = {"blank line": "blank lines", "row with empty text": "rows with empty text",
           "row with a blank label": "rows with a blank label",
           "row without text or label": "rows without text or label",
           "repeated header row": "repeated header rows"}


class DataError(ValueError):
    """A data file that cannot be read as the job says (the message names file and line)."""


@dataclass
class FileReport:
    """What reading one file found: its lines, the samples kept, and what was left out and why."""

    path: Path
    lines: int = 0
    samples: int = 0
    left_out: dict[str, list[int]] = field(default_factory=dict)  # reason -> line numbers
    fallback: str | None = None  # the encoding the lines in `fallback_lines` were read with
    fallback_lines: list[int] = field(default_factory=list)
    kept: array.array = field(default_factory=lambda: array.array("q"))  # the line of each sample kept
    cut: list[int] = field(default_factory=list)  # the lines of the samples cut to `max_words` words (`read`)
    max_words: int = 0
    longest: int = 0  # words of the longest sample cut

    def leave_out(self, reason: str, line: int) -> None:
        self.left_out.setdefault(reason, []).append(line)

    def __str__(self) -> str:
        text = f"{self.path.name}: {_count(self.lines, 'line')}, {_count(self.samples, 'sample')}"
        if self.left_out:
            text += "; left out: " + ", ".join(f"{len(at):,} {reason if len(at) == 1 else _PLURAL[reason]} "
                                               f"({_lines(at)})" for reason, at in self.left_out.items())
        if self.fallback_lines:
            fallback = self.fallback_lines
            text += f"; {_count(len(fallback), 'line')} read as {self.fallback} ({_lines(fallback)})"
        if self.cut:
            text += (f"; cut to their first {self.max_words:,} words ([data] max_words): "
                     f"{_count(len(self.cut), 'sample')} ({_lines(self.cut)}; the longest {self.longest:,} words)")
        return text


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def _lines(numbers: list[int], shown: int = 5) -> str:
    head = ", ".join(map(str, numbers[:shown]))
    return ("line " if len(numbers) == 1 else "lines ") + head + (", ..." if len(numbers) > shown else "")


SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".npz": "npz"}  # formats a file's name says


def format_of(paths: tuple[Path, ...]) -> str | None:
    """The format a data set's files say they hold, where a job file leaves it out: per-label for
    a folder or several files, else the file's extension (`SUFFIXES`); None where they do not say."""
    if len(paths) > 1 or is_folder(paths[0]):
        return "per-label"
    return SUFFIXES.get(paths[0].suffix.lower())


def is_folder(path: Path) -> bool:
    """Whether `path` is a folder (a name too long is not one: `data_file_problem` says what it is)."""
    try:
        return path.is_dir()
    except OSError:
        return False


def data_file_problem(path: Path) -> str | None:
    """Why the data file at `path` is not read, checked before a byte of it is (None: it is
    fine): it must be a regular file of 1 to MAX_DATA_FILE bytes. A FIFO, a device
    (/dev/zero), a folder, and the zero-size files of /proc and /sys (/proc/kmsg blocks a
    reader) are refused by type and size."""
    try:
        info = os.stat(path)
    except OSError as err:
        return "no such file" if err.errno == errno.ENOENT else err.strerror
    except ValueError as err:  # a NUL in the path
        return str(err)
    if stat.S_ISDIR(info.st_mode):
        return "not a file (a folder)"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file (a FIFO, socket or device is not read)"
    if info.st_size == 0:
        return "empty (0 bytes)"
    if info.st_size > MAX_DATA_FILE:
        return f"{info.st_size:,} bytes, more than a data file may be ({MAX_DATA_FILE:,})"
    return None


def check_data_file(path: Path) -> None:
    """DataError naming the path when `data_file_problem` finds one."""
    problem = data_file_problem(path)
    if problem is not None:
        raise DataError(f"data file {str(path)!r}: {problem}")


def read_data_file(path: Path) -> bytes:
    """The bytes of the data file at `path` (see `check_data_file`), at most MAX_DATA_FILE."""
    check_data_file(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in must not block
        with open(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise DataError(f"data file {str(path)!r} is not a regular file")
            raw = handle.read(MAX_DATA_FILE + 1)
    except OSError as err:
        raise DataError(f"data file {str(path)!r}: {err.strerror}") from None
    if len(raw) > MAX_DATA_FILE:
        raise DataError(f"data file {str(path)!r}: more than a data file may be ({MAX_DATA_FILE:,} bytes)")
    return raw


def decode(path: Path, encoding: str, fallback: str | None = None, report: FileReport | None = None) -> str:
    """The text of `path`, BOM dropped; DataError when it is missing, empty, binary or does
    not decode. With `fallback`, lines that are not `encoding` are read with it (counted in
    `report`)."""
    raw = read_data_file(path)
    try:
        ascii_compatible = "\n".encode(encoding) == b"\n"
    except LookupError:
        raise DataError(f"[data] encoding {encoding!r} is not a text encoding Python knows") from None
    if not raw.strip():
        raise DataError(f"data file {str(path)!r} is empty" + (f" ({len(raw)} bytes of white space)" if raw else ""))
    mark = byte_order_mark(raw)
    if mark in ("utf-16", "utf-32") and not codecs.lookup(encoding).name.startswith(mark):
        raise DataError(f"data file {str(path)!r} is {mark.upper()} text (it starts with a {mark.upper()} byte-order "
                        f"mark), not {encoding}: set [data] encoding = \"{mark}\"")
    if ascii_compatible and b"\0" in raw:
        at = raw.index(b"\0")
        wide = _utf16_without_mark(raw)
        if wide:
            raise DataError(f"data file {str(path)!r} looks like {wide.upper()} text without a byte-order mark (every "
                            f"other byte is NUL), not {encoding}: set [data] encoding = \"{wide}\"")
        line = _line_of(raw, at)
        raise DataError(f"data file {str(path)!r} is binary, not text: a NUL byte on line {line} (byte {at:,})")
    try:
        return _unmarked(raw.decode(encoding))
    except UnicodeDecodeError as err:
        line = _line_of(raw, err.start) if ascii_compatible else None
        where = f"line {line}, byte {err.start:,}" if line else f"byte {err.start:,}"
        if not fallback:
            raise DataError(f"data file {str(path)!r} is not {encoding} ({where}: {err.reason}); set [data] encoding,"
                            " or fallback_encoding (e.g. \"latin-1\")") from None
        try:
            "\n".encode(fallback)
        except LookupError:
            raise DataError(f"[data] fallback_encoding {fallback!r} is not a text encoding Python knows") from None
    if not ascii_compatible:  # lines cannot be told apart in bytes: all or nothing
        _warn_once(raw, "%s is not %s; reading it as %s", path, encoding, fallback)
        try:
            return _unmarked(raw.decode(fallback))
        except UnicodeDecodeError as err:
            raise DataError(f"data file {str(path)!r} is neither {encoding} nor {fallback} (byte {err.start:,}: "
                            f"{err.reason})") from None
    parts = _LINE_BREAK_BYTES.split(raw)  # lines and, between them, their line breaks
    for i in range(0, len(parts), 2):
        try:
            parts[i] = parts[i].decode(encoding)
        except UnicodeDecodeError:
            number = i // 2 + 1
            try:
                parts[i] = parts[i].decode(fallback)
            except UnicodeDecodeError as err:
                raise DataError(f"data file {str(path)!r}: line {number} is neither {encoding} nor {fallback} "
                                f"({err.reason})") from None
            if report is not None:
                report.fallback = fallback
                report.fallback_lines.append(number)
    for i in range(1, len(parts), 2):
        parts[i] = parts[i].decode("ascii")
    _warn_once(raw, "%s: some lines are not %s; read those as %s", path, encoding, fallback)
    return _unmarked("".join(parts))


def byte_order_mark(raw: bytes) -> str | None:
    """The Unicode encoding whose byte-order mark `raw` starts with: "utf-8", "utf-16" or
    "utf-32" (the codec that reads the mark and drops it), or None."""
    return next((name for mark, name in _BYTE_ORDER_MARKS if raw.startswith(mark)), None)


def _utf16_without_mark(raw: bytes) -> str | None:
    """"utf-16-le" or "utf-16-be" where `raw` reads as mostly ASCII text in that encoding
    without a byte-order mark (nine in ten of the odd, or the even, bytes of its first 4 KB are
    NUL, and few of the others), else None."""
    sample = raw[:4096]
    if len(sample) < 8:
        return None
    for name, zeros, others in (("utf-16-le", sample[1::2], sample[0::2]), ("utf-16-be", sample[0::2], sample[1::2])):
        if zeros.count(0) >= 0.9 * len(zeros) and others.count(0) <= 0.1 * len(others):
            return name
    return None


def _unmarked(text: str) -> str:
    """`text` without the byte-order mark it starts with, if any (a codec such as utf-8 or
    utf-16-le keeps one as U+FEFF)."""
    return text[1:] if text.startswith("\ufeff") else text


_WARNED: set[tuple] = set()


def _warn_once(raw: bytes, message: str, path, encoding: str, fallback: str) -> None:
    """Warn about a file's fallback decoding once per process and file content (`gadei run`
    reads the training file to prepare the job and again to test the model it hands back)."""
    key = (str(path), encoding, fallback, len(raw), hash(raw))
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message, path, encoding, fallback)


def _line_of(raw: bytes, at: int) -> int:
    """The line number (from 1) of byte `at` of an ASCII-compatible file."""
    return len(_LINE_BREAK_BYTES.findall(raw, 0, at)) + 1


def split_lines(text: str) -> list[str]:
    """The lines of `text`, split at \\n, \\r\\n and a lone \\r only; no empty last line."""
    lines = _LINE_BREAK.split(text)
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def read(paths: list[Path], fmt: str, *, max_words: int | None = None, reports: list[FileReport] | None = None,
         **options) -> Rows:
    """Every sample of `paths` as (tokens, label) rows: `read_texts` tokenized, each cut to its
    first `max_words` words (None: none is cut), counted in its file's report."""
    found: list[FileReport] = []
    texts = read_texts(paths, fmt, reports=found, **options)
    if reports is not None:
        reports += found
    from .text import tokenize  # PyTorch: a job file is checked without it

    lines = ((report, line) for report in found for line in report.kept)
    rows = []
    for (text, label), (report, line) in zip(texts, lines):
        words = list(map(sys.intern, tokenize(text)))  # one string for each word, not one for each time it is said
        label = sys.intern(label)
        if max_words is not None and len(words) > max_words:
            report.cut.append(line)
            report.max_words, report.longest = max_words, max(report.longest, len(words))
            del words[max_words:]
        rows.append((words, label))
    return rows


def read_texts(paths: list[Path], fmt: str, *, text_column: Column = "text", label_column: Column = "label",
               header: bool = True, encoding: str = "utf-8", fallback: str | None = None,
               reports: list[FileReport] | None = None) -> list[tuple[str, str]]:
    """Every sample of `paths` (one file, or for per-label one file per label) as
    (text, label), the text exactly as the file holds it; each file's `FileReport` is
    appended to `reports`. Raises DataError naming the file and line of the first problem."""
    if fmt not in FORMATS:
        raise DataError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    rows: list[tuple[str, str]] = []
    found: list[FileReport] = []
    for path in paths:
        report = FileReport(path)
        found.append(report)
        text = decode(path, encoding, fallback, report)
        if fmt in ("csv", "tsv"):
            samples = _table(path, text, fmt, text_column, label_column, header, report)
        elif fmt == "jsonl":
            samples = _jsonl(path, text, text_column, label_column, report)
        else:
            samples = _line_format(path, text, fmt, report)
        report.samples = len(samples)
        rows += samples
    if reports is not None:
        reports += found
    if not rows:
        raise DataError(f"{', '.join(map(str, paths))}: no samples ({'; '.join(map(str, found))})")
    return rows


def label_of_file(path: Path) -> str:
    """The label a per-label file names: `positive.txt` -> `positive`, `custrev.pos` -> `pos`."""
    name = path.name[:-4] if path.name.lower().endswith(".txt") else path.name
    return name.rsplit(".", 1)[-1] if "." in name else name


def _line_format(path: Path, text: str, fmt: str, report: FileReport) -> list[tuple[str, str]]:
    rows = []
    file_label = label_of_file(path) if fmt == "per-label" else None
    lines = split_lines(text)
    report.lines = len(lines)
    for lineno, line in enumerate(lines, start=1):
        line = line.strip()
        if not line:
            report.leave_out("blank line", lineno)
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
        rows.append((sentence, label))
        report.kept.append(lineno)
    return rows


def table_rows(path: Path, text: str, fmt: str, report: FileReport) -> Iterator[tuple[int, list[str]]]:
    """(line, fields) of each row of a csv or tsv file, blank lines counted in `report` and
    skipped. TSV is plain: fields are split at tabs, a row ends at its line break. CSV keeps
    RFC 4180 quoting, but a quoted field over MAX_QUOTED_LINES lines or to the end of the
    file is refused: it is an unbalanced quote, and reading on would merge the rows after it."""
    if fmt == "tsv":
        lines = split_lines(text)
        report.lines = len(lines)
        for lineno, line in enumerate(lines, start=1):
            if line.strip():
                yield lineno, line.split("\t")
            else:
                report.leave_out("blank line", lineno)
        return
    if csv.field_size_limit() < MAX_FIELD_CHARS:
        csv.field_size_limit(MAX_FIELD_CHARS)
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    start = 1
    try:
        for fields in reader:
            span = reader.line_num - start + 1
            if span > MAX_QUOTED_LINES:
                raise DataError(f"{path}:{start}: a quoted field runs over {span:,} lines (to line {reader.line_num:,}"
                                f"); is a quote unbalanced? (a quoted field may span at most {MAX_QUOTED_LINES} lines)")
            if any(cell.strip() for cell in fields):
                yield start, fields
            else:
                report.leave_out("blank line", start)
            start = reader.line_num + 1
    except csv.Error as err:
        if "unexpected end of data" in str(err):
            raise DataError(f"{path}:{start}: a quoted field starts on this line and runs to the end of the file; "
                            "is a quote unbalanced?") from None
        if "field larger than field limit" in str(err):
            raise DataError(f"{path}:{start}: a field is longer than {MAX_FIELD_CHARS:,} characters") from None
        if "expected after" in str(err):  # `"how many" cats,NUM`: text after a closing quote
            raise DataError(f"{path}:{start}: a quoted field goes on after its closing quote; quote the whole field "
                            'and double a quote inside it (`"how ""many"" cats",NUM`), or leave the quotes '
                            "out") from None
        raise DataError(f"{path}:{start}: not CSV: {err}") from None
    report.lines = len(split_lines(text))


def _table(path: Path, text: str, fmt: str, text_column: Column, label_column: Column, header: bool,
           report: FileReport) -> list[tuple[str, str]]:
    found = table_rows(path, text, fmt, report)
    names: list[str] | None = None
    if header:
        first = next(found, None)
        if first is None:
            raise DataError(f"{path}: no header row")
        names = [name.strip() for name in first[1]]
    columns = {kind: column_index(path, names, kind, column)
               for kind, column in (("text_column", text_column), ("label_column", label_column))}
    if columns["text_column"] == columns["label_column"]:
        at = columns["text_column"]
        raise DataError(_same_column(path, text_column, label_column, f"column {at + 1}" +
                                     (f" ({names[at]!r})" if names else "")))
    width = len(names) if names else None
    rows = []
    for lineno, fields in found:
        if width is None:
            width = len(fields)
            for kind, at in columns.items():
                if at >= width:
                    raise DataError(f"{path}: [data] {kind} = {at + 1}, but the first row has {width} columns")
        while len(fields) > width and not fields[-1].strip():  # trailing delimiters: empty fields
            fields.pop()
        if len(fields) != width:
            raise DataError(f"{path}:{lineno}: {len(fields)} fields, " + (f"the header has {width}" if names else
                            f"the first row has {width}") + (" (a tab inside a text?)" if fmt == "tsv" and
                                                              len(fields) > width else ""))
        if names and [f.strip() for f in fields] == names:
            report.leave_out("repeated header row", lineno)
            continue
        _keep(rows, report, lineno, fields[columns["text_column"]], fields[columns["label_column"]].strip())
    return rows


def _same_column(path: Path, text_column: Column, label_column: Column, which: str) -> str:
    """The refusal of a text column that is the label column: trained so, the model would
    read each sample's label as its text (100% accuracy that means nothing)."""
    return (f"{path}: [data] text_column = {text_column!r} and label_column = {label_column!r} both name {which}: "
            "the label would be the text; set text_column to the texts' own")


def _keep(rows: list, report: FileReport, lineno: int, sentence: str, label: str) -> None:
    """Add the sample of line `lineno`, or count in `report` why it is left out."""
    if not sentence.strip():
        report.leave_out("row with empty text" if label else "row without text or label", lineno)
    elif not label:
        report.leave_out("row with a blank label", lineno)
    else:
        rows.append((sentence, label))
        report.kept.append(lineno)


def column_index(path: Path, names: list[str] | None, kind: str, column: Column) -> int:
    """The index of `column` (a header name, or a number from 1) in a row."""
    if isinstance(column, int):
        if names is not None and column > len(names):
            raise DataError(f"{path}: [data] {kind} = {column}, but the header has {len(names)} columns")
        return column - 1
    if names is None:
        raise DataError(f"{path}: [data] {kind} = {column!r} names a column, but header = false; give its "
                        "number (1 is the first column)")
    if column in names:
        return names.index(column)
    hint = ""
    separator = next((mark for mark in _SEPARATORS if len(names) == 1 and mark in names[0]), None)
    if separator:
        hint = (f"; the header is one column holding {separator!r}: is the file separated by {_SEPARATORS[separator]}? "
                "format csv reads commas, tsv tabs" + ("; save it with commas (Excel saves ';' where a comma is the "
                                                        "decimal mark)" if separator == ";" else ""))
    elif _looks_like_data(names):
        hint = ("; the first row looks like data, not a header: if the file has none, set [data] header = false "
                "(columns are then given by number, 1 = the first)")
    raise DataError(f"{path}: [data] {kind} = {column!r} is not a column of its header (columns: "
                    f"{', '.join(repr(n[:40]) for n in names) or 'none'}){hint}")


_SEPARATORS = {"\t": "tabs", ",": "commas", ";": "semicolons", "|": "bars"}  # what a one-column header may hold


def _looks_like_data(names: list[str]) -> bool:
    """A header row whose cells read like sentences, numbers or nothing is likely a data row."""
    def datalike(name: str) -> bool:
        return not name or len(name) > 40 or len(name.split()) > 3 or bool(re.fullmatch(r"[-+.\d]+", name))

    return any(datalike(n) for n in names)


def _jsonl(path: Path, text: str, text_column: Column, label_column: Column,
           report: FileReport) -> list[tuple[str, str]]:
    for kind, key in (("text_column", text_column), ("label_column", label_column)):
        if not isinstance(key, str):
            raise DataError(f"[data] {kind} = {key!r}: jsonl names keys, not column numbers")
    if text_column == label_column:
        raise DataError(_same_column(path, text_column, label_column, f"key {text_column!r}"))
    rows = []
    lines = split_lines(text)
    report.lines = len(lines)
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            report.leave_out("blank line", lineno)
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as err:
            raise DataError(f"{path}:{lineno}: not a JSON object: {err}") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno}: a JSON line must be an object, not {type(record).__name__}")
        for kind, key in (("text_column", text_column), ("label_column", label_column)):
            if key not in record:
                raise DataError(f"{path}:{lineno}: [data] {kind} = {key!r} is not a key of the object (keys: "
                                f"{', '.join(map(repr, record)) or 'none'})")
        label, sentence = record[label_column], record[text_column]
        if isinstance(label, (dict, list)) or label is None:
            raise DataError(f"{path}:{lineno}: label {label!r} in {label_column!r} is not a plain value")
        if isinstance(sentence, (dict, list)) or sentence is None:
            raise DataError(f"{path}:{lineno}: text {str(sentence)[:40]!r} in {text_column!r} is not a plain value")
        _keep(rows, report, lineno, str(sentence), str(label).strip())
    return rows
