"""A job's supervisor, seen from gadei: its settings (declared once) and the command lines that
start it, what it leaves for others to read (its exit codes, its record in the runtime folder,
how far each learner it launched got), whether it lives (`alive`), and `Supervised`: a
supervisor as its client holds it (`gadei run`, the daemon), started, asked to stop, followed
to the job's end.

The supervisor itself is the package `gadei_watchdog` (the watchdog grown into the owner of a
job), a process of its own that uses gadei; gadei starts it and never imports it. One per job:
it starts the job's server and learners (its children, tied to it: they end when it does),
checkpoints the job, restarts what dies, decides that the job ended and why, and alone writes
the job's outputs; its clients start it, pass a stop on (SIGTERM) and read result.json. Its
record (`save_state`: its settings and the learners it launched) is what `gadei status` shows.
"""

import argparse
import glob
import json
import logging
import os
import signal
import stat
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import _proc, files, options, ring
from ._proc import python_command
from .checkpoint import CheckpointOptions
from .console import REFUSED, refusal_in  # a supervisor that exits REFUSED said why: it is not started again
from .env import runtime_dir
from .options import option, same_as

log = logging.getLogger(__name__)

PROGRAM = "gadei_watchdog"  # the supervisor's package, run as `python -m gadei_watchdog`
LOG = "logs/supervisor.log"  # a job's supervisor's own log, in its output folder
STOP_RECORD = "logs/server-stop.json"  # the last server's stop record (`gadei.server_record.StopRecord`)

# Why a supervisor's watch ended (its exit code under `gadei serve --checkpoint-dir`; 0: the job
# stopped). A job file's supervisor exits with the code `gadei run` reports (`gadei.outputs.exit_code`).
SERVER_DEAD = 3  # the server died or hung and was not (or could not be) restarted
LEARNERS_FAILED = 4  # the job ended after the supervisor gave up on a launched learner
JOB_FAILED = 5  # the server stopped the job as failed; nothing was restarted

DESCRIPTION = ("The supervisor of one job: start its server (--server's gadei arguments), report dead or hung "
               "learners and server, take a checkpoint between two updates every --every seconds, launch --learners "
               "and restart them when they die, restart a dead server; a SIGTERM or SIGINT is a stop it takes with a "
               "checkpoint of the learners' progress. Ends when the job stops (0; 4 when it gave up on a launched "
               "learner; 5 when the server failed the job) or its server is dead for good (3). `gadei serve "
               "--checkpoint-dir` becomes it; `gadei run` and the daemon start it with --job-file.")

_SUFFIX = ".supervisor.json"


def _strings(value: list) -> list:
    for item in value:
        if not isinstance(item, str):
            raise ValueError(f"holds {json.dumps(item)}, not a string; allowed: a JSON list of strings")
    return value


def _argument_lists(value: list) -> list:
    for item in value:
        if not isinstance(item, list) or not all(isinstance(a, str) for a in item):
            raise ValueError(f"holds {json.dumps(item)}, not a list of strings; allowed: a JSON list of lists of "
                             "strings")
    return value


@dataclass
class SupervisorSettings:
    """How a supervisor runs its job: what `gadei serve --checkpoint-dir` starts it with, and what a
    job file's supervisor derives from the job."""

    checkpoint_dir: str = option("", "where checkpoints go (and, by default, launched processes' logs)",
                                 metavar="DIR")
    every: float = same_as(CheckpointOptions, "interval")  # a job file's [checkpoint] interval
    keep: int = same_as(CheckpointOptions, "keep")
    interval: float = option(0.5, "seconds between looks and beats", low=0, low_open=True, high=3600)
    max_missed: int = option(20, "beats a process may miss before it counts as hung", low=1, high=10**6)
    server: list[str] = option([], "the gadei arguments that start the job's server (`serve JOB ...`), as this "
                               "supervisor's child; when it dies, it is started again with them plus --replace "
                               "--resume (gadei serve passes this)", allowed="a JSON list of strings", check=_strings)
    max_restarts: int = option(3, "restarts of the server, and of each launched learner, within the window before "
                               "giving up", low=1, high=10**6)
    window: float = option(300.0, "seconds over which restarts are counted", low=0, low_open=True, high=10**9)
    learners: list[list[str]] = option([], "learners to launch and keep running: the arguments after `gadei learn "
                                       "JOB` of each (gadei serve --learner passes this); each gets `--entry N`, its "
                                       "place in the list, unless it names an entry",
                                       allowed="a JSON list of lists of strings", check=_argument_lists)
    backoff: float = option(1.0, "seconds before a dead learner's first restart, doubling with each", low=0, high=3600)
    log_dir: str | None = option(None, "where launched processes write their logs", metavar="DIR",
                                 shown="--checkpoint-dir")

    def check(self) -> None:
        """Raises ValueError naming the first setting whose value is not allowed."""
        try:
            options.check_all(self)
        except ValueError as err:
            raise ValueError(f"supervisor {err}") from None
        if not self.server:
            raise ValueError("supervisor server: give the arguments that start the job's server")
        for name in ("checkpoint_dir", "log_dir"):
            folder = getattr(self, name)
            if folder and os.path.lexists(folder) and not os.path.isdir(folder):
                raise ValueError(f"supervisor {name} = {folder!r} is not a folder ({_what_is(folder)} is in its place)")


def _what_is(path: str) -> str:
    """What is at `path`, which is not a folder, in words."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return "a symbolic link to " + ("nothing" if not os.path.exists(path) else "something else")
    return ("a file" if stat.S_ISREG(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a device")


def _progress(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint's progress; allowed: a JSON object")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The supervisor's arguments: JOB and a flag for each setting, --progress; or --job-file."""
    parser.add_argument("job", nargs="?", help="the job to supervise; with --job-file, the name of the job it "
                        "holds, checked against it (so `ps` shows every process of a job with its name)")
    options.add_arguments(parser, SupervisorSettings)
    parser.add_argument("--progress", metavar="JSON", type=_progress, default={}, help="how far each launched "
                        "learner got, from the checkpoint the server resumed from: they start there")
    parser.add_argument("--job-file", metavar="FILE", help="run the job whose prepared output folder holds this "
                        "job.toml (`gadei run` and the daemon prepare it) to its end: its server, learners, "
                        "checkpoints and outputs (the other flags come from it)")
    parser.add_argument("--resume", action="store_true", help="--job-file: go on from the newest checkpoint of its "
                        "output folder that records the learners' progress")
    parser.add_argument("--by", default="gadei run", help="--job-file: the command that started the job, which "
                        "what it says to go on with it names (gadei run, gadei submit)")
    parser.add_argument("--named", metavar="FILE", help="--job-file: the job file the job was started from, "
                        "which what it says to go on with it names (default: the job.toml it runs)")
    parser.add_argument("--since", type=float, help="--job-file: when this run of the job started (seconds since "
                        "the epoch), where a supervisor before this one started it (default: now)")
    parser.add_argument("--claim", action="store_true", help="--job-file: claim the output folder (`gadei.claim`) "
                        "once the processes of the supervisor before this one let go of it, where no claim was "
                        "handed to this one (a restarted daemon's); refuse the job where another run holds it")


def command(job: str, settings: SupervisorSettings, progress: dict | None = None) -> list[str]:
    """The command line of the supervisor of `job` with `settings` (its launched learners starting
    from `progress`, a checkpoint's)."""
    return python_command(PROGRAM, job, *options.to_argv(settings),
                          *([f"--progress={json.dumps(progress)}"] if progress else []))


def job_command(name: str, job_file: Path, *, resume: bool, by: str, named: Path | None = None,
                since: float | None = None, claim: bool = False) -> list[str]:
    """The command line of the supervisor that runs the prepared job `name`, whose job.toml is
    `job_file`, to its end (`named`: the job file it was started from; `since`: when this run of
    the job started, where an earlier supervisor started it; `claim`: it claims the output folder
    itself). It carries the name as the job's server and learners do, so `ps` (and `pkill -f
    NAME`) find the whole job by it."""
    return python_command(PROGRAM, name, "--job-file", str(job_file), "--by", by, *(["--resume"] if resume else []),
                          *([f"--named={named}"] if named else []), *([f"--since={since!r}"] if since else []),
                          *(["--claim"] if claim else []))


# ------------------------------------------------------------------ what it leaves behind


@dataclass
class Launched:
    """One learner the supervisor launched, across its restarts.

    Attributes:
        number: its place in the job's list of learners (0, 1, ...).
        args: the arguments after `gadei learn JOB`.
        start_at: samples of its schedule its current process skipped.
        pid, started: its current process (pid and start time; 0 when none runs).
        entry: the learner entry (ring) that process holds, once it attached.
        seen: samples that process had published when last looked at.
        done: it finished its schedule.
        failed: it died too often within the window; no more restarts.
        error: what its last process refused, where its log's last line says (`console.refusal_in`).
        restarts: wall-clock times it was started again after a death.
        due: wall-clock time of the next start (0: none pending).
    """

    number: int
    args: list[str]
    start_at: int = 0
    pid: int = 0
    started: float = 0.0
    entry: int = -1
    seen: int = 0
    done: bool = False
    failed: bool = False
    error: str = ""
    restarts: list[float] = field(default_factory=list)
    due: float = 0.0

    def __post_init__(self):
        self.proc: subprocess.Popen | None = None  # its process, the supervisor's child
        self.oom_kills: int | None = None  # `_proc.oom_kills()` when the supervisor started it

    @property
    def running(self) -> bool:
        return self.pid != 0


def progress(table: list[Launched], ckpt) -> dict:
    """What a checkpoint taken now holds of each launched learner's schedule (the
    `checkpoint.take` progress hook), by learner number as text: samples, or "done".

    A running learner's samples are those the server applied from its ring (the counters are
    part of the same capture); a dead one waiting for its restart already counts what it
    published in `start_at`.
    """
    out = {}
    for learner in table:
        if learner.done:
            out[str(learner.number)] = "done"
            continue
        # its entry's counters, or, once it gave the entry back, the record it kept then
        # (`gadei.ring.applied_in`)
        applied = ring.applied_in(ckpt.learners, learner.pid) if learner.running else 0
        out[str(learner.number)] = learner.start_at + applied
    return out


def state_path(job: str) -> str:
    """Where a job's supervisor keeps its settings and launched learners (for `gadei status`)."""
    return os.path.join(runtime_dir(), job + _SUFFIX)


def saved_jobs() -> dict[str, str]:
    """The jobs whose supervisor's record is in the runtime folder: job name -> the record's path.

    Raises:
        PermissionError: the runtime folder is not the user's own and private (`env.runtime_dir`).
    """
    return {os.path.basename(path)[: -len(_SUFFIX)]: path
            for path in glob.glob(os.path.join(glob.escape(runtime_dir()), "*" + _SUFFIX))}


def save_state(job: str, settings: dict, table: list[Launched]) -> None:
    """Write the supervisor's record atomically (a reader never sees half a file)."""
    files.replace(state_path(job), json.dumps({"job": job, "settings": settings,
                                               "learners": [asdict(learner) for learner in table]}))


def load_state(job: str) -> tuple[dict, list[Launched]]:
    """The record a job's supervisor saved; FileNotFoundError when it saved none."""
    with open(state_path(job)) as handle:
        data = json.load(handle)
    return data["settings"], [Launched(**learner) for learner in data["learners"]]


def remove_state(job: str) -> None:
    """At the supervisor's end: its record goes, so that a runtime folder does not gather one per
    job ever run."""
    try:
        os.unlink(state_path(job))
    except FileNotFoundError:
        pass


def registered(region) -> tuple[int, float]:
    """The supervisor a job's region names (pid, start time; pid 0: none registered)."""
    h = region.header
    return h.get("supervisor_pid"), h.get("supervisor_start")


def alive(region) -> bool:
    """Whether the job's supervisor (the one its region's header names) lives: the one answer to
    "is this job's supervisor alive" (`gadei status`, a bridge waiting for a restarted server)."""
    return _proc.alive(*registered(region))


# ------------------------------------------------------------------ a client's supervisor


class Supervised:
    """A job file's supervisor as its client (`gadei run`, the daemon) holds it: started
    (`start`), asked to stop (`stop`: SIGTERM, which it takes as a stop at any moment, even
    while it starts), followed (`ended`) to the job's end, which its result.json records.

    A supervisor that died without writing result.json took its job down with it (its server
    and learners are tied to it); `ended` then starts a new one that goes on from the newest
    checkpoint that records the learners' progress, or from the job's start where none does yet
    (a job shorter than its first checkpoint interval; at most `restarts` times within `window`
    seconds, never after a stop was asked, nor after one that refused: exit code 2, its last line
    says why), or answers the end with the reason when none can.

    Args:
        name: the job's name.
        job_file: the job as run (its prepared output folder's job.toml: `gadei.prepare.prepare`).
        named: the job file it was started from (what it says to go on with it names).
        out: the job's output folder.
        by: the command that started the job (what the job says to go on with it names).
        env: the supervisor's environment (None: this process's).
        log: where its output goes (a path, appended to; None: this process's own).
        private: the log is made 0600 whatever the umask (the job's [output] private).
        pid, started, since: a supervisor an earlier client started (a restarted daemon's),
            followed by its pid and start time instead of started anew, and when the run it
            supervises started (the job's time base, which a supervisor that replaces it goes on
            in: `--since`).
        zygote: a `gadei.zygote.Zygote` to fork the supervisor from (the daemon's: it starts
            warm), where it is alive; else a new interpreter runs it.
        claim: the run's claim on the output folder (`gadei.claim.take`), held until the job
            ended; the supervisor holds it too (forked from this process or its zygote, or handed
            it as it starts a new interpreter). None (a restarted daemon's, which the job's
            processes hold the claim from): a supervisor that replaces the one that died claims
            the folder itself, once that one's processes let go of it.
    """

    def __init__(self, name: str, job_file: Path, out: Path, *, by: str, named: Path | None = None,
                 env: dict | None = None, log: Path | None = None, private: bool = True, pid: int = 0,
                 started: float = 0.0, since: float | None = None, restarts: int = 3, window: float = 300.0,
                 zygote=None, claim=None):
        self.name, self.job_file, self.out, self.by = name, job_file, out, by
        self.env, self.log, self.private = env, log, private
        self.zygote, self.claim = zygote, claim
        self.named = named
        self.proc: subprocess.Popen | None = None
        self.pid, self.started = pid, started
        self.oom_kills = _proc.oom_kills()
        self.restarts, self.window = restarts, window
        self._deaths: list[float] = []
        self.since = since  # when its first supervisor started: the run's start
        self.stop_asked = False
        self.said = ""  # how the last supervisor ended, when it died

    def start(self, resume: bool = False, said: list[str] = ()) -> None:
        """Start the supervisor (`resume`: it goes on from the newest checkpoint that records the
        learners' progress); `said`: lines written to its log first (what was chosen for the job)."""
        from .launch import spawn, started_as

        self.oom_kills = _proc.oom_kills()
        command = job_command(self.name, self.job_file, resume=resume, by=self.by, named=self.named, since=self.since,
                              claim=self.claim is None)
        self.since = self.since or time.time()
        # in a session of its own (it outlives its client); a stop sent at once waits for its handler
        self.proc, self.pid = None, 0
        keep = (self.claim.fileno(),) if self.claim is not None else ()  # a new interpreter's too
        if self.log is None:
            self.proc = spawn(command, env=self.env, held=True, keep=keep)
        else:
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600 if self.private else 0o666)
            with open(fd, "ab") as log_file:
                log_file.write("".join(f"{line}\n" for line in said).encode())
                log_file.flush()
                self.pid = self._fork(command, log_file)
                if not self.pid:
                    self.proc = spawn(command, log=log_file, env=self.env, held=True, keep=keep)
        self.pid = self.proc.pid if self.proc is not None else self.pid
        try:
            self.started = _proc.start_time(self.pid)
        except Exception:  # noqa: BLE001 - it ended at once: `ended` says how
            self.started = 0.0
        log.info("job folder %s: supervisor pid %d started (%s)%s", self.out, self.pid,
                 started_as(self.proc) if self.proc is not None else "forked warm by the zygote",
                 ", resuming" if resume else "")

    def _fork(self, command: list[str], log_file) -> int:
        """The pid of the supervisor its zygote forked; 0 where it has none alive, or it could not."""
        if self.zygote is None or not self.zygote.alive():
            return 0
        try:
            return self.zygote.start(command, log_fd=log_file.fileno(), env=dict(os.environ if self.env is None
                                                                                 else self.env),
                                     hold=self.claim.fileno() if self.claim is not None else None)
        except OSError as err:
            log.warning("job folder %s: %s; its supervisor starts a new interpreter", self.out, err)
            return 0

    def release(self) -> None:
        """The job ended: this client's claim on its folder goes (its supervisor's went with it)."""
        if self.claim is not None:
            self.claim.close()
            self.claim = None

    def stop(self) -> None:
        """Ask the job to stop (a stop it takes once: the checkpoint of the learners' progress,
        then the server's stop); a supervisor held by SIGSTOP takes it once it goes on."""
        self.stop_asked = True
        if self.running():
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def running(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return _proc.alive(self.pid, self.started)

    def wait(self, seconds: float) -> None:
        """Wait up to `seconds`, less where the supervisor (this process's child) ends first."""
        if self.proc is None:
            time.sleep(seconds)
            return
        try:
            self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            pass

    def code(self, wait: float = 0.0) -> int | None:
        """Its exit code where it was this process's child (or its zygote's, which tells it within
        `wait` seconds of its end) and ended, else None."""
        if self.proc is not None:
            return self.proc.poll()
        return self.zygote.code(self.pid, wait) if self.zygote is not None else None

    def ended(self) -> dict | None:
        """None while the job runs (a supervisor that died is replaced here, where it may be);
        result.json once the job ended; {"outcome": None, "reason": ...} where its supervisor
        died, no result.json says how the job ended, and no new one may go on with it."""
        from .outputs import going_on, read_result

        if self.running():
            return None
        result = read_result(self.out)
        if result is not None:
            self.release()
            return result
        code = self.code(wait=2.0)
        how = _proc.how_it_ended(code, self.oom_kills)
        self.said = f"its supervisor (pid {self.pid}) {how}"
        now = time.time()
        self._deaths = [t for t in self._deaths if now - t < self.window]
        found = going_on(self.out)  # its newest checkpoint that records the learners' progress (or its candidate's)
        refused = code == REFUSED  # it said why (not even result.json could be written): a new one would again
        if not self.stop_asked and not refused and len(self._deaths) < self.restarts:
            self._deaths.append(now)
            log.warning("job folder %s: %s; a new one goes on from %s", self.out, self.said,
                        found or "the job's start (no checkpoint records the learners' progress yet)")
            self.start(resume=True)
            return None
        self.release()
        if self.stop_asked:
            why = "it was being stopped"
        elif refused:
            said = refusal_in(self.log) if self.log is not None else ""  # else it went to our stderr
            why = f"it refused to go on: {said}" if said else "it refused to go on"
        else:
            why = f"it died {len(self._deaths) + 1} times within {self.window:g} s"
        return {"outcome": None, "reason": f"{self.said} and no new one goes on with the job ({why})",
                "resumable": found is not None}
