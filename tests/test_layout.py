"""The region layout: a pure function, sections aligned and disjoint, writers on separate lines."""

import dataclasses

import pytest

from gadei.layout import (
    ENTRY,
    ENTRY_BYTES,
    HEADER,
    HEADER_BYTES,
    LINE,
    PAGE,
    RING_BYTES,
    RING_SLOTS,
    SLOT_HEADER_BYTES,
    Shape,
    SparseTable,
    layout,
    ring_slots,
)


@pytest.mark.parametrize(
    "shape",
    [
        Shape(1),
        Shape(7, capacity=1, slots=1),
        Shape(2_807_511),
        Shape(1_000_003, capacity=3, slots=4, state_arrays=1),
        Shape(1_000_003, capacity=3, slots=4, state_arrays=2),
        Shape(1_000_003, grad_dtype="bfloat16",
              sparse=(SparseTable(0, 1000, 128, 300), SparseTable(500_000, 10, 7, 10))),
    ],
)
def test_sections_are_page_aligned_disjoint_and_sized(shape):
    lay = layout(shape)
    assert layout(shape) == lay  # pure: the same shape gives the same offsets
    starts = [0, lay.spec, lay.table, lay.weights] + ([lay.state] if lay.state is not None else []) + [lay.rings]
    assert all(s % PAGE == 0 for s in starts)
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert lay.spec >= HEADER_BYTES
    assert lay.weights - lay.table >= shape.capacity * ENTRY_BYTES
    spans = []
    for learner in range(shape.capacity):
        for slot in range(shape.slots):
            payload = lay.payload(learner, slot)
            assert payload % PAGE == 0
            spans.append((payload, payload + lay.payload_bytes))
            header = lay.slot_header(learner, slot)
            spans.append((header, header + SLOT_HEADER_BYTES))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[0][0] >= lay.rings and spans[-1][1] <= lay.total
    # inside a payload: the dense area, then each table's count, indices and rows, in order
    inner = [(0, shape.dense_count * shape.grad_itemsize)]
    for table, area in zip(shape.sparse, lay.sparse_areas):
        inner += [(area.count, area.count + 8), (area.indices, area.indices + 8 * table.max_rows),
                  (area.rows, area.rows + table.max_rows * table.width * shape.grad_itemsize)]
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(inner, inner[1:]))
    assert inner[-1][1] <= lay.payload_bytes <= lay.payload_stride


def test_dense_segments_leave_out_the_tables():
    shape = Shape(100, sparse=(SparseTable(10, 5, 4, 5), SparseTable(50, 2, 10, 2)))
    assert shape.dense_segments == ((0, 10, 0), (30, 20, 10), (70, 30, 30))
    assert shape.dense_count == 60


def test_head_and_tail_are_on_different_cache_lines():
    # the learner writes head, the server writes tail: one line each, no false sharing
    assert ENTRY["head"].offset // LINE != ENTRY["tail"].offset // LINE
    assert ENTRY["space_waiting"].offset // LINE not in {ENTRY["head"].offset // LINE, ENTRY["tail"].offset // LINE}
    assert ENTRY_BYTES % LINE == 0
    assert HEADER["version"].offset // LINE != HEADER["applied"].offset // LINE
    assert HEADER["version"].offset % 8 == 0 and ENTRY["tail"].offset % 8 == 0  # futex words


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n_params": 0}, "n_params"),
        ({"n_params": 10, "grad_dtype": "int8"}, "grad_dtype"),
        ({"n_params": 10, "capacity": 0}, "capacity"),
        ({"n_params": 10, "slots": 0}, "slots"),
        ({"n_params": 10, "mode": "nope"}, "mode"),
        ({"n_params": 10, "sparse": (SparseTable(5, 2, 4, 2),)}, "outside"),
        ({"n_params": 100, "sparse": (SparseTable(0, 5, 4, 6),)}, "max_rows"),
        ({"n_params": 100, "sparse": (SparseTable(0, 5, 4, 5), SparseTable(10, 5, 4, 5))}, "overlaps"),
    ],
)
def test_bad_shapes_are_refused_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Shape(**kwargs)


def test_rings_get_8_slots_by_default_fewer_for_large_gradients_and_2_in_sync_mode():
    """A job that leaves its slots to the server ("auto") gets rings with room for several
    gradients (so that a server with no core of its own may nap between looks), within 16 MiB
    a ring; sync rounds take one gradient a learner, and keep 2."""
    small = Shape(n_params=10_000)
    assert ring_slots(small, None).slots == RING_SLOTS == 8
    assert ring_slots(small, 3).slots == 3  # the job's own
    assert ring_slots(Shape(n_params=10_000, mode="sync"), None).slots == 2
    large = ring_slots(Shape(n_params=1_000_000), None)  # 4 MB a gradient: 4 fit in 16 MiB
    assert large.slots == RING_BYTES // layout(dataclasses.replace(large, slots=1)).payload_stride == 4
    assert ring_slots(Shape(n_params=100_000_000), None).slots == 2  # 400 MB a gradient: the least a ring has
