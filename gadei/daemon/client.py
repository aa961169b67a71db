"""Talking to the daemon: one request and its answer (`request`, `client`), `gadei daemon stop`,
the systemd user unit that runs it, and the table `gadei status` prints of its jobs."""

import json
import logging
import os
import shlex
import socket
import time

from .. import _proc
from ..errors import GadeiError, GadeiTimeout
from ..protocol import Deadline, wait_for
from .jobs import socket_path

log = logging.getLogger(__name__)

def request(path: str | None, message: dict, timeout: float = 30.0) -> dict:
    """Send one request to the daemon; its answer, within `timeout` seconds in all.

    A full listen backlog (EAGAIN) is waited out until the deadline, and a refused connection
    (a daemon restarting) for up to 2 s of it.

    Raises:
        FileNotFoundError, ConnectionRefusedError: no daemon listens on `path`.
        GadeiTimeout: no answer within `timeout`.
    """
    path = path or socket_path()
    deadline = Deadline(timeout)
    refused = Deadline(min(2.0, timeout))  # how long a refused connection is tried again
    pause = 0.005
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.001, deadline.left()))
            sock.connect(path)
            break
        except (BlockingIOError, InterruptedError, ConnectionRefusedError) as err:
            sock.close()
            if isinstance(err, ConnectionRefusedError) and refused.expired():
                raise
            if deadline.expired():
                raise GadeiTimeout(f"the gadei daemon on {path} did not take the connection within {timeout:g} s "
                                   "(its listen backlog stayed full)") from None
            deadline.sleep(pause)
            pause = min(0.1, pause * 2)
        except BaseException:
            sock.close()
            raise
    with sock:
        try:
            sock.sendall((json.dumps(message) + "\n").encode())
            data = b""
            while not data.endswith(b"\n"):
                sock.settimeout(max(0.001, deadline.left()))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except socket.timeout:
            raise GadeiTimeout(f"the gadei daemon on {path} did not answer within {timeout:g} s (is it stopped?)") \
                from None
    if not data:
        raise GadeiError(f"the gadei daemon on {path} closed the connection without an answer")
    return json.loads(data)


class NoDaemon(GadeiError):
    """No daemon listens on this user's socket (none runs)."""


def client(message: dict, timeout: float = 30.0) -> dict:
    """`request` for the command line: a clear error when no daemon runs (`NoDaemon`), or it refused."""
    path = socket_path()
    try:
        answer = request(path, message, timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        raise NoDaemon(f"no gadei daemon listens on {path}; start one with `gadei daemon`") from None
    except PermissionError:
        raise GadeiError(f"{path} belongs to another user's daemon") from None
    if not answer.get("ok"):
        raise GadeiError(answer.get("error", "the daemon refused"))
    return answer


def stop(timeout: float = 30.0) -> int:
    """`gadei daemon stop`: ask the daemon to stop and wait until it has; its pid.

    Raises:
        GadeiError: no daemon runs.
        GadeiTimeout: it did not end within `timeout`.
    """
    pid = client({"op": "stop"}, timeout)["pid"]
    wait_for(lambda: not _proc_running(pid), timeout, f"the gadei daemon (pid {pid}) to stop")
    return pid


def _proc_running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def systemd_unit() -> str:
    """A systemd user unit that runs this gadei's daemon (`gadei daemon systemd-unit` prints it)."""
    env = "".join(f"Environment={name}={os.environ[name]}\n" for name in ("GADEI_STATE_DIR", "GADEI_RUNTIME_DIR")
                  if os.environ.get(name))
    return (
        "[Unit]\n"
        "Description=gadei daemon: queued training jobs of %u\n\n"
        "[Service]\n"
        "Type=simple\n"
        f"ExecStart={shlex.join(_proc.gadei_command('daemon', 'run'))}\n"
        f"ExecStop={shlex.join(_proc.gadei_command('daemon', 'stop'))}\n"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        "UMask=0077\n"
        "KillMode=process\n"  # jobs run in sessions of their own: stopping the daemon leaves them running
        + env +
        "\n[Install]\n"
        "WantedBy=default.target\n"
    )


def format_jobs(jobs: list[dict]) -> str:
    rows = [("job", "state", "submitted", "ran", "output", "note")]
    for j in jobs:
        ran = (j["ended"] or time.time()) - j["started"] if j["started"] else 0
        rows.append((j["name"], j["state"], time.strftime("%m-%d %H:%M:%S", time.localtime(j["submitted"])),
                     f"{ran:.0f} s" if j["started"] else "-", j["output"], j["message"]))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
