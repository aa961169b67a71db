"""Seeing a job run: snapshots of a region's counters, read without writing a byte of it.

`read` takes one snapshot through a read-only mapping; two snapshots give rates
(pushes/s, updates/s, gradient bytes/s). `gadei status` prints them as a table for people
or as JSON lines for programs.
"""

import time
from dataclasses import asdict, dataclass, field

from . import _proc, ring
from .layout import ENTRY_STATES, HIST_BUCKETS
from .modes import RuleOptions, read_options
from .options import declared, used_in
from .protocol import RunState
from .region import Region
from .supervisor import alive, registered

DEFAULTS = {f.name: f.default for f in declared(RuleOptions)}  # an option is shown where it is not its default


@dataclass
class LearnerStatus:
    """One learner entry as the region shows it."""

    learner: int
    state: str
    pid: int
    alive: bool
    beat_age: float | None  # seconds since its last heartbeat
    pushes: int  # gradients published since this owner claimed the ring
    applied: int  # of those, applied by the server
    in_ring: int  # published, not yet applied
    samples: int
    pulls: int
    pulled_version: int
    stale_mean: float
    stale_p50: int
    stale_max: int
    dropped: int  # gradients not applied for the staleness bound: not published, or discarded by the server
    pull_retries: int  # consistent copies taken again because an update ran during them
    device: str  # where its model is: "cpu" or "cuda:N"
    stale_hist: list[int] = field(repr=False)


@dataclass
class JobStatus:
    """A job's region at one moment."""

    job: str
    taken_at: float  # time.monotonic() of the snapshot
    run_state: str
    fail_reason: str  # why the server stopped the job as failed ("" unless it did)
    server_pid: int
    server_alive: bool
    server_beat_age: float | None
    version: int
    applied: int
    applied_bytes: int  # gradient bytes the server read from slots, ever
    nonfinite_skipped: int  # gradients with NaN or inf values the server skipped, not applied
    n_params: int
    grad_dtype: str
    row_sparse_tables: int
    lr: float
    threads: int
    capacity: int
    slots: int
    mode: str
    options: dict
    supervisor_pid: int
    supervisor_alive: bool
    supervisor_beat_age: float | None
    restarts: int
    checkpointed_version: int
    learners: list[LearnerStatus]
    launched: list[dict] = field(default_factory=list)  # the supervisor's launched learners (see `_launched`)
    picking: dict | None = None  # a job that picks its model: its candidates, and which one trains (`_picking`)

    def to_json(self) -> dict:
        return asdict(self)


def _age(beat_ns: int, now_ns: int) -> float | None:
    return None if beat_ns == 0 else max(0.0, (now_ns - beat_ns) / 1e9)


def device_name(code: int) -> str:
    """A learner entry's `device` field as a name: 0 "cpu", k + 1 "cuda:k"."""
    return "cpu" if code == 0 else f"cuda:{code - 1}"


def _p50(hist: list[int]) -> int:
    """Median staleness estimated from the log2 histogram (the bucket's lower bound)."""
    total = sum(hist)
    if total == 0:
        return 0
    seen = 0
    for bucket, count in enumerate(hist):
        seen += count
        if 2 * seen >= total:
            return 0 if bucket == 0 else 1 << (bucket - 1)
    return 1 << (HIST_BUCKETS - 2)


def read(region: Region) -> JobStatus:
    """Snapshot `region`'s counters (only loads; safe on a read-only mapping)."""
    h = region.header
    now = time.monotonic_ns()
    learners = []
    for i in range(region.shape.capacity):
        e = region.entry(i)
        pid = ring.owner(region, i)
        if pid == 0:
            continue
        pushes, applied, in_ring = ring.since_claim(region, i)
        hist = e.get("stale_hist")
        learners.append(
            LearnerStatus(
                learner=i,
                state=ENTRY_STATES.get(e.get("state"), "?"),
                pid=pid,
                alive=_proc.alive(pid, e.get("start")),
                beat_age=_age(e.get("beat"), now),
                pushes=pushes,
                applied=applied,
                in_ring=in_ring,
                samples=e.get("samples"),
                pulls=e.get("pulls"),
                pulled_version=e.get("pulled_version"),
                stale_mean=e.get("stale_sum") / applied if applied else 0.0,
                stale_p50=_p50(hist),
                stale_max=e.get("stale_max"),
                dropped=e.get("dropped") + e.get("discarded"),
                pull_retries=e.get("pull_retries"),
                device=device_name(e.get("device")),
                stale_hist=hist,
            )
        )
    state = RunState(region)
    return JobStatus(
        job=region.job,
        taken_at=now / 1e9,
        run_state=state.name(),
        fail_reason=state.reason(),
        server_pid=h.get("server_pid"),
        server_alive=region.server_alive(),
        server_beat_age=_age(h.get("server_beat"), now),
        version=h.get("version"),
        applied=h.get("applied"),
        applied_bytes=h.get("applied_bytes"),
        nonfinite_skipped=h.get("nonfinite_skipped"),
        n_params=region.shape.n_params,
        grad_dtype=region.shape.grad_dtype,
        row_sparse_tables=len(region.shape.sparse),
        lr=h.get("lr"),
        threads=h.get("threads"),
        capacity=region.shape.capacity,
        slots=region.shape.slots,
        mode=region.shape.mode,
        options=asdict(read_options(region)),
        supervisor_pid=registered(region)[0],
        supervisor_alive=alive(region),
        supervisor_beat_age=_age(h.get("supervisor_beat"), now) if registered(region)[0] else None,
        restarts=h.get("restarts"),
        checkpointed_version=h.get("checkpointed_version"),
        learners=learners,
        launched=_launched(region.job),
        picking=_picking(region.job),
    )


def _launched(job: str) -> list[dict]:
    """The learners the job's supervisor launched, as its record says: number, pid, state
    (running, waiting for a restart, done, given up), restarts and where it (re)started."""
    try:
        from .supervisor import load_state

        _, table = load_state(job)
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return []
    out = []
    for learner in table:
        state = "given up" if learner.failed else "done" if learner.done else "running" if learner.pid else "waiting"
        out.append({"number": learner.number, "pid": learner.pid, "state": state, "restarts": len(learner.restarts),
                    "start_at": learner.start_at})
    return out


def _picking(job: str) -> dict | None:
    """A job that picks its model (`workload = "auto"`): the candidate that trains now (the run
    folder its supervisor's record names, a candidate's) and each candidate's figures as its
    result.json says (`gadei.outputs.figures`: outcome, validation accuracy, seconds); else None."""
    from pathlib import Path

    from . import outputs

    try:
        from .supervisor import load_state

        settings, _ = load_state(job)
        folder = Path(settings["checkpoint_dir"]).parent
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return None
    found = outputs.candidates(folder.parent.parent) if folder.parent.name == outputs.CANDIDATES else None
    if not found or folder.name not in [c.workload for c in found]:
        return None
    return {"training": folder.name, "candidates": [outputs.figures(c) for c in found]}


@dataclass
class Rates:
    """Per-second rates between two snapshots of one job."""

    seconds: float
    updates: float
    bytes: float  # gradient bytes applied per second
    pushes: dict[int, float]  # learner -> pushes/s
    samples: dict[int, float]  # learner -> samples/s


def rates(before: JobStatus, after: JobStatus) -> Rates:
    """Rates of the counters between two snapshots (learners present in both)."""
    dt = max(1e-9, after.taken_at - before.taken_at)
    old = {learner.learner: learner for learner in before.learners if learner.pid}
    pushes, samples = {}, {}
    for learner in after.learners:
        prev = old.get(learner.learner)
        if prev is not None and prev.pid == learner.pid:
            pushes[learner.learner] = (learner.pushes - prev.pushes) / dt
            samples[learner.learner] = (learner.samples - prev.samples) / dt
    updates = (after.applied - before.applied) / dt
    return Rates(dt, updates, (after.applied_bytes - before.applied_bytes) / dt, pushes, samples)


def picking_line(picking: dict) -> str:
    """`_picking` in words: "picks its model: candidate 2 of 2, textcnn, trains; ngram done,
    validation accuracy 90.12% in 14 s"."""
    found = picking["candidates"]
    at = next(i for i, c in enumerate(found, 1) if c["workload"] == picking["training"])
    said = []
    for c in found:
        if c["workload"] == picking["training"]:
            continue
        if c.get("outcome") is None:
            said.append(f"{c['workload']} waits")
        else:
            said.append(f"{c['workload']} {c['outcome']}"
                        + (f", validation accuracy {c['validation_accuracy']:.2%}"
                           if "validation_accuracy" in c else "")
                        + (f" in {c['seconds']:.0f} s" if "seconds" in c else ""))
    return (f"picks its model (workload auto): candidate {at} of {len(found)}, {picking['training']}, trains"
            + "".join(f"; {line}" for line in said))


def _option(name: str, value) -> str:
    """`, momentum 0.9`, `, optimizer adagrad`, `, stale_lr on`: one option for the status line."""
    if isinstance(value, bool):
        return f", {name} {'on' if value else 'off'}"
    if isinstance(value, (int, float)):
        return f", {name} {value:g}"
    return f", {name} {value}"


def format_table(status: JobStatus, rate: Rates | None) -> str:
    """The human-readable status of one job."""
    server = f"pid {status.server_pid} " + ("alive" if status.server_alive else "GONE")
    if status.server_beat_age is not None:
        server += f", beat {status.server_beat_age:.1f}s ago"
    options = {k: v for k, v in status.options.items()
               if k != "lr" and v != DEFAULTS[k] and used_in(RuleOptions, k, status.mode)}
    tables = status.row_sparse_tables
    transport = status.grad_dtype + (f" + {tables} row-sparse table{'s' * (tables != 1)}" if tables else "")
    lines = [
        f"job {status.job}: {status.run_state}; server {server}; mode {status.mode}, lr {status.lr:g}"
        + "".join(_option(k, v) for k, v in options.items())
        + f"; kernel teams of up to {status.threads} thread{'s' * (status.threads != 1)}",
        f"  weights: {status.n_params:,} parameters ({status.n_params * 4 / 1e6:.1f} MB), {transport} gradients, "
        f"version {status.version:,}, {status.applied:,} gradients applied"
        + (f", {status.nonfinite_skipped:,} non-finite gradients skipped" if status.nonfinite_skipped else "")
        + (f", {rate.updates:,.1f} updates/s, {rate.bytes / 1e9:.2f} GB/s of gradients" if rate else ""),
        f"  learners: {len(status.learners)} of {status.capacity} entries, {status.slots} slots per ring",
    ]
    if status.fail_reason:
        lines.insert(1, f"  failed: {status.fail_reason}")
    if status.supervisor_pid or status.checkpointed_version or status.restarts:
        who = "none"
        if status.supervisor_pid:
            who = f"pid {status.supervisor_pid} " + ("alive" if status.supervisor_alive else "GONE")
            if status.supervisor_beat_age is not None:
                who += f", beat {status.supervisor_beat_age:.1f}s ago"
        lines.insert(2, f"  supervisor: {who}; last checkpoint at version {status.checkpointed_version:,}; "
                        f"{status.restarts} server restarts")
    if status.picking:
        lines.append("  " + picking_line(status.picking))
    if status.launched:
        lines.append("  launched by the supervisor: " + "; ".join(
            f"{learner['number']} {learner['state']}" + (f" (pid {learner['pid']})" if learner["pid"] else "")
            + (f", {learner['restarts']} restarts" if learner["restarts"] else "") for learner in status.launched))
    if status.learners:
        header = ("learner", "pid", "state", "device", "pushes", "pushes/s", "samples/s", "applied", "in ring",
                  "stale mean/p50/max", "dropped", "pulled v", "retries", "beat")
        rows = [header]
        for learner in status.learners:
            rows.append((
                str(learner.learner),
                str(learner.pid) + ("" if learner.alive else " (dead)"),
                learner.state,
                learner.device,
                f"{learner.pushes:,}",
                f"{rate.pushes.get(learner.learner, 0.0):,.1f}" if rate else "-",
                f"{rate.samples.get(learner.learner, 0.0):,.1f}" if rate else "-",
                f"{learner.applied:,}",
                str(learner.in_ring),
                f"{learner.stale_mean:.1f}/{learner.stale_p50}/{learner.stale_max}",
                f"{learner.dropped:,}",
                f"{learner.pulled_version:,}",
                f"{learner.pull_retries:,}",
                "-" if learner.beat_age is None else f"{learner.beat_age:.1f}s",
            ))
        widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
        for row in rows:
            lines.append("  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    return "\n".join(lines)
