"""Checkpoint files: plain PyTorch reads them, a damaged or partial one is never taken,
a writer killed mid-write or out of space leaves the earlier checkpoints whole."""

import logging
import os
import random
import signal
import textwrap
import time

import pytest
import torch
from conftest import finish, read_line

from gadei import checkpoint
from gadei.checkpoint import Checkpoint, CheckpointError


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


def test_flat_weights_follow_the_spec_and_name_a_mismatch(tmp_path):
    ckpt = _checkpoint()
    spec = [("0.weight", (50, 8)), ("1.weight", (3, 8)), ("1.bias", (3,))]
    flat = ckpt.flat_weights(spec)
    assert flat.shape == (427,) and flat[:400].tolist() == ckpt.model["0.weight"].reshape(-1).tolist()
    with pytest.raises(CheckpointError, match=r"'1.weight' is shape \(3, 8\), the job has shape \(4, 8\)"):
        ckpt.flat_weights([("0.weight", (50, 8)), ("1.weight", (4, 8))])


_WRITER = textwrap.dedent("""
    import json, resource, signal, sys, torch
    from gadei import checkpoint
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
    version = 100
    while True:
        version += 1
        checkpoint.save(folder, Checkpoint(job="killed", version=version, applied=version, model=big), keep=2)
        print(json.dumps({"version": version}), flush=True)
""")


def test_a_writer_killed_mid_write_leaves_whole_checkpoints_only(tmp_path, procs):
    checkpoint.save(tmp_path, _checkpoint(1))
    writer = procs.start("-c", _WRITER, tmp_path, "loop")
    assert read_line(writer, 60)["version"] == 101  # one whole checkpoint written, more under way
    time.sleep(random.uniform(0.0, 0.05))  # a moment somewhere inside a later write
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    found = checkpoint.latest(tmp_path)
    assert found is not None and found.version >= 101 and found.job == "killed"
    for path in checkpoint.listing(tmp_path):
        checkpoint.load(path)  # every listed file is whole
    checkpoint.save(tmp_path, _checkpoint(500))  # the next writer removes the dead one's temporary file
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
    with pytest.raises(CheckpointError, match=r"job 'ckpt-test': cannot write checkpoint .*not-a-folder/sub/ckpt-000001.pt: Not a directory"):
        checkpoint.save(blocker / "sub", _checkpoint())
    assert blocker.read_text().startswith("a file")
