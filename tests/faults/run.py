"""The full randomized fault-injection suite: every scenario, several runs, a table.

    python tests/faults/run.py [--runs 3] [--scenarios kill-server,stall-learner] [--epochs 4]

Run it from the repository root with gadei and its test extras installed (`pip install -e
'.[test]'`) and the shared data sets at GADEI_DATA_DIR (default ../shared/data). Every job
trains with job seed --job-seed; injection points and victims are drawn at random from --seed. A run passes
when every check of harness.py holds and its test accuracy is at most --run-tolerance (3)
points below the median of --references (5) fault-free runs; and the median accuracy of all
faulted runs must be at most --tolerance (1) point below it (damage lowers it). (Same-seed
Hogwild runs of this job end several points apart, now and then 4 points low, so one run
against one run would test noise.) It prints one line per run, then the table: scenario x
runs x passed x median recovery time (from the fault until the job is whole again) x mean
accuracy x its difference from the fault-free median. Exits 1 on any failure.
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests/: the harness imports helpers

import harness  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per scenario (default 3)")
    parser.add_argument("--scenarios", default=",".join(harness.SCENARIOS),
                        help=f"comma-separated (default all: {', '.join(harness.SCENARIOS)})")
    parser.add_argument("--epochs", type=int, default=4, help="epochs of every job (default 4)")
    parser.add_argument("--learners", type=int, default=3, help="launched learners per job (default 3)")
    parser.add_argument("--tolerance", type=float, default=1.0, help="accuracy points the median of all faulted "
                        "runs may be below the fault-free median (default 1)")
    parser.add_argument("--run-tolerance", type=float, default=3.0, help="accuracy points one run may be below the "
                        "fault-free median (default 3)")
    parser.add_argument("--references", type=int, default=5, help="fault-free runs averaged (default 5)")
    parser.add_argument("--job-seed", type=int, default=0, help="seed of every job's model and data order (default 0)")
    parser.add_argument("--seed", type=int, default=int(time.time()), help="seed of the injection points")
    parser.add_argument("--workdir", help="where jobs write (default: a temporary folder)")
    parser.add_argument("--json", help="also save every outcome here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in harness.SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {list(harness.SCENARIOS)}")
    why_not = harness.can_unshare()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gadei-faults-"))
    rng = random.Random(args.seed)
    print(f"fault suite: {len(names)} scenarios x {args.runs} runs, {args.learners} learners x {args.epochs} epochs "
          f"of TREC, injection seed {args.seed}, in {workdir}", flush=True)
    harness.set_subreaper(True)
    outcomes = []
    try:
        for run in range(args.runs):
            for name in names:
                scenario = harness.SCENARIOS[name]
                if scenario.needs_unshare and why_not:
                    print(f"  {name} run {run}: skipped: {why_not}", flush=True)
                    continue
                settings = harness.Settings(seed=args.job_seed, epochs=args.epochs, learners=args.learners)
                outcome = harness.run_scenario(scenario, settings, workdir, tolerance=args.run_tolerance,
                                               references=args.references, rng=random.Random(rng.randrange(2**32)))
                outcomes.append(outcome)
                acc = f"{outcome.accuracy:.1f}%" if outcome.accuracy is not None else "-"
                ref = f"{outcome.reference:.1f}%" if outcome.reference is not None else "-"
                rec = f"{outcome.recovery_s:.2f} s" if outcome.recovery_s is not None else "-"
                print(f"  {name} run {run}: {'passed' if outcome.passed else 'FAILED'} in {outcome.seconds:.0f} s; "
                      f"recovery {rec}; accuracy {acc} (fault-free {ref})", flush=True)
                for problem in outcome.problems:
                    print(f"      {problem}", flush=True)
    finally:
        harness.set_subreaper(False)
    print()
    print(harness.table(outcomes))
    refs = harness.reference_accuracy(harness.Settings(seed=args.job_seed, epochs=args.epochs,
                                                       learners=args.learners), workdir, args.references)
    faulted = [o.accuracy for o in outcomes if o.accuracy is not None]
    pooled_ok = True
    if faulted:
        diff = statistics.median(faulted) - statistics.median(refs)
        pooled_ok = diff >= -args.tolerance
        print(f"\nfault-free runs: {', '.join(f'{a:.1f}' for a in refs)}% (median {statistics.median(refs):.2f}%); "
              f"all {len(faulted)} faulted runs: median {statistics.median(faulted):.2f}%, mean "
              f"{statistics.mean(faulted):.2f}% ({diff:+.2f} points, "
              f"{'not' if pooled_ok else 'MORE than'} {args.tolerance:g} below)")
    if args.json:
        Path(args.json).write_text(json.dumps({"outcomes": [asdict(o) for o in outcomes], "references": refs},
                                              indent=1))
    return 0 if outcomes and all(o.passed for o in outcomes) and pooled_ok else 1


if __name__ == "__main__":
    sys.exit(main())
