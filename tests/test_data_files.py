"""Users' data files, read exactly or refused: a corpus of awkward files (quotes, line
endings, byte-order marks, encodings, blank and repeated rows, huge lines, empty and binary
files), each read to the exact (text, label) samples expected or refused with an error that
names the file and line. The first case is the real failure this corpus was started for: a
TSV file whose texts begin with a double quote lost rows to a CSV-style quote reader."""

import json

import pytest

from gadei_workloads.files import MAX_QUOTED_LINES, DataError, read, read_texts

H = "label\ttext\n"  # a TSV header
C = "label,text\n"  # a CSV header


def _read(tmp_path, content: bytes | str, fmt: str, name: str = "data", **options):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    reports = []
    samples = read_texts([path], fmt, reports=reports, **options)
    return samples, reports[0]


def test_a_tsv_whose_texts_begin_with_quotes_keeps_every_row(tmp_path):
    rows = [(f'"{i} quoted at the start' if i % 11 == 0 else f"plain text {i}", "pos" if i % 2 else "neg")
            for i in range(15_000)]
    samples, report = _read(tmp_path, H + "".join(f"{label}\t{text}\n" for text, label in rows), "tsv",
                            text_column="text", label_column="label")
    assert samples == [(text, label) for text, label in rows]
    assert (report.lines, report.samples, report.left_out) == (15_001, 15_000, {})


# (name, content, format, options, the exact (text, label) samples)
READ = [
    ("tsv quotes start/middle/end", H + 'a\t"starts\nb\tmid"dle\nc\tends"\nd\t"both"\n', "tsv", {},
     [('"starts', "a"), ('mid"dle', "b"), ('ends"', "c"), ('"both"', "d")]),
    ("tsv unbalanced quotes", H + 'a\t"never closed\nb\tnext row\n', "tsv", {},
     [('"never closed', "a"), ("next row", "b")]),
    ("tsv quoted label is literal", H + '"a"\tx\n', "tsv", {}, [("x", '"a"')]),
    ("tsv crlf", (H + "a\tone\nb\ttwo\n").replace("\n", "\r\n"), "tsv", {}, [("one", "a"), ("two", "b")]),
    ("tsv lone cr", (H + "a\tone\nb\ttwo\n").replace("\n", "\r"), "tsv", {}, [("one", "a"), ("two", "b")]),
    ("tsv bom", "\ufeff" + H + "a\tone\n", "tsv", {}, [("one", "a")]),
    # Excel's "Unicode text" and PowerShell's files: UTF-16 with a byte-order mark, which is dropped
    # however the encoding is named
    *((f"tsv {encoding} with a byte-order mark read as {name}", ("\ufeff" + H + "a\tcafé\r\n").encode(encoding), "tsv",
       {"encoding": name}, [("café", "a")])
      for encoding, name in (("utf-16-le", "utf-16"), ("utf-16-be", "utf-16"), ("utf-16-le", "utf-16-le"),
                             ("utf-32-le", "utf-32"), ("utf-16-be", "UTF_16BE"))),
    ("tsv utf-16 without a mark", (H + "a\tcafé\n").encode("utf-16-le"), "tsv", {"encoding": "utf-16-le"},
     [("café", "a")]),
    ("tsv trailing tabs", H + "a\tone\t\nb\ttwo\t\t\n", "tsv", {}, [("one", "a"), ("two", "b")]),
    ("tsv latin-1 byte 0x85 is no line break", (H + "a\tone\x85two\n").encode("latin-1"), "tsv",
     {"encoding": "latin-1"}, [("one\x85two", "a")]),
    ("tsv without header", "a\tone\nb\ttwo\n", "tsv", {"header": False, "label_column": 1, "text_column": 2},
     [("one", "a"), ("two", "b")]),
    ("tsv columns by number with header", "id\ttext\tlabel\n7\tone\ta\n", "tsv", {"text_column": 2,
                                                                                 "label_column": 3},
     [("one", "a")]),
    ("csv standard quoting", C + 'a,"one, with comma"\nb,"two ""quoted"""\nc,"three\nlines\nlong"\n', "csv", {},
     [("one, with comma", "a"), ('two "quoted"', "b"), ("three\nlines\nlong", "c")]),
    ("csv quote inside an unquoted field", C + 'a,mid"dle\n', "csv", {}, [('mid"dle', "a")]),
    ("csv crlf and bom", ("\ufeff" + C + 'a,"x\r\ny"\r\nb,two\r\n'), "csv", {}, [("x\r\ny", "a"), ("two", "b")]),
    ("csv trailing commas", C + "a,one,\nb,two,,\n", "csv", {}, [("one", "a"), ("two", "b")]),
    ("csv without header", "a,one\nb,two\n", "csv", {"header": False, "label_column": 1, "text_column": 2},
     [("one", "a"), ("two", "b")]),
    ("jsonl crlf and bom", '\ufeff{"text": "one", "label": "a"}\r\n{"text": "two", "label": "b"}\r\n', "jsonl", {},
     [("one", "a"), ("two", "b")]),
    ("label-text lone cr", "a one\rb two\r", "label-text", {}, [("one", "a"), ("two", "b")]),
    ("trec crlf", "DESC:def what is it ?\r\nNUM:count how many ?\r\n", "trec", {},
     [("what is it ?", "DESC"), ("how many ?", "NUM")]),
]


@pytest.mark.parametrize("name,content,fmt,options,expected", READ, ids=[case[0] for case in READ])
def test_an_awkward_file_reads_to_exactly_its_samples(tmp_path, name, content, fmt, options, expected):
    samples, _ = _read(tmp_path, content, fmt, **options)
    assert samples == expected


# (name, content, format, options, the samples kept, what was left out and where)
LEFT_OUT = [
    ("blank lines", H + "a\tone\n\n   \nb\ttwo\n\n", "tsv", 2, {"blank line": [3, 4, 6]}),
    ("blank labels", H + "a\tone\n\ttwo\n \tthree\n", "tsv", 1, {"row with a blank label": [3, 4]}),
    ("empty texts", C + 'a,one\nb,\nc,"  "\n', "csv", 1, {"row with empty text": [3, 4]}),
    ("repeated header", H + "a\tone\nlabel\ttext\nb\ttwo\n", "tsv", 2, {"repeated header row": [3]}),
    ("jsonl blank label and empty text", '{"text": "x", "label": ""}\n{"text": " ", "label": "a"}\n'
                                         '{"text": "y", "label": "b"}\n', "jsonl", 1,
     {"row with a blank label": [1], "row with empty text": [2]}),
]


@pytest.mark.parametrize("name,content,fmt,kept,left_out", LEFT_OUT, ids=[case[0] for case in LEFT_OUT])
def test_rows_left_out_are_counted_with_their_lines(tmp_path, name, content, fmt, kept, left_out):
    samples, report = _read(tmp_path, content, fmt)
    assert len(samples) == kept and report.samples == kept and report.left_out == left_out
    for reason in left_out:
        assert reason.split()[-1] in str(report)  # the printed line says why


def test_the_report_line_counts_lines_samples_and_reasons(tmp_path):
    _, report = _read(tmp_path, H + "a\tone\n\n\tx\n\ty\nb\ttwo\n", "tsv", name="train.tsv")
    assert str(report) == ("train.tsv: 6 lines, 2 samples; left out: 1 blank line (line 3), "
                           "2 rows with a blank label (lines 4, 5)")


def test_a_megabyte_line_is_read_whole(tmp_path):
    long = " ".join(["word"] * 200_000)  # 1 MB
    for fmt, content in (("tsv", H + f"a\t{long}\nb\tshort\n"), ("csv", C + f'a,"{long}"\nb,short\n')):
        samples, _ = _read(tmp_path, content, fmt)
        assert samples == [(long, "a"), ("short", "b")]


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl", "label-text", "trec", "per-label"])
def test_a_text_longer_than_max_words_is_cut_and_counted_with_its_line(tmp_path, fmt):
    """A training text of millions of words would take a learner's memory (the text CNN pads its
    batch to it) and more rows than a gradient carries: read, it is cut to its first max_words
    words, and the file's line says which lines were cut, in every format."""
    long = " ".join(f"w{i}" for i in range(5_000))
    texts = [("a", "short one"), ("b", long), ("a", "two words"), ("b", long + " more")]
    line = {"csv": lambda label, text: f"{label},{text}", "tsv": lambda label, text: f"{label}\t{text}",
            "jsonl": lambda label, text: json.dumps({"label": label, "text": text}),
            "label-text": lambda label, text: f"{label} {text}", "trec": lambda label, text: f"{label}:x {text}",
            "per-label": lambda label, text: text}[fmt]
    head = {"csv": C, "tsv": H}.get(fmt, "")
    kept = [(label, text) for label, text in texts if fmt != "per-label" or label == "b"]
    path = tmp_path / ("data.b" if fmt == "per-label" else "data")
    path.write_text(head + "\n\n".join(line(label, text) for label, text in kept) + "\n")  # blank lines between
    reports = []
    rows = read([path], fmt, max_words=1_000, reports=reports)
    assert [len(words) for words, _ in rows] == [min(1_000, len(text.split())) for _, text in kept]
    assert rows[-1][0] == [f"w{i}" for i in range(1_000)]  # its first words
    first = 1 + bool(head)
    cut = [first + 2 * i for i, (_, text) in enumerate(kept) if len(text.split()) > 1_000]
    assert reports[0].cut == cut
    assert str(reports[0]).endswith(f"; cut to their first 1,000 words ([data] max_words): 2 samples (lines "
                                    f"{cut[0]}, {cut[1]}; the longest 5,001 words)")
    assert read([path], fmt)[-1][0][-1] == "more"  # no max_words: read whole


def test_mixed_encodings_read_only_the_bad_lines_with_the_fallback(tmp_path):
    content = (H + "a\tnaïve\n").encode("utf-8") + "b\tcafé\n".encode("latin-1") + "c\tdéjà vu\n".encode("utf-8")
    with pytest.raises(DataError, match=r"data:?.* is not utf-8 \(line 3, byte \d+: invalid continuation byte\)"):
        _read(tmp_path, content, "tsv")
    samples, report = _read(tmp_path, content, "tsv", fallback="latin-1")
    assert samples == [("naïve", "a"), ("café", "b"), ("déjà vu", "c")]  # the UTF-8 lines are not mojibake
    assert report.fallback_lines == [3] and "1 line read as latin-1 (line 3)" in str(report)


def test_the_fallback_is_warned_about_once_per_file_however_often_it_is_read(tmp_path, caplog):
    content = (H + "a\tcafé\n").encode("latin-1")
    with caplog.at_level("WARNING", logger="gadei_workloads.files"):
        for _ in range(3):  # gadei run reads the training file to prepare, and again to test the model
            _read(tmp_path, content, "tsv", fallback="latin-1")
        _read(tmp_path, content + "b\tdéjà\n".encode("latin-1"), "tsv", fallback="latin-1")
    warnings = [r.getMessage() for r in caplog.records if "read those as latin-1" in r.getMessage()]
    assert len(warnings) == 2, warnings  # once, and once more for the file's new content


def test_a_latin1_file_reads_with_latin1(tmp_path):
    samples, _ = _read(tmp_path, (H + "a\tcafé\n").encode("latin-1"), "tsv", encoding="latin-1")
    assert samples == [("café", "a")]


# (name, content, format, options, what the error says)
REFUSED = [
    ("empty file", b"", "tsv", {}, r"data file '.*data': empty"),
    ("white space only", b"\n\n  \n", "csv", {}, r"is empty \(5 bytes of white space\)"),
    ("binary", b"label\ttext\n\x89PNG\r\n\x1a\n\x00\x00\x00", "tsv", {}, r"is binary, not text: a NUL byte on line 4"),
    ("tsv tab inside a text", H + "a\tone\nb\ttwo\tthree\n", "tsv", {},
     r"data:3: 3 fields, the header has 2 \(a tab inside a text\?\)"),
    ("tsv too few fields", H + "a\tone\nb\n", "tsv", {}, r"data:3: 1 fields, the header has 2"),
    ("csv quote to the end of the file", C + 'a,one\nb,"never closed\nc,three\nd,four\n', "csv", {},
     r"data:3: a quoted field starts on this line and runs to the end of the file; is a quote unbalanced\?"),
    ("csv quote over many lines", C + 'a,"opens\n' + "x,y\n" * MAX_QUOTED_LINES + 'z,closes"\nb,two\n', "csv", {},
     rf"data:2: a quoted field runs over {MAX_QUOTED_LINES + 2} lines \(to line {MAX_QUOTED_LINES + 3}\)"),
    ("csv text after a closing quote", C + 'a,"one"two\n', "csv", {},
     r"data:2: a quoted field goes on after its closing quote; quote the whole field and double a quote inside it"),
    ("missing column, header looks like data", "pos\tthis film was great fun\nneg\tdull\n", "tsv", {},
     r"\[data\] text_column = 'text' is not a column of its header \(columns: 'pos', 'this film was great fun'\); "
     r"the first row looks like data, not a header: if the file has none, set \[data\] header = false"),
    ("semicolons read as csv", "label;text\na;one\n", "csv", {},
     r"is not a column of its header \(columns: 'label;text'\); the header is one column holding ';': is the file "
     r"separated by semicolons\? format csv reads commas, tsv tabs; save it with commas \(Excel saves ';' where"),
    ("commas read as tsv", C + "a,one\n", "tsv", {},
     r"\(columns: 'label,text'\); the header is one column holding ',': is the file separated by commas\? format csv "
     r"reads commas, tsv tabs$"),
    ("missing column, a real header", "category\tsentence\npos\tfun\n", "tsv", {},
     r"is not a column of its header \(columns: 'category', 'sentence'\)$"),
    ("column name without header", "a\tone\n", "tsv", {"header": False, "text_column": "text", "label_column": 1},
     r"names a column, but header = false"),
    ("column number past the row", "a\tone\n", "tsv", {"header": False, "text_column": 5, "label_column": 1},
     r"text_column = 5, but the first row has 2 columns"),
    ("jsonl text not a value", '{"text": {"a": 1}, "label": "x"}\n', "jsonl", {}, r"data:1: text .* is not a plain"),
    ("jsonl deeply nested", '{"text": ' + "[" * 100_000 + "]" * 100_000 + ', "label": "a"}\n', "jsonl", {},
     r"data:1: not a JSON object"),
    ("no samples at all", H + "\ta\n\n", "tsv", {}, r"no samples \(data: 3 lines, 0 samples; left out: 1 row"),
    ("text column is the label column", C + "a,one\nb,two\n", "csv", {"text_column": "label"},
     r"data: \[data\] text_column = 'label' and label_column = 'label' both name column 1 \('label'\): the label "
     r"would be the text"),
    ("text column by number is the label column", "a\tone\n", "tsv", {"header": False, "text_column": 1,
                                                                       "label_column": 1}, r"both name column 1:"),
    ("jsonl text key is the label key", '{"text": "one", "label": "a"}\n', "jsonl", {"text_column": "label"},
     r"both name key 'label': the label would be the text"),
    ("utf-16 is not utf-8", "label\ttext\na\tone\n".encode("utf-16"), "tsv", {},
     r"data' is UTF-16 text \(it starts with a UTF-16 byte-order mark\), not utf-8: "
     r"set \[data\] encoding = \"utf-16\"$"),
    ("utf-16 is not latin-1 either", "label\ttext\na\tone\n".encode("utf-16"), "tsv", {"encoding": "latin-1"},
     r"is UTF-16 text \(it starts with a UTF-16 byte-order mark\), not latin-1"),
    ("utf-32 is not utf-8", "label\ttext\na\tone\n".encode("utf-32"), "tsv", {},
     r"is UTF-32 text \(it starts with a UTF-32 byte-order mark\), not utf-8: set \[data\] encoding = \"utf-32\""),
    ("utf-16 without a mark", "label\ttext\na\tone\n".encode("utf-16-le"), "tsv", {},
     r"looks like UTF-16-LE text without a byte-order mark \(every other byte is NUL\), not utf-8: "
     r"set \[data\] encoding = \"utf-16-le\""),
    ("utf-16-be without a mark", "label\ttext\na\tone\n".encode("utf-16-be"), "tsv", {},
     r"looks like UTF-16-BE text .*encoding = \"utf-16-be\""),
]


@pytest.mark.parametrize("name,content,fmt,options,message", REFUSED, ids=[case[0] for case in REFUSED])
def test_a_file_that_is_not_what_the_job_says_is_refused_naming_file_and_line(tmp_path, name, content, fmt, options,
                                                                              message):
    with pytest.raises(DataError, match=message):
        _read(tmp_path, content, fmt, **options)
