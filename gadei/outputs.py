"""A run's outputs in its folder: metrics.jsonl from the learners' epoch records, the plot
(accuracy.png) and result.json (the final model's test accuracy)."""

import json
from pathlib import Path

from . import jobfile


def hand_back_best(out: Path) -> bool:
    """model.pt becomes the model chosen on the validation set (checkpoints/best.pt), in place
    of the weights the job ended with; whether there was one."""
    import torch

    from . import selection

    weights = selection.best_weights(out / "checkpoints")
    if weights is None:
        return False
    tmp = out / ".model.pt.tmp"
    torch.save(weights, tmp)
    tmp.replace(out / "model.pt")
    return True


def write_result(job: jobfile.Job, train, test, out: Path, seconds: float, finished: bool,
            bridge: dict | None = None) -> dict:
    """result.json: model.pt's test accuracy (evaluated here, on the whole test set); which
    evaluation chose it (epoch, version, validation accuracy and loss, see gadei.selection);
    why training stopped: "patience" (the validation accuracy stopped improving), "cap" (the
    [train] epochs ran out) or "cancelled"; the run's seconds (this run's, since a resume);
    for a node of a bridged run, what its bridge did."""
    import torch
    from gadei_workloads import get

    from . import selection

    workload = get(job.workload)
    model = workload.build_model(train, job.train.seed)
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    chosen = selection.read_state(out / "checkpoints") or {}
    stopped = "cancelled" if not finished else "patience" if chosen.get("stopped") == "patience" else "cap"
    best = chosen.get("best") or {}
    result = {"job": job.name, "finished": finished, "stopped": stopped,
              **{key: best[key] for key in ("epoch", "version", "validation_accuracy", "validation_loss") if key in best},
              "evaluations": chosen.get("evaluations", 0),
              "test_accuracy": workload.evaluate(model, test),
              "test_samples": len(test), "seconds": round(seconds, 1), "learners": job.train.learners,
              "epochs": job.train.epochs, "patience": job.train.patience}
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
    """accuracy.png: validation and test accuracy against epochs and against seconds since the
    start, the chosen (best validation) epoch marked."""
    import matplotlib

    matplotlib.use("Agg")  # no screen
    import matplotlib.pyplot as plt

    seconds, total = {}, 0.0
    for m in metrics:
        total += m.get("epoch_seconds", 0.0)
        seconds[m["epoch"]] = total
    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for key, label in (("validation_accuracy", "validation"), ("test_accuracy", "test")):
        points = [(m["epoch"], 100 * m[key]) for m in metrics if key in m]
        if not points:
            continue
        by_epoch.plot([e for e, _ in points], [a for _, a in points], marker="o", label=label)
        by_time.plot([seconds[e] for e, _ in points], [a for _, a in points], marker="o", label=label)
    chosen = [m for m in metrics if m.get("best")]
    if chosen:
        best = chosen[-1]["epoch"]
        by_epoch.axvline(best, color="grey", linestyle="--", label=f"chosen: epoch {best}")
        by_time.axvline(seconds[best], color="grey", linestyle="--")
    by_epoch.set_xlabel("epoch")
    by_epoch.set_ylabel("accuracy (%)")
    by_time.set_xlabel("seconds of training")
    for axes in (by_epoch, by_time):
        axes.grid(True, alpha=0.3)
    if any("validation_accuracy" in m or "test_accuracy" in m for m in metrics):
        by_epoch.legend(loc="lower right")
    fig.suptitle(f"gadei job {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
