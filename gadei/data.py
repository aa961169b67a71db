"""Where a process's training data comes from: a data spec resolved to (train, test).

A spec is what `--data` takes: a workload's own (`generated`, `generated:SEED`,
`trec:FOLDER`, `trec-fine:FOLDER`, `sst2:FOLDER`; see `gadei_workloads.text.load`), a shared
data set's bare name (`trec`, found under GADEI_DATA_DIR), or `job:JOBFILE`, the [data] of a
job file (how `gadei run` hands its data to the server and learners it starts). Job files
are gadei's, so that last form is resolved here and not by the workloads, which import
nothing of gadei.
"""

import os

from . import jobfile
from .env import settings
from .errors import GadeiError


def resolve(spec: str) -> str:
    """The spec with a shared data set's bare name ('trec') resolved against GADEI_DATA_DIR."""
    name, _, rest = spec.partition(":")
    if rest or name in ("generated", "job"):
        return spec
    base = settings().data_dir
    if base is None:
        raise GadeiError(f"--data {spec!r}: give a folder ({name}:FOLDER) or set GADEI_DATA_DIR")
    return f"{name}:{os.path.join(base, name)}"


def load(workload, spec: str):
    """(train, validation, test) of `spec` for `workload` (a `gadei_workloads.Workload`):
    a job file's validation set (its [data] validation, or the share of train it holds out);
    None for the other specs, which name a training and a test set only."""
    spec = resolve(spec)
    kind, _, path = spec.partition(":")
    if kind == "job":
        if not path:
            raise GadeiError(f"--data {spec!r}: give the job file, job:JOBFILE")
        return jobfile.load_data(jobfile.load(path))
    train, test = workload.load_data(spec)
    return train, None, test
