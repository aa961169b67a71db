"""Custody of a job: a new watchdog takes over from one that died (`adopt`, as `gadei run`
does when its job's watchdog dies), and the server of a `gadei run` job makes sure that the
job is never left to no one when its watchdog and its `gadei run` both died (`Custody`)."""

import logging
import subprocess
import time
from pathlib import Path

from . import outputs
from ._proc import gadei_command
from .errors import GadeiError

log = logging.getLogger(__name__)

FIRST_LOOKS = 0.05  # seconds between the looks until the job's first watchdog is seen (a header read each)
WATCHDOG_GRACE = 90  # seconds a new watchdog may take to take over from a dead one


def adopt(name: str, env: dict[str, str] | None = None) -> tuple[bool, str]:
    """A new watchdog takes over the job `name` from one that died (`gadei serve NAME --adopt`,
    in the environment `env`, this process's by default: the watchdog and the learners it
    restarts inherit it): (True, which watchdog) once a live one watches it (this call's, or one
    that another process started at the same moment: the header takes one, the other stands
    down), or once the job no longer serves (it is stopping or gone: nothing is left to take
    over, and a watchdog that took over may already have watched it to its end); else (False,
    why none could)."""
    from .launch import run_command

    try:
        code, stderr = run_command(gadei_command("serve", name, "--adopt"), WATCHDOG_GRACE, env)
    except subprocess.TimeoutExpired:
        return False, f"`gadei serve {name} --adopt` did not end within {WATCHDOG_GRACE} s"
    said = (stderr.strip().splitlines() or [f"exit {code}"])[-1]
    if code == 0:
        return True, said
    live = live_watchdog(name)
    if live:
        return True, f"{said} (watchdog pid {live} watches it)"
    if not _serving(name):
        return True, f"{said} (the job no longer serves: nothing is left to take over)"
    return False, said


def _serving(name: str) -> bool:
    """The job's live server still serves: it was not asked to stop, and did not stop."""
    from .protocol import RunState
    from .region import Region, inspect

    found = inspect(name)
    if found is None or found.state != "running":
        return False
    try:
        with Region.attach(name, readonly=True) as region:
            return RunState(region).serving()
    except GadeiError:
        return False


def live_watchdog(name: str) -> int:
    """The pid of the job's live registered watchdog (pid and start time in its region's
    header); 0 when none lives, or the job has no region."""
    from . import _proc
    from .region import Region

    try:
        with Region.attach(name, readonly=True) as region:
            pid, started = region.header.get("watchdog_pid"), region.header.get("watchdog_start")
    except GadeiError:
        return 0
    return pid if pid and _proc.alive(pid, started) else 0


class Custody:
    """In the server of a `gadei run` job (`gadei serve --outputs FOLDER` with its watchdog):
    the job is never left to no one. Every `interval` seconds, while it serves, it looks
    whether the watchdog the header names is gone (pid and start time) and no live process
    holds the run's lock (`outputs.owned`: its `gadei run`, the daemon's, or a writer of its
    outputs). Both gone, a new watchdog takes over as `gadei run` would have it (`adopt`),
    and writes the outputs at the end; when none can, the job ends as failed: its end record
    says why (`reason`), the server stops (its orphaned learners stop with it), and the server
    writes the outputs once it stopped (`write_outputs`).

    A `gadei run` that lives adopts for itself (it holds the lock); if it was killed while
    adopting, its adoption and this one race for the header, which takes one watchdog.

    A header that names no watchdog yet is a job starting, for `grace` seconds from the
    start of the looks: a watchdog that has not registered by then (it died on its way, as one
    that stops beating is dead after `interval * max_missed`) leaves the job unwatched too.
    Without `grace` (a server that started no watchdog: --no-watchdog by hand), none is awaited."""

    def __init__(self, region, out: Path, stop, interval: float, grace: float | None = None):
        import threading

        self.region, self.name, self.out, self._stop, self.interval = region, region.job, out, stop, interval
        self.grace = grace
        self._since = time.monotonic()  # when the looks began: the first watchdog registers within `grace`
        self.reason = ""  # why the job failed when no watchdog could take over
        self._last: tuple = (0, 0.0, False)  # the header's watchdog pid, its start, finished (at close)
        self._seen: tuple = (0, 0.0)  # the last watchdog the header named (pid, start): a watchdog that ends
        # on an exception (SIGINT too) clears its pid there first, and is gone all the same
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gadei-custody", daemon=True)

    def start(self) -> "Custody":
        self._thread.start()
        return self

    def close(self) -> None:
        """Before the server closes its region: the looks end, and the header's last word on
        the watchdog and the job's end is kept for `write_outputs`."""
        self._closed.set()
        self._thread.join()
        h = self.region.header
        self._last = (h.get("watchdog_pid"), h.get("watchdog_start"), h.get("finished") == 1)

    def _watch(self) -> None:
        # Until the first watchdog is seen (where one is awaited), look every FIRST_LOOKS s: one
        # that registers and soon ends on an exception clears its pid, and unseen it would pass
        # for none at all (a CI run saw its pid on no look of 2 s).
        while not self._closed.wait(self.interval if self._seen[0] or self.grace is None
                                    else min(self.interval, FIRST_LOOKS)):
            dead = self._unwatched()
            if dead is None:
                continue
            name = self.name
            log.warning("job %s: %s and its `gadei run` are gone; starting a new watchdog that takes over its "
                        "learners", name, self._which(dead))
            adopted, reason = adopt(name)
            if adopted:
                log.warning("job %s: %s", name, reason)
                continue
            if self._unwatched() is None:  # another adopter won, or the job is ending: not a failure
                log.warning("job %s: %s; the job is watched or ending now: not failing it", name, reason)
                continue
            self.reason = (f"{self._which(dead)} and its gadei run died and no new watchdog could take over: "
                           f"{reason}")
            log.error("job %s: %s; stopping the job", name, self.reason)
            from .watchdog_record import JOB_FAILED

            outputs.record_end(self.out, outputs.Ending(JOB_FAILED, False, self.reason))
            self._stop()
            return

    def _which(self, dead: int) -> str:
        return f"its watchdog (pid {dead})" if dead else f"its watchdog (none registered within {self.grace:g} s)"

    def _unwatched(self) -> int | None:
        """The dead watchdog's pid when the serving job has neither it nor an owner of its run
        (0: none ever registered, `grace` seconds after the looks began). A header naming no
        watchdog is unwatched once one was seen (it cleared its pid as it ended); before the
        first one registers, the job is starting, not unwatched, for `grace` seconds."""
        from . import _proc
        from .protocol import RunState

        h = self.region.header
        pid, started = h.get("watchdog_pid"), h.get("watchdog_start")
        if pid:
            self._seen = (pid, started)
        pid, started = self._seen
        if not pid and (self.grace is None or time.monotonic() - self._since < self.grace):
            return None  # starting: its first watchdog registers
        if not RunState(self.region).serving() or (pid and _proc.alive(pid, started)) or outputs.owned(self.out):
            return None
        return pid

    def write_outputs(self) -> None:
        """After the server stopped: the outputs that no one else is left to write, as its
        `gadei run` or watchdog would have written them. Of a job no watchdog could take over
        (result.json says failed, and why); and of a job that was stopping (every learner
        done, or a `gadei stop`) when its watchdog and its `gadei run` both died, before the
        watchdog recorded the end: the server records it (finished as the watchdog had said
        in the header) and writes them."""
        ending = None
        if not self.reason:
            if not self._orphaned_end():
                return
            pid, _, finished = self._last
            ending = outputs.Ending(0, finished, f"its watchdog (pid {pid}) and its gadei run died while the job was "
                                    "stopping; its server recorded the end")
            log.warning("job %s: its watchdog (pid %d) and its `gadei run` died while the job was stopping; writing "
                        "its outputs", self.name, pid)
        try:
            result = outputs.conclude(self.out, ending=ending, note=self.reason)
            log.error("job %s: wrote its outputs in %s (%s)", self.name, self.out, result.get("outcome"))
        except (OSError, GadeiError) as err:
            log.error("job %s: cannot write the outputs in %s: %s", self.name, self.out, err)

    def _orphaned_end(self) -> bool:
        """The stopped job's end is recorded by no one: its watchdog is dead (not merely slow
        to write), nobody holds the run's lock, and neither an end record nor result.json is there."""
        from . import _proc

        pid, started, _ = self._last
        return bool(pid) and not _proc.alive(pid, started) and not outputs.owned(self.out) \
            and outputs.read_ending(self.out) is None and outputs.read_result(self.out) is None
