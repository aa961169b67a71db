"""The job's shared-memory region: create it (server), attach to it (everyone else), check it.

One POSIX shared-memory object per job, named `/gadei-<job>` (on Linux it shows as
`/dev/shm/gadei-<job>`), mode 0600, pre-faulted at creation and laid out by
`gadei.layout.layout`. The creator writes the header's identity fields and the `magic`
word last, so an attacher that sees the magic sees a complete header.

Attaching checks, in order, and refuses with an error naming both sides: the owner (another
user's region), the magic (not a gadei region), the layout version, the size against the
layout of the shape in the header, and then whatever the attacher expects (parameter
count, gradient dtype). A region whose server process is gone is a leftover: `serve`
refuses to reuse it unless told to replace it, and `gadei clean` removes it.
"""

import ctypes
import errno
import functools
import json
import logging
import mmap
import os
import pwd
import re
import struct
import time
from dataclasses import dataclass

import numpy as np
import posix_ipc

from . import _native, _proc
from .cgroup import memory_available
from .errors import (BadJobName, ForeignOwner, ForeignRegion, GadeiTimeout, JobRunning, LeftoverRegion, RegionError,
                     RegionMismatch, RegionNotFound)
from .layout import (DTYPE_CODES, DTYPES, ENTRY, FIELD_BYTES, HEADER, HEADER_BYTES, HIST_BUCKETS, LAYOUT_VERSION, MAGIC,
                     MAX_SPARSE, MODE_CODES, MODES, NAME_BYTES, SLOT, Layout, Shape, SparseTable, layout)
from .protocol import Deadline

log = logging.getLogger(__name__)

PREFIX = "gadei-"
SHM_DIR = "/dev/shm"
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_POLL = 0.02  # seconds between looks while waiting for a region to appear


def check_job_name(job: str) -> str:
    """Return `job` if it can name a region, else raise BadJobName saying what is allowed."""
    if not isinstance(job, str) or not _JOB_NAME.fullmatch(job):
        raise BadJobName(
            f"job name {job!r} is not allowed: use 1-63 ASCII letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return job


def shm_name(job: str) -> str:
    """The POSIX shared-memory name of `job`'s region."""
    return "/" + PREFIX + check_job_name(job)


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


class Record:
    """Typed access to one fixed-layout record (header, learner entry, slot header) in a region.

    Integer fields are read and written with the native atomics (sequentially consistent);
    f64 fields are stored as their 64-bit pattern through the same atomics.
    """

    __slots__ = ("base", "fields")

    def __init__(self, base: int, fields):
        self.base = base
        self.fields = fields

    def addr(self, name: str) -> int:
        """The absolute address of field `name` (for futex waits and native calls)."""
        return self.base + self.fields[name].offset

    def get(self, name: str):
        field = self.fields[name]
        address = self.base + field.offset
        if field.kind == "u64":
            return _native.load64(address)
        if field.kind == "u32":
            return _native.load32(address)
        if field.kind == "f64":
            return struct.unpack("<d", struct.pack("<Q", _native.load64(address)))[0]
        if field.kind == "hist":
            return [_native.load64(address + 8 * i) for i in range(HIST_BUCKETS)]
        if field.kind == "sparse":
            return _read_sparse(address, _native.load32(self.base + self.fields["sparse_count"].offset))
        raise TypeError(f"field {name!r} of kind {field.kind!r} is read with Region.read_name")

    def set(self, name: str, value) -> None:
        field = self.fields[name]
        address = self.base + field.offset
        if field.kind == "u64":
            _native.store64(address, int(value))
        elif field.kind == "u32":
            _native.store32(address, int(value))
        elif field.kind == "f64":
            _native.store64(address, struct.unpack("<Q", struct.pack("<d", float(value)))[0])
        else:
            raise TypeError(f"field {name!r} of kind {field.kind!r} cannot be set as a number")

    def text(self, name: str) -> str:
        """Text field `name` as another process wrote it: bytes to the first NUL, bad UTF-8
        replaced, anything unprintable shown as '?'."""
        raw = ctypes.string_at(self.addr(name), FIELD_BYTES["text"]).split(b"\0", 1)[0]
        return "".join(c if c.isprintable() else "?" for c in raw.decode("utf-8", "replace"))

    def set_text(self, name: str, value: str) -> None:
        """Write text field `name`: `value` as UTF-8, cut at a character's end to leave a NUL."""
        size = FIELD_BYTES["text"]
        raw = value.encode("utf-8")[: size - 1].decode("utf-8", "ignore").encode("utf-8")
        ctypes.memmove(self.addr(name), raw.ljust(size, b"\0"), size)

    def add(self, name: str, delta: int) -> int:
        """Atomically add `delta`; return the value before."""
        field = self.fields[name]
        op = _native.add64 if field.kind == "u64" else _native.add32
        return op(self.base + field.offset, delta)

    def cas(self, name: str, expected: int, desired: int) -> bool:
        """Compare-and-swap field `name` from `expected` to `desired`; True when it swapped."""
        field = self.fields[name]
        op = _native.cas64 if field.kind == "u64" else _native.cas32
        return op(self.base + field.offset, expected, desired)

    def add_bucket(self, name: str, bucket: int, delta: int) -> int:
        """Atomically add `delta` to bucket `bucket` of histogram field `name`; the value before."""
        field = self.fields[name]
        if field.kind != "hist" or not 0 <= bucket < HIST_BUCKETS:
            raise IndexError(f"field {name!r} of kind {field.kind!r} has no bucket {bucket}")
        return _native.add64(self.base + field.offset + 8 * bucket, delta)

    def word(self, name: str) -> "Word":
        """Field `name` (u32 or u64) as a `Word` bound to its address, for loops that use it often."""
        field = self.fields[name]
        if field.kind not in ("u32", "u64"):
            raise TypeError(f"field {name!r} of kind {field.kind!r} is not an atomic word")
        return Word(self.base + field.offset, field.kind == "u64")


class Word:
    """One atomic 32- or 64-bit word of a mapped region, at a fixed address.

    Everyone reads and writes a header or learner-entry word through this (or through
    `Record`), but for two owners that make the native calls on their own words themselves:
    the ring (its counters and the owner's record, on the per-gradient path: gadei.ring) and
    the slot's format (a slot's payload and row counts: gadei.transport.slot). A futex waits
    on the low 32 bits of a 64-bit word (little-endian), so `wait(expected)` compares those.
    """

    __slots__ = ("addr", "load", "store", "add", "cas")

    def __init__(self, addr: int, wide: bool):
        self.addr = addr
        self.load = functools.partial(_native.load64 if wide else _native.load32, addr)
        self.store = functools.partial(_native.store64 if wide else _native.store32, addr)
        self.add = functools.partial(_native.add64 if wide else _native.add32, addr)
        self.cas = functools.partial(_native.cas64 if wide else _native.cas32, addr)

    def wait(self, expected: int, timeout: float) -> bool:
        """Sleep while the word's low 32 bits hold `expected`, up to `timeout` seconds; False on time-out."""
        return _native.futex_wait(self.addr, expected & 0xFFFFFFFF, timeout) == 0

    def wake(self, n: int = 1 << 30) -> int:
        """Wake up to `n` processes waiting on the word (all of them by default)."""
        return _native.futex_wake(self.addr, n)


@dataclass(frozen=True)
class _Opened:
    """An opened shared-memory object before it is trusted: fd, size, owner."""

    shm: posix_ipc.SharedMemory
    size: int
    uid: int
    inode: int


class _SymlinkSquat(ForeignRegion):
    """The region's name in SHM_DIR is a symbolic link (shm_open never follows one)."""

    def __init__(self, path: str, problem: str, uid: int):
        super().__init__(f"{path}: {problem}")
        self.problem, self.uid = problem, uid


def _open(name: str, readonly: bool) -> _Opened:
    try:
        shm = posix_ipc.SharedMemory(name, read_only=readonly)
    except OSError as err:  # shm_open opens with O_NOFOLLOW: ELOOP is a symbolic link in the region's place
        if err.errno != errno.ELOOP:
            raise
        path = os.path.join(SHM_DIR, name.lstrip("/"))
        try:
            info, target = os.lstat(path), os.readlink(path)
        except OSError:
            raise _SymlinkSquat(path, "it is a symbolic link, which gadei never follows", -1) from None
        raise _SymlinkSquat(path, f"it is a symbolic link (to {target!r}) made by {_user(info.st_uid)}, which gadei "
                            "never follows", info.st_uid) from None
    except posix_ipc.PermissionsError as err:
        path = os.path.join(SHM_DIR, name.lstrip("/"))
        try:
            owner = _user(os.stat(path).st_uid)
        except OSError:
            owner = "another user"
        raise ForeignOwner(
            f"region {name} belongs to {owner}; you are {_user(os.geteuid())}: it is not yours to use"
        ) from err
    stat = os.fstat(shm.fd)
    return _Opened(shm, stat.st_size, stat.st_uid, stat.st_ino)


def _map(opened: _Opened, size: int, readonly: bool, populate: bool) -> mmap.mmap:
    """Map the object; with `populate`, fault every page in now (MAP_POPULATE), not on first use."""
    prot = mmap.PROT_READ | (0 if readonly else mmap.PROT_WRITE)
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(opened.shm.fd, size, flags=flags, prot=prot)


class Region:
    """A mapped gadei region. Create with `Region.create`, attach with `Region.attach`.

    Attributes:
        job: the job name.
        name: the shared-memory name (`/gadei-<job>`).
        shape, layout: what the region holds and where.
        readonly: whether this mapping may only read.
        header: the header record.
        weights: float32 NumPy view of the weights (read-only for read-only attachers).
    """

    def __init__(self, job: str, opened: _Opened, mm: mmap.mmap, shape: Shape, readonly: bool):
        self.job = job
        self.name = shm_name(job)
        self.shape = shape
        self.layout: Layout = layout(shape)
        self.readonly = readonly
        self._inode = opened.inode
        self._mm = mm
        self._bytes = np.frombuffer(mm, dtype=np.uint8)
        self.base = int(self._bytes.ctypes.data)
        self.header = Record(self.base, HEADER)
        self.weights = self.array(self.layout.weights, shape.n_params)
        self.weights_addr = self.base + self.layout.weights
        self._closed = False

    # ------------------------------------------------------------------ sections

    def array(self, offset: int, count: int, dtype=np.float32) -> np.ndarray:
        """A NumPy view of `count` elements of `dtype` at byte `offset` of the region."""
        return self._bytes[offset : offset + count * np.dtype(dtype).itemsize].view(dtype)

    def entry(self, learner: int) -> Record:
        """The learner table entry `learner`."""
        self._check_learner(learner)
        return Record(self.base + self.layout.entry(learner), ENTRY)

    def slot_header(self, learner: int, slot: int) -> Record:
        """The header of slot index `slot` of learner `learner`'s ring."""
        return Record(self.base + self.layout.slot_header(learner, slot), SLOT)

    @property
    def state(self) -> np.ndarray | None:
        """The optimiser state, `state_arrays` x n_params float32 end to end (the momentum
        buffer, Adagrad's sums, or Adam's m then v), or None when the job has none."""
        if self.layout.state is None:
            return None
        return self.array(self.layout.state, self.shape.state_arrays * self.shape.n_params)

    def _check_learner(self, learner: int) -> None:
        if not 0 <= learner < self.shape.capacity:
            raise IndexError(f"job {self.job!r}: learner {learner} is outside 0..{self.shape.capacity - 1}")

    # ------------------------------------------------------------------ the model spec

    def read_spec(self) -> list[tuple[str, tuple[int, ...]]] | None:
        """The model's parameters as [(name, shape)], or None while no model was recorded."""
        length = self.header.get("spec_len")
        if length == 0:
            return None
        raw = bytes(self._bytes[self.layout.spec : self.layout.spec + length])
        return [(name, tuple(shape)) for name, shape in json.loads(raw.decode("utf-8"))["params"]]

    def write_spec(self, spec: list[tuple[str, tuple[int, ...]]]) -> None:
        """Record the model's parameter names and shapes (before weights are marked ready)."""
        raw = json.dumps({"params": [[name, list(shape)] for name, shape in spec]}).encode("utf-8")
        if len(raw) > self.shape.spec_bytes:
            raise RegionMismatch(
                f"job {self.job!r}: the model's parameter list takes {len(raw):,} bytes of JSON, "
                f"the region has room for {self.shape.spec_bytes:,}"
            )
        self._bytes[self.layout.spec : self.layout.spec + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        self.header.set("spec_len", len(raw))

    def raw(self, offset: int, count: int) -> bytes:
        """A copy of `count` bytes of the region at byte `offset` (for comparing what was written once)."""
        return bytes(self._bytes[offset : offset + count])

    def read_name(self) -> str:
        """The job name recorded in the header."""
        off = HEADER["job"].offset
        return bytes(self._bytes[off : off + NAME_BYTES]).rstrip(b"\0").decode("utf-8", "replace")

    # ------------------------------------------------------------------ server liveness

    def server_alive(self) -> bool:
        """True when the process recorded as the server runs (pid and start time match)."""
        return _proc.alive(self.header.get("server_pid"), self.header.get("server_start"))

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Unmap (the object stays until unlinked). Views handed out keep the mapping alive."""
        if self._closed:
            return
        self._closed = True
        self.weights = None
        self._bytes = None
        try:
            self._mm.close()
        except BufferError:
            log.debug("job %r: region views are still in use; the mapping goes with the last of them", self.job)

    def unlink(self) -> bool:
        """Remove the region's name if it is still this region; True when removed."""
        path = os.path.join(SHM_DIR, self.name.lstrip("/"))
        try:
            if os.stat(path).st_ino != self._inode:
                log.warning("job %r: %s is another region now; leaving it", self.job, self.name)
                return False
            posix_ipc.unlink_shared_memory(self.name)
            return True
        except (FileNotFoundError, posix_ipc.ExistentialError):
            return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ create / attach

    @classmethod
    def create(cls, job: str, shape: Shape, *, replace: bool = False) -> "Region":
        """Create the region of `job` for `shape` (the server does this), pre-faulted and zeroed.

        The identity fields and the calling process as the region's server are written, but
        not `magic`: the caller fills in the other server fields, weights and spec, then calls
        `publish()` so attachers see a complete region. Until then `inspect` reports the job as
        'starting', not as a leftover that `--replace` or `gadei clean` would remove.

        Raises:
            JobRunning: a live server already serves `job`.
            LeftoverRegion: a crashed server's region is in the way and `replace` is False.
            ForeignRegion: an object with the name exists that is not a gadei region.
            ForeignOwner: the object belongs to another user.
        """
        name = shm_name(job)
        lay = layout(shape)
        started = _proc.start_time()
        found = inspect(job)
        leftover = None  # the region it replaces
        if found is not None:
            if found.state == "running":
                raise JobRunning(f"job {job!r} is already served by pid {found.server_pid} ({name})")
            if found.state == "starting":
                raise JobRunning(f"job {job!r}: server pid {found.server_pid} is creating {name}")
            if found.state == "leftover" and replace:
                leftover = found
            elif found.state == "leftover":
                raise LeftoverRegion(
                    f"job {job!r}: {name} was left behind by server pid {found.server_pid}, which is "
                    f"not running; remove it with `gadei clean {job}` or serve with --replace"
                )
            else:
                check_name_free(job, found)
        # Its pages are charged to this process's cgroup: past the limit, the kernel kills us. A
        # region it replaces gives its pages back (its server ran in this cgroup: a restart's).
        room = memory_available()
        if room is not None and lay.total > room + (leftover.size if leftover else 0):
            raise RegionError(f"job {job!r}: the region needs {lay.total / 1e6:,.1f} MB, where this process's cgroup "
                              f"(a container's memory limit) has {room / 1e6:,.1f} MB available: fewer parameters or "
                              "learners, or a larger limit")
        if leftover:  # removed only now, and created at once: a restart's region is missing for as short as can be
            log.warning("job %r: replacing the region left behind by server pid %d", job, leftover.server_pid)
            remove(job)
        try:
            shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=lay.total)
        except posix_ipc.ExistentialError as err:
            raise JobRunning(f"job {job!r}: another server created {name} at the same moment") from err
        # The creator is the region's server from (microseconds after) its creation, before the
        # reservation below, which takes seconds for a large region: `inspect` does not take it
        # for a leftover meanwhile. server_pid, run_state (0) and server_start in one write.
        os.pwrite(shm.fd, struct.pack("<IId", os.getpid(), 0, started), HEADER["server_pid"].offset)
        try:
            # tmpfs hands out pages when they are first touched: reserve them all now, so a full
            # /dev/shm is a clear error here and never a SIGBUS in the middle of training.
            os.posix_fallocate(shm.fd, 0, lay.total)
        except OSError as err:
            shm.close_fd()
            shm.unlink()
            free = os.statvfs(SHM_DIR)
            raise RegionError(
                f"job {job!r}: cannot reserve {lay.total / 1e6:,.1f} MB for the region in {SHM_DIR} "
                f"({err.strerror}; {free.f_bavail * free.f_frsize / 1e6:,.1f} MB free there): free space in "
                f"{SHM_DIR} (`gadei clean` removes leftovers) or make it larger "
                "(a container's: `docker run --shm-size`)"
            ) from None
        stat = os.fstat(shm.fd)
        opened = _Opened(shm, stat.st_size, stat.st_uid, stat.st_ino)
        try:
            mm = _map(opened, lay.total, readonly=False, populate=True)
        finally:
            shm.close_fd()
        region = cls(job, opened, mm, shape, readonly=False)
        h = region.header
        h.set("layout_version", LAYOUT_VERSION)
        h.set("header_bytes", HEADER_BYTES)
        h.set("region_bytes", lay.total)
        h.set("n_params", shape.n_params)
        h.set("grad_dtype", DTYPE_CODES[shape.grad_dtype])
        h.set("capacity", shape.capacity)
        h.set("slots", shape.slots)
        h.set("mode", MODE_CODES[shape.mode])
        h.set("creator_uid", os.geteuid())
        h.set("spec_bytes", shape.spec_bytes)
        h.set("state_arrays", shape.state_arrays)
        h.set("sparse_count", len(shape.sparse))
        _write_sparse(h.addr("sparse"), shape.sparse)
        h.set("created_ns", time.time_ns())
        encoded = job.encode("utf-8")
        off = HEADER["job"].offset
        region._bytes[off : off + len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
        return region

    def publish(self) -> None:
        """Write `magic`: from now on attachers accept the region (the creator calls this last)."""
        self.header.set("magic", MAGIC)

    @classmethod
    def attach(cls, job: str, *, readonly: bool = False, wait: float = 0.0) -> "Region":
        """Attach to `job`'s region, waiting up to `wait` seconds for it to exist and be published.

        Raises:
            RegionNotFound: no region appeared within `wait` seconds.
            ForeignOwner, ForeignRegion: see `create`.
        """
        name = shm_name(job)
        deadline = Deadline(wait)
        while True:
            try:
                opened = _open(name, readonly)
            except posix_ipc.ExistentialError:
                if deadline.expired():
                    waited = f" after waiting {wait:g} s" if wait > 0 else ""
                    raise RegionNotFound(
                        f"job {job!r} has no region ({SHM_DIR}/{name[1:]}){waited}: is `gadei serve {job}` running?"
                    ) from None
                time.sleep(_POLL)
                continue
            try:
                region = _trust(job, opened, readonly)
            except _NotPublished:
                if deadline.expired():
                    raise GadeiTimeout(
                        f"job {job!r}: {name} exists but its server did not finish creating it within {wait:g} s"
                    ) from None
                time.sleep(_POLL)
                continue
            finally:
                opened.shm.close_fd()
            return region

    def expect(self, *, n_params: int | None = None, grad_dtype: str | None = None) -> None:
        """Raise RegionMismatch, naming both sides, unless the region holds what is expected."""
        if n_params is not None and n_params != self.shape.n_params:
            raise RegionMismatch(
                f"job {self.job!r}: model has {n_params:,} parameters, region holds {self.shape.n_params:,}"
            )
        if grad_dtype is not None and grad_dtype != self.shape.grad_dtype:
            raise RegionMismatch(
                f"job {self.job!r}: learner sends {grad_dtype} gradients, region holds {self.shape.grad_dtype}"
            )


class _NotPublished(Exception):
    """The region exists but its creator has not written `magic` yet."""


def _write_sparse(address: int, tables) -> None:
    for i, table in enumerate(tables):
        entry = address + 32 * i
        _native.store64(entry, table.offset)
        _native.store64(entry + 8, table.rows)
        _native.store32(entry + 16, table.width)
        _native.store32(entry + 20, table.max_rows)


def _read_sparse(address: int, count: int) -> tuple[SparseTable, ...]:
    return tuple(
        SparseTable(
            offset=_native.load64(address + 32 * i),
            rows=_native.load64(address + 32 * i + 8),
            width=_native.load32(address + 32 * i + 16),
            max_rows=_native.load32(address + 32 * i + 20),
        )
        for i in range(count)
    )


def _read_header(opened: _Opened) -> dict:
    """The header's numeric fields as plain values, read through a short-lived mapping."""
    head = mmap.mmap(opened.shm.fd, HEADER_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        view = np.frombuffer(head, dtype=np.uint8)
        record = Record(int(view.ctypes.data), HEADER)
        values = {name: record.get(name) for name, field in HEADER.items() if field.kind in ("u32", "u64", "f64")}
        values["sparse"] = _read_sparse(record.addr("sparse"), min(values["sparse_count"], MAX_SPARSE))
        del view, record
    finally:
        head.close()
    return values


def _shape_from_header(h: dict) -> Shape:
    dtype = DTYPES.get(h["grad_dtype"], (f"code {h['grad_dtype']}", 0))[0]
    mode = MODES.get(h["mode"], f"code {h['mode']}")
    return Shape(
        n_params=h["n_params"],
        grad_dtype=dtype,
        capacity=h["capacity"],
        slots=h["slots"],
        mode=mode,
        state_arrays=h["state_arrays"],
        sparse=h["sparse"],
        spec_bytes=h["spec_bytes"],
    )


def _trust(job: str, opened: _Opened, readonly: bool) -> Region:
    """Check an opened object and map it whole; raise the error that says what is wrong."""
    name = shm_name(job)
    if opened.uid != os.geteuid():
        raise ForeignOwner(
            f"region {name} belongs to {_user(opened.uid)}; you are {_user(os.geteuid())}: it is not yours to use"
        )
    if opened.size < HEADER_BYTES:
        if opened.size == 0:
            raise _NotPublished()
        raise ForeignRegion(f"job {job!r}: {name} is {opened.size} bytes, too small for a gadei header")
    h = _read_header(opened)
    if h["magic"] == 0:
        raise _NotPublished()
    if h["magic"] != MAGIC:
        raise ForeignRegion(f"job {job!r}: {name} is not a gadei region "
                            f"(magic {h['magic']:#018x}, expected {MAGIC:#018x})")
    if h["layout_version"] != LAYOUT_VERSION:
        raise ForeignRegion(
            f"job {job!r}: {name} has layout version {h['layout_version']}, this gadei reads version {LAYOUT_VERSION}"
        )
    try:
        shape = _shape_from_header(h)
    except ValueError as err:
        raise ForeignRegion(f"job {job!r}: {name} has a corrupt header: {err}") from err
    expected = layout(shape).total
    recorded = h["region_bytes"]
    if not expected == recorded == opened.size:
        raise ForeignRegion(
            f"job {job!r}: {name} is {opened.size:,} bytes, its header says {recorded:,} and its "
            f"shape needs {expected:,}: the region is corrupt"
        )
    # Writers pre-fault their page tables; a read-only observer (gadei status) maps lazily.
    mm = _map(opened, opened.size, readonly=readonly, populate=not readonly)
    return Region(job, opened, mm, shape, readonly=readonly)


@dataclass(frozen=True)
class Found:
    """What `inspect` found under a job's name.

    state is 'running' (a live server serves it), 'starting' (a live server is still creating
    it: attach with a `wait`), 'leftover' (its server is gone), 'foreign' (not a gadei region,
    or one this version cannot read) or 'other-user'; problem says why for the last two.
    """

    job: str
    state: str
    server_pid: int = 0
    problem: str = ""
    size: int = 0


def inspect(job: str) -> Found | None:
    """Look at `job`'s region without attaching to it for use; None when there is none."""
    name = shm_name(job)
    try:
        opened = _open(name, readonly=True)
    except posix_ipc.ExistentialError:
        return None
    except ForeignOwner as err:
        return Found(job, "other-user", problem=str(err))
    except _SymlinkSquat as err:
        return Found(job, "foreign" if err.uid == os.geteuid() else "other-user", problem=err.problem)
    try:
        if opened.uid != os.geteuid():
            return Found(job, "other-user", problem=f"it belongs to {_user(opened.uid)}", size=opened.size)
        if opened.size < HEADER_BYTES:
            return Found(job, "foreign", problem=f"it is {opened.size} bytes, too small for a gadei region",
                         size=opened.size)
        h = _read_header(opened)
        magic, version = h["magic"], h["layout_version"]
        if magic not in (0, MAGIC):
            return Found(job, "foreign", problem=f"it is not a gadei region (magic {magic:#018x})", size=opened.size)
        if magic == MAGIC and version != LAYOUT_VERSION:
            return Found(job, "foreign", problem=f"it has layout version {version}, not {LAYOUT_VERSION}",
                         size=opened.size)
        if not _proc.alive(h["server_pid"], h["server_start"]):
            state = "leftover"
        else:
            state = "running" if magic == MAGIC else "starting"
        return Found(job, state, server_pid=h["server_pid"], size=opened.size)
    finally:
        opened.shm.close_fd()


def check_name_free(job: str, found: "Found | None" = None) -> None:
    """Refuse a job name that another user's object, or an object that is not a gadei region,
    holds in SHM_DIR (a squatted name): `gadei run` and `gadei submit` ask before anything
    starts, `Region.create` again at creation. `found`: what `inspect` already found.

    Raises:
        ForeignOwner: another user's object (or symbolic link) holds the name; the message names them.
        ForeignRegion: an object of ours that is not a gadei region (or a symbolic link) holds it.
    """
    found = found if found is not None else inspect(job)
    if found is None or found.state not in ("other-user", "foreign"):
        return
    path = f"{SHM_DIR}/{PREFIX}{job}"
    if found.state == "other-user":
        raise ForeignOwner(f"job {job!r}: {path} is not yours: {found.problem}; you are {_user(os.geteuid())}, "
                           "so this job name cannot be used on this machine: give the job another name (or ask "
                           "that user, or root, to remove it)")
    raise ForeignRegion(f"job {job!r}: {path} exists but {found.problem}; remove it with `gadei clean --force {job}`")


def cross_cpu_ns(cpu_a: int, cpu_b: int, rounds: int, timeout: float) -> float:
    """What a region word costs to cross between two CPUs: nanoseconds per round trip of a cache
    line between two threads pinned to `cpu_a` and `cpu_b`, over `rounds` trips (the native probe).

    Raises:
        OSError: a thread cannot run on its CPU; TimeoutError: the rounds took over `timeout` seconds.
    """
    return _native.cross_cpu_ns(cpu_a, cpu_b, rounds, timeout)


def remove(job: str) -> None:
    """Unlink `job`'s region name (processes that mapped it keep their mapping)."""
    try:
        posix_ipc.unlink_shared_memory(shm_name(job))
    except posix_ipc.ExistentialError:
        pass


def list_jobs() -> list[str]:
    """Names of the jobs that have an object in /dev/shm (any state, any owner)."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    jobs = []
    for entry in sorted(names):
        if entry.startswith(PREFIX):
            job = entry[len(PREFIX) :]
            if _JOB_NAME.fullmatch(job):
                jobs.append(job)
    return jobs
