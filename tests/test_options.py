"""Each option is declared once (`gadei.options.option`), and the job file, the command line and
the Server's keyword arguments are made from that declaration: they agree on names, defaults
and what is allowed, and `gadei run` hands its processes the job file, not re-encoded flags."""

import json
import re
import subprocess
import sys
import textwrap
import uuid
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

from helpers import finish, small_csv, tiered, wait_for

SERVE_FLAGS = {a.dest: a for a in build_parser().verbs["serve"]._actions}


# (the declaring class, its job-file section, the verb whose flags it makes)
DECLARATIONS = [(RuleOptions, "train", "serve"), (TransportOptions, "transport", "serve"),
                (BridgeOptions, "bridge", "bridge")]


def _said_why(cls) -> set[str]:
    """The options `cls`'s docstring names in its "What only one of them has, and why" paragraph."""
    doc = cls.__doc__ or ""
    paragraph = (doc[doc.index("What only one of them has"):].split("\n\n")[0]
                 if "What only one of them has" in doc else "")
    return {f.name for f in options.declared(cls) if re.search(rf"\b{f.name}\b", paragraph)}


@pytest.mark.parametrize("cls, section", [(jobfile.Train, "train"), (CheckpointOptions, "checkpoint")])
def test_every_declared_option_is_a_job_file_key(cls, section):
    assert set(options.job_keys(cls)) <= set(jobfile._SCHEMA[section])
    declared = {f.name for f in options.declared(cls)}
    assert declared == set(options.job_keys(cls)), "an option left out of job files must say why (job=False)"


@pytest.mark.parametrize("cls, section, verb", DECLARATIONS, ids=lambda x: getattr(x, "__name__", x))
def test_every_declared_option_is_a_job_file_key_and_a_flag_with_the_declared_default_and_help(cls, section, verb):
    """An option is both, unless its declaration says it is not (`job=False`, `flag=False`) and
    its class's docstring says why."""
    flags = {a.dest: a for a in build_parser().verbs[verb]._actions}
    for f in options.declared(cls):
        meta = f.metadata["option"]
        if meta["job"]:
            assert f.name in jobfile._SCHEMA[section], f.name
        if meta["flag"]:
            action = flags[f.name]
            assert options.flag(f.name) in action.option_strings, f.name
            assert action.default == f.default, f.name
            assert meta["help"] in action.help, f.name
        if not (meta["job"] and meta["flag"]):
            assert f.name in _said_why(cls), f"{cls.__name__}.{f.name}: only one of job file and flags has it; " \
                "its class's docstring must say why"
    if section == "bridge":  # the whole section is the one class's
        assert set(jobfile._SCHEMA[section]) == set(options.job_keys(cls))


def test_the_lr_default_is_declared_once():
    """The job file, the CLI and the Server all take 0.01 from RuleOptions."""
    assert SERVE_FLAGS["lr"].default == RuleOptions.lr == jobfile.Train().lr
    assert build_parser().verbs["demo"].get_default("lr") == RuleOptions.lr
    sources = [p for p in Path(gadei.__file__).parent.rglob("*.py")
               if "default=0.01" in p.read_text() or "lr: float = 0.01" in p.read_text()]
    assert sources == [], sources


# (the job-file section and the verb of an option, a value both refuse)
REFUSED = [("train", "serve", "lr", 11.0), ("train", "serve", "lr", 0), ("train", "serve", "momentum", 1.0),
           ("train", "serve", "optimizer", "rmsprop"), ("train", "serve", "stale_bound", -1),
           ("train", "serve", "tau", 0), ("transport", "serve", "slots", 0),
           ("transport", "serve", "grad_dtype", "int8"),
           ("bridge", "bridge", "strategy", "averge"), ("bridge", "bridge", "interval", 0),
           ("bridge", "bridge", "every", -1), ("bridge", "bridge", "alpha", 1.5), ("bridge", "bridge", "bucket_mb", -1),
           ("bridge", "bridge", "bucket_mb", "big"), ("bridge", "bridge", "timeout", 0)]
VERB_ARGS = {"serve": ["x", "--params", "10"], "bridge": ["x"]}


@pytest.mark.parametrize("section, verb, key, value",  # a CLI process each: one per section, all with --long
                         tiered(REFUSED, default=[REFUSED[0], REFUSED[6], REFUSED[8]]), ids=lambda x: str(x))
def test_the_job_file_and_the_flag_refuse_a_value_alike(tmp_path, section, verb, key, value):
    extra = 'strategy = "elastic"\n' if key == "alpha" else ""  # alpha alone is elastic's
    path = _job_file(tmp_path, f"[{section}]\n{extra}{key} = {json.dumps(value)}\n")
    with pytest.raises(jobfile.JobFileError) as err:
        jobfile.load(path)
    allowed = str(err.value).split("allowed: ", 1)[1]
    flag = subprocess.run([sys.executable, "-m", "gadei", verb, *VERB_ARGS[verb], options.flag(key), str(value)],
                          capture_output=True, text=True, timeout=60)
    assert flag.returncode == 2 and f"allowed: {allowed}" in flag.stderr, (allowed, flag.stderr)
    if section == "bridge":
        with pytest.raises(BridgeError) as err:
            BridgeOptions(**{key: value}).check(2)  # built in code (gadei.run's node): checked as the bridge starts
        assert str(err.value).startswith(f"bridge options: {key} = ") and str(err.value).endswith(f"allowed: {allowed}")


@pytest.mark.parametrize("given, why", [
    ({"interval": 10, "every": 2}, "exchange after versions or every seconds; allowed: one of them"),
    ({"alpha": 0.5}, "alpha is the elastic strategy's moving rate; allowed: with "),
    ({"alpha": 0.5, "strategy": "gossip"}, "alpha is the elastic strategy's moving rate; allowed: with "),
])
def test_the_job_file_and_the_bridge_flags_refuse_options_that_conflict_alike(tmp_path, given, why):
    """Two bridge options each allowed alone but not together: the job file, the flags and the
    options built in code (gadei run's node) refuse them for the same reason, naming the values
    as each writes them; nothing starts (no MPI is needed to be told)."""
    path = _job_file(tmp_path, "[bridge]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in given.items()))
    with pytest.raises(jobfile.JobFileError) as err:
        jobfile.load(path)
    assert why in str(err.value) and all(f"{k} = {v!r}" in str(err.value) for k, v in given.items()), err.value
    argv = [a for k, v in given.items() for a in (options.flag(k), str(v))]
    flag = subprocess.run([sys.executable, "-m", "gadei", "bridge", "x", *argv], capture_output=True, text=True,
                          timeout=60)
    if set(given) == {"interval", "every"}:  # alternatives in the usage: the parser refuses them together
        assert flag.returncode == 2 and "error: argument --every: not allowed with argument --interval" in \
            flag.stderr and "[--interval N | --every S]" in flag.stderr, flag.stderr
    else:
        assert flag.returncode == 2 and why in flag.stderr, flag.stderr
        assert all(f"{options.flag(k)} {v}" in flag.stderr for k, v in given.items()), flag.stderr
    with pytest.raises(BridgeError, match=f"^bridge options: .*{re.escape(why)}"):
        BridgeOptions(**given).check(2)
    alone = dict(list(given.items())[1:])  # without the first, the rest is fine
    assert BridgeOptions(**alone).conflict(options.as_flag) is None


def test_the_bridge_flags_make_the_bridge_options():
    parse = build_parser().verbs["bridge"].parse_args
    assert options.from_args(BridgeOptions, parse(["job"])) == BridgeOptions()
    assert options.from_args(BridgeOptions, parse(["job", "--bucket-mb", "auto", "--every", "0.5"])) == \
        BridgeOptions(bucket_mb=None, every=0.5)
    assert options.from_args(BridgeOptions, parse(["job", "--bucket-mb", "0", "--float16"])) == \
        BridgeOptions(bucket_mb=0.0, float16=True)


def test_the_bridge_usage_shows_interval_and_every_as_alternatives():
    """Exchanges are scheduled by versions or by seconds, never both: `gadei bridge --help`
    shows the two flags as alternatives, where the schedule is declared among the options."""
    usage = " ".join(build_parser().verbs["bridge"].format_usage().split())
    assert "[--strategy {average,elastic,gossip}] [--interval N | --every S] [--alpha ALPHA]" in usage, usage


@pytest.mark.parametrize("document, where", [("jobs.md", "[bridge]"), ("bridge.md", "Options:"),
                                             ("cli.md", "gadei bridge JOB")])
def test_the_docs_name_every_bridge_option(document, where):
    """docs/jobs.md's example job file has every [bridge] key; docs/bridge.md's options and
    docs/cli.md's `gadei bridge` line have every flag."""
    text = (Path(__file__).resolve().parent.parent / "docs" / document).read_text()
    part = text[text.index(where):].split("\n\n")[0]
    if document == "jobs.md":
        missing = [k for k in options.job_keys(BridgeOptions) if not re.search(rf"^#? ?{k} = ", part, re.M)]
    else:
        missing = [options.flag(f.name) for f in options.declared(BridgeOptions)
                   if f.metadata["option"]["flag"] and not re.search(rf"{options.flag(f.name)}\b", part)]
    assert not missing, f"docs/{document} does not name {missing}"


def test_every_supervisor_setting_survives_the_command_line_that_hands_it_to_the_supervisor():
    """`gadei serve --checkpoint-dir` writes its supervisor's settings as flags
    (`supervisor.command`) and the supervisor reads them back (`add_arguments`, `from_args`),
    both from the one list of declarations: every setting, each set to a value other than its
    default (a float `:g` would round, a folder that starts with a dash, quotes in a learner's
    arguments), comes back equal, and so do the defaults."""
    import argparse
    import dataclasses

    from gadei import _proc, supervisor
    from gadei.supervisor import SupervisorSettings

    changed = SupervisorSettings(checkpoint_dir="/tmp/check points", every=0.1 + 0.2, keep=7, interval=1 / 3,
                                 max_missed=5, server=["serve", "job", "--lr", "0.05", "--learner=--epochs 2"],
                                 max_restarts=9, window=12.5,
                                 learners=[["--shard", "0/2", "--x", 'it\'s "quoted"'], []], backoff=0.0,
                                 log_dir="-logs")
    unchanged = [f.name for f in dataclasses.fields(SupervisorSettings)
                 if getattr(changed, f.name) == options.default_of(f)]
    assert unchanged == [], f"give these settings a value other than their default here: {unchanged}"
    assert {f.name for f in dataclasses.fields(SupervisorSettings)} == \
        {f.name for f in options.declared(SupervisorSettings)}
    parser = argparse.ArgumentParser()
    supervisor.add_arguments(parser)
    for settings in (changed, SupervisorSettings(server=["serve", "job"])):
        argv = supervisor.command("job", settings, {"0": 5, "1": "done"})
        program = _proc.python_command("gadei_watchdog", "job")
        assert argv[:len(program)] == program
        args = parser.parse_args(argv[len(program) - 1:])
        assert (args.job, args.progress) == ("job", {"0": 5, "1": "done"})
        assert options.from_args(SupervisorSettings, args) == settings


def test_server_keywords_are_the_declared_options():
    job = f"test-opt-{uuid.uuid4().hex[:8]}"
    with gadei.Server(job, n_params=10, lr=0.5, stale_bound=3, slots=3, learners=2) as server:
        assert server.rule_options == RuleOptions(lr=0.5, stale_bound=3)
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
