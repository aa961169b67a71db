"""GPU learners (issue 6): the device transports, device choice and their refusals.

The device push and pull run three threads per learner (train, push, pull) with one-item
hand-offs between them. On a CPU "device" they run the same code with synchronous copies
and no streams, which is how this suite checks their thread logic on machines without a
GPU: real server and learner processes, random delays injected in each of the three
threads, and the exactly-once contract of tests/test_exactly_once.py (final weights bit
for bit, counters). The same tests on CUDA devices, and the GPU-only cases (GPU and CPU
learners in one job, more learners than GPUs), are skipped where no GPU is visible.
"""

import re
import signal
import threading
import time

import pytest
import torch

import gadei
from helpers import (LR, N, VALUES, Serving, communicate, finish, push_known_gradients, read_line, small_job, tiered,
                     unique_name, wait_for)
from gadei import device, jobfile, status
from gadei.jobfile import JobFileError
from gadei.region import Region
from worker import TABLE_WIDTH, Flat, Table

GPUS = device.cuda_count()
NO_GPU = f"needs a CUDA GPU: torch {torch.__version__} sees none on this machine"
cuda = pytest.mark.skipif(GPUS == 0, reason=NO_GPU)
no_cuda = pytest.mark.skipif(GPUS > 0, reason="checks the refusal on a machine without CUDA; this one has a GPU")
DEADLINE = 120  # seconds a learner may take for its pushes; far above what they need, far below a hang


def _on_devices(job, procs, tmp_path, devices, **options):
    """test_exactly_once's contract through the device transports: one learner per entry of
    `devices`, each step's gradient different (V, 2V, 3V, V, ...)."""
    push_known_gradients(job, procs, tmp_path, values=[VALUES[i % len(VALUES)] for i in range(len(devices))],
                         pull="device", push="device", devices=devices, vary=True, deadline=DEADLINE, **options)


# ------------------------------------------------------------------ the three-thread hand-off

STRESS = [  # (slots, gradient transport, model, row-sparse, mode): every slot format, a full ring, consistent pulls
    (1, "float32", "flat", False, "async"),
    (2, "float16", "flat", False, "async"),
    (2, "bfloat16", "table", True, "async"),
    (1, "float32", "flat", False, "consistent"),
]


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("seed, case", tiered(list(enumerate(STRESS)), default=[(0, STRESS[0])]))  # all: --long
def test_random_delays_in_the_train_push_and_pull_threads_neither_deadlock_nor_lose_a_gradient(
        job, procs, tmp_path, dev, seed, case):
    slots, grad_dtype, model, row_sparse, mode = case
    _on_devices(job, procs, tmp_path, [dev] * len(VALUES), slots=slots, grad_dtype=grad_dtype, model=model,
                row_sparse=row_sparse, mode=mode, jitter=seed)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=cuda)])
def test_stopping_the_job_mid_push_ends_every_learner_and_applies_what_was_published(job, procs, dev):
    server = procs.worker("serve", job, "--n", N, "--lr", LR, "--learners", 3, "--slots", 1)
    read_line(server, 60)
    learners = [procs.worker("push", job, "--n", N, "--value", 1, "--steps", 10**6, "--pull", "device",
                             "--push", "device", "--device", dev, "--jitter", i, "--max-jitter", 0.005)
                for i in range(3)]
    for learner in learners:
        read_line(learner, 60)
        read_line(learner, 60)
    with Region.attach(job, readonly=True) as region:
        wait_for(lambda: region.header.get("applied") >= 60, 60, "60 gradients applied")
    server.send_signal(signal.SIGTERM)
    report = read_line(server, 60)
    finish(server)
    done = [read_line(learner, 30) for learner in learners]  # each with-block ended quietly on JobStopped
    for learner in learners:
        finish(learner, 30)
    assert report["heads"] == report["tails"]  # everything published was applied
    assert report["applied"] == report["version"] == sum(report["heads"])
    # each learner's pushes were published (and so applied) but for those the staleness bound
    # dropped and at most the two still on their way when the job stopped (DevicePush has two
    # staging buffers: one the push thread holds, waiting for ring space, one handed over to
    # it); none is invented
    assert all(0 <= d["pushed"] - d["dropped"] - report["heads"][d["learner"]] <= 2 for d in done), (done, report)


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=cuda)])
def test_a_killed_server_ends_every_device_learner_with_server_gone(job, procs, dev):
    server = procs.worker("serve", job, "--n", N, "--lr", LR, "--learners", 2, "--slots", 1)
    read_line(server, 60)
    learners = [procs.worker("push", job, "--n", N, "--value", 1, "--steps", 10**6, "--pull", "device",
                             "--push", "device", "--device", dev, "--jitter", i) for i in range(2)]
    for learner in learners:
        read_line(learner, 60)
        read_line(learner, 60)
    with Region.attach(job, readonly=True) as region:
        wait_for(lambda: region.header.get("applied") >= 20, 60, "20 gradients applied")
    server.send_signal(signal.SIGKILL)
    for learner in learners:
        _, err = communicate(learner, 60)  # the push thread's wait for ring space notices, the train thread raises
        assert learner.returncode != 0 and "ServerGone" in err and "is gone" in err, err[-2000:]


# ------------------------------------------------------------------ GPU learners (skipped without a GPU)


@cuda
def test_gpu_learners_apply_every_gradient_exactly_once(job, procs, tmp_path):
    _on_devices(job, procs, tmp_path, ["cuda:0"] * 3)


@cuda
def test_gpu_learners_convert_to_16_bits_on_the_device_and_send_table_rows(job, procs, tmp_path):
    _on_devices(job, procs, tmp_path, ["cuda:0"] * 3, grad_dtype="bfloat16", model="table", row_sparse=True)


@cuda
def test_gpu_and_cpu_learners_train_one_job(job, procs, tmp_path):
    _on_devices(job, procs, tmp_path, ["cuda:0", "cpu", "cuda:0"])


@cuda
def test_more_learners_than_gpus_share_them(job, procs, tmp_path):
    gpus = tuple(f"cuda:{i}" for i in range(GPUS))
    _on_devices(job, procs, tmp_path, device.spread(gpus, 2 * GPUS + 1))


@cuda
def test_a_gpu_learner_page_locks_the_region_and_unlocks_it_when_it_leaves(job):

    model = Flat(N, 0.0)
    with Serving(job, model=Flat(N, 1.0), lr=LR):
        with gadei.Learner(model, job, device="cuda:0") as learner:
            assert (learner.pull_mode, learner.push_mode) == ("device", "device")
            assert torch.from_numpy(learner.region.weights).is_pinned()
            (entry,) = status.read(learner.region).learners
            assert entry.device == "cuda:0"  # what `gadei status` shows
            for _ in range(3):
                for p in model.parameters():
                    p.grad = torch.ones_like(p)
                learner.step()
        assert model.weight.device.type == "cuda"


@cuda
def test_a_gpu_learners_step_returns_while_the_gpu_still_computes_its_gradient(job):
    """`step` never waits for the device: it queues the staging copies and hands the
    gradient over (a row-sparse table's touched rows, whose count needs the device, are
    found on the push thread's stream), so the train thread can queue the next mini-batch
    while the GPU still runs this one. A second of GPU work queued before the step is still
    running when it returns."""

    model = Table(N, 0.0)
    rows = torch.ones(3, TABLE_WIDTH, device="cuda:0")
    with Serving(job, model=Table(N, 1.0), lr=LR, row_sparse=True):
        with gadei.Learner(model, job, device="cuda:0") as learner:
            for step in range(3):
                for p in model.parameters():
                    p.grad = (torch.sparse_coo_tensor(torch.tensor([[1, 5, 1]], device="cuda:0"), rows, p.shape)
                              if p.dim() == 2 else torch.ones_like(p))
                torch.cuda._sleep(2_000_000_000)  # about a second of one GPU thread, on the train stream
                queued = torch.cuda.Event()
                queued.record()
                learner.step()
                assert not queued.query(), f"step {step} waited for the GPU"
                torch.cuda.synchronize()
            wait_for(lambda: learner._push.pending == 0, 30, "the gradients to be published")
            assert learner.entry.get("head") == 3


def test_gradients_the_push_thread_still_holds_count_towards_the_staleness_bound(job):
    """Two gradients staged and held by the push thread (a copy that does not end) are ahead
    of the next one: with stale_bound 1 the third, computed on the same version, is dropped
    at once, where counting the ring alone would let it wait behind them to be applied too late."""

    release = threading.Event()
    device.set_injector(lambda point: point == "push.copy" and release.wait(30))
    try:
        with Serving(job, model=Flat(100, 1.0), lr=0.5, learners=1, stale_bound=1):
            model = Flat(100, 0.0)
            with gadei.Learner(model, job, pull="device", push="device", device="cpu") as learner:
                for _ in range(2):
                    for p in model.parameters():
                        p.grad = torch.ones_like(p)
                    learner.step()
                assert learner._push.pending == 2 and learner.entry.get("dropped") == 0
                for p in model.parameters():
                    p.grad = torch.ones_like(p)
                learner.step()  # computed on version 0, two gradients ahead of it
                assert learner.entry.get("dropped") == 1
                release.set()
                wait_for(lambda: learner._push.pending == 0, 30, "the held gradients to be published")
                assert learner.entry.get("head") == 2
    finally:
        release.set()
        device.set_injector(None)


def test_an_error_in_the_pull_thread_is_raised_in_the_train_thread(job):

    def fail(point):
        if point == "pull.copy":
            raise RuntimeError("injected pull failure")

    device.set_injector(fail)
    try:
        with Serving(job, model=Flat(100, 1.0), lr=0.5, learners=1):
            model = Flat(100, 0.0)
            with pytest.raises(RuntimeError, match="injected pull failure"):
                with gadei.Learner(model, job, pull="device", push="device", device="cpu") as learner:
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:  # the server's version moves: the pull thread copies
                        for p in model.parameters():
                            p.grad = torch.ones_like(p)
                        learner.step()
    finally:
        device.set_injector(None)


@cuda
def test_a_gpu_learner_refuses_elastic_mode_by_name(job):

    with Serving(job, model=Flat(100, 1.0), mode="elastic"):
        with pytest.raises(gadei.RegionMismatch, match="elastic mode, which GPU learners do not support"):
            gadei.Learner(Flat(100, 0.0), job, device="cuda:0").attach()


# ------------------------------------------------------------------ device choice and refusals


@no_cuda
def test_a_learner_asking_for_cuda_without_a_gpu_fails_at_once_saying_so(job):
    with pytest.raises(gadei.DeviceError, match="no usable CUDA GPU"):
        gadei.Learner(Flat(100, 0.0), job, device="cuda:0")  # before any region is looked for


@no_cuda
def test_gadei_learn_with_a_cuda_device_without_a_gpu_fails_at_once_saying_so(job, procs):
    learn = procs.gadei("learn", job, "--device", "cuda:0")
    _, err = communicate(learn, 60)
    assert learn.returncode == 2 and "device 'cuda:0'" in err and "no usable CUDA GPU" in err, err


def test_a_bad_device_name_is_refused(job):
    with pytest.raises(gadei.DeviceError, match="not a device; allowed: cpu, cuda, cuda:N"):
        gadei.Learner(Flat(100, 0.0), job, device="gpu0")


def test_a_cpu_learner_may_use_the_device_transports_but_not_in_elastic_mode(job):

    with Serving(job, model=Flat(100, 1.0), mode="elastic"):
        with pytest.raises(gadei.RegionMismatch, match="pull must be one of"):
            gadei.Learner(Flat(100, 0.0), job, pull="device", push="device").attach()


def test_learners_are_spread_round_robin_over_the_devices():
    assert device.spread(("cuda:0", "cuda:1"), 5) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert device.spread(("cpu",), 2) == ["cpu", "cpu"]


GOOD = small_job() + "\n[train]\nlearners = 3\n"


def _load(folder, devices_line: str):
    path = folder / "job.toml"
    path.write_text(GOOD + devices_line + "\n")
    return jobfile.load(path)


def test_a_job_trains_on_the_cpu_unless_its_file_says_otherwise(small):
    job = _load(small, "")
    assert job.train.devices == "cpu"
    filled, chosen = job.with_defaults(40)
    assert filled.train.devices == "cpu" and not any("devices" in line for line in chosen)


@no_cuda
def test_auto_devices_choose_the_cpu_without_a_gpu_and_say_so(small):
    filled, chosen = _load(small, 'devices = "auto"').with_defaults(40)
    assert filled.train.devices == "cpu"
    assert any(line.startswith("devices = cpu (auto: no CUDA GPU is visible") for line in chosen), chosen
    again = jobfile.load(_write(small, filled.to_toml()))
    assert again.train.devices == "cpu"


@cuda
def test_auto_devices_choose_every_visible_gpu(small):
    filled, chosen = _load(small, 'devices = "auto"').with_defaults(40)
    assert filled.train.devices == ",".join(f"cuda:{i}" for i in range(GPUS))
    assert any("auto: every visible CUDA GPU" in line for line in chosen)


def _write(folder, text):
    path = folder / "as-run.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("line, message", [
    ("devices = 2", 'devices = 2 is an integer; allowed: "cpu", "auto"'),
    ('devices = "gpu"', "[train] devices = 'gpu': 'gpu' is not a device"),
    ('devices = "cuda:0,cuda:0"', "cuda:0 named twice"),
    ('devices = "auto,cpu"', "'auto' stands alone"),
    ('devices = ""', "'' is not a device"),
    ('device = "cpu"', "unknown key 'device' (did you mean 'devices'?)"),
])
def test_a_bad_devices_field_is_refused_naming_file_field_and_what_is_allowed(small, line, message):
    with pytest.raises(JobFileError) as refused:
        _load(small, line)
    text = str(refused.value)
    assert text.startswith("job.toml: [train] ") and message in text, text


@no_cuda
def test_a_job_asking_for_a_gpu_on_a_machine_without_one_is_refused_before_it_starts(small):
    with pytest.raises(JobFileError) as refused:
        _load(small, 'devices = "cpu,cuda:0"')
    text = str(refused.value)
    assert text.startswith("job.toml: [train] devices = 'cpu,cuda:0'") and "no usable CUDA GPU" in text, text


@cuda
def test_gadei_run_spreads_the_learners_over_the_listed_devices(small, procs):
    """A job with GPU and CPU learners, more learners than GPUs: each learner trains where
    `devices` put it (its log says so) and the job ends with its model."""
    name = unique_name("dev")
    path = small / "job.toml"
    path.write_text(GOOD.replace('name = "pets"', f'name = "{name}"')
                    + 'devices = "cuda:0,cpu"\nepochs = 2\n[output]\nfolder = "out"\n')
    run = procs.gadei("run", path)
    out, err = communicate(run, 600)
    assert run.returncode == 0, out + err
    assert "learners' devices: 0: cuda:0, 1: cpu, 2: cuda:0" in out, out
    logs = small / "out" / "logs"
    attached = r"attached \(pid \d+, {}, .*, pull {}, push {}\)"  # the learner's own line, threads between
    assert re.search(attached.format("cuda:0", "device", "device"), (logs / "learner-0.log").read_text())
    assert re.search(attached.format("cpu", "view", "publish"), (logs / "learner-1.log").read_text())
    assert re.search(attached.format("cuda:0", "device", "device"), (logs / "learner-2.log").read_text())
    assert (small / "out" / "model.pt").exists()


def test_the_gpu_busy_figure_counts_only_the_samples_taken_while_the_learners_trained():
    """`gadei bench gpu`'s share runs read the GPU's utilisation from the learners' start to
    their end; their start (spawn, imports, CUDA's set-up) is an idle GPU for seconds, longer
    than the timed steps, and counted it read 0% of a GPU that trained (issue 35): only the
    samples inside every learner's timed window count, and none there gives no figure."""
    from gadei.bench.gpu import _Busy

    busy = _Busy(torch.device("cpu"))
    busy.source = "torch"
    busy.samples = [(1.0, 0.0), (2.0, 0.0), (3.0, 0.0), (5.0, 0.9), (6.0, 0.7), (9.0, 0.0)]
    assert busy.fraction([(4.0, 7.0), (4.5, 8.0)]) == (pytest.approx(0.8), "torch, polled")  # the overlap: 5, 6
    assert busy.fraction([(4.0, 5.5), (5.8, 6.5)])[0] == pytest.approx(0.8)  # no overlap: their span
    assert busy.fraction([(3.5, 4.5)]) is None  # a window shorter than the sampling: no figure
    # the driver's time-stamped samples (nvidia-ml-py) are preferred where some fall in the window
    busy.driver_samples = [(4.2, 1.0), (4.9, 0.5), (7.5, 0.0)]
    assert busy.fraction([(4.0, 7.0), (4.5, 8.0)]) == (pytest.approx(0.5), "NVML samples")
    assert busy.fraction([(5.5, 6.5)]) == (pytest.approx(0.7), "torch, polled")
