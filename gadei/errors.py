"""The errors gadei raises, one hierarchy rooted at GadeiError.

Every message names the job, the thing and the values on both sides of a mismatch, so a
user can act on it without reading the code.
"""


class GadeiError(Exception):
    """Base class of every error gadei raises on purpose."""


class BadJobName(GadeiError, ValueError):
    """A job name that cannot name a shared-memory region."""


class RegionError(GadeiError):
    """Something about a job's shared-memory region is wrong."""


class RegionNotFound(RegionError, FileNotFoundError):
    """No region exists for the job (no server has created it, or it was stopped)."""


class JobRunning(RegionError):
    """A live server already serves the job."""


class FolderInUse(GadeiError):
    """Another run holds the job's output folder (`gadei.claim`): it starts or runs now."""


class LeftoverRegion(RegionError):
    """A region whose server is gone: left behind by a crash."""


class ForeignRegion(RegionError):
    """A shared-memory object with the job's name that gadei did not create (or an older layout)."""


class ForeignOwner(RegionError, PermissionError):
    """The region belongs to another user."""


class RegionCorrupt(RegionError):
    """A field of a live region is outside what the protocol allows (a ring's head - tail, a
    counter, a header field written once): something other than gadei wrote it. The server
    stops the job on it; no checkpoint is taken of it."""


class RegionMismatch(RegionError):
    """The region does not hold what the attacher expects (parameters, dtype, model)."""


class CapacityError(GadeiError):
    """Every learner entry of the region is taken by a live learner."""


class JobStopped(GadeiError):
    """The job was stopped; a learner's step raises it and `with Learner(...)` ends quietly."""


class JobFailed(JobStopped):
    """The server stopped the job as failed (a corrupt region, a non-finite gradient with
    nonfinite = 'stop'); the message says why. Unlike a stop, `with Learner(...)` lets it through."""


class NonFiniteGradient(GadeiError):
    """A gradient with NaN or infinite values reached a server told to stop on one (nonfinite = 'stop')."""


class ServerGone(GadeiError):
    """The server died or stopped beating while a learner waited for it."""


class GadeiTimeout(GadeiError, TimeoutError):
    """A wait passed its deadline; the message says how long and for what."""


class DeviceError(GadeiError, ValueError):
    """A device a learner or job asks for that this machine cannot give (e.g. CUDA without a GPU)."""


class DaemonError(GadeiError):
    """Talking to the gadei daemon failed: none listens, the connection broke, or it refused a
    request (`DaemonRefused`)."""


class NoDaemon(DaemonError):
    """No daemon listens on the socket (none runs); `socket` is its path, which the message names."""

    def __init__(self, message: str, socket: str = ""):
        super().__init__(message)
        self.socket = socket


class DaemonRefused(DaemonError):
    """The daemon answered a request with a refusal; the message is its reason."""


class NoSuchJob(DaemonRefused, LookupError):
    """The daemon has no job of that name."""


class JobTimeout(GadeiTimeout):
    """A wait for a daemon job passed its deadline; `job` and `state` say which job and the state it
    was still in, as the message does."""

    def __init__(self, message: str, job: str = "", state: str = ""):
        super().__init__(message)
        self.job, self.state = job, state
