"""Where a learner computes: the device it trains on, and what a GPU learner needs from the host.

A learner's device is the model's own (or `Learner(device=...)`, `gadei learn --device`, a
job file's `[train] devices`). A CUDA learner moves gradients and weights with the device
transports of `gadei.transport` (`DevicePush`, `DevicePull`): copies on streams of their own,
from and to a region that this module page-locks (cudaHostRegister) so that those copies
are DMA transfers rather than staged through pageable memory. The same transports run with
a CPU "device" (no streams, synchronous copies), which is how machines without a GPU
exercise their threads.

This module also holds the fault-injection hook of those transports' threads
(`set_injector`): tests slow the train, push and pull threads at named points with random
delays to shake out hand-off races.

torch is imported by the functions that use it: the job file's checks import this module,
and `gadei status`, `stop` and `clean` import those.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from typing import TYPE_CHECKING, Callable

from .errors import DeviceError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"(cpu|cuda(:[0-9]+)?)")
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process

_injector: Callable[[str], None] | None = None


def cuda_count() -> int:
    """CUDA GPUs visible to this process (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve(device: str | torch.device) -> torch.device:
    """The device `device` names, checked against this machine ('cuda' is 'cuda:0').

    Raises:
        DeviceError: not a device name, CUDA asked for on a machine without it, or a GPU
            index that is not visible.
    """
    import torch

    text = str(device)
    if not _NAME.fullmatch(text):
        raise DeviceError(f"device {text!r}: not a device; allowed: cpu, cuda, cuda:N")
    dev = torch.device(text)
    if dev.type == "cpu":
        return dev
    count = cuda_count()
    if count == 0:
        raise DeviceError(f"device {text!r}: this machine has no usable CUDA GPU (torch {torch.__version__}: "
                          "torch.cuda.is_available() is False); use 'cpu'")
    index = dev.index or 0
    if index >= count:
        raise DeviceError(f"device {text!r}: this machine shows {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def parse_devices(text: str) -> tuple[str, ...]:
    """A job's `devices` as written ('auto', 'cpu', 'cuda:0,cuda:1', 'cpu,cuda:0'): its names,
    syntax only (`resolve` checks them against the machine).

    Raises:
        ValueError: an empty list, a name that is not a device, a device named twice.
    """
    if text.strip() == "auto":
        return ("auto",)
    import torch

    names = tuple(part.strip() for part in text.split(","))
    for name in names:
        if name == "auto":
            raise ValueError("'auto' stands alone (every visible GPU), it is not one device of a list")
        if not _NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a device")
    canonical = [str(torch.device(n)) if n != "cuda" else "cuda:0" for n in names]
    twice = sorted({n for n in canonical if canonical.count(n) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} named twice (learners are spread round-robin; more learners than "
                         "devices share them)")
    return tuple(canonical)


def choose(devices: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
    """The devices a job's learners use: 'auto' becomes every visible GPU, or the CPU where
    there is none; with a line for people saying what 'auto' chose (None: nothing chosen)."""
    if devices != ("auto",):
        return devices, None
    count = cuda_count()
    if count == 0:
        return ("cpu",), ("devices = cpu (auto: no CUDA GPU is visible on this machine, so the learners train on "
                          "the CPU)")
    chosen = tuple(f"cuda:{i}" for i in range(count))
    return chosen, f"devices = {','.join(chosen)} (auto: every visible CUDA GPU)"


def spread(devices: tuple[str, ...], learners: int) -> list[str]:
    """Learner i's device: round-robin over `devices` (more learners than devices share them)."""
    return [devices[i % len(devices)] for i in range(learners)]


def stream_context(stream):
    """`torch.cuda.stream(stream)`, or nothing for a CPU device (stream None)."""
    import torch

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class CopyTimer:
    """How long copies took: on a CUDA stream, by two events the GPU times around them (the
    copy engine's time, not the host's wait for work queued before them); on a CPU device
    (stream None), by the wall clock around the synchronous copies.

    Start it once the copies may begin, `stop()` once they are queued, and read `seconds()`
    after the stream was synchronised.
    """

    def __init__(self, stream):
        self._stream = stream
        if stream is None:
            self._started = time.perf_counter()
            return
        import torch

        self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._start.record(stream)

    def stop(self) -> None:
        if self._stream is None:
            self._seconds = time.perf_counter() - self._started
        else:
            self._end.record(self._stream)

    def seconds(self) -> float:
        if self._stream is None:
            return self._seconds
        return self._start.elapsed_time(self._end) / 1e3  # milliseconds between the two events


class PageLock:
    """Host ranges page-locked for CUDA (cudaHostRegister) until `release()`.

    Registration is best effort: where it fails (e.g. the locked-memory limit) the copies
    still work, staged through pageable memory by the driver, and a warning says so. A range
    this process registered already (another learner of the process) is left to its owner.
    """

    def __init__(self, job: str):
        self.job = job
        self._ranges: list[int] = []

    def add(self, address: int, nbytes: int, what: str) -> bool:
        """Page-lock `nbytes` at `address`; True if this object registered it (and will unregister it)."""
        import torch

        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostRegister(address, nbytes, _PORTABLE))
        if code == 0:
            self._ranges.append(address)
            return True
        _clear_cuda_error(cudart)  # else the next CUDA call would report this one's error
        if code != _ALREADY_REGISTERED:
            log.warning("job %r: could not page-lock %s (%d bytes, cudaError %d); its copies go through pageable "
                        "memory (correct, slower)", self.job, what, nbytes, code)
        return False

    def release(self) -> None:
        """Unregister every range this object registered (before the region is unmapped)."""
        import torch

        cudart = torch.cuda.cudart() if self._ranges else None
        while self._ranges:
            code = int(cudart.cudaHostUnregister(self._ranges.pop()))
            if code != 0:
                _clear_cuda_error(cudart)
                log.warning("job %r: cudaHostUnregister failed (cudaError %d)", self.job, code)


def _clear_cuda_error(cudart) -> None:
    get_last = getattr(cudart, "cudaGetLastError", None)
    if get_last is not None:
        get_last()


def set_injector(injector: Callable[[str], None] | None) -> None:
    """Call `injector(point)` at each named point of the device transports' threads (tests:
    random delays); None turns it off. Points: 'train.stage', 'train.swap' (train thread),
    'push.copy', 'push.publish' (push thread), 'pull.copy', 'pull.staged' (pull thread)."""
    global _injector
    _injector = injector


def inject(point: str) -> None:
    """The injection point `point` (nothing unless a test set an injector)."""
    if _injector is not None:
        _injector(point)
