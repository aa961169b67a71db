"""The suite's two tiers (the default one, and the long one that --long adds), the --soak
and --busy options, markers and fixtures: unique job names, real child processes that are
always reaped, mpiexec's environment (`mpi_env`), a runtime folder of the suite's own, busy
processes beside each test where --busy asks for them (a loaded machine), and, under
pytest-xdist (`-n 2`), no other test beside one marked `alone`. Every region a
test's job created is removed at the end even if the test failed. What tests import is in
helpers.py.
"""

import fcntl
import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import Procs, missing, small_csv, unique_name

from gadei.region import inspect, remove


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="also run the long tier (tests marked long: the accuracy medians over seeds, the "
                          "fault-injection scenarios, the deep protocol-model checks); `--long -m long` runs it alone")
    parser.addoption("--soak", action="store_true",
                     help="also run the long tier and the soak runs (marked soak: accuracy on SST-2 and banking77, "
                          "the rest of the fault scenarios, the bridge's repeated runs, variations left out of CI for "
                          "its time; in neither tier, not in CI)")
    parser.addoption("--busy", type=int, default=0, metavar="N",
                     help="run N busy processes (a loop each, at full speed) beside every test, from its start to its "
                          "end: the machine loaded, as a service's often is; every wait's deadline must hold then too")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "long: the long tier (minutes a test: accuracy medians, fault scenarios, deep model checks), "
                   "skipped unless --long is given"
    )
    config.addinivalue_line("markers", "soak: soak runs (tens of minutes, and variations left out of CI for its "
                                       "time), skipped unless --soak is given")
    config.addinivalue_line("markers", "faults: the fault, kill, stop, cancel, checkpoint, supervisor and daemon "
                                       "tests, which CI runs one at a time on a loaded machine (`--busy 2 -m faults`), "
                                       "and the rest of the default tier two at a time (`-n 2 -m 'not faults'`)")
    config.addinivalue_line("markers", "alone: a test that measures rates against each other, which no load may "
                                       "skew: under pytest-xdist (`-n 2`) no other test runs beside it")


def pytest_collection_modifyitems(config, items):
    soak = config.getoption("--soak")  # the soak runs come on top of both tiers
    skips = {marker: pytest.mark.skip(reason=f"{why}: give --{marker} to run it")
             for marker, why, given in (("long", "in the long tier", config.getoption("--long") or soak),
                                        ("soak", "a soak run", soak))
             if not given}
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _runtime_dir(tmp_path_factory):
    """Watchdogs keep their state in GADEI_RUNTIME_DIR, the daemon its job records in
    GADEI_STATE_DIR: the suite's go to folders of its own (every child inherits them), never
    into the user's."""
    folder = tmp_path_factory.mktemp("runtime")
    folder.chmod(0o700)
    saved = {name: os.environ.get(name) for name in ("GADEI_RUNTIME_DIR", "GADEI_STATE_DIR")}
    os.environ["GADEI_RUNTIME_DIR"] = str(folder)
    os.environ["GADEI_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    yield folder
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _alone(request, tmp_path_factory):
    """Under pytest-xdist, each test holds the run's lock shared, and a test marked `alone` holds it
    exclusive: it waits for the test beside it to end, and the next one waits for it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    exclusive = request.node.get_closest_marker("alone") is not None
    with open(tmp_path_factory.getbasetemp().parent / "alone.lock", "a") as lock:  # the run's folder, not the worker's
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield


@pytest.fixture(autouse=True)
def _busy(request):
    """--busy N: N processes that keep a core each busy beside the test, killed and reaped after it."""
    count = request.config.getoption("--busy")
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
             for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
        for loop in loops:
            loop.wait()


@pytest.fixture
def job():
    """A job name no other test (or test run) uses; its region is removed afterwards."""
    name = unique_name("test")
    yield name
    if inspect(name) is not None:
        remove(name)


@pytest.fixture
def procs():
    children = Procs()
    yield children
    children.reap()


@pytest.fixture
def small(tmp_path):
    """A folder holding a small text data set (`helpers.small_csv`: train.csv, 40 rows)."""
    small_csv(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def mpi_env(tmp_path_factory):
    """The environment mpiexec runs in here, after checking that it starts two ranks at all.

    Open MPI's shared-memory segments go to a folder of the test run's own, so a killed
    rank leaves nothing in /dev/shm. Module-scoped: each module's mpiexec tests look once.
    """
    from gadei.bridge import BridgeError, local_mpiexec

    if importlib.util.find_spec("mpi4py") is None:
        missing("mpi4py is not installed (pip install 'gadei[mpi]')")
    try:
        argv, extra = local_mpiexec(2, sys.executable, "-c", "from mpi4py import MPI; print(MPI.COMM_WORLD.Get_size())")
    except BridgeError as err:
        missing(str(err))
    env = {**os.environ, **extra, "OMPI_MCA_btl_sm_backing_directory": str(tmp_path_factory.mktemp("mpi-sm"))}
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        missing("mpiexec did not start two ranks within 120 s")
    if done.returncode != 0 or done.stdout.split() != ["2", "2"]:
        missing(f"mpiexec cannot start two ranks here (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return extra | {"OMPI_MCA_btl_sm_backing_directory": env["OMPI_MCA_btl_sm_backing_directory"]}


@pytest.fixture
def daemon_env(tmp_path):
    """The environment of a daemon of its own (runtime and state folders in `tmp_path`) for
    `gadei daemon` and the commands that talk to it."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    return {"GADEI_RUNTIME_DIR": str(run), "GADEI_STATE_DIR": str(tmp_path / "state")}
