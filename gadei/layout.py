"""The region's layout: one pure function from a job's shape to the byte offset of everything.

Every process of a job computes the same `Layout` from the `Shape` stored in the region's
header, so nothing about where things live is ever communicated except that shape. The
region is, in order (each section page-aligned):

    header        identity and the job's options (written once), server state, version and
                  seqlock, doorbell: one cache line per writer so no two processes write
                  the same line
    spec          the model's parameter names and shapes as JSON (for clear mismatch errors)
    learner table `capacity` entries of ENTRY_BYTES, each split into lines by writer
                  (learner-owned head, server-owned tail, staleness histogram)
    weights       n_params float32 (in elastic mode: the centre variable)
    state         `state_arrays` x n_params float32 of server optimiser state, end to end:
                  none, the momentum buffer, Adagrad's sums of squared gradients, or Adam's
                  first and second moments (m, then v)
    rings         per learner: `slots` slot headers (one cache line each), then `slots`
                  page-aligned payloads

A slot's payload is a dense area, the gradients of every dense parameter end to end in the
job's gradient dtype (float32, float16 or bfloat16), followed by one area per row-sparse
table: a row count, the row indices (int64) and the rows themselves. Row-sparse tables
(embeddings) are left out of the dense area, so a mini-batch moves only the rows it touched.

Counters are 64-bit and monotonic; a ring's `head - tail` is the number of published,
unconsumed slots and slot k lives at index k % slots.
"""

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType

MAGIC = 0x31304945_44414701  # bytes b"\x01GADEI01" in little-endian order
LAYOUT_VERSION = 13  # 13: an entry's last_pid/last_applied are the record its launched learner keeps at release
PAGE = 4096
LINE = 64
NAME_BYTES = 64
HIST_BUCKETS = 16
MAX_SPARSE = 8  # row-sparse tables a job may have
DEFAULT_SPEC_BYTES = 64 * 1024
REASON_BYTES = 512  # a text field: UTF-8, NUL-padded (why the server stopped the job as failed)

# Gradient transports: code stored in the header -> (name, bytes per element).
DTYPES = MappingProxyType({1: ("float32", 4), 2: ("float16", 2), 3: ("bfloat16", 2)})
DTYPE_CODES = MappingProxyType({name: code for code, (name, _) in DTYPES.items()})

# Update rules: code stored in the header -> name.
MODES = MappingProxyType({1: "async", 2: "consistent", 3: "sync", 4: "elastic"})
MODE_CODES = MappingProxyType({name: code for code, name in MODES.items()})

# Run states of the job (header field run_state). FAILED: the server stopped the job on an
# error it must not go on from (a corrupt region, a non-finite gradient with nonfinite =
# 'stop'); its supervisor does not restart it, and no checkpoint is taken after it.
CREATED, SERVING, STOPPING, STOPPED, FAILED = 0, 1, 2, 3, 4
RUN_STATES = MappingProxyType({CREATED: "created", SERVING: "serving", STOPPING: "stopping", STOPPED: "stopped",
                               FAILED: "failed"})

# The header's train_stop: why the evaluating learner decided that training ends (0: it goes on).
TRAIN_ON, TRAIN_STOP_PATIENCE = 0, 1
TRAIN_STOPS = MappingProxyType({TRAIN_STOP_PATIENCE: "patience ran out"})

# What a reader accepts of a live region's counters (anything else is corrupt: RegionCorrupt).
COUNTER_LIMIT = 1 << 63  # versions, gradients applied, ring heads and tails stay below this
MAX_SAMPLES = 1 << 32  # samples one slot may say its gradient was computed from

# Weights initialisation: low 32 bits of the header word `init`; the high 32 hold the
# uploading pid while INIT_WRITING, so a reset of a dead uploader cannot undo a new one.
INIT_EMPTY, INIT_WRITING, INIT_READY = 0, 1, 2

# Learner entry states (the entry's `state` field; ownership itself is the `lease` word).
# DEAD: the supervisor found the owner gone without leaving; the next learner that claims
# the entry takes it over.
FREE, CLAIMING, ACTIVE, LEAVING, DEAD = 0, 1, 2, 3, 4
ENTRY_STATES = MappingProxyType({FREE: "free", CLAIMING: "claiming", ACTIVE: "active", LEAVING: "leaving",
                                 DEAD: "dead"})

_SPARSE_ENTRY = 32  # offset u64, rows u64, width u32, max_rows u32, reserved u64
_SIZES = {"u32": 4, "u64": 8, "f64": 8, "name": NAME_BYTES, "hist": 8 * HIST_BUCKETS,
          "sparse": _SPARSE_ENTRY * MAX_SPARSE, "text": REASON_BYTES}
FIELD_BYTES = MappingProxyType(_SIZES)  # bytes of a field of each kind
_LINE_BREAK = ("", "")


def _round_up(value, multiple):
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class Field:
    """One field of a record: byte offset from the record's start, kind ('u32', 'u64', ...)."""

    offset: int
    kind: str


def _record(fields):
    """Offsets for `fields` in order, each aligned to its size; _LINE_BREAK starts a new cache line."""
    out, offset = {}, 0
    for name, kind in fields:
        if (name, kind) == _LINE_BREAK:
            offset = _round_up(offset, LINE)
            continue
        size = _SIZES[kind]
        offset = _round_up(offset, min(size, 8))
        out[name] = Field(offset, kind)
        offset += size
    return MappingProxyType(out), _round_up(offset, LINE)


HEADER, HEADER_BYTES = _record(
    [
        # identity: written once by the creator before `magic`, read by every attacher
        ("magic", "u64"),
        ("layout_version", "u32"),
        ("header_bytes", "u32"),
        ("region_bytes", "u64"),
        ("n_params", "u64"),
        ("grad_dtype", "u32"),
        ("capacity", "u32"),
        ("slots", "u32"),
        ("mode", "u32"),
        ("creator_uid", "u32"),
        ("spec_bytes", "u32"),
        ("state_arrays", "u32"),  # n_params float32 arrays of optimiser state: 0, 1 or 2 (Adam)
        ("created_ns", "u64"),
        ("job", "name"),
        _LINE_BREAK,
        # the job's options, written once by the creator
        ("momentum", "f64"),
        ("adam_beta1", "f64"),  # Adam's moment decays and epsilon (optimizer adam)
        ("adam_beta2", "f64"),
        ("adam_eps", "f64"),
        ("optimizer", "u32"),  # 0: sgd; 1: adagrad (state: the sums of squared gradients); 2: adam (state: m, v)
        ("stale_lr", "u32"),  # 1: divide the learning rate by each gradient's staleness
        ("stale_bound", "u32"),  # 0: none; K: no gradient is applied more than K versions stale
        ("alpha", "f64"),  # elastic moving rate
        ("tau", "u32"),  # elastic: local steps between exchanges
        ("sparse_count", "u32"),
        ("drop_after", "f64"),  # sync / staleness bound: seconds without a beat before a learner is left out
        ("nonfinite", "u32"),  # a gradient with NaN or inf: 0 skip it (and count it), 1 stop the job
        ("sparse", "sparse"),  # MAX_SPARSE entries: offset u64, rows u64, width u32, max_rows u32
        _LINE_BREAK,
        # server: written by the server only
        ("server_pid", "u32"),
        ("run_state", "u32"),
        ("server_start", "f64"),
        ("server_beat", "u64"),
        ("lr", "f64"),
        ("threads", "u32"),
        ("applied", "u64"),
        ("serve_start_ns", "u64"),
        ("applied_bytes", "u64"),  # gradient bytes the server read from slots, ever
        ("nonfinite_skipped", "u64"),  # gradients with NaN or inf values the server skipped (nonfinite = 'skip')
        _LINE_BREAK,
        # the weights' version: bumped once per update (per round in sync mode); pull threads
        # futex-wait on it. seq is the seqlock of consistent mode: odd while an update runs.
        ("version", "u64"),
        ("seq", "u64"),
        _LINE_BREAK,
        # waiters: pull threads count themselves here so the server wakes them only when needed
        ("version_waiters", "u32"),
        _LINE_BREAK,
        # doorbell: learners ring it (bump + wake) when the server said it sleeps
        ("doorbell", "u32"),
        ("server_sleeping", "u32"),
        _LINE_BREAK,
        # weights initialisation and the model spec, written once by whoever initialises
        ("init", "u64"),
        ("spec_len", "u32"),
        _LINE_BREAK,
        # the job's supervisor (its process fills these; gadei status shows them)
        ("supervisor_pid", "u32"),
        ("supervisor_start", "f64"),
        ("supervisor_beat", "u64"),
        ("checkpointed_version", "u64"),
        ("finished", "u32"),  # 1: the supervisor stopped the job because every launched learner finished
        _LINE_BREAK,
        # checkpoint hold: a checkpointer sets hold (0 -> 1), the server pauses between two
        # updates and says so in held until hold is 0 again or its hold limit passed; each pause
        # that ends bumps hold_epoch (a copy is whole if held stayed 1 and the epoch did not move)
        ("hold", "u32"),
        ("held", "u32"),
        ("hold_epoch", "u64"),
        ("restarts", "u32"),  # times a supervisor restarted this job's server (recent ones, in its window)
        ("resumed_applied", "u64"),  # `applied` of the checkpoint this region was resumed from (0: none)
        _LINE_BREAK,
        # the training decision: the evaluating learner (the only writer) sets it once, when the
        # validation accuracy stopped improving; every learner ends its schedule when it sees it
        ("train_stop", "u32"),  # 0: train on; TRAIN_STOP_PATIENCE: patience ran out
        ("train_stop_version", "u64"),  # the weights' version when it was decided
        _LINE_BREAK,
        # why the server stopped the job as failed, in words (the server writes it once, before
        # run_state FAILED; its supervisor's result.json and `gadei status` show it)
        ("fail_reason", "text"),
    ]
)

ENTRY, ENTRY_BYTES = _record(
    [
        # owner learner writes
        ("lease", "u64"),  # owner pid << 32 | claims; changed only by compare-and-swap
        ("state", "u32"),  # FREE, CLAIMING, ACTIVE, LEAVING or DEAD, for people and the supervisor
        ("pid", "u32"),  # whose counters these are: set once a new owner reset them, kept at release
        ("start", "f64"),
        ("beat", "u64"),
        ("head", "u64"),  # slots published, ever (monotonic)
        ("claim_head", "u64"),  # head when the current owner claimed the ring
        # the launched learner numbered like this entry: the pid of its process that last gave
        # back a drained ring (whichever entry it held) and what the server applied of it, kept
        # by that process at release (no claim writes them): a learner killed after it gave its
        # entry back is counted by them
        ("last_pid", "u32"),
        ("last_applied", "u64"),
        ("pulled_version", "u64"),
        ("pulls", "u64"),
        ("samples", "u64"),
        ("threads", "u32"),  # cores the learner keeps busy (torch threads + push/pull threads)
        ("device", "u32"),  # where its model is: 0 the CPU, k + 1 CUDA GPU k
        ("dropped", "u64"),  # gradients not published: they would have broken the staleness bound
        ("pull_retries", "u64"),  # consistent mode: copies retried because an update ran
        _LINE_BREAK,
        # server writes
        ("tail", "u64"),  # slots consumed, ever (monotonic); futex word of a learner waiting for space
        ("applied_samples", "u64"),
        ("stale_sum", "u64"),
        ("stale_max", "u64"),
        ("discarded", "u64"),  # published gradients the server did not apply: later than the staleness bound
        _LINE_BREAK,
        # owner learner sets while it waits for ring space; the server wakes it
        ("space_waiting", "u32"),
        _LINE_BREAK,
        # server writes: staleness histogram, bucket b counts staleness s with bit_length(s) == b
        ("stale_hist", "hist"),
    ]
)

SLOT, SLOT_HEADER_BYTES = _record(
    [
        ("version", "u64"),  # the weights version the gradient was computed on
        ("step", "u64"),  # the learner's step number
        ("samples", "u64"),  # samples in the mini-batch
        ("kind", "u64"),  # GRADIENT, or MOVE (a bridge's move: w -= payload, outside the update rule)
    ]
)
GRADIENT, MOVE = 0, 1  # slot kinds


@dataclass(frozen=True)
class SparseTable:
    """A parameter whose gradient travels as rows (an embedding table).

    Attributes:
        offset: index of its first weight in the flat weights.
        rows: rows of the table.
        width: elements per row.
        max_rows: most distinct rows one gradient may carry.
    """

    offset: int
    rows: int
    width: int
    max_rows: int

    @property
    def size(self) -> int:
        return self.rows * self.width


@dataclass(frozen=True)
class Shape:
    """What a region must hold; the layout is a pure function of it.

    Attributes:
        n_params: number of float32 weights.
        grad_dtype: element type of gradients in a slot (a key of DTYPE_CODES).
        capacity: learner entries (most learners attached at once).
        slots: gradient slots per learner ring.
        mode: the server's update rule (a key of MODE_CODES).
        state_arrays: n_params float32 arrays of optimiser state after the weights (0, 1 for
            momentum or Adagrad, 2 for Adam).
        sparse: the row-sparse tables, in order of offset.
        spec_bytes: room for the model's parameter spec (JSON).
    """

    n_params: int
    grad_dtype: str = "float32"
    capacity: int = 8
    slots: int = 2
    mode: str = "async"
    state_arrays: int = 0
    sparse: tuple[SparseTable, ...] = ()
    spec_bytes: int = DEFAULT_SPEC_BYTES

    def __post_init__(self):
        if not isinstance(self.n_params, int) or self.n_params < 1:
            raise ValueError(f"n_params must be a positive integer, not {self.n_params!r}")
        if self.grad_dtype not in DTYPE_CODES:
            raise ValueError(f"grad_dtype {self.grad_dtype!r} is not one of {sorted(DTYPE_CODES)}")
        if not 1 <= self.capacity <= 1024:
            raise ValueError(f"capacity (learners) must be 1..1024, not {self.capacity!r}")
        if not 1 <= self.slots <= 64:
            raise ValueError(f"slots per ring must be 1..64, not {self.slots!r}")
        if self.state_arrays not in (0, 1, 2):
            raise ValueError(f"state_arrays (optimiser state arrays) must be 0, 1 or 2, not {self.state_arrays!r}")
        if self.mode not in MODE_CODES:
            raise ValueError(f"mode {self.mode!r} is not one of {sorted(MODE_CODES)}")
        if self.spec_bytes < PAGE or self.spec_bytes % PAGE:
            raise ValueError(f"spec_bytes must be a positive multiple of {PAGE}, not {self.spec_bytes!r}")
        if len(self.sparse) > MAX_SPARSE:
            raise ValueError(f"at most {MAX_SPARSE} row-sparse tables, not {len(self.sparse)}")
        end = 0
        for table in self.sparse:
            if table.offset < end or table.rows < 1 or table.width < 1 or table.offset + table.size > self.n_params:
                raise ValueError(f"row-sparse table {table} overlaps another or lies outside the {self.n_params} "
                                 "weights")
            if not 1 <= table.max_rows <= table.rows:
                raise ValueError(f"row-sparse table {table}: max_rows must be 1..{table.rows}")
            end = table.offset + table.size

    @property
    def grad_itemsize(self) -> int:
        return DTYPES[DTYPE_CODES[self.grad_dtype]][1]

    @property
    def dense_segments(self) -> tuple[tuple[int, int, int], ...]:
        """(weights offset, length, offset in the dense area) of each run of dense weights."""
        out, start, slot = [], 0, 0
        for table in self.sparse:
            if table.offset > start:
                out.append((start, table.offset - start, slot))
                slot += table.offset - start
            start = table.offset + table.size
        if start < self.n_params:
            out.append((start, self.n_params - start, slot))
        return tuple(out)

    @property
    def dense_count(self) -> int:
        """Gradient elements in a slot's dense area."""
        return self.n_params - sum(table.size for table in self.sparse)


@dataclass(frozen=True)
class SparseArea:
    """Where one row-sparse table's gradient lies in a slot payload (offsets from its start)."""

    count: int  # u64: rows in use
    indices: int  # int64 x max_rows
    rows: int  # grad dtype x max_rows x width


@dataclass(frozen=True)
class Layout:
    """Byte offsets of every section of a region of one `Shape`."""

    shape: Shape
    spec: int
    table: int
    weights: int
    state: int | None
    rings: int
    ring_bytes: int
    slot_headers_bytes: int
    dense_bytes: int
    sparse_areas: tuple[SparseArea, ...]
    payload_bytes: int
    payload_stride: int
    total: int

    def entry(self, learner: int) -> int:
        """Offset of learner entry `learner` in the table."""
        return self.table + learner * ENTRY_BYTES

    def slot_header(self, learner: int, slot: int) -> int:
        """Offset of the header of slot index `slot` (0..slots-1) of learner `learner`'s ring."""
        return self.rings + learner * self.ring_bytes + slot * SLOT_HEADER_BYTES

    def payload(self, learner: int, slot: int) -> int:
        """Offset of the payload of slot index `slot` of learner `learner`'s ring."""
        return self.rings + learner * self.ring_bytes + self.slot_headers_bytes + slot * self.payload_stride


RING_SLOTS = 8  # slots a ring gets where the job leaves them to the server ("auto") and they fit RING_BYTES
RING_BYTES = 16 << 20


def ring_slots(shape: Shape, slots: int | None) -> Shape:
    """`shape` with `slots` per ring; None (a job's "auto", the default): RING_SLOTS where a ring of
    them holds at most RING_BYTES of payload, as many as fit for larger gradients (at least 2), and
    2 in sync mode (a round takes one gradient of each learner: more slots would only let a
    learner run further ahead of the weights). Room for several gradients a ring is what lets a
    server with no core of its own nap between looks instead of being rung awake by each
    (`gadei.spin.nap_ns`)."""
    if slots is None:
        stride = layout(dataclasses.replace(shape, slots=1)).payload_stride
        slots = 2 if shape.mode == "sync" else max(2, min(RING_SLOTS, RING_BYTES // stride))
    return dataclasses.replace(shape, slots=slots)


def layout(shape: Shape) -> Layout:
    """The layout of a region holding `shape`: a pure function, the same in every process."""
    weights_bytes = _round_up(shape.n_params * 4, PAGE)
    spec = _round_up(HEADER_BYTES, PAGE)
    table = spec + shape.spec_bytes
    weights = table + _round_up(shape.capacity * ENTRY_BYTES, PAGE)
    state = weights + weights_bytes if shape.state_arrays else None
    rings = weights + weights_bytes + _round_up(shape.state_arrays * shape.n_params * 4, PAGE)
    itemsize = shape.grad_itemsize
    dense_bytes = _round_up(shape.dense_count * itemsize, LINE)
    areas, offset = [], dense_bytes
    for sparse in shape.sparse:
        count = offset
        indices = count + LINE
        rows = indices + _round_up(sparse.max_rows * 8, LINE)
        offset = rows + _round_up(sparse.max_rows * sparse.width * itemsize, LINE)
        areas.append(SparseArea(count, indices, rows))
    payload_bytes = max(offset, LINE)
    payload_stride = _round_up(payload_bytes, PAGE)
    slot_headers_bytes = _round_up(shape.slots * SLOT_HEADER_BYTES, PAGE)
    ring_bytes = slot_headers_bytes + shape.slots * payload_stride
    return Layout(
        shape=shape,
        spec=spec,
        table=table,
        weights=weights,
        state=state,
        rings=rings,
        ring_bytes=ring_bytes,
        slot_headers_bytes=slot_headers_bytes,
        dense_bytes=dense_bytes,
        sparse_areas=tuple(areas),
        payload_bytes=payload_bytes,
        payload_stride=payload_stride,
        total=rings + shape.capacity * ring_bytes,
    )
