"""Files written whole or not at all (`replace`): into a temporary file beside the path, then
renamed over it, so that a reader (another process, or the next run after a crash) finds the file
before or the file after, never half of one. The one place gadei does that, and names a write's
temporary file (`temporary`: a checkpoint's too, which then takes its name by a hard link so that
two writers never replace each other's: `gadei.checkpoint`); what a writer killed mid-write left
is removed by the next one to write there (`remove_orphans`)."""

import contextlib
import itertools
import os
import re
from pathlib import Path

from . import _proc

_WRITES = itertools.count()  # each write's own temporary file, whichever thread of this process writes
_TEMPORARY = re.compile(r"^\.(.+)\.tmp(\d+)(?:\.\d+)?$")  # .NAME.tmpPID.N (.NAME.tmpPID: earlier versions')


def temporary(path: Path) -> Path:
    """Where a write of `path` goes first: .NAME.tmpPID.N beside it, hidden, one per write."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}.{next(_WRITES)}")


def remove_orphans(folder, names=None) -> None:
    """Remove the temporary files in `folder` whose writer died mid-write (its pid runs no
    more); of the files `names` only, where given."""
    try:
        found = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in found:
        orphan = _TEMPORARY.match(name)
        if orphan and (names is None or orphan.group(1) in names) and not _proc.running(int(orphan.group(2))):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def sync_folder(folder) -> None:
    """Make the names in `folder` (a rename, a link) outlive a crash of the machine."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(path, content, *, private: bool = False, durable: bool = False) -> None:
    """Write `path` whole or not at all. `content`: text (UTF-8), bytes, or a function that
    writes into the file it is given (open for binary writing). `private`: mode 0600 whatever
    the umask (else 0666 less the umask). `durable`: the file and then its folder are synced, so
    that the new file outlives a crash of the machine too.

    The temporary file is `temporary(path)`.

    Raises:
        OSError: it could not be written (the file at `path` is then as it was), also where
            `content`'s writer (torch.save, say) reports the failed write as an error of its own;
            its `filename` is `path`.
    """
    path = Path(path)
    tmp = temporary(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a killed writer's leftover (a pid is reused) would keep its mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600 if private else 0o666)
    try:
        if private:
            os.fchmod(fd, 0o600)  # a umask such as 0277 takes bits from 0600 too
        with os.fdopen(fd, "wb") as out:
            fd = -1
            if callable(content):
                writer = Writer(out)
                try:
                    content(writer)
                except Exception as err:
                    if writer.error is None or writer.error is err:
                        raise
                    raise writer.error from err  # torch.save's RuntimeError for a write that failed: why it did
            else:
                out.write(content.encode() if isinstance(content, str) else content)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if isinstance(err, OSError) and err.filename in (None, str(tmp)):
            err.filename = str(path)  # a failed write names the file it was for
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        sync_folder(path.parent)


class Writer:
    """A binary file for a writer that reports a failed write only as an error of its own
    (torch.save: a RuntimeError, "unexpected pos"): it remembers the OSError (no space, quota,
    file too large) so that the caller can say why."""

    def __init__(self, handle):
        self.handle, self.error = handle, None

    def write(self, data) -> int:
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = err
            raise

    def __getattr__(self, name):  # the rest of a file (flush, tell, seek, ...) as the handle has it
        return getattr(self.handle, name)
