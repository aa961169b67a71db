"""How a server may wait for the next gradient without taking a core from others: whether
spinning or dozing pays (`SPIN_PAYS_NS`, `doze_pays`), how long a server with no core of its
own naps (`nap_ns`), how busy the machine is
(`runnable`), the machine's one permit to spin or doze (`SpinToken`), and sleeps that end
on time (`short_timer_slack`). `gadei.server`'s apply loop (`Server._serve_each`) decides
with them."""

import fcntl
import os

from .env import runtime_dir

# Spinning for the next gradient pays only when gradients come faster than the server sleeps
# and wakes (a futex sleep and wake-up, and a halted vCPU's exit: tens of microseconds, up to
# 100 on a virtual machine); `gadei bench server` shows what it costs when they do not.
SPIN_PAYS_NS = 200_000
DOZE_NS = 50_000_000  # the longest an idle server dozes after the last gradient
DOZE_SLICE_NS = 50_000  # between two looks at the rings while it dozes
# Dozing (a look at the rings every 50 us between gradients) pays while they come close
# enough that a wake-up's delay (100-300 us on a virtual machine) could keep a learner waiting
# on a full ring, or while the server's own work is a large part of the gap: a vCPU that
# halted between two 16 MB updates 5 ms apart applied the next in 4-5 ms, one that dozed in
# 2-2.7 (`gadei bench latency`). Otherwise nothing waits on the wake-up: one learner of the
# text CNN at batch 2 (a gradient every 3.3 ms, 0.1 ms of work, 2 cores) ran at the same 580
# samples/s dozing or not, the server at 0.33 cores dozing against 0.06 sleeping on the
# doorbell (2026-11-26, three runs each).
DOZE_PAYS_NS = 1_000_000
DOZE_PAYS_WORK = 0.25  # the share of the gap the server's update takes, at and above which a doze pays


def doze_pays(gap_ns: int, work_ns: int) -> bool:
    """Whether dozing through the next gap pays, with gradients `gap_ns` apart and `work_ns`
    of work each (both averaged)."""
    return gap_ns < DOZE_PAYS_NS or work_ns >= DOZE_PAYS_WORK * gap_ns


# A server with no core of its own (the learners fill the cores) sleeps on the doorbell, and
# each push that finds it asleep rings it: a wake-up, and the server put on a learner's core,
# for every gradient. Where gradients come faster than a nap, it naps instead: looks at the
# rings every nap (up to NAP_NS) and applies what came, the learners ringing nothing. A nap
# is long enough to save wake-ups (NAP_MIN_NS) and short enough that no learner fills its
# ring meanwhile: half the time its free slots take to fill at the rate its gradients come.
# A napping server wakes less often than one rung for each gradient, so servers side by side
# nap without the SpinToken.
# Each wake-up cost the server about 90 us of CPU besides its gradients' (2 n-gram learners at
# batch 4 on 2 cores, perf stat over 3 s: 4,292 wake-ups and 0.62 s napping 0.5 ms, 2,135 and
# 0.43 s napping 1 ms), and 1 ms naps beat 0.5 ms ones at batches 2 to 8: docs/benchmarks.md.
NAP_NS = 1_000_000
NAP_MIN_NS = 200_000


def nap_ns(gap_ns: int, rings: int, slots: int) -> int:
    """How long a server with no core of its own naps between looks at the rings, with gradients
    `gap_ns` apart (averaged over all rings), `rings` learners attached and `slots` per ring; 0
    where a nap does not pay (gradients farther apart than the nap, or rings too small to hold
    what comes in two naps: sleep on the doorbell)."""
    nap = min(NAP_NS, (slots - 1) * gap_ns * max(1, rings) // 2)
    return nap if nap >= NAP_MIN_NS and gap_ns < nap else 0


def runnable() -> int:
    """Threads runnable on the machine now, this one included (/proc/loadavg); 0 where unknown."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return 0


class SpinToken:
    """The machine's one permit to spin or doze (this user's, a lock file in `env.runtime_dir`):
    of several servers running side by side, at most one keeps a core busy while it waits for
    gradients, the others sleep on their doorbells. Taken without waiting; dropped by the
    kernel when its holder dies."""

    def __init__(self):
        self._fd, self._held = -1, False

    def take(self) -> bool:
        """Hold the permit (True), or False when another server holds it (or no lock file can be
        made: then none spins)."""
        if self._held:
            return True
        try:
            if self._fd < 0:
                self._fd = os.open(os.path.join(runtime_dir(), "spin.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                   0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        self._held = True
        return True

    def give(self) -> None:
        """Let the permit go (no-op when not held)."""
        if self._held:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._held = False

    def close(self) -> None:
        self.give()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def short_timer_slack() -> None:
    """Let this thread's short sleeps end on time: Linux adds up to 50 us of timer slack to
    each by default, as long as a DOZE_SLICE_NS itself (prctl PR_SET_TIMERSLACK, 1 ns)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the default slack
        pass
