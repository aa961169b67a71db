"""Talking to the daemon: `Client` (submit a job file or a job as a dict, list, wait for,
follow and cancel jobs, read their logs, result and model), which `gadei submit`, `status`,
`logs`, `cancel` and `daemon stop` use; the one request and its answer under it (`request`);
the systemd user unit that runs the daemon, and the table `gadei status` prints of its jobs."""

import json
import logging
import os
import shlex
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

from .. import _proc
from ..errors import DaemonError, DaemonRefused, GadeiError, GadeiTimeout, JobTimeout, NoDaemon, NoSuchJob
from ..protocol import Deadline, wait_for
from ..outputs import EPOCHS, candidates
from .jobs import CANCELLED, LIVE, JobRecord, state_dir
from .logs import Tail, log_files
from .service import lock_holder, socket_path
from .listener import MAX_LINES, BadRequest

log = logging.getLogger(__name__)


CHECK_SECONDS_PER_MB = 5.0  # a submit's wait beyond the client's timeout, for each MB of the job's data files
# (the daemon's checks read them: 1.3-1.5 s a MB measured on 2 cores, a job that picks its model encoding both)


def _data_bytes(path: str) -> int:
    """The bytes of the data files the job file at `path` names (a per-label folder's files; 0
    where it or they cannot be read: the daemon says what is wrong)."""
    from .. import jobfile
    from ..data import data_files

    try:
        section = jobfile.load(path).data
    except GadeiError:
        return 0
    size = 0
    for file in data_files(section):
        try:
            size += os.stat(file).st_size
        except OSError:
            pass
    return size


def request(path: str | None, message: dict, timeout: float = 30.0) -> dict:
    """Send one request to the daemon on the socket `path` (default: this user's); its answer,
    {"ok": true, ...} or {"ok": false, "error": ...}, within `timeout` seconds in all.

    A full listen backlog (EAGAIN) is waited out until the deadline, and so is a daemon that
    started and does not listen yet (it warms up first: `service.lock_holder`); a refused
    connection (a daemon restarting) for up to 2 s of it.

    Raises:
        NoDaemon: no daemon listens on `path`, and none is starting.
        GadeiTimeout: no answer within `timeout`.
        DaemonError: the socket is another user's, or the connection broke without an answer.
    """
    path = path or socket_path()
    try:
        return _request(path, message, timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        raise NoDaemon(f"no gadei daemon listens on {path}; start one with `gadei daemon`", path) from None
    except PermissionError:
        raise DaemonError(f"{path} belongs to another user's daemon") from None
    except GadeiTimeout:  # a TimeoutError, so an OSError: as it is, not as a broken connection
        raise
    except OSError as err:  # a reset connection, a socket path too long, ...
        raise DaemonError(f"the gadei daemon on {path}: {err.strerror or err}") from err


def _request(path: str, message: dict, timeout: float) -> dict:
    deadline = Deadline(timeout)
    refused = Deadline(min(2.0, timeout))  # how long a refused connection is tried again
    pause = 0.005
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.001, deadline.left()))
            sock.connect(path)
            break
        except (BlockingIOError, InterruptedError, ConnectionRefusedError, FileNotFoundError) as err:
            sock.close()
            absent = isinstance(err, (ConnectionRefusedError, FileNotFoundError))
            starting = lock_holder(path) if absent else None
            if absent and not starting and (isinstance(err, FileNotFoundError) or refused.expired()):
                raise
            if deadline.expired():
                raise GadeiTimeout(f"the gadei daemon (pid {starting}) on {path} is starting and did not listen "
                                   f"within {timeout:g} s" if starting else f"the gadei daemon on {path} did not take "
                                   f"the connection within {timeout:g} s (its listen backlog stayed full)") from None
            deadline.sleep(pause)
            pause = min(0.1, pause * 2)
        except BaseException:
            sock.close()
            raise
    with sock:
        try:
            sock.sendall((json.dumps(message) + "\n").encode())
            data = b""
            while not data.endswith(b"\n"):
                sock.settimeout(max(0.001, deadline.left()))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except socket.timeout:
            raise GadeiTimeout(f"the gadei daemon on {path} did not answer within {timeout:g} s (is it stopped?)") \
                from None
    if not data:
        raise DaemonError(f"the gadei daemon on {path} closed the connection without an answer")
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise DaemonError(f"the gadei daemon on {path} answered {data[:80]!r}, not a JSON object")
    return answer


DICT = "job dict"  # how errors name a job given as a dict (`Client.submit`), where they name a job file
POLL = 0.5  # seconds between two looks at a job that is waited for or followed


class Client:
    """The daemon of this user, from Python: what `gadei submit`, `status`, `logs` and `cancel`
    do, and waiting, following, the result and the model of a job.

        client = gadei.Client()
        job = client.submit("job.toml")          # or a dict: {"job": {...}, "data": {...}, ...}
        client.wait(job, timeout=3600)
        print(client.result(job)["test_accuracy"])

    A job is named by its name or by the `JobRecord` that `submit`, `job` and `jobs` hand back.
    Every error is a `gadei.GadeiError`: `NoDaemon` (no daemon listens; it names the socket),
    `NoSuchJob`, `JobFileError` (a job refused: it names the key), `DaemonRefused` (any other
    refusal, with the daemon's reason), `GadeiTimeout` and `JobTimeout`.

    Args:
        socket: the daemon's socket (default: `daemon.sock` in this user's runtime folder).
        timeout: seconds one request may take; a submit waits CHECK_SECONDS_PER_MB more for
            each MB of the job's data files, which the daemon's checks read.
        poll: seconds between two looks at a job being waited for or followed.
    """

    def __init__(self, socket: str | os.PathLike | None = None, *, timeout: float = 30.0, poll: float = POLL):
        self.socket = os.fspath(socket) if socket is not None else socket_path()
        self.timeout, self.poll = timeout, poll

    def __repr__(self) -> str:
        return f"gadei.Client({self.socket!r})"

    def _ask(self, message: dict, more: float = 0.0) -> dict:
        answer = request(self.socket, message, self.timeout + more)
        if not answer.get("ok"):
            raise _refusal(answer)
        return answer

    # ------------------------------------------------------------------ the queue

    def submit(self, job: str | os.PathLike | dict, *, resume: bool = False,
               base: str | os.PathLike | None = None) -> JobRecord:
        """Queue a job: a job file's path, or a job as a dict of sections ({"job": {"name": ...,
        "workload": ...}, "data": {...}, "train": {...}}, as a job file's TOML reads). The daemon
        checks it (its data, its output folder) before it queues it; a dict is checked here first,
        by the job file's own rules, and written as a job file in the state folder's job-files/.

        Args:
            resume: go on with the (cancelled or failed) run in the job's output folder.
            base: a dict's relative paths ([data], [output] folder) are taken from this folder
                (default: the current one), as a job file's are from its own folder.

        Returns:
            The job's record, queued.

        Raises:
            JobFileError: the job cannot run as given (the message names the key and the value).
            DaemonRefused: e.g. a job of that name is queued or running already.
        """
        if isinstance(job, dict):
            from ..jobfile import JobFileError

            path = _write_job_file(job, Path(base) if base is not None else Path.cwd())
            try:
                return self._submit(path, resume)
            except (DaemonRefused, NoDaemon, JobFileError):  # not queued: nothing will read it (after a timeout, it
                os.unlink(path)  # may be)
                raise
        return self._submit(os.path.abspath(job), resume)

    def _submit(self, path: str, resume: bool) -> JobRecord:
        # the daemon answers once it has checked the job, its data read: seconds a MB beyond `timeout`
        return _record(self._ask({"op": "submit", "jobfile": path, "resume": resume},
                                 more=CHECK_SECONDS_PER_MB * _data_bytes(path) / 2**20)["job"])

    def jobs(self) -> list[JobRecord]:
        """Every job the daemon knows, oldest first."""
        return [_record(j) for j in self._ask({"op": "status", "job": None})["jobs"]]

    def job(self, job: str | JobRecord) -> JobRecord:
        """The job's record now (its state, output folder, times, message). Raises NoSuchJob."""
        return _record(self._ask({"op": "status", "job": _name(job)})["jobs"][0])

    def cancel(self, job: str | JobRecord) -> JobRecord:
        """Cancel a job: a queued one never starts; a running one stops at a checkpoint of every
        learner's progress, its logs kept (`submit(..., resume=True)` goes on with it). Its record;
        `wait` for it to end."""
        return _record(self._ask({"op": "cancel", "job": _name(job)})["job"])

    def stop_daemon(self, timeout: float = 30.0) -> int:
        """Stop the daemon (its running jobs go on) and wait until it has ended; its pid.

        Raises:
            GadeiTimeout: it did not end within `timeout` seconds.
        """
        pid = self._ask({"op": "stop"})["pid"]
        wait_for(lambda: not _proc.running(pid), timeout, f"the gadei daemon (pid {pid}) to stop")
        return pid

    # ------------------------------------------------------------------ waiting and following

    def wait(self, job: str | JobRecord, timeout: float) -> JobRecord:
        """Wait until the job has ended (done, failed or cancelled, its run stopped); its record.

        Raises:
            JobTimeout: it had not ended within `timeout` seconds (the message and the
                error's `job` and `state` say which job and the state it was in).
        """
        deadline = Deadline(timeout)
        while True:
            record = self.job(job)
            if ended(record):
                return record
            self._pause(deadline, record)

    def follow(self, job: str | JobRecord, timeout: float | None = None) -> Iterator[dict]:
        """The job's progress as it trains: one record per evaluated epoch (the keys of a
        metrics.jsonl line: epoch, loss, validation_accuracy, test_accuracy, samples_per_s,
        staleness_mean, ...), from its first epoch, until the job has ended (then every epoch
        it wrote has been given); metrics.jsonl adds seconds_since_start to each once the job's
        outputs are written. A job that is queued is waited for. A job that picks its model gives
        its candidates' epochs in the order they train, each record with its "workload".

        Raises:
            JobTimeout: the job had not ended `timeout` seconds after the call (None: no limit).
        """
        deadline = Deadline(timeout) if timeout is not None else None
        record, tails, seen = self.job(job), None, set()
        while True:
            last = ended(record)  # looked before the file is read: what it wrote by then is read
            if record.started:
                out = Path(record.output)
                tails = tails or [(c.workload, Tail(c.folder / EPOCHS)) for c in candidates(out) or []] or \
                    [(None, Tail(out / EPOCHS))]
                for workload, tail in tails:
                    for line in tail.read(final=last):
                        epoch = _epoch(line)
                        if epoch is not None and not (epoch.get("restarted") and (workload, epoch["epoch"]) in seen):
                            seen.add((workload, epoch["epoch"]))  # a restarted learner's catch-up record: not again
                            yield {"workload": workload, **epoch} if workload else epoch
            if last:
                return
            self._pause(deadline, record)
            record = self.job(record.name)

    def logs(self, job: str | JobRecord, lines: int = 50, *, follow: bool = False,
             timeout: float | None = None) -> Iterator[str]:
        """The last `lines` lines of each of the job's logs (its supervisor's, its server's, each
        learner's), each log after a `==> PATH <==` line, as `gadei logs` prints them; a job
        that never ran says why. `follow`: then the lines they gain, as they are written, until
        the job has ended (`==> PATH <==` again when another log has gained lines, as `tail -f`
        says it); a queued job is waited for.

        Raises:
            JobTimeout: following, the job had not ended `timeout` seconds after the call.
        """
        if isinstance(lines, bool) or not isinstance(lines, int) or not 1 <= lines <= MAX_LINES:
            raise BadRequest(f"logs: lines = {lines!r}: an integer from 1 to {MAX_LINES:,} is expected")
        if not follow:
            yield from self._ask({"op": "logs", "job": _name(job), "lines": lines})["text"].splitlines()
            return
        deadline = Deadline(timeout) if timeout is not None else None
        record = self.job(job)
        while not record.started and not ended(record):
            self._pause(deadline, record)
            record = self.job(record.name)
        if not record.started:  # it ended without running (cancelled while queued): the daemon says so
            yield from self.logs(record.name, lines)
            return
        tails: dict[str, Tail] = {}
        current, looked = None, False  # the log whose lines were given last; after the first look
        while True:
            last = ended(record)
            for path in log_files(record):
                if path not in tails:  # the logs there at the first look: their last lines; later ones whole
                    tails[path] = Tail(Path(path), first=None if looked else lines)
                new = tails[path].read(final=last)
                if new and path != current:
                    yield f"==> {path} <=="
                    current = path
                yield from new
            looked = True
            if last:
                return
            self._pause(deadline, record)
            record = self.job(record.name)

    def _pause(self, deadline: Deadline | None, record: JobRecord) -> None:
        """Sleep `poll` seconds (less if the deadline comes sooner), or raise JobTimeout once
        the deadline has passed with the job still live."""
        if deadline is not None and deadline.expired():
            state = "cancelling (its supervisor is still stopping it)" if record.state == CANCELLED else record.state
            raise JobTimeout(f"job {record.name!r} is still {state} after {deadline.seconds:g} s of waiting"
                             + (f" ({record.message})" if record.message and record.state != CANCELLED else "")
                             + f"; its output folder is {record.output}", job=record.name, state=record.state)
        time.sleep(self.poll if deadline is None else deadline.slice(self.poll))

    # ------------------------------------------------------------------ what a job hands back

    def result(self, job: str | JobRecord) -> dict:
        """The job's result.json as a dict: its outcome (done, stopped, failed, diverged), why it
        ended, the epoch of the model chosen on validation, its test accuracy, seconds, ...
        (docs/jobs.md, "The output folder").

        Raises:
            GadeiError: the job has none (yet): it is queued or running, or it never ran.
        """
        from ..outputs import read_result

        record = self.job(job)
        result = read_result(Path(record.output))
        if result is None:
            raise GadeiError(f"job {record.name!r} has no result yet: {_why_nothing(record)}")
        return result

    def model_path(self, job: str | JobRecord) -> Path:
        """The path of the job's model (model.pt in its output folder: a PyTorch state dict,
        the model chosen on validation; for the candidates' mean a job that picks its model may
        hand back, every member's weights, each key prefixed by its workload: `gadei.ensemble`).
        Raises GadeiError while it has none."""
        record = self.job(job)
        path = Path(record.output, "model.pt")
        if not ended(record) or not path.is_file():
            raise GadeiError(f"job {record.name!r} has no model yet: {_why_nothing(record)}")
        return path

    def predict(self, job: str | JobRecord, texts: list[str], top: int = 3) -> list[list[tuple[str, float]]]:
        """For each of `texts` (a sentence; for a numeric workload, the features separated by
        commas), the `top` labels of the ended job's model with their probabilities, as `gadei
        predict` gives them (`gadei.predict.predict` on its output folder)."""
        from ..predict import predict

        return predict(str(self.model_path(job).parent), texts, top)  # predict checks texts and top


def ended(record: JobRecord) -> bool:
    """The job has ended: done, failed, or cancelled and its run stopped."""
    return record.state not in LIVE and record.ended > 0


def _why_nothing(record: JobRecord) -> str:
    if record.state in LIVE:
        return f"it is {record.state}; `wait` for it to end"
    if not record.started:
        return f"it never ran ({record.state}: {record.message})"
    if not ended(record):
        return "it is being cancelled: its run is still stopping"
    return f"it {record.state} ({record.message}) and left none in {record.output}"


def _name(job) -> str:
    name = job.name if isinstance(job, JobRecord) else job
    if not isinstance(name, str):
        raise GadeiError(f"a job is named by its name or its JobRecord, not by {type(job).__name__} ({job!r:.80})")
    return name


_FIELDS = {f.name for f in fields(JobRecord)}


def _record(answer: dict) -> JobRecord:
    try:
        return JobRecord(**{k: v for k, v in answer.items() if k in _FIELDS})  # a newer daemon's fields: left out
    except (TypeError, AttributeError) as err:
        raise DaemonError(f"the daemon answered with a job record that is not one: {err}") from None


def _refusal(answer: dict) -> DaemonRefused:
    """The error a refusal stands for: its kind (the class of the daemon's error), else DaemonRefused."""
    message, kind = str(answer.get("error", "the daemon refused")), answer.get("kind")
    if kind == "NoSuchJob":
        return NoSuchJob(message)
    if kind == "JobFileError":
        from ..jobfile import JobFileError

        return JobFileError(message)
    return DaemonRefused(message)


# ------------------------------------------------------------------ a job as a dict


def _write_job_file(job: dict, base: Path) -> str:
    """Check the job `job` by the job file's rules (relative paths from `base`) and write it as a
    job file (paths made absolute) in the state folder's job-files/; the file's path.

    Raises:
        JobFileError: naming the section and key (as "job dict: [train] lr = ...").
    """
    from .. import jobfile

    raw = _plain(job)
    parsed = jobfile.parse(raw, base.resolve() / DICT)
    written = {section: dict(table) for section, table in raw.items()}
    for key in ("train", "test", "validation"):  # the paths as the job's folder anchored them (a per-label
        given = raw["data"].get(key)  # folder as the files it holds)
        if given is not None:
            paths = [str(p) for p in getattr(parsed.data, key)]
            written["data"][key] = paths if isinstance(given, list) or len(paths) > 1 else paths[0]
    written.setdefault("output", {})["folder"] = str(parsed.output)
    try:
        text = jobfile.toml_text(written)
    except ValueError as err:  # a value TOML does not hold as given
        raise jobfile.JobFileError(f"{DICT}: {err}") from None
    folder = state_dir() / "job-files"
    folder.mkdir(mode=0o700, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=f"{parsed.name}.", suffix=".toml", dir=folder)  # one per submit, never
    with open(fd, "w", encoding="utf-8") as handle:  # another's: a refused submit must not touch a queued job's
        handle.write(text)
    return path


def _plain(value):
    """`value` as TOML reads it: paths as strings, tuples as lists (in dicts and lists)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _epoch(line: str) -> dict | None:
    """An evaluating learner's epoch record (a JSON line of its records, `gadei.outputs.EPOCHS`) as
    metrics.jsonl holds it."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("event") != "epoch":
        return None
    return {k: v for k, v in record.items() if k not in ("event", "job", "learner")}


# ------------------------------------------------------------------ the daemon as a service, its jobs as a table


def systemd_unit() -> str:
    """A systemd user unit that runs this gadei's daemon (`gadei daemon systemd-unit` prints it)."""
    env = "".join(f"Environment={name}={os.environ[name]}\n" for name in ("GADEI_STATE_DIR", "GADEI_RUNTIME_DIR")
                  if os.environ.get(name))
    return (
        "[Unit]\n"
        "Description=gadei daemon: queued training jobs of %u\n\n"
        "[Service]\n"
        "Type=simple\n"
        f"ExecStart={shlex.join(_proc.gadei_command('daemon', 'run'))}\n"
        f"ExecStop={shlex.join(_proc.gadei_command('daemon', 'stop'))}\n"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        "UMask=0077\n"
        "KillMode=process\n"  # jobs run in sessions of their own: stopping the daemon leaves them running
        + env +
        "\n[Install]\n"
        "WantedBy=default.target\n"
    )


def format_jobs(jobs: list[dict]) -> str:
    rows = [("job", "state", "submitted", "ran", "output", "note")]
    for j in jobs:
        ran = (j["ended"] or time.time()) - j["started"] if j["started"] else 0
        rows.append((j["name"], j["state"], time.strftime("%m-%d %H:%M:%S", time.localtime(j["submitted"])),
                     f"{ran:.0f} s" if j["started"] else "-", j["output"], j["message"]))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
