"""What a daemon job needs to start (cores, memory, shared memory) and what the machine has
free for it: the daemon starts a waiting job when its need fits what is free (`--max-jobs
auto`), and refuses at submit one that could never fit.

- A job's cores: its learners' threads and one for its server, at most the cores there are (a
  job larger than the machine runs alone, as `gadei run` runs it). Its learners' threads are
  its file's, or "auto" of the cores it is given (`share`): the cores shared by the jobs that
  wait and run, at least one a learner and one for the server.
- Its shared memory: its region (`gadei.layout`: the weights, the optimiser's state, the
  rings, whose slots carry an embedding table of sparse gradients as `max_rows` rows).
- Its memory: the region (/dev/shm is memory) and each process's (server, supervisor,
  learners): PROCESS_BYTES and three copies of the weights (weights, gradients, a spare); and
  its data sets, DATA_COPIES times what one process holds of them (`gadei.data.footprint`).
- What is free: what the machine has (usable cores, the cgroup's memory limit or the
  machine's memory, /dev/shm's size) less what the running jobs were given, and at most what
  the machine says is free now (another user's processes count too).
"""

import os
from dataclasses import dataclass

from ..env import usable_cores

PROCESS_BYTES = 300 << 20  # a job process's own memory beyond its weights and data: the interpreter, torch
# A job's processes are forked from its supervisor, which reads its sets: they share the sets' pages
# until they touch them. Measured through the daemon (a 50 MB CSV, 2 learners, one process's share
# 435 MiB): the sum of the processes' peak PSS, less a small job's, less or not their copies of the
# model (15 million weights) and the region, came to 1.8 to 2.7 times it. 3, as an upper bound.
DATA_COPIES = 3
SHM = "/dev/shm"


@dataclass(frozen=True)
class Need:
    """Cores, bytes of memory and of shared memory (a job's need, or what is free)."""

    cores: int
    memory: int
    shm: int

    def __add__(self, other: "Need") -> "Need":
        return Need(self.cores + other.cores, self.memory + other.memory, self.shm + other.shm)

    def short(self, free: "Need") -> str | None:
        """What of this need `free` lacks, in words ("needs 3 cores, 1 free"); None: it fits."""
        for what, needed, there in (("cores", self.cores, free.cores), ("memory", self.memory, free.memory),
                                    ("shared memory", self.shm, free.shm)):
            if needed > there:
                return (f"needs {needed} cores, {max(0, there)} free" if what == "cores" else
                        f"needs {_gib(needed)} of {what}, {_gib(max(0, there))} free")
        return None


@dataclass(frozen=True)
class Sizes:
    """What a job file asks for, read at submit: its learners and their threads (0: auto), and
    its region's and its processes' bytes."""

    learners: int
    threads: int
    region: int
    processes: int

    def need(self, cores: int, share: int) -> Need:
        """Its need where `cores` are usable and it is given `share` of them."""
        from ..jobfile import auto_threads

        threads = self.threads or auto_threads(self.learners, share)
        return Need(min(cores, self.learners * threads + 1), self.region + self.processes, self.region)


def sizes(job, estimate, threads: int, data: int = 0) -> Sizes:
    """A job's sizes (`job`: a `gadei.jobfile.Job` with its defaults chosen, `estimate`: its
    model's `gadei_workloads.cost.Estimate`, `threads`: its learners' as its file gives them,
    0 for auto, `data`: the bytes one process holds of its data sets, `gadei.data.footprint`)."""
    from ..layout import Shape, SparseTable, layout, ring_slots
    from ..modes import state_names

    t, parameters = job.train, max(1, estimate.parameters)
    rows, width = estimate.table
    sparse = () if not rows or job.transport.row_sparse is False else (  # its place in the weights changes no size
        SparseTable(0, rows, width, min(rows, job.transport.rows)),)
    shape = ring_slots(Shape(n_params=parameters, capacity=t.learners + (1 if job.bridge is not None else 0),
                             mode=t.mode, state_arrays=len(state_names(t.rule)), sparse=sparse),
                       job.transport.slots)
    region = layout(shape).total
    processes = (t.learners + 2) * (PROCESS_BYTES + 3 * 4 * parameters) + DATA_COPIES * data
    return Sizes(t.learners, threads, region, processes)


def room() -> Need:
    """What the daemon's jobs may use in all: the usable cores, the memory (the cgroup's limit,
    else the machine's), /dev/shm's size."""
    import psutil

    from ..cgroup import memory_limit

    memory = psutil.virtual_memory().total
    limit = memory_limit()
    return Need(usable_cores(), min(memory, limit) if limit else memory, _shm(total=True))


def free(given: list[Need]) -> Need:
    """What is free for one more job: `room()` less `given` (the running jobs' needs), and at
    most the memory and /dev/shm free now."""
    import psutil

    from ..cgroup import memory_available

    total, used = room(), Need(0, 0, 0)
    for need in given:
        used = used + need
    available = memory_available()
    memory_now = psutil.virtual_memory().available if available is None else available
    return Need(total.cores - used.cores, min(total.memory - used.memory, memory_now),
                min(total.shm - used.shm, _shm(total=False)))


def never(need: Need) -> str | None:
    """Why a job of `need` could never start here (its memory or region larger than the
    machine's); None when it could."""
    total = room()
    if need.shm > total.shm:
        return f"its region needs {_gib(need.shm)} of shared memory and {SHM} holds {_gib(total.shm)}"
    if need.memory > total.memory:
        return f"it needs {_gib(need.memory)} of memory and this machine (or its cgroup) has {_gib(total.memory)}"
    return None


def share(cores: int, learners: int, jobs: int) -> int:
    """The cores a job of `learners` is given where `jobs` jobs wait and run: an equal share of
    `cores`, at least one a learner and one for its server, at most all of them."""
    return min(cores, max(learners + 1, cores // max(1, jobs)))


def _shm(total: bool) -> int:
    try:
        st = os.statvfs(SHM)
    except OSError:  # no /dev/shm: the region's own check says so when it is created
        return 1 << 62
    return (st.f_blocks if total else st.f_bavail) * st.f_frsize


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"
