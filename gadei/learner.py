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
"""

import logging
import os
import time

import psutil
import torch

from . import _native, _proc, params
from .env import settings
from .errors import GadeiTimeout, JobStopped, ServerGone
from .layout import INIT_EMPTY, INIT_READY, INIT_WRITING, LEAVING, RUN_STATES, SERVING, STOPPED
from .region import Region
from .ring import claim
from .transport import PULLS, PUSHES

log = logging.getLogger(__name__)


class Learner:
    """One learner of a job: trains `model` against the job's shared weights.

    Args:
        model: a PyTorch module with float32 CPU parameters, built like the job's model.
        job: the job name.
        pull: 'view' (the parameters are views of the shared weights: Hogwild, no copies)
            or 'copy' (a pull thread copies new weights, swapped in between steps, so the
            weights do not change during a forward/backward pass).
        push: 'publish' (`.grad` are views of the ring slot: no copies) or 'thread' (private
            staging buffers and a push thread that copies them into the ring).
        timeout: seconds to wait for the job's region and initial weights (default:
            GADEI_ATTACH_TIMEOUT).
        upload: upload this model's parameters when the region holds no weights yet.
    """

    def __init__(self, model: torch.nn.Module, job: str, *, pull: str = "view", push: str = "publish",
                 timeout: float | None = None, upload: bool = True):
        if pull not in PULLS:
            raise ValueError(f"pull={pull!r} is not one of {sorted(PULLS)}")
        if push not in PUSHES:
            raise ValueError(f"push={push!r} is not one of {sorted(PUSHES)}")
        self.model = model
        self.job = job
        self.pull_mode = pull
        self.push_mode = push
        env = settings()
        self.timeout = env.attach_timeout if timeout is None else float(timeout)
        self._server_timeout_ns = int(env.server_timeout * 1e9)
        self.upload = upload
        self.steps = 0
        self._last_pulled = 0
        self.region: Region | None = None
        self._push = self._pull = self._producer = None

    # ------------------------------------------------------------------ attach

    def attach(self) -> "Learner":
        """Attach to the job, check the model, claim a ring; `with Learner(...)` calls this."""
        params.check_model(self.job, self.model)
        spec = params.spec_of(self.model)
        region = Region.attach(self.job, wait=self.timeout)
        self.region = region
        try:
            h = region.header
            if h.get("run_state") != SERVING:
                raise JobStopped(f"job {self.job!r} is {RUN_STATES.get(h.get('run_state'), '?')}, not serving")
            region.expect(n_params=params.count(spec), grad_dtype="float32")
            self._ensure_weights(spec)
            renamed = params.compare(self.job, spec, region.read_spec(), region.shape.n_params)
            if renamed:
                log.warning("job %r: parameter names differ from the region's: %s", self.job, ", ".join(renamed[:5]))
            self._state_addr = h.addr("run_state")
            self._server_beat_addr = h.addr("server_beat")
            self._server = (h.get("server_pid"), h.get("server_start"))
            self._producer = claim(region, drain_timeout=self.timeout, server_alive=self._server_alive)
            self.entry = region.entry(self._producer.learner)
            self._beat_addr = self.entry.addr("beat")
            parameters = list(self.model.parameters())
            self._pull = PULLS[self.pull_mode](region, parameters, spec, self._record_pull)
            self._pull.start()
            self._push = PUSHES[self.push_mode](region, self._producer, parameters, spec, self._on_slice)
            self._push.bind()
            helpers = (self.push_mode == "thread") + (self.pull_mode == "copy")
            self.entry.set("threads", torch.get_num_threads() + helpers)
        except BaseException:
            self._teardown(drain=False)
            raise
        log.info("job %r: learner %d attached (pid %d, pull %s, push %s)", self.job, self.learner_id,
                 os.getpid(), self.pull_mode, self.push_mode)
        return self

    def _ensure_weights(self, spec) -> None:
        """Upload the model's parameters if the region holds none yet; else wait until it does."""
        h = self.region.header
        deadline = time.monotonic() + self.timeout
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
            if state == INIT_WRITING and not psutil.pid_exists(pid):
                h.cas("init", word, INIT_EMPTY)  # the uploader died half way; someone uploads again
                continue
            if time.monotonic() >= deadline:
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
        return self.region is None or _native.load32(self._state_addr) != SERVING

    def step(self, samples: int = 1) -> None:
        """Push the gradient that backward left in `.grad`; take newer weights if there are any.

        Args:
            samples: the mini-batch size the gradient came from (for statistics).

        Raises:
            JobStopped: the job is stopping or stopped (ends a `with Learner(...)` block quietly).
            ServerGone: the server died while this learner waited for ring space.
        """
        if self._push is None:
            raise RuntimeError(f"job {self.job!r}: learner is not attached; use `with Learner(...)`")
        if _native.load32(self._state_addr) != SERVING:
            raise JobStopped(f"job {self.job!r} was stopped")
        self._push.push(self._pull.version(), self.steps, int(samples))
        self.steps += 1
        self.entry.add("samples", int(samples))
        _native.store64(self._beat_addr, time.monotonic_ns())
        self._pull.between_steps()

    def refresh(self) -> None:
        """Copy the latest weights into the model now (e.g. before evaluating)."""
        self._pull.refresh()

    def _record_pull(self, version: int) -> None:
        self._last_pulled = version
        self.entry.set("pulled_version", version)
        self.entry.add("pulls", 1)

    def _server_alive(self) -> bool:
        return _proc.alive(*self._server)

    def _on_slice(self) -> None:
        """Called every wait slice while blocked: beat, and end the wait if the job or server ended."""
        _native.store64(self._beat_addr, time.monotonic_ns())
        if _native.load32(self._state_addr) != SERVING:
            raise JobStopped(f"job {self.job!r} was stopped")
        if not self._server_alive():
            raise ServerGone(f"job {self.job!r}: server pid {self._server[0]} is gone")
        silent = time.monotonic_ns() - _native.load64(self._server_beat_addr)
        if silent > self._server_timeout_ns:
            raise ServerGone(f"job {self.job!r}: server pid {self._server[0]} has not beaten for {silent / 1e9:.0f} s")

    # ------------------------------------------------------------------ detach

    def close(self) -> None:
        """Wait until this learner's published gradients are applied, give the ring back, detach.

        The model keeps a private copy of the latest weights.
        """
        self._teardown(drain=True)

    def _teardown(self, drain: bool) -> None:
        if self.region is None:
            return
        region, self.region = self.region, None
        try:
            # Order matters: publish what the push thread holds, wait until the server applied
            # everything this learner published, and only then take the final weights.
            if self._push is not None:
                self._push.close()
            if self._producer is not None:
                self.entry.set("state", LEAVING)
                if drain and not self._producer.drain(self.timeout, self._drainable):
                    log.warning("job %r: %d gradients of learner %d were not applied before it left", self.job,
                                self._producer.head - self._producer.tail(), self._producer.learner)
            if self._pull is not None:
                self._pull.finish()
            if self._producer is not None:
                self._producer.release()
        finally:
            self._push = self._pull = None
            region.close()
        log.info("job %r: learner left after %d steps", self.job, self.steps)

    def _drainable(self) -> bool:
        """The server may still apply what this learner published (it drains while stopping)."""
        return _native.load32(self._state_addr) != STOPPED and self._server_alive()

    def __enter__(self) -> "Learner":
        return self.attach()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close()
        return exc_type is not None and issubclass(exc_type, JobStopped)

