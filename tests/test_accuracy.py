"""Training as a service, end to end: a job file with nothing tuned reaches its accuracy.

Each case is the job a user with only a labelled file would write (`[job]`, `[data]`,
`[train] learners`; every hyper-parameter is the default `gadei run` chooses), run with
`gadei run` as a real job (server, watchdog, launched learners) with two learners and
with one, for the same default epochs. The accuracy is that of the final model on the
whole test set (`result.json`). Two learners must reach the target and lose at most one
point to one learner (async Hogwild updates from stale weights must not cost accuracy).

TREC runs in the default suite (slow: about five minutes here); SST-2 and banking77 take
about ten minutes each on a 2-core machine and run with `--soak`.
"""

import json

import pytest

from conftest import communicate, data_dir

CASES = {
    "trec": (0.85, """
        [data]
        train = "{d}/trec/TREC.train"
        test = "{d}/trec/TREC.test"
        format = "trec"
        encoding = "latin-1"
    """),
    "sst2": (0.78, """
        [data]
        train = "{d}/sst2/stsa.binary.train"
        test = "{d}/sst2/stsa.binary.test"
        format = "label-text"
    """),
    "banking77": (0.80, """
        [data]
        train = "{d}/banking77/train.csv"
        test = "{d}/banking77/test.csv"
        format = "csv"
        label_column = "category"
    """),
}


def _run(procs, folder, case: str, learners: int) -> dict:
    name = f"acc-{case}-{learners}-{folder.parent.name[-12:]}".replace("_", "-")
    path = folder / f"{case}-{learners}.toml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(f'[job]\nname = "{name}"\nworkload = "textcnn"\n'
                    + "\n".join(line.strip() for line in CASES[case][1].format(d=data_dir()).splitlines())
                    + f'\n[train]\nlearners = {learners}\n[output]\nfolder = "out-{learners}"\n')
    run = procs.gadei("run", path, "--quiet")
    out, err = communicate(run, 1800)
    assert run.returncode == 0, out + err
    assert "chose epochs" in out, out
    result = json.loads((folder / f"out-{learners}" / "result.json").read_text())
    assert result["finished"] and result["learners"] == learners
    return result


@pytest.mark.parametrize("case", [
    pytest.param("trec", marks=pytest.mark.slow),
    pytest.param("sst2", marks=pytest.mark.soak),
    pytest.param("banking77", marks=pytest.mark.soak),
])
def test_a_job_with_default_settings_reaches_its_accuracy_with_two_learners_as_with_one(case, tmp_path, procs):
    target, _ = CASES[case]
    if not (data_dir() / case).is_dir():
        pytest.skip(f"{case} is not at {data_dir() / case} (set GADEI_DATA_DIR)")
    two = _run(procs, tmp_path / case, case, learners=2)
    one = _run(procs, tmp_path / case, case, learners=1)
    report = f"{case}: two learners {two['test_accuracy']:.2%} in {two['seconds']} s, one {one['test_accuracy']:.2%} " \
             f"in {one['seconds']} s, {two['epochs']} epochs"
    print(report)
    assert two["epochs"] == one["epochs"], report
    assert two["test_accuracy"] >= target, report
    assert two["test_accuracy"] >= one["test_accuracy"] - 0.01, report
