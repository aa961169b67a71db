"""Baseline for the textcnn workload: one process, accuracy and step time.

The figures the parameter server is compared against: test accuracy after each epoch,
seconds per epoch and milliseconds per step, for given data, batch size, learning rate,
optimizer and seeds. Run it as ``python -m gadei_workloads.measure_textcnn --data trec:FOLDER``
(the package must be installed); ``--steps N`` times N steps without evaluating.
``--optimizer adagrad`` trains with the update a job file's server applies by default
(``s += g²; w -= lr g / (√s + 1e-10)``, torch's Adagrad with the same epsilon); ``sgd``
(the default) is plain SGD with the text CNN's max-norm constraint. ``--data`` takes the
workload's data specs (``gadei_workloads.specs.load``), ``banking77:FOLDER`` among them; a job
file's ``[data]`` is gadei's (this package imports nothing of gadei): ``gadei bench quality``
runs a PyTorch baseline on job files.

Examples::

    python -m gadei_workloads.measure_textcnn --data trec:../shared/data/trec \
        --lr 0.05 --epochs 5 --seeds 0 1 2 3 4
    python -m gadei_workloads.measure_textcnn --data generated --lr 0.05 --epochs 3
    python -m gadei_workloads.measure_textcnn --data trec:../shared/data/trec \
        --batch-size 4 --steps 500
    python -m gadei_workloads.measure_textcnn --data sst2:../shared/data/sst2 \
        --optimizer adagrad --batch-size 2 --epochs 5
    python -m gadei_workloads.measure_textcnn --data banking77:../shared/data/banking77 \
        --optimizer adagrad --batch-size 4 --epochs 8
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from . import get
from .text import TextDataset, batches
from .textcnn import EMBED_DIM, build_textcnn

logger = logging.getLogger(__name__)


def train_run(
    train: TextDataset,
    test: TextDataset,
    *,
    seed: int,
    batch_size: int,
    lr: float,
    epochs: int,
    embed_dim: int = EMBED_DIM,
    max_steps: int | None = None,
    optimizer: str = "sgd",
) -> list[dict]:
    """Trains one model in one process and returns one record per epoch.

    Args:
        train: Training set.
        test: Test set (evaluated after every epoch unless ``max_steps`` is set).
        seed: Model initialisation, dropout and data-order seed.
        batch_size: Samples per step.
        lr: Learning rate (no momentum, no weight decay).
        epochs: Epochs to run.
        embed_dim: Embedding width.
        max_steps: Stop after this many steps in all and skip evaluation (timing only).
        optimizer: ``"sgd"`` (with the text CNN's max-norm constraint) or ``"adagrad"``
            (the job files' default server update; no max-norm, as in a job).

    Returns:
        Records with ``seed, epoch, steps, seconds, ms_per_step, test_acc, loss``.
    """
    workload = get("textcnn")
    model = build_textcnn(len(train.vocab), train.n_labels, seed=seed, embed_dim=embed_dim)
    if optimizer == "adagrad":  # the server's rule: s += g²; w -= lr g / (√s + 1e-10)
        step_rule = torch.optim.Adagrad(model.parameters(), lr=lr, eps=1e-10)
        constrain_lr = None  # max-norm as a gradient correction holds for plain SGD only
    elif optimizer == "sgd":
        step_rule = torch.optim.SGD(model.parameters(), lr=lr)
        constrain_lr = lr
    else:
        raise ValueError(f"optimizer {optimizer!r}: allowed: sgd, adagrad")
    torch.manual_seed(seed)  # dropout masks
    records, done = [], 0
    for epoch in range(epochs):
        steps, loss_sum = 0, 0.0
        start = time.perf_counter()
        for x, y in batches(train, batch_size, epoch=epoch, seed=seed):
            step_rule.zero_grad(set_to_none=True)
            loss = workload.loss(model, x, y)
            workload.backward(model, loss, constrain_lr)
            step_rule.step()
            loss_sum += loss.item()
            steps += 1
            done += 1
            if max_steps is not None and done >= max_steps:
                break
        seconds = time.perf_counter() - start
        timing_only = max_steps is not None
        record = {
            "seed": seed, "batch_size": batch_size, "lr": lr, "optimizer": optimizer, "embed_dim": embed_dim,
            "epoch": epoch + 1, "steps": steps, "seconds": round(seconds, 3),
            "ms_per_step": round(1000 * seconds / max(steps, 1), 3),
            "loss": round(loss_sum / max(steps, 1), 4),
            "test_acc": None if timing_only else round(workload.evaluate(model, test), 4),
        }
        records.append(record)
        logger.info(
            "seed %d  epoch %2d  acc %s  loss %.4f  %6.1f s  %.2f ms/step",
            seed, epoch + 1, "  -   " if timing_only else f"{record['test_acc']:.4f}",
            record["loss"], seconds, record["ms_per_step"],
        )
        if timing_only and done >= max_steps:
            break
    return records


def _summary(records: list[dict]) -> None:
    """Logs mean / min / max test accuracy per epoch over the seeds."""
    by_epoch: dict[int, list[dict]] = {}
    for r in records:
        by_epoch.setdefault(r["epoch"], []).append(r)
    logger.info("epoch  acc mean   min     max     s/epoch  ms/step  (over %d seeds)",
                len({r["seed"] for r in records}))
    for epoch, rs in sorted(by_epoch.items()):
        accs = [r["test_acc"] for r in rs if r["test_acc"] is not None]
        acc = f"{statistics.mean(accs):.4f}  {min(accs):.4f}  {max(accs):.4f}" if accs else "-"
        logger.info("%5d  %s  %7.2f  %7.2f", epoch, acc,
                    statistics.mean(r["seconds"] for r in rs),
                    statistics.mean(r["ms_per_step"] for r in rs))


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; see ``--help``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="generated", help="data spec, e.g. trec:FOLDER")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--optimizer", choices=("sgd", "adagrad"), default="sgd",
                        help="sgd (max-norm constraint kept) or adagrad (the job files' default)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--embed-dim", type=int, default=EMBED_DIM)
    parser.add_argument("--steps", type=int, default=None, help="time this many steps only")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", type=Path, default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)

    train, test = get("textcnn").load_data(args.data)
    n_params = sum(
        p.numel() for p in build_textcnn(len(train.vocab), train.n_labels,
                                         embed_dim=args.embed_dim).parameters()
    )
    logger.info("%s: %d train, %d test, %d labels, vocab %d; model %d parameters",
                args.data, len(train), len(test), train.n_labels, len(train.vocab), n_params)
    logger.info("batch %d, lr %g, optimizer %s, embed %d, threads %d",
                args.batch_size, args.lr, args.optimizer, args.embed_dim, args.threads)
    records = []
    for seed in args.seeds:
        records += train_run(
            train, test, seed=seed, batch_size=args.batch_size, lr=args.lr,
            epochs=args.epochs, embed_dim=args.embed_dim, max_steps=args.steps,
            optimizer=args.optimizer,
        )
    _summary(records)
    if args.json is not None:
        with args.json.open("a") as f:
            for r in records:
                f.write(json.dumps({"data": args.data, "params": n_params, **r}) + "\n")


if __name__ == "__main__":
    main()
