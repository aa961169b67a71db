"""The region layout: a pure function, sections aligned and disjoint, writers on separate lines."""

import pytest

from gadei.layout import (
    ENTRY,
    ENTRY_BYTES,
    HEADER,
    HEADER_BYTES,
    LINE,
    PAGE,
    SLOT_HEADER_BYTES,
    Shape,
    layout,
)


@pytest.mark.parametrize(
    "shape",
    [Shape(1), Shape(7, capacity=1, slots=1), Shape(2_807_511), Shape(1_000_003, capacity=3, slots=4, centre=True)],
)
def test_sections_are_page_aligned_disjoint_and_sized(shape):
    lay = layout(shape)
    assert layout(shape) == lay  # pure: the same shape gives the same offsets
    starts = [0, lay.spec, lay.table, lay.weights] + ([lay.centre] if lay.centre is not None else []) + [lay.rings]
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
    ],
)
def test_bad_shapes_are_refused_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Shape(**kwargs)
