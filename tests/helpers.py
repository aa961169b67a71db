"""What the tests share: unique names, data sets and the small job files on them, real child
processes that are always reaped, one way to end a job's processes (`end_jobs`), the
exactly-once contract (`push_known_gradients`), and waits with deadlines (`wait_for`), never
fixed sleeps. Import it as `from helpers import ...`; the fixtures that use it are in
conftest.py. The fault harness (tests/faults/, also run outside pytest) imports it too.

A dependency CI installs (the shared data sets, MPI) is `missing()`: the test is skipped with
the reason on a developer's machine, and fails under CI=true, where a skip would hide a
broken install.
"""

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest

from gadei import protocol
from gadei._proc import gadei_command

IN_CI = os.environ.get("CI") == "true"


def missing(what: str):
    """Skip the calling test because `what` is missing; under CI=true, fail it instead."""
    if IN_CI:
        pytest.fail(f"{what}, and CI=true: CI installs it, so this is a broken install, not a skip")
    pytest.skip(what)


HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"


def tiered(cases, default, soak=()) -> list:
    """Parameters of a test whose cases are variations of one claim: the cases in `default` run
    in the default tier, those in `soak` are soak runs (`--soak`: variations whose code the other
    cases already run, left out of CI for its time), the others are marked long (the long tier,
    `--long`). A case is a value or a tuple of values, as `pytest.mark.parametrize` takes them."""
    return [case if case in default else pytest.param(*(case if isinstance(case, tuple) else (case,)),
                                                      marks=pytest.mark.soak if case in soak else pytest.mark.long)
            for case in cases]


def data_dir() -> Path:
    """The shared data sets: GADEI_DATA_DIR, else ../shared/data next to the repository."""
    return Path(os.environ.get("GADEI_DATA_DIR") or HERE.parent.parent / "shared" / "data")


def unique_name(prefix: str) -> str:
    """A job name no other test, and no other test run on this machine, uses: `prefix`, this
    process's id and 10 random hex digits (a name made of the test's tmp_path is the same in
    two concurrent runs of the suite)."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def cgroup(cpus: float | None = None, memory: int | None = None):
    """A cgroup of a test's own, made for its block and removed after: limited to `cpus` CPUs
    on average (a quota, as a container's `--cpus` sets) and `memory` bytes (no swap). Yields
    a function that turns a command line into one that runs inside it. Each limit gets a
    folder under this process's own cgroup of that controller, in cgroup v1 (the only version
    where a process's cgroup can have children without moving the process); a machine without
    a writable v1 hierarchy for it (not root, or cgroup v2 alone) skips the test, and under
    CI=true fails it (`missing`)."""
    from gadei.cgroup import folders

    made = []
    try:
        for controller, wanted in (("cpu", cpus), ("memory", memory)):
            if wanted is None:
                continue
            found = folders(controller)
            own = found[0] if found else None
            if own is None or not (own / "cgroup.procs").exists() or not os.access(own, os.W_OK) or \
                    (controller == "cpu" and not (own / "cpu.cfs_quota_us").exists()):
                missing(f"a writable cgroup v1 {controller} hierarchy (root, and cgroup v1 mounted)")
            folder = own / unique_name("gadei-test")
            folder.mkdir()
            made.append(folder)
            if controller == "cpu":
                (folder / "cpu.cfs_period_us").write_text("100000")
                (folder / "cpu.cfs_quota_us").write_text(str(int(wanted * 100000)))
            else:
                (folder / "memory.limit_in_bytes").write_text(str(wanted))
                if (folder / "memory.memsw.limit_in_bytes").exists():
                    (folder / "memory.memsw.limit_in_bytes").write_text(str(wanted))
        joins = " ".join(f"echo $$ > '{f}/cgroup.procs' &&" for f in made)
        yield lambda argv: ["sh", "-c", f'{joins} exec "$@"', "sh", *map(str, argv)]
    finally:
        for folder in reversed(made):
            wait_for(lambda: _emptied(folder), 30, f"the test's cgroup {folder} to empty")


def _emptied(folder: Path) -> bool:
    """Kill what is left in a test's cgroup (a test that failed) and remove it once empty."""
    for pid in (folder / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    try:
        folder.rmdir()
        return True
    except OSError:
        return False


def job_text(body: dict[str, dict]) -> str:
    """A job file's text: {section: {key: value}}, in that order."""
    def value(v) -> str:
        return json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else repr(v)

    return "\n".join(f"[{section}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in keys.items())
                     for section, keys in body.items())


def trec_job(name: str, output="out", **sections: dict) -> str:
    """The text of a job file that trains the text CNN on TREC (the calling test is skipped
    where TREC is missing); `sections` adds sections, e.g. train={"learners": 2, "lr": 0.05}."""
    trec = data_dir() / "trec"
    if not (trec / "TREC.train").is_file():
        missing(f"TREC is not at {trec} (set GADEI_DATA_DIR)")
    return job_text({"job": {"name": name, "workload": "textcnn"},
                     "data": {"train": str(trec / "TREC.train"), "test": str(trec / "TREC.test"), "format": "trec",
                              "encoding": "latin-1"},
                     **sections, "output": {"folder": str(output)}})


def small_job(name: str = "pets") -> str:
    """The text of the small job file: the text CNN on the small data set (`small_csv`, which the
    `small` fixture writes next to it). It ends in its [data] section: append [data] keys, or
    sections."""
    return (f'\n[job]\nname = "{name}"\nworkload = "textcnn"\n\n'
            '[data]\ntrain = "train.csv"\nformat = "csv"\nlabel_column = "category"\n')


def blobs(n: int = 600, features: int = 8, labels: int = 3, seed: int = 0):
    """`n` numeric samples in `labels` Gaussian clusters (labels 'class-0' ...): (x, y). Far from
    0 and wide, so that standardising them matters."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 4, (labels, features))
    y = rng.integers(0, labels, n)
    x = (centres[y] + rng.normal(0, 1, (n, features))) * 10 + 100
    return x, np.array([f"class-{v}" for v in y])


def blobs_job(folder: Path, name: str, **sections: dict) -> Path:
    """The small job: an MLP on 900 `blobs` (folder/blobs.npz, 20% held out), its output in
    folder/out; `sections` adds sections, e.g. train={"learners": 2, "epochs": 4, "lr": 0.05}.
    Writes folder/job.toml; its path."""
    x, y = blobs(900)
    np.savez(folder / "blobs.npz", x=x, y=y)
    path = folder / "job.toml"
    path.write_text(job_text({"job": {"name": name, "workload": "mlp"},
                              "data": {"train": "blobs.npz", "format": "npz", "holdout": 0.2},
                              **sections, "output": {"folder": "out"}}))
    return path


def files_up_to(limit: int) -> str:
    """Python source that makes the process that runs it fail every write past `limit` bytes of
    a file (EFBIG, "File too large"), as writes fail on a full disk: RLIMIT_FSIZE, with SIGXFSZ
    ignored. For a process of its own (`python -c`), never the tests' own."""
    return ("import resource, signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n")


def small_csv(folder: Path) -> Path:
    """A small text data set, `folder`/train.csv: 40 sentences about cats and dogs (columns text
    and category, the labels alternating): a job file on it (format "csv", label_column
    "category") parses and loads in well under a second. The `small` fixture writes it."""
    rows = [f'"sentence number {i}, about {"dogs" if i % 2 else "cats"}",{"dog" if i % 2 else "cat"}'
            for i in range(40)]
    path = folder / "train.csv"
    path.write_text("text,category\n" + "\n".join(rows) + "\n")
    return path


def job_processes(*names: str) -> list[psutil.Process]:
    """Live processes (not zombies, not this one) whose command line names one of the jobs
    `names`: a job's `gadei run`, server, supervisor and learners each carry its name (or its
    folder's) in their arguments, whoever their parent is."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        line = " ".join(proc.info["cmdline"] or [])
        if proc.pid != os.getpid() and proc.info["status"] != psutil.STATUS_ZOMBIE and any(n in line for n in names):
            found.append(proc)
    return found


def command_words(proc: psutil.Process) -> list[str]:
    """The words of `proc`'s command line: its arguments, or its title split at spaces (a job
    process forked warm shows its command as one title, `gadei.zygote`)."""
    return " ".join(proc.cmdline()).split()


def dead(pid: int) -> bool:
    """The process `pid` is gone or a zombie (killed, its parent not yet told)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def learner_pids(region) -> list[int]:
    """The pids of the learners that own one of the region's entries now."""
    from gadei import ring

    return [p for p in (ring.owner(region, i) for i in range(region.shape.capacity)) if p]


def job_version(name: str) -> int:
    """The weights' version of job `name`'s region; 0 while it has none (not yet, or no more)."""
    from gadei.errors import GadeiError
    from gadei.region import Region

    try:
        with Region.attach(name, readonly=True) as region:
            return region.header.get("version")
    except GadeiError:
        return 0


def end_jobs(*names: str, timeout: float = 10, keep_regions: bool = False) -> None:
    """Kill every process of the jobs `names` (`job_processes`: those that are not this test's
    children too, a restarted server, an orphaned learner), wait up to `timeout` s for each
    (and kill again while any is left, up to 6 x `timeout`),
    and remove the jobs' regions (unless `keep_regions`: the test still looks at them): what a
    test leaves behind, whatever it did."""
    from gadei.region import inspect, remove

    deadline = protocol.Deadline(6 * timeout)  # again while any is left: a supervisor killed after its
    while (left := job_processes(*names)) and not deadline.expired():  # server may have started another
        for proc in left:
            try:
                proc.kill()
                proc.wait(timeout)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired):
                pass
    for name in () if keep_regions else names:
        if inspect(name) is not None:
            remove(name)


# `procs.start("-c", EXEC, *argv)`: the child becomes argv[0]
EXEC = "import os, sys; os.execv(sys.argv[1], sys.argv[1:])"


def mpiexec_run(procs, mpi_env: dict, path, nodes: int = 2) -> subprocess.Popen:
    """`mpiexec -n NODES gadei run PATH` on this machine, as a child of `procs` (the mpiexec
    itself, same pid), in the environment of the `mpi_env` fixture."""
    from gadei.bridge import local_mpiexec

    argv, _ = local_mpiexec(nodes, *gadei_command("run", path))
    return procs.start("-c", EXEC, *argv, env=mpi_env)


class Serving:
    """A server applying gradients on a thread of this process (for in-process API tests)."""

    def __init__(self, job, **kwargs):
        from gadei import Server

        self.server = Server(job, **kwargs)
        self.thread = threading.Thread(target=self.server.serve, kwargs={"grace": 2.0}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self.server

    def __exit__(self, *exc):
        self.server.request_stop()
        self.thread.join(30)
        self.server.close()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.01):
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` s
    (`gadei.protocol.wait_for`, the one copy of this loop)."""
    return protocol.wait_for(predicate, timeout, what, interval=interval, error=pytest.fail.Exception)


class Procs:
    """Child processes of one test; `reap()` kills and waits for whatever is left."""

    def __init__(self):
        self.children: list[subprocess.Popen] = []

    def start(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        """`python ARGS...` with this Python."""
        return self.spawn([sys.executable, *map(str, args)], env)

    def spawn(self, argv: list[str], env: dict | None = None, cwd=None, stdin=None) -> subprocess.Popen:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        # One thread per stream drains it: a child never blocks on a full pipe, and lines
        # are handed over through a queue (select() on a buffered pipe misses lines).
        proc.lines = queue.Queue()
        proc.err_lines = []
        proc.readers = [
            threading.Thread(target=_drain, args=(proc.stdout, proc.lines.put), daemon=True),
            threading.Thread(target=_drain, args=(proc.stderr, proc.err_lines.append), daemon=True),
        ]
        for reader in proc.readers:
            reader.start()
        self.children.append(proc)
        return proc

    def worker(self, *args, env: dict | None = None) -> subprocess.Popen:
        return self.start(WORKER, *args, env=env)

    def gadei(self, *args, env: dict | None = None, cwd=None) -> subprocess.Popen:
        return self.spawn(gadei_command(*args), env, cwd)

    def reap(self) -> None:
        for proc in self.children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.children:
            proc.wait()
            for reader in proc.readers:
                reader.join(10)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def _drain(stream, put) -> None:
    for line in stream:
        put(line)


def _rest(proc: subprocess.Popen) -> tuple[str, str]:
    """After `proc` exited: what it printed that no read_line took, and all of its stderr."""
    for reader in proc.readers:
        reader.join(10)
    out = []
    while not proc.lines.empty():
        out.append(proc.lines.get())
    return "".join(out), "".join(proc.err_lines)


def communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """Wait up to `timeout` for `proc` to exit; its remaining (stdout, stderr). Fails the test on timeout."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{proc.args} did not finish in {timeout} s:\n{_rest(proc)[1][-3000:]}")
    return _rest(proc)


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    """Wait for `proc` to exit 0 within `timeout`; its (stdout not yet read, stderr)."""
    out, err = communicate(proc, timeout)
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{err[-3000:]}"
    return out, err


def png_shape(path: Path) -> tuple:
    """A PNG's (height, width, channels), read back by matplotlib (after checking it is a PNG)."""
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    return matplotlib.image.imread(path).shape


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def read_line(proc: subprocess.Popen, timeout: float) -> dict:
    """The next JSON line `proc` prints (its stdout), within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = proc.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            if proc.poll() is not None:
                pytest.fail(f"{proc.args} ended (rc {proc.returncode}) without a line:\n{_rest(proc)[1][-3000:]}")
            pytest.fail(f"{proc.args} printed no line within {timeout} s")
        if line.startswith("{"):
            return json.loads(line)


# ------------------------------------------------------------------ the exactly-once contract
# (tests/test_exactly_once.py runs it over every CPU transport, tests/test_device.py over the
# device ones): learners push gradients of known values (small integers, the learning rate a
# power of two, so that every partial sum is exact in float32, float16 and bfloat16)

N = 100_003  # parameters: not a multiple of any vector width
LR = 0.125
STEPS = 300  # gradients each learner pushes
VALUES = (1.0, 2.0, 3.0)  # one learner per value


def expected_weights(model: str, total: float = STEPS * sum(VALUES)) -> np.ndarray:
    """Initial weights 1, minus lr times `total` (the sum of one element over every gradient
    pushed), in the region's parameter order; a table's touched rows only (row 0 twice per
    gradient)."""
    from worker import MODELS, TOUCHED

    parts = []
    for p in MODELS[model](N, 1.0).parameters():
        part = np.full(tuple(p.shape), 1.0 - LR * total, dtype=np.float32)
        if p.dim() == 2:  # the table: only the rows a gradient names move, row 0 twice
            part[:] = 1.0
            for row in TOUCHED:
                part[row] -= LR * total
        parts.append(part.ravel())
    return np.concatenate(parts)


def push_known_gradients(job, procs, tmp_path, *, values=VALUES, pull="copy", push="publish", slots=2,
                         grad_dtype="float32", model="flat", row_sparse=False, mode="async", devices=None,
                         vary=False, jitter=None, deadline=120) -> None:
    """The exactly-once contract: one learner per entry of `values` pushes STEPS gradients of
    that value (`vary`: V, 2V, 3V, V, ... so that a gradient overwritten by the next one while
    it is copied changes the sums) through the `pull` and `push` transports (on `devices[i]`
    for the device ones, with random delays seeded by `jitter`); the final weights must equal
    the initial ones minus lr times everything pushed, to the bit, and the counters agree."""
    from worker import TABLE_ROWS, TABLE_WIDTH, TOUCHED

    dump = tmp_path / "weights.npy"
    server = procs.worker("serve", job, "--model", model, "--n", N, "--lr", LR, "--learners", len(values),
                          "--slots", slots, "--grad-dtype", grad_dtype, "--mode", mode,
                          *(["--row-sparse"] if row_sparse else []), "--dump", dump)
    # the learners start beside their server, each waiting for its region: their imports of torch
    # (a second of CPU each) overlap instead of following one another
    learners = [
        procs.worker("push", job, "--model", model, "--n", N, "--value", v, "--steps", STEPS, "--pull", pull,
                     "--push", push, *(["--device", devices[i]] if devices else []), *(["--vary"] if vary else []),
                     *(["--jitter", jitter * 100 + i] if jitter is not None else []))
        for i, v in enumerate(values)
    ]
    read_line(server, 60)
    try:
        for learner in learners:
            read_line(learner, 60)  # attaching
            read_line(learner, 60)  # attached
        done = [read_line(learner, deadline) for learner in learners]
    except pytest.fail.Exception:
        if server.poll() is None:
            raise
        # the server stopped first (a ring it found corrupt, say): a learner only saw the region go
        pytest.fail(f"the server exited {server.returncode} while the learners pushed:\n{_rest(server)[1][-3000:]}")
    for learner in learners:
        finish(learner)
    assert [d["pushed"] for d in done] == [STEPS] * len(values)

    server.send_signal(signal.SIGTERM)
    report = read_line(server, 60)
    finish(server)
    expected = expected_weights(model, sum(v * ((1 + k % 3) if vary else 1) for v in values for k in range(STEPS)))
    np.testing.assert_array_equal(np.load(dump), expected)
    assert report["applied"] == report["version"] == STEPS * len(values)
    # a learner that finished early leaves its ring to the next one: count over all rings
    assert report["heads"] == report["tails"]
    assert sum(report["heads"]) == STEPS * len(values)
    itemsize = 4 if grad_dtype == "float32" else 2
    dense = N - TABLE_ROWS * TABLE_WIDTH if row_sparse else N
    per_gradient = dense * itemsize + (len(set(TOUCHED)) * (8 + TABLE_WIDTH * itemsize) if row_sparse else 0)
    assert report["applied_bytes"] == per_gradient * STEPS * len(values)
    final = float(expected[-TABLE_ROWS * TABLE_WIDTH if model == "table" else -1])  # the last parameter's first
    # each learner left with the weights of the version it last saw in its model: the last to
    # leave saw every gradient applied, so it holds exactly the final weights
    assert max(d["version"] for d in done) == report["version"]
    assert all(d["weight0"] == final for d in done if d["version"] == report["version"])


def daemon_jobs(procs, env) -> dict:
    """The daemon's job records as `gadei status --json` gives them, by name (`env`: the daemon's)."""
    out, _ = finish(procs.gadei("status", "--json", env=env))
    record = json.loads(out.splitlines()[0])
    assert record["event"] == "daemon-jobs"
    return {j["name"]: j for j in record["jobs"]}


def wait_listening(path, daemon: subprocess.Popen, timeout: float = 60) -> None:
    """Wait until `daemon` takes connections on the Unix socket at `path`, or exits: not until the
    file is there, which a daemon killed before leaves behind."""
    def listens() -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except OSError:
                return False
        return True

    wait_for(lambda: listens() or daemon.poll() is not None, timeout, "the daemon's socket")


def start_daemon(procs, env, *args) -> subprocess.Popen:
    """`gadei daemon *args` in `env` (the `daemon_env` fixture's), once its socket takes connections."""
    daemon = procs.gadei("daemon", *args, env=env)
    wait_listening(os.path.join(env["GADEI_RUNTIME_DIR"], "daemon.sock"), daemon)
    assert daemon.poll() is None, daemon.err_lines
    return daemon
