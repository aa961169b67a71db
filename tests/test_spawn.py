"""Every process gadei starts runs the installed gadei, whatever the working directory.

`python -m gadei` puts the working directory first on sys.path, so from a repository root
after a non-editable `pip install .` every server, learner and supervisor imported the source
tree's `gadei/` (which has no compiled `_native`) and died. One function builds every such
command line (`gadei._proc.python_command`, with `-P`); these tests hold the code to it and
run a whole job from a folder that holds decoy packages of every name gadei imports.
"""

import ast
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from helpers import cgroup, communicate, missing, unique_name, wait_for

from gadei import _proc

ROOT = Path(__file__).resolve().parent.parent
DECOYS = ("gadei", "gadei_watchdog", "gadei_workloads")


def test_only_the_process_module_spells_python_dash_m():
    spelled = []
    for folder in ("gadei", "watchdog", "workloads"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(_proc.__file__).resolve():
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and node.value == "-m":
                    spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert spelled == [], f"build command lines with gadei._proc.python_command, not by hand: {spelled}"


def test_a_command_line_keeps_the_working_directory_off_the_module_path():
    assert _proc.gadei_command("serve", "job", 3) == [_proc.sys.executable, "-P", "-m", "gadei", "serve", "job", "3"]


def test_gadei_run_from_a_folder_of_decoy_packages_runs_the_installed_gadei(tmp_path, procs):
    here = tmp_path / "checkout"
    for name in DECOYS:  # what a source tree without the compiled extension amounts to
        (here / name).mkdir(parents=True)
        (here / name / "__init__.py").write_text(f"raise ImportError('the decoy {name} in the working directory')\n")
    rows = [f"{'dog' if i % 2 else 'cat'}\t\"a sentence {i} about {'dogs' if i % 2 else 'cats'}" for i in range(60)]
    (tmp_path / "train.tsv").write_text("label\ttext\n" + "\n".join(rows) + "\n\ncat\t\n")
    name = unique_name("spawn")
    (tmp_path / "job.toml").write_text(f'[job]\nname = "{name}"\nworkload = "textcnn"\n'
                                       '[data]\ntrain = "train.tsv"\nformat = "tsv"\n'
                                       '[train]\nlearners = 2\nepochs = 1\n[output]\nfolder = "out"\n')
    run = procs.gadei("run", tmp_path / "job.toml", "--quiet", cwd=here)
    out, err = communicate(run, 300)
    assert run.returncode == 0, out + err
    assert "decoy" not in out + err
    assert ("  read train.tsv: 63 lines, 60 samples; left out: 1 blank line (line 62), 1 row with empty text "
            "(line 63)") in out
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert result["finished"] is True
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "out" / "logs").glob("*.log"))
    assert "decoy" not in logs


def test_a_command_line_says_which_gadei_command_it_runs():
    """`gadei serve` decides its OpenMP wait policy from its own command line as the package is
    imported (gadei/__init__.py): every way gadei or a user starts it is recognised, and no other
    program or command is taken for it."""
    assert _proc.gadei_subcommand(_proc.gadei_command("serve", "--job-file", "j.toml")) == "serve"
    assert _proc.gadei_subcommand(_proc.gadei_command("learn", "--job-file", "j.toml")) == "learn"
    assert _proc.gadei_subcommand(["/venv/bin/python3", "/venv/bin/gadei", "serve", "x"]) == "serve"
    assert _proc.gadei_subcommand(["python", "-X", "importtime", "-B", "-m", "gadei", "serve"]) == "serve"
    for other in (["python", "-m", "pytest", "serve"], ["python", "train.py", "serve"], ["python", "-c", "x", "serve"],
                  ["python", "-m", "gadei"], ["python", "/venv/bin/gadei"], ["python"]):
        assert _proc.gadei_subcommand(other) is None, other


# How a process ended, in words (`_proc.how_it_ended`): every message of gadei's that says a
# process it started or watched died says it so.

def test_how_a_process_ended_names_the_exit_code_or_the_signal():
    assert _proc.how_it_ended(0) == "exited with code 0"
    assert _proc.how_it_ended(2) == "exited with code 2"
    assert _proc.how_it_ended(-11) == "was killed by SIGSEGV (signal 11)"
    assert _proc.how_it_ended(-15) == "was killed by SIGTERM (signal 15)"
    assert _proc.how_it_ended(-200) == "was killed by signal 200"  # no such signal: its number
    # SIGKILL with no count from the process's start: the usual cause, hedged
    said = _proc.how_it_ended(-9)
    assert said.startswith("was killed by SIGKILL (signal 9): where no one sent it, the kernel's out-of-memory "
                           "killer did") and "dmesg" in said, said


def test_a_sigkill_says_whether_the_out_of_memory_killer_sent_it(procs):
    """Two real deaths by SIGKILL: one sent by this test, one by the kernel's out-of-memory
    killer to a process that outgrew the 64 MB of a cgroup of its own (`helpers.cgroup`)."""
    if _proc.oom_kills() is None:
        missing("the kernel's count of out-of-memory kills (oom_kill in /proc/vmstat, Linux 4.13 and later)")
    started = _proc.oom_kills()
    sleeper = procs.start("-c", "import time; time.sleep(600)")
    os.kill(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait(30) == -signal.SIGKILL
    assert _proc.how_it_ended(sleeper.returncode, started) == (
        "was killed by SIGKILL (signal 9), sent by a process (not the out-of-memory killer, which killed nothing "
        "since it started)")
    assert _proc.how_it_ended(None, started) == "is gone"  # a process whose code cannot be read: nothing to add

    with cgroup(memory=64 << 20) as inside:
        started = _proc.oom_kills()
        hungry = procs.spawn(inside([sys.executable, "-c", "held = b'x' * (1 << 30)"]))
        _, err = communicate(hungry, 120)
    assert hungry.returncode == -signal.SIGKILL, err
    said = _proc.how_it_ended(hungry.returncode, started)
    assert said.startswith("was killed by SIGKILL (signal 9), most likely by the kernel's out-of-memory killer, which "
                           "killed 1 process on this machine since it started: the machine or its cgroup ran out "
                           "of memory"), said
    assert _proc.how_it_ended(None, started).startswith("is gone, most likely killed by the kernel's out-of-memory "
                                                        "killer, which killed 1 process on this machine since it "
                                                        "started")


def test_a_process_whose_main_thread_ended_runs_until_its_other_threads_have(procs):
    """A process that exits ends its main thread first, and /proc shows that thread's state (a
    zombie) while its other threads still end: `gadei daemon stop` once said the daemon
    stopped while its parent could not reap it yet. Here the main thread leaves and a second
    thread runs on: the process runs (for `running` and `alive`) until that thread ends."""
    code = ("import ctypes, os, threading\n"
            "os.read(0, 1)\n"  # each byte from the test: the main thread ends, then the other one
            "threading.Thread(target=lambda: (os.read(0, 1), os._exit(0))).start()\n"
            "ctypes.CDLL(None).pthread_exit(None)\n")
    proc = procs.spawn([sys.executable, "-c", code], stdin=subprocess.PIPE)
    started = _proc.start_time(proc.pid)
    proc.stdin.write("x")
    proc.stdin.flush()
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, 30, "the main thread to end")
    assert proc.poll() is None and _proc.running(proc.pid) and _proc.alive(proc.pid, started)
    proc.stdin.write("x")
    proc.stdin.flush()
    assert proc.wait(30) == 0
    assert not _proc.running(proc.pid) and not _proc.alive(proc.pid, started)


def test_a_process_stays_the_one_it_was_when_the_wall_clock_is_stepped(procs, monkeypatch):
    """A VM's wall clock once stepped 23 s during a job: a start time read from psutil's
    `create_time` (its start since boot added to the boot time as the wall clock puts it now)
    moved with it, and every process the job's supervisor had recorded seemed another one: it
    took its live server for dead. `_proc.start_time` counts from boot, which no step moves.
    Here psutil's boot time is moved as such a step moves it."""
    proc = procs.spawn([sys.executable, "-c", "import time; time.sleep(120)"])
    started = _proc.start_time(proc.pid)
    recorded_by_an_earlier_gadei = psutil.Process(proc.pid).create_time()
    assert _proc.alive(proc.pid, started) and _proc.alive(proc.pid, recorded_by_an_earlier_gadei)
    assert not _proc.alive(proc.pid, started + 0.02)  # two clock ticks apart: another process on that pid

    booted = psutil.boot_time()
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: booted + 23.0)
    assert abs(psutil.Process(proc.pid).create_time() - recorded_by_an_earlier_gadei - 23.0) < 0.01  # the step
    assert _proc.alive(proc.pid, started) and _proc.start_time(proc.pid) == started
    proc.kill()
    proc.wait(30)
    assert not _proc.alive(proc.pid, started)
