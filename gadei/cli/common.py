"""What the verbs share: JSON lines for programs, a model and data from --workload/--data/--seed
or --model."""

import importlib
import json
import logging

from .. import data
from ..errors import GadeiError

log = logging.getLogger("gadei.cli")


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def workload_model(args):
    """(workload, train, validation, test, model) for --workload/--data/--seed (validation:
    None unless the data is a job file's, see `gadei.data.load`)."""
    from gadei_workloads import get

    workload = get(args.workload)
    train, validation, test = data.load(workload, args.data or workload.default_data)
    return workload, train, validation, test, workload.build_model(train, args.seed)


def factory_model(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise GadeiError(f"--model {spec!r}: expected MODULE:CALLABLE, e.g. mypkg.models:build")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise GadeiError(f"--model {spec!r}: {err}") from err
    return factory()


def add_workload(p, required: bool) -> None:
    p.add_argument("--workload", required=required, help="built-in workload (textcnn, lstm, mlp)")
    p.add_argument("--data", help="data set: 'generated', 'generated:SEED', 'trec:FOLDER', 'sst2:FOLDER', or "
                   "'trec' / 'sst2' (under GADEI_DATA_DIR); default: the workload's generated set")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initial weights and the data order")
