"""Each option is declared once (`gadei.options.option`), and the job file, the command line and
the Server's keyword arguments are made from that declaration: they agree on names, defaults
and what is allowed, and `gadei run` hands its processes the job file, not re-encoded flags."""

import json
import subprocess
import sys
import textwrap
import uuid
from dataclasses import fields
from pathlib import Path

import pytest

import gadei
from gadei import jobfile, options
from gadei.bridge import BridgeError, BridgeOptions
from gadei.checkpoint import CheckpointOptions
from gadei.cli import build_parser
from gadei.modes import RuleOptions, read_options
from gadei.region import Region
from gadei.transport.options import TransportOptions

from helpers import finish, small_csv, wait_for

SERVE_FLAGS = {a.dest: a for a in build_parser().verbs["serve"]._actions}
BRIDGE_FLAGS = {a.dest: a for a in build_parser().verbs["bridge"]._actions}


@pytest.mark.parametrize("cls, section", [(RuleOptions, "train"), (TransportOptions, "transport"),
                                          (jobfile.Train, "train"), (CheckpointOptions, "checkpoint")])
def test_every_declared_option_is_a_job_file_key(cls, section):
    assert set(options.job_keys(cls)) <= set(jobfile._SCHEMA[section])
    declared = {f.name for f in options.declared(cls)}
    assert declared == set(options.job_keys(cls)), "an option left out of job files must say why (job=False)"


@pytest.mark.parametrize("cls", [RuleOptions, TransportOptions])
def test_every_update_rule_and_transport_option_is_a_serve_flag_with_the_declared_default(cls):
    for f in options.declared(cls):
        action = SERVE_FLAGS[f.name]
        assert action.default == f.default, f.name
        assert f.metadata["option"]["help"] in action.help, f.name


def test_the_lr_default_is_declared_once():
    """The job file, the CLI and the Server all take 0.01 from RuleOptions."""
    assert SERVE_FLAGS["lr"].default == RuleOptions.lr == jobfile.Train().lr
    assert build_parser().verbs["demo"].get_default("lr") == RuleOptions.lr
    sources = [p for p in Path(gadei.__file__).parent.rglob("*.py")
               if "default=0.01" in p.read_text() or "lr: float = 0.01" in p.read_text()]
    assert sources == [], sources


@pytest.mark.parametrize("key, value", [("lr", 11.0), ("lr", 0), ("momentum", 1.0), ("optimizer", "rmsprop"),
                                        ("stale_bound", -1), ("tau", 0), ("slots", 0), ("grad_dtype", "int8")])
def test_the_job_file_and_the_flag_refuse_a_value_alike(tmp_path, key, value):
    cls = TransportOptions if key in {f.name for f in fields(TransportOptions)} else RuleOptions
    section = "transport" if cls is TransportOptions else "train"
    path = _job_file(tmp_path, f"[{section}]\n{key} = {json.dumps(value)}\n")
    with pytest.raises(jobfile.JobFileError) as err:
        jobfile.load(path)
    allowed = str(err.value).split("allowed: ", 1)[1]
    flag = subprocess.run([sys.executable, "-m", "gadei", "serve", "x", "--params", "10", options.flag(key), str(value)],
                          capture_output=True, text=True, timeout=60)
    assert flag.returncode == 2 and f"allowed: {allowed}" in flag.stderr, (allowed, flag.stderr)


def test_the_bridge_flags_and_the_job_files_bridge_section_are_the_declared_bridge_options():
    """`gadei bridge`'s flags and a job file's [bridge] keys both come from BridgeOptions; what
    only one of them has is the set its docstring says why of."""
    declared = {f.name: f for f in options.declared(BridgeOptions)}
    flags = {name for name, f in declared.items() if f.metadata["option"]["flag"]}
    assert set(options.job_keys(BridgeOptions)) == set(jobfile._SCHEMA["bridge"])
    assert set(declared) - set(options.job_keys(BridgeOptions)) == {"checkpoint_dir", "save", "json", "trace"}
    assert set(declared) - flags == {"node_lr"}
    for name in flags:
        action = BRIDGE_FLAGS[name]
        assert action.default == declared[name].default, name
        assert declared[name].metadata["option"]["help"] in action.help, name
    parse = build_parser().verbs["bridge"].parse_args
    assert options.from_args(BridgeOptions, parse(["job"])) == BridgeOptions()
    assert options.from_args(BridgeOptions, parse(["job", "--bucket-mb", "auto", "--every", "0.5"])) == \
        BridgeOptions(bucket_mb=None, every=0.5)
    assert options.from_args(BridgeOptions, parse(["job", "--bucket-mb", "0", "--float16"])) == \
        BridgeOptions(bucket_mb=0.0, float16=True)


@pytest.mark.parametrize("key, value", [("strategy", "averge"), ("interval", 0), ("every", -1), ("alpha", 1.5),
                                        ("bucket_mb", -1), ("bucket_mb", "big"), ("timeout", 0)])
def test_the_bridge_job_file_and_the_bridge_flag_refuse_a_value_alike(tmp_path, key, value):
    path = _job_file(tmp_path, "[bridge]\nstrategy = \"elastic\"\n" if key == "alpha" else "[bridge]\n")
    path.write_text(path.read_text() + f"{key} = {json.dumps(value)}\n")
    with pytest.raises(jobfile.JobFileError) as err:
        jobfile.load(path)
    allowed = str(err.value).split("allowed: ", 1)[1]
    flag = subprocess.run([sys.executable, "-m", "gadei", "bridge", "x", options.flag(key), str(value)],
                          capture_output=True, text=True, timeout=60)
    assert flag.returncode == 2 and f"allowed: {allowed}" in flag.stderr, (allowed, flag.stderr)
    with pytest.raises(BridgeError) as err:
        BridgeOptions(**{key: value}).check(2)  # built in code (gadei.run's node): checked as the bridge starts
    assert str(err.value).startswith(f"bridge options: {key} = ") and str(err.value).endswith(f"allowed: {allowed}")


def test_server_keywords_are_the_declared_options():
    job = f"test-opt-{uuid.uuid4().hex[:8]}"
    with gadei.Server(job, n_params=10, lr=0.5, stale_bound=3, slots=3, learners=2) as server:
        assert server.options == RuleOptions(lr=0.5, stale_bound=3)
        assert server.region.shape.slots == 3
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['learning_rate'\]"):
        gadei.Server(job, n_params=10, learning_rate=0.5)


def test_serve_takes_the_job_file_and_a_flag_given_too_wins(tmp_path, procs):
    """What `gadei run` starts: `gadei serve JOB --job-file job.toml`; the update rule and the
    rings come from the file, and `--lr` (a bridged node's rate) overrides it."""
    path = _job_file(tmp_path, """\
        [train]
        mode = "consistent"
        optimizer = "adagrad"
        lr = 0.2
        nonfinite = "stop"
        [transport]
        grad_dtype = "bfloat16"
        slots = 3
        """)
    job = f"test-opt-{uuid.uuid4().hex[:8]}"
    serve = procs.gadei("serve", job, "--job-file", str(path), "--lr", "0.3", "--learners", "2")
    try:
        wait_for(lambda: _header(job), 60, "the server to serve")
        rule, shape, mode = _header(job)
        assert rule == RuleOptions(lr=0.3, optimizer="adagrad", nonfinite="stop")
        assert (shape.grad_dtype, shape.slots, shape.capacity, mode) == ("bfloat16", 3, 2, "consistent")
    finally:
        finish(procs.gadei("stop", job))
        finish(serve)


def _job_file(folder: Path, sections: str) -> Path:
    """A job file of the text CNN on a small CSV in `folder`, with `sections` added."""
    small_csv(folder)
    path = folder / "job.toml"
    path.write_text('[job]\nname = "opt"\nworkload = "textcnn"\n[data]\ntrain = "train.csv"\nformat = "csv"\n'
                    'label_column = "category"\n' + textwrap.dedent(sections))
    return path


def _header(job):
    try:
        with Region.attach(job, readonly=True) as region:
            if region.header.get("run_state") == 0:
                return None
            return read_options(region), region.shape, region.shape.mode
    except (gadei.RegionNotFound, gadei.GadeiTimeout):  # not yet, or still being made
        return None
