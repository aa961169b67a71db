"""Exactly once, with real processes: every published gradient is applied once, none twice, none lost.

Learners push gradients of known values (small integers, learning rate a power of two, so
every partial sum is exact in float32, float16 and bfloat16); the final weights must equal
the initial weights minus lr times the sum of everything pushed, to the bit, and the
counters must agree. The same contract runs against every push and pull transport, ring
size and gradient transport (float32, float16, bfloat16, row-sparse tables with a row named
twice in one gradient, and a sparse gradient sent into a dense float16 slot). The contract
itself is `helpers.push_known_gradients` (tests/test_device.py runs it over the device
transports). The default tier runs each push and pull transport, a one-slot ring, a 16-bit slot
and a row-sparse table; the long tier (`--long`) every case.
"""

import pytest

from helpers import push_known_gradients, tiered


@pytest.mark.parametrize(
    "pull, push, slots, grad_dtype, model, row_sparse",
    tiered([
        ("copy", "publish", 2, "float32", "flat", False),
        ("view", "publish", 2, "float32", "flat", False),
        ("copy", "thread", 2, "float32", "flat", False),
        ("view", "thread", 2, "float32", "flat", False),
        ("copy", "publish", 1, "float32", "flat", False),
        ("copy", "publish", 4, "float32", "flat", False),
        ("view", "publish", 2, "float16", "flat", False),
        ("view", "thread", 2, "bfloat16", "flat", False),
        ("view", "publish", 2, "float32", "table", True),
        ("copy", "thread", 2, "bfloat16", "table", True),
        ("view", "publish", 2, "float16", "table", False),
    ], default=[  # each push, each pull, a one-slot ring, a 16-bit slot and a row-sparse table; the rest: --long
        ("copy", "publish", 2, "float32", "flat", False),
        ("view", "thread", 2, "float32", "flat", False),
        ("copy", "publish", 1, "float32", "flat", False),
        ("view", "thread", 2, "bfloat16", "flat", False),
        ("view", "publish", 2, "float32", "table", True),
    ]),
)
def test_every_gradient_is_applied_exactly_once(job, procs, tmp_path, pull, push, slots, grad_dtype, model,
                                                row_sparse):
    push_known_gradients(job, procs, tmp_path, pull=pull, push=push, slots=slots, grad_dtype=grad_dtype, model=model,
                         row_sparse=row_sparse)
