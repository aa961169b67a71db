"""One owner per shared-memory protocol and per C module, one name per public class: the
house rules of issue 16, held by a scan of the source (AST), so that a new module cannot
quietly write a handshake again or call the native layer around its owners."""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"gadei": ROOT / "gadei", "gadei_watchdog": ROOT / "watchdog", "gadei_workloads": ROOT / "workloads"}

# The modules that own a protocol or a kernel, and so call gadei._native (see gadei/_native.pyi):
# the region's atomic words and futexes, the rings, the update kernels, the transports'
# payload kernels, the bridge's weights copy and exit guard, the kernel benchmarks, and the
# benchmarks' probe of how near the CPUs are (timing.cross_cpu_ns).
NATIVE_OWNERS = {
    "gadei/region.py", "gadei/ring.py", "gadei/modes.py",
    "gadei/transport/slot.py", "gadei/transport/pull.py",
    "gadei/bridge/node.py", "gadei/bridge/exchange.py",
    "gadei/bench/__init__.py", "gadei/bench/latency.py", "gadei/bench/kernel.py", "gadei/bench/timing.py",
}

# Header words of the run-state machine, the stop handshake, the doorbell, the version waits
# and the checkpoint hold: only gadei/protocol.py names them.
PROTOCOL = "gadei/protocol.py"
LAYOUT = "gadei/layout.py"  # declares them (offsets), says nothing of how they are used
PROTOCOL_FIELDS = {"run_state", "doorbell", "server_sleeping", "version_waiters", "seq", "hold", "held", "hold_epoch"}


def _sources():
    for folder in FOLDERS.values():
        for path in sorted(folder.rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def native_importers(sources) -> set[str]:
    found = set()
    for name, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (
                    (node.module or "").endswith("_native") or any(a.name == "_native" for a in node.names)):
                found.add(name)
            elif isinstance(node, ast.Import) and any(a.name.endswith("._native") for a in node.names):
                found.add(name)
    return found


def protocol_field_uses(sources) -> dict[str, set[str]]:
    """Modules other than the protocol's that name a protocol header word: a string constant
    equal to the field's name (h.get("run_state"), h.addr("doorbell"), a tuple of names)."""
    found = defaultdict(set)
    for name, tree in sources:
        if name in (PROTOCOL, LAYOUT):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in PROTOCOL_FIELDS:
                found[name].add(node.value)
    return dict(found)


def shared_class_names(sources) -> dict[str, list[str]]:
    """Public class names defined in more than one module."""
    where = defaultdict(list)
    for name, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(name)
    return {cls: places for cls, places in where.items() if len(places) > 1}


def test_only_the_owners_import_the_native_module():
    assert native_importers(_sources()) == NATIVE_OWNERS


def test_only_the_protocol_module_names_the_protocol_header_words():
    assert protocol_field_uses(_sources()) == {}


def test_no_two_public_classes_share_a_name():
    assert shared_class_names(_sources()) == {}


def test_the_scans_find_what_they_look_for():
    """Each scan catches a module breaking its rule (so that the tests above can fail)."""
    broken = [("gadei/stray.py", ast.parse(
        "from . import _native\nclass Record: pass\ndef f(h):\n    return h.get('run_state')\n")),
              ("gadei/other.py", ast.parse("class Record: pass\n"))]
    assert native_importers(broken) == {"gadei/stray.py"}
    assert protocol_field_uses(broken) == {"gadei/stray.py": {"run_state"}}
    assert shared_class_names(broken) == {"Record": ["gadei/stray.py", "gadei/other.py"]}
