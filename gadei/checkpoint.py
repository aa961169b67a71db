"""Crash-safe checkpoint files of a job: where the job's supervisor puts what a restart needs.

A checkpoint is one file, `ckpt-<n>.pt` in the job's checkpoint folder (n counts up with
every checkpoint written there), that plain PyTorch reads without running pickled code:

    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])

It holds the weights as a state dict (`model`), the version they are at and the gradients
applied, the server's optimiser state (`optimizer`: the momentum buffer, Adagrad's sums or
Adam's two moments where the job keeps them; EASGD's centre is the weights themselves),
every learner's counters and the job's configuration (both JSON text), the progress of the
learners a supervisor launched (`progress`: samples of each one's schedule that the weights
hold, or "done"), and a CRC-32 `checksum` over all of it (SHA-256 in files of format 1, which are
still read).

Writing is crash safe: the file is written under a temporary name (`gadei.files.temporary`),
flushed and fsync'ed, given its final name by a hard link (atomic, and a name another writer
took is never replaced), and the folder is fsync'ed, so a crash at any instant leaves either no
new checkpoint or a whole one; the next writer removes what a killed one left. Only the last
`keep` are kept. Reading verifies the checksum; `latest()` skips a checkpoint that fails it
(with a warning) for the one before.

torch is imported by the functions that need it, not with the module: the supervisor's package
imports this one, and `gadei status`, `stop` and `clean` import that. A supervisor started cold
imports it on a thread as the job starts (`import_torch_now`), not at its first checkpoint.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import files
from .errors import GadeiError
from .options import option

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FORMAT = "gadei-checkpoint"
FORMAT_VERSION = 2  # the version written; 1 (a SHA-256 checksum) is read as well (`_DIGESTS`)
_NAME = re.compile(r"^ckpt-(\d{6,})\.pt$")


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """When a job's supervisor takes checkpoints and how many it keeps (a job file's [checkpoint];
    `gadei serve --checkpoint-every --keep`)."""

    interval: float = option(60.0, "seconds between two checkpoints", low=0, low_open=True, high=10**9)
    keep: int = option(3, "checkpoints kept", low=1, high=10**6)


class CheckpointError(GadeiError):
    """A checkpoint could not be written, or a file is not a whole, valid checkpoint."""


@dataclasses.dataclass
class Checkpoint:
    """What a job needs to go on from where it was.

    Attributes:
        job: the job's name.
        version: the weights' version (updates applied to them, ever).
        applied: gradients the server applied, ever.
        model: the weights, parameter name -> float32 tensor (a state dict).
        optimizer: the server's optimiser state, name -> float32 tensor of n_params
            (`momentum`, `adagrad_sums`, or Adam's `adam_m` and `adam_v`; Adam's step is the
            version).
        config: the job's configuration (shape, mode, options), JSON-compatible.
        learners: each learner entry's counters, JSON-compatible.
        progress: for each learner the supervisor launched (by its number, as text): the
            samples of its schedule whose gradients the weights hold, or "done".
        created: when it was taken (seconds since the epoch).
        path: the file it was read from or written to.
    """

    job: str
    version: int
    applied: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    config: dict = dataclasses.field(default_factory=dict)
    learners: list[dict] = dataclasses.field(default_factory=list)
    progress: dict[str, int | str] = dataclasses.field(default_factory=dict)
    created: float = dataclasses.field(default_factory=time.time)
    path: Path | None = None

    def checksum(self, format_version: int = FORMAT_VERSION) -> str:
        """A digest of every field but `path`, in a fixed order: CRC-32 ("crc32:" and 8 hex
        digits), or SHA-256 for a file of format 1. It finds a damaged or partial file, as a
        zip's CRC-32 does, and signs nothing: a cryptographic hash was the larger part of a
        large checkpoint's save and load for no gain."""
        digest = _DIGESTS[format_version]()
        for group in (self.model, self.optimizer):
            for name in sorted(group):
                tensor = group[name].detach().contiguous().cpu()
                digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
                digest.update(tensor.numpy().reshape(-1).view(np.uint8))  # its bytes, not a copy of them
        digest.update(self._meta().encode())
        return digest.hexdigest()

    def _meta(self) -> str:
        return json.dumps({"job": self.job, "version": self.version, "applied": self.applied,
                           "config": self.config, "learners": self.learners, "progress": self.progress,
                           "created": self.created},
                          sort_keys=True)

    def to_dict(self) -> dict:
        """The file's contents: tensors and plain values only (what `weights_only` loads)."""
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, "job": self.job, "version": self.version,
            "applied": self.applied, "created": self.created, "model": self.model, "optimizer": self.optimizer,
            "config": json.dumps(self.config, sort_keys=True), "learners": json.dumps(self.learners),
            "progress": json.dumps(self.progress, sort_keys=True), "checksum": self.checksum(),
        }

    def flat_weights(self, spec: list[tuple[str, tuple[int, ...]]]) -> np.ndarray:
        """The weights as one float32 array laid out by `spec` (the region's order).

        Raises:
            CheckpointError: the checkpoint's parameters differ from `spec` (names the first).
        """
        import torch

        parts = []
        for name, shape in spec:
            tensor = self.model.get(name)
            if tensor is None or tuple(tensor.shape) != tuple(shape):
                found = "missing" if tensor is None else f"shape {tuple(tensor.shape)}"
                raise CheckpointError(f"checkpoint {self.path}: parameter {name!r} is {found}, the job has "
                                      f"shape {tuple(shape)}")
            parts.append(tensor.detach().reshape(-1).to(torch.float32).numpy())
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def import_torch_now() -> None:
    """Import torch on a thread of its own, where this process has not yet (a supervisor started
    cold, by `gadei serve --checkpoint-dir`). `capture` needs it, and its first import takes
    seconds: 2 s on a busy 2-core machine, which put a job's first checkpoint at twice its
    interval (a server killed in between restarted from the initial weights). A warm process
    has it already, and starts no thread (one that forks must run one thread alone)."""
    if "torch" not in sys.modules:
        threading.Thread(target=__import__, args=("torch",), name="gadei import torch", daemon=True).start()


def take(region, folder: str | os.PathLike, keep: int = 3, *, still: bool = False, progress=None) -> Checkpoint:
    """Capture the job's state between two updates, write it to `folder` (keeping the last
    `keep`) and record its version in the region. `still`: nothing updates the region now
    (the caller is the server, between two updates), so no hold is asked for. `progress`:
    called with the captured checkpoint (still under the hold) to fill its `progress`.
    Raises CheckpointError as `capture` and `save` do."""
    if still:
        _check(region)
    taken = _copy(region) if still else capture(region, progress=progress)
    if still and progress is not None:
        taken.progress = progress(taken)
    save(folder, taken, keep=keep)
    region.header.set("checkpointed_version", taken.version)
    return taken


def capture(region, timeout: float = 5.0, progress=None) -> Checkpoint:
    """A whole copy of a job's state from its region, taken between two updates.

    With the server running, this asks it for a hold (it pauses between two updates, at
    most `protocol.hold_limit` seconds), copies while it holds, and lets it go: the server stalls
    for the time of the copy. With the server stopped (or not yet serving) nothing changes
    the weights, and the copy is taken as it is. A server that died while serving may have
    died within an update (the weights hold it, the learners' counters do not), so its
    region is not copied: a restart goes on from the checkpoint taken before.

    Raises:
        CheckpointError: another checkpoint holds the server, the server died while serving,
            did not pause within `timeout`, or went on before the copy was done.
    """
    import torch  # noqa: F401  (here, not under the hold: a first import takes seconds the server would stand still)

    from .layout import SERVING, STOPPING
    from .protocol import RunState, hold_and_copy

    h = region.header
    def whole() -> Checkpoint:
        _check(region)
        copy = _copy(region)
        if progress is not None:
            copy.progress = progress(copy)
        return copy

    if RunState(region).get() not in (SERVING, STOPPING):
        return whole()
    if not region.server_alive():
        raise CheckpointError(f"job {region.job!r}: the server (pid {h.get('server_pid')}) died while serving, maybe "
                              "within an update; no checkpoint is taken from its region")
    return hold_and_copy(region, timeout, whole, CheckpointError)


def _check(region) -> None:
    """Refuse (CheckpointError) to copy a region its server stopped as failed, or one whose rings
    or counters are outside what the protocol allows: a restart must never go on from it."""
    from .errors import RegionCorrupt
    from .layout import COUNTER_LIMIT, FAILED, RUN_STATES
    from .protocol import RunState, hold_requested
    from .ring import check_rings

    h = region.header
    state = RunState(region).get()
    if state == FAILED:
        raise CheckpointError(f"job {region.job!r}: its server stopped it as failed (see the server's log): no "
                              "checkpoint is taken of it")
    try:
        if state not in RUN_STATES:
            raise RegionCorrupt(f"job {region.job!r}: header field run_state is {state:,}, allowed "
                                f"0..{max(RUN_STATES)}")
        for name in ("version", "applied"):
            value = h.get(name)
            if value >= COUNTER_LIMIT:
                raise RegionCorrupt(f"job {region.job!r}: header field {name} is {value:,}, allowed "
                                    f"0..{COUNTER_LIMIT - 1:,}")
        hold = hold_requested(region)
        if hold > 1:
            raise RegionCorrupt(f"job {region.job!r}: header field hold is {hold:,}, allowed 0..1")
        check_rings(region)
    except RegionCorrupt as err:
        raise CheckpointError(f"{err}: the region is corrupt, no checkpoint is taken of it") from err


def _copy(region) -> Checkpoint:
    """The job's state as it is in `region` now (whole only while nothing updates it)."""
    import torch

    from . import params
    from .modes import read_options, state_names
    from .ring import counters

    h, shape = region.header, region.shape
    version, applied = h.get("version"), h.get("applied")
    state, n = region.state, shape.n_params
    names = state_names(read_options(region)) if state is not None else ()
    optimizer = {name: torch.from_numpy(np.array(state[k * n : (k + 1) * n], copy=True))
                 for k, name in enumerate(names)}
    spec = region.read_spec()
    # one copy of the weights (under the hold: a second one was a third of the server's stall)
    model = (params.state_dict(spec, region.weights) if spec else
             {"weights": torch.from_numpy(np.array(region.weights, dtype=np.float32, copy=True))})
    learners = counters(region)
    config = {
        "job": region.job, "mode": shape.mode, "n_params": shape.n_params, "grad_dtype": shape.grad_dtype,
        "learners": shape.capacity, "slots": shape.slots, "state_arrays": shape.state_arrays,
        "sparse": [[t.offset, t.rows, t.width, t.max_rows] for t in shape.sparse],
        "spec": [[name, list(dims)] for name, dims in spec] if spec else None,
        "options": dataclasses.asdict(read_options(region)),
        "resumed_applied": h.get("resumed_applied"),
    }
    return Checkpoint(job=region.job, version=version, applied=applied, model=model, optimizer=optimizer,
                      config=config, learners=learners)


def save(folder: str | os.PathLike, checkpoint: Checkpoint, keep: int = 3) -> Path:
    """Write `checkpoint` crash safely as the next `ckpt-<n>.pt` in `folder`; keep the last `keep`.

    Raises:
        CheckpointError: the folder cannot be created or written (full, read-only, not
            allowed): nothing new is left in it, and the checkpoints already there are kept.
    """
    import torch

    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep!r}")
    folder = Path(folder)
    path = folder / f"ckpt-{_next_number(folder):06d}.pt"  # its name unless another writer takes it first (_claim)
    tmp = files.temporary(folder / "ckpt.pt")  # a writer's file until it takes its name (`_claim`)
    writer = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        files.remove_orphans(folder)
        with open(tmp, "wb") as handle:
            writer = files.Writer(handle)
            torch.save(checkpoint.to_dict(), writer)
            handle.flush()
            os.fsync(handle.fileno())
        path = _claim(folder, tmp)
        files.sync_folder(folder)
    except (OSError, RuntimeError) as err:  # torch.save turns a failed write into a RuntimeError
        try:
            tmp.unlink()
        except OSError:
            pass
        cause = (writer.error if writer is not None else None) or err
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
        raise CheckpointError(f"job {checkpoint.job!r}: cannot write checkpoint {path}: {reason}") from cause
    checkpoint.path = path
    for old in listing(folder)[:-keep]:
        try:
            old.unlink()
        except OSError as err:
            log.warning("job %r: cannot remove old checkpoint %s: %s", checkpoint.job, old, err.strerror)
    log.info("job %r: checkpoint %s at version %s", checkpoint.job, path, f"{checkpoint.version:,}")
    return path


def _claim(folder: Path, tmp: Path) -> Path:
    """Give the written `tmp` the next free `ckpt-<n>.pt` name and return it. A hard link
    fails where the name exists, so two writers at once (the supervisor's periodic checkpoint,
    `gadei run`'s at a stop, the server's own) each get a name of their own; a rename would
    let the later one replace the other's checkpoint unseen."""
    number = _next_number(folder)
    while True:
        path = folder / f"ckpt-{number:06d}.pt"
        try:
            os.link(tmp, path)
        except FileExistsError:
            number += 1
            continue
        except OSError as err:
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            os.replace(tmp, path)  # a file system without hard links: as before, the last writer wins
            return path
        tmp.unlink()
        return path


def _next_number(folder: Path) -> int:
    existing = listing(folder) if folder.is_dir() else []
    return int(_NAME.match(existing[-1].name).group(1)) + 1 if existing else 1


class _Crc32:
    """zlib.crc32 behind hashlib's `update` and `hexdigest`."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"crc32:{self.value:08x}"


_DIGESTS = {1: hashlib.sha256, 2: _Crc32}  # a file's checksum by its format version


def listing(folder: str | os.PathLike) -> list[Path]:
    """The checkpoint files in `folder`, oldest first (temporary files are not listed)."""
    folder = Path(folder)
    try:
        names = [name for name in os.listdir(folder) if _NAME.match(name)]
    except FileNotFoundError:
        return []
    return [folder / name for name in sorted(names, key=lambda n: int(_NAME.match(n).group(1)))]


def load(path: str | os.PathLike, *, verify: bool = True) -> Checkpoint:
    """Read and verify one checkpoint file. `verify=False`: a look at its fields (its version
    and progress, for words such as how to go on with a stopped run), not a checkpoint to go on
    from: the file is mapped and its tensors are neither read nor checked (a large model's were
    seconds of a stopped `gadei run`'s last line).

    Raises:
        CheckpointError: the file cannot be read, is not a gadei checkpoint, or fails its
            checksum (the message says which).
    """
    import torch

    path = Path(path)
    try:
        data = torch.load(path, weights_only=True, map_location="cpu", mmap=not verify)
    except OSError as err:
        raise CheckpointError(f"checkpoint {path}: {err.strerror or err}") from err
    except Exception as err:  # a truncated or garbled file fails inside the unpickler or the zip reader
        raise CheckpointError(f"checkpoint {path} is not readable ({type(err).__name__}: {err})") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a gadei checkpoint")
    format_version = data.get("format_version")
    if format_version not in _DIGESTS:
        raise CheckpointError(f"checkpoint {path} has format version {format_version!r}, this gadei reads "
                              f"{' and '.join(map(str, _DIGESTS))}")
    try:
        checkpoint = Checkpoint(job=data["job"], version=int(data["version"]), applied=int(data["applied"]),
                                model=dict(data["model"]), optimizer=dict(data["optimizer"]),
                                config=json.loads(data["config"]), learners=json.loads(data["learners"]),
                                progress=json.loads(data.get("progress", "{}")), created=float(data["created"]),
                                path=path)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} lacks or garbles field {err}") from err
    if verify and checkpoint.checksum(format_version) != data.get("checksum"):
        raise CheckpointError(f"checkpoint {path} fails its checksum (a partial or damaged file)")
    return checkpoint


def latest(folder: str | os.PathLike, *, with_progress: bool = False, verify: bool = True) -> Checkpoint | None:
    """The newest checkpoint in `folder` that verifies; one that does not is skipped with a
    warning for the one before. `with_progress`: only one that says how far each launched
    learner got (a supervisor's; the server's own stop checkpoint does not). `verify=False`: a
    look (`load`), whose tensors are not checked. None if there is none."""
    for path in reversed(listing(folder)):
        try:
            found = load(path, verify=verify)
        except CheckpointError as err:
            log.warning("skipping a bad checkpoint: %s", err)
            continue
        if found.progress or not with_progress:
            return found
    return None
