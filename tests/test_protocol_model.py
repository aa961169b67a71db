"""The push/apply protocol, machine-checked: Spin verifies tests/model/protocol.pml.

Every interleaving of the modelled processes, within the bounds of each check
(tests/model/check.py), keeps the protocol's promises: each published gradient applied
exactly once, never a slot still being written, `0 <= head - tail <= slots`, no deadlock, no
livelock, a stop ends every process. Each known mistake, and the code before each fix this
model led to, gives a counter-example. The conformance tests fail when the code changes a
constant or an order of stores that the model assumes. See docs/protocol-model.md.

Without `spin` or `gcc` these tests skip, except under CI=true (CI installs both), where a
missing tool fails them.
"""

import ast
import importlib.util
import inspect
import os
import re
import textwrap
from pathlib import Path

import pytest

from gadei import checkpoint, layout, ring, server
from gadei.layout import ENTRY, SLOT
from helpers import tiered

_HERE = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("protocol_model_check", _HERE / "model" / "check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

MODEL_TEXT = check.MODEL.read_text()
ROOT = _HERE.parent


def _need_tools():
    missing = [name for name, path in check.tools().items() if path is None]
    if not missing:
        return
    why = f"{' and '.join(missing)} not on PATH (apt-get install spin gcc): the protocol model is not checked"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI: {why}")
    pytest.skip(why)


def _by_name(name):
    return next(c for c in check.CHECKS if c.name == name)


# ------------------------------------------------------------------ the model verifies

LONG_CHECKS = ("kill-after-release", "two-claims-ckpt", "old-last-owner-ckpt")  # the longest of the rest by far


def _tiered(checks):
    """The checks' names as test parameters: a deep check (minutes, GBs) and LONG_CHECKS are in
    the long tier."""
    checks = list(checks)
    return tiered([c.name for c in checks],
                  default=[c.name for c in checks if not c.deep and c.name not in LONG_CHECKS])


@pytest.mark.parametrize("name", _tiered(c for c in check.CHECKS if c.expect is None))
def test_the_model_verifies(name, tmp_path):
    _need_tools()
    result = check.run(_by_name(name), tmp_path)
    assert result.errors == 0, f"{name}: spin found a counter-example:\n{result.output}\n{result.replay[-6000:]}"
    assert result.stored > 1000, result.output  # it searched something
    print(f"\n{name}: {result.stored:,} states stored, {result.transitions:,} transitions, depth {result.depth}, "
          f"{result.memory_mb:.0f} MB, {result.seconds:.1f} s")


# ------------------------------------------------------------------ mistakes are found

@pytest.mark.parametrize("name", _tiered(c for c in check.CHECKS if c.expect is not None))
def test_a_faulty_variant_gives_a_counter_example(name, tmp_path):
    _need_tools()
    variant = _by_name(name)
    result = check.run(variant, tmp_path)
    assert result.errors >= 1, f"{name}: no counter-example:\n{result.output}"
    assert (tmp_path / "protocol.pml.trail").exists()
    assert "spin: trail ends after" in result.replay, result.replay[-3000:]
    assert variant.expect in result.failed_assertion, (result.failed_assertion, result.output)
    print(f"\n{name}: assertion violated {result.failed_assertion}, search depth {result.depth} "
          f"({result.stored:,} states)")


def test_head_before_header_trail_shows_the_server_reading_a_header_not_yet_written(tmp_path):
    _need_tools()
    result = check.run(_by_name("bug-head-before-header"), tmp_path)
    steps = [line for line in result.replay.splitlines() if re.match(r"\s*\d+:\s+proc", line)]
    failed = next(i for i, line in enumerate(steps) if "assert((hdr[" in line)
    published = max(i for i, line in enumerate(steps[:failed]) if "head[r] = (head[r]+1)" in line)
    header_stores = [line for line in steps[published:failed] if "hdr[((r*2)+s)] = head[r]" in line]
    assert not header_stores, "the header of the last published slot was written before the server read it"


def test_no_zero_trail_shows_a_gradient_applied_twice(tmp_path):
    _need_tools()
    result = check.run(_by_name("bug-no-zero"), tmp_path)
    assert "assert((cnt[i]==0))" in result.replay
    applies = [line for line in result.replay.splitlines() if "cnt[i] = (cnt[i]+1)" in line]
    assert len(applies) >= 2


def test_old_last_owner_trail_shows_the_record_overwritten_before_the_supervisor_looked(tmp_path):
    """The learner gave its entry back and was killed; the other learner claimed the entry
    twice, each claim copying the last owner into (last_pid, last_applied), the second over
    the first; only then did the supervisor count the dead learner: by `seen`, 0."""
    _need_tools()
    result = check.run(_by_name("old-last-owner"), tmp_path)
    steps = [line for line in result.replay.splitlines() if re.match(r"\s*\d+:\s+proc", line)]
    counted = next(i for i, line in enumerate(steps) if "start_at[0] = (start_at[0]+seen[0])" in line)
    copies = [line for line in steps[:counted] if "(Other:" in line and "elast_pid[r] = eplain[r]" in line]
    assert len(copies) == 2, copies
    assert any("killed[0] = 1" in line for line in steps[:counted])
    assert "assert((cnt[i]==0))" in steps[-1] or "cnt[i]==0" in result.failed_assertion


# ------------------------------------------------------------------ the model follows the code

def _define(name: str) -> int:
    found = re.search(rf"^#define {name} (\d+)\b", MODEL_TEXT, re.M)
    assert found, f"the model defines no {name}"
    return int(found.group(1))


def test_model_constants_are_the_codes():
    for name in ("CREATED", "SERVING", "STOPPING", "STOPPED", "FREE", "CLAIMING", "ACTIVE", "LEAVING", "DEAD"):
        assert _define(name) == getattr(layout, name), f"{name}: the model says {_define(name)}, gadei.layout says " \
                                                      f"{getattr(layout, name)}"


def test_slot_header_and_ring_counters_are_what_the_model_assumes():
    # one slot header of fields written together before head (the model's `hdr`)
    assert list(SLOT) == ["version", "step", "samples", "kind"]
    # head is the learner's, tail the server's, each on its own cache line; both u64 (monotonic)
    assert ENTRY["head"].kind == ENTRY["tail"].kind == "u64"
    assert ENTRY["head"].offset // layout.LINE != ENTRY["tail"].offset // layout.LINE
    # slot k lives at index k % slots, on both sides
    assert "self.head % self.slots" in inspect.getsource(ring.Producer.slot.fget)
    assert "tail % self.slots" in inspect.getsource(ring.Consumer.take)
    assert "self._consumer.take(learner)" in inspect.getsource(server.Server._take)


def _body_calls(func) -> list[str]:
    """The calls in `func`'s body, in source order, as dotted text (`slot.set('version')`...)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            first = node.args[0] if node.args else None
            arg = ast.unparse(first) if first is not None else ""
            calls.append((node.lineno, node.col_offset, f"{name}({arg})"))
    return [text for _, _, text in sorted(calls)]


def _index(calls: list[str], text: str) -> int:
    found = [i for i, call in enumerate(calls) if text in call]
    assert found, f"no call {text!r} in {calls}"
    return found[0]


def test_publish_writes_the_slot_header_before_head():
    calls = _body_calls(ring.Producer.publish)
    head = _index(calls, "_native.store64(self._head_addr")
    for field in SLOT:
        assert _index(calls, f"slot.set('{field}')") < head, f"slot header field {field!r} is stored after head"
    # head is published by a sequentially consistent store in the native module
    native = (ROOT / "native" / "gadei_native.c").read_text()
    store = native[native.index("gd_store64(PyObject"):]
    assert "__atomic_store_n" in store[:600] and "__ATOMIC_SEQ_CST" in store[:600]


def test_the_server_applies_then_hands_back():
    update = _body_calls(server.Server._update)
    releases = [i for i, call in enumerate(update) if call.startswith("self._consumer.release")]
    assert _index(update, "self.update_rule.apply") < releases[-1]  # an applied gradient's slot: after the update
    assert _index(update, "self.update_rule.format.discard") < releases[0]  # a discarded one's: after clearing it
    release = _body_calls(ring.Consumer.release)
    assert _index(release, "_native.store64(self._tail_addrs[learner]") == 0
    # the poll reads head with acquire, as the model's take needs
    native = (ROOT / "native" / "gadei_native.c").read_text()
    poll = native[native.index("gd_poll_rings(PyObject"):]
    assert "__atomic_load_n((uint64_t *)(entry + head_off), __ATOMIC_ACQUIRE)" in poll[:2500]


def test_a_new_owner_writes_its_pid_only_after_resetting_the_counters():
    calls = _body_calls(ring._take)
    pid = max(i for i, c in enumerate(calls) if c == "entry.set('pid')")  # its own (the first sets 0)
    assert _index(calls, "producer.drain") < pid
    assert _index(calls, "clear_slot(region") < pid  # the previous owner's unpublished slots zeroed
    assert max(i for i, c in enumerate(calls) if c.startswith("entry.set(name)")) < pid  # the counter resets
    assert not any("set('pid')" in c for c in _body_calls(ring.Producer.release))  # release keeps it


def test_a_launched_learner_keeps_its_record_when_it_releases_its_entry():
    # Producer.release: a launched learner (claim's `prefer`, its number) whose ring is drained
    # (applied_samples final) keeps (last_pid, last_applied) in the entry of its number before
    # it gives its entry back; no claim writes them (two claims once overwrote a copy kept there)
    release = _body_calls(ring.Producer.release)
    keep = _index(release, "_keep_record(")
    assert _index(release, "drained(self.entry)") < keep < _index(release, "self.entry.set('state')")
    assert keep < _index(release, "self.entry.cas('lease')")
    assert "self.region.entry(self.number)" in inspect.getsource(ring.Producer.release)
    assert "number = prefer if first else None" in inspect.getsource(ring.claim)
    assert not any("last_" in c for f in (ring.claim, ring._take) for c in _body_calls(f))
    sets = [c for c in _body_calls(ring._keep_record) if c.startswith("record.set(")]
    # last_pid 0 while last_applied changes, then last_pid: a reader checks it around last_applied
    assert sets == ["record.set('last_pid')", "record.set('last_applied')", "record.set('last_pid')"], sets
    # _take: pid 0 after the drain, before the counter resets (its own pid after them)
    take = _body_calls(ring._take)
    zero = _index(take, "entry.set('pid')")
    assert _index(take, "producer.drain") < zero < min(i for i, c in enumerate(take) if c.startswith("entry.set(name)"))
    # the supervisor reads the record for a learner that left its entry (ring.left_record), each
    # answer between two reads of the field naming it, and so does a checkpoint's progress
    # (ring.applied_in, the record first)
    launched = (ROOT / "watchdog" / "learners.py").read_text()
    died = launched[launched.index("    def _died("):launched.index("    def resume(")]
    assert "ring.left_record(region, learner.pid)" in died
    left = inspect.getsource(ring.left_record)
    for name, answer in (("last_pid", "last_applied"), ("pid", "applied_samples")):
        first = left.index(f'.get("{name}") == pid')
        read = left.index(f'.get("{answer}")', first)
        assert left.index(f'.get("{name}") == pid', read) > read, f"left_record: {answer} is not re-checked"
    assert left.index('.get("last_pid") == pid') < left.index('entry.get("pid") == pid')
    record = (ROOT / "gadei" / "supervisor.py").read_text()  # progress: the supervisor's, also at a stop
    assert "ring.applied_in(ckpt.learners, learner.pid)" in record[record.index("def progress("):]
    applied_in = inspect.getsource(ring.applied_in)
    assert applied_in.index('c.get("last_pid") == pid') < applied_in.index('c["pid"] == pid')


def test_drain_looks_once_more_when_no_learner_is_left():
    source = inspect.getsource(server.Server._drain)
    busy = source.index("busy_entries()")
    assert "consumer.poll(0)" in source[busy:], "Server._drain ends without a last look after no learner is busy"


def test_capture_does_not_copy_a_dead_servers_region():
    source = inspect.getsource(checkpoint.capture)
    assert "server_alive()" in source and "died while serving" in source


def test_the_supervisor_carries_a_stop_over_a_restart():
    source = (ROOT / "watchdog" / "supervisor.py").read_text()
    assert "self._stopped_it = RunState(self.region).request_stop()" in source
    assert "stopping = False" in source and "carried" in source
    assert ('entry.get("applied_samples") if entry.get("pid") == pid else 0'
            in inspect.getsource(ring.dead_owner_applied))


def test_each_process_of_the_model_names_the_code_it_models():
    names = {
        "Server": ["Server.serve", "_serve_each", "_drain", "_update", "_pause", "Consumer.poll", "gd_poll_rings"],
        "Train": ["Learner.attach", "ring.claim", "_take", "ThreadPush.push", "_teardown"],
        "Push": ["ThreadPush._run", "Producer.wait_space", "publish", "write_grads"],
        "Supervisor": ["Supervisor.run", "_restart_server", "_died", "progress", "capture"],
        "Other": ["ring.claim", "_take", "Producer.release"],
    }
    header = MODEL_TEXT[:MODEL_TEXT.index("*/")]
    for process, functions in names.items():
        assert re.search(rf"^ \*   {process}\b", header, re.M), process
        for function in functions:
            assert function in header, f"{process}: the model's header does not name {function}"
    for process in names:
        assert re.search(rf"proctype {process}\(", MODEL_TEXT), process
