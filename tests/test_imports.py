"""The import graph of gadei, gadei_watchdog and gadei_workloads has no circle, counting imports
inside functions too (a circle hidden in a function still ties two modules into one), no
module is longer than the house limit, and the commands that do not train start without torch."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gadei
from helpers import unique_name

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"gadei": ROOT / "gadei", "gadei_watchdog": ROOT / "watchdog", "gadei_workloads": ROOT / "workloads"}
MAX_LINES = 700


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__main__":
                continue
            name = ".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))
            found[name] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that `name` imports (a package's name counts as its __init__)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    for name in graph:  # importing a module runs its package's __init__ first: not an edge of ours
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    return graph


def test_the_import_graph_has_no_circle():
    assert _cycles(_graph()) == []


def test_the_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def supervisor_importers(graph: dict[str, set[str]]) -> list[str]:
    """gadei's modules that import the supervisor's package, gadei_watchdog (inside functions too)."""
    return sorted(f"{name} imports {target}" for name, targets in graph.items() if name.split(".")[0] == "gadei"
                  for target in targets if target.split(".")[0] == "gadei_watchdog")


def test_gadei_starts_the_supervisor_and_never_imports_it():
    """The dependency runs one way: gadei_watchdog uses gadei; gadei starts the supervisor as a
    process (`python -m gadei_watchdog`) and reads what it leaves (`gadei.supervisor`)."""
    assert supervisor_importers(_graph()) == []
    assert supervisor_importers({"gadei.cli": {"gadei_watchdog.cli"}, "gadei_watchdog": {"gadei.region"}}) == \
        ["gadei.cli imports gadei_watchdog.cli"]


def command_line_importers(graph: dict[str, set[str]]) -> list[str]:
    """Modules of the library (and the supervisor's) that import the command line, gadei.cli
    (inside functions too): only gadei.cli itself and gadei.__main__ may."""
    return sorted(f"{name} imports {target}" for name, targets in graph.items()
                  if not (name == "gadei.cli" or name.startswith("gadei.cli.") or name == "gadei.__main__")
                  for target in targets if target == "gadei.cli" or target.startswith("gadei.cli."))


def test_the_library_never_imports_the_command_line():
    """The command line is a thin client of the library; the library (the trainer once took its
    JSON lines and its model from gadei.cli.common) never needs it."""
    assert command_line_importers(_graph()) == []
    assert command_line_importers({"gadei.trainer": {"gadei.cli.common"}, "gadei.cli.run": {"gadei.cli.common"},
                                   "gadei.__main__": {"gadei.cli"}}) == ["gadei.trainer imports gadei.cli.common"]


def test_every_package_is_installed():
    """pyproject.toml lists every package folder (a subpackage left out is missing from a
    non-editable install, while an editable one still finds it in the source tree)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join((package, *init.parent.relative_to(folder).parts))
               for package, folder in PACKAGES.items() for init in folder.rglob("__init__.py")}
    assert listed == folders


def test_no_module_is_over_the_limit():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_test_module_imports_another():
    """What tests share is in helpers.py (functions) and conftest.py (fixtures): a test module
    imported by another runs its module-level code twice and ties two files' tests together."""
    tests = {path.stem for path in (ROOT / "tests").rglob("test_*.py")}
    found = []
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[-1] in tests]
    assert found == []


def _fresh(code: str) -> dict:
    """What `code` (run in a fresh interpreter) prints as its last line, read as JSON."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_commands_that_do_not_train_start_without_torch():
    """`import gadei`, `import gadei.cli` and `gadei status` / `clean` / `stop --help` leave torch
    (more than a second of CPU to import) unloaded: the suite and its users start hundreds of them."""
    job = unique_name("no-torch")
    found = _fresh(f"""
import contextlib, io, json, sys
import gadei
after = {{"import gadei": "torch" in sys.modules}}
import gadei.cli
after["import gadei.cli"] = "torch" in sys.modules
for argv in (["status", "{job}"], ["clean", "{job}"], ["stop", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = gadei.cli.main(argv)
        except SystemExit as exit:
            code = exit.code
    after["gadei " + " ".join(argv)] = "torch" in sys.modules
    after["gadei " + argv[0] + " exit"] = code
print(json.dumps(after))
""")
    assert found == {"import gadei": False, "import gadei.cli": False,
                     f"gadei status {job}": False, "gadei status exit": 2,  # no such job
                     f"gadei clean {job}": False, "gadei clean exit": 0,
                     "gadei stop --help": False, "gadei stop exit": 0}


def test_a_job_file_is_checked_and_submitted_without_torch(tmp_path, monkeypatch):
    """Reading a job file (every workload, and "auto") and `gadei submit`, a client of the daemon
    which reads the data, leave torch unloaded (each `gadei submit` took 1.4 s more to import it,
    two thirds of a small job's wait for its queue); the workloads' kinds, which a job file is
    checked by, are the registry's."""
    (tmp_path / "data.csv").write_text("text,label\n" + "".join(f"row {i},l{i % 2}\n" for i in range(20)))
    np.savez(tmp_path / "data.npz", x=np.zeros((20, 2)), y=np.arange(20) % 2)
    for workload, data in (("auto", "data.csv"), ("ngram", "data.csv"), ("textcnn", "data.csv"),
                           ("lstm", "data.csv"), ("mlp", "data.npz")):
        (tmp_path / f"{workload}.toml").write_text(f'[job]\nname = "j{workload}"\nworkload = "{workload}"\n'
                                                   f'[data]\ntrain = "{data}"\n')
    monkeypatch.setenv("GADEI_RUNTIME_DIR", str(tmp_path / "run"))  # no daemon there
    monkeypatch.setenv("GADEI_STATE_DIR", str(tmp_path / "state"))
    found = _fresh(f"""
import contextlib, io, json, sys
import gadei.cli
from gadei import jobfile
after = {{}}
for workload in ("auto", "ngram", "textcnn", "lstm", "mlp"):
    after[workload] = jobfile.load("{tmp_path}/" + workload + ".toml").workload
after["read, torch"] = "torch" in sys.modules
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
    after["submit exit"] = gadei.cli.main(["submit", "{tmp_path}/ngram.toml"])
after["no daemon"] = "no gadei daemon" in err.getvalue()
after["submitted, torch"] = "torch" in sys.modules
from gadei_workloads import KINDS, WORKLOADS
after["kinds"] = KINDS == {{name: w.kind for name, w in WORKLOADS.items()}}
print(json.dumps(after))
""")
    assert found == {"auto": "auto", "ngram": "ngram", "textcnn": "textcnn", "lstm": "lstm", "mlp": "mlp",
                     "read, torch": False, "submit exit": 2, "no daemon": True, "submitted, torch": False,
                     "kinds": True}, found


def test_the_public_names_resolve_when_touched():
    """`gadei.Server` and `gadei.Learner` import their modules (and torch) on first use, and are
    the classes those modules define."""
    found = _fresh("""
import json, sys
import gadei
before = "torch" in sys.modules
from gadei.learner import Learner
from gadei.server import Server
print(json.dumps({"before": before, "server": gadei.Server is Server, "learner": gadei.Learner is Learner,
                  "after": "torch" in sys.modules}))
""")
    assert found == {"before": False, "server": True, "learner": True, "after": True}


def test_every_public_name_is_there():
    assert all(getattr(gadei, name) is not None for name in gadei.__all__)
    assert set(gadei.__all__) <= set(dir(gadei))
    assert gadei.__version__


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Srever'"):
        gadei.__getattr__("Srever")
    assert not hasattr(gadei, "Srever")


def test_a_source_folder_without_its_native_module_says_so_and_what_to_do(tmp_path):
    """After `pip install .`, Python started in the repository's root imports its source folder
    (the current folder comes first on sys.path), which holds no built native module: the
    README's `gadei.Client()` there failed with `cannot import name '_native' from 'gadei'`. It
    says why and what to do; where the module is there, nothing changes."""
    import shutil

    shutil.copytree(ROOT / "gadei", tmp_path / "gadei", ignore=shutil.ignore_patterns("_native*", "__pycache__"))
    code = ("import sys; sys.meta_path = [f for f in sys.meta_path if 'Editable' not in "  # as a plain install
            "getattr(f, '__name__', type(f).__name__)]\n"
            "import gadei; assert gadei.__file__.startswith(sys.argv[1]), gadei.__file__; gadei.Client")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert (f"ImportError: gadei's native module is not built in {tmp_path / 'gadei'}: this is a source folder"
            in done.stderr and "run Python from another folder, or build it here with `python setup.py "
            "build_ext --inplace`" in done.stderr), done.stderr
    assert gadei._native.__name__ == "gadei._native"
