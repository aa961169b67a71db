"""The benches' records of the processes they run: a short run of gadei and of Hogwild through
`gadei.bench.peers.run_peer` (real processes, real shared memory) reports every process, its
role, CPU seconds and OS threads, so that a run on any machine shows what each one cost; and
the pictures the benches draw beside their tables (`--plot`)."""

import json
import os

import pytest

from helpers import communicate, data_dir, missing, png_shape


@pytest.mark.parametrize("kind, roles", [("gadei", ["server", "learner", "learner"]),
                                         ("hogwild", ["process", "process"])])
def test_a_run_records_every_process_with_its_cpu_and_threads(kind, roles):
    if not (data_dir() / "trec" / "TREC.train").is_file():
        missing("TREC is not in the shared data")
    from gadei.bench.peers import run_peer

    run = run_peer(kind, 2, 4, epochs=1, seed=0, lr=0.01, data=f"trec:{data_dir() / 'trec'}", limit=40,
                   timeout=120)
    processes = run["processes"]
    assert [p["role"] for p in processes] == roles  # one record per process, a server first
    assert [p["rank"] for p in processes if p["role"] != "server"] == [0, 1]
    assert len({p["pid"] for p in processes}) == len(roles) and os.getpid() not in {p["pid"] for p in processes}
    for p in processes:
        assert p["threads"] >= 1, p
        assert p["cpu_s"] > 0, p
    # the run's CPU is the sum of its processes' (the figure CPU ms/sample is made of)
    assert run["cpu_s"] == pytest.approx(sum(p["cpu_s"] for p in processes))
    assert run["server_cpu_s"] == pytest.approx(sum(p["cpu_s"] for p in processes if p["role"] == "server"))


def _sleep_forever():
    import time

    while True:
        time.sleep(1)


def test_a_peer_process_killed_by_a_signal_is_named_with_who_sent_it():
    """A run whose process was killed says by which signal and, for SIGKILL, whether the
    kernel's out-of-memory killer sent it (what a model too large for the machine gets), not
    only "exited with code -9". Here a process sent it (`gadei._proc.how_it_ended`; the
    out-of-memory case is tests/test_spawn.py's)."""
    import multiprocessing
    import signal

    from gadei import _proc
    from gadei.bench.peers import PeerCrashed, _collect

    ctx = multiprocessing.get_context("spawn")
    queue, proc = ctx.Queue(), ctx.Process(target=_sleep_forever)
    started = _proc.oom_kills()
    proc.start()
    try:
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(PeerCrashed) as crashed:
            _collect(queue, [proc], 1, 60.0, "plain 1", started)
    finally:
        proc.kill()
        proc.join(30)
    assert str(crashed.value) == (f"bench plain 1: process {proc.pid} was killed by SIGKILL (signal 9), sent by a "
                                  "process (not the out-of-memory killer, which killed nothing since it started)")


def test_filters_too_large_for_the_machine_are_refused_before_any_run(procs, tmp_path):
    """`gadei bench threads --filters` with a model that cannot fit (5,000,000 filters a width:
    72 GB of weights) is refused in one line saying the model's size and the memory there is,
    exit 2, before a process is started (it was a worker killed by the kernel and a traceback)."""
    out = tmp_path / "bench.json"
    bench = procs.gadei("bench", "threads", "--quick", "--repeats", "1", "--filters", "100,5000000", "--out", out,
                        env={**os.environ, "GADEI_DATA_DIR": str(data_dir())})
    stdout, err = communicate(bench, 120)
    assert bench.returncode == 2, err
    assert err.startswith("gadei: error: --filters 5,000,000: the text CNN would have ") and err.count("\n") == 1, err
    assert "GB of float32 weights" in err and "GB available: use fewer filters" in err, err
    assert "samples/s" not in stdout and not out.exists()  # no run, no table, no figures


def test_a_filter_count_fits_up_to_the_memory_available():
    """The check itself: RUN_COPIES float32 copies of the parameters against the bytes
    available, the dense part smaller than the whole (the embedding table is not dense)."""
    from gadei.bench.threads import RUN_COPIES, check_fits, model_sizes

    data = f"trec:{data_dir() / 'trec'}" if (data_dir() / "trec" / "TREC.train").is_file() else "generated"
    sizes = model_sizes(data, [100, 400])
    (small, small_dense), (large, large_dense) = sizes[100], sizes[400]
    assert 0 < small_dense < small and 0 < large_dense < large
    assert large_dense == pytest.approx(4 * small_dense, rel=0.01)  # convolutions grow with the filters
    need = RUN_COPIES * 4 * large
    check_fits(sizes, need)  # exactly enough
    with pytest.raises(ValueError, match=r"^--filters 400: the text CNN would have [\d,]+ parameters"):
        check_fits(sizes, need - 1)


# The pictures the benchmarks draw beside their tables (`--plot`, gadei.bench.figure).

def test_plot_goes_beside_out_by_default_and_gets_each_benchmarks_name_when_several_draw():
    from argparse import Namespace

    from gadei.bench.figure import plot_path

    args = Namespace(what=["kernel", "gpu"], out="/r/gadei-bench.json", plot=None)
    assert plot_path(args, "gpu") == "/r/gadei-bench-gpu.png"
    assert (plot_path(Namespace(what=["scaling"], out="gadei-bench.json", plot=None), "scaling")
            == "gadei-bench-scaling.png")
    args.plot = "/p/gpu.png"  # one benchmark of the command draws: the path as given
    assert plot_path(args, "gpu") == "/p/gpu.png"
    args.what = ["peers", "scaling"]
    assert [plot_path(args, w) for w in args.what] == ["/p/gpu-peers.png", "/p/gpu-scaling.png"]
    args.plot = "none"
    assert plot_path(args, "peers") is None


def _titles(fig) -> list[str]:
    import matplotlib.pyplot as plt

    titles = [ax.get_title() for ax in fig.axes]
    plt.close(fig)
    return titles


def test_each_benchmarks_figure_has_a_panel_per_figure_of_its_tables():
    """The figures drawn from a benchmark's JSON (of the shape its --quick run saves): peers one
    panel per mini-batch with a bar per method, quality its accuracies and times, gpu its three
    figures (the real commands draw them in the long tests: gpu's below, peers' and quality's in
    test_cli.py's --quick runs)."""
    from gadei.bench import gpu, peers, quality

    runs = [("plain", 1), ("gadei", 2), ("rpc", 2)]
    methods = {f"{k}-{n}": {"samples_per_s": 100.0 * i + 50, "test_accuracy": 0.8} for i, (k, n) in enumerate(runs)}
    fig = peers.figure([{"batch": 4, "methods": methods}, {"batch": 32, "methods": methods}], runs)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["plain PyTorch 1 process", "gadei 2 learners",
                                                                     "RPC parameter server 1 + 2"]
    assert [round(b.get_width()) for b in fig.axes[0].patches] == [50, 150, 250]
    assert _titles(fig) == ["batch 4", "batch 32"]
    s = {"median": 0.9, "min": 0.88, "max": 0.91, "seconds_to_best": 10.0, "wall_seconds": 20.0}
    fig = quality.figure({"trec": {"gadei-1": s, "gadei-2": s, "pytorch": {**s, "seconds_to_best": None}}})
    assert len(fig.axes[0].patches) == 3 and fig.axes[0].get_ylabel().startswith("test accuracy")
    assert _titles(fig) == ["the model handed back", "to the chosen model (the whole run: light)"]
    step = {"model": "vgg", "batch": 2, "plain_step_ms": 2.0, "gadei_step_ms": 2.1}
    copy = {"model": "vgg", "batch": 2, "push_bytes_per_s": 1e9, "pull_bytes_per_s": 1e9,
            "device_to_host_bytes_per_s": 2e9, "host_to_device_bytes_per_s": 2e9}
    share = {"plain_samples_per_s": 900.0, "batch": 4,
             "rows": [{"learners": 1, "samples_per_s": 800.0, "gpu_busy": 0.5},
                      {"learners": 2, "samples_per_s": 1500.0, "gpu_busy": 0.9}]}
    fig = gpu.figure({"step": {"rows": [step]}, "share": share, "copy": {"rows": [copy]}})
    assert len(fig.axes) == 4  # the GPU's busy fraction on a second axis of the share panel
    assert _titles(fig)[:3] == ["step time (lower is better)", "sharing the GPU (text CNN, batch 4)",
                                "copies against pinned copies"]


def _bench(procs, tmp_path, *what: str, timeout: float = 900) -> dict:
    from helpers import finish

    out = tmp_path / "bench.json"
    finish(procs.gadei("bench", *what, "--quick", "--repeats", "1", "--out", out,
                       env={**os.environ, "GADEI_DATA_DIR": str(data_dir())}), timeout)
    return json.loads(out.read_text())


@pytest.mark.soak  # a bench's --quick run on the CPU: a minute and more (left out of CI for its time)
def test_bench_gpu_on_the_cpu_draws_its_figure_beside_out(procs, tmp_path):
    """`gadei bench gpu --device cpu --quick` (the harness's smoke run) draws its figure through
    the code a GPU run takes, to gadei-bench-gpu.png beside --out, and the JSON says where."""
    saved = _bench(procs, tmp_path, "gpu", "--device", "cpu", timeout=600)
    path = tmp_path / "gadei-bench-gpu.png"
    assert saved["gpu"]["plot"] == str(path)
    assert png_shape(path)[:2] == (380, 1300)  # three panels side by side
    # each push is set against a pinned copy of its own bytes: the text CNN's table travels as
    # its touched rows, so a push is smaller than the model, and a pull is the whole model
    steps = {r["model"]: r for r in saved["gpu"]["step"]["rows"]}
    copies = {r["model"]: r for r in saved["gpu"]["copy"]["rows"]}
    assert 0 < copies["textcnn"]["push_bytes_per_copy"] < steps["textcnn"]["params"] * 4
    assert copies["textcnn"]["pull_bytes_per_copy"] == steps["textcnn"]["params"] * 4
    assert copies["vgg"]["push_bytes_per_copy"] == steps["vgg"]["params"] * 4  # dense, float32
    assert all(r["push_vs_d2h"] > 0 and r["pull_vs_h2d"] > 0 for r in copies.values())
    assert all(r["train_wait_ms"] >= 0 and r["space_wait_ms"] >= 0 for r in steps.values())
