"""The wire between bridge ranks: the measured cost of a message (`Link`), and `Wire`, which
moves float32 vectors in buckets sized from it, as float32 or float16 (summed in float32 in
rank order, the same on every rank)."""

import statistics
import time
from dataclasses import dataclass

import numpy as np

from ..protocol import Deadline
from .mpi import BridgeError, link_errors, mpi, wait_all


MB = 1 << 20
_OVERHEAD = 0.05  # auto buckets: per-message latency at most this share of a bucket's transfer time
_MIN_BUCKET, _MAX_BUCKET = 64 << 10, 64 << 20
_INFLIGHT = 4  # buckets in flight at once
_FLOAT16_MAX = 65504.0


def to16(x: np.ndarray) -> np.ndarray:
    """x (float32) as float16 bits (uint16); torch converts with the CPU's F16C, NumPy in software."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.float16).view(torch.int16).numpy().view(np.uint16)


def from16(bits: np.ndarray, out: np.ndarray) -> None:
    """out (float32) = the float16 values whose bits are `bits`."""
    import torch

    torch.from_numpy(out).copy_(torch.from_numpy(bits.view(np.int16)).view(torch.float16))


def sum16(rows: np.ndarray, out: np.ndarray) -> None:
    """out = the float16 rows summed in float32, row after row (the same result on every rank)."""
    import torch

    total = torch.from_numpy(out)
    halves = torch.from_numpy(rows.view(np.int16)).view(torch.float16)
    total.copy_(halves[0])
    for row in halves[1:]:
        total.add_(row)  # float16 + float32 promotes to float32


# ------------------------------------------------------------------ the link and its buckets


@dataclass(frozen=True)
class Link:
    """Cost model of one message: seconds = alpha + beta * bytes."""

    alpha: float
    beta: float

    def bucket_bytes(self, overhead: float = _OVERHEAD) -> int:
        """MG-WFBP's merge: the smallest bucket whose latency is at most `overhead` of its transfer."""
        raw = self.alpha * (1 - overhead) / (overhead * max(self.beta, 1e-15))
        return int(min(_MAX_BUCKET, max(_MIN_BUCKET, raw)) // 4096 * 4096)


def fit_link(samples: list[tuple[int, float]]) -> Link:
    """Least-squares fit of seconds = alpha + beta * bytes over (bytes, seconds) samples."""
    x = np.array([s[0] for s in samples], dtype=np.float64)
    y = np.array([s[1] for s in samples], dtype=np.float64)
    beta, alpha = np.polyfit(x, y, 1)
    return Link(alpha=max(float(alpha), 1e-7), beta=max(float(beta), 1e-13))


def measure_link(comm, timeout: float, sizes=(4 << 10, 64 << 10, 512 << 10, 2 << 20), repeats: int = 5,
                 on_poll=None) -> Link:
    """Measure alpha and beta of an allreduce over `comm` (collective); every rank gets the same Link.

    Each size is timed `repeats` times (median), then a line is fitted; the ranks agree on
    the largest alpha and beta any of them measured.
    """
    MPI = mpi()
    samples = []
    for size in sizes:
        x = np.ones(size // 4, dtype=np.float32)
        out = np.empty_like(x)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            wait_all([comm.Iallreduce(x, out, op=MPI.SUM)], Deadline(timeout), "measuring the link", on_poll)
            times.append(time.perf_counter() - start)
        samples.append((size, statistics.median(times[1:])))
    link = fit_link(samples)
    agreed = np.array([link.alpha, link.beta])
    wait_all([comm.Iallreduce(MPI.IN_PLACE, agreed, op=MPI.MAX)], Deadline(timeout), "agreeing on the link",
             on_poll)
    return Link(alpha=float(agreed[0]), beta=float(agreed[1]))


class Wire:
    """Moves float32 vectors between ranks in buckets, as float32 or float16 on the wire.

    Args:
        comm: the communicator.
        bucket_bytes: bytes of float32 per bucket (0: the whole vector in one message).
        float16: send float16; sums are accumulated in float32.
        timeout: seconds any one exchange may wait.
        on_poll: called between polls.
    """

    def __init__(self, comm, bucket_bytes: int, float16: bool, timeout: float, on_poll=None):
        self.comm = comm
        self.size = comm.Get_size()
        self.bucket = bucket_bytes // 4
        self.float16 = float16
        self.timeout = timeout
        self.on_poll = on_poll
        self.sent = 0  # bytes this rank put on the wire, ever

    def poll(self) -> None:
        """What to do between two polls (the bridge beats its ring entry)."""
        if self.on_poll is not None:
            self.on_poll()

    def _slices(self, n: int) -> list[slice]:
        step = self.bucket or n
        return [slice(i, min(n, i + step)) for i in range(0, n, step)] or [slice(0, 0)]

    def _check16(self, x: np.ndarray) -> None:
        if self.float16 and x.size and float(np.abs(x).max()) > _FLOAT16_MAX:
            raise BridgeError(f"a value of {float(np.abs(x).max()):.4g} does not fit float16 "
                              f"(largest {_FLOAT16_MAX:g}); exchange without --float16")

    @link_errors
    def allreduce_sum(self, x: np.ndarray, out: np.ndarray, what: str = "allreduce") -> np.ndarray:
        """out = the sum over ranks of x (float32; the same on every rank)."""
        MPI = mpi()
        deadline = Deadline(self.timeout)
        self._check16(x)
        pending: list[tuple] = []
        for s in self._slices(x.size):
            if len(pending) >= _INFLIGHT:
                self._finish(pending.pop(0), out, deadline, what)
            if self.float16:
                send = to16(x[s])
                recv = np.empty((self.size, send.size), dtype=np.uint16)
                request = self.comm.Iallgather([send, MPI.UINT16_T], [recv, MPI.UINT16_T])
                pending.append((request, s, send, recv))
                self.sent += send.nbytes * (self.size - 1)
            else:
                request = self.comm.Iallreduce(x[s], out[s], op=MPI.SUM)
                pending.append((request, s, None, None))
                self.sent += 2 * x[s].nbytes * (self.size - 1) // self.size
        for item in pending:
            self._finish(item, out, deadline, what)
        return out

    def _finish(self, item, out, deadline, what) -> None:
        request, s, _, recv = item
        wait_all([request], deadline, what, self.on_poll)
        if recv is not None:  # float32 accumulation in rank order: the same sum on every rank
            sum16(recv, out[s])

    @link_errors
    def swap(self, peer: int, x: np.ndarray, out: np.ndarray, send_tag: int, recv_tag: int, *,
             what: str) -> np.ndarray:
        """Send x to `peer` and receive its vector into out (float32), bucket by bucket."""
        MPI = mpi()
        deadline = Deadline(self.timeout)
        self._check16(x)
        slices = self._slices(x.size)
        if self.float16:
            wire_out = np.empty(x.size, dtype=np.uint16)
            sends = [[to16(x[s]), MPI.UINT16_T] for s in slices]
            recvs = [[wire_out[s], MPI.UINT16_T] for s in slices]
        else:
            sends = [[x[s], MPI.FLOAT] for s in slices]
            recvs = [[out[s], MPI.FLOAT] for s in slices]
        requests = [self.comm.Isend(buf, peer, send_tag) for buf in sends]
        requests += [self.comm.Irecv(buf, peer, recv_tag) for buf in recvs]
        wait_all(requests, deadline, what, self.on_poll)
        self.sent += sum(buf[0].nbytes for buf in sends)
        if self.float16:
            from16(wire_out, out)
        return out
