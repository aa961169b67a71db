"""End to end, by hand: `gadei serve` and two `gadei learn` processes, each learner on its shard,
train the text CNN on TREC.

The layer under `gadei run`: a server started with its flags, learners started with theirs
(`--shard i/2`), each reporting its epochs, and the server's final weights read from its
region. Each learner sees every sample of its shard once an epoch, one update per
mini-batch, so the final version is the sum of the learners' steps and the shards together
cover the training set; and the weights learn. Whether two learners lose accuracy against
one, over seeds and `gadei run`'s defaults, is `tests/test_accuracy.py`'s claim (the long
tier); this is the fast check of the hand-run job, on a budget of EPOCHS epochs.

FLOOR was measured with this very budget (EPOCHS epochs, batch BATCH, lr LR, two learners):
over seeds 0-5 the final weights scored 83.6-88.4% on TREC's test set (86.7% the median;
`python tests/test_e2e.py` prints the figure of each seed again), so a run below FLOOR is a
broken job, not noise.
"""

import json
import time


from helpers import data_dir, missing
from gadei import params
from gadei.local import LocalJob
from gadei.region import Region

EPOCHS = 2
BATCH = 2
LR = 0.05
SEED = 0
FLOOR = 0.80


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
        codes = local.wait_learners(timeout=600)
        assert codes == [0] * learners, [local.log(f"learner-{i}") for i in range(learners)]
        with Region.attach(job, readonly=True) as region:
            model = workload.build_model(train, seed)
            model.load_state_dict(params.state_dict(region.read_spec(), region.weights))
            version = region.header.get("version")
        local.stop()
        epochs = [{**json.loads(line), "shard": i} for i in range(learners)  # learner i ran shard i/learners
                  for line in local.log(f"learner-{i}").splitlines() if line.startswith("{")]
    return {"accuracy": workload.evaluate(model, test), "version": version, "epochs": epochs, "train": len(train)}


def test_serve_and_two_learners_on_their_shards_train_trec(tmp_path):
    if not (data_dir() / "trec" / "TREC.train").exists():
        missing(f"TREC is not at {data_dir() / 'trec'} (set GADEI_DATA_DIR)")
    result = _train(tmp_path, 2, SEED)
    epochs = [e for e in result["epochs"] if e.get("event") == "epoch"]
    assert sorted((e["shard"], e["epoch"]) for e in epochs) == [(i, n) for i in (0, 1) for n in range(1, EPOCHS + 1)]
    # each shard's samples once an epoch, one update per mini-batch of BATCH: the shards cover the set
    shard = {i: (result["train"] - i + 1) // 2 for i in (0, 1)}
    assert sorted(e["steps"] for e in epochs) == sorted(-(-shard[e["shard"]] // BATCH) for e in epochs)
    # every mini-batch of both schedules applied once
    assert result["version"] == sum(e["steps"] for e in epochs)
    assert result["accuracy"] >= FLOOR, result["accuracy"]


if __name__ == "__main__":  # the figure FLOOR was set from: this test's budget over seeds 0-5
    import tempfile
    from pathlib import Path

    for seed in range(6):
        with tempfile.TemporaryDirectory() as folder:
            started = time.monotonic()
            result = _train(Path(folder), 2, seed)
            print(f"seed {seed}: {result['accuracy']:.2%} in {time.monotonic() - started:.0f} s", flush=True)
