"""End to end: two learners and a server train the text CNN on TREC as well as one learner does.

Each run is a real job: `gadei serve` plus `gadei learn` processes, each learner on its
shard of the data, for the same number of epochs over the whole training set (so both
runs do the same total work). The test accuracy is that of the server's final weights.
Test accuracy on TREC's 500 questions moves by a point or two between seeds, so the
comparison is of the mean over SEEDS seeds.
"""

import json
import time

import pytest

from helpers import data_dir, missing
from gadei import params
from gadei.launch import LocalJob
from gadei.region import Region

EPOCHS = 8
BATCH = 2
LR = 0.05
SEEDS = (0, 1)


def _train(tmp_path, learners: int, seed: int) -> dict:
    from gadei_workloads import get

    data = f"trec:{data_dir() / 'trec'}"
    workload = get("textcnn")
    train, test = workload.load_data(data)
    job = f"test-e2e-{learners}-{seed}-{time.monotonic_ns() % 10**9}"
    common = ["--data", data, "--seed", str(seed)]
    serve = ["--workload", "textcnn", *common, "--lr", str(LR), "--learners", str(learners)]
    learn = [[*common, "--epochs", str(EPOCHS), "--batch", str(BATCH), "--shard", f"{i}/{learners}", "--json"]
             for i in range(learners)]
    with LocalJob(job, serve, learn, log_dir=tmp_path) as local:
        local.start()
        codes = local.wait_learners(timeout=1200)
        assert codes == [0] * learners, [local.log(f"learner-{i}") for i in range(learners)]
        with Region.attach(job, readonly=True) as region:
            model = workload.build_model(train, seed)
            model.load_state_dict(params.state_dict(region.read_spec(), region.weights))
            version = region.header.get("version")
        local.stop()
        epochs = [json.loads(line) for i in range(learners)
                  for line in local.log(f"learner-{i}").splitlines() if line.startswith("{")]
    return {"accuracy": workload.evaluate(model, test), "version": version, "epochs": epochs}


@pytest.mark.slow
def test_two_learners_reach_the_accuracy_of_one_on_trec(tmp_path):
    if not (data_dir() / "trec" / "TREC.train").exists():
        missing(f"TREC is not at {data_dir() / 'trec'} (set GADEI_DATA_DIR)")
    runs = {1: [], 2: []}
    for seed in SEEDS:
        for learners in (1, 2):
            result = _train(tmp_path / f"{learners}-{seed}", learners, seed)
            runs[learners].append(result)
            # the same total work: every sample seen EPOCHS times, one update per mini-batch
            assert result["version"] == sum(e["steps"] for e in result["epochs"])
    accuracy = {n: [r["accuracy"] for r in rs] for n, rs in runs.items()}
    mean = {n: sum(a) / len(a) for n, a in accuracy.items()}
    assert min(accuracy[2]) >= 0.85, accuracy
    assert min(accuracy[1]) >= 0.85, accuracy
    assert mean[2] >= mean[1] - 0.01, accuracy
