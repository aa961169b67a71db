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

from ._proc import gadei_subcommand
from .env import quiet_openmp

# before the command-line tools load OpenMP: the kernel's idle threads sleep (a server's, and those of the
# processes `gadei run` forks from itself: `gadei.zygote`)
if gadei_subcommand() in ("serve", "run"):
    quiet_openmp()

from .errors import (
    BadJobName,
    CapacityError,
    DaemonError,
    DaemonRefused,
    DeviceError,
    FolderInUse,
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
    "FolderInUse",
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
    if name == "_native":  # `from . import _native` asks here too: say why it is missing, not only that it is
        return _native_module()
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next lookup finds it without coming here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _native_module():
    """gadei._native, the built C kernels; where there is none (a repository's source folder,
    which `import gadei` finds first when Python runs there after `pip install .`), an
    ImportError that says so and what to do."""
    try:
        return importlib.import_module("._native", __name__)
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}._native":
            raise
        import os

        raise ImportError(f"gadei's native module is not built in {os.path.dirname(__file__)}: this is a source "
                          "folder (Python puts the current folder first on sys.path), not the installed gadei; run "
                          "Python from another folder, or build it here with `python setup.py build_ext --inplace` "
                          "(or `pip install -e .`)", name=f"{__name__}._native") from None
