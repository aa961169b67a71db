"""Checkpoints: plain PyTorch reads the files; a damaged or partial one is never taken; a
writer killed mid-write or out of space leaves the earlier checkpoints whole; a checkpoint
of a training job holds whole updates only; a resumed job applies nothing twice."""

import dataclasses
import logging
import os
import random
import re
import signal
import textwrap
import threading
import time

import pytest
import torch

import gadei
from helpers import communicate, finish, read_line, wait_for
from gadei import checkpoint, protocol
from gadei.checkpoint import Checkpoint, CheckpointError
from gadei.region import Region, inspect
from worker import Flat

pytestmark = pytest.mark.faults  # also run on a loaded machine: `--busy 2 -m faults` (docs/testing.md)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3))


def _checkpoint(version: int = 7, seed: int = 0) -> Checkpoint:
    model = _model(seed)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Checkpoint(job="ckpt-test", version=version, applied=version + 1, model=state,
                      optimizer={"momentum": torch.full((427,), 0.5)},
                      config={"mode": "async", "lr": 0.01, "learners": 2},
                      learners=[{"pushed": 4, "applied": 4}, {"pushed": 3, "applied": 2}])


def test_round_trip_and_plain_pytorch_reads_it(tmp_path):
    written = _checkpoint()
    path = checkpoint.save(tmp_path, written)
    assert path.name == "ckpt-000001.pt" and written.path == path
    back = checkpoint.load(path)
    assert (back.job, back.version, back.applied, back.config, back.learners) == \
        (written.job, written.version, written.applied, written.config, written.learners)
    assert back.checksum() == written.checksum()
    plain = torch.load(path, weights_only=True)  # no gadei code needed, no pickled code run
    model = _model(seed=1)
    model.load_state_dict(plain["model"])
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, written.model[name])
    assert torch.equal(plain["optimizer"]["momentum"], written.optimizer["momentum"])


def test_only_the_last_keep_are_kept_and_latest_is_the_newest(tmp_path):
    for version in range(1, 6):
        checkpoint.save(tmp_path, _checkpoint(version), keep=2)
    assert [p.name for p in checkpoint.listing(tmp_path)] == ["ckpt-000004.pt", "ckpt-000005.pt"]
    assert checkpoint.latest(tmp_path).version == 5


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_latest_is_skipped_for_the_one_before(tmp_path, caplog, damage):
    checkpoint.save(tmp_path, _checkpoint(1))
    newest = checkpoint.save(tmp_path, _checkpoint(2))
    data = bytearray(newest.read_bytes())
    if damage == "flip":  # a bit flipped inside the weights: the file still unpickles
        position = data.index(written_bytes(_checkpoint(2)))
        data[position + 5] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    newest.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="ckpt-000002.pt"):
        checkpoint.load(newest)
    if damage == "flip":  # a look at its fields (a stopped run's last line) does not check the tensors; a resume does
        assert checkpoint.load(newest, verify=False).version == 2
    else:
        with pytest.raises(CheckpointError, match="ckpt-000002.pt"):
            checkpoint.load(newest, verify=False)
    with caplog.at_level(logging.WARNING, logger="gadei.checkpoint"):
        found = checkpoint.latest(tmp_path)
    assert found.version == 1
    assert "ckpt-000002.pt" in caplog.text


def written_bytes(ckpt: Checkpoint) -> bytes:
    """Some bytes of the checkpoint's weights as they lie in the file."""
    return ckpt.model["0.weight"].numpy().tobytes()[:64]


def test_a_file_that_is_not_a_gadei_checkpoint_is_refused(tmp_path):
    path = tmp_path / "ckpt-000001.pt"
    torch.save({"model": _model().state_dict()}, path)
    with pytest.raises(CheckpointError, match="not a gadei checkpoint"):
        checkpoint.load(path)
    assert checkpoint.latest(tmp_path) is None


def test_a_checkpoint_of_format_1_is_read_and_checked_by_its_sha256_and_an_unknown_format_is_named(tmp_path):
    """Format 2 changed the checksum from SHA-256 to CRC-32 (12 s of a 2.3 GB checkpoint's
    save): a job checkpointed by a gadei before it still resumes, and a damaged one of its
    files is still found."""
    written = dataclasses.replace(_checkpoint(4), created=1.0)
    old = dict(written.to_dict(), format_version=1, checksum=written.checksum(1))
    assert old["checksum"] == "99fd53cd0ffbc42bddc059ef8c29c224e855ba0d1d2778a014f5c45b6cb4ca84"  # as format 1 wrote it
    assert re.fullmatch(r"crc32:[0-9a-f]{8}", written.to_dict()["checksum"])
    torch.save(old, tmp_path / "ckpt-000001.pt")
    back = checkpoint.load(tmp_path / "ckpt-000001.pt")
    assert back.version == 4 and back.checksum() == written.checksum()
    damaged = dict(old, model={k: v + (k == "1.bias") for k, v in old["model"].items()})
    torch.save(damaged, tmp_path / "ckpt-000002.pt")
    with pytest.raises(CheckpointError, match="ckpt-000002.pt fails its checksum"):
        checkpoint.load(tmp_path / "ckpt-000002.pt")
    torch.save(dict(old, format_version=3), tmp_path / "ckpt-000003.pt")
    with pytest.raises(CheckpointError, match="has format version 3, this gadei reads 1 and 2"):
        checkpoint.load(tmp_path / "ckpt-000003.pt")
    assert checkpoint.latest(tmp_path).path.name == "ckpt-000001.pt"


def test_flat_weights_follow_the_spec_and_name_a_mismatch(tmp_path):
    ckpt = _checkpoint()
    spec = [("0.weight", (50, 8)), ("1.weight", (3, 8)), ("1.bias", (3,))]
    flat = ckpt.flat_weights(spec)
    assert flat.shape == (427,) and flat[:400].tolist() == ckpt.model["0.weight"].reshape(-1).tolist()
    with pytest.raises(CheckpointError, match=r"'1.weight' is shape \(3, 8\), the job has shape \(4, 8\)"):
        ckpt.flat_weights([("0.weight", (50, 8)), ("1.weight", (4, 8))])


_WRITER = textwrap.dedent("""
    import json, resource, signal, sys, torch
    from gadei import checkpoint, protocol
    from gadei.checkpoint import Checkpoint
    folder, mode = sys.argv[1], sys.argv[2]
    big = {"w": torch.arange(4_000_000, dtype=torch.float32)}  # 16 MB: a write takes a while
    if mode == "full":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # exceeding the limit fails the write with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            checkpoint.save(folder, Checkpoint(job="full", version=9, applied=9, model=big))
        except checkpoint.CheckpointError as err:
            print("ERROR", err, flush=True)
        sys.exit(0)
    if mode == "many":  # small checkpoints, as fast as it can, beside other writers
        for k in range(40):
            small = Checkpoint(job="many", version=k, applied=k, model={"w": torch.zeros(4)})
            checkpoint.save(folder, small, keep=1000)
        sys.exit(0)
    version = 100
    while True:
        version += 1
        checkpoint.save(folder, Checkpoint(job="killed", version=version, applied=version, model=big), keep=2)
        print(json.dumps({"version": version}), flush=True)
""")


def test_a_writer_killed_mid_write_leaves_whole_checkpoints_only(tmp_path, procs):
    checkpoint.save(tmp_path, _checkpoint(1))

    def writing() -> list[str]:
        return [name for name in os.listdir(tmp_path) if ".tmp" in name]

    deadline = time.monotonic() + 120
    while True:  # until a kill lands inside a write: its temporary file is left behind
        writer = procs.start("-c", _WRITER, tmp_path, "loop")
        assert read_line(writer, 60)["version"] == 101  # one whole checkpoint written, more under way
        wait_for(writing, 60, "a checkpoint write under way")
        time.sleep(random.uniform(0.0, 0.01))  # a moment somewhere inside that write
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        if writing():
            break
        assert time.monotonic() < deadline, "no kill landed inside a write within 120 s"
    found = checkpoint.latest(tmp_path)
    assert found is not None and found.version >= 101 and found.job == "killed"
    for path in checkpoint.listing(tmp_path):
        checkpoint.load(path)  # every listed file is whole
    checkpoint.save(tmp_path, _checkpoint(500))  # the next writer removes the dead one's temporary file
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]


def test_writers_at_once_each_keep_their_checkpoints(tmp_path, procs):
    """The supervisor's periodic checkpoint, gadei run's at a stop and the server's own may be
    written at once: each gets a name of its own, none replaces another's."""
    writers = [procs.start("-c", _WRITER, tmp_path, "many") for _ in range(3)]
    for writer in writers:
        finish(writer, 120)
    names = [path.name for path in checkpoint.listing(tmp_path)]
    assert names == [f"ckpt-{n:06d}.pt" for n in range(1, 121)], f"{len(names)} of 120 checkpoints kept"
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]


def test_out_of_space_is_a_clear_error_and_keeps_the_earlier_checkpoint(tmp_path, procs):
    checkpoint.save(tmp_path, _checkpoint(1))
    out, err = finish(procs.start("-c", _WRITER, tmp_path, "full"), 120)
    assert out.startswith("ERROR job 'full': cannot write checkpoint ") and "ckpt-000002.pt: File too large" in out, err
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001.pt"]  # no partial file, the old one intact
    assert checkpoint.latest(tmp_path).version == 1


def test_a_folder_that_cannot_be_written_is_a_clear_error(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoint folder should be")
    with pytest.raises(CheckpointError, match=r"job 'ckpt-test': cannot write checkpoint "
                                              r".*not-a-folder/sub/ckpt-000001.pt: Not a directory"):
        checkpoint.save(blocker / "sub", _checkpoint())
    assert blocker.read_text().startswith("a file")


# --- taking a checkpoint of a running job ---------------------------------------------

N = 2_000_000  # 8 MB of weights: an update takes long enough for a plain copy to overlap one


def _whole(ckpt: Checkpoint) -> bool:
    """Every weight is what `version` updates of gradient 1.0 at lr 0.125 make of 1.0."""
    expected = 1.0 - 0.125 * ckpt.version
    return all(bool((t == expected).all()) for t in ckpt.model.values())


def _training(procs, job, mode):
    server = procs.worker("serve", job, "--n", N, "--lr", 0.125, "--mode", mode, "--learners", 2, "--threads", 1)
    read_line(server, 60)
    learners = [procs.worker("push", job, "--n", N, "--steps", 10**9) for _ in range(2)]
    for learner in learners:
        read_line(learner, 60)
        read_line(learner, 60)
    return server


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_capture_while_training_holds_whole_updates_only(job, procs, mode):
    _training(procs, job, mode)
    with Region.attach(job) as region:
        wait_for(lambda: region.header.get("version") > 5, 60, "updates to flow")
        captured = [checkpoint.capture(region) for _ in range(15)]
        assert region.header.get("hold") == 0  # every capture let go of its hold
        wait_for(lambda: region.header.get("held") == 0, 10, "the server to go on after the last capture")
        after = region.header.get("version")
        # The control: the same copy without a hold, racing the server, must tear at some point,
        # or the check below proves nothing. On a loaded machine updates are rare, so copy until
        # one tears rather than a fixed number of times.
        wait_for(lambda: not _whole(checkpoint._copy(region)), 60, "a plain copy (no hold) to tear", interval=0)
    assert all(_whole(c) for c in captured), [c.version for c in captured if not _whole(c)]
    assert len({c.version for c in captured}) > 1 and captured[-1].version <= after  # training went on between


def test_the_server_goes_on_when_a_checkpointer_dies_holding_it(job, procs):
    _training(procs, job, "async")
    with Region.attach(job) as region:
        h = region.header
        wait_for(lambda: h.get("version") > 5, 60, "updates to flow")
        epoch = h.get("hold_epoch")
        assert h.cas("hold", 0, 1)  # asked for a hold and never let go, as a killed checkpointer would
        wait_for(lambda: h.get("held") == 1, 10, "the server to pause")
        paused_at = h.get("version")
        wait_for(lambda: h.get("version") > paused_at, protocol.hold_limit(region.shape) + 10, "the server to go on")
        assert h.get("hold") == 0 and h.get("hold_epoch") == epoch + 1
        assert _whole(checkpoint.capture(region))  # and the next checkpoint works


def test_a_checkpoint_taken_right_after_another_gets_a_pause_of_its_own(job, procs):
    """The pause the last checkpointer let go of ends before the next one asks: riding on it
    would give the next copy only what is left of that pause's hold limit. Here the server is
    stopped (SIGSTOP) within a pause until that limit passed, and let run during the next
    checkpoint; on the old protocol the server then went on amid the copy."""
    server = _training(procs, job, "async")
    with Region.attach(job) as region:
        h = region.header
        wait_for(lambda: h.get("version") > 5, 60, "updates to flow")

        def stop_the_server():
            os.kill(server.pid, signal.SIGSTOP)
            return checkpoint._copy(region)

        first = protocol.hold_and_copy(region, 10, stop_the_server, CheckpointError)
        assert h.get("hold") == 0 and h.get("held") == 1  # let go of; the stopped server still pauses
        stale = h.get("hold_epoch")
        time.sleep(protocol.hold_limit(region.shape) + 0.5)  # that pause's limit passes while the server cannot run
        threading.Timer(0.5, os.kill, (server.pid, signal.SIGCONT)).start()

        def copy_while_the_server_runs():
            wait_for(lambda: h.get("hold_epoch") != stale, 10, "the server to run again")
            epochs.append(h.get("hold_epoch"))
            return checkpoint._copy(region)

        epochs = []

        second = protocol.hold_and_copy(region, 10, copy_while_the_server_runs, CheckpointError)
        assert _whole(first) and _whole(second) and second.version >= first.version
        assert epochs == [stale + 1]  # the copy was taken in a pause of its own, after the stale one ended
        wait_for(lambda: h.get("version") > second.version, 30, "the server to go on after the second checkpoint")


def test_a_job_resumed_from_its_checkpoint_goes_on_where_it_stopped(job, procs, tmp_path):
    """Nothing is applied twice or lost across a stop and a resume: the final weights are
    exactly those of every step applied once."""
    steps = []
    for run, extra in enumerate((["--checkpoint-dir", tmp_path], ["--resume", tmp_path, "--checkpoint-dir", tmp_path])):
        server = procs.worker("serve", job, "--n", 1000, "--lr", 0.125, "--learners", 2, *extra)
        read_line(server, 60)
        learner = procs.worker("push", job, "--n", 1000, "--steps", 40 + run)
        steps.append(40 + run)
        assert read_line(learner, 60) and read_line(learner, 60)  # attaching, attached
        read_line(learner, 120)
        finish(learner)
        server.send_signal(signal.SIGTERM)
        report = read_line(server, 60)
        finish(server)
        assert report["version"] == sum(steps) and report["wmin"] == report["wmax"] == 1.0 - 0.125 * sum(steps)
        saved = checkpoint.latest(tmp_path)  # written at the clean stop
        assert saved.version == saved.applied == sum(steps) and _whole(saved)
    assert [p.name for p in checkpoint.listing(tmp_path)] == ["ckpt-000001.pt", "ckpt-000002.pt"]


def test_resuming_from_a_checkpoint_of_another_model_is_refused_and_leaves_no_region(job, tmp_path):
    checkpoint.save(tmp_path, _checkpoint())
    with pytest.raises(CheckpointError, match=r"parameter 'weight' is missing"):
        gadei.Server(job, model=Flat(100), resume=checkpoint.latest(tmp_path))
    assert inspect(job) is None


def test_serve_resume_without_a_valid_checkpoint_is_a_clear_error(job, procs, tmp_path):
    (tmp_path / "ckpt-000001.pt").write_bytes(b"not a checkpoint")
    out, err = communicate(procs.gadei("serve", job, "--params", 10, "--resume", tmp_path), 60)
    assert f"--resume {tmp_path}: no checkpoint there that reads and verifies" in err
    assert "skipping a bad checkpoint" in err


def test_launched_learners_never_resume_from_a_checkpoint_without_their_progress(job, procs, tmp_path):
    """A stopped server's own checkpoint holds the weights, not how far each learner got:
    learners launched from their start would apply again what those weights hold. The
    supervisor refuses it, and a folder of such checkpoints only, with the reason and the way
    on; it starts nothing (no region is left)."""
    saved = checkpoint.save(tmp_path, _checkpoint())  # no progress: as `gadei serve` leaves at its stop
    for given in (tmp_path, saved):
        out, err = communicate(procs.gadei("serve", job, "--params", 10, "--checkpoint-dir", tmp_path, "--resume",
                                           given, "--learner", "--epochs 1"), 60)
        assert f"--resume {given}: " in err and "would train again what its weights hold" in err, err
        assert "Traceback" not in err and inspect(job) is None


def test_serve_params_resumed_from_a_checkpoint_of_a_named_model_is_a_clear_error(job, procs, tmp_path):
    """--params gives the weights no names: a checkpoint of a model's named parameters, without
    their shapes, cannot be laid out in it. Refused with the reason, no traceback, no region."""
    checkpoint.save(tmp_path, _checkpoint())
    out, err = communicate(procs.gadei("serve", job, "--params", 10, "--resume", tmp_path), 60)
    assert "holds a model's parameters (0.weight, 1.weight, 1.bias)" in err and "not --params" in err, err
    assert "Traceback" not in err and inspect(job) is None
