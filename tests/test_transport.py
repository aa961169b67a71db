"""The transports at the module level: in this process, on a real region (a `Server` and its
apply loop on a thread, no subprocess), beside the end-to-end runs of tests/test_exactly_once.py.

What each encoding must do to a gradient: a float32, float16 or bfloat16 slot holds it as
that type rounds it (to nearest, ties to even: checked against a NumPy reference of the
rounding, not torch's own conversion) and the server applies exactly that; a row-sparse
table travels as its touched rows, each once with its rows summed, and the server's apply of
them equals the dense apply of the same gradient; and what each refuses: a gradient that
does not fit its encoding (too many rows; a value float16 cannot hold) is never applied as
something else, a slot whose rows a learner wrote wrong (a row count over the job's
max_rows, a row index outside the table) stops the job as corrupt without writing outside
the table, and an error in a push or pull thread reaches the train thread.
"""

import ctypes
import math
import threading
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from gadei import params, protocol
from gadei.errors import GadeiError, RegionCorrupt
from gadei.layout import FAILED
from gadei.region import Region, inspect, remove
from gadei.ring import claim
from gadei.server import Server
from gadei.transport import CopyPull, DevicePull, DevicePush, PublishPush, SlotWriter, ThreadPush, ViewPull
from gadei.transport.options import TransportOptions
from gadei.transport.slot import dense_area, sparse_area
from worker import TABLE_ROWS, TABLE_WIDTH, Flat, Table

N = 1100  # Table: a 64 x 16 embedding (1,024) and a bias of 76
LR = 0.5  # a power of two: lr * g is exact, so w - lr * g rounds once whichever way the kernel computes it
TABLE = "embedding.weight"


@contextmanager
def serving(job, model, serve=True, **transport):
    """A Server of `model` in this process (applying on a thread unless not `serve`), a
    learner's view of its region and its claimed ring: (server, region, producer, parameters, spec)."""
    server = Server(job, model=model, transport=TransportOptions(**transport), learners=2, lr=LR, threads=1)
    region = Region.attach(job)
    loop = threading.Thread(target=server.serve, kwargs={"grace": 0.5}, daemon=True)
    if serve:
        loop.start()
    try:
        producer = claim(region, drain_timeout=5, server_alive=lambda: True)
        yield server, region, producer, list(model.parameters()), params.spec_of(model)
        if serve:
            assert producer.drain(5.0, lambda: True)
        producer.release()
    finally:
        protocol.RunState(region).request_stop()
        if serve:
            loop.join(10)
        region.close()
        server.close()


def _applied(region, count: int) -> None:
    protocol.wait_for(lambda: region.header.get("applied") + region.header.get("nonfinite_skipped") >= count, 10,
                      f"{count} gradients settled")


def _decoded(values: torch.Tensor, grad_dtype: str) -> np.ndarray:
    """`values` as a slot of `grad_dtype` holds them, read back as float32: NumPy's float16, and
    bfloat16 by hand (the upper 16 bits of the float32, rounded to nearest, ties to even), so
    that the reference is not the conversion the code under test calls."""
    x = values.numpy().astype(np.float32)
    if grad_dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if grad_dtype == "bfloat16":
        bits = x.view(np.uint32).astype(np.uint64)  # finite values only: no NaN payloads to keep
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32)
    return x


def test_the_rounding_reference_rounds_as_each_type_is_defined():
    """The reference itself, on values whose rounding is known by hand."""
    third = torch.tensor([1 / 3, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1e-6, 300.5])
    # bfloat16 keeps 8 significant bits: 1/3 -> 0.333984375; 1 + 2^-8 is a tie: to even (1.0);
    # 1 + 3 * 2^-8 a tie: to even (1 + 2^-6); 300.5 -> 300 (between 300 and 302)
    assert _decoded(third, "bfloat16").tolist() == [0.333984375, 1.0, 1 + 2 ** -6, 9.98377799987793e-07, 300.0]
    # float16 keeps 11: 1/3 -> 0.333251953125; 1e-6 is subnormal (a multiple of 2^-24)
    assert _decoded(third, "float16").tolist() == [0.333251953125, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 17 * 2 ** -24, 300.5]


# ------------------------------------------------------------------ dense gradients: publish and thread


# 1/3 and 0.1 are not exact in float16 or bfloat16 (each rounds them its own way), 1e-6 is a
# float16 subnormal, 300.5 needs more mantissa than bfloat16 has.
VALUES = torch.tensor([0.25, -1.5, 1 / 3, 0.1, 1e-6, 300.5, -2.0])


@pytest.mark.parametrize("push_cls", [PublishPush, ThreadPush, DevicePush])  # DevicePush on a CPU "device"
@pytest.mark.parametrize("grad_dtype", ["float32", "float16", "bfloat16"])
def test_a_dense_gradient_arrives_as_its_slot_type_converts_it_and_is_applied_once(job, push_cls, grad_dtype):
    model = Flat(64, 1.0)
    with serving(job, model, grad_dtype=grad_dtype) as (server, region, producer, parameters, spec):
        push = push_cls(region, producer, parameters, spec, lambda: None, server.rule_options)
        try:
            push.bind()
            grads = [VALUES.repeat(math.ceil(p.numel() / len(VALUES)))[: p.numel()].reshape(p.shape)
                     for p in parameters]
            for p, g in zip(parameters, grads):
                if p.grad is None:  # float16/bfloat16, or the thread push: backward's own tensor
                    p.grad = g.clone()
                else:  # float32 publish: .grad is the slot itself
                    p.grad.copy_(g)
            assert push.push(0, 0, 1)
            _applied(region, 1)
        finally:
            push.close()
        flat = torch.cat([g.flatten() for g in grads])
        expected = np.float32(1) - np.float32(LR) * _decoded(flat, grad_dtype)
        np.testing.assert_array_equal(region.weights, expected)
        assert region.header.get("applied") == region.header.get("version") == 1
        if grad_dtype != "float32":  # the conversion happened: not the float32 values
            assert not np.array_equal(region.weights, (torch.ones(64) - LR * flat).numpy())


@pytest.mark.parametrize("grad_dtype, bad", [("float16", 1e5), ("bfloat16", float("nan")), ("float32", float("inf"))])
def test_a_gradient_its_slot_type_cannot_hold_is_skipped_and_counted_never_applied(job, grad_dtype, bad):
    """float16 holds at most 65,504: 1e5 becomes inf in the slot; the server skips it (nonfinite
    "skip"), counts it, and the next gradient is applied as usual."""
    model = Flat(64, 1.0)
    with serving(job, model, grad_dtype=grad_dtype) as (server, region, producer, parameters, spec):
        push = PublishPush(region, producer, parameters, spec, lambda: None, server.rule_options)
        try:
            push.bind()
            for p in parameters:
                p.grad = torch.full(p.shape, 0.25)
            parameters[0].grad[3] = bad
            assert push.push(0, 0, 1)
            _applied(region, 1)
            assert region.header.get("nonfinite_skipped") == 1 and region.header.get("applied") == 0
            np.testing.assert_array_equal(region.weights, np.ones(64, np.float32))  # nothing of it applied
            for p in parameters:
                p.grad = torch.full(p.shape, 0.25)
            assert push.push(0, 1, 1)
            _applied(region, 2)
        finally:
            push.close()
        np.testing.assert_array_equal(region.weights, np.full(64, 1 - LR * 0.25, np.float32))


# ------------------------------------------------------------------ row-sparse tables


def _sparse(indices: list[int], rows: torch.Tensor) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([indices]), rows, (TABLE_ROWS, TABLE_WIDTH), check_invariants=True)


def _count(region, learner: int, slot: int, table: int) -> int:
    """The row count of table `table` in a slot, as the server would read it."""
    return ctypes.c_uint64.from_address(sparse_area(region, learner, slot, table)[0]).value


@pytest.mark.parametrize("push_cls", [PublishPush, DevicePush])
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_a_row_sparse_gradient_travels_as_its_touched_rows_each_once_and_only_they_move(job, grad_dtype, push_cls):
    model = Table(N, 1.0)
    rows = torch.arange(4 * TABLE_WIDTH, dtype=torch.float32).reshape(4, TABLE_WIDTH) / 8  # exact in bfloat16
    with serving(job, model, serve=False, row_sparse=True, grad_dtype=grad_dtype, max_rows=8) as \
            (server, region, producer, parameters, spec):
        writer = SlotWriter(region, producer.learner, parameters, spec)
        table = writer.table_of[[name for name, _ in spec].index(TABLE)]
        assert table is not None and writer.table_of.count(None) == 1  # the bias is dense
        grads = [_sparse([5, 0, 5, 9], rows) if p.dim() == 2 else torch.full(p.shape, 0.5) for p in parameters]
        writer.write_grads(0, grads)
        indices, written = writer.rows_area(0, table)
        assert _count(region, producer.learner, 0, table) == 3  # row 5 named twice: one row, coalesced
        assert indices[:3].tolist() == [0, 5, 9]
        assert torch.equal(written[:3].float(), torch.stack([rows[1], rows[0] + rows[2], rows[3]]))

        # a dense gradient of a row-sparse table: the rows that are not zero go
        dense = torch.zeros(TABLE_ROWS, TABLE_WIDTH)
        dense[7], dense[60] = 1.0, -2.0
        writer.write_grads(1, [dense if p.dim() == 2 else torch.zeros(p.shape) for p in parameters])
        indices, written = writer.rows_area(1, table)
        assert _count(region, producer.learner, 1, table) == 2 and indices[:2].tolist() == [7, 60]
        assert torch.equal(written[:2].float(), dense[[7, 60]])

        # the push itself (the device push stages the rows on its device and writes them from its thread)
        push = push_cls(region, producer, parameters, spec, lambda: None, server.rule_options)
        try:
            push.bind()
            slot = producer.slot
            for p in parameters:
                p.grad = _sparse([9, 5, 9], rows[:3]) if p.dim() == 2 else torch.full(p.shape, 0.5)
            assert push.push(0, 0, 1)
            protocol.wait_for(lambda: push.pending == 0, 10, "the push to be published")
            indices, written = writer.rows_area(slot, table)
            assert _count(region, producer.learner, slot, table) == 2 and indices[:2].tolist() == [5, 9]
            assert torch.equal(written[:2].float(), torch.stack([rows[1], rows[0] + rows[2]]))
        finally:
            push.close()

    # through the apply loop: only the touched rows and the bias move
    with serving(job, Table(N, 1.0), row_sparse=True, grad_dtype=grad_dtype, max_rows=8) as \
            (server, region, producer, parameters, spec):
        push = push_cls(region, producer, parameters, spec, lambda: None, server.rule_options)
        push.bind()
        for p in parameters:
            p.grad = _sparse([5, 0, 5, 9], rows) if p.dim() == 2 else torch.full(p.shape, 0.5)
        assert push.push(0, 0, 1)
        _applied(region, 1)
        push.close()
        weights = params.state_dict(spec, region.weights)
    table_expected = torch.ones(TABLE_ROWS, TABLE_WIDTH)
    table_expected[0] -= LR * rows[1]
    table_expected[5] -= LR * (rows[0] + rows[2])
    table_expected[9] -= LR * rows[3]
    assert torch.equal(weights[TABLE], table_expected)
    assert torch.equal(weights["bias"], torch.full((N - TABLE_ROWS * TABLE_WIDTH,), 1 - LR * 0.5))


@pytest.mark.parametrize("push_cls", [PublishPush, DevicePush])  # the device push refuses it while staging
def test_a_gradient_touching_more_rows_than_a_slot_carries_is_refused_and_nothing_is_published(job, push_cls):
    model = Table(N, 1.0)
    with serving(job, model, row_sparse=True, max_rows=4) as (server, region, producer, parameters, spec):
        push = push_cls(region, producer, parameters, spec, lambda: None, server.rule_options)
        try:
            push.bind()
            for p in parameters:
                p.grad = _sparse([1, 2, 3, 4, 5], torch.ones(5, TABLE_WIDTH)) if p.dim() == 2 else torch.ones(p.shape)
            with pytest.raises(GadeiError, match=rf"job '{job}': one gradient touches 5 rows of '{TABLE}', the job "
                                                 r"carries at most 4 \(give the job a larger \[transport\] "
                                                 r"max_rows, or its server --max-rows\)"):
                push.push(0, 0, 1)
            # not written, not published
            assert _count(region, producer.learner, producer.slot, 0) == 0 and producer.tail() == 0
            for p in parameters:  # more entries than a slot's rows, but two rows once coalesced: it fits
                p.grad = _sparse([1, 2, 1, 2, 2], torch.ones(5, TABLE_WIDTH)) if p.dim() == 2 else torch.ones(p.shape)
            assert push.push(0, 1, 1)  # the next one goes as usual
            _applied(region, 1)
        finally:
            push.close()
        assert region.header.get("applied") == region.header.get("version") == 1


@pytest.mark.parametrize("grad_dtype", ["float32", "float16", "bfloat16"])
def test_a_row_sparse_table_ends_as_the_same_gradient_sent_dense_would_leave_it(job, grad_dtype):
    """row_sparse changes how a table's gradient travels, never what it does: the same sparse
    gradient (rows that round in float16 and bfloat16, a row named three times) pushed into a
    row-sparse job and into a dense one leaves the same weights, to the bit."""
    rows = torch.arange(1, 5 * TABLE_WIDTH + 1, dtype=torch.float32).reshape(5, TABLE_WIDTH) / 3
    indices = [40, 2, 40, 63, 40]
    weights = {}
    for row_sparse in (True, False):
        name = f"{job}-{'rows' if row_sparse else 'dense'}"
        try:
            with serving(name, Table(N, 1.0), row_sparse=row_sparse, grad_dtype=grad_dtype, max_rows=8) as \
                    (server, region, producer, parameters, spec):
                assert len(region.shape.sparse) == int(row_sparse)
                push = PublishPush(region, producer, parameters, spec, lambda: None, server.rule_options)
                push.bind()
                for p in parameters:
                    p.grad = _sparse(indices, rows) if p.dim() == 2 else torch.full(p.shape, 0.25)
                assert push.push(0, 0, 1)
                _applied(region, 1)
                push.close()
                weights[row_sparse] = params.state_dict(spec, region.weights)
        finally:
            if inspect(name) is not None:
                remove(name)
    for key in (TABLE, "bias"):
        assert torch.equal(weights[True][key], weights[False][key]), key
    table = weights[True][TABLE]
    summed = {2: rows[1], 40: rows[0] + rows[2] + rows[4], 63: rows[3]}
    for row in range(TABLE_ROWS):  # the touched rows moved by lr times their rounded sum, no other
        expected = np.float32(1) - np.float32(LR) * _decoded(summed[row], grad_dtype) if row in summed else 1.0
        np.testing.assert_array_equal(table[row].numpy(), np.broadcast_to(np.float32(expected), (TABLE_WIDTH,)))


def _publish_rows(region, producer, writer, indices: list[int], count: int | None = None) -> None:
    """Publish a gradient of the table whose slot says `indices` (rows of 0.5) and a row count of
    `count` (default: the number of indices), written there by hand: what a learner that does not
    keep to the format (or a stray write into the region) leaves; the dense area (the bias) is 0."""
    producer.wait_space(lambda: None)
    index_area, row_area = writer.rows_area(producer.slot, 0)
    count_addr = sparse_area(region, producer.learner, producer.slot, 0)[0]
    index_area[: len(indices)] = torch.tensor(indices, dtype=torch.int64)
    row_area[: len(indices)] = 0.5
    ctypes.c_uint64.from_address(count_addr).value = len(indices) if count is None else count
    producer.publish(region.header.get("version"), producer.head, 1)


@pytest.mark.parametrize("indices, count, error", [
    (list(range(8)), 9, r"learner ring 0: slot \d's row count of a row-sparse table is 9, allowed 0\.\.8: "
                        r"the slot is corrupt"),
    ([3, TABLE_ROWS], None, r"a gradient named 1 row indices outside the table's 0\.\.63: the slot is corrupt"),
    ([-1, 3], None, r"a gradient named 1 row indices outside the table's 0\.\.63: the slot is corrupt"),
    ([2 ** 40], None, r"a gradient named 1 row indices outside the table's 0\.\.63: the slot is corrupt"),
], ids=["count-over-max-rows", "row-64", "row-minus-1", "row-2^40"])
def test_a_slot_whose_rows_break_the_format_stops_the_job_as_corrupt_and_nothing_lands_outside_the_table(
        job, indices, count, error):
    """A gradient of exactly max_rows rows is applied; then one whose row count is over max_rows,
    or that names a row the table does not have, stops the job (run state failed, RegionCorrupt
    saying which rule it broke), and nothing is written outside the table: the weights after it
    (the bias, where row 64 would land) are as they were."""
    with serving(job, Table(N, 1.0), serve=False, row_sparse=True, max_rows=8) as \
            (server, region, producer, parameters, spec):
        writer = SlotWriter(region, producer.learner, parameters, spec)
        _publish_rows(region, producer, writer, list(range(56, 64)))  # max_rows rows: fine
        _publish_rows(region, producer, writer, indices, count)
        protocol.RunState(region).request_stop()  # serve() applies what was published, then ends
        with pytest.raises(RegionCorrupt, match=rf"job '{job}': {error}"):
            server.serve(grace=0.2)
        assert region.header.get("run_state") == FAILED
        assert region.header.get("applied") == 1
        weights = params.state_dict(spec, region.weights)
        assert torch.equal(weights["bias"], torch.ones(N - TABLE_ROWS * TABLE_WIDTH))  # nothing past the table
        moved = (weights[TABLE] != 1.0).any(dim=1).nonzero().flatten().tolist()
        assert set(moved) - set(range(56, 64)) <= {i for i in indices if 0 <= i < TABLE_ROWS}
        assert torch.equal(weights[TABLE][56:64], torch.full((8, TABLE_WIDTH), 1 - LR * 0.5))


def test_a_push_threads_error_is_raised_in_the_train_thread_at_its_next_push(job):
    model = Table(N, 1.0)
    with serving(job, model, row_sparse=True, max_rows=4) as (server, region, producer, parameters, spec):
        push = ThreadPush(region, producer, parameters, spec, lambda: None, server.rule_options)
        try:
            for p in parameters:
                p.grad = _sparse([1, 2, 3, 4, 5], torch.ones(5, TABLE_WIDTH)) if p.dim() == 2 else torch.ones(p.shape)
            assert push.push(0, 0, 1)  # handed over; the push thread finds it too large
            protocol.wait_for(lambda: push._error is not None, 10, "the push thread to fail")
            for p in parameters:
                p.grad = _sparse([1], torch.ones(1, TABLE_WIDTH)) if p.dim() == 2 else torch.ones(p.shape)
            with pytest.raises(GadeiError, match="one gradient touches 5 rows"):
                push.push(0, 1, 1)
            assert push.pending == 0 and producer.tail() == 0 and region.header.get("version") == 0
        finally:
            push.close()


# ------------------------------------------------------------------ pulls


def _bump(server_region, region, producer, value: float, step: int) -> None:
    """Publish a dense gradient of `value` and wait until it is applied."""
    producer.wait_space(lambda: None)
    dense_area(region, producer.learner, producer.slot)[:] = value
    producer.publish(region.header.get("version"), step, 1)
    _applied(region, step + 1)


@pytest.mark.parametrize("copy_cls", [CopyPull, DevicePull])  # DevicePull on a CPU "device"
def test_a_view_pull_sees_each_update_as_it_happens_and_a_copy_pull_between_steps(job, copy_cls):
    model = Flat(64, 1.0)
    with serving(job, model) as (server, region, producer, parameters, spec):
        region.weights[:] = np.arange(64, dtype=np.float32) / 8  # each weight its own (exact) value
        start = torch.from_numpy(region.weights.copy())
        view_model, copy_model = Flat(64, 0.0), Flat(64, 0.0)
        pulled = []
        view = ViewPull(region, list(view_model.parameters()), spec, lambda v: None)
        copy = copy_cls(region, list(copy_model.parameters()), spec, pulled.append)
        view.start()
        copy.start()

        def flat(m):
            return torch.cat([p.detach().flatten() for p in m.parameters()]).cpu()

        try:
            assert torch.equal(flat(view_model), start) and torch.equal(flat(copy_model), start)
            assert pulled == [0] and copy.version() == 0
            _bump(server.region, region, producer, 0.25, 0)
            assert torch.equal(flat(view_model), start - 0.125)  # a view: no pull
            assert torch.equal(flat(copy_model), start)  # a copy: unchanged until between steps
            protocol.wait_for(lambda: copy._ready, 10, "the pull thread to stage version 1")
            copy.between_steps()
            assert torch.equal(flat(copy_model), start - 0.125) and copy.version() == 1
            assert pulled == [0, 1]
            copy.between_steps()  # nothing newer: nothing swapped
            assert pulled == [0, 1]
        finally:
            copy.finish()
            view.finish()
        # finish leaves each model a private copy of the latest weights
        _bump(server.region, region, producer, 0.25, 1)
        assert torch.equal(flat(view_model), start - 0.125) and torch.equal(flat(copy_model), start - 0.125)


def test_a_pull_threads_error_is_raised_in_the_train_thread_at_its_next_step(job, monkeypatch):
    model = Flat(64, 1.0)
    with serving(job, model) as (server, region, producer, parameters, spec):
        copy = CopyPull(region, list(Flat(64, 0.0).parameters()), spec, lambda v: None)
        copy.start()
        try:
            def broken():
                raise OSError("the staging copy failed")

            monkeypatch.setattr(copy, "_stage", broken)
            _bump(server.region, region, producer, 0.25, 0)
            protocol.wait_for(lambda: copy._error is not None, 10, "the pull thread to fail")
            with pytest.raises(OSError, match="the staging copy failed"):
                copy.between_steps()
        finally:
            copy.finish()
