"""One owner per shared-memory protocol and per C module, one name per public class, one module
that starts and kills processes: the house rules of issues 16 and 32, held by a scan of the
source (AST), so that a new module cannot quietly write a handshake again, call the native
layer around its owners or start a process of its own; and only the ring reads or writes a
ring's counters and owner accounting, and writes a slot's header; only the slot's format and
the learner's writer a slot's row counts; only gadei/outputs.py writes a job's outputs, and only
the job's supervisor has it write them; only gadei/_proc.py says whether a process runs; and no
module reads a process's state from its log."""

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"gadei": ROOT / "gadei", "gadei_watchdog": ROOT / "watchdog", "gadei_workloads": ROOT / "workloads"}

# The modules that own a protocol or a kernel, and so call gadei._native (see gadei/_native.pyi):
# the region's atomic words and futexes (and the probe of what one costs to cross between CPUs),
# the rings, the slot's format (its payload kernels, and `Float32Dense`: the kernels on plain
# float32 arrays, which the sync round's sum, elastic's weights, the weights copy of a pull or a
# bridge and the kernel benchmarks go through), and the process owner's exit guard (the bridge's
# MPI_Finalize). Everyone else goes through their functions; the update rules (gadei/modes.py)
# through the slot's.
NATIVE_OWNERS = {"gadei/region.py", "gadei/ring.py", "gadei/transport/slot.py", "gadei/launch.py"}

# Header words of the run-state machine (and why it failed), the stop handshake, the doorbell,
# the version waits, the checkpoint hold and the training decision: only gadei/protocol.py
# names them (its module docstring lists the same words).
PROTOCOL = "gadei/protocol.py"
LAYOUT = "gadei/layout.py"  # declares them (offsets), says nothing of how they are used
PROTOCOL_FIELDS = {"run_state", "fail_reason", "doorbell", "server_sleeping", "version_waiters", "seq", "hold", "held",
                   "hold_epoch", "train_stop"}


# A ring's counters and its owner accounting (gadei.layout.ENTRY): only gadei/ring.py writes
# them, or takes their address (through which the native layer would write them), and only it
# reads them: the others ask it what they mean (ring.owner, since_claim, published, counters...).
RING = "gadei/ring.py"
RING_WORDS = {"head", "tail", "lease", "space_waiting", "claim_head", "pid", "last_pid", "last_applied"}
WRITES = {"set", "add", "cas", "addr", "word"}  # Record's writers, and its raw handles on a word
# `pid` names a field of many records (a job's, a lock file's, a reply's): it counts as the
# ring's where it is read from a learner entry, a name bound to `region.entry(...)`.
SHARED_NAMES = {"pid"}

# A slot's header (gadei.layout.SLOT: version, step, samples, kind) is written only where a
# slot is published (gadei/ring.py); the slot's format reads it when the server takes the
# slot (gadei/transport/slot.py), and the region makes its record.
SLOT_HEADER_WRITERS = {"gadei/ring.py"}
SLOT_HEADER_TAKERS = {"gadei/region.py", "gadei/ring.py", "gadei/transport/slot.py"}

# A slot's row counts (gadei.layout.SparseArea.count): the slot's format makes their address
# (`sparse_area`) and zeroes them when a slot is applied or discarded, and the learner's writer
# stores them (`store_rows`, last, once the rows are in); a device push has the writer do it.
ROW_COUNT_WRITERS = {"gadei/transport/slot.py", "gadei/transport/writer.py"}


# A job's outputs (result.json, metrics.jsonl, accuracy.png, model.pt): only gadei/outputs.py
# writes them, and only when the job's supervisor, which alone decides that the job ended, calls
# its `conclude` (watchdog/job.py); everyone else reads result.json and writes none of them.
OUTPUTS = "gadei/outputs.py"
CONCLUDER = "watchdog/job.py"
OUTPUT_FILES = ("result.json", "metrics.jsonl", "accuracy.png", "model.pt")
OUTPUT_NAMES: set[str] = set()  # gadei.outputs' names of those paths
OUTPUT_WRITERS = {"write_metrics", "hand_back", "plot"}

# "Is this process running" (a pid, and its start time): gadei/_proc.py answers it (`alive`,
# `running`), for every process gadei watches; nobody else asks psutil or the kernel whether a
# pid lives.
LIVENESS = "gadei/_proc.py"
LIVENESS_CALLS = {"create_time", "pid_exists", "is_running", "STATUS_ZOMBIE"}

# A file written whole or not at all (beside its place, then renamed there): gadei/files.py
# does it for every writer (`replace`); a checkpoint takes its name by a hard link instead, and
# renames only where the file system has none (gadei/checkpoint.py).
RENAMERS = {"gadei/files.py", "gadei/checkpoint.py"}

# A process's state passes as a typed record (a server's stop record, result.json, a learner's
# epoch records), never as lines read back from its log: only the modules that show logs to
# people (`gadei logs`, `gadei run`'s supervisor's warnings) open a log to read it.
LOG_SHOWERS = {"gadei/daemon/logs.py", "gadei/run.py",
               "gadei/local.py"}  # its `LocalJob` shows a child's log in the error that it failed
READS = {"read_text", "read_bytes", "open", "readlines"}
FILE_WRITES = {"write_text", "write_bytes", "savefig", "touch", "dump", "save", "replace", "rename", "copy",
               "copyfile", "copy2", "move"}  # calls that write a file named in their receiver or arguments


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
# `spawn` (and `become`) and gadei/_proc.py's `wait_or_kill`; `spawn` forks warm through gadei/zygote.py,
# which alone forks (and starts the daemon's zygote process, which forks for it).
PROCESS_OWNER = "gadei/launch.py"
WAIT_OR_KILL_OWNER = "gadei/_proc.py"
FORK_OWNER = "gadei/zygote.py"


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


def ring_word_writers(sources) -> dict[str, set[str]]:
    """Modules other than the ring's that write a ring word (or take its address): a call
    `x.set("head", ...)`, `x.cas("lease", ...)`, `x.addr("tail")`..."""
    found = defaultdict(set)
    for name, tree in sources:
        if name in (RING, LAYOUT):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WRITES
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in RING_WORDS):
                found[name].add(node.args[0].value)
    return dict(found)


def ring_word_readers(sources) -> dict[str, set[str]]:
    """Modules other than the ring's that read a ring word (its name, "?" for a field named at
    run time): a string naming one (`entry.get("head")`, a tuple of names a loop reads), or a
    read of a learner entry's `pid` or of a field of it by a name not written out
    (`entry.get(name)`), on `region.entry(...)` or a name bound to one."""
    found = defaultdict(set)
    for name, tree in sources:
        if name in (RING, LAYOUT):
            continue
        entries = _names_bound_to(tree, "entry")
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in RING_WORDS - SHARED_NAMES:
                found[name].add(node.value)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and node.args and _is_record(node.func.value, entries, "entry")):
                field = node.args[0]
                if not isinstance(field, ast.Constant):
                    found[name].add("?")
                elif field.value in SHARED_NAMES:
                    found[name].add(field.value)
    return dict(found)


def _is_record(receiver, bound, maker: str) -> bool:
    """`receiver` (less its subscripts) is a call `x.maker(...)` or a name bound to one."""
    while isinstance(receiver, ast.Subscript):
        receiver = receiver.value
    if isinstance(receiver, ast.Call):
        return isinstance(receiver.func, ast.Attribute) and receiver.func.attr == maker
    return isinstance(receiver, (ast.Name, ast.Attribute)) and _bound(receiver) in bound


def _slot_header_names(tree) -> set[tuple[str, str]]:
    """Names (variables, attributes) bound to a slot header record (`_names_bound_to`)."""
    return _names_bound_to(tree, "slot_header")


def _names_bound_to(tree, maker: str) -> set[tuple[str, str]]:
    """Names (variables, attributes) bound to a record a call `x.maker(...)` returns
    (`region.slot_header(...)`, `region.entry(...)`), to an element of one of those
    (`header = self._slot_headers[i][k]`, `for entry in entries`, `for i, entry in
    enumerate(entries)`), or to a list of them."""
    names: set[tuple[str, str]] = set()  # ("name", variable) or ("attr", attribute)

    def record(expr) -> bool:
        if isinstance(expr, ast.Call):
            return isinstance(expr.func, ast.Attribute) and expr.func.attr == maker
        if isinstance(expr, (ast.Name, ast.Attribute)):
            return _bound(expr) in names
        if isinstance(expr, ast.Subscript):
            return record(expr.value)
        if isinstance(expr, (ast.List, ast.Tuple)):
            return any(record(e) for e in expr.elts)
        if isinstance(expr, ast.ListComp):
            return record(expr.elt)
        return False

    while True:
        before = len(names)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and record(node.value):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, (ast.Name, ast.Attribute)):
                        names.add(_bound(target))
            elif isinstance(node, (ast.For, ast.comprehension)):
                target, items = node.target, node.iter
                if (isinstance(items, ast.Call) and isinstance(items.func, ast.Name) and items.func.id == "enumerate"
                        and items.args and isinstance(target, ast.Tuple) and len(target.elts) == 2):
                    target, items = target.elts[1], items.args[0]
                if isinstance(target, (ast.Name, ast.Attribute)) and record(items):
                    names.add(_bound(target))
        if len(names) == before:
            return names


def _bound(node) -> tuple[str, str]:
    return ("name", node.id) if isinstance(node, ast.Name) else ("attr", node.attr)


def slot_header_uses(sources) -> tuple[set[str], set[str]]:
    """(modules that take a slot header, modules that write one: call set/add/cas/addr/word on
    a name bound to it)."""
    takers, writers = set(), set()
    for name, tree in sources:
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "slot_header"
               for n in ast.walk(tree)):
            takers.add(name)
        bound = _slot_header_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WRITES:
                receiver = node.func.value
                while isinstance(receiver, ast.Subscript):
                    receiver = receiver.value
                if ((isinstance(receiver, (ast.Name, ast.Attribute)) and _bound(receiver) in bound)
                        or (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute)
                            and receiver.func.attr == "slot_header")):
                    writers.add(name)
    return takers, writers


def row_count_writers(sources) -> set[str]:
    """Modules that store a row count (import or call `store_rows`) or compute a row count's
    address (`payload + area.count`: arithmetic on a sparse area's `count` offset)."""
    found = set()
    for name, tree in sources:
        if name == LAYOUT:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and any(a.name == "store_rows" for a in node.names)) or (
                    isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "store_rows"
                                                    or getattr(node.func, "attr", None) == "store_rows")) or (
                    isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and any(
                        isinstance(side, ast.Attribute) and side.attr == "count" for side in (node.left, node.right))):
                found.add(name)
    return found


def output_writers(sources) -> set[str]:
    """Modules other than gadei/outputs.py that write a job's outputs or its end record: they
    call one of outputs' writers (`outputs.write_ending(...)`, `from .outputs import
    write_metrics`), or write a file (FILE_WRITES, `open` to write) whose path names one of
    OUTPUT_FILES or OUTPUT_NAMES, there or through a variable bound to it."""
    found = set()
    for name, tree in sources:
        if name == OUTPUTS:
            continue
        paths: set[str] = set()

        def names_output(expr) -> bool:
            return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.endswith(OUTPUT_FILES)
                       or isinstance(n, ast.Attribute) and n.attr in OUTPUT_NAMES
                       or isinstance(n, ast.Name) and n.id in paths for n in ast.walk(expr))

        while True:
            before = len(paths)
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and names_output(node.value):
                    paths.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if len(paths) == before:
                break
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "outputs"
                    and node.attr in OUTPUT_WRITERS) or (
                    isinstance(node, ast.ImportFrom) and (node.module or "").endswith("outputs")
                    and any(a.name in OUTPUT_WRITERS for a in node.names)):
                found.add(name)
            elif _file_write(node) and names_output(node):
                found.add(name)
    return found


def concluders(sources) -> set[str]:
    """Modules that call `conclude` (`outputs.conclude(...)`, or imported by name)."""
    found = set()
    for name, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == "conclude"
                                               or getattr(node.func, "id", None) == "conclude"):
                found.add(name)
    return found


def liveness_checkers(sources) -> set[str]:
    """Modules other than gadei/_proc.py (and the benchmarks) that ask whether a process runs
    themselves: a process's start time (`create_time`), `psutil.pid_exists`, `is_running`, its
    status against `STATUS_ZOMBIE`, or `os.kill(pid, 0)`."""
    found = set()
    for name, tree in sources:
        if name == LIVENESS or name.startswith(BENCHMARKS):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in LIVENESS_CALLS:
                found.add(name)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "kill"
                  and len(node.args) == 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == 0):
                found.add(name)
    return found


def log_readers(sources) -> set[str]:
    """Modules other than LOG_SHOWERS that read a log: a read (READS, `open` not to write) whose
    path names a `.log` file, there or through a name bound to one in that module."""
    found = set()
    for name, tree in sources:
        if name in LOG_SHOWERS or name.startswith(BENCHMARKS):  # a benchmark's own processes are not a job's
            continue
        paths: set[str] = set()

        def names_log(expr) -> bool:
            return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.endswith(".log")
                       or isinstance(n, (ast.Name, ast.Attribute)) and _bound(n)[1] in paths
                       for n in ast.walk(expr))

        while True:
            before = len(paths)
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign) and names_log(node.value):
                    paths.update(_bound(t)[1] for t in node.targets if isinstance(t, (ast.Name, ast.Attribute)))
            if len(paths) == before:
                break
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in READS
                    and not _file_write(node) and names_log(node)):
                found.add(name)
    return found


def _file_write(node) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in FILE_WRITES:
        return True
    if isinstance(func, ast.Name) and func.id == "open" or isinstance(func, ast.Attribute) and func.attr == "open":
        modes = node.args[1:2] + [k.value for k in node.keywords if k.arg in ("mode", "flags")]
        return any(isinstance(m, ast.Constant) and isinstance(m.value, str) and bool(set(m.value) & set("wax+"))
                   or any(isinstance(n, ast.Attribute) and n.attr in ("O_WRONLY", "O_RDWR", "O_CREAT")
                          for n in ast.walk(m)) for m in modes)
    return False


def renamers(sources) -> set[str]:
    """Modules that rename a file over another (`os.replace`, `os.rename`, a path's `rename`)."""
    found = set()
    for name, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                    node.func.attr == "rename" or node.func.attr == "replace" and
                    isinstance(node.func.value, ast.Name) and node.func.value.id == "os"):
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


def test_the_protocol_module_says_which_words_it_alone_names():
    doc = ast.get_docstring(ast.parse((ROOT / PROTOCOL).read_text(encoding="utf-8")))
    listed = re.search(r"names those\s+words \(([^)]*)\)", doc)
    assert listed and set(re.findall(r"`(\w+)`", listed.group(1))) == PROTOCOL_FIELDS


def test_only_the_ring_writes_a_ring_counter_or_its_owner_accounting():
    assert ring_word_writers(_sources()) == {}


def test_only_the_ring_reads_a_ring_counter_or_its_owner_accounting():
    assert ring_word_readers(_sources()) == {}


def test_only_the_ring_writes_a_slot_header_and_only_the_slot_format_reads_one_besides():
    takers, writers = slot_header_uses(_sources())
    assert writers == SLOT_HEADER_WRITERS
    assert takers == SLOT_HEADER_TAKERS


def test_only_the_slot_format_and_the_learners_writer_write_a_row_count():
    assert row_count_writers(_sources()) == ROW_COUNT_WRITERS


def test_only_the_outputs_module_writes_a_jobs_outputs():
    assert output_writers(_sources()) == set()


def test_only_the_supervisor_has_the_outputs_written():
    assert concluders(_sources()) == {CONCLUDER}


def test_only_the_process_module_says_whether_a_process_runs():
    assert liveness_checkers(_sources()) == set()


def test_no_module_reads_a_processs_state_from_its_log():
    assert log_readers(_sources()) == set()


def test_no_two_public_classes_share_a_name():
    assert shared_class_names(_sources()) == {}


def test_only_the_process_owner_starts_a_process():
    assert spawners(_sources()) == {PROCESS_OWNER, FORK_OWNER}


def test_only_the_process_module_kills_a_child_that_did_not_exit_in_time():
    assert kills_after_a_wait(_sources()) == {WAIT_OR_KILL_OWNER}


def test_only_the_files_module_writes_a_file_whole_by_renaming_it():
    assert renamers(_sources()) == RENAMERS


def test_the_scans_find_what_they_look_for():
    """Each scan catches a module breaking its rule (so that the tests above can fail)."""
    broken = [("gadei/stray.py", ast.parse(
        "from . import _native\nclass Record: pass\ndef f(h):\n    return h.get('run_state')\n")),
              ("gadei/other.py", ast.parse("class Record: pass\n")),
              ("gadei/waits.py", ast.parse("try:\n    p.wait(timeout=60)\nexcept subprocess.TimeoutExpired:\n"
                                           "    p.kill()\n    p.wait()\n"))]
    assert native_importers(broken) == {"gadei/stray.py"}
    # a second writer of a ring counter, of the owner accounting, and of a slot header
    writer = [("gadei/stray.py", ast.parse(
        "def f(region, e):\n    e.set('head', 1)\n    e.cas('lease', 0, 1)\n    e.set('last_pid', 7)\n"
        "    headers = [region.slot_header(0, k) for k in range(2)]\n    header = headers[1]\n"
        "    header.set('samples', 3)\n"))]
    assert ring_word_writers(writer) == {"gadei/stray.py": {"head", "lease", "last_pid"}}
    # a second reader of them: by name, in a tuple of names, a learner entry's pid, a field named at run time
    reader = [("gadei/status.py", ast.parse(
        "def f(region, i):\n    e = region.entry(i)\n    return e.get('head') - e.get('tail'), e.get('pid')\n")),
              ("gadei/checkpoint.py", ast.parse(
                  "NAMES = ('samples', 'last_applied')\nentries = [region.entry(i) for i in range(4)]\n"
                  "def f(region):\n"
                  "    return [[e.get(n) for n in NAMES] for e in entries], region.entry(0).get('pid')\n")),
              ("gadei/server.py", ast.parse(
                  "def f(self, region, k):\n    self._entries = [region.entry(i) for i in range(4)]\n"
                  "    return [entry.get(k) for i, entry in enumerate(self._entries)]\n")),
              ("gadei/outputs.py", ast.parse("def f(lock):\n    return lock.get('pid'), lock.get(name)\n"))]
    assert ring_word_readers(reader) == {"gadei/status.py": {"head", "tail", "pid"},
                                         "gadei/checkpoint.py": {"last_applied", "?", "pid"}, "gadei/server.py": {"?"}}
    assert slot_header_uses(writer) == ({"gadei/stray.py"}, {"gadei/stray.py"})
    counts = [("gadei/a.py", ast.parse("from .transport.slot import store_rows\n")),
              ("gadei/b.py", ast.parse("slot.store_rows(addr, 3)\n")),
              ("gadei/c.py", ast.parse("_native.store64(payload + area.count, 0)\n")),
              ("gadei/d.py", ast.parse("writer.set_rows(0, 1, 3)\nn = items.count(3) + 1\n"))]
    assert row_count_writers(counts) == {"gadei/a.py", "gadei/b.py", "gadei/c.py"}
    reader = [("gadei/server.py",
               ast.parse("def f(region):\n    h = region.slot_header(0, 0)\n    return h.get('kind')\n"))]
    assert slot_header_uses(reader) == ({"gadei/server.py"}, set())
    assert protocol_field_uses(broken) == {"gadei/stray.py": {"run_state"}}
    assert shared_class_names(broken) == {"Record": ["gadei/stray.py", "gadei/other.py"]}
    assert kills_after_a_wait(broken) == {"gadei/waits.py"}
    renamed = [("gadei/a.py", ast.parse("os.replace(tmp, path)\n")), ("gadei/b.py", ast.parse("tmp.rename(path)\n")),
               ("gadei/c.py", ast.parse("name = text.replace('a', 'b')\n"))]
    assert renamers(renamed) == {"gadei/a.py", "gadei/b.py"}
    started = [("gadei/a.py", ast.parse("subprocess.Popen(['x'])")), ("gadei/b.py", ast.parse("os.execv('x', ['x'])")),
               ("gadei/bench/c.py", ast.parse("subprocess.run(['x'])")), ("gadei/d.py", ast.parse("p.run()"))]
    assert spawners(started) == {"gadei/a.py", "gadei/b.py"}
    # a second writer of the outputs: through outputs' writers, or a file of its own
    written = [("watchdog/__init__.py", ast.parse("outputs.write_metrics(out)\n")),
               ("gadei/a.py", ast.parse("from .outputs import write_metrics\n")),
               ("gadei/b.py", ast.parse("def f(out):\n    (out / 'result.json').write_text('{}')\n")),
               ("gadei/c.py", ast.parse("def f(out):\n    path = out / 'model.pt'\n"
                                        "    with open(path, 'w') as f:\n        f.write('{}')\n")),
               ("gadei/d.py", ast.parse("def f(out):\n"
                                        "    os.open(out / 'result.json', os.O_WRONLY | os.O_CREAT, 0o600)\n")),
               ("gadei/e.py", ast.parse("def f(out):\n    fig.savefig(out / 'accuracy.png')\n")),
               ("gadei/outputs.py", ast.parse("def f(out):\n    (out / 'metrics.jsonl').write_text('')\n")),
               ("gadei/readers.py", ast.parse(  # reads them, and writes another file
                   "def f(out):\n    with open(out / 'daemon.log', 'wb'):\n        pass\n"
                   "    return json.loads((out / 'result.json').read_text())\n"))]
    assert output_writers(written) == {"watchdog/__init__.py", "gadei/a.py", "gadei/b.py", "gadei/c.py", "gadei/d.py",
                                       "gadei/e.py"}
    # a second writer's call of conclude, a second liveness check, a state read from a log
    assert concluders([("gadei/run.py", ast.parse("outputs.conclude(job, ending, since=0)\n")),
                       ("gadei/daemon/jobs.py", ast.parse("from ..outputs import conclude\nconclude(job, e)\n")),
                       ("gadei/x.py", ast.parse("outputs.read_result(out)\n"))]) == {"gadei/run.py",
                                                                                    "gadei/daemon/jobs.py"}
    assert liveness_checkers([("gadei/ring.py", ast.parse("def f(p):\n    return psutil.Process(p).status() != "
                                                          "psutil.STATUS_ZOMBIE\n")),
                              ("gadei/a.py", ast.parse("def f(p, t):\n"
                                                       "    return psutil.Process(p).create_time() == t\n")),
                              ("gadei/b.py", ast.parse("os.kill(pid, 0)\n")),
                              ("gadei/c.py", ast.parse("_proc.alive(pid, started)\nos.kill(pid, signal.SIGTERM)\n")),
                              ("gadei/bench/d.py", ast.parse("psutil.pid_exists(3)\n"))]) == {
        "gadei/ring.py", "gadei/a.py", "gadei/b.py"}
    assert log_readers([("gadei/run.py", ast.parse("LOG = 'logs/supervisor.log'\ndef f(out):\n"
                                                   "    return (out / LOG).read_text()\n")),  # a shower
                        ("gadei/a.py", ast.parse("def f(out):\n    return (out / 'logs' / 'serve.log').read_text()\n")),
                        ("gadei/b.py", ast.parse("from .supervisor import LOG\nPATH = 'x/server.log'\n"
                                                 "def f():\n    return open(PATH).read()\n")),
                        ("gadei/c.py", ast.parse("def f(out):\n    spawn(cmd, log=out / 'server.log')\n"
                                                 "    with open(out / 'learner.log', 'ab'):\n        pass\n"))]) == {
        "gadei/a.py", "gadei/b.py"}
