"""MPI for the bridge: mpi4py loaded once without finalize-at-exit, the bridge's errors, and
every wait on a peer polled against a deadline (a lost peer is a LinkDown, never a hang)."""

import functools
import time

from ..errors import GadeiError, GadeiTimeout
from ..protocol import Deadline


class BridgeError(GadeiError):
    """The bridge cannot run (no MPI, a job it cannot move, bad options)."""


class LinkDown(GadeiTimeout):
    """A wait on a peer ended without its answer: the deadline passed, or MPI reported the peer failed."""


class PeerLost(GadeiError):
    """A peer did not answer within the timeout."""

    def __init__(self, message: str, peers: list[int]):
        super().__init__(message)
        self.peers = peers


def mpi():
    """mpi4py's MPI module, initialised without finalize-at-exit (the bridge decides).

    Raises:
        BridgeError: mpi4py (or the MPI library under it) is not installed.
    """
    try:
        import mpi4py

        mpi4py.rc.finalize = False  # after a lost peer, MPI_Finalize could wait for it
        from mpi4py import MPI
    except ImportError as err:
        raise BridgeError(f"the MPI bridge needs mpi4py and Open MPI ({err}): pip install 'gadei[mpi]'") from None
    return MPI


def pause(waited: float) -> None:
    """Between two polls: only yield the core for the first 20 ms (a non-blocking collective
    moves on only while it is polled), then sleep longer the longer the wait (up to 2 ms)."""
    time.sleep(0 if waited < 0.02 else min(0.002, waited / 20))


def wait_all(requests: list, deadline: Deadline, what: str, on_poll=None) -> None:
    """Poll `requests` until all completed; LinkDown (a GadeiTimeout) naming `what` once
    `deadline` expired, or at once when MPI reports that a peer failed. One deadline may
    bound several waits (the buckets of one exchange).

    `on_poll` is called between polls (the bridge beats its ring entry there).
    """
    MPI = mpi()
    started = time.monotonic()
    try:
        while not MPI.Request.Testall(requests):
            waited = time.monotonic() - started
            if deadline.expired():
                raise LinkDown(f"{what}: no answer within {waited:.1f} s")
            if on_poll is not None:
                on_poll()
            pause(waited)
    except MPI.Exception as err:
        raise LinkDown(f"{what}: MPI error: {err.Get_error_string()}") from None


def link_errors(method):
    """Turn an MPI error inside `method` (a peer that failed) into LinkDown."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        MPI = mpi()
        try:
            return method(*args, **kwargs)
        except MPI.Exception as err:
            raise LinkDown(f"MPI error: {err.Get_error_string()}") from None

    return wrapper
