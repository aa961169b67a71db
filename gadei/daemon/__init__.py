"""`gadei daemon`: training as a service for one user. Jobs arrive as job files on a Unix
socket, wait in a queue, and run up to `max_jobs` at once, each under its own supervisor (the
daemon prepares the job, starts its supervisor, and reads its result.json at the end).

The socket is `daemon.sock` in the user's runtime folder (`gadei.env.runtime_dir`, mode
0700), itself mode 0600, and every request's peer uid is read with SO_PEERCRED: a request
from another user is refused even where the file modes would let it through.

Each job's record is a JSON file in the state folder's jobs/ (`$GADEI_STATE_DIR/jobs/`,
default `$XDG_STATE_HOME/gadei/jobs/` or `~/.local/state/gadei/jobs/`), written atomically
on every change, so a daemon that is restarted knows every job's state and output. A job's
supervisor runs in a session of its own: a daemon that stops or dies leaves it running, and the
next one finds it again by its pid and start time (or, if the job ended meanwhile, its
result.json). A job's supervisor that dies takes its job down with it; the daemon starts a new
one that goes on from the job's newest checkpoint (`gadei.supervisor.Supervised`). A cancel is
a stop the job's supervisor takes: a checkpoint to go on from, then the job's end.

One daemon per state folder: it holds an exclusive `flock` on `daemon.lock` there (and on
`daemon.sock.lock` beside its socket) for its whole life, so a second daemon is refused at
once, even beside a stopped one, and a daemon only ever removes its own socket.

Protocol: one JSON object per line each way. Requests: {"op": "submit", "jobfile": PATH,
"resume": BOOL}, {"op": "status", "job": NAME or null}, {"op": "cancel", "job": NAME},
{"op": "logs", "job": NAME, "lines": N}, {"op": "stop"}. Answers: {"ok": true, ...} or {"ok":
false, "error": MESSAGE, "kind": CLASS} (the class of the error, e.g. NoSuchJob or JobFileError,
which `Client` raises again; absent for a request refused before it was read). One thread serves
every connection (`listener.Loop`, a selector): a request
is at most MAX_REQUEST bytes and must arrive within REQUEST_TIMEOUT, at most MAX_CONNECTIONS
are open at once, and every request, however malformed, gets an answer; WORKERS threads
compute the answers. A job that cannot start is marked failed with the reason, and the queue
goes on. `Client` (`gadei.Client`) is the one way to talk to it, from Python and for the
commands.
"""

from ..errors import NoDaemon
from .client import Client, format_jobs, request, systemd_unit
from .jobs import CANCELLED, DONE, FAILED, LIVE, QUEUED, RUNNING, JobRecord, state_dir
from .service import Daemon, DaemonRunning, socket_path
from .listener import MAX_CONNECTIONS, MAX_REQUEST, REQUEST_TIMEOUT, BadRequest

__all__ = ["CANCELLED", "DONE", "FAILED", "LIVE", "MAX_CONNECTIONS", "MAX_REQUEST", "NoDaemon", "QUEUED",
           "REQUEST_TIMEOUT", "RUNNING", "BadRequest", "Client", "Daemon", "DaemonRunning", "JobRecord", "format_jobs",
           "request", "socket_path", "state_dir", "systemd_unit"]
