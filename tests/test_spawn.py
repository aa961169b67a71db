"""Every process gadei starts runs the installed gadei, whatever the working directory.

`python -m gadei` puts the working directory first on sys.path, so from a repository root
after a non-editable `pip install .` every server, learner and watchdog imported the source
tree's `gadei/` (which has no compiled `_native`) and died. One function builds every such
command line (`gadei._proc.python_command`, with `-P`); these tests hold the code to it and
run a whole job from a folder that holds decoy packages of every name gadei imports.
"""

import ast
import json
from pathlib import Path

from helpers import communicate, unique_name

from gadei import _proc

ROOT = Path(__file__).resolve().parent.parent
DECOYS = ("gadei", "gadei_watchdog", "gadei_workloads")


def test_only_the_process_module_spells_python_dash_m():
    spelled = []
    for folder in ("gadei", "watchdog", "workloads"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(_proc.__file__).resolve():
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and node.value == "-m":
                    spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert spelled == [], f"build command lines with gadei._proc.python_command, not by hand: {spelled}"


def test_a_command_line_keeps_the_working_directory_off_the_module_path():
    assert _proc.gadei_command("serve", "job", 3) == [_proc.sys.executable, "-P", "-m", "gadei", "serve", "job", "3"]


def test_gadei_run_from_a_folder_of_decoy_packages_runs_the_installed_gadei(tmp_path, procs):
    here = tmp_path / "checkout"
    for name in DECOYS:  # what a source tree without the compiled extension amounts to
        (here / name).mkdir(parents=True)
        (here / name / "__init__.py").write_text(f"raise ImportError('the decoy {name} in the working directory')\n")
    rows = [f"{'dog' if i % 2 else 'cat'}\t\"a sentence {i} about {'dogs' if i % 2 else 'cats'}" for i in range(60)]
    (tmp_path / "train.tsv").write_text("label\ttext\n" + "\n".join(rows) + "\n\ncat\t\n")
    name = unique_name("spawn")
    (tmp_path / "job.toml").write_text(f'[job]\nname = "{name}"\nworkload = "textcnn"\n'
                                       '[data]\ntrain = "train.tsv"\nformat = "tsv"\n'
                                       '[train]\nlearners = 2\nepochs = 1\n[output]\nfolder = "out"\n')
    run = procs.gadei("run", tmp_path / "job.toml", "--quiet", cwd=here)
    out, err = communicate(run, 300)
    assert run.returncode == 0, out + err
    assert "decoy" not in out + err
    assert ("  read train.tsv: 63 lines, 60 samples; left out: 1 blank line (line 62), 1 row with empty text "
            "(line 63)") in out
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["finished"] is True
    logs = "".join(p.read_text() for p in (tmp_path / "out" / "logs").iterdir() if p.is_file())
    assert "decoy" not in logs


def test_a_command_line_says_which_gadei_command_it_runs():
    """`gadei serve` decides its OpenMP wait policy from its own command line as the package is
    imported (gadei/__init__.py): every way gadei or a user starts it is recognised, and no other
    program or command is taken for it."""
    assert _proc.gadei_subcommand(_proc.gadei_command("serve", "--job-file", "j.toml")) == "serve"
    assert _proc.gadei_subcommand(_proc.gadei_command("learn", "--job-file", "j.toml")) == "learn"
    assert _proc.gadei_subcommand(["/venv/bin/python3", "/venv/bin/gadei", "serve", "x"]) == "serve"
    assert _proc.gadei_subcommand(["python", "-X", "importtime", "-B", "-m", "gadei", "serve"]) == "serve"
    for other in (["python", "-m", "pytest", "serve"], ["python", "train.py", "serve"], ["python", "-c", "x", "serve"],
                  ["python", "-m", "gadei"], ["python", "/venv/bin/gadei"], ["python"]):
        assert _proc.gadei_subcommand(other) is None, other
