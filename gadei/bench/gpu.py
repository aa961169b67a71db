"""`gadei bench gpu`: GPU learners (the device transports) against a plain PyTorch GPU loop.

step   per-step time of one GPU learner + server against a plain single-process PyTorch loop
       (torch.optim.SGD) on the same GPU, model, data and mini-batch: the text CNN at
       mini-batch 1, 2, 4 and 32, and a VGG-style image CNN (32x32 images) at 2 and 32. The
       issue's target: within 1.1x of the plain loop, i.e. pushes and pulls hidden.
share  samples/s of the text CNN (mini-batch 4) with 1, 2, 4 and 8 learner processes on one
       GPU (over-subscription), against one plain loop, and the fraction of time the GPU was
       busy (NVML's utilisation: the driver's time-stamped samples with nvidia-ml-py, else
       the figure polled every 50 ms through torch.cuda.utilization or nvidia-smi; the mean
       of the samples taken while every learner ran its timed steps, see `_Busy`).
copy   bytes per second the learner's push thread (device -> region) and pull thread
       (region -> device) moved while copying, in the `step` runs, against the bandwidth of
       pinned-buffer copies of the same size (the bytes of one push, of one pull) measured
       here; both timed by CUDA events around the copies, so the figures are the copy
       engine's, not the host's waits for the work queued before them.

The `step` table also says where one learner's step waited: the train thread for a staging
buffer (two gradients still on their way) and the push thread for a free ring slot (the
server behind), in ms per step.

Every figure is the median of `--repeats` runs, plain and gadei interleaved within each.
Without CUDA it stops with a message; `--device cpu` runs the same harness on the CPU (a
smoke run of the code: its figures say nothing about GPUs).
"""

import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time

import torch
from torch import nn

from .._proc import how_it_ended
from ..env import environ
from ..errors import DeviceError
from ..modes import RuleOptions
from .figure import plot_path, pyplot, save
from .timing import median, start_server, table

log = logging.getLogger(__name__)

TEXT_BATCHES = (1, 2, 4, 32)
IMAGE_BATCHES = (2, 32)
SHARE_LEARNERS = (1, 2, 4, 8)
SHARE_BATCH = 4
LR = RuleOptions.lr  # the default update rule's


class VGGish(nn.Module):
    """A VGG-style CNN for 32x32 RGB images: 3x3 convolutions in blocks of two, max-pooling, two
    dense layers (about 2.5 M parameters)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        layers, width = [], 3
        for out in (64, 128, 256):
            layers += [nn.Conv2d(width, out, 3, padding=1), nn.ReLU(), nn.Conv2d(out, out, 3, padding=1), nn.ReLU(),
                       nn.MaxPool2d(2)]
            width = out
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(256 * 4 * 4, 512), nn.ReLU(), nn.Linear(512, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def build(model: str, seed: int = 0) -> nn.Module:
    """The bench's models, the same parameters in every process for one seed (CPU)."""
    if model == "vgg":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return VGGish()
    from gadei_workloads import build_textcnn

    return build_textcnn(_text_data()[0], 6, seed=seed)


def _text_data():
    """(vocabulary size, the generated training set) of the text CNN runs."""
    from gadei_workloads import get

    train, _ = get("textcnn").load_data("generated")
    return len(train.vocab), train


def batches(model: str, batch: int, count: int, device: torch.device) -> list:
    """`count` mini-batches on `device` (moved there beforehand: the loops time steps, not input)."""
    if model == "vgg":
        gen = torch.Generator().manual_seed(batch)
        out = [(torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
               for _ in range(count)]
    else:
        from gadei_workloads.text import batches as text_batches

        _, train = _text_data()
        out, epoch = [], 0
        while len(out) < count:
            out += list(text_batches(train, batch, epoch=epoch, seed=0))
            epoch += 1
        out = out[:count]
    return [(x.to(device), y.to(device)) for x, y in out]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_steps(model: nn.Module, data: list, warmup: int, device: torch.device) -> float:
    """Seconds per step of a plain PyTorch loop (SGD) over `data` after `warmup` steps."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    start = None
    for i, (x, y) in enumerate(data):
        if i == warmup:
            _sync(device)
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    _sync(device)
    return (time.perf_counter() - start) / (len(data) - warmup)


def gadei_steps(model: nn.Module, job: str, data: list, warmup: int, device: torch.device) -> dict:
    """Seconds per step of one learner (device transports) over `data`, and its copy figures."""
    from ..learner import Learner

    learner = Learner(model, job, device=device, pull="device", push="device").attach()
    try:
        start = None
        for i, (x, y) in enumerate(data):
            if i == warmup:
                _sync(device)
                start = time.perf_counter()
                push0, pull0 = _copies(learner)
            nn.functional.cross_entropy(model(x), y).backward()
            learner.step(samples=len(y))
        _sync(device)
        seconds, wall = time.perf_counter() - start, time.time()  # the timed steps' window, in wall-clock time
        push1, pull1 = _copies(learner)
    finally:
        learner.close()
    steps = len(data) - warmup
    return {"step_seconds": seconds / steps, "window": (wall - seconds, wall),
            **{key: push1[key] - push0[key] for key in push0},
            **{key: pull1[key] - pull0[key] for key in pull0},
            "moved_bytes_per_s": (push1["push_bytes"] - push0["push_bytes"] + pull1["pull_bytes"]
                                  - pull0["pull_bytes"]) / seconds}


def _copies(learner) -> tuple[dict, dict]:
    """The push's and the pull's counters (device transports) as they stand."""
    push, pull = learner._push, learner._pull
    return ({"push_bytes": push.bytes, "push_copy_seconds": push.copy_seconds, "push_copies": push.copies,
             "train_wait_seconds": push.train_wait_seconds, "space_wait_seconds": push.space_wait_seconds},
            {"pull_bytes": pull.bytes, "pull_copy_seconds": pull.copy_seconds, "pull_copies": pull.copies})


def _server_main(job: str, model: str, learners: int, failed) -> None:
    from ..server import Server

    torch.set_num_threads(1)
    try:
        server = Server(job, model=build(model), learners=learners, rule_options=RuleOptions(lr=LR))
    except Exception as err:  # start_server says what, not only an exit code
        failed.put(f"{type(err).__name__}: {err}")
        raise
    try:
        server.serve()
    finally:
        server.close()


class _Job:
    """A server process for `model` with room for `learners`; stopped and reaped on exit."""

    def __init__(self, model: str, learners: int, timeout: float = 120.0):
        self.job = f"bench-gpu-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        self.proc = start_server(self.job, _server_main, (self.job, model, learners), timeout)

    def __enter__(self):
        return self.job

    def __exit__(self, *exc):
        from ..launch import stop_job
        from ..region import remove

        try:
            stop_job(self.job)
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
                remove(self.job)


def bench_step(args, device: torch.device) -> dict:
    steps, warmup = (30, 5) if args.quick else (300, 30)
    cases = [("textcnn", b) for b in ((2,) if args.quick else TEXT_BATCHES)]
    cases += [("vgg", b) for b in ((2,) if args.quick else IMAGE_BATCHES)]
    rows = []
    for model_name, batch in cases:
        data = batches(model_name, batch, steps + warmup, device)
        plain, runs = [], []
        for _ in range(args.repeats):
            plain.append(plain_steps(build(model_name).to(device), data, warmup, device))
            with _Job(model_name, 1) as job:
                runs.append(gadei_steps(build(model_name), job, data, warmup, device))
        row = {"model": model_name, "batch": batch, "plain_step_ms": median(plain) * 1e3,
               "gadei_step_ms": median([r["step_seconds"] for r in runs]) * 1e3,
               "push_bytes_per_s": median([r["push_bytes"] / r["push_copy_seconds"] for r in runs
                                            if r["push_copy_seconds"]]),
               "pull_bytes_per_s": median([r["pull_bytes"] / r["pull_copy_seconds"] for r in runs
                                            if r["pull_copy_seconds"]]),
               "push_bytes_per_copy": median([r["push_bytes"] / r["push_copies"] for r in runs if r["push_copies"]]),
               "pull_bytes_per_copy": median([r["pull_bytes"] / r["pull_copies"] for r in runs if r["pull_copies"]]),
               "train_wait_ms": median([r["train_wait_seconds"] / steps for r in runs]) * 1e3,
               "space_wait_ms": median([r["space_wait_seconds"] / steps for r in runs]) * 1e3,
               "moved_bytes_per_s": median([r["moved_bytes_per_s"] for r in runs]),
               "params": sum(p.numel() for p in build(model_name).parameters()), "runs": runs, "plain_runs": plain}
        row["gadei_vs_plain"] = row["gadei_step_ms"] / row["plain_step_ms"]
        log.info("gpu step %s batch %d: plain %.3f ms, gadei %.3f ms (%.2fx)", model_name, batch,
                 row["plain_step_ms"], row["gadei_step_ms"], row["gadei_vs_plain"])
        rows.append(row)
    print(f"\ngpu step: ms per step on {device}, one learner + server against a plain PyTorch loop, median of "
          f"{args.repeats} runs of {steps} steps (target: gadei/plain <= 1.1)")
    print(table(("model", "batch", "params", "plain ms", "gadei ms", "gadei/plain", "train waited ms", "ring full ms"),
                 [(r["model"], r["batch"], f"{r['params']:,}", f"{r['plain_step_ms']:.3f}", f"{r['gadei_step_ms']:.3f}",
                   f"{r['gadei_vs_plain']:.2f}x", f"{r['train_wait_ms']:.3f}", f"{r['space_wait_ms']:.3f}")
                  for r in rows]))
    print("(train waited: the train thread for a staging buffer; ring full: the push thread for a free slot, the "
          "server behind; both per step)")
    return {"rows": rows, "steps": steps, "warmup": warmup}


def _share_worker(job: str, device: str, steps: int, warmup: int, barrier, queue) -> None:
    torch.set_num_threads(1)
    dev = torch.device(device)
    data = batches("textcnn", SHARE_BATCH, steps + warmup, dev)
    model = build("textcnn")
    barrier.wait()
    result = gadei_steps(model, job, data, warmup, dev)
    queue.put(result)


class _Busy:
    """The GPU's utilisation while the learners trained, from NVML: the percent of time one
    or more kernels ran, over NVML's own sample period (1/6 to 1 s).

    Where nvidia-ml-py is installed, the driver's own samples, each with its time stamp
    (`nvmlDeviceGetSamples`, read every 0.25 s), are kept; else (or if the driver has none)
    the latest figure is read every 50 ms (torch.cuda.utilization, or nvidia-smi without
    nvidia-ml-py). Only the samples taken while every learner ran its timed steps count
    (`fraction`): the processes' start (spawn, imports, CUDA's set-up) takes seconds of an
    idle GPU, longer than the timed steps, and counted it read 0% of a GPU that trains."""

    def __init__(self, device: torch.device):
        self.device, self.samples, self.driver_samples, self.source = device, [], [], None
        self._nvml = None  # (pynvml, handle) where the driver's samples can be read
        self._nvml_inits = None  # pynvml, once its nvmlInit succeeded (to be shut down)
        self._last_seen = 0  # the driver's time stamp (microseconds) of the newest sample kept
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open_nvml(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml_inits = pynvml
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(self.device))
            self._nvml = (pynvml, handle)
        except Exception as err:  # no nvidia-ml-py, or no NVML: the polled figure only
            log.info("gpu busy: NVML's samples are not readable (%s: %s)", type(err).__name__, err)

    def _read_driver_samples(self) -> None:
        pynvml, handle = self._nvml
        try:
            kind, samples = pynvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, self._last_seen)
        except pynvml.NVMLError as err:  # NOT_FOUND: no new sample since the last read
            if not isinstance(err, pynvml.NVMLError_NotFound):
                log.info("gpu busy: nvmlDeviceGetSamples failed (%s); polling instead", err)
                self._nvml = None
            return
        for sample in samples:
            if sample.timeStamp > self._last_seen:
                self._last_seen = sample.timeStamp
                value = sample.sampleValue.uiVal if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT else None
                if value is not None:
                    self.driver_samples.append((sample.timeStamp / 1e6, value / 100))

    def _read(self) -> float | None:
        if self.source in (None, "torch"):
            try:
                value = torch.cuda.utilization(self.device)
                self.source = "torch"
                return value / 100
            except Exception:  # no pynvml: ask nvidia-smi instead
                self.source = "nvidia-smi"
        if shutil.which("nvidia-smi") is None:
            self.source = "none"
            return None
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                              "-i", str(self._nvml_index())], capture_output=True, text=True, timeout=5)
        return float(out.stdout.strip()) / 100 if out.returncode == 0 and out.stdout.strip() else None

    def _nvml_index(self) -> int:
        """The device's index as NVML and nvidia-smi number the GPUs, whatever CUDA_VISIBLE_DEVICES
        hides from torch (torch's own index where torch cannot tell: UUIDs there, without NVML)."""
        try:
            return torch.cuda._get_nvml_device_index(self.device)
        except Exception:
            return self.device.index or 0

    def _run(self) -> None:
        self._open_nvml()
        ticks = 0
        while not self._stop.wait(0.05):
            if self._nvml is not None and ticks % 5 == 0:
                self._read_driver_samples()
            ticks += 1
            if self.source != "none":
                value = self._read()
                if value is not None:
                    self.samples.append((time.time(), value))
        if self._nvml is not None:
            self._read_driver_samples()
        if self._nvml_inits is not None:
            self._nvml_inits.nvmlShutdown()  # NVML counts its inits: this run's must end with it

    def __enter__(self):
        if self.device.type == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def fraction(self, windows: list[tuple[float, float]]) -> tuple[float, str] | None:
        """The mean utilisation of the samples taken while every learner ran its timed steps
        (the windows' overlap; their span where they do not overlap), and where they came from;
        None without a sample in it (NVML's own period is 1/6 to 1 s: a shorter run has no
        true figure). The driver's time-stamped samples are preferred to the polled ones."""
        start, end = max(w[0] for w in windows), min(w[1] for w in windows)
        if start >= end:
            start, end = min(w[0] for w in windows), max(w[1] for w in windows)
        for samples, source in ((self.driver_samples, "NVML samples"), (self.samples, f"{self.source}, polled")):
            inside = [value for at, value in samples if start <= at <= end]
            if inside:
                return sum(inside) / len(inside), source
        return None


class Mps:
    """A CUDA MPS control daemon of the bench's own (`gadei bench gpu --mps`), for the
    processes started while it is entered: their kernels share the GPU in one MPS server's
    context instead of time-slicing between a context per process. It runs in pipe and log
    folders of its own (CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY, set in this
    process's environment, which spawned learners inherit) and is told to quit on exit."""

    def __init__(self):
        self.control = shutil.which("nvidia-cuda-mps-control")
        if self.control is None:
            raise DeviceError("gadei bench gpu --mps: nvidia-cuda-mps-control is not on PATH (it comes with the "
                              "NVIDIA driver's utilities)")
        self.folder, self.env, self._environ = "", {}, None

    def _control(self, *args: str, text: str | None = None) -> None:
        # its output goes to a file, not a pipe: the daemon `-d` forks may hold a pipe open
        with tempfile.TemporaryFile("w+") as out:
            done = subprocess.run([self.control, *args], input=text, stdout=out, stderr=subprocess.STDOUT, text=True,
                                  timeout=60, env={**os.environ, **self.env})
            out.seek(0)
            said = out.read().strip()
        if done.returncode != 0:
            raise DeviceError(f"nvidia-cuda-mps-control {' '.join(args) or text.strip()} "
                              f"{how_it_ended(done.returncode)}: {said}")

    def __enter__(self) -> "Mps":
        self.folder = tempfile.mkdtemp(prefix="gadei-mps-")
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.folder, "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.folder, "log")}
        for folder in self.env.values():
            os.makedirs(folder)
        try:
            self._control("-d")
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self._environ = environ(self.env)
        self._environ.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._environ.__exit__(None, None, None)
        try:
            self._control(text="quit\n")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def bench_share(args, device: torch.device, mps: Mps | None = None) -> dict:
    steps, warmup = (20, 5) if args.quick else (300, 30)
    counts = (1, 2) if args.quick else SHARE_LEARNERS
    data = batches("textcnn", SHARE_BATCH, steps + warmup, device)
    plain = median([SHARE_BATCH / plain_steps(build("textcnn").to(device), data, warmup, device)
                     for _ in range(args.repeats)])
    rows = [_share_row(learners, device, steps, warmup, args.repeats, plain) for learners in counts]
    if mps is not None:
        with mps:
            rows += [{**_share_row(learners, device, steps, warmup, args.repeats, plain), "mps": True}
                     for learners in counts]
    print(f"\ngpu share: text CNN, mini-batch {SHARE_BATCH}, learners on {device} "
          f"(plain loop: {plain:,.0f} samples/s); median of {args.repeats}")
    print(table(("learners", "MPS", "samples/s", "x plain", "x 1 learner", "ring full ms", "GPU busy", "busy from"),
                 [(r["learners"], "yes" if r.get("mps") else "no", f"{r['samples_per_s']:,.0f}", f"{r['vs_plain']:.2f}",
                   f"{r['samples_per_s'] / rows[0]['samples_per_s']:.2f}", f"{r['space_wait_ms']:.3f}",
                   "n/a" if r["gpu_busy"] is None else f"{r['gpu_busy']:.0%}", r["gpu_busy_source"] or "-")
                  for r in rows]))
    print("(x 1 learner: against one learner without MPS; ring full: the push threads' waits for a free slot per "
          "step, the median learner's)")
    return {"plain_samples_per_s": plain, "rows": rows, "batch": SHARE_BATCH}


def _share_row(learners: int, device: torch.device, steps: int, warmup: int, repeats: int, plain: float) -> dict:
    """`learners` learner processes training side by side on `device`, `repeats` times."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    rates, busy, waits = [], [], []
    for _ in range(repeats):
        with _Job("textcnn", learners) as job:
            barrier, queue = ctx.Barrier(learners), ctx.Queue()
            procs = [ctx.Process(target=_share_worker, args=(job, str(device), steps, warmup, barrier, queue))
                     for _ in range(learners)]
            for p in procs:
                p.start()
            with _Busy(device) as sampler:
                results = [queue.get(timeout=1800) for _ in procs]
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
                    p.join()
        # each learner's own rate, added: they ran side by side
        rates.append(sum(SHARE_BATCH / r["step_seconds"] for r in results))
        busy.append(sampler.fraction([r["window"] for r in results]))
        waits.append(median([r["space_wait_seconds"] / steps for r in results]))
    busy = [b for b in busy if b is not None]
    return {"learners": learners, "samples_per_s": median(rates), "vs_plain": median(rates) / plain,
            "space_wait_ms": median(waits) * 1e3,
            "gpu_busy": median([value for value, _ in busy]) if busy else None,
            "gpu_busy_source": ", ".join(sorted({source for _, source in busy})) or None}


def copy_bandwidth(nbytes: int, to_device: bool, device: torch.device, repeats: int) -> float:
    """Bytes/s of one pinned host -> `device` (or back) copy of `nbytes`, timed as the
    transports time theirs (device.CopyTimer): the ceiling they can reach at that size."""
    from ..device import CopyTimer

    pin = device.type == "cuda"
    host = torch.empty(max(1, int(nbytes) // 4), dtype=torch.float32, pin_memory=pin)
    dev = torch.empty(host.numel(), dtype=torch.float32, device=device)
    dst, src = (dev, host) if to_device else (host, dev)
    stream = torch.cuda.current_stream(device) if pin else None
    times = []
    for _ in range(max(5, repeats)):
        _sync(device)
        timer = CopyTimer(stream)
        dst.copy_(src, non_blocking=pin)
        timer.stop()
        _sync(device)
        times.append(timer.seconds())
    return host.numel() * 4 / median(times)


def bench_copy(step: dict, device: torch.device, repeats: int) -> dict:
    rows = []
    for r in step["rows"]:
        d2h = copy_bandwidth(r["push_bytes_per_copy"], False, device, repeats)
        h2d = copy_bandwidth(r["pull_bytes_per_copy"], True, device, repeats)
        rows.append({"model": r["model"], "batch": r["batch"], "push_bytes_per_s": r["push_bytes_per_s"],
                     "pull_bytes_per_s": r["pull_bytes_per_s"], "moved_bytes_per_s": r["moved_bytes_per_s"],
                     "push_bytes_per_copy": r["push_bytes_per_copy"], "pull_bytes_per_copy": r["pull_bytes_per_copy"],
                     "device_to_host_bytes_per_s": d2h, "host_to_device_bytes_per_s": h2d,
                     "push_vs_d2h": r["push_bytes_per_s"] / d2h, "pull_vs_h2d": r["pull_bytes_per_s"] / h2d})
    print(f"\ngpu copy: GB/s of the push (device -> region) and pull (region -> device) copies while they ran, "
          f"against one pinned copy of the same bytes (one push's, one pull's) on {device}, all timed by the "
          f"device; 'moved' is bytes over the whole run")
    print(table(("model", "batch", "push MB", "push", "D2H pinned", "push/D2H", "pull", "H2D pinned", "pull/H2D",
                  "moved"),
                 [(r["model"], r["batch"], f"{r['push_bytes_per_copy'] / 1e6:.2f}",
                   f"{r['push_bytes_per_s'] / 1e9:.2f}", f"{r['device_to_host_bytes_per_s'] / 1e9:.2f}",
                   f"{r['push_vs_d2h']:.2f}",
                   f"{r['pull_bytes_per_s'] / 1e9:.2f}", f"{r['host_to_device_bytes_per_s'] / 1e9:.2f}",
                   f"{r['pull_vs_h2d']:.2f}", f"{r['moved_bytes_per_s'] / 1e9:.2f}") for r in rows]))
    return {"rows": rows}


def bench_gpu(args) -> dict:
    """The three GPU figures on `args.device` (default cuda:0)."""
    from ..device import resolve

    name = getattr(args, "device", None) or "cuda:0"
    try:
        device = resolve(name)
    except DeviceError as err:
        raise DeviceError(f"gadei bench gpu measures GPU learners: {err}. (`--device cpu` runs the harness on the "
                          "CPU as a smoke run; its figures say nothing about GPUs)") from None
    mps = None
    if getattr(args, "mps", False):
        if device.type != "cuda":
            raise DeviceError("gadei bench gpu --mps shares a GPU through CUDA MPS: it needs a CUDA device")
        mps = Mps()  # refused now, not after the step runs, where the machine has no MPS
    if device.type == "cpu":
        print("gadei bench gpu --device cpu: a smoke run of the harness on the CPU; the figures say nothing about GPUs")
        gpu = None
    else:
        props = torch.cuda.get_device_properties(device)
        gpu = {"name": props.name, "memory_bytes": props.total_memory, "cuda": torch.version.cuda,
               "count": torch.cuda.device_count()}
        print(f"gadei bench gpu: {props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}, "
              f"torch {torch.__version__}")
    step = bench_step(args, device)
    share = bench_share(args, device, mps)
    copy = bench_copy(step, device, args.repeats)
    out = {"device": str(device), "gpu": gpu, "step": step, "share": share, "copy": copy}
    path = plot_path(args, "gpu")
    if path:
        where = gpu["name"] if gpu else f"{device} (a smoke run: the figures say nothing about GPUs)"
        out["plot"] = save(figure(out), path, f"gadei bench gpu on {where}, median of {args.repeats}")
    return out


def figure(result: dict):
    """The three figures side by side: ms per step of gadei and the plain loop for each model
    and batch; samples/s against learners sharing the GPU (the plain loop as a line, the GPU's
    busy fraction on a second axis where it was read); the push and pull copies' GB/s beside
    pinned copies'."""
    import numpy as np

    fig, (step, share, copy) = pyplot().subplots(1, 3, figsize=(13, 3.8))
    rows = result["step"]["rows"]
    cases, x = [f"{r['model']}\nbatch {r['batch']}" for r in rows], np.arange(len(rows))
    step.bar(x - 0.2, [r["plain_step_ms"] for r in rows], 0.4, label="plain PyTorch", color="tab:grey")
    step.bar(x + 0.2, [r["gadei_step_ms"] for r in rows], 0.4, label="gadei learner + server", color="tab:blue")
    step.set_xticks(x, cases, fontsize=7)
    step.set_ylabel("ms per step")
    step.set_title("step time (lower is better)", fontsize=9)
    step.legend(fontsize=7)
    shared = result["share"]
    plain_rows = [r for r in shared["rows"] if not r.get("mps")]
    mps_rows = [r for r in shared["rows"] if r.get("mps")]
    learners = [r["learners"] for r in plain_rows]
    share.plot(learners, [r["samples_per_s"] for r in plain_rows], "o-", color="tab:blue", label="gadei learners")
    if mps_rows:
        share.plot([r["learners"] for r in mps_rows], [r["samples_per_s"] for r in mps_rows], "s--", color="tab:purple",
                   label="gadei learners, CUDA MPS")
    share.axhline(shared["plain_samples_per_s"], color="grey", linestyle=":", label="plain PyTorch, 1 process")
    share.set_xticks(learners)
    share.set_xlabel("learners on one GPU")
    share.set_ylabel("samples/s")
    share.set_ylim(bottom=0)
    share.set_title(f"sharing the GPU (text CNN, batch {shared['batch']})", fontsize=9)
    share.legend(fontsize=7, loc="lower right")
    busy = [(n, r["gpu_busy"]) for n, r in zip(learners, plain_rows) if r["gpu_busy"] is not None]
    if busy:
        twin = share.twinx()
        twin.bar([n for n, _ in busy], [100 * b for _, b in busy], width=0.3, alpha=0.2, color="tab:blue")
        twin.set_ylim(0, 100)
        twin.set_ylabel("GPU busy %", fontsize=8)
    rows = result["copy"]["rows"]
    x = np.arange(len(rows))
    for offset, key, label, colour in ((-0.3, "push_bytes_per_s", "push (device -> region)", "tab:blue"),
                                       (-0.1, "device_to_host_bytes_per_s", "pinned D2H", "lightsteelblue"),
                                       (0.1, "pull_bytes_per_s", "pull (region -> device)", "tab:green"),
                                       (0.3, "host_to_device_bytes_per_s", "pinned H2D", "palegreen")):
        copy.bar(x + offset, [r[key] / 1e9 for r in rows], 0.2, label=label, color=colour)
    copy.set_xticks(x, [f"{r['model']}\nbatch {r['batch']}" for r in rows], fontsize=7)
    copy.set_ylabel("GB/s")
    copy.set_title("copies against pinned copies", fontsize=9)
    copy.legend(fontsize=7)
    return fig
