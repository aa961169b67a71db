"""The protocol model's checks: Spin verifies tests/model/protocol.pml at fixed bounds.

Each `Check` is one verifier run: `spin -a` with the check's bounds (-D), `gcc` of the
generated pan.c (`-DSAFETY` for assertions and deadlocks, `-DNP` for non-progress cycles,
neither for an LTL claim), then `./pan`. A check of the model as the code is expects no
error; a check of a faulty variant (a known mistake, or the code before a fix the model
led to) expects a counter-example, replayed with `spin -t`.

    python tests/model/check.py            # every check, a table of states, memory, time
    python tests/model/check.py ring-2x2   # some of them, by name (the deep ones only so)
    python tests/model/check.py --all      # also the deep ones (minutes, GBs)

tests/test_protocol_model.py runs the same checks; docs/protocol-model.md gives the figures
this prints.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MODEL = Path(__file__).with_name("protocol.pml")
DEPTH = 100_000  # pan -m: the deepest search (the model's runs are a few hundred steps)
MEMORY_MB = 1536  # pan -DMEMLIM: a check that needs more stops, it does not take the machine
# -DCOLLAPSE stores each state compressed per process: ~3x less memory, exhaustive still.
_PAN_CFLAGS = ("-O2", "-w", "-DCOLLAPSE", f"-DMEMLIM={MEMORY_MB}")


@dataclass(frozen=True)
class Check:
    """One verifier run.

    Attributes:
        name: how the tests and the docs call it.
        bounds: the model's -D bounds and switches (L, S, N, LCRASH, SCRASH, CKPTS, STOPS, OCLAIMS, ...).
        mode: 'safety' (assertions, invalid end states), 'progress' (non-progress cycles)
            or an LTL claim's name (`ltl ...` in the model, with -DLIVENESS).
        expect: None when the model must verify; else a text the counter-example's failed
            assertion (or spin's error line) holds.
        about: what it shows, one line.
        deep: too large for the test suite (minutes, over a GB): run it by name.
    """

    name: str
    bounds: tuple[str, ...]
    mode: str = "safety"
    expect: str | None = None
    about: str = ""
    deep: bool = False  # minutes and GBs: run by name only, not by the test suite

    def defines(self) -> list[str]:
        flags = [f"-D{b}" for b in self.bounds]
        return flags + (["-DLIVENESS"] if self.mode not in ("safety", "progress") else [])


_ALL_FAULTS = ("LCRASH=1", "SCRASH=1", "CKPTS=1", "STOPS=1")

CHECKS = (
    # The model as the code is: no counter-example.
    Check("ring-2x2", ("L=2", "S=2", "N=2", "LCRASH=0", "SCRASH=0", "CKPTS=0", "STOPS=1"),
          about="two learners, push thread hand-off, round-robin consume, stop"),
    Check("ring-1x3", ("L=1", "S=3", "N=3", "LCRASH=1", "SCRASH=1", "CKPTS=0", "STOPS=1"),
          about="three slots; a learner and the server killed at any step, restarts, stop"),
    Check("kill-after-release", ("L=2", "S=1", "N=1", "LCRASH=1", "SCRASH=0", "CKPTS=0", "STOPS=0"),
          about="two learners, one killed at any step (after it released its entry too), its ring taken over"),
    Check("two-claims", ("L=1", "S=2", "N=2", "LCRASH=1", "SCRASH=0", "CKPTS=0", "STOPS=0", "OCLAIMS=2"),
          about="a learner killed after it released its entry, claimed twice by another before the supervisor looks"),
    Check("two-claims-ckpt", ("L=1", "S=2", "N=2", "LCRASH=0", "SCRASH=1", "CKPTS=1", "STOPS=0", "OCLAIMS=2"),
          about="a checkpoint's progress of a learner that released its entry, claimed twice since; a restart from it"),
    Check("checkpoint-1x2", ("L=1", "S=2", "N=2", "LCRASH=0", "SCRASH=1", "CKPTS=1", "STOPS=1"),
          about="the checkpoint hold, the server killed at any step and resumed from it, stop"),
    Check("all-1x2", ("L=1", "S=2", "N=2", *_ALL_FAULTS),
          about="every fault at once: kills, restarts, the checkpoint hold, stop", deep=True),
    Check("progress-1x2", ("L=1", "S=2", "N=2", "LCRASH=1", "SCRASH=1", "CKPTS=0", "STOPS=1"), mode="progress",
          about="no cycle without a publish or an apply (livelock), with kills and restarts"),
    Check("ends-1x2", ("L=1", "S=2", "N=2", "LCRASH=1", "SCRASH=1", "CKPTS=0", "STOPS=1"), mode="ends",
          about="LTL <> wd_ended: every run ends, every process with it"),
    Check("stop-ends-1x2", ("L=1", "S=2", "N=2", "LCRASH=1", "SCRASH=1", "CKPTS=0", "STOPS=1"), mode="stop_ends",
          about="LTL [](user_stop -> <> wd_ended): a `gadei stop` ends every process"),
    # Known mistakes: each must give a counter-example.
    Check("bug-head-before-header", ("L=1", "S=2", "N=2", "LCRASH=0", "SCRASH=0", "CKPTS=0", "STOPS=0",
                                     "BUG_HEAD_BEFORE_HEADER"),
          expect="hdr[", about="publish stores head before the slot header"),
    Check("bug-no-zero", ("L=1", "S=2", "N=3", "LCRASH=0", "SCRASH=0", "CKPTS=0", "STOPS=0", "BUG_NO_ZERO"),
          expect="cnt[i]==0", about="the server hands a slot back without clearing it"),
    # The code before the fixes this model led to: each must give a counter-example.
    Check("old-drain", ("L=1", "S=2", "N=2", "LCRASH=1", "SCRASH=0", "CKPTS=0", "STOPS=1", "OLD_DRAIN"),
          expect="head[i]==tail[i]", about="Server._drain ended with a dead learner's last gradient unapplied"),
    Check("old-capture", ("L=1", "S=2", "N=2", "LCRASH=0", "SCRASH=1", "CKPTS=1", "STOPS=0", "OLD_CAPTURE"),
          expect="cnt[i]==0", about="capture copied a dead server's region, mid-update"),
    Check("old-pid-order", ("L=2", "S=2", "N=2", "LCRASH=1", "SCRASH=0", "CKPTS=0", "STOPS=0", "OLD_PID_ORDER"),
          expect="cnt[i]==", about="a new owner's pid stood beside the old owner's counters; release cleared it"),
    Check("old-restart-stop", ("L=1", "S=2", "N=2", "LCRASH=0", "SCRASH=1", "CKPTS=0", "STOPS=1", "OLD_RESTART_STOP"),
          expect="run_state!=1", about="a restarted server forgot a `gadei stop`"),
    Check("old-kill-after-release", ("L=1", "S=2", "N=2", "LCRASH=1", "SCRASH=0", "CKPTS=0", "STOPS=0",
                                     "OLD_KILL_AFTER_RELEASE"),
          expect="cnt[i]==0", about="killed after release, before exit: restarted from a stale `seen`"),
    Check("old-last-owner", ("L=1", "S=2", "N=2", "LCRASH=1", "SCRASH=0", "CKPTS=0", "STOPS=0", "OCLAIMS=2",
                             "OLD_LAST_OWNER"),
          expect="cnt[i]==0", about="the last owner's copy kept in the claimed entry, overwritten by a second claim"),
    Check("old-last-owner-ckpt", ("L=1", "S=2", "N=2", "LCRASH=0", "SCRASH=1", "CKPTS=1", "STOPS=0", "OCLAIMS=2",
                                        "OLD_LAST_OWNER"),
          expect="cnt[i]==0", about="the same, read by a checkpoint's progress, and a restart from it"),
)


@dataclass
class Result:
    """What one run of pan printed."""

    check: Check
    errors: int
    stored: int
    transitions: int
    depth: int
    memory_mb: float
    seconds: float
    output: str
    replay: str = ""  # `spin -t -p` of the counter-example, when there is one

    @property
    def failed_assertion(self) -> str:
        found = re.search(r"assertion violated (.*)", self.output)
        return found.group(1).strip() if found else ""


def tools() -> dict[str, str | None]:
    """Where spin and gcc are (None: missing)."""
    return {name: shutil.which(name) for name in ("spin", "gcc")}


def _number(pattern: str, text: str, kind=int):
    found = re.search(pattern, text)
    return kind(found.group(1)) if found else kind(0)


def run(check: Check, workdir: str | os.PathLike | None = None, timeout: float = 300.0) -> Result:
    """Verify `check` in `workdir` (a fresh temporary folder when None).

    Raises:
        RuntimeError: spin or gcc failed, or pan ran out of memory or depth.
    """
    own = workdir is None
    folder = Path(tempfile.mkdtemp(prefix="gadei-model-") if own else workdir)
    try:
        model = folder / MODEL.name
        shutil.copyfile(MODEL, model)
        _call(["spin", *check.defines(), "-a", model.name], folder, timeout)
        cflags = {"safety": ["-DSAFETY"], "progress": ["-DNP"]}.get(check.mode, [])
        _call(["gcc", *_PAN_CFLAGS, *cflags, "-o", "pan", "pan.c"], folder, timeout)
        args = ["./pan", f"-m{DEPTH}", "-n"]
        if check.mode == "progress":
            args.append("-l")
        elif check.mode != "safety":
            args += ["-a", "-N", check.mode]
        started = time.monotonic()
        out = _call(args, folder, timeout, ok=(0, 1))
        seconds = time.monotonic() - started
        if "max search depth too small" in out or "MEMLIM" in out or "out of memory" in out.lower():
            raise RuntimeError(f"check {check.name}: pan did not finish the search:\n{out}")
        result = Result(
            check=check,
            errors=_number(r"errors: (\d+)", out),
            stored=_number(r"(\d+) states, stored", out),
            transitions=_number(r"(\d+) transitions", out),
            depth=_number(r"depth reached (\d+)", out),
            memory_mb=_number(r"([\d.]+)\s+total actual memory usage", out, float),
            seconds=seconds,
            output=out,
        )
        if result.errors and (folder / f"{model.name}.trail").exists():
            result.replay = _call(["spin", *check.defines(), "-t", "-p", model.name], folder, timeout)
        return result
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)


def _call(args: list[str], folder: Path, timeout: float, ok=(0,)) -> str:
    proc = subprocess.run(args, cwd=folder, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode not in ok:
        raise RuntimeError(f"{' '.join(args)} exited with {proc.returncode}:\n{out[-4000:]}")
    return out


def main(argv: list[str]) -> int:
    missing = [name for name, path in tools().items() if path is None]
    if missing:
        print(f"missing: {', '.join(missing)} (apt-get install spin gcc)", file=sys.stderr)
        return 2
    chosen = [c for c in CHECKS if c.name in argv or (not argv and not c.deep) or argv == ["--all"]]
    print(f"{'check':24} {'mode':10} {'expect':9} {'errors':>6} {'states stored':>14} {'transitions':>12} "
          f"{'depth':>6} {'memory MB':>10} {'seconds':>8}  bounds")
    bad = 0
    for check in chosen:
        result = run(check)
        good = (result.errors == 0) if check.expect is None else (result.errors > 0 and bool(result.replay))
        bad += not good
        print(f"{check.name:24} {check.mode:10} {'pass' if check.expect is None else 'counter':9} {result.errors:>6} "
              f"{result.stored:>14,} {result.transitions:>12,} {result.depth:>6} {result.memory_mb:>10.1f} "
              f"{result.seconds:>8.1f}  {' '.join(check.bounds)}" + ("" if good else "   <-- UNEXPECTED"), flush=True)
        if result.errors:
            print(f"{'':24} counter-example: assertion violated {result.failed_assertion or result.output[:200]!r}",
                  flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
