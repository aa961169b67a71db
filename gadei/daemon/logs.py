"""A daemon job's logs, as `gadei logs` shows them (the job's supervisor's, its server's, each
learner's, in its output folder): which files (`log_files`), their last lines (`tail`), and the
lines a file gains as it is written (`Tail`, which `Client.logs` and `Client.follow` read)."""

import os
from pathlib import Path

LOG_TAIL_BYTES = 4 << 20  # the most of one log a `logs` answer carries


def tail(path, lines: int) -> str:
    """The last `lines` lines of the file at `path`, from at most its last LOG_TAIL_BYTES."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        handle.seek(max(0, size - LOG_TAIL_BYTES))
        data = handle.read(LOG_TAIL_BYTES)
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def log_files(record) -> list[str]:
    """A daemon job's logs (`record`: its `gadei.daemon.jobs.JobRecord`) that are there, in the
    order `gadei logs` prints them: its supervisor's, its server's, each learner's (a job that
    picks its model: each candidate's server's and learners', in the order they train)."""
    from ..outputs import candidates

    out = Path(record.output)
    found = []
    for folder in [out / "logs", *(c.folder / "logs" for c in candidates(out) or [])]:
        try:
            learners = sorted(str(p) for p in folder.glob("learner-*.log"))
        except OSError:
            learners = []
        found += [p for p in (str(folder / "server.log"),) if os.path.exists(p)] + learners
    return [p for p in (record.log,) if os.path.exists(p)] + found


class Tail:
    """The lines a file gains: each `read` gives the complete lines written since the last one
    (the first: the file's last `first` lines, or all of it). A file that shrank was written
    anew: it is read again from its start."""

    def __init__(self, path: Path, first: int | None = None):
        self.path, self.first = path, first
        self.offset: int | None = None  # where the next read starts; None: not read yet
        self.partial = b""  # a line not yet ended

    def read(self, final: bool = False) -> list[str]:
        """The new complete lines (`final`: and an unended last line: the writer is done)."""
        try:
            with open(self.path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                first = self.offset is None
                if first:
                    start = 0 if self.first is None else max(0, size - LOG_TAIL_BYTES)
                elif size < self.offset:  # written anew
                    start, self.partial = 0, b""
                else:
                    start = self.offset
                handle.seek(start)
                data = handle.read(max(0, min(size - start, LOG_TAIL_BYTES)))
        except FileNotFoundError:
            return []
        self.offset = start + len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        if final and self.partial and self.offset == size:
            lines.append(self.partial)
            self.partial = b""
        if first and self.first is not None:
            lines = lines[1 if start else 0:]  # a tail that starts mid-file starts mid-line
            lines = lines[-self.first:] if self.first else []
        return [line.decode(errors="replace") for line in lines]
