"""The learner: a user's PyTorch training loop attached to a job's region by name.

    with gadei.Learner(model, job="demo") as learner:
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            loss.backward()               # accumulates straight into a free ring slot
            learner.step(samples=len(y))  # publishes it; takes newer weights if there are any

Attaching checks the model against the region (parameter count, then each shape) before any
step, uploads the model's parameters as the initial weights if the server was started
without a model, and claims one ring. `step` raises `JobStopped` once the job is stopped,
which ends the `with` block quietly; on leaving, the learner's last gradients are applied
and the model keeps a private copy of the final weights.

What `step` does depends on the job's mode (set by the server; see `gadei.modes`):
async/consistent push and go on; with a staleness bound K they first check that the
gradient cannot be applied more than K versions late (else it is dropped and counted), and
a learner that far behind waits until the server settled its own ring; sync waits for the round's new version; elastic
takes a local SGD step and, every tau steps, exchanges weights with the centre.
"""

import logging
import os
import time

import torch

from . import _proc, params
from . import device as _device
from .env import openmp_policy, settings
from .errors import GadeiTimeout, JobFailed, JobStopped, RegionMismatch, ServerGone
from .layout import INIT_EMPTY, INIT_READY, INIT_WRITING, LEAVING, STOPPED, TRAIN_STOPS
from .protocol import WAIT_SLICE, Deadline, RunState, TrainStop, Version
from .region import Region
from .modes import read_options
from .ring import claim
from .transport import PULLS, PUSHES

log = logging.getLogger(__name__)


class Learner:
    """One learner of a job: trains `model` against the job's shared weights.

    Args:
        model: a PyTorch module with float32 parameters, built like the job's model.
        job: the job name.
        pull: 'view' (the parameters are views of the shared weights: Hogwild, no copies)
            or 'copy' (a pull thread copies new weights, swapped in between steps, so the
            weights do not change during a forward/backward pass). Default: 'view', but
            'copy' in consistent mode and 'local' (a private model) in elastic mode.
        push: 'publish' (`.grad` are views of the ring slot: no copies) or 'thread' (private
            gradients and a push thread that writes them into the ring). Default: 'publish',
            and 'weights' in elastic mode.
        device: where the model trains: 'cpu', 'cuda' or 'cuda:N' (the model is moved there),
            default the device of the model's first parameter. A CUDA learner uses the device
            transports (pull and push 'device': staging buffers on the GPU, copy streams, a
            page-locked region); a CPU learner may choose them too. CUDA on a machine without
            it raises DeviceError at once.
        timeout: seconds to wait for the job's region and initial weights (default:
            GADEI_ATTACH_TIMEOUT).
        upload: upload this model's parameters when the region holds no weights yet.
        entry: the learner entry (ring, and the learner's number in logs and `gadei status`)
            to take when it is free or its owner died; else, and by default, the first free.
    """

    def __init__(self, model: torch.nn.Module, job: str, *, pull: str | None = None, push: str | None = None,
                 device: str | torch.device | None = None, timeout: float | None = None, upload: bool = True,
                 entry: int | None = None):
        if pull is not None and pull not in PULLS:
            raise ValueError(f"pull={pull!r} is not one of {sorted(PULLS)}")
        if push is not None and push not in PUSHES:
            raise ValueError(f"push={push!r} is not one of {sorted(PUSHES)}")
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else "cpu"
        self.device = _device.resolve(device)  # DeviceError now, before anything is attached
        self.model = model
        self.job = job
        self.pull_mode = pull
        self.push_mode = push
        env = settings()
        self.timeout = env.attach_timeout if timeout is None else float(timeout)
        self._server_timeout_ns = int(env.server_timeout * 1e9)
        self.upload = upload
        self.prefer_entry = entry
        self.steps = 0
        self._last_pulled = 0
        self.region: Region | None = None
        self._push = self._pull = self._producer = None
        self._forward_hook = None

    # ------------------------------------------------------------------ attach

    def attach(self) -> "Learner":
        """Attach to the job, check the model, claim a ring; `with Learner(...)` calls this."""
        if any(p.device != self.device for p in self.model.parameters()):
            self.model.to(self.device)
        params.check_model(self.job, self.model, self.device)
        spec = params.spec_of(self.model)
        region = Region.attach(self.job, wait=self.timeout)
        self.region = region
        try:
            h = region.header
            self._state = RunState(region)
            if not self._state.serving():
                raise self._state.not_serving(self.job)
            region.expect(n_params=params.count(spec))
            self.mode = region.shape.mode
            self.options = read_options(region)
            self.pull_mode, self.push_mode = _transports(self.job, self.mode, self.pull_mode, self.push_mode,
                                                         self.device)
            self._ensure_weights(spec)
            renamed = params.compare(self.job, spec, region.read_spec(), region.shape.n_params)
            if renamed:
                log.warning("job %r: parameter names differ from the region's: %s", self.job, ", ".join(renamed[:5]))
            self._server_beat = h.word("server_beat")
            self._train_stop = TrainStop(region)
            self._server = (h.get("server_pid"), h.get("server_start"))
            self._producer = claim(region, drain_timeout=self.timeout, server_alive=self._server_alive,
                                   prefer=self.prefer_entry)
            self.entry = region.entry(self._producer.learner)
            self._beat = self.entry.word("beat")
            parameters = list(self.model.parameters())
            self._pull = PULLS[self.pull_mode](region, parameters, spec, self._record_pull,
                                               consistent=self.mode == "consistent")
            self._pull.start()
            if self.pull_mode == "view":
                # A forward pass reads the weights as they are when it runs: the version then is the
                # one its gradient is computed on (not the one at the last step, or at attach).
                self._forward_hook = self.model.register_forward_pre_hook(self._forward_starts)
            self._push = PUSHES[self.push_mode](region, self._producer, parameters, spec, self._on_slice,
                                                self.options)
            self._push.bind()
            self._clock = Version(region)
            helpers = (self.push_mode in ("thread", "device")) + (self.pull_mode in ("copy", "device"))
            self.entry.set("threads", torch.get_num_threads() + helpers)
            self.entry.set("device", 0 if self.device.type == "cpu" else self.device.index + 1)
        except BaseException:
            self._teardown(drain=False)
            raise
        log.info("job %r: learner %d attached (pid %d, %s, %d PyTorch thread%s, OpenMP wait policy: %s, pull %s, "
                 "push %s)", self.job, self.learner_id, os.getpid(), self.device, torch.get_num_threads(),
                 "s" if torch.get_num_threads() != 1 else "", openmp_policy(), self.pull_mode, self.push_mode)
        return self

    def _ensure_weights(self, spec) -> None:
        """Upload the model's parameters if the region holds none yet; else wait until it does."""
        h = self.region.header
        deadline = Deadline(self.timeout)
        while True:
            word = h.get("init")
            state, pid = word & 0xFFFFFFFF, word >> 32
            if state == INIT_READY:
                return
            if state == INIT_EMPTY and self.upload and h.cas("init", word, os.getpid() << 32 | INIT_WRITING):
                self.region.write_spec(spec)
                params.flatten_into(self.model, self.region.weights)
                h.set("init", INIT_READY)
                log.info("job %r: uploaded this model's parameters as the initial weights", self.job)
                return
            if state == INIT_WRITING and not _proc.running(pid):
                h.cas("init", word, INIT_EMPTY)  # the uploader died half way; someone uploads again
                continue
            if deadline.expired():
                why = "no learner with upload=True attached" if state == INIT_EMPTY else "the upload did not finish"
                raise GadeiTimeout(f"job {self.job!r}: waited {self.timeout:g} s for initial weights: {why}")
            time.sleep(0.01)

    # ------------------------------------------------------------------ training

    @property
    def learner_id(self) -> int:
        """This learner's entry (and ring) number in the region."""
        return self._producer.learner

    @property
    def version(self) -> int:
        """The weights version the model computes with now (after leaving: the final one)."""
        return self._pull.version() if self._pull is not None else self._last_pulled

    @property
    def stopped(self) -> bool:
        """True once the job is stopping or stopped."""
        return self.region is None or not self._state.serving()

    def step(self, samples: int = 1) -> None:
        """Push the gradient that backward left in `.grad`; take newer weights if there are any.

        Args:
            samples: the mini-batch size the gradient came from (for statistics).

        Raises:
            JobStopped: the job is stopping or stopped (ends a `with Learner(...)` block quietly).
            JobFailed: the server stopped the job as failed; the message says why (a `with`
                block lets it through).
            ServerGone: the server died while this learner waited for ring space.
        """
        if self._push is None:
            raise RuntimeError(f"job {self.job!r}: learner is not attached; use `with Learner(...)`")
        if not self._state.serving():
            raise self._state.not_serving(self.job)
        computed_on = self._pull.version()
        bound = self.options.stale_bound
        ahead = self._ahead() + self._push.pending if bound else 0
        if bound and ahead - computed_on > bound:
            self._push.discard()  # applied now, it would be more than `bound` versions late
            self.entry.add("dropped", 1)
            published = False
        else:
            published = self._push.push(computed_on, self.steps, int(samples))
        self.steps += 1
        self.entry.add("samples", int(samples))
        self._beat.store(time.monotonic_ns())
        if self.mode == "sync" and published:
            self._await_version(computed_on)  # the round this gradient belongs to was applied
            self._pull.refresh()
        else:
            self._pull.between_steps()
        if bound:
            self._catch_up(ahead + published, bound)
        if self._pull.retries:
            self.entry.add("pull_retries", self._pull.retries)
            self._pull.retries = 0

    def _ahead(self) -> int:
        """The version a gradient published now may be applied at, at the latest.

        Every gradient published before it (P, all rings) may be applied first, and the
        server, taking the rings round-robin, may apply one more from each of the other L - 1
        attached rings before it reaches this one: P + L - 1. A gradient computed on version
        v would be that minus v versions late. (The caller adds the gradients its push thread
        still holds, `Push.pending`: they reach the ring before this one.)
        """
        heads, owned = self._producer.published_everywhere()
        return heads + owned - 1

    def _catch_up(self, ahead: int, bound: int) -> None:
        """A learner too far behind blocks until the server settled (applied or discarded) what
        it published, then takes the newest weights.

        It waits for its own ring only, which the server reaches in bounded time (it takes the
        rings round-robin): waiting until the whole job had fewer gradients in flight could
        starve a slow learner behind fast ones that keep their rings full.
        """
        if ahead - self._clock.get() <= bound:  # `ahead` as of this step's push
            return
        self._producer.drain(self.timeout, self._waiting_on_server)
        self._pull.refresh()

    def _await_version(self, version: int) -> None:
        """Block until the weights' version is past `version` (sync mode: the round was applied)."""
        while self._clock.get() <= version:
            self._wait_version_change(version)

    def _wait_version_change(self, version: int) -> None:
        self._clock.wait_change(version, WAIT_SLICE)
        self._on_slice()

    @property
    def constraint_lr(self) -> float | None:
        """The learning rate a model's constraint correction may count on (the server applies
        ``w -= lr * g`` exactly), or None where the update is not that (Adagrad scales each
        weight's step, so a correction would not be a projection)."""
        return self.options.lr if self.options.optimizer == "sgd" and not self.options.momentum else None

    def refresh(self) -> None:
        """Copy the latest weights into the model now (e.g. before evaluating)."""
        self._pull.refresh()

    @property
    def training_ended(self) -> int:
        """The job's training decision: `layout.TRAIN_ON` (0) while training goes on, else why
        it ended (`layout.TRAIN_STOP_PATIENCE`). One learner decides (`end_training`); every
        learner reads it between steps and ends its schedule when it is not 0."""
        return self._train_stop.get()

    def end_training(self, reason: int, why: str = "") -> bool:
        """Decide, for every learner of the job, that training ends (`reason`: a
        `layout.TRAIN_STOP_*`; `why`: the same in words for the log, by default
        `layout.TRAIN_STOPS`): set once (compare-and-swap from TRAIN_ON, so the first decision
        stands), with the version it was decided at. The learners end their schedules at their
        next step, leave, and the job's supervisor stops the job as finished. Whether this call
        decided it."""
        if not self._train_stop.decide(reason, self.version):
            return False
        log.info("job %r: learner %d ended the job's training at version %s: %s", self.job, self.learner_id,
                 f"{self.version:,}", why or TRAIN_STOPS.get(reason, f"reason {reason}"))
        return True

    def _record_pull(self, version: int) -> None:
        self._last_pulled = version
        self.entry.set("pulled_version", version)
        self.entry.add("pulls", 1)

    def beat(self) -> None:
        """Say that this learner lives while it does something other than a step (the evaluating
        learner waits for its evaluation, which may be writing a large best.pt): its supervisor
        reports a learner that has not beaten for a while as hung."""
        self._beat.store(time.monotonic_ns())

    def _server_alive(self) -> bool:
        return _proc.alive(*self._server)

    def _on_slice(self) -> None:
        """Called every wait slice while blocked: beat, and end the wait if the job or server ended."""
        self._beat.store(time.monotonic_ns())
        if not self._state.serving():
            raise self._state.not_serving(self.job)
        if not self._server_alive():
            raise ServerGone(f"job {self.job!r}: server pid {self._server[0]} is gone")
        silent = time.monotonic_ns() - self._server_beat.load()
        if silent > self._server_timeout_ns:
            raise ServerGone(f"job {self.job!r}: server pid {self._server[0]} has not beaten for {silent / 1e9:.0f} s")

    # ------------------------------------------------------------------ detach

    def close(self) -> None:
        """Wait until this learner's published gradients are applied, give the ring back, detach.

        The model keeps a private copy of the latest weights.
        """
        self._teardown(drain=True)

    def _forward_starts(self, *_) -> None:
        if self._pull is not None:
            self._pull.between_steps()

    def _teardown(self, drain: bool) -> None:
        if self.region is None:
            return
        region, self.region = self.region, None
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        try:
            # Order matters: publish what the push thread holds, wait until the server applied
            # everything this learner published, and only then take the final weights.
            if self._push is not None:
                self._push.close()
            if self._producer is not None:
                self.entry.set("state", LEAVING)
                if drain and not self._producer.drain(self.timeout, self._drainable):
                    log.warning("job %r: %d gradients of learner %d were not applied before it left", self.job,
                                self._producer.pending(), self._producer.learner)
            if self._pull is not None:
                self._pull.finish()
            if self._producer is not None:
                self._producer.release()
        finally:
            self._push = self._pull = None
            region.close()
        log.info("job %r: learner left after %d steps", self.job, self.steps)

    def _waiting_on_server(self) -> bool:
        """`drain`'s check while a step waits: beat; raise if the job stopped or the server died."""
        self._on_slice()
        return True

    def _drainable(self) -> bool:
        """The server may still apply what this learner published (it drains while stopping)."""
        return self._state.get() != STOPPED and self._server_alive()

    def __enter__(self) -> "Learner":
        return self.attach()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        return exc_type is not None and issubclass(exc_type, JobStopped) and not issubclass(exc_type, JobFailed)



# The transports each mode allows a CPU learner, the default first.
_ALLOWED = {
    "async": (("view", "copy"), ("publish", "thread")),
    "consistent": (("copy",), ("publish", "thread")),
    "sync": (("view", "copy"), ("publish", "thread")),
    "elastic": (("local",), ("weights",)),
}
# A learner on a GPU: its model is not in shared memory, so only the device transports reach it.
# (A CPU learner may choose them too in these modes: their threads with synchronous copies.)
_ALLOWED_GPU = {mode: (("device",), ("device",)) for mode in ("async", "consistent", "sync")}


def _transports(job: str, mode: str, pull: str | None, push: str | None,
                device: torch.device = torch.device("cpu")) -> tuple[str, str]:
    """The (pull, push) a learner on `device` uses in `mode`; RegionMismatch for a choice the
    mode (or the device) cannot honour."""
    if device.type != "cpu" and mode not in _ALLOWED_GPU:
        raise RegionMismatch(f"job {job!r} runs in {mode} mode, which GPU learners do not support yet (elastic "
                             "learners keep a local model and push weights); train this learner on the CPU, not "
                             f"{device}")
    pulls, pushes = (_ALLOWED_GPU if device.type != "cpu" else _ALLOWED)[mode]
    pull, push = pull or pulls[0], push or pushes[0]
    if device.type == "cpu" and mode in _ALLOWED_GPU:  # accepted, not listed (tests)
        pulls, pushes = pulls + ("device",) * (pull == "device"), pushes + ("device",) * (push == "device")
    why = {"consistent": "consistent reads need copies taken inside the seqlock",
           "elastic": "elastic learners train a local model and push weights"}.get(mode, "")
    if device.type != "cpu":
        why = f"a model on {device} is reached through device staging buffers"
    if pull not in pulls:
        raise RegionMismatch(f"job {job!r} runs in {mode} mode: pull must be one of {list(pulls)}, "
                             f"not {pull!r} ({why})")
    if push not in pushes:
        raise RegionMismatch(f"job {job!r} runs in {mode} mode: push must be one of {list(pushes)}, "
                             f"not {push!r} ({why})")
    return pull, push
