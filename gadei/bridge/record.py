"""What a node's bridge leaves its job when it ends (`BridgeEnd`, logs/bridge-end.json): what it
did, for the node's result.json, and the model the nodes agreed on (logs/bridge-agreed.pt),
written by the rank that ran the bridge (`leave`) and waited for by the node's supervisor
(`wait`), which alone writes the job's outputs."""

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import _proc, files
from ..protocol import Deadline

log = logging.getLogger(__name__)

END = "logs/bridge-end.json"  # the bridge's record, in the node's output folder
MODEL = "logs/bridge-agreed.pt"  # the model the nodes agreed on, which the rank saves there
QUIET = 30.0  # seconds beyond its timeout a bridge may make no exchange once its job ended, before it is given up


@dataclass
class BridgeEnd:
    """What a node's bridge did (result.json's "bridge"), and the model the nodes agreed on (a path,
    or None where it ended without one)."""

    summary: dict
    model: str | None = None


def leave(out: Path, background, rank: int, size: int, strategy: str, private: bool) -> BridgeEnd:
    """Once the bridge in `background` (a `gadei.bridge.Background`) ended: the agreed model saved
    (`private`: 0600), the record written whole; the record."""
    model = None
    if background.bridge is not None and background.bridge.final is not None:
        model = str(out / MODEL)
        background.bridge.save_final(model, private=private)
    summary = {"node": rank, "nodes": size, "strategy": strategy}
    report = background.report
    if report is not None:
        summary.update({k: v for k, v in asdict(report).items() if k not in ("rank", "job", "strategy")})
    else:
        summary["reason"] = f"no bridge ran: {background.error}"
    end = BridgeEnd(summary, model)
    files.replace(out / END, json.dumps(asdict(end)) + "\n")
    return end


def read(out: Path) -> BridgeEnd | None:
    try:
        return BridgeEnd(**json.loads((out / END).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def wait(out: Path, timeout: float, host: list) -> BridgeEnd | None:
    """The bridge's record, waited for while the rank that runs the bridge (`host`: [pid, start
    time]) lives, for at most twice its `timeout` plus QUIET seconds (beyond the quiet the rank
    itself allows); None where none came."""
    deadline = Deadline(2 * (timeout + QUIET))
    while not deadline.expired():
        found = read(out)
        if found is not None:
            return found
        if host and not _proc.alive(*host):
            found = read(out)  # written just before it ended
            if found is None:
                log.error("%s: the rank that ran its bridge (pid %d) is gone without its record", out, host[0])
            return found
        deadline.sleep(0.1)
    log.error("%s: no record of its bridge within %g s", out, deadline.seconds)
    return None
