"""The server: creates the job's region and settles every published gradient exactly once
(applies it, or discards and counts it: staler than the job's bound, not finite).

The apply loop looks at the learners' rings round-robin, takes one published slot at a
time, applies it with the job's update rule (a native kernel, GIL released), bumps the
weights version, records the gradient's staleness, and hands the slot back. Between
gradients it spins (up to GADEI_SPIN_US) only while they come faster than a sleep and a
wake-up cost, dozes (looking at the rings every 50 us) while they come less than 1 ms apart
or its updates take a quarter of the gap, and otherwise sleeps on the region's doorbell, so
an idle server costs no CPU. It spins or dozes only while the machine has a core for it (the
threads the attached learners keep busy, plus the server, fit the cores) and no other server
on the machine does the same (`spin.SpinToken`): on a machine the learners fill, a spinning
server would take their CPU; there it naps instead (a look at the rings every few hundred
microseconds) while gradients come faster than that, rather than being rung awake by each.
Its kernel's OpenMP threads sleep between updates too (`env.quiet_openmp`). In async,
consistent and elastic modes it never waits for a learner: one that dies or stops simply stops
publishing; a sync round waits for a gradient of every live learner, and leaves out one that
has not beaten for `drop_after` seconds.

The region is untrusted input: every process of the user can write it. The server checks
each ring's head - tail when it takes a gradient (`ring.Consumer.take`), a slot's counters,
that the version and gradients applied are the ones it wrote, and at every heartbeat that
the header's fields written once (identity, shape, options) and its own are unchanged and
the run state and checkpoint hold are ones it knows. A violation stops the job
(`RegionCorrupt`: run state 'failed', no checkpoint of it, its supervisor does not restart it).
A gradient with NaN or inf values is skipped and counted, or stops the job (`nonfinite`).

Initial weights are deterministic: either the server is given a model (from a model
factory with a fixed seed) and copies its parameters into the region, or it is given only a
parameter count and the first learner to attach uploads its own model's parameters.
"""

import dataclasses
import logging
import struct
import time
from dataclasses import dataclass

from .env import quiet_openmp

# ruff: noqa: E402 (the imports below come after quiet_openmp(), on purpose)
quiet_openmp()  # before torch loads OpenMP: the kernel's idle threads sleep (a server of the Python API too)

import numpy as np
import torch

from . import params
from .checkpoint import Checkpoint, CheckpointError
from .checkpoint import take as take_checkpoint
from .env import openmp_policy, openmp_spins, settings, usable_cores
from .errors import NonFiniteGradient, RegionCorrupt, RegionMismatch
from .layout import (
    ACTIVE,
    FIELD_BYTES,
    HEADER,
    HIST_BUCKETS,
    INIT_READY,
    RUN_STATES,
    SERVING,
    STOPPING,
    Shape,
    ring_slots,
)
from .modes import RULES, RuleOptions, make_rule, state_names
from .options import check_all, declared, to_header
from .transport.options import TransportOptions
from .transport.slot import Gradient
from .region import Region
from .server_record import drop_server_record, save_server_record
from .protocol import WAIT_SLICE, Deadline, RunState, ServerHold, Version
from .ring import Consumer, owner_alive
from .spin import DOZE_NS, DOZE_SLICE_NS, SPIN_PAYS_NS, SpinToken, doze_pays, nap_ns, runnable, short_timer_slack

log = logging.getLogger(__name__)

# What to do about each error the server stops a job on (the end of its recorded reason).
_ADVICE = {
    RegionCorrupt: "something other than gadei wrote the job's shared memory; the newest checkpoint is from before "
                   "this: go on from it with --resume",
    NonFiniteGradient: "training diverged or the data hold NaN or inf: lower the learning rate (or set nonfinite = "
                       "'skip' to skip such gradients) and train again",
}

BEAT_INTERVAL = 0.05  # seconds between heartbeats while gradients flow
_BEAT_NS = int(BEAT_INTERVAL * 1e9)
@dataclass(frozen=True)
class ServeReport:
    """What one `Server.serve` run did."""

    applied: int
    seconds: float
    version: int
    learners_left: int
    first_applied: float | None = None  # when (time.time()) it applied its first gradient; None: none


def with_options(rule_options: RuleOptions, transport: TransportOptions, options: dict):
    """`rule_options` and `transport` with `options` (names of either's options) replaced.

    Raises:
        TypeError: a name that is neither's option.
    """
    names = ({f.name for f in declared(RuleOptions)}, {f.name for f in declared(TransportOptions)})
    unknown = set(options) - names[0] - names[1]
    if unknown:
        raise TypeError(f"Server() got unexpected keyword arguments {sorted(unknown)}; options: "
                        f"{sorted(names[0] | names[1])}")
    rule_options = dataclasses.replace(rule_options, **{k: v for k, v in options.items() if k in names[0]})
    transport = dataclasses.replace(transport, **{k: v for k, v in options.items() if k in names[1]})
    return rule_options, transport


class Server:
    """A job's parameter server. Creating it creates the job's region.

    Args:
        job: the job name; the region is `/gadei-<job>`.
        model: a model whose parameters are the initial weights (and whose parameter
            names and shapes every learner's model must match).
        n_params: instead of `model`: the number of parameters; the first learner to
            attach uploads its model's parameters as the initial weights.
        mode: the update rule: 'async', 'consistent', 'sync' or 'elastic' (see `gadei.modes`).
        rule_options: the update rule's options (`gadei.modes.RuleOptions`: lr, momentum, optimizer, ...).
        transport: the rings' format (`gadei.transport.options.TransportOptions`: gradient
            element type, row-sparse tables (needs `model`), slots per ring).
        **options: any option of those two by name (`lr=0.1, grad_dtype="float16"`),
            replacing the one in `rule_options` or `transport`.
        learners: most learners attached at once (one ring each).
        threads: the most OpenMP threads of the update kernel (default: GADEI_THREADS); a team
            has one thread per 262,144 elements of an update (native GD_THREAD_MIN).
        spin_us: the most microseconds to spin for the next gradient, while gradients come
            less than SPIN_PAYS_NS apart and the server has a core of its own (GADEI_SPIN_US).
        replace: replace a region left behind by a crashed server instead of refusing.
        resume: a checkpoint (`gadei.checkpoint.load` / `latest`) to go on from: its
            weights, version, gradients applied and momentum replace the initial ones. Its
            parameters must be the job's (names and shapes).
    """

    def __init__(
        self,
        job: str,
        *,
        model: torch.nn.Module | None = None,
        n_params: int | None = None,
        mode: str = "async",
        rule_options: RuleOptions = RuleOptions(),
        transport: TransportOptions = TransportOptions(),
        learners: int = 8,
        threads: int | None = None,
        spin_us: float | None = None,
        replace: bool = False,
        resume: Checkpoint | None = None,
        **options,
    ):
        if (model is None) == (n_params is None):
            raise ValueError("give the server either a model or n_params, not both or neither")
        if mode not in RULES:
            raise ValueError(f"mode {mode!r} is not one of {sorted(RULES)}")
        rule_options, transport = with_options(rule_options, transport, options)
        self.rule_options = rule_options
        self.rule_options.check(mode, learners)
        check_all(transport)
        grad_dtype, row_sparse, slots = transport.grad_dtype, transport.row_sparse, transport.slots
        env = settings()
        self.threads = env.threads if threads is None else max(1, int(threads))
        self.spin_ns = int(1000 * (env.spin_us if spin_us is None else spin_us))
        self._cores = usable_cores()  # the spin and doze decide on the cores this process may use
        if self.threads > 1 and openmp_spins():
            log.warning("job %r: OpenMP's idle threads spin here (OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT, or torch was "
                        "imported before gadei): the update kernel's %d threads will keep up to %d cores busy between "
                        "updates; import gadei.server before torch, or set OMP_WAIT_POLICY=PASSIVE", job, self.threads,
                        self.threads)
        spec, sparse = None, ()
        auto = row_sparse is None
        if auto:
            row_sparse = model is not None and mode != "elastic" and params.sparse_grads(model)
        if model is not None:
            params.check_model(job, model)
            spec = params.spec_of(model)
            n_params = params.count(spec)
            if row_sparse:
                sparse = params.sparse_tables(model, transport.rows)
                if not sparse:
                    raise ValueError(f"job {job!r}: row_sparse needs an nn.Embedding or nn.EmbeddingBag in the model")
        elif row_sparse:
            raise ValueError(f"job {job!r}: row_sparse needs the model (serve it with --workload or --model), "
                             "not only --params")
        shape = ring_slots(Shape(n_params=int(n_params), grad_dtype=grad_dtype, capacity=learners, mode=mode,
                                 state_arrays=len(state_names(rule_options)), sparse=sparse), slots)
        self.region = Region.create(job, shape, replace=replace)
        self.job = job
        self.mode = mode
        try:
            h = self.region.header  # server_pid and server_start: written by Region.create
            h.set("server_beat", time.monotonic_ns())
            h.set("threads", self.threads)
            to_header(self.region.header, self.rule_options)
            if model is not None:
                self.region.write_spec(spec)
                params.flatten_into(model, self.region.weights)
                h.set("init", INIT_READY)
            if resume is not None:
                self._resume(resume, spec)
            self.update_rule = make_rule(mode, self.region, self.rule_options, self.threads)
            self._consumer = Consumer(self.region)
            self._entries = [self.region.entry(i) for i in range(shape.capacity)]
            self._state = RunState(self.region)
            self._state.start()
            self.region.publish()
            # What only this server writes, or nobody after now: checked at every heartbeat.
            self._identity = self.region.raw(0, _IDENTITY_END)
            self._pid, self._started = h.get("server_pid"), h.get("server_start")
            self._version, self._applied = h.get("version"), h.get("applied")
            save_server_record(job, self._pid, self._started)
        except BaseException:
            self.region.unlink()
            self.region.close()
            raise
        self._clock = Version(self.region)
        self._hold = ServerHold(self.region)
        self.first_applied: float | None = None  # when it applied its first gradient (time.time())
        self._applied_word = h.word("applied")
        self._bytes_word = h.word("applied_bytes")
        self._beat_word = h.word("server_beat")
        self._skipped_word = h.word("nonfinite_skipped")
        self._next_audit = 0
        self._closed = False
        described = (f"{grad_dtype} gradients"
                     + (f", {len(sparse)} row-sparse table{'s' * (len(sparse) != 1)}" if sparse else "")
                     + (" (chosen: the model's embedding gradients are sparse)" if auto and sparse else ""))
        log.info(
            "job %r: serving %s parameters (%s) in %s mode, %s, %d learner rings of %s slots, lr %g, "
            "kernel teams of up to %d thread%s (one per 262,144 elements of an update; OpenMP wait policy: %s)", job,
            f"{shape.n_params:,}", _mb(shape.n_params * 4), mode, described, shape.capacity,
            f"{shape.slots}{' (auto)' if slots is None else ''}", rule_options.lr,
            self.threads, "s" * (self.threads != 1), openmp_policy(),
        )

    def _resume(self, checkpoint: Checkpoint, spec) -> None:
        """Put a checkpoint's weights, version and optimiser state in the new region."""
        h = self.region.header
        saved = checkpoint.config.get("spec")
        if spec is None and saved:  # the job was served with n_params only: the checkpoint has the names
            spec = [(name, tuple(dims)) for name, dims in saved]
            self.region.write_spec(spec)
        if spec is not None:
            weights = checkpoint.flat_weights(spec)
        elif "weights" in checkpoint.model:  # a job served with n_params only, checkpointed so
            weights = checkpoint.model["weights"].numpy()
        else:
            raise RegionMismatch(f"job {self.job!r}: checkpoint {checkpoint.path} holds a model's parameters "
                                 f"({', '.join(list(checkpoint.model)[:5])}{', ...' * (len(checkpoint.model) > 5)}) "
                                 "and no list of their shapes; serve it with the model it was taken of "
                                 "(--workload or --model), not --params")
        if weights.size != self.region.shape.n_params:
            raise RegionMismatch(f"job {self.job!r}: checkpoint {checkpoint.path} holds {weights.size:,} parameters, "
                                 f"the job has {self.region.shape.n_params:,}")
        self.region.weights[:] = weights
        self._resume_state(checkpoint)
        h.set("version", checkpoint.version)
        h.set("applied", checkpoint.applied)
        h.set("resumed_applied", checkpoint.applied)
        h.set("checkpointed_version", checkpoint.version)
        h.set("init", INIT_READY)
        log.info("job %r: resumed from %s at version %s", self.job, checkpoint.path, f"{checkpoint.version:,}")

    def _resume_state(self, checkpoint: Checkpoint) -> None:
        """Put a checkpoint's optimiser state in the region: each array the job keeps, by name.
        Momentum or Adagrad sums it lacks (taken with other options) start from zero, with a
        warning. An Adam job refuses a checkpoint without Adam's moments (CheckpointError): its
        bias correction counts from the version, which goes on, so zero moments at a late step
        would not be Adam's steps (the first ones about 3 lr instead of lr)."""
        state, n = self.region.state, self.region.shape.n_params
        names = state_names(self.rule_options)
        for k, name in enumerate(names):
            kept = checkpoint.optimizer.get(name)
            if kept is not None and kept.numel() != n:
                raise CheckpointError(f"job {self.job!r}: checkpoint {checkpoint.path}: optimizer state {name!r} has "
                                      f"{kept.numel():,} values, the job has {n:,} parameters")
            if kept is not None:
                state[k * n : (k + 1) * n] = kept.reshape(-1).numpy()
            elif self.rule_options.optimizer == "adam":
                taken = checkpoint.config.get("options", {}).get("optimizer", "unknown")
                raise CheckpointError(f"job {self.job!r}: checkpoint {checkpoint.path} holds no Adam moments ({name!r} "
                                      f"is missing; it was taken with optimizer {taken!r}): an adam job cannot go on "
                                      "from it, since Adam's bias correction counts the job's updates and zero "
                                      f"moments at version {checkpoint.version:,} are not Adam's steps; resume it "
                                      f"with optimizer = {taken!r}, or train a new adam job")
            else:
                log.warning("job %r: checkpoint %s holds no %s (it was taken with other options); they start from "
                            "zero", self.job, checkpoint.path, name)

    # ------------------------------------------------------------------ the apply loop

    def request_stop(self) -> None:
        """Ask the loop to stop (safe from a signal handler and from other processes' `gadei stop`)."""
        self._state.request_stop()  # rings the doorbell

    def serve(self, *, grace: float = 5.0) -> ServeReport:
        """Apply gradients until the job is asked to stop, then drain and mark it stopped.

        After the stop request, gradients already published are still applied, and the
        loop waits up to `grace` seconds for attached learners to leave, so that every
        gradient a learner published is applied exactly once.
        """
        h = self.region.header
        started = time.monotonic()
        first = self._applied_word.load()
        h.set("serve_start_ns", time.monotonic_ns())
        try:
            if self.update_rule.rounds:
                self._serve_rounds()
            else:
                self._serve_each()
            state = self._state.get()
            if state != STOPPING:  # the loop ends on a stop request, or on a run state nobody may write
                raise RegionCorrupt(f"job {self.job!r}: header field run_state is {state:,}, allowed {SERVING} "
                                    f"(serving) or {STOPPING} (stopping): the region is corrupt")
            left = self._drain(grace)
        except (RegionCorrupt, NonFiniteGradient) as err:
            self._fail(err)
            raise
        self._state.finish()
        self._consumer.wake_all()
        self._clock.wake_all()
        applied = self._applied_word.load() - first
        seconds = time.monotonic() - started
        log.info("job %r: stopped after %s gradients in %.1f s", self.job, f"{applied:,}", seconds)
        return ServeReport(applied, seconds, h.get("version"), left, self.first_applied)

    def failure(self) -> str:
        """Why this server stopped the job as failed ("" unless it did)."""
        return self._state.reason()

    def _fail(self, err: Exception) -> None:
        """Stop the job on `err`: its reason recorded in the region (`RunState.fail`: the
        supervisor's result.json and `gadei status` show it), run state 'failed'
        (final: no checkpoint is taken of the region and its supervisor does not restart the
        server), every waiter woken."""
        reason = f"{err}; {_ADVICE[type(err)]}"
        log.error("%s; the job stops as failed (its supervisor does not restart the server)", reason)
        self._state.fail(reason)
        self._consumer.wake_all()
        self._clock.wake_all()

    def _audit(self) -> None:
        """At a heartbeat: raise RegionCorrupt unless what this server wrote once, or alone, is as it
        wrote it, and the fields others write hold values it knows."""
        if self.region.raw(0, _IDENTITY_END) != self._identity:
            raise self._identity_changed()
        h = self.region.header
        for name, mine in (("server_pid", self._pid), ("server_start", self._started)):
            value = h.get(name)
            if value != mine:
                raise RegionCorrupt(f"job {self.job!r}: header field {name} is {value!r}, expected {mine!r} (this "
                                    "server's): the region is corrupt")
        state = self._state.get()
        if state not in (SERVING, STOPPING):
            raise RegionCorrupt(f"job {self.job!r}: header field run_state is {state:,} "
                                f"({RUN_STATES.get(state, 'unknown')}), allowed {SERVING} (serving) or {STOPPING} "
                                "(stopping) while the server serves: the region is corrupt")
        self._check_hold(self._hold.requested())
        self._check_version(self._clock.get())
        applied = self._applied_word.load()
        if applied != self._applied:
            raise RegionCorrupt(f"job {self.job!r}: header field applied is {applied:,}, expected {self._applied:,} "
                                "(only the server counts it): the region is corrupt")

    def _identity_changed(self) -> RegionCorrupt:
        raw = self.region.raw(0, _IDENTITY_END)
        for name, field in HEADER.items():
            end = field.offset + FIELD_BYTES[field.kind]
            if end > _IDENTITY_END or raw[field.offset:end] == self._identity[field.offset:end]:
                continue
            value, expected = (_shown(name, field.kind, data[field.offset:end]) for data in (raw, self._identity))
            return RegionCorrupt(f"job {self.job!r}: header field {name} is {value}, expected {expected} (written "
                                 "once when the region was created): the region is corrupt")
        where = next(i for i, (a, b) in enumerate(zip(raw, self._identity)) if a != b)
        return RegionCorrupt(f"job {self.job!r}: header byte {where} is {raw[where]}, expected {self._identity[where]} "
                             "(written once when the region was created): the region is corrupt")

    def _check_version(self, version: int) -> None:
        if version != self._version:
            raise RegionCorrupt(f"job {self.job!r}: header field version is {version:,}, expected {self._version:,} "
                                "(only the server moves it, by one per update): the region is corrupt")

    def _check_hold(self, hold: int) -> None:
        if hold > 1:
            raise RegionCorrupt(f"job {self.job!r}: header field hold is {hold:,}, allowed 0..1 (a checkpoint's "
                                "request that the server pause): the region is corrupt")

    def _serve_each(self) -> None:
        """async, consistent, elastic: one update per gradient, rings taken round-robin.

        After each update it spins (up to spin_ns, and at most 4 gaps) for the next gradient,
        but only while gradients come faster than a sleep and a wake-up cost (the gap between
        them, averaged, under SPIN_PAYS_NS): only then does spinning buy time. Otherwise, where
        a doze pays (`spin.doze_pays`: gradients less than 1 ms apart, or updates that take a
        quarter of the gap) and for DOZE_NS since the last gradient, it dozes: looks at the
        rings every DOZE_SLICE_NS and sleeps in between (natively, GIL released; a vCPU halted
        that briefly wakes at once, so a short pause does not cost the next gradient a deep
        wake-up, and learners need not ring); else it sleeps on the doorbell (small updates far
        apart are not kept waiting by a wake-up: a doze there cost a quarter of a core for
        nothing a learner waits on). It spins and dozes only while it has a core of its own
        (the attached learners' threads and the server fit the cores, and the machine's
        runnable threads, /proc/loadavg, do not exceed them) and holds the machine's one
        `SpinToken` (jobs side by side: one server at a time spins or dozes, the others sleep).
        With no core of its own it naps where a nap pays (`spin.nap_ns`: gradients come faster
        than the nap, and the rings hold what comes in two): it looks at the rings once a nap,
        so that it wakes once for several gradients instead of being rung awake, on a learner's
        core, for each; else it sleeps on the doorbell and leaves the cores to the learners.
        """
        serving, held = self._state.serving, self._hold.requested
        consumer = self._consumer
        next_beat, spin_ns, own_core, last, rings = 0, 0, False, 0, 1
        gap = DOZE_NS  # the gap between two gradients, averaged (ns): long until measured
        work = 0  # an update's time, averaged (ns)
        flowing = False  # the last look found a gradient: spin for the next one before sleeping
        token = SpinToken()
        short_timer_slack()
        try:
            while serving():
                if held():
                    self._pause()
                learner = consumer.poll(min(spin_ns, 4 * gap) if flowing and gap < SPIN_PAYS_NS else 0)
                if learner < 0:
                    self._beat()
                    idle = time.monotonic_ns() - last
                    nap = 0 if own_core else nap_ns(gap, rings, consumer.slots)
                    if own_core and idle < DOZE_NS and doze_pays(gap, work) and token.take():
                        learner = consumer.poll(min(DOZE_NS - idle, _BEAT_NS), DOZE_SLICE_NS)
                    elif nap and idle < DOZE_NS:
                        token.give()
                        learner = consumer.poll(min(DOZE_NS - idle, _BEAT_NS), nap)
                    else:
                        token.give()
                        learner = consumer.sleep(WAIT_SLICE)
                    flowing = learner >= 0
                    if learner < 0:
                        continue
                flowing = True
                began = time.monotonic_ns()
                self._update([self._take(learner)])
                now = time.monotonic_ns()
                work += (now - began - work) // 8
                gap += (min(now - last, DOZE_NS) - gap) // 8
                last = now
                if now >= next_beat:
                    self._beat(now)
                    next_beat = now + _BEAT_NS
                    own_core = consumer.learner_threads() + 1 <= self._cores and runnable() <= self._cores
                    rings = consumer.attached()
                    spin_ns = self.spin_ns if own_core else 0
        finally:
            token.close()

    def _serve_rounds(self) -> None:
        """sync: one update per round of one gradient from every live learner."""
        serving, held = self._state.serving, self._hold.requested
        consumer = self._consumer
        drop_ns = int(self.rule_options.drop_after * 1e9)
        next_beat = 0
        while serving():
            if held():
                self._pause()
            members = self._members(drop_ns)
            taken: dict[int, Gradient] = {}
            while True:
                for learner in members:
                    if learner not in taken and consumer.pending(learner):
                        taken[learner] = self._take(learner)
                # The round holds every live learner, also one that attached meanwhile (looked
                # at after taking, so a learner that saw it active before pushing is in); one
                # that stopped beating is left out.
                live = self._members(drop_ns)
                for learner in sorted(set(members) - set(live) - set(taken)):
                    if self._entries[learner].get("state") == ACTIVE:  # not one that is leaving
                        log.warning("job %r: learner %d left out of the round: no heartbeat for %g s or gone",
                                    self.job, learner, self.rule_options.drop_after)
                members = sorted(set(taken) | set(live))
                waiting = [m for m in members if m not in taken]
                if not waiting or not serving():
                    break
                if any(consumer.pending(m) for m in waiting):
                    continue
                if held():
                    self._pause()  # between rounds' updates the weights are whole
                self._beat()
                consumer.sleep(WAIT_SLICE)
            if taken:
                self._update(list(taken.values()))
                if time.monotonic_ns() >= next_beat:  # rounds that never wait still beat (and audit)
                    self._beat()
                    next_beat = time.monotonic_ns() + _BEAT_NS
            else:
                self._beat()
                consumer.sleep(WAIT_SLICE)

    def _members(self, drop_ns: int) -> list[int]:
        """Learners that take part in the next sync round: attached, active, beating."""
        return [i for i, entry in enumerate(self._entries)
                if self._consumer.owned(i) and entry.get("state") == ACTIVE and self._fresh(i, drop_ns)]

    def _fresh(self, learner: int, drop_ns: int) -> bool:
        entry = self._entries[learner]
        if time.monotonic_ns() - entry.get("beat") > drop_ns:
            return False
        return self._consumer.pending(learner) or owner_alive(self.region, learner)

    def _drain(self, grace: float) -> int:
        """Apply what is published until no live learner remains or `grace` passes; learners left."""
        deadline = Deadline(grace)
        consumer = self._consumer
        while True:
            if self._hold.requested():
                self._pause()
            learner = consumer.poll(0)
            if learner >= 0:
                self._update([self._take(learner)])
                continue
            busy = consumer.busy_entries()
            if not busy:
                # A learner that died after the poll above published everything before it
                # died: look once more, or its last gradient would never be applied.
                if consumer.poll(0) >= 0:
                    continue
                return 0
            if deadline.expired():
                log.warning("job %r: %d learners still attached after %g s of stopping", self.job, len(busy), grace)
                return len(busy)
            self._beat()
            consumer.sleep(deadline.slice(WAIT_SLICE))

    def _take(self, learner: int) -> Gradient:
        """The oldest published gradient of `learner`'s ring (not yet handed back), with the
        staleness it will be applied at."""
        slot = self._consumer.take(learner)  # checks the ring's head - tail
        version = self._clock.get()
        self._check_version(version)
        return self.update_rule.format.take(learner, slot, version)  # checks the slot's header and row counts

    def _update(self, grads: list[Gradient]) -> None:
        """One update from `grads`: apply, bump the version, record statistics, hand the slots back."""
        bound = self.rule_options.stale_bound
        late = [g for g in grads if g.staleness > bound and not g.move] if bound else None
        if late:
            for grad in late:
                self.update_rule.format.discard(grad.payload)  # later than the bound: never applied
                self._entries[grad.learner].add("discarded", 1)
                self._consumer.release(grad.learner)
            grads = [g for g in grads if g.staleness <= bound or g.move]
        finite = []
        for grad in grads:  # one read-only pass over each slot (native, GIL released) before it is applied
            bad = self.update_rule.format.nonfinite(grad)
            if bad:
                self._refuse(grad, bad)
            else:
                finite.append(grad)
        grads = finite
        if not grads:
            return
        moved = sum(self.update_rule.format.bytes_in(g) for g in grads)
        if self.update_rule.seqlock:
            self._clock.begin_update()  # seq odd: an update is running
        try:
            for grad in grads:
                if grad.move:  # a bridge's move lands as sent, outside the update rule
                    self.update_rule.move(grad)
            self.update_rule.apply([g for g in grads if not g.move])
            self._clock.bump()
            self._version += 1
        finally:
            if self.update_rule.seqlock:
                self._clock.end_update()  # seq even: the weights are whole again
        self._bytes_word.add(moved)
        for grad in grads:
            entry = self._entries[grad.learner]
            entry.add("stale_sum", grad.staleness)
            if grad.staleness > entry.get("stale_max"):
                entry.set("stale_max", grad.staleness)
            entry.add_bucket("stale_hist", min(grad.staleness.bit_length(), HIST_BUCKETS - 1), 1)
            entry.add("applied_samples", grad.samples)
            self._applied_word.add(1)
            self._applied += 1
            self._consumer.release(grad.learner)
        if self.first_applied is None:
            self.first_applied = time.time()
        self._clock.wake_if_waited()

    def _refuse(self, grad: Gradient, bad: int) -> None:
        """A gradient with `bad` NaN or infinite values: stop the job, or skip it and count it."""
        what = (f"learner ring {grad.learner}: a {'move' if grad.move else 'gradient'} with {bad:,} non-finite "
                f"value{'s' if bad != 1 else ''} (NaN or inf)")
        if self.rule_options.nonfinite == "stop":
            raise NonFiniteGradient(f"job {self.job!r}: {what}; nonfinite is 'stop' (--nonfinite stop, [train] "
                                    "nonfinite = 'stop')")
        self.update_rule.format.discard(grad.payload)
        skipped = self._skipped_word.add(1) + 1
        if skipped & (skipped - 1) == 0:  # the 1st, 2nd, 4th, 8th ...: a diverging job does not flood the log
            log.warning("job %r: %s: skipped, not applied; %s such gradients skipped so far", self.job, what,
                        f"{skipped:,}")
        self._consumer.release(grad.learner)

    def _pause(self) -> None:
        """A checkpointer asked for a hold: stay between two updates until it lets go (at most
        `protocol.hold_limit` seconds, 2 s for a small job: the server never waits on anyone for
        long; see `protocol.ServerHold`)."""
        self._hold.pause(self._check_hold, self._beat)

    def _beat(self, now: int | None = None) -> None:
        """Beat, and audit the header at most once per BEAT_INTERVAL (a server that catches up
        with every gradient beats before each sleep: that must stay one store)."""
        now = time.monotonic_ns() if now is None else now
        self._beat_word.store(now)
        if now >= self._next_audit:
            self._next_audit = now + _BEAT_NS
            self._audit()

    # ------------------------------------------------------------------ results and lifetime

    @property
    def version(self) -> int:
        return self.region.header.get("version")

    def weights(self) -> np.ndarray:
        """A copy of the current weights."""
        return np.array(self.region.weights, copy=True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current weights as a state dict that the job's model class loads.

        Raises:
            RuntimeError: no model was recorded yet (no learner uploaded one).
        """
        spec = self.region.read_spec()
        if spec is None:
            raise RuntimeError(f"job {self.job!r}: no model was recorded in the region yet")
        return params.state_dict(spec, self.region.weights)

    def save(self, path: str, private: bool = True) -> None:
        """Write the current weights as a state dict that `torch.load(path, weights_only=True)` reads,
        mode 0600 whatever the umask (`private` False: the umask decides)."""
        params.save(self.state_dict(), path, private=private)
        log.info("job %r: saved weights of version %s to %s", self.job, f"{self.version:,}", path)

    def write_checkpoint(self, folder: str, keep: int = 3):
        """Write a checkpoint of the job now (between two updates: call it from the serving
        thread, e.g. after `serve` returned) into `folder`, keeping the last `keep`; its path.

        Raises:
            CheckpointError: the folder cannot be written (nothing is left half-written).
        """
        return take_checkpoint(self.region, folder, keep=keep, still=True).path

    def close(self) -> None:
        """Mark the job stopped, wake every waiter, unlink and unmap the region."""
        if self._closed:
            return
        self._closed = True
        self._state.finish()  # a failed job stays failed for its supervisor to see
        self._consumer.wake_all()
        self._clock.wake_all()
        drop_server_record(self.job, self._pid, self._started)
        self.region.unlink()
        self.region.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"


_IDENTITY_END = HEADER["server_pid"].offset  # the header's fields before it are written once, by the creator


def _shown(name: str, kind: str, data: bytes) -> str:
    """A header field's bytes as a person reads them (the magic in hex, numbers with separators)."""
    if kind == "u64" or kind == "u32":
        value = int.from_bytes(data, "little")
        return f"{value:#018x}" if name == "magic" else f"{value:,}"
    if kind == "f64":
        return repr(struct.unpack("<d", data)[0])
    if kind == "name":
        return repr(data.rstrip(b"\0").decode("utf-8", "replace"))
    return data.hex()


__all__ = ["Server", "ServeReport"]
