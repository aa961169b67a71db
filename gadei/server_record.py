"""The server's records outside its region: its pid and start time in this user's runtime
folder (`JOB.server.json`), so that `gadei stop` can find and stop a server whose region's
header cannot be read (corrupted, or another object in its place); and how it ended
(`StopRecord`), which it writes where its supervisor asks (`gadei serve --stop-record`), and
which `gadei serve --json` prints."""

import json
import logging
import os
import struct
import time
from dataclasses import asdict, dataclass, fields

from . import _proc, files
from .layout import HEADER
from .region import SHM_DIR, check_job_name, shm_name

log = logging.getLogger(__name__)


STOPPED, FAILED, REFUSED, EARLY = "stopped", "failed", "refused", "early"


@dataclass
class StopRecord:
    """How one server ended, written by it once, atomically, as its last act.

    Attributes:
        job: the job's name.
        outcome: "stopped" (asked to stop, it drained the rings and stopped), "failed" (it
            stopped the job as failed: a corrupt region, a non-finite gradient), "refused" (it
            did not start: `reason`), "early" (stopped before it served: it wrote nothing).
        reason: why, where it failed or refused.
        applied: gradients this server applied; seconds: how long it served.
        version: the weights' version at its end; applied_total: gradients applied in the
            job (across resumes); resumed_applied: those the checkpoint it resumed from held.
        published: gradients the learners published; discarded: those it discarded (stale
            beyond the bound, not finite); nonfinite_skipped: of those, the non-finite ones.
        checkpoint: the checkpoint it wrote at its stop (its final weights), if any.
        first_applied: when (time.time()) it applied its first gradient; 0: none.
        pid, time: who wrote it, and when (time.time()).
    """

    job: str
    outcome: str
    reason: str = ""
    applied: int = 0
    seconds: float = 0.0
    version: int = 0
    applied_total: int = 0
    resumed_applied: int = 0
    published: int = 0
    discarded: int = 0
    nonfinite_skipped: int = 0
    checkpoint: str | None = None
    first_applied: float = 0.0
    pid: int = 0
    time: float = 0.0


def write_stop_record(path: str, record: StopRecord) -> None:
    """Write `record` at `path` whole or not at all, stamped with this process and the time."""
    record.pid, record.time = os.getpid(), time.time()
    files.replace(path, json.dumps(asdict(record)) + "\n")


def read_stop_record(path) -> StopRecord | None:
    """The stop record at `path`; None where there is none, or not a whole one."""
    try:
        raw = json.loads(open(path).read())
        return StopRecord(**{f.name: raw[f.name] for f in fields(StopRecord) if f.name in raw})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _record_path(job: str) -> str:
    from .env import runtime_dir

    return os.path.join(runtime_dir(), f"{check_job_name(job)}.server.json")


def save_server_record(job: str, pid: int, started: float) -> None:
    """Record `job`'s server (pid and start time) outside its region, in this user's runtime
    folder, so that `gadei stop` finds it when the region's header cannot be read. A folder
    that cannot be written costs only that (a warning)."""
    try:
        files.replace(_record_path(job), json.dumps({"job": job, "pid": pid, "start": started}))
    except OSError as err:  # PermissionError included: a runtime folder of another user
        log.warning("job %r: cannot record the server outside its region (gadei stop then needs a readable "
                    "region): %s", job, err)


def _read_record(path: str) -> tuple[int, float]:
    """(pid, start time) of the record at `path`. Raises OSError (FileNotFoundError: none),
    or ValueError, KeyError, TypeError for a record that is not one."""
    with open(path) as handle:
        record = json.load(handle)
    return int(record["pid"]), float(record["start"])


def drop_server_record(job: str, pid: int, started: float) -> None:
    """Remove `job`'s server record if it is still the one of (pid, started)."""
    try:
        path = _record_path(job)
        if _read_record(path) == (pid, started):
            os.unlink(path)
    except (OSError, ValueError, KeyError, TypeError):
        pass


def gone_server_records(jobs: list[str] | None = None) -> list[tuple[str, str, str]]:
    """The server records in this user's runtime folder whose server is gone (killed, or
    exited without dropping it), of `jobs` only when given: (job, path, which server it
    named: "server pid 123", or "an unreadable record"). The record of a server that still
    runs is kept for `gadei stop`; a file whose name is not a job's is not gadei's.

    Raises:
        PermissionError: the runtime folder is another user's or others may write to it.
    """
    import glob

    from .env import runtime_dir
    from .errors import GadeiError

    gone = []
    for path in sorted(glob.glob(os.path.join(runtime_dir(), "*.server.json"))):
        job = os.path.basename(path)[: -len(".server.json")]
        try:
            if jobs and job not in jobs or _record_path(job) != path:
                continue
        except GadeiError:  # not a job name gadei writes: not ours to remove
            continue
        try:
            pid, started = _read_record(path)
        except FileNotFoundError:  # its server dropped it meanwhile
            continue
        except (OSError, ValueError, KeyError, TypeError):
            gone.append((job, path, "an unreadable record"))
            continue
        if not _proc.alive(pid, started):
            gone.append((job, path, f"server pid {pid}"))
    return gone


def live_server(job: str) -> tuple[int, float, str] | None:
    """(pid, start time, where it was found) of `job`'s server when a process of this user runs
    as it: from the server's record, else from the region header's pid fields read as raw
    bytes (whatever the rest of the header holds). None when neither names a live process of
    this user (pid and start time must match: a reused pid is not it)."""
    import psutil

    candidates = []
    try:
        candidates.append((*_read_record(_record_path(job)), "the server's record"))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        with open(os.path.join(SHM_DIR, shm_name(job).lstrip("/")), "rb") as handle:
            handle.seek(HEADER["server_pid"].offset)
            pid, _, started = struct.unpack("<IId", handle.read(16))
        candidates.append((pid, started, "the region's header"))
    except (OSError, struct.error):
        pass
    for pid, started, where in candidates:
        if not _proc.alive(pid, started):
            continue
        try:
            if psutil.Process(pid).uids().effective != os.geteuid():
                continue  # not ours to stop
        except psutil.Error:
            continue
        return pid, started, where
    return None
