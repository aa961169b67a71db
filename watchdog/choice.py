"""The candidate loop of a job that picks its model (`workload = "auto"`), as its supervisor runs
it: the candidates trained one after another, in the order `gadei.prepare` wrote for them
(cheapest first: `gadei.outputs.ORDER`), each a job of its own in its run folder, handed to the
job file's supervisor (`job`) to be supervised and concluded, until every one has ended or a
stop came. The choice itself is made when the job's own outputs are written
(`gadei.outputs.conclude`: the best validation accuracy of the candidates that handed back a
model), so that it is made once, by the one writer of the outputs.

A candidate that fails or diverges does not end the job: the next one trains, and the choice is
among those that handed back a model. A stop ends the candidate training now (a checkpoint that
records its learners' progress, as for any job) and no later one starts. A resumed run
(`--resume`, or a new supervisor that goes on after one died) keeps the candidates that ended for
good (done or diverged), goes on with the others from their newest checkpoint that records the
learners' progress, and starts the rest from their beginning (`gadei.outputs.afresh`).
"""

import logging
from typing import Callable

from gadei import checkpoint, jobfile, outputs
from gadei.errors import GadeiError

log = logging.getLogger(__name__)


class Choice:
    """The candidates of a job that picks its model, trained in turn.

    Args:
        job: the job as run (its output folder's job.toml, workload "auto").
        train: `(candidate's job, its checkpoint or None, when its run started) -> its result.json`:
            supervise one candidate from its folder to its end and write its outputs.
    """

    def __init__(self, job: jobfile.Job, train: Callable[[jobfile.Job, object, float], dict]):
        self.job, self.train = job, train

    def run(self, *, resume: bool, since: float, stopped: Callable[[], bool]) -> outputs.Ending:
        """Train each candidate that has not ended for good, in order; how the job's run ended
        (`finished`: every candidate ended; `stopped`: a stop cut it short). `resume`: go on from
        the candidates' checkpoints; `since`: when this run of the job started; `stopped`: whether
        a stop was asked (between two candidates, the next one does not start)."""
        found = outputs.candidates(self.job.output)
        if not found:
            raise GadeiError(f"job {self.job.name!r}: workload {jobfile.AUTO!r}, but {self.job.output} holds no "
                             f"{outputs.ORDER} (the candidates and their order): `gadei run` and the daemon write it "
                             "when they prepare the job")
        first = 0.0  # when this run's first gradient was applied (its first candidate's)
        for i, c in enumerate(found, 1):
            said = f"job {self.job.name!r}: candidate {i} of {len(found)}, {c.workload}"
            if c.final:
                log.info("%s: %s in an earlier run; its result is kept", said, c.result.get("outcome"))
                continue
            if stopped():
                log.info("%s: not started, the job was asked to stop", said)
                return outputs.Ending(0, finished=False, stopped=True, first_applied=first)
            at = checkpoint.latest(c.folder / "checkpoints", with_progress=True) if resume else None
            if at is None:
                outputs.afresh(c.folder)  # what an attempt of it left is not this run's
            log.info("%s: %s", said, f"goes on from checkpoint {at.path.name} (version {at.version:,})" if at else
                     "trains")
            result = self.train(jobfile.load(c.folder / "job.toml"), at, _started(found, since))
            log.info("%s: %s%s", said, result.get("outcome"),
                     f", validation accuracy {result['validation_accuracy']:.2%} (epoch {result['epoch']:g})"
                     if "validation_accuracy" in result and "epoch" in result else f": {result.get('reason')}")
            c.result = result
            first = first or outputs.first_update_at(result) or 0.0
            if result.get("outcome") == outputs.STOPPED:
                return outputs.Ending(0, finished=False, stopped=True, first_applied=first)
        return outputs.Ending(0, finished=True, first_applied=first)


def _started(found: list[outputs.Candidate], since: float) -> float:
    """When the candidate that trains now started, the start of its time base: when the last
    candidate that ended in this run of the job ended (its result.json's last run), or the run's
    start (`since`). A new supervisor that goes on with the run (one died) is handed the run's
    start, and so counts the candidate's seconds from the same moment as the one before it."""
    ends = [since]
    for c in found:
        runs = (c.result or {}).get("runs")
        if isinstance(runs, list) and runs and isinstance(runs[-1], dict):
            last = runs[-1]
            if isinstance(last.get("started"), (int, float)) and isinstance(last.get("seconds"), (int, float)) and \
                    last["started"] >= since:
                ends.append(last["started"] + last["seconds"])
    return max(ends)
