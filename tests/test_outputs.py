"""A run's outputs (`gadei.outputs`): what result.json and the run's last line say of a
resumed run's time."""

import json
import re
import signal

from gadei import outputs
from helpers import blobs_job, communicate, end_jobs, finish, job_version, unique_name, wait_for


def test_a_resumed_run_says_its_seconds_with_the_runs_it_resumed(tmp_path, procs):
    """result.json's `seconds` is this run's; `seconds_in_all` adds the runs it resumed (from
    the stopped run's result.json, which the resumed run replaces), and the last line says both
    (once it said only the resumed part, as if the job had taken that long)."""
    name = unique_name("goon")
    path = blobs_job(tmp_path, name, train={"learners": 1, "epochs": 12, "patience": 12, "lr": 0.05},
                     checkpoint={"interval": 1})
    out = tmp_path / "out"
    try:
        run = procs.gadei("run", path, "--quiet")
        wait_for(lambda: job_version(name) >= 300, 180, "the job to make 300 updates", interval=0.05)
        run.send_signal(signal.SIGTERM)  # `gadei cancel`'s path: checkpoint the progress, then stop
        said, err = communicate(run, 120)
        assert run.returncode == 130 and "stopped after" in said and "with the runs it resumed" not in said, said + err
        stopped = json.loads((out / "result.json").read_text())
        assert stopped["seconds"] > 0 and "seconds_in_all" not in stopped, stopped

        said, _ = finish(procs.gadei("run", path, "--resume", "--quiet"), 300)
        result = json.loads((out / "result.json").read_text())
        assert result["finished"] and result["seconds_in_all"] == round(stopped["seconds"] + result["seconds"], 1)
        took = re.search(r"done in (\d+) s \((\d+) s with the runs it resumed\)", said)
        assert took, said
        assert abs(int(took[2]) - int(took[1]) - stopped["seconds"]) <= 1, (said, stopped)
    finally:
        end_jobs(name)


def test_a_run_resumed_after_a_kill_that_left_no_result_says_nothing_of_the_time_before(tmp_path):
    """A run killed before any process wrote its result.json leaves its time unknown: the
    resumed run keeps none (rather than the older runs' time, which would undercount), and
    neither does a run that is not resumed."""
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "result.json").write_text(json.dumps({"seconds": 30.0, "seconds_in_all": 50.0}))
    outputs.forget(out, resume=True)
    assert json.loads((out / outputs.EARLIER).read_text()) == {"seconds": 50.0}
    assert not (out / "result.json").exists()
    outputs.forget(out, resume=True)  # the resumed run was killed: no result.json of it
    assert not (out / outputs.EARLIER).exists()
    (out / "result.json").write_text(json.dumps({"seconds": 30.0}))
    outputs.forget(out)
    assert not (out / outputs.EARLIER).exists()
