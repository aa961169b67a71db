"""A job file's training as a plain PyTorch script: the peers' job in `gadei bench service` (a
loop of it, one and two at a time, and Ray Jobs running it) and `gadei bench quality`'s
baseline. One process, one PyTorch thread: the job file's data, split as gadei splits it
(training, validation, test), its workload's model from the same seed, the optimizer, lr,
mini-batch and epochs the job file's defaults choose (or the caller's), the validation
accuracy after every epoch, the best model kept, stopped after the job's patience; the test
accuracy of that model.

Run by its path, so that nothing of the bench's package is imported (its `__init__` imports
every bench):

    python -P gadei/bench/plain_job.py JOB.toml

Its last line on stdout is one JSON object: the test accuracy and the rest of `train`'s
figures, with `started` (this process's start, from the kernel), `first_gradient_at` (the
first backward's end) and `ended_at`, all wall clock (seconds since 1970), as the bench times
the other systems.
"""

import json
import sys
import time
from pathlib import Path

OPTIMIZERS = ("sgd", "adagrad", "adam")
ADAGRAD_EPS = 1e-10  # gadei's server's (gadei.modes.ADAGRAD_EPS); torch's default is the same


def command(job_file: Path) -> list[str]:
    """The command line that runs this script on `job_file` with this Python (`-P`: the
    working directory stays off sys.path, as for every process gadei starts)."""
    return [sys.executable, "-P", str(Path(__file__).resolve()), str(job_file)]


def train(path: Path, *, optimizer: str | None = None, lr: float | None = None, batch: int | None = None,
          epochs: int | None = None, patience: int | None = None) -> dict:
    """Train the job file `path`'s model as one process; what the job's defaults choose for
    whatever is None here.

    Returns:
        test_accuracy (the model chosen on validation), epoch (the chosen one),
        validation_accuracy, epochs_run, stopped ("patience" or "cap"), seconds_to_best and
        wall_seconds (from the call), first_gradient_at (wall clock), the settings it ran
        with (optimizer, lr, batch) and the samples of each split.
    """
    started = time.monotonic()
    import torch
    from gadei_workloads import get

    from gadei import data, jobfile

    job = jobfile.load(path)
    train_set, validation, test = data.load_job(job)
    job, _ = job.with_defaults(len(train_set))
    optimizer = optimizer or job.train.optimizer
    lr = job.train.lr if lr is None else lr
    batch = batch or job.train.batch
    cap = epochs or job.train.epochs
    patience = job.train.patience if patience is None else patience
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"{path}: optimizer {optimizer!r}: the plain script runs {', '.join(OPTIMIZERS)}")
    workload, seed = get(job.workload), job.train.seed
    torch.set_num_threads(1)  # as one learner, and as one core of the machine (Ray's entrypoint_num_cpus=1)
    torch.manual_seed(seed)
    model = workload.build_model(train_set, seed)
    if optimizer == "adam":  # torch's Adam takes dense gradients only
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                module.sparse = False
    step = {"sgd": lambda p: torch.optim.SGD(p, lr=lr),
            "adagrad": lambda p: torch.optim.Adagrad(p, lr=lr, eps=ADAGRAD_EPS),
            "adam": lambda p: torch.optim.Adam(p, lr=lr)}[optimizer](model.parameters())
    constraint_lr = lr if optimizer == "sgd" else None  # the text CNN's max-norm, as a gadei learner adds it
    best, best_state, since, epoch, first_gradient_at = None, None, 0, 0, None
    # torch's sparse Adagrad builds each update unchecked, and warns of it unless told: its default, said once
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        for epoch in range(1, cap + 1):
            model.train()
            for x, y in workload.batches(train_set, batch, epoch=epoch - 1, seed=seed):
                step.zero_grad()
                workload.gradient(model, x, y, constraint_lr)
                if first_gradient_at is None:
                    first_gradient_at = time.time()
                step.step()
            accuracy = workload.evaluate(model, validation)
            if best is None or accuracy > best[1]:
                best, since = (epoch, accuracy, time.monotonic() - started), 0
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                since += 1
                if since >= patience:
                    break
    model.load_state_dict(best_state)
    return {"test_accuracy": workload.evaluate(model, test), "epoch": best[0], "validation_accuracy": best[1],
            "epochs_run": epoch, "stopped": "patience" if since >= patience else "cap",
            "seconds_to_best": round(best[2], 1), "wall_seconds": round(time.monotonic() - started, 1),
            "first_gradient_at": first_gradient_at, "optimizer": optimizer, "lr": lr, "batch": batch,
            "samples": {"train": len(train_set), "validation": len(validation), "test": len(test)}}


def process_start() -> float:
    """This process's start, wall clock, to a clock tick (10 ms): its start since boot
    (`gadei._proc.start_time`) set against the boot clock now. psutil's create_time adds those
    ticks to the boot time in whole seconds, which puts it up to a second early."""
    from gadei import _proc

    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - _proc.start_time())


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="plain_job.py", description="a job file's training as a plain PyTorch script; "
                                "its figures as JSON on the last line")
    p.add_argument("job_file", type=Path)
    args = p.parse_args(argv)
    started = process_start()
    result = train(args.job_file)
    print(json.dumps({**result, "started": started, "ended_at": time.time()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
