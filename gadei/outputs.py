"""A run's outputs in its folder: metrics.jsonl from the learners' epoch records, the plot
(accuracy.png) and result.json (the final model's test accuracy)."""

import json
from pathlib import Path

from . import jobfile


def write_result(job: jobfile.Job, train, test, out: Path, seconds: float, finished: bool,
            bridge: dict | None = None) -> dict:
    """result.json: the final model's test accuracy (evaluated here, on the whole test set),
    the version it is, and the run's seconds (this run's, since a resume); for a node of a
    bridged run, what its bridge did."""
    import torch
    from gadei_workloads import get

    workload = get(job.workload)
    model = workload.build_model(train, job.train.seed)
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    result = {"job": job.name, "finished": finished, "test_accuracy": workload.evaluate(model, test),
              "test_samples": len(test), "seconds": round(seconds, 1), "learners": job.train.learners,
              "epochs": job.train.epochs}
    if bridge is not None:
        result["bridge"] = bridge
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def epoch_records(out: Path) -> list[dict]:
    """The evaluating learner's epoch records (learner 0 writes JSON lines to its log)."""
    path = out / "logs" / "learner-0.log"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        if line.startswith('{"event": "epoch"'):
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def last_epoch(out: Path) -> dict:
    records = epoch_records(out)
    return records[-1] if records else {}


def write_metrics(out: Path) -> list[dict]:
    """metrics.jsonl: per epoch of the evaluating learner (a restarted one's epochs replace the
    lost ones)."""
    by_epoch: dict[int, dict] = {}
    for record in epoch_records(out):
        by_epoch[record["epoch"]] = {k: v for k, v in record.items() if k not in ("event", "job", "learner")}
    metrics = [by_epoch[e] for e in sorted(by_epoch)]
    with open(out / "metrics.jsonl", "w") as handle:
        for record in metrics:
            handle.write(json.dumps(record) + "\n")
    return metrics


def plot(metrics: list[dict], path: Path, title: str) -> None:
    """accuracy.png: test accuracy against epochs and against seconds since the start."""
    import matplotlib

    matplotlib.use("Agg")  # no screen
    import matplotlib.pyplot as plt

    epochs = [m["epoch"] for m in metrics if "test_accuracy" in m]
    accuracy = [100 * m["test_accuracy"] for m in metrics if "test_accuracy" in m]
    seconds, total = [], 0.0
    for m in metrics:
        total += m.get("epoch_seconds", 0.0)
        if "test_accuracy" in m:
            seconds.append(total)
    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    by_epoch.plot(epochs, accuracy, marker="o")
    by_epoch.set_xlabel("epoch")
    by_epoch.set_ylabel("test accuracy (%)")
    by_time.plot(seconds, accuracy, marker="o")
    by_time.set_xlabel("seconds of training")
    for axes in (by_epoch, by_time):
        axes.grid(True, alpha=0.3)
    fig.suptitle(f"gadei job {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
