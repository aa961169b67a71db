"""A file written whole or not at all (`gadei.files.replace`), which every record, result and
model of gadei is written through."""

import itertools
import os
import stat
import subprocess
import sys

import pytest

from gadei import files
from helpers import files_up_to


def test_a_write_that_fails_midway_leaves_the_file_as_it_was_and_nothing_beside_it(tmp_path):
    path = tmp_path / "result.json"
    files.replace(path, '{"outcome": "done"}\n')

    def half(out):
        out.write(b'{"outcome": "fa')
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        files.replace(path, half)
    assert path.read_text() == '{"outcome": "done"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_a_failed_write_that_torch_save_reports_as_its_own_error_is_the_oserror_that_failed_it(tmp_path):
    """torch.save reports a write that failed (a full disk, a quota, a file too large) as a
    RuntimeError ("unexpected pos 1536 vs 1430"): a learner's best.pt on a full disk crashed it
    with that traceback, and model.pt its supervisor. `replace` raises the OSError that failed the
    write, naming the file, and leaves nothing behind; files of another writer's too (np.savez)."""
    script = files_up_to(65536) + """
import errno, os, sys
import numpy as np
import torch
from pathlib import Path
from gadei import files, params
for name, save in (("model.pt", lambda path: params.save({"w": torch.zeros(100_000)}, str(path))),
                   ("weights.npz", lambda path: files.replace(path, lambda f: np.savez(f, w=np.zeros(100_000))))):
    path = Path(sys.argv[1]) / name
    try:
        save(path)
    except OSError as err:
        print(name, errno.errorcode[err.errno], err.filename == str(path), sorted(os.listdir(path.parent)))
params.save({"w": torch.zeros(10)}, str(Path(sys.argv[1]) / "small.pt"))
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["model.pt EFBIG True []", "weights.npz EFBIG True []"], done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.pt"]


@pytest.mark.parametrize("private, mode", [(True, 0o600), (False, 0o644)])
def test_a_private_file_is_0600_whatever_the_umask(tmp_path, private, mode):
    old = os.umask(0o022)
    try:
        files.replace(tmp_path / "model.pt", b"weights", private=private)
        files.replace(tmp_path / "model.pt", lambda out: out.write(b"newer"), private=private, durable=True)
    finally:
        os.umask(old)
    assert (tmp_path / "model.pt").read_bytes() == b"newer"
    assert stat.S_IMODE((tmp_path / "model.pt").stat().st_mode) == mode


def test_a_link_in_the_temporary_files_place_is_not_followed(tmp_path, monkeypatch):
    """A link planted where a write's temporary file goes is removed, not written through."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    monkeypatch.setattr(files, "_WRITES", itertools.count(7))  # the next write is this process's 7th
    os.symlink(victim, tmp_path / f".job.json.tmp{os.getpid()}.7")
    files.replace(tmp_path / "job.json", "{}")
    assert victim.read_text() == "keep"
    assert (tmp_path / "job.json").read_text() == "{}"


def test_the_next_writer_removes_what_a_killed_writer_left(tmp_path):
    """A temporary file whose writer's pid runs no more is removed; one of a live writer, one of
    another file than those named, and a user's own hidden file are kept."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {"dead": f".result.json.tmp{dead.pid}.3", "old naming": f".model.pt.tmp{dead.pid}",
             "live": f".result.json.tmp{os.getpid()}.9", "other file": f".notes.txt.tmp{dead.pid}.1",
             "user's": ".result.json.swp"}
    for name in names.values():
        (tmp_path / name).write_text("half")
    files.remove_orphans(tmp_path, ("result.json", "model.pt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [names["live"], names["other file"], names["user's"]])
    files.remove_orphans(tmp_path / "absent")  # a folder not made yet: nothing to remove
