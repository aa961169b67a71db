"""How a gadei command runs in a terminal: logging set up once from GADEI_LOG, and a
refusal shown as one line (`gadei: error: ...`, exit 2) instead of a traceback, a closed pipe
on stdout a quiet stop, and the process's end once the command returned (`leave`)."""

import atexit
import gc
import json
import logging
import os
import re
import signal
import sys
import threading

from .env import settings
from .errors import GadeiError

REFUSED = 2  # the exit code of a command that refuses to go on and says why on stderr (argparse's too)


def emit(record: dict) -> None:
    """One JSON line on stdout, for programs (a command's `--json`, a learner's epoch records)."""
    print(json.dumps(record), flush=True)


def configure_logging(default: str = "INFO") -> None:
    """The log records of this process to stderr, at GADEI_LOG's level, else at `default`."""
    level = getattr(logging, settings().log_level or default, logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def refusal_in(log: "str | os.PathLike") -> str:
    """What a gadei process refused, as the last line of its `log` says it: `run`'s
    `PROG: error: ...`, without `PROG: error: `; "" where that line is not there (it died
    otherwise, or the log could not be written: a full disk)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    said = (_REFUSAL.match(line) for line in reversed(lines))
    return next((match[1] for match in said if match), "")


_REFUSAL = re.compile(r"gadei(?: [a-z]+)?: error: (.+)")  # `run`'s line, whichever gadei command's prog


def run(func, args, prog: str = "gadei") -> int:
    """`func(args)`'s exit code; REFUSED (2) with one line on stderr for what gadei refuses, 130 on Ctrl-C,
    141 when stdout's reader has gone."""
    # A command whose own lines say what happens (`gadei run`) shows the library's records only
    # from WARNING unless GADEI_LOG asks for more; the others log at INFO (their logs are files).
    try:
        configure_logging(getattr(args, "log_default", "INFO"))  # reads every GADEI_* setting: a bad one is refused
        return func(args)
    except GadeiError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return REFUSED
    except (ValueError, FileNotFoundError, PermissionError) as err:  # bad values found after parsing (data
        print(f"{prog}: error: {err}", file=sys.stderr)  # specs, env variables), missing or unreadable files
        return REFUSED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # whoever read stdout is gone (`gadei logs JOB | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not fail again
        return 128 + signal.SIGPIPE  # what a shell reports for a command a closed pipe stopped


def leave(code: int):
    """End this process, a command's, with exit code `code` (its `main`'s): its exit handlers
    run (logging's flush) and its streams are flushed, then it ends without tearing down its
    objects one by one (half a second of an interpreter that imported torch). Where a thread of
    its own still runs, it exits as an interpreter does, which waits for it, its objects kept
    from the collector's last passes (`gc.freeze`: 0.35 s of that half second). For a program's
    entry point only: never returns."""
    if any(t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        gc.freeze()
        sys.exit(code)
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
