"""A stop (SIGTERM: `gadei cancel`; SIGINT: Ctrl-C) that meets a job's end, with real processes,
each moment held on purpose (SIGSTOP/SIGCONT, or the supervisor's own hold, GADEI_PAUSE_AT),
not hoped for: the job's supervisor decides the outcome from what it sees when it takes the
stop, and only there.

(a) Mid-training: the job ends stopped, with a checkpoint that records each learner's progress,
    and `--resume` goes on from it to every learner's end (each mini-batch in the weights once).
(b) After the learners finished, before the supervisor saw it: the job ends done, its model
    handed back, and says the stop came after training ended (once, under load, it ended
    "stopped ... nothing to go on with; remove that folder", its finished model thrown away).
(c) While the outputs are written: done, every output written; the stop changes nothing.

Run them over and over on a loaded machine with `--busy 2`:

    python -m pytest -q tests/test_stop_race.py --busy 2
"""

import json
import os
import queue
import shlex
import signal

import psutil
import pytest

from gadei import checkpoint
from gadei.protocol import Deadline
from gadei.server_record import read_stop_record
from helpers import blobs_job, command_words, communicate, end_jobs, job_version, unique_name, wait_for

pytestmark = pytest.mark.faults  # also run on a loaded machine: `--busy 2 -m faults` (docs/testing.md)

STOP_WITHIN = 120  # seconds from the stop to gadei run's end, at most


def _job(folder, name: str, epochs: int):
    """The small job (an MLP on 900 blobs, two learners), no validation share: trained to its
    cap, whose mini-batches are known."""
    return blobs_job(folder, name, train={"learners": 2, "epochs": epochs, "lr": 0.05},
                     data={"train": "blobs.npz", "format": "npz", "holdout": 0.2, "validation_holdout": 0},
                     checkpoint={"interval": 600})


def _supervisor(run) -> psutil.Process:
    """`gadei run`'s job's supervisor (its child)."""
    return wait_for(lambda: next((c for c in psutil.Process(run.pid).children()
                                  if "gadei_watchdog" in " ".join(c.cmdline())), None), 60, "the job's supervisor")


def _learners(supervisor: psutil.Process) -> list[psutil.Process]:
    return [c for c in supervisor.children() if "learn" in command_words(c)]


def _stopped_state(proc: psutil.Process) -> bool:
    return proc.status() == psutil.STATUS_STOPPED


def _ended_done(run, out) -> tuple[str, str]:
    """`gadei run`'s output once it ended: exit 0, the job done and finished, its model, metrics
    and plot handed back."""
    stdout, stderr = communicate(run, STOP_WITHIN)
    assert run.returncode == 0 and "done in" in stdout, stdout + stderr
    result = json.loads((out / "result.json").read_text())
    assert (result["outcome"], result["finished"]) == ("done", True), result
    for name in ("model.pt", "metrics.jsonl", "accuracy.png"):
        assert (out / name).exists(), name
    return stdout, stderr


def _said(run, words: str, timeout: float) -> None:
    """Until `gadei run` printed a line holding `words` (the lines before it are read too)."""
    deadline = Deadline(timeout)
    while True:
        try:
            if words in run.lines.get(timeout=deadline.left()):
                return
        except queue.Empty:
            pytest.fail(f"gadei run did not say {words!r} within {timeout:g} s")


def _passed_on(supervisor: psutil.Process) -> bool:
    """`gadei run` passed the stop on: the held supervisor has a SIGTERM pending (ShdPnd, the
    signals sent to the process, in /proc/PID/status)."""
    with open(f"/proc/{supervisor.pid}/status") as status:
        pending = next(line for line in status if line.startswith("ShdPnd:"))
    return bool(int(pending.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


@pytest.fixture
def job(tmp_path):
    name = unique_name("race")
    yield name
    end_jobs(name)


def test_a_stop_mid_training_ends_stopped_and_resume_goes_on_to_every_learners_end(tmp_path, procs, job):
    """The command `gadei run` says to go on with is run as said, quoted for a shell: the job
    file's folder holds a space, quotes and a non-ASCII letter."""
    folder = tmp_path / "a job's \"folder\" é"
    folder.mkdir()
    path = _job(folder, job, epochs=200)
    out = folder / "out"
    run = procs.gadei("run", path, "--quiet")
    supervisor = _supervisor(run)
    wait_for(lambda: job_version(job) >= 300 and len(_learners(supervisor)) == 2, 120, "the job to make 300 updates")
    # the learners too: most of their schedule is left when the stop is taken
    held = [supervisor, *_learners(supervisor)]
    for proc in held:
        proc.send_signal(signal.SIGSTOP)
    try:
        # stopped, not only sent a SIGSTOP: a process that has not run since (a loaded machine)
        # takes a SIGTERM that comes now first (the lower signal number), and then stops, the
        # stop handled and never pending (it failed so once in 10 runs under --busy 2)
        wait_for(lambda: all(_stopped_state(proc) for proc in held), 60, "the supervisor and learners to stop")
        run.send_signal(signal.SIGTERM)  # gadei run passes it on; the held supervisor takes it once it runs
        wait_for(lambda: _passed_on(supervisor), 60, "gadei run to pass the stop on")
    finally:
        for proc in reversed(held):
            proc.send_signal(signal.SIGCONT)
    stdout, stderr = communicate(run, STOP_WITHIN)
    assert run.returncode == 130, stdout + stderr
    result = json.loads((out / "result.json").read_text())
    assert (result["outcome"], result["finished"]) == ("stopped", False), result
    found = checkpoint.latest(out / "checkpoints", with_progress=True)
    assert found is not None and set(found.progress) == {"0", "1"}, found and found.progress
    said = stdout.split("go on with `", 1)[-1].split("`", 1)[0]
    assert shlex.split(said) == ["gadei", "run", "--resume", str(path)], stdout
    first = read_stop_record(out / "logs" / "server-stop.json")

    # to its end sooner (another epoch cap may be asked for), past where it stopped: the learners
    # run on between their SIGCONT and the supervisor's checkpoint, a while on a loaded machine
    shards = [len(range(i, 721, 2)) for i in range(2)]  # each learner's samples an epoch: 721, 2 learners
    per_epoch = sum(-(-n // 2) for n in shards)  # mini-batches of 2
    # past each learner's own point: one may have run well ahead of the other (once, 3,068
    # samples of its schedule against 1,502, past the cap that the version alone suggested)
    epochs = max(found.progress[str(i)] // shards[i] for i in range(2)) + 2
    _job(folder, job, epochs=epochs)  # the same job file, to its end sooner
    resumed = procs.gadei(*shlex.split(said)[1:], "--quiet")
    stdout, stderr = communicate(resumed, STOP_WITHIN * 2)
    assert resumed.returncode == 0 and "done in" in stdout, stdout + stderr
    last = read_stop_record(out / "logs" / "server-stop.json")
    steps = epochs * per_epoch
    assert last.version == steps and last.resumed_applied + last.applied == steps, (first, last)
    assert 0 < last.resumed_applied <= first.version, (first, last)


def test_a_stop_after_the_learners_finished_ends_the_job_done(tmp_path, procs, job):
    path = _job(tmp_path, job, epochs=3)
    out = tmp_path / "out"
    run = procs.gadei("run", path)
    supervisor = _supervisor(run)
    wait_for(lambda: job_version(job) >= 50 and len(_learners(supervisor)) == 2, 120, "the job to train")
    learners = _learners(supervisor)
    supervisor.send_signal(signal.SIGSTOP)  # it has not seen the learners finish: their ends are its to see
    try:
        wait_for(lambda: _stopped_state(supervisor) and all(p.status() == psutil.STATUS_ZOMBIE for p in learners),
                 STOP_WITHIN, "both learners to finish their schedules")  # and the supervisor stopped: see (a)
        run.send_signal(signal.SIGTERM)
        wait_for(lambda: _passed_on(supervisor), 60, "gadei run to pass the stop on")
    finally:
        supervisor.send_signal(signal.SIGCONT)
    stdout, stderr = _ended_done(run, out)
    assert "the stop came after training ended" in json.loads((out / "result.json").read_text())["reason"]
    assert "remove that folder" not in stdout + stderr


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_stop_while_the_outputs_are_written_changes_nothing(tmp_path, procs, job, how):
    path = _job(tmp_path, job, epochs=3)
    out = tmp_path / "out"
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # not ignored in the child, whoever started us
    try:
        run = procs.gadei("run", path, env={**os.environ, "GADEI_PAUSE_AT": "concluding"})
    finally:
        signal.signal(signal.SIGINT, before)
    supervisor = _supervisor(run)
    try:
        wait_for(lambda: _stopped_state(supervisor), STOP_WITHIN, "the supervisor to hold before the outputs")
        assert (out / "logs" / "server-stop.json").exists() and not (out / "result.json").exists()
        run.send_signal(getattr(signal, how))
        _said(run, "stopping the job", 60)  # passed on to the held supervisor, which has decided the end
    finally:
        supervisor.send_signal(signal.SIGCONT)
    _ended_done(run, out)
