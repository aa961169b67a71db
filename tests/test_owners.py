"""One owner per shared-memory protocol and per C module, one name per public class, one module
that starts and kills processes: the house rules of issues 16 and 32, held by a scan of the
source (AST), so that a new module cannot quietly write a handshake again, call the native
layer around its owners or start a process of its own."""

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
    "gadei/transport/slot.py", "gadei/transport/pull.py", "gadei/transport/device.py",
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


# Starting a process, and "wait for a child, else kill it", are written once: gadei/launch.py's
# `spawn` (`run_command`, `become`) and `wait_or_kill`.
PROCESS_OWNER = "gadei/launch.py"


SPAWNS = {("subprocess", "Popen"), ("subprocess", "run"), ("subprocess", "call"), ("subprocess", "check_call"),
          ("subprocess", "check_output"), ("os", "fork"), ("os", "posix_spawn")}
BENCHMARKS = "gadei/bench/"  # a benchmark's own processes are not a job's


def spawners(sources) -> set[str]:
    """Modules (benchmarks aside) that start a process themselves: subprocess, os.fork, os.exec*."""
    found = set()
    for name, tree in sources:
        if name.startswith(BENCHMARKS):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and ((node.func.value.id, node.func.attr) in SPAWNS
                                                               or node.func.value.id == "os" and
                                                               node.func.attr.startswith(("exec", "spawn"))):
                found.add(name)
    return found


def kills_after_a_wait(sources) -> set[str]:
    """Modules that catch a wait's `TimeoutExpired` and kill the child there themselves."""
    found = set()
    for name, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.ExceptHandler) and node.type is not None and any(
                    isinstance(n, (ast.Name, ast.Attribute)) and (getattr(n, "id", None) or getattr(n, "attr", None))
                    == "TimeoutExpired" for n in ast.walk(node.type)) and any(
                    isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "kill"
                    for stmt in node.body for n in ast.walk(stmt)):
                found.add(name)
    return found


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


def test_only_the_process_owner_starts_a_process():
    assert spawners(_sources()) == {PROCESS_OWNER}


def test_only_the_process_owner_kills_a_child_that_did_not_exit_in_time():
    assert kills_after_a_wait(_sources()) == {PROCESS_OWNER}


def test_the_scans_find_what_they_look_for():
    """Each scan catches a module breaking its rule (so that the tests above can fail)."""
    broken = [("gadei/stray.py", ast.parse(
        "from . import _native\nclass Record: pass\ndef f(h):\n    return h.get('run_state')\n")),
              ("gadei/other.py", ast.parse("class Record: pass\n")),
              ("gadei/waits.py", ast.parse("try:\n    p.wait(timeout=60)\nexcept subprocess.TimeoutExpired:\n"
                                           "    p.kill()\n    p.wait()\n"))]
    assert native_importers(broken) == {"gadei/stray.py"}
    assert protocol_field_uses(broken) == {"gadei/stray.py": {"run_state"}}
    assert shared_class_names(broken) == {"Record": ["gadei/stray.py", "gadei/other.py"]}
    assert kills_after_a_wait(broken) == {"gadei/waits.py"}
    started = [("gadei/a.py", ast.parse("subprocess.Popen(['x'])")), ("gadei/b.py", ast.parse("os.execv('x', ['x'])")),
               ("gadei/bench/c.py", ast.parse("subprocess.run(['x'])")), ("gadei/d.py", ast.parse("p.run()"))]
    assert spawners(started) == {"gadei/a.py", "gadei/b.py"}
