"""The daemon's jobs: their records on disk, the queue, and the runner that prepares each job,
starts its supervisor (`gadei.supervisor.Supervised`) and reads its result.json at the job's
end (`Jobs`); `gadei.daemon.service` serves them on the socket."""

import json
import logging
import os
import threading
import time
import typing
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .. import _proc, data, files, jobfile, outputs
from ..env import CORES, environ, state_dir as state_folder, usable_cores
from ..errors import GadeiError, NoSuchJob
from ..outputs import SUBMIT
from ..supervisor import Supervised
from ..zygote import Zygote
from . import logs, resources

if typing.TYPE_CHECKING:
    from ..prepare import Prepared

log = logging.getLogger(__name__)

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"
STATES = (QUEUED, RUNNING, DONE, FAILED, CANCELLED)
LIVE = (QUEUED, RUNNING)
STARTING = "starting: checked again"  # a queued job's message while the runner prepares it


def state_dir(create: bool = True) -> Path:
    """The daemon's state folder (its lock, and the job records in jobs/); `create`: make it
    (0700) if it is missing, as the daemon does, not a reader of the records."""
    path = Path(state_folder())
    if create:
        (path / "jobs").mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


@dataclass
class JobRecord:
    """One submitted job, as the daemon keeps it on disk."""

    name: str
    jobfile: str  # the job file as submitted (absolute)
    output: str
    state: str = QUEUED
    submitted: float = 0.0
    started: float = 0.0
    ended: float = 0.0
    pid: int = 0  # the job's supervisor while it runs
    pid_start: float = 0.0
    returncode: int | None = None
    message: str = ""  # how it ended; while it waits, what for
    resume: bool = False  # go on with the run its output folder holds (`gadei submit --resume`)
    priority: int = 0  # its [job] priority: a waiting job of a higher one starts first
    sizes: dict | None = None  # what it asks for (`resources.Sizes`), read at submit
    cores: int = 0  # the cores it was given to choose its threads by (GADEI_CORES), once it started
    need: dict | None = None  # what it was given (`resources.Need`) while it runs

    def __post_init__(self) -> None:
        """A record read from disk, or from the daemon's answer, holds what the daemon writes.

        Raises:
            TypeError: naming the first field that does not.
        """
        for f in fields(self):
            value, kinds = getattr(self, f.name), _KINDS[f.name]
            if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
                raise TypeError(f"its {f.name} is {value!r:.60}, not {' or '.join(k.__name__ for k in kinds)}")
        if self.state not in STATES:
            raise TypeError(f"its state is {self.state!r:.60}, not one of {', '.join(STATES)}")

    @property
    def log(self) -> str:
        from ..supervisor import LOG

        return os.path.join(self.output, LOG)


def _kinds(annotation) -> tuple:
    """The types a field's annotation takes (`int | None`: int, NoneType); a float field takes an int."""
    kinds = typing.get_args(annotation) or (annotation,)
    return (int, *kinds) if float in kinds else kinds


_KINDS = {f.name: _kinds(f.type) for f in fields(JobRecord)}  # each field's types, as its annotation says


def read_records(folder: Path) -> dict[str, JobRecord]:
    """The job records in the state folder `folder` (none if it has none), by name; an
    unreadable one is skipped with a warning. What a starting daemon knows, and what `gadei
    status` and `gadei logs` show while no daemon runs."""
    records = {}
    known = {f.name for f in fields(JobRecord)}
    for path in sorted((folder / "jobs").glob("*.json")):
        try:
            raw = json.loads(path.read_text())
            if not isinstance(raw, dict):
                raise ValueError(f"{type(raw).__name__}, not a JSON object")
            record = JobRecord(**{k: v for k, v in raw.items() if k in known})
        except (OSError, ValueError, TypeError) as err:
            log.warning("skipping the unreadable job record %s: %s", path, err)
            continue
        records[record.name] = record
    return records


def job_logs(record: JobRecord, lines: int) -> str:
    """The last `lines` lines of each of a job's logs (`gadei logs`: its supervisor's, its
    server's, each learner's), or why it has none: a job that never started
    (cancelled while queued, or one that could not start) says so."""
    parts = []
    for path in logs.log_files(record):
        try:
            text = logs.tail(path, lines)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as err:
            text = f"(unreadable: {err.strerror})"
        parts.append(f"==> {path} <==\n" + text)
    if record.started:
        return "\n".join(parts) if parts else f"job {record.name!r} has no logs yet"
    if record.state == QUEUED:
        why = f"job {record.name!r} is queued: it has not started yet, so it has no logs"
    elif record.state == CANCELLED:
        why = f"job {record.name!r} was cancelled before it started: it never ran, so it has no logs"
    else:
        why = f"job {record.name!r} never started ({record.state}: {record.message}), so it has no logs"
    return why + ("; the logs in its output folder are an earlier run's:\n" + "\n".join(parts) if parts else "")


class Jobs:
    """The daemon's jobs: their records (read from `folder`'s jobs/ at the start, saved on every
    change), the queue and the runner (`run_queue`): each waiting job, by priority then by
    submit time, starts when what it needs is free (`resources`; max_jobs None), or while fewer
    than `max_jobs` run."""

    def __init__(self, folder: Path, max_jobs: int | None = None, poll: float = 0.5):
        self.folder, self.max_jobs, self.poll = folder, max_jobs, poll
        self.lock = threading.Lock()
        self.records: dict[str, JobRecord] = read_records(self.folder)
        self.supervised: dict[str, Supervised] = {}  # each running job's supervisor
        self._stop = threading.Event()
        self._kick = threading.Event()  # a look is due now: a job was submitted, or a supervisor ended
        self.zygote: Zygote | None = None  # where the runner starts supervisors warm (`gadei.zygote`)
        # the last submit's job as checked, and what its data was made of (`data.fingerprint`): its
        # start takes its data sets where unchanged (one job's at most: they are held in memory)
        self._checked: dict[str, tuple[str, "Prepared"]] = {}
        self._submitting: dict[str, str] = {}  # the jobs a submit checks now: name -> output folder
        with self.lock:
            for record in self.records.values():
                if record.pid and not record.ended:  # running, or cancelled and still stopping
                    # a supervisor an earlier daemon started: followed by its pid and start time
                    self.supervised[record.name] = self._supervised(record, pid=record.pid, started=record.pid_start,
                                                                    since=record.started or None)

    # ------------------------------------------------------------------ records

    def _save(self, record: JobRecord) -> None:
        files.replace(self.folder / "jobs" / f"{record.name}.json", json.dumps(asdict(record), indent=1))

    def _supervised(self, record: JobRecord, **kw) -> Supervised:
        try:
            private = jobfile.load(Path(record.output) / "job.toml").private
        except GadeiError:  # not prepared yet, or gone: its log is private until the job says otherwise
            private = True
        supervised = Supervised(record.name, Path(record.output) / "job.toml", Path(record.output), by=SUBMIT,
                                zygote=self.zygote, named=Path(record.jobfile),
                                env={**os.environ, **self._cores_env(record)}, log=Path(record.log), private=private,
                                **kw)
        supervised.stop_asked = record.state == CANCELLED  # a cancelled job's supervisor is not replaced
        return supervised

    def _cores_env(self, record: JobRecord) -> dict[str, str]:
        """GADEI_CORES for the job: the cores it was given, where fewer than the usable ones."""
        return {CORES: str(record.cores)} if 0 < record.cores < usable_cores() else {}

    def _conclude(self, record: JobRecord, result: dict, code: int | None) -> None:
        """The job ended: its state from its result.json (`gadei.outputs`), or, where its supervisor
        died and none could go on with it, from the reason (`result`'s "reason"). `code`: its
        supervisor's exit code where known."""
        out = Path(record.output)
        outcome = result.get("outcome")
        # when it ended: its result.json's time (a job that ended while no daemon ran ended then,
        # not when this daemon came to read it)
        at = _written_at(out / "result.json") if outcome is not None else None
        try:
            said = outputs.summary(jobfile.load(record.jobfile), result, SUBMIT) if outcome is not None else ""
        except GadeiError:  # its job file is gone: result.json's words alone
            said = f"{outcome}: {result.get('reason', '')}"
        if outcome == outputs.DONE:
            self._finish(record, DONE, code, (said + "; the cancel came after training ended")
                         if record.state == CANCELLED else said, at)
        elif record.state == CANCELLED and outcome is not None:
            self._finish(record, CANCELLED, code, f"cancelled; {said}", at)  # its model so far; how to go on
        elif record.state == CANCELLED:  # its supervisor died before it stopped the job
            self._finish(record, CANCELLED, code, f"cancelled; {result['reason']}; " + (
                f"go on with {outputs.go_on(record.jobfile, SUBMIT)}" if result.get("resumable") else
                "no checkpoint records the learners' progress"))
        elif outcome is not None:
            self._finish(record, FAILED, code, said, at)
        else:
            self._finish(record, FAILED, code, f"{result['reason']}; " + (
                f"go on with {outputs.go_on(record.jobfile, SUBMIT)}" if result.get("resumable") else
                f"see `gadei logs {record.name}`"))

    def _finish(self, record: JobRecord, state: str, code: int | None, message: str = "",
                at: float | None = None) -> None:
        """Record the job's end: `state`, its run's exit `code`, `message`, and when (`at`; None: now)."""
        record.state, record.returncode, record.ended, record.pid = state, code, at or time.time(), 0
        record.need = None  # what it was given is free again
        record.message = message
        self._save(record)
        log.info("job %s %s%s", record.name, state, f": {message}" if message else "")

    # ------------------------------------------------------------------ requests

    def submit(self, path: str, resume: bool = False) -> JobRecord:
        """Check a job file and its data now, then queue it; `resume`: to go on with the run in
        its output folder. Raises GadeiError saying why not."""
        job = jobfile.load(path)
        with self.lock:
            old = self.records.get(job.name)
            if old is not None and old.state in LIVE:
                raise GadeiError(f"job {job.name!r} is already {old.state}; cancel it first or give the job "
                                 "another [job] name")
            if old is not None and old.state == CANCELLED and not old.ended:  # its supervisor still stops it
                raise GadeiError(f"job {job.name!r} is being cancelled: its supervisor is still stopping it (its "
                                 "checkpoint, then its outputs); submit it again once `gadei status` no longer says "
                                 "cancelling")
            if job.name in self._submitting:  # two submits of one name at once: the later would replace the first
                raise GadeiError(f"job {job.name!r} is being submitted by another submit, which checks its data "
                                 "now; submit it again once that one is answered, or give the job another [job] name")
            # a folder a queued job will run in looks empty to a check: the later job would fail as it started
            out = str(job.output)
            taken = [(r.name, r.state) for r in self.records.values() if r.state in LIVE and r.output == out]
            taken += [(name, "being submitted") for name, folder in self._submitting.items() if folder == out]
            if taken:
                raise GadeiError(f"output folder {out} is that of job {taken[0][0]!r}, which is {taken[0][1]}; set "
                                 "another [output] folder")
            self._submitting[job.name] = out
        try:
            return self._queue(job, resume)
        finally:
            with self.lock:
                del self._submitting[job.name]

    def _queue(self, job: jobfile.Job, resume: bool) -> JobRecord:
        """`submit`'s checks of a job no other holds the name of, then its record, queued."""
        from ..prepare import check

        # what `gadei run` would refuse (a squatted region name, the data, the output folder, the
        # resume point) is the submitter's to hear now, not the log's
        made_of = _made_of(job)  # before the files are read: a change as they are read is one since
        prepared = check(job, resume, by=SUBMIT)
        from gadei_workloads.cost import estimate  # torch, which reading the data imported

        # a job that picks its model trains its candidates one after another: it needs what the largest needs,
        # and its supervisor holds every candidate's data sets (each its own vocabulary) as it goes
        candidates = prepared.candidates or [prepared]
        held = sum(data.footprint((each.train, each.validation, each.test)) for each in candidates)
        sizes = max((resources.sizes(each.job, estimate(each.job.workload, each.train), job.train.threads or 0, held)
                     for each in candidates), key=lambda s: (s.region + s.processes, s.learners))
        if self.max_jobs is None:
            cores = usable_cores()
            never = resources.never(sizes.need(cores, cores))
            if never:
                raise GadeiError(f"job {job.name!r} could never start on this machine: {never}")
        record = JobRecord(name=job.name, jobfile=str(job.path), output=str(job.output), submitted=time.time(),
                           resume=resume, priority=job.priority, sizes=asdict(sizes))
        with self.lock:
            self.records[job.name] = record
            self._save(record)
            self._checked = {job.name: (made_of, prepared)} if made_of else {}
        log.info("job %s queued (%s)", job.name, job.path)
        self._kick.set()
        return record

    def cancel(self, name: str) -> JobRecord:
        """Cancel a queued job, or stop a running one as Ctrl-C stops `gadei run` (its supervisor
        takes a checkpoint that records the learners' progress, then stops the job; a job whose
        training had ended is done). Answers at once: a running job's state is `cancelled` with
        the message "cancelling" until its supervisor has ended it (`_reap`)."""
        with self.lock:
            record = self._get(name)
            if record.state == QUEUED:
                self._checked.pop(name, None)
                self._finish(record, CANCELLED, None, "cancelled before it started")
                return record
            if record.state != RUNNING:
                raise GadeiError(f"job {name!r} is {record.state}; nothing to cancel")
            supervised = self.supervised.get(name)
            if supervised is not None:
                supervised.stop()  # its supervisor stops the job: a checkpoint to go on from, logs kept
            record.message = "cancelling"
            record.state = CANCELLED
            self._save(record)
        return record

    def logs(self, name: str, lines: int) -> str:
        with self.lock:
            record = self._get(name)
        return job_logs(record, lines)

    def _get(self, name: str) -> JobRecord:
        record = self.records.get(name)
        if record is None:
            raise NoSuchJob(f"the daemon has no job {name!r} (known: {', '.join(sorted(self.records)) or 'none'})")
        return record

    # ------------------------------------------------------------------ the runner

    def run_queue(self) -> None:
        """Start queued jobs while fewer than max_jobs run; notice the ones that ended."""
        try:
            while not self._stop.is_set():
                try:
                    self._warm()
                    self._run_once()
                except Exception:  # e.g. a record that cannot be saved (disk full): log it, the loop goes on
                    log.exception("the runner failed; trying again in %g s", self.poll)
                self._kick.wait(self.poll)
                self._kick.clear()
        finally:
            if self.zygote is not None:
                self.zygote.close()

    def _warm(self) -> None:
        """A zygote to start supervisors from: started with the runner, and again if it died."""
        if self.zygote is not None and self.zygote.alive():
            return
        if self.zygote is not None:
            log.warning("the zygote (pid %d) %s; starting another", self.zygote.proc.pid,
                        _proc.how_it_ended(self.zygote.proc.returncode))
            self.zygote.close()
        self.zygote = Zygote(on_exit=self._kick.set)

    def stop_runner(self) -> None:
        """End `run_queue` (at its next look)."""
        self._stop.set()
        self._kick.set()

    def _run_once(self) -> None:
        """One look: reap the jobs that ended, start the waiting ones that fit (by priority, then
        by submit time: one that does not fit does not hold back a later one that does), and say
        of the others what they wait for; a job that cannot start is failed with the reason and
        the next one is started instead. A job is prepared (its data read: minutes for a large
        set) without the lock, so that the daemon answers meanwhile."""
        starts = []
        with self.lock:
            self._reap()
            running = [r for r in self.records.values() if r.name in self.supervised]
            queued = sorted((r for r in self.records.values() if r.state == QUEUED),
                            key=lambda r: (-r.priority, r.submitted))
            cores = usable_cores()
            given = [resources.Need(**r.need) for r in running if r.need]
            for record in queued:
                if self.max_jobs is not None:  # a count: each job its equal share of the cores
                    if len(running) >= self.max_jobs:
                        break
                    share, need = cores // self.max_jobs, None
                else:
                    sizes = resources.Sizes(**record.sizes) if record.sizes else resources.Sizes(1, 1, 0, 0)
                    share = resources.share(cores, sizes.learners, len(running) + len(queued))
                    need = sizes.need(cores, share)
                    short = need.short(resources.free(given))
                    if short:
                        self._waits(record, short)
                        continue
                record.message = STARTING  # what `gadei status` says while it is prepared (not saved)
                starts.append((record, share, need))  # counted as running: the next ones fit beside it
                running.append(record)
                given += [need] if need else []
        for record, share, need in starts:
            try:
                self._start(record, share, need)
            except Exception as err:  # this job cannot start; the queue goes on with the next
                reason = _reason(err)
                log.warning("job %s could not start: %s", record.name, reason)
                with self.lock:
                    if record.state != QUEUED:  # cancelled as it was prepared (its end), or started: not failed
                        continue
                    try:
                        self._finish(record, FAILED, None, f"could not start: {reason}")
                    except OSError as save_err:  # the record stays queued in memory only: drop it
                        log.error("job %s: cannot save its record (%s); forgetting it", record.name, save_err)
                        self.records.pop(record.name, None)

    def _waits(self, record: JobRecord, short: str) -> None:
        """The queued job waits: what for, on its record (`gadei status`), when that changed."""
        message = f"waiting: {short}"
        if record.message != message:
            record.message = message
            self._save(record)
            log.info("job %s %s", record.name, message)

    def _start(self, record: JobRecord, cores: int, need: "resources.Need | None") -> None:
        """Prepare the job: the checks of its submit again (its folder may have changed since), on
        the data sets its submit read where its job file and data files are unchanged (else read
        again), with `cores` to choose its threads by; then start its supervisor, in a session of
        its own, writing its log in the output folder; a cancel that comes at once is a stop it
        takes. `need`: what it is given while it runs. Called without the lock, which it takes
        once the job is prepared: a job cancelled meanwhile is not started."""
        from ..placement import Local
        from ..prepare import describe, prepare

        if os.path.lexists(record.output) and not os.path.isdir(record.output):
            raise GadeiError(f"output folder {record.output} is not a folder")
        record.cores = cores
        with self.lock:
            made_of, checked = self._checked.pop(record.name, (None, None))
        with environ(self._cores_env(record)):  # the defaults it chooses count on its share of the cores
            job = jobfile.load(record.jobfile)
            if checked is not None and made_of == _made_of(job):
                log.info("job %s starts with the data its submit read (its job file and data files unchanged since)",
                         record.name)
            else:
                checked = None
            # encoded: its supervisor, forked by the zygote without them, reads its sets as encoded here
            prepared = prepare(job, record.resume, by=SUBMIT, encoded=True, checked=checked)
            said = describe(prepared, Local())
        with self.lock:
            if self.records.get(record.name) is not record or record.state != QUEUED:
                log.info("job %s was %s as it was prepared; not started", record.name, record.state)
                prepared.claim.close()
                return
            supervised = self._supervised(record, claim=prepared.claim)
            try:
                supervised.start(resume=record.resume, said=said)
            except BaseException:
                supervised.release()
                raise
            self.supervised[record.name] = supervised
            record.state, record.pid, record.pid_start, record.started = RUNNING, supervised.pid, \
                supervised.started, supervised.since
            record.need, record.message = asdict(need) if need else None, ""
            self._save(record)
        log.info("job %s started (supervisor pid %d)", record.name, supervised.pid)

    def _reap(self) -> None:
        """Each running job's supervisor looked at: a job that ended concluded, a supervisor that
        died replaced (`Supervised.ended`: its new pid recorded)."""
        for name, supervised in list(self.supervised.items()):
            record = self.records.get(name)
            if record is None:
                del self.supervised[name]
                continue
            result = supervised.ended()
            if result is None:
                if (record.pid, record.pid_start) != (supervised.pid, supervised.started):  # a new one goes on
                    record.pid, record.pid_start = supervised.pid, supervised.started
                    self._save(record)
                continue
            del self.supervised[name]
            self._conclude(record, result, supervised.code(wait=1.0))


def _made_of(job: jobfile.Job) -> str | None:
    """`data.fingerprint` of the submitted job (its job file, its data files); None where one of
    them cannot be read (its check says why)."""
    try:
        return data.fingerprint(job, job.path)
    except OSError:
        return None


def _reason(err: Exception) -> str:
    if isinstance(err, OSError) and err.strerror:
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    return str(err) or type(err).__name__


def _written_at(path: Path) -> float | None:
    """When `path` was last written (not after now), or None where it cannot be read."""
    try:
        return min(time.time(), path.stat().st_mtime)
    except OSError:
        return None
