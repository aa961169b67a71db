"""`gadei.Client` against a real daemon and a real job: a job submitted as a dict and as a file,
a wait that times out and one that ends, the job's progress and logs followed to its end, its
result, model and predictions, a queued job cancelled; and the typed errors: no daemon (naming
the socket), a malformed job dict (naming the key), a job the daemon refuses or does not know."""

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import blobs, start_daemon, communicate, finish, job_text, unique_name

import gadei
from gadei.predict import predict


@pytest.fixture
def daemon_env(daemon_env, monkeypatch):
    """The daemon's runtime and state folders (conftest's) for this process's Client too."""
    for name, value in daemon_env.items():
        monkeypatch.setenv(name, value)
    return daemon_env


def _blobs_data(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    x, y = blobs(900)
    np.savez(folder / "blobs.npz", x=x, y=y)
    return x, y


def _job(name: str, **train) -> dict:
    """The smallest real job: an MLP on 900 blobs (blobs.npz, relative), 1 learner, 1 epoch."""
    return {"job": {"name": name, "workload": "mlp"},
            "data": {"train": "blobs.npz", "format": "npz", "holdout": 0.2},
            "train": {"learners": 1, "epochs": 1, **train}}


def test_a_job_submitted_waited_for_followed_and_read_back_through_the_client(tmp_path, procs, daemon_env):
    x, y = _blobs_data(tmp_path)
    name, queued = unique_name("client"), unique_name("client-q")
    daemon = start_daemon(procs, daemon_env)
    client = gadei.Client(poll=0.1)  # this user's socket, as the daemon's environment names it

    record = client.submit(_job(name), base=tmp_path)  # a dict: relative paths from `base`
    assert record.name == name and record.state == "queued" and record.output == str(tmp_path / "runs" / name)
    with pytest.raises(gadei.JobTimeout) as late:
        client.wait(record, timeout=0.05)
    assert late.value.job == name and late.value.state in ("queued", "running"), late.value
    assert f"job {name!r} is still {late.value.state} after 0.05 s" in str(late.value)

    # the same job again while it is live: refused, and the job file written for it is gone
    with pytest.raises(gadei.DaemonRefused, match=f"job '{name}' is already (queued|running)"):
        client.submit(_job(name), base=tmp_path)
    assert len(list(Path(daemon_env["GADEI_STATE_DIR"], "job-files").iterdir())) == 1
    # a job file, queued behind the running one (one job at a time), cancelled before it starts
    path = tmp_path / "queued.toml"
    path.write_text(job_text({**_job(queued), "output": {"folder": "out-queued"}}))
    assert client.submit(path).state == "queued"
    assert client.cancel(queued).state == "cancelled"
    never = client.wait(queued, timeout=30)
    assert never.state == "cancelled" and not never.started
    assert list(client.logs(queued)) == [f"job '{queued}' was cancelled before it started: it never ran, so it has "
                                         "no logs"]
    with pytest.raises(gadei.GadeiError, match="never ran"):
        client.result(queued)
    # what the daemon refuses or does not know comes back as the error it is
    bad = tmp_path / "bad.toml"
    bad.write_text(job_text({"job": {"name": "bad", "workload": "mlp"}, "data": {"train": "nope.npz",
                                                                                 "format": "npz"}}))
    with pytest.raises(gadei.JobFileError, match=r"\[data\] train = '.*nope.npz'.*no such file"):
        client.submit(bad)
    (tmp_path / "words.csv").write_text("a,b\nx,y\n")  # a dict the daemon refuses for its data: its file is gone
    with pytest.raises(gadei.JobFileError, match="words.csv"):
        client.submit({"job": {"name": "words", "workload": "mlp"}, "data": {"train": "words.csv"}}, base=tmp_path)
    assert len(list(Path(daemon_env["GADEI_STATE_DIR"], "job-files").iterdir())) == 1
    with pytest.raises(gadei.NoSuchJob, match="the daemon has no job 'nope'"):
        client.job("nope")

    # its logs followed by `gadei logs --follow` (this client, in a process of its own) while its
    # progress is followed here, each to the job's end
    tail = procs.gadei("logs", name, "--lines", 5, "--follow", env=daemon_env)
    progress = list(client.follow(record, timeout=180))
    out_text, _ = communicate(tail, 60)
    assert tail.returncode == 0
    logs = out_text.splitlines()
    done = client.wait(name, timeout=0)  # follow ended with the job: no wait is left
    assert done.state == "done", done
    out = Path(done.output)
    # each record as the job wrote it: metrics.jsonl's line, less what is added when the job's
    # outputs are written (`seconds_since_start`, in the time base of result.json's runs)
    written = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("seconds_since_start" in w for w in written), written
    assert progress == [{k: v for k, v in w.items() if k != "seconds_since_start"} for w in written]
    assert [p["epoch"] for p in progress] == [1]
    serve_log = out / "logs" / "server.log"
    assert f"==> {serve_log} <==" in logs and f"==> {out / 'logs' / 'supervisor.log'} <==" in logs, logs
    stopped = next(line for line in serve_log.read_text().splitlines() if line.startswith('{"event": "stopped"'))
    assert stopped in logs  # the server's last words, written as the job ended
    # followed once it has ended: all of it at once, then the end
    assert list(client.follow(name, timeout=0)) == progress
    assert list(client.logs(name, lines=5, follow=True, timeout=0)) == list(client.logs(name, lines=5))

    result = client.result(name)
    assert result == json.loads((out / "result.json").read_text()) and result["outcome"] == "done"
    assert client.model_path(name) == out / "model.pt"
    texts = [",".join(str(v) for v in x[i]) for i in range(10)]
    answers = client.predict(done, texts, top=1)
    assert answers == predict(str(out), texts, top=1)
    assert sum(a[0][0] == label for a, label in zip(answers, y[:10])) >= 8, (answers, y[:10])

    finish(procs.gadei("daemon", "stop", env=daemon_env))
    communicate(daemon, 30)


def test_a_daemon_answer_that_is_no_job_record_is_a_daemon_error_naming_the_field(tmp_path):
    """What comes over the socket is checked: a job record whose field is not of its type (a
    daemon of another version, a process that is not the daemon) is a DaemonError, not a record."""
    import socket
    import threading

    path = str(tmp_path / "daemon.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(30)  # a client that never connects: the thread ends, the test fails on its own

    def answer():
        connection, _ = server.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(json.dumps({"ok": True, "jobs": [{"name": "x", "jobfile": "/j.toml", "output": "/o",
                                                                  "submitted": "yesterday"}]}).encode() + b"\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(gadei.DaemonError, match="not one: its submitted is 'yesterday', not int or float"):
            gadei.Client(path).job("x")
    finally:
        thread.join(10)
        server.close()


def test_no_daemon_is_a_typed_error_that_names_the_socket(tmp_path):
    socket = tmp_path / "daemon.sock"
    client = gadei.Client(socket)
    for call in (client.jobs, lambda: client.wait("x", timeout=5), lambda: list(client.logs("x")),
                 lambda: client.submit(tmp_path / "job.toml")):
        with pytest.raises(gadei.NoDaemon) as caught:
            call()
        assert caught.value.socket == str(socket) and f"no gadei daemon listens on {socket}" in str(caught.value)


def test_a_job_dict_with_a_per_label_folder_is_written_with_every_file_of_it(tmp_path, monkeypatch):
    """A dict that names a per-label folder (and leaves the format to it) is written as a job file
    that reads every label's file (it once named the first file alone: one label, refused)."""
    from gadei import jobfile
    from gadei.daemon.client import _data_bytes, _write_job_file

    monkeypatch.setenv("GADEI_STATE_DIR", str(tmp_path / "state"))
    (tmp_path / "reviews").mkdir()
    for label in ("good", "bad", "meh"):
        (tmp_path / "reviews" / f"{label}.txt").write_text("".join(f"{label} line {i}\n" for i in range(200)))
    for data in ({"train": "reviews"}, {"train": "reviews", "format": "per-label"}):
        job = jobfile.load(_write_job_file({"job": {"name": "reviews", "workload": "ngram"}, "data": data}, tmp_path))
        assert job.data.format == "per-label", job.data
        assert job.data.train == tuple(tmp_path / "reviews" / f"{n}.txt" for n in ("bad", "good", "meh")), job.data
        assert sorted(gadei.data.load_job(job)[0].label_names) == ["bad", "good", "meh"]
    # a submit waits for the daemon's checks by the bytes they read: the folder's files, not its entry
    (tmp_path / "reviews.toml").write_text('[job]\nname = "reviews"\n[data]\ntrain = "reviews"\n')
    files = (tmp_path / "reviews").iterdir()
    assert _data_bytes(str(tmp_path / "reviews.toml")) == sum(f.stat().st_size for f in files)


@pytest.mark.parametrize("change, message", [
    (lambda j: j["data"].pop("train"), r"job dict: \[data\] train is missing; it is required"),
    (lambda j: j["train"].update(lr="fast"), r"job dict: \[train\] lr = 'fast' is a string; allowed: a number"),
    (lambda j: j["train"].update(epoch=2), r"job dict: \[train\] unknown key 'epoch' \(did you mean 'epochs'\?\)"),
    (lambda j: j.update(trian={}), r"job dict: unknown section \[trian\] \(did you mean 'train'\?\)"),
], ids=["missing", "type", "unknown-key", "unknown-section"])
def test_a_malformed_job_dict_is_refused_naming_the_key_before_the_daemon_is_asked(tmp_path, monkeypatch, change,
                                                                                   message):
    monkeypatch.setenv("GADEI_STATE_DIR", str(tmp_path / "state"))
    _blobs_data(tmp_path)
    job = _job("malformed")
    change(job)
    client = gadei.Client(tmp_path / "daemon.sock")  # no daemon: the dict is refused before it is asked
    with pytest.raises(gadei.JobFileError, match=message):
        client.submit(job, base=tmp_path)
    assert not (tmp_path / "state").exists()  # no job file written
