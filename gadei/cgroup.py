"""The limits the cgroups of this process put on it: a CPU quota (what a container's `--cpus`
or a Kubernetes CPU limit sets) and a memory limit, read from cgroup v2 or v1, whichever the
kernel mounts for each controller. Neither shows in the CPUs a process may run on (its
affinity) nor in the machine's free memory, so a container on a 16-core host with a quota of
4 CPUs would otherwise count on 16 cores, and a bench would size its runs by memory the
container cannot have.

A limit of a cgroup's parent applies to it too: each function takes the smallest along the
path from this process's cgroup up to its mount's root (the root of a container's cgroup
namespace). Where the files cannot be read (not Linux, no cgroup mounted, a folder that is not
ours to read), there is no limit: None.
"""

import math
import os
import re
from pathlib import Path

_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1
_PROC = Path("/proc/self")  # where this process's cgroups and mounts are read (tests give another)


def _unescape(path: str) -> str:
    """A path as /proc/self/mountinfo writes it (a space as \\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def folders(controller: str) -> list[Path]:
    """The folders of this process's cgroup for `controller` ("cpu", "memory"), its own first,
    then each parent's up to the mount's root; [] where none is mounted or readable.

    A v1 hierarchy that has the controller is preferred; else the v2 hierarchy, where its
    root lists the controller in cgroup.controllers."""
    try:
        memberships = (_PROC / "cgroup").read_text().splitlines()
        mounts = (_PROC / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    paths = {}  # "memory" or "" (v2) -> this process's cgroup path in that hierarchy
    for line in memberships:
        number, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        if number == "0" and names == "":
            paths.setdefault("", path)
        for name in names.split(","):
            if name:
                paths[name] = path
    candidates = []  # (prefer, mount root, mount point, the cgroup path in it)
    for line in mounts:
        fields, _, after = line.partition(" - ")
        fields, after = fields.split(), after.split()
        if len(fields) < 5 or len(after) < 3:
            continue
        root, point, fstype, options = _unescape(fields[3]), _unescape(fields[4]), after[0], after[2].split(",")
        if fstype == "cgroup" and controller in options and controller in paths:
            candidates.append((0, root, point, paths[controller]))
        elif fstype == "cgroup2" and "" in paths:
            try:
                enabled = (Path(point) / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            if controller in enabled:
                candidates.append((1, root, point, paths[""]))
    for _, root, point, path in sorted(candidates):
        relative = os.path.relpath(path, root) if path.startswith(root) else "."
        if relative.startswith(".."):
            relative = "."  # a path outside the mount (another namespace's view): the mount's own root
        here, top = (Path(point) / relative).resolve(), Path(point).resolve()
        if not here.is_dir():
            continue
        chain = [here]
        while chain[-1] != top and top in chain[-1].parents:
            chain.append(chain[-1].parent)
        return chain
    return []


def _read(folder: Path, name: str) -> str | None:
    try:
        return (folder / name).read_text().strip()
    except OSError:
        return None


def _stat(folder: Path, key: str) -> int:
    """One counter of a folder's memory.stat (0 where it is not there)."""
    for line in (_read(folder, "memory.stat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def cpu_quota() -> float | None:
    """The CPUs this process's cgroups let it use in all, on average (quota over period: 2.5
    for a container run with `--cpus 2.5`); None where no quota is set."""
    smallest = None
    for folder in folders("cpu"):
        both = _read(folder, "cpu.max")  # v2: "QUOTA PERIOD", QUOTA "max" for none
        if both is not None:
            quota, _, period = both.partition(" ")
        else:  # v1
            quota, period = _read(folder, "cpu.cfs_quota_us"), _read(folder, "cpu.cfs_period_us")
        try:
            cpus = int(quota) / int(period)
        except (TypeError, ValueError, ZeroDivisionError):
            continue  # "max", -1 (none) or unreadable
        if cpus > 0:
            smallest = cpus if smallest is None else min(smallest, cpus)
    return smallest


def quota_cores(quota: float | None = None) -> int | None:
    """A quota (default: `cpu_quota()`) as a count of cores to plan threads for: rounded down
    (threads beyond a quota are throttled, not run), at least 1; None where no quota is set."""
    quota = cpu_quota() if quota is None else quota
    return None if quota is None else max(1, math.floor(quota + 1e-9))


def _limit(folder: Path) -> tuple[int, bool] | None:
    """A cgroup folder's own memory limit and whether it is v2's; None where it has none."""
    raw = _read(folder, "memory.max")  # v2: "max" for none
    v2 = raw is not None
    if not v2:
        raw = _read(folder, "memory.limit_in_bytes")  # v1: about 2**63 for none
    if raw is None or not raw.isdigit() or int(raw) >= _UNLIMITED:
        return None
    return int(raw), v2


def memory_limit() -> int | None:
    """The bytes of memory this process's cgroups let it (with the others in them) use; None
    where no limit is set."""
    limits = [found[0] for found in map(_limit, folders("memory")) if found is not None]
    return min(limits, default=None)


def memory_available() -> int | None:
    """The bytes this process's cgroups can still give it: at each limited level, its limit
    less what the cgroup uses, counting its page cache that can be dropped (inactive files) as
    free, the smallest of them; None where no limit is set. (The kernel's own figure,
    MemAvailable, knows nothing of a cgroup's limit.)"""
    smallest = None
    for folder in folders("memory"):
        found = _limit(folder)
        if found is None:
            continue
        limit, v2 = found
        used = _read(folder, "memory.current" if v2 else "memory.usage_in_bytes")
        if used is None or not used.isdigit():
            continue
        free = max(0, limit - int(used) + _stat(folder, "inactive_file" if v2 else "total_inactive_file"))
        smallest = free if smallest is None else min(smallest, free)
    return smallest
