"""gadei: a shared-memory scale-up parameter server for deep-learning training.

A server process holds a job's weights in one POSIX shared-memory region and applies, in
place and lock-free, every gradient its learners publish into their rings. docs/how-it-works.md
gives the data flow; the public API is `Server`, `Learner` and the errors.
"""

from .env import quiet_openmp

quiet_openmp()  # before anything loads OpenMP (torch, gadei._native): idle kernel threads sleep

from .errors import (
    BadJobName,
    CapacityError,
    DeviceError,
    ForeignOwner,
    ForeignRegion,
    GadeiError,
    GadeiTimeout,
    JobRunning,
    JobStopped,
    LeftoverRegion,
    RegionError,
    RegionMismatch,
    RegionNotFound,
    ServerGone,
)
from .learner import Learner
from .modes import RuleOptions
from .server import Server
from .transport.options import TransportOptions

__version__ = "0.1.0"

__all__ = [
    "BadJobName",
    "CapacityError",
    "DeviceError",
    "ForeignOwner",
    "ForeignRegion",
    "GadeiError",
    "GadeiTimeout",
    "JobRunning",
    "JobStopped",
    "Learner",
    "LeftoverRegion",
    "RegionError",
    "RegionMismatch",
    "RegionNotFound",
    "RuleOptions",
    "Server",
    "ServerGone",
    "TransportOptions",
]
