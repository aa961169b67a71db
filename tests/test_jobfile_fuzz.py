"""Job files fuzzed: several hundred seeded mutations of a valid job file (wrong types,
out-of-range numbers, unknown keys and sections, control characters, huge and deeply nested
values, odd paths for the job file, its data and its output folder) each either get a
one-line `GadeiError` that names the file, or are accepted and write themselves back
(`Job.to_toml`) as the same job. Through `gadei.run.check_job`, what `gadei run --check`
runs (nothing is trained), and a few real `gadei run --check` processes."""

import math
import os
import random
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest

from helpers import communicate
from gadei import data, jobfile
from gadei.errors import GadeiError
from gadei.prepare import check_job

CASES = 360  # generated job files, besides the odd job-file paths

BASE = {
    "job": {"name": "NAME", "workload": "textcnn"},
    "data": {"train": "good.csv", "format": "csv", "label_column": "category"},
    "train": {"learners": 2, "lr": 0.05, "epochs": 3, "seed": 1},
    "checkpoint": {"interval": 30.0, "keep": 2},
    "output": {"folder": "out"},
}
KEYS = {section: list(keys) for section, keys in jobfile._SCHEMA.items()}
ODD_VALUES = [
    "", " ", "x" * 5000, -1, 0, 1, 2**63 - 1, -(2**63), 1e30, 1e-30, -0.0, math.inf, -math.inf, math.nan, 0.5, 10.0,
    10.000001, 65, 64, True, False, [], ["a", 1], [[[]]], {}, {"a": 1}, "auto", "cpu", "cuda:99999999999999999999",
    "cuda:0,cuda:0", "../../../../etc/passwd", "~/nowhere", "utf-16", "rot13", "latin-1", "per-label", "npz", "sgd",
]
CONTROL = ["\n", "\r", "\t", "\x00", "\x1b", "\x7f", "\x85", "\u2028"]


def _toml(value) -> str:
    """TOML for any value the fuzzer makes (strings JSON-escaped, which TOML reads)."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return ("nan" if math.isnan(value) else "inf" if value == math.inf else "-inf" if value == -math.inf
                else repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def _text(body: dict) -> str:
    return "\n".join(f"[{section}]\n" + "".join(f"{json_key(k)} = {_toml(v)}\n" for k, v in keys.items())
                     if isinstance(keys, dict) else f"{json_key(section)} = {_toml(keys)}\n"
                     for section, keys in body.items())


def json_key(key: str) -> str:
    import json

    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else json.dumps(key)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Data files good and odd, and odd places, in one folder."""
    root = tmp_path_factory.mktemp("fuzz")
    rows = [f'"sentence {i} about {"dogs" if i % 2 else "cats"}",{"dog" if i % 2 else "cat"}' for i in range(40)]
    (root / "good.csv").write_text("text,category\n" + "\n".join(rows) + "\n")
    (root / "good.tsv").write_text("text\tcategory\n" + "\n".join(r.replace('",', "\t").strip('"') for r in rows))
    (root / "empty.csv").write_bytes(b"")
    (root / "blank.csv").write_text("\n \n")
    (root / "binary.csv").write_bytes(b"text,category\nab\0cd,x\n")
    (root / "latin1.csv").write_bytes(b"text,category\ncaf\xe9 au lait,a\nth\xe9,b\n")
    (root / "one-label.csv").write_text("text,category\na b,x\nc d,x\n")
    (root / "ctl-header.csv").write_text("te\x01xt,category\na,x\nb,y\n")
    x = np.random.default_rng(0).normal(size=(40, 3))
    np.savez(root / "good.npz", x=x, y=np.arange(40) % 2)
    (root / "truncated.npz").write_bytes((root / "good.npz").read_bytes()[:200])
    np.savez(root / "nofeatures.npz", x=np.zeros((40, 0)), y=np.arange(40) % 2)
    (root / "nofeatures.csv").write_text("label\n" + "\n".join(str(i % 2) for i in range(40)) + "\n")
    (root / "numeric.csv").write_text("a,b,label\n" + "\n".join(f"{i},{i * 2},{i % 2}" for i in range(40)) + "\n")
    (root / "folder").mkdir()
    os.mkfifo(root / "fifo")
    (root / "loop-a").symlink_to(root / "loop-b")
    (root / "loop-b").symlink_to(root / "loop-a")
    (root / "a-file").write_text("not a folder\n")
    (root / "folder-link").symlink_to(root / "folder")
    for name, child in (("logs-file", "logs"), ("toml-folder", "job.toml"), ("ckpt-file", "checkpoints")):
        (root / name).mkdir()
        (root / name / child).mkdir() if child == "job.toml" else (root / name / child).write_text("x")
    (root / "read-only").mkdir(mode=0o500)
    return root


def _odd_paths(root: Path) -> list[str]:
    return [str(root / p) for p in ("empty.csv", "blank.csv", "binary.csv", "latin1.csv", "one-label.csv",
                                    "ctl-header.csv", "folder", "fifo", "loop-a", "missing.csv", "good.tsv",
                                    "truncated.npz", "nofeatures.npz", "nofeatures.csv", "good.npz")] + [
        "/dev/zero", "/dev/null", "/proc/kmsg", "/proc/self/status", "/", str(root / ("x" * 300)),
        "/".join(["", *["d" * 200] * 30]), str(root / "folder" / ".." / "good.csv"), "good.csv\n", "\x00"]


def _odd_outputs(root: Path) -> list[str]:
    return [str(root / p) for p in ("a-file", "folder-link", "logs-file", "toml-folder", "ckpt-file", "read-only",
                                    "a-file/below", "loop-a", "folder")] + [
        "/dev/null", "/proc", str(root / ("y" * 300)), "/".join(["", *["e" * 200] * 30]), "out\x1b[2J", "out\n"]


def _section(body: dict, name: str) -> dict:
    """body[name] as a table (an earlier mutation may have made it a value)."""
    if not isinstance(body.get(name), dict):
        body[name] = {}
    return body[name]


def _mutate(rng: random.Random, body: dict, root: Path) -> tuple[str, str]:
    """One mutation of `body` (in place); (what it did, the job file's text)."""
    kind = rng.choice(["type", "range", "unknown", "control", "huge", "data", "output", "numeric", "bytes",
                       "drop", "section"])
    section = rng.choice(list(KEYS))
    key = rng.choice(KEYS[section])
    if kind in ("type", "range"):
        value = rng.choice(ODD_VALUES)
        _section(body, section)[key] = value
        return f"[{section}] {key} = {value!r}"[:120], _text(body)
    if kind == "unknown":
        name = rng.choice(["lerners", "lr ", "extra", "Train", "ñame", "a.b", ""])
        target = rng.choice([section, "unknown"])
        _section(body, target)[name] = 1
        return f"unknown [{target}] {name!r}", _text(body)
    if kind == "control":
        section, key = rng.choice([("job", "name"), ("job", "workload"), ("data", "train"), ("data", "format"),
                                   ("data", "label_column"), ("data", "text_column"), ("data", "encoding"),
                                   ("output", "folder"), ("train", "devices"), ("train", "mode")])
        value = str(_section(body, section).get(key, "x"))
        at = rng.randrange(len(value) + 1)
        _section(body, section)[key] = value[:at] + rng.choice(CONTROL) + value[at:]
        return f"control character in [{section}] {key}", _text(body)
    if kind == "huge":
        how = rng.choice(["deep", "long", "wide", "big-file"])
        if how == "deep":
            depth = rng.choice([100, 1000, 100_000])
            return f"nested {depth} deep", _text(body) + f"\n[train.x]\ny = {'[' * depth}{']' * depth}\n"
        if how == "long":
            _section(body, section)[key] = "z" * rng.choice([2000, 5000, 200_000])
            return f"[{section}] {key}: a long string", _text(body)
        if how == "wide":
            _section(body, section)[key] = list(range(rng.choice([1000, 50_000])))
            return f"[{section}] {key}: a long list", _text(body)
        return "a job file over 1 MiB", _text(body) + "# " + "p" * (1 << 20) + "\n"
    if kind == "data":
        path = rng.choice(_odd_paths(root))
        _section(body, "data")[rng.choice(["train", "test"])] = (path if rng.random() < 0.8
                                                                  else [path, str(root / "good.csv")])
        if rng.random() < 0.3:
            _section(body, "data")["format"] = rng.choice(["per-label", "tsv", "jsonl", "trec", "npz"])
        return f"data file {path[:80]!r}", _text(body)
    if kind == "output":
        folder = rng.choice(_odd_outputs(root))
        _section(body, "output")["folder"] = folder
        return f"output folder {folder[:80]!r}", _text(body)
    if kind == "numeric":
        _section(body, "job")["workload"] = "mlp"
        data = rng.choice(["good.npz", "truncated.npz", "nofeatures.npz", "nofeatures.csv", "numeric.csv", "good.csv"])
        body["data"] = {"train": str(root / data), "format": "npz" if data.endswith("npz") else "csv",
                        "label_column": rng.choice(["label", 1, 3, "category"])}
        return f"mlp on {data}", _text(body)
    if kind == "drop":
        _section(body, section).pop(key, None)
        return f"[{section}] {key} left out", _text(body)
    if kind == "section":
        body[section] = rng.choice([1, "x", [], {"": 1}])
        return f"[{section}] as a value", _text(body)
    text = bytearray(_text(body).encode())
    for _ in range(rng.randint(1, 4)):  # bytes: deleted, replaced, inserted
        at = rng.randrange(len(text))
        op = rng.randrange(3)
        if op == 0:
            del text[at]
        elif op == 1:
            text[at] = rng.randrange(256)
        else:
            text[at:at] = bytes([rng.randrange(256)])
    return "random bytes changed", text.decode("latin-1")


def _listing(folder: Path) -> list[str]:
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def _one_case(path: Path, what: str) -> str:
    """'error' or 'accepted'; fails the test with the case otherwise."""
    before = _listing(path.parent)
    try:
        lines = check_job(str(path))
    except GadeiError as err:
        assert _listing(path.parent) == before, f"{what}: the check wrote into the folder"
        message = str(err)
        assert message and "\n" not in message and "\r" not in message, f"{what}: not one line: {message!r}"
        assert path.name in message or "job.toml" in message, f"{what}: the message does not name the file: {message!r}"
        return "error"
    except BaseException as err:  # noqa: BLE001 - any other exception is the finding
        pytest.fail(f"{what}: {type(err).__name__} instead of a clear error: {err!r}"[:2000])
    assert lines and lines[0].startswith("gadei run: job "), what
    assert _listing(path.parent) == before, f"{what}: the check wrote into the folder"
    job = jobfile.load(path)
    again_path = path.with_name("as-run.toml")
    again_path.write_text(job.to_toml())
    again = jobfile.load(again_path)
    assert again == jobfile.Job(**{**job.__dict__, "path": again.path}), f"{what}: job.toml does not read back"
    _builds(job, what)
    _write_as_a_run_would(job, what)
    return "accepted"


def _builds(job: jobfile.Job, what: str) -> None:
    """The accepted job's data load and its model builds (the learner's first steps; a job that
    picks its model: each candidate's, as its learners take it)."""
    from dataclasses import replace

    from gadei_workloads import CANDIDATES, get

    for workload in CANDIDATES if job.workload == jobfile.AUTO else (job.workload,):
        train = data.load_job(replace(job, workload=workload))[0]
        size = len(train.vocab) if train.vocab is not None else train.features
        try:
            get(workload).build_from_maps(size, train.n_labels, job.train.seed)
        except Exception as err:  # noqa: BLE001 - the finding
            pytest.fail(f"{what}: accepted, but its model does not build: {err!r}")


def _write_as_a_run_would(job: jobfile.Job, what: str) -> None:
    """The first writes of a run into the accepted job's output folder succeed (then undone)."""
    out = job.output
    made = [p for p in (out, out / "logs", out / "job.toml") if not os.path.lexists(p)]
    try:
        (out / "logs").mkdir(parents=True, exist_ok=True)
        (out / "job.toml").write_text(job.to_toml())
    except OSError as err:
        pytest.fail(f"{what}: accepted, but the run could not write its output folder: {err}")
    for path in reversed(made):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _issue_cases(root: Path) -> list[tuple[str, str, object]]:
    """Issue 19's job files that got a traceback, hung, or were accepted and then failed:
    (section, key, value) set on the base job; each must now be refused."""
    deep = "[" * 100_000 + "]" * 100_000
    return [("train", "x", deep), ("train", "devices", "cuda:99999999999999999999"),
            ("data", "train", str(root / "loop-a")), ("data", "train", str(root / ("x" * 300))),
            ("data", "train", str(root / "fifo")), ("data", "train", "/proc/kmsg"), ("data", "train", "/dev/zero"),
            ("output", "folder", str(root / "a-file")), ("output", "folder", "/dev/null"),
            ("output", "folder", str(root / "logs-file")), ("output", "folder", str(root / "toml-folder")),
            ("output", "folder", str(root / "ckpt-file")), ("output", "folder", str(root / "folder-link")),
            ("output", "folder", "/proc"), ("output", "folder", "out\x1b"), ("data", "label_column", "cat\x01"),
            ("train", "lr", 1e30), ("train", "lr", 10.5), ("data", "fallback_encoding", "nope"),
            ("job", "workload", "mlp-truncated"), ("job", "workload", "mlp-nofeatures")]


def test_fuzzed_job_files_get_a_clear_error_or_run_as_written(corpus, tmp_path, capsys):
    rng = random.Random(0)
    counts = {"error": 0, "accepted": 0}
    for case, (section, key, value) in enumerate(_issue_cases(corpus)):
        folder = tmp_path / f"issue-{case}"
        folder.mkdir()
        body = {s: dict(keys) for s, keys in BASE.items()}
        body["job"]["name"] = f"fz-{uuid.uuid4().hex[:10]}"
        body["data"]["train"] = str(corpus / "good.csv")
        body["output"]["folder"] = str(folder / "out")
        if key == "workload":
            body["job"]["workload"] = "mlp"
            body["data"] = {"train": str(corpus / f"{value[4:]}.npz"), "format": "npz"}
        else:
            body[section][key] = value
        path = folder / "job.toml"
        path.write_text(_text(body))
        assert _one_case(path, f"issue case [{section}] {key} = {str(value)[:60]!r}") == "error", (section, key, value)
        counts["error"] += 1
    for case in range(CASES):
        folder = tmp_path / f"case-{case}"
        folder.mkdir()
        (folder / "good.csv").symlink_to(corpus / "good.csv")
        body = {s: dict(keys) for s, keys in BASE.items()}
        body["job"]["name"] = f"fz-{uuid.uuid4().hex[:10]}"
        body["output"]["folder"] = str(folder / "out")
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            what, text = _mutate(rng, body, corpus)
        path = folder / "job.toml"
        path.write_text(text, encoding="latin-1" if what == "random bytes changed" else "utf-8",
                        errors="surrogateescape")
        counts[_one_case(path, f"case {case}: {what}")] += 1
    odd = [corpus / "fifo", Path("/dev/zero"), corpus / "folder", corpus / "loop-a", corpus / ("j" * 300),
           corpus / "missing.toml", corpus / "good.csv", corpus / "binary.csv", Path("/proc/self/status")]
    for path in odd:
        counts[_one_case(path, f"job file {path}")] += 1
    total = CASES + len(odd) + len(_issue_cases(corpus))
    with capsys.disabled():
        print(f"\njob-file fuzz: {total} cases, {counts['error']} clear errors, {counts['accepted']} accepted")
    assert counts["error"] + counts["accepted"] == total and counts["accepted"] >= 20 and counts["error"] >= 200


def test_gadei_run_check_exits_0_or_2_with_one_line_and_writes_nothing(corpus, tmp_path, procs):
    good = tmp_path / "good.toml"
    body = {s: dict(keys) for s, keys in BASE.items()}
    body["job"]["name"] = f"fz-{uuid.uuid4().hex[:10]}"
    body["data"]["train"] = str(corpus / "good.csv")
    body["output"]["folder"] = str(tmp_path / "out")
    good.write_text(_text(body))
    nested = tmp_path / "nested.toml"
    nested.write_text(_text(body) + "[train.x]\ny = " + "[" * 100_000 + "]" * 100_000 + "\n")
    runs = {path: procs.gadei("run", "--check", path) for path in (good, nested, corpus / "fifo", "/dev/zero")}
    for path, proc in runs.items():
        out, err = communicate(proc, 120)
        if path == good:
            assert proc.returncode == 0, out + err
            assert "  read good.csv: 41 lines, 40 samples" in out and out.splitlines()[-1] == "check passed", out
            assert not (tmp_path / "out").exists()
        else:
            assert proc.returncode == 2, (path, out, err)
            assert len(err.strip().splitlines()) == 1 and Path(path).name in err and "Traceback" not in err, err
