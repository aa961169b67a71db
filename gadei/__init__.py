"""gadei: a shared-memory scale-up parameter server for deep-learning training.

A server process holds a job's weights in one POSIX shared-memory region and applies, in
place and lock-free, every gradient its learners publish into their rings. docs/how-it-works.md
gives the data flow; the public API is `Server`, `Learner`, `Client` (the daemon's jobs from
Python) and the errors.

`Server`, `Learner`, `Client`, `RuleOptions`, `TransportOptions` and `JobFileError` are
imported when first touched (PEP 562), not with the package: the first two bring torch, which
takes more than a second of CPU to import and which the commands that do not train (`gadei
status`, `stop`, `clean`, `--help`) never need; `RuleOptions` brings NumPy and the native kernels.
"""

import importlib

from .env import quiet_openmp

quiet_openmp()  # before anything loads OpenMP (torch, gadei._native): idle kernel threads sleep

from .errors import (
    BadJobName,
    CapacityError,
    DaemonError,
    DaemonRefused,
    DeviceError,
    ForeignOwner,
    ForeignRegion,
    GadeiError,
    GadeiTimeout,
    JobFailed,
    JobRunning,
    JobStopped,
    JobTimeout,
    LeftoverRegion,
    NoDaemon,
    NoSuchJob,
    RegionError,
    RegionMismatch,
    RegionNotFound,
    ServerGone,
)

__version__ = "0.1.0"

_LAZY = {  # public name -> the module that defines it, imported on first use
    "Client": ".daemon.client",
    "JobFileError": ".jobfile",
    "Learner": ".learner",
    "RuleOptions": ".modes",
    "Server": ".server",
    "TransportOptions": ".transport.options",
}

__all__ = [
    "BadJobName",
    "CapacityError",
    "Client",
    "DaemonError",
    "DaemonRefused",
    "DeviceError",
    "ForeignOwner",
    "ForeignRegion",
    "GadeiError",
    "GadeiTimeout",
    "JobFailed",
    "JobFileError",
    "JobRunning",
    "JobStopped",
    "JobTimeout",
    "Learner",
    "LeftoverRegion",
    "NoDaemon",
    "NoSuchJob",
    "RegionError",
    "RegionMismatch",
    "RegionNotFound",
    "RuleOptions",
    "Server",
    "ServerGone",
    "TransportOptions",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next lookup finds it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
