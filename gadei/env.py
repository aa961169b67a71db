"""Every GADEI_* environment variable, read when asked for (never at import time).

| variable | meaning | default |
|---|---|---|
| GADEI_CORES | the cores gadei's choices count on: learners' threads = "auto", the server's kernel team (GADEI_THREADS) and its spin for the next gradient; at most the usable cores | the usable cores (the affinity, a container's or taskset's share, or the cgroup's CPU quota where that is fewer: `gadei.cgroup`); in a job the daemon runs beside others (`--max-jobs` N), the daemon's cores / N |
| GADEI_THREADS | the most OpenMP threads of the server's update kernel (a team has one thread per 262,144 elements of the update) | half the usable cores (GADEI_CORES), at least 1 |
| GADEI_SPIN_US | the most microseconds the server spins for the next gradient, while they come less than 200 us apart and it has a core of its own | 2000 |
| GADEI_ATTACH_TIMEOUT | seconds a learner waits for the job's region and weights | 30 |
| GADEI_SERVER_TIMEOUT | seconds without a server heartbeat before a waiting learner gives up | 30 |
| GADEI_LOG | log level of the command-line tools (DEBUG, INFO, WARNING) | INFO (WARNING in `gadei run`'s own process, whose lines say what happens) |
| GADEI_DATA_DIR | folder of the shared text data sets (tests, `gadei learn --data trec`) | ../shared/data |
| GADEI_STATE_DIR | the daemon's state folder: its lock, and the job records in its jobs/ | $XDG_STATE_HOME/gadei, else ~/.local/state/gadei |
| GADEI_RUNTIME_DIR | this user's folder for gadei's runtime files (a job's supervisor's record, which `gadei status` shows; the daemon's socket) | $XDG_RUNTIME_DIR/gadei, else /tmp/gadei-UID |
| GADEI_PAUSE_AT | a test's hold: a job's supervisor stops itself (SIGSTOP) at this point of its life, until continued (SIGCONT): `concluding`, the job's end decided, its outputs not yet written | none |

Two more are read outside Python: GADEI_NO_OPENMP=1 at build time (setup.py builds the
kernel serial) and GADEI_NO_AVX2=1 when gadei._native loads (the portable kernel even where
the CPU has AVX2; the tests use it to check that path). GADEI_RESTARTS is gadei's own
bookkeeping, not a setting: the times of a job's recent server restarts, which a
supervisor hands to the server it restarts (the server shows their count in `gadei status`),
written by `restarts_env` and read by `restarts`.

One variable of OpenMP's own is set by `quiet_openmp`, in a server's process only and for as
long as its OpenMP runtime takes to load: OMP_WAIT_POLICY=PASSIVE, unless it or GOMP_SPINCOUNT
is set already. Learners and every other process keep OpenMP's defaults.
"""  # noqa: E501 (a markdown table: one row a line)

import contextlib
import ctypes
import os
from dataclasses import dataclass


def _number(name, default, kind):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not {'an integer' if kind is int else 'a number'}") \
            from None
    if value < 0:
        raise ValueError(f"environment variable {name}={raw!r} must not be negative")
    return value


@dataclass(frozen=True)
class Settings:
    """The GADEI_* variables as typed values; see the module docstring for their meaning."""

    threads: int
    spin_us: float
    attach_timeout: float
    server_timeout: float
    log_level: str | None  # None: not set (each command has its default: `gadei.console`)
    data_dir: str | None


CORES = "GADEI_CORES"


def affinity_cores() -> int:
    """The CPUs this process may run on (its affinity: a container's or taskset's share of the
    machine, not `os.cpu_count()`)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def usable_cores() -> int:
    """The cores gadei's choices count on (learners' auto threads, the server's team and spin):
    the CPUs this process may run on, fewer where its cgroup's CPU quota allows fewer (a
    container's `--cpus`: `gadei.cgroup.quota_cores`), or fewer still where GADEI_CORES says so
    (the daemon gives each job that runs beside others its share, `job_cores_env`)."""
    from .cgroup import quota_cores

    cores = affinity_cores()
    quota = quota_cores()
    cores = cores if quota is None else min(cores, quota)
    given = _number(CORES, None, int)
    if given is None:
        return cores
    if given < 1:
        raise ValueError(f"environment variable {CORES}={os.environ[CORES]!r} must be at least 1")
    return min(cores, given)


def cores_said() -> str:
    """`usable_cores` in words, with where a smaller count comes from ("8 cores (GADEI_CORES;
    the process may use 16)", "4 cores (the cgroup's CPU quota, 4.5 CPUs; the process may run
    on 16)")."""
    from .cgroup import cpu_quota, quota_cores

    cores, affinity = usable_cores(), affinity_cores()
    said = f"{cores} core{'s' if cores != 1 else ''}"
    if cores >= affinity:
        return said
    quota = cpu_quota()
    if quota is not None and quota_cores(quota) <= cores:  # the quota, not GADEI_CORES, is what limits
        return said + f" (the cgroup's CPU quota, {quota:g} CPUs; the process may run on {affinity})"
    return said + f" ({CORES}; the process may use {affinity})"


def job_cores_env(jobs: int) -> dict[str, str]:
    """The environment of a job that runs beside up to `jobs` - 1 others (the daemon's
    `--max-jobs`): GADEI_CORES, its share of this process's cores, so that their learners'
    threads and servers fit the cores together as one job's do alone. Nothing for one job."""
    return {CORES: str(max(1, usable_cores() // jobs))} if jobs > 1 else {}


def settings() -> Settings:
    """Read the GADEI_* environment variables now and return them typed."""
    return Settings(
        threads=_number("GADEI_THREADS", max(1, usable_cores() // 2), int),
        spin_us=_number("GADEI_SPIN_US", 2000.0, float),
        attach_timeout=_number("GADEI_ATTACH_TIMEOUT", 30.0, float),
        server_timeout=_number("GADEI_SERVER_TIMEOUT", 30.0, float),
        log_level=(os.environ.get("GADEI_LOG") or "").upper() or None,
        data_dir=os.environ.get("GADEI_DATA_DIR") or None,
    )


@contextlib.contextmanager
def environ(values: dict[str, str]):
    """`values` in this process's environment for the block (processes started in it inherit
    them), and the variables as they were after it."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def openmp_policy_given() -> bool:
    """Whether the user set OpenMP's wait policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT): gadei
    then leaves it alone everywhere."""
    return "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ


def learners_openmp_env(learners: int, threads: int) -> dict[str, str]:
    """The OpenMP wait policy of a job's learners, for the environment `gadei run` starts them
    in: OpenMP's default (nothing) where their threads and the server fit the cores, passive
    where they do not (`threads` given above what the cores hold). Threads that spin between
    PyTorch's parallel regions then take the cores from the threads that compute and from the
    server: 2 learners of 2 threads on 2 cores trained an epoch of TREC in 90 s, against 12 s
    with passive threads. Nothing where the user set a policy, or with one thread a learner."""
    if threads > 1 and learners * threads + 1 > usable_cores() and not openmp_policy_given():
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {}


_OPENMP_LATE = False  # OpenMP was loaded before quiet_openmp could set its wait policy
_OPENMP_QUIET = False  # quiet_openmp loaded this process's OpenMP runtime under the passive policy


def quiet_openmp() -> None:
    """Make this process's idle OpenMP threads sleep instead of spinning: a server's. GNU
    OpenMP's default keeps every thread of a team spinning for about 3 ms after each parallel
    region; the server's kernel team runs for tens of microseconds per update, so between
    updates its threads would take as many cores as they are, on any machine.

    The runtime reads its policy once, when it loads (with gadei._native or torch), so this
    sets OMP_WAIT_POLICY=PASSIVE, loads it now, and takes the variable out of the environment
    again: the policy is this process's, and the processes it starts keep OpenMP's defaults.
    Learners must: PyTorch runs a step's parallel regions back to back, and waking sleeping
    threads for each one made a text CNN's step at mini-batch 2 nearly twice as slow with 2
    threads as with one (docs/benchmarks.md, "threads").

    Called where a server runs: by `gadei serve` when the package is imported (the
    command-line tools load the kernel as they import; `_proc.gadei_subcommand`), and by
    `gadei.server` when it is imported (a server of the Python API). Nothing where the user
    set OMP_WAIT_POLICY or GOMP_SPINCOUNT; `openmp_spins` says when the runtime was loaded
    before (torch imported first)."""
    global _OPENMP_LATE, _OPENMP_QUIET
    if _OPENMP_QUIET or openmp_policy_given():
        return
    if _openmp_loaded():
        _OPENMP_LATE = True
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:  # GNU OpenMP, which gadei._native links and torch's wheels bundle under the same soname
        ctypes.CDLL("libgomp.so.1")  # reads the policy as it loads; both find it loaded then
    except OSError:  # none on the library path: the variable stays for whatever loads OpenMP later
        return
    if _openmp_loaded():
        del os.environ["OMP_WAIT_POLICY"]
        _OPENMP_QUIET = True


def openmp_spins() -> bool:
    """Whether this process's OpenMP threads spin between parallel regions: the runtime was
    loaded (torch imported before gadei.server) before `quiet_openmp` could make it passive,
    or the user asked for it (OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT above 0)."""
    if _OPENMP_QUIET:
        return False
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
    spin = os.environ.get("GOMP_SPINCOUNT", "").strip()
    return _OPENMP_LATE or policy == "ACTIVE" or (policy != "PASSIVE" and spin not in ("", "0"))


def openmp_policy() -> str:
    """This process's OpenMP wait policy in words (the logs of servers and learners say it)."""
    if _OPENMP_QUIET:
        return "passive (gadei's: idle threads sleep)"
    given = [f"{name}={os.environ[name]}" for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if name in os.environ]
    if given:
        return ", ".join(given)
    return "OpenMP's default" + (" (loaded before gadei could make it passive)" if _OPENMP_LATE else "")


def _openmp_loaded() -> bool:
    try:
        with open("/proc/self/maps", "rb") as f:
            return any(b"libgomp" in line or b"libomp" in line or b"libiomp" in line for line in f)
    except OSError:  # not Linux: unknown, taken as not loaded
        return False


PAUSE_POINTS = ("starting", "concluding")  # where GADEI_PAUSE_AT may hold a job's supervisor


def pause_at(point: str) -> None:
    """Stop this process (SIGSTOP) until it is continued, where GADEI_PAUSE_AT names `point`
    (one of PAUSE_POINTS): how a test holds a job's supervisor at a chosen moment, by a hook it
    controls, not by a timing it hopes for."""
    import signal

    if os.environ.get("GADEI_PAUSE_AT") == point:
        os.kill(os.getpid(), signal.SIGSTOP)


def restarts() -> list[float]:
    """The times (time.time()) of the job's recent server restarts, as the supervisor that started
    this process handed them down in GADEI_RESTARTS; [] when none."""
    raw = os.environ.get("GADEI_RESTARTS", "")
    try:
        return [float(t) for t in raw.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"environment variable GADEI_RESTARTS={raw!r} is not a comma-separated list of "
                         "times") from None


def restarts_env(times: list[float]) -> dict[str, str]:
    """The environment that hands `times` (a job's recent server restarts) to a server."""
    return {"GADEI_RESTARTS": ",".join(str(t) for t in times)}


def state_dir() -> str:
    """The daemon's state folder (GADEI_STATE_DIR, else $XDG_STATE_HOME/gadei, else
    ~/.local/state/gadei); the daemon creates it (`gadei.daemon.jobs.state_dir`)."""
    folder = os.environ.get("GADEI_STATE_DIR")
    if folder:
        return folder
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "gadei")


def runtime_dir() -> str:
    """This user's folder for gadei's runtime files, created (mode 0700) if missing.

    Raises:
        PermissionError: the folder belongs to another user or others may write to it (a
            file there could be planted by them).
    """
    import stat

    folder = os.environ.get("GADEI_RUNTIME_DIR")
    if not folder:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        folder = os.path.join(xdg, "gadei") if xdg else f"/tmp/gadei-{os.getuid()}"
    os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.stat(folder)
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"gadei runtime folder {folder} belongs to uid {info.st_uid} or others may write "
                              f"to it (mode {stat.S_IMODE(info.st_mode):o}); set GADEI_RUNTIME_DIR to a folder of "
                              "yours")
    return folder
