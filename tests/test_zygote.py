"""Warm starts (`gadei.zygote`): a job's server and learners forked from its supervisor, which
imported what they need and read the job's data once; the daemon's supervisors forked from its
zygote. Each forked process is its parent's child, shows its own command line, ends with the
exit code its command gives; a zygote killed is replaced, and the jobs it started go on."""

import json
import os
import signal
import textwrap

import psutil
import pytest

from helpers import communicate, daemon_jobs, finish, small_job, start_daemon, unique_name, wait_for
from gadei import _proc

pytestmark = pytest.mark.faults  # also run on a loaded machine: `--busy 2 -m faults` (docs/testing.md)


def _small_job(small, name: str, epochs: int = 2, **train) -> str:
    options = "".join(f"{key} = {value}\n" for key, value in {"epochs": epochs, "learners": 2, **train}.items())
    path = small / f"{name}.toml"
    path.write_text(textwrap.dedent(small_job(name)) + f"\n[train]\n{options}\n[output]\nfolder = \"out-{name}\"\n")
    return path


def _started(log: str) -> dict[str, str]:
    """How the supervisor's log says it started the server and each launched learner."""
    how = {}
    for line in log.splitlines():
        if "starting the server (pid" in line:
            how["server"] = line.split("(pid ")[1].split(")")[0]
        elif "started launched learner" in line:
            number = line.split("started launched learner ")[1].split()[0]
            how[f"learner {number}"] = line.split("(pid ")[1].split(")")[0]
    return how


def test_a_run_forks_its_supervisor_server_and_learners_warm_and_says_when_its_first_gradient_came(small, procs):
    """`gadei run` forks the job's supervisor from itself once it read the job's data, and the
    supervisor the server and the learners, side by side (no interpreter started, nothing
    imported or read again); result.json says how long the job took to its first applied
    gradient."""
    name = unique_name("warm")
    path = _small_job(small, name)
    out, err = finish(procs.gadei("run", path, env={**os.environ, "GADEI_LOG": "INFO"}), 300)
    assert f"job {name} done" in out, err[-3000:]
    assert "started (forked warm)" in next(line for line in err.splitlines() if "supervisor pid" in line), err
    how = _started((small / f"out-{name}" / "logs" / "supervisor.log").read_text())
    assert set(how) == {"server", "learner 0", "learner 1"} and all("forked warm" in h for h in how.values()), how
    result = json.loads((small / f"out-{name}" / "result.json").read_text())
    assert 0 < result["seconds_to_first_update"] < result["seconds"], result


# The forks below are made in a fresh interpreter: pytest's process loaded OpenMP (spinning)
# before anything could make it passive, and runs threads of its own.
_FORKS = """
import json, os, signal, sys, threading, time
import psutil
from gadei import _proc, zygote

name, folder = sys.argv[1], sys.argv[2]
zygote.warm(late=False)
seen = {"passive": zygote.can_fork(passive=True), "spinning": zygote.can_fork(passive=False)}
hold = threading.Event()
second = threading.Thread(target=hold.wait)
second.start()
seen["two threads"] = zygote.can_fork(passive=True)
hold.set()
second.join()

refused = zygote.fork(_proc.python_command("gadei", "stop", name), log=f"{folder}/stop.log")
seen["stop"] = refused.wait(60)
waiting = zygote.fork(_proc.python_command("gadei", "learn", name), log=f"{folder}/learn.log",
                      env={**os.environ, "GADEI_ATTACH_TIMEOUT": "120"})
deadline = time.monotonic() + 60
while f"-m gadei learn {name}" not in " ".join(psutil.Process(waiting.pid).cmdline()):
    assert time.monotonic() < deadline, psutil.Process(waiting.pid).cmdline()
    time.sleep(0.01)
seen["title"] = " ".join(psutil.Process(waiting.pid).cmdline())
seen["parent"] = psutil.Process(waiting.pid).ppid() == os.getpid()
waiting.kill()
seen["killed"] = waiting.wait(60)
held = zygote.fork(_proc.python_command("gadei", "--help"), log=f"{folder}/help.log", held=True)
os.kill(held.pid, signal.SIGTERM)
seen["held"] = held.wait(60)
print(json.dumps(seen))
"""


def test_a_forked_child_is_its_command_with_its_own_log_title_and_exit_code(tmp_path, procs):
    """`zygote.fork` runs `python -P -m MODULE ARGS` as `spawn` would: its log and title (`ps`)
    its own, waited for as a child, its exit code the command's; one forked `held` starts with
    SIGTERM blocked (a stop sent at once waits for the handler its command sets: `gadei --help`
    sets none and ends 0, not killed). Only a warm process of one thread forks, and only a child
    that may run with passive OpenMP threads (they loaded passive; a learner of several threads
    that fit the cores must spin, and starts in a new interpreter)."""
    name = unique_name("nosuch")
    out, err = finish(procs.spawn([*_proc.python_command("gadei", "--version")[:2], "-c", _FORKS, name,
                                   str(tmp_path)]), 120)
    seen = json.loads(out.splitlines()[-1])
    assert (seen["passive"], seen["spinning"], seen["two threads"]) == (True, False, False), seen
    assert seen["stop"] == 2 and f"gadei: error: job '{name}' has no region" in (tmp_path / "stop.log").read_text()
    assert f"-m gadei learn {name}" in seen["title"] and seen["parent"] and seen["killed"] == -signal.SIGKILL, seen
    assert seen["held"] == 0 and "usage: gadei" in (tmp_path / "help.log").read_text(), seen


def test_the_daemon_forks_supervisors_from_its_zygote_and_replaces_a_killed_one(small, procs, daemon_env):
    """Each daemon job's supervisor is forked by the daemon's zygote; a zygote killed (SIGKILL)
    does not take the running job with it (its supervisor is in a session of its own), and the
    next job is forked from a new zygote. A daemon that listens is warm, and its zygote too
    (each imported what it needs: torch, the workloads, the job layer): the first job submitted
    waits for neither."""
    daemon = start_daemon(procs, daemon_env)
    (zygote,) = [p for p in psutil.Process(daemon.pid).children() if "gadei.zygote" in " ".join(p.cmdline())]
    for warm in (daemon.pid, zygote.pid):
        maps = {os.path.basename(m.path) for m in psutil.Process(warm).memory_maps()}
        assert any("libtorch" in m for m in maps), (warm, sorted(maps))
    assert any("/matplotlib/" in m.path for m in zygote.memory_maps()), "the daemon listens before its zygote is warm"
    first, second = unique_name("zfirst"), unique_name("zsecond")
    # long enough that it still runs when a `gadei jobs` started under load answers (a few seconds)
    finish(procs.gadei("submit", _small_job(small, first, epochs=300, patience=300), env=daemon_env))
    state = wait_for(lambda: (s := daemon_jobs(procs, daemon_env)[first]["state"]) != "queued" and s, 120,
                     "the first job to start")
    assert state == "running", state
    zygotes = [p for p in psutil.Process(daemon.pid).children() if "gadei.zygote" in " ".join(p.cmdline())]
    assert len(zygotes) == 1
    zygotes[0].send_signal(signal.SIGKILL)
    finish(procs.gadei("submit", _small_job(small, second), env=daemon_env))
    wait_for(lambda: all(daemon_jobs(procs, daemon_env)[n]["state"] == "done" for n in (first, second)), 300,
             "both jobs to finish")
    for name in (first, second):
        out = small / f"out-{name}"
        assert (out / "model.pt").exists() and json.loads((out / "result.json").read_text())["outcome"] == "done"
        assert all("forked warm" in h for h in _started((out / "logs" / "supervisor.log").read_text()).values())
    daemon.terminate()
    _, err = communicate(daemon, 60)
    assert "the zygote (pid" in err and "starting another" in err, err[-3000:]
    assert "forked warm by the zygote" in err, err[-3000:]
