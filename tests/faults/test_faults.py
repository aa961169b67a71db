"""The fault-injection scenarios, in the long tier (`--long`): the fast subset, and with
`--soak` the rest (the full randomized suite: `python tests/faults/run.py`; see harness.py for
what each scenario does and checks).

Each test runs a real job (its supervisor, server, three launched learners training the text CNN
on TREC), injects one fault and checks that the job finishes with every mini-batch of its
schedule in the weights once, the exactly-once ledger, the lost progress, nothing left
behind, and test accuracy within 3 points of the median of three fault-free runs of the
same seed: a guard against damage (a restart from the initial weights, gradients applied
twice), not a noise test. Same-seed Hogwild runs of this job ended between 82.6% and 88.0%
on TREC here (19 runs), and a faulted run that passed every other check once ended at 80.0%
against 88.6% in CI (kill-server; 6 runs of it here: 86.2-90.0% against 88.0%): the low tail
of one run is noise. So a run whose only failed check is its accuracy is run once more, with
another injection point, and the test fails when that one is off too; damage moves every run.
The full suite also compares the median of all faulted runs.
"""

import random

import pytest

import harness
from helpers import missing

pytestmark = [pytest.mark.long, pytest.mark.faults]

FAST = [name for name, s in harness.SCENARIOS.items() if s.fast]
SLOW = [name for name, s in harness.SCENARIOS.items() if not s.fast]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    if not (harness.data_dir() / "trec").is_dir():
        missing(f"the TREC data set is not at {harness.data_dir() / 'trec'} (set GADEI_DATA_DIR)")
    harness.set_subreaper(True)  # orphans of killed supervisors and servers come to us to be reaped
    yield tmp_path_factory.mktemp("faults")
    harness.set_subreaper(False)
    harness.reap_orphans()


def _run(name: str, workdir, seed: int = 0):
    scenario = harness.SCENARIOS[name]
    if scenario.needs_unshare:
        why_not = harness.can_unshare()
        if why_not:
            pytest.skip(f"{name} needs a private mount namespace: {why_not}")
    outcome = harness.run_scenario(scenario, harness.Settings(seed=seed), workdir, tolerance=3.0, references=3,
                                   rng=random.Random(f"{name}-{seed}"))
    if outcome.only_accuracy_off:  # one run's low tail, or damage: a second run tells them apart
        first = outcome.problems[0]
        outcome = harness.run_scenario(scenario, harness.Settings(seed=seed), workdir, tolerance=3.0, references=3,
                                       rng=random.Random(f"{name}-{seed}-again"))
        if outcome.accuracy_off:
            outcome.problems.insert(0, f"the first run, too: {first}")
    assert outcome.passed, "\n".join(outcome.problems)
    return outcome


@pytest.mark.parametrize("name", FAST)
def test_a_job_survives(name, workdir):
    _run(name, workdir)


@pytest.mark.soak
@pytest.mark.parametrize("name", SLOW)
def test_a_job_survives_more(name, workdir):
    _run(name, workdir)
