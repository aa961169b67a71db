"""The MPI bridge with real processes: nodes simulated on one machine, each a job with its
own region, joined by bridge ranks that mpiexec starts (rank r attaches to job JOB-r).

- The wire: bucketed and float16 sums and swaps match the float32 sum (within float16's
  rounding), and every rank gets the same sum.
- The contract, for each strategy (and average against consistent- and elastic-mode jobs,
  and with three nodes, buckets and float16): with nothing training, every node ends with
  the mean of the nodes' initial weights (average: the same model on every node; also under
  adagrad and momentum, since moves land outside the update rule), the
  local server applied every move the bridge published exactly once, and the bridges end
  cleanly when the jobs stop.
- A move still in the ring when its job stops is applied by the stopping server and counted.
- A killed rank does not hang the others: average ends on every other rank within the
  timeout, with a checkpoint, while the jobs keep serving; gossip goes on without it.
- gossip with one rank slowed 10x (stopped 90 % of the time) keeps the others' exchange rate.
- Jobs the bridge cannot move (sync mode, float16/bfloat16 rings) are refused.
(test_bridge_jobfile.py runs whole bridged jobs from job files, and the slow test that
each strategy trains the text CNN on TREC as well as one node doing the same total work.)

Skipped, with the reason, where mpi4py is missing or mpiexec cannot start two ranks.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import gadei
from helpers import EXEC, finish, json_lines, read_line, tiered, wait_for
from gadei._proc import gadei_command
from gadei.bridge import STRATEGIES, STRATEGY_NAMES, BridgeError, LocalNode, local_mpiexec
from gadei.layout import SERVING
from gadei.region import Region, inspect, remove

HERE = Path(__file__).resolve().parent
WORKER = HERE / "bridge_worker.py"
N = 100_003  # parameters of each node's model (0.4 MB: several 0.05 MB buckets)


class Ranks:
    """One mpiexec of bridge ranks and the JSON lines they printed."""

    def __init__(self, procs, env: dict, nodes: int, job: str, options, more: tuple = ()):
        argv, _ = local_mpiexec(nodes, *gadei_command("bridge", job), "--job-per-rank", "--json",
                                *map(str, options))
        if more:  # ranks after the bridge's, running another program (mpiexec's ':')
            argv += [":", "-n", "1", *map(str, more)]
        self.nodes = nodes
        self.proc = procs.start("-c", EXEC, *argv, env=env)
        self.events: list[dict] = []

    def _pump(self) -> None:
        while not self.proc.lines.empty():
            self.events += json_lines(self.proc.lines.get())

    def of(self, kind: str, rank: int | None = None) -> list[dict]:
        self._pump()
        return [e for e in self.events if e.get("event") == kind and (rank is None or e["rank"] == rank)]

    def wait(self, predicate, timeout: float, what: str):
        def look():
            if self.proc.poll() is not None:
                self._pump()
                if not predicate():
                    pytest.fail(f"mpiexec ended (rc {self.proc.returncode}) before {what}:\n"
                                f"{''.join(self.proc.err_lines)[-3000:]}")
            return predicate()
        try:
            return wait_for(look, timeout, what, interval=0.05)
        except pytest.fail.Exception as failed:
            pytest.fail(f"{failed}; the ranks printed:\n{''.join(self.proc.err_lines)[-3000:]}")

    def ready(self) -> dict[int, dict]:
        self.wait(lambda: len(self.of("ready")) == self.nodes, 120, "every bridge rank to be ready")
        return {e["rank"]: e for e in self.of("ready")}

    def ended(self) -> dict[int, dict]:
        return {e["rank"]: e for e in self.of("ended")}

    def finish(self, timeout: float) -> dict[int, dict]:
        """Wait for mpiexec to exit; the ranks' `ended` lines."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"mpiexec did not exit within {timeout} s:\n{''.join(self.proc.err_lines)[-3000:]}")
        for reader in self.proc.readers:
            reader.join(10)
        return self.ended()

    def log(self) -> str:
        return "".join(self.proc.err_lines)

    def reap(self) -> None:
        """End mpiexec (SIGTERM: it ends its ranks) and any rank left behind."""
        pids = [e["pid"] for e in self.of("ready")]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        for pid in pids:
            try:
                rank = psutil.Process(pid)
                if "bridge" in " ".join(rank.cmdline()):
                    rank.kill()
                    rank.wait(10)
            except (psutil.NoSuchProcess, psutil.TimeoutExpired):
                pass


@pytest.fixture
def bridges(procs, mpi_env, job):
    """Start bridge ranks: bridges(nodes, *options) -> Ranks for jobs JOB-0 .. JOB-(nodes-1)."""
    started: list[Ranks] = []

    def start(nodes: int, *options, more: tuple = ()) -> Ranks:
        ranks = Ranks(procs, mpi_env, nodes, job, options, more)
        started.append(ranks)
        return ranks

    yield start
    for ranks in started:
        ranks.reap()
    for r in range(4):
        if inspect(f"{job}-{r}") is not None:
            remove(f"{job}-{r}")


def _serve(procs, job: str, nodes: int, *options):
    """One process serving JOB-0 .. JOB-(nodes-1); job r's weights start as N(0, 1) draws of seed r."""
    server = procs.start(WORKER, "serve", *[f"{job}-{r}" for r in range(nodes)], "--n", N, *options)
    read_line(server, 120)
    return server


def _stop(server) -> list[int]:
    """Stop every job of a `_serve` process; the gradients each server applied."""
    server.send_signal(signal.SIGTERM)
    stopped = read_line(server, 60)["stopped"]
    finish(server)
    return stopped


def _initial(nodes: int) -> np.ndarray:
    return np.array([np.random.default_rng(r).standard_normal(N).astype(np.float32) for r in range(nodes)])


def _weights(job: str) -> np.ndarray:
    with Region.attach(job, readonly=True) as region:
        return np.array(region.weights, copy=True)


def _mpi_run(mpi_env, nodes: int, *command, timeout: float = 120) -> list[dict]:
    argv, _ = local_mpiexec(nodes, sys.executable, *map(str, command))
    done = subprocess.run(argv, env={**os.environ, **mpi_env}, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json_lines(done.stdout)


# ------------------------------------------------------------------ the wire


def test_bucketed_and_float16_sums_match_the_float32_sum(mpi_env):
    n = 300_001  # 1.2 MB: several auto buckets, 74 small ones, and a short last one
    results = _mpi_run(mpi_env, 3, WORKER, "wire", n)
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    largest = max(float(np.abs(np.random.default_rng(100 + r).standard_normal(n).astype(np.float32)).max())
                  for r in range(3))
    for result in results:
        errors = result["error"]
        for name in ("whole", "buckets", "small-buckets"):
            assert errors[name] <= 2e-6, result  # float32 rounding of a sum of three
        for name in ("float16", "buckets+float16"):
            assert errors[name] <= 3 * largest * 2**-11, result  # each addend rounded to float16
            assert errors[name] > 0, result  # it did travel as float16
        if "swap-whole" in errors:
            assert errors["swap-whole"] == errors["swap-buckets"] == errors["swap-small-buckets"] == 0
            assert 0 < errors["swap-float16"] <= largest * 2**-11
        assert result["bytes"]["float16"] < result["bytes"]["whole"]
    for name in results[0]["checksum"]:  # every rank holds the same sum, bit for bit
        assert len({r["checksum"][name] for r in results}) == 1, name


# ------------------------------------------------------------------ the contract of every strategy


@pytest.mark.parametrize(
    "strategy, mode, rule, nodes, options",
    tiered([
        ("average", "async", [], 2, ["--bucket-mb", "0"]),
        ("average", "consistent", ["--optimizer", "adagrad"], 3, ["--bucket-mb", "0.05", "--float16"]),
        ("average", "elastic", [], 2, []),
        ("elastic", "async", ["--momentum", "0.9"], 2, ["--bucket-mb", "0.05"]),
        ("gossip", "async", ["--optimizer", "adagrad"], 2, []),
    ], default=[  # each strategy once; a third node, float16 buckets and an elastic job: --long
        ("average", "async", [], 2, ["--bucket-mb", "0"]),
        ("elastic", "async", ["--momentum", "0.9"], 2, ["--bucket-mb", "0.05"]),
        ("gossip", "async", ["--optimizer", "adagrad"], 2, []),
    ]),
)
def test_every_strategy_brings_the_nodes_to_their_mean_through_the_ring(job, procs, bridges, strategy, mode, rule,
                                                                        nodes, options):
    """(The moves land as sent also where the job's rule is adagrad or momentum.)"""
    server = _serve(procs, job, nodes, "--mode", mode, *rule)
    ranks = bridges(nodes, "--strategy", strategy, "--every", 0.1, "--timeout", 20, *options)
    ranks.ready()
    ranks.wait(lambda: all(len(ranks.of("exchange", r)) >= 3 for r in range(nodes)), 120,
               "three exchanges on every rank")
    weights = np.array([_weights(f"{job}-{r}") for r in range(nodes)])
    mean = _initial(nodes).mean(axis=0)
    tolerance = 4.5 * 2**-11 if "--float16" in options else 1e-5
    assert np.abs(weights - mean).max() <= tolerance
    # the same model on every node, up to the rounding of w - (w - t) in the server's kernel
    assert np.abs(weights - weights[0]).max() <= 1e-6
    applied = _stop(server)
    ended = ranks.finish(60)
    assert sorted(ended) == list(range(nodes)), ranks.log()[-3000:]
    for r, end in ended.items():
        assert end["reason"].startswith(("the local job stopped", "the exchanges ended", "no peers left")), end
        assert end["lost"] == []
        assert applied[r] == end["published"] >= end["moves"] >= 3  # each move applied exactly once
    assert ranks.proc.returncode == 0


def _finish_job(job: str) -> None:
    """Stop `job` the way its supervisor does once every launched learner finished."""
    from gadei import _native
    from gadei.layout import STOPPING

    with Region.attach(job) as region:
        h = region.header
        h.set("finished", 1)
        h.cas("run_state", SERVING, STOPPING)
        _native.add32(h.addr("doorbell"), 1)
        _native.futex_wake(h.addr("doorbell"), 1)


def _pending(job: str) -> bool:
    """Whether some ring of `job` holds a published entry its server has not taken."""
    with Region.attach(job, readonly=True) as region:
        return any(region.entry(i).get("head") != region.entry(i).get("tail") for i in range(region.shape.capacity))


def test_a_move_the_job_stopped_under_counts_once_the_stopping_server_applied_it(job, procs, bridges):
    """The job stops while a move waits in the ring (the bridge's wait for it ends with "was
    stopped"): the stopping server still applies it, and the report counts it as a move."""
    server = _serve(procs, job, 2)
    ranks = bridges(2, "--strategy", "average", "--every", 0.1, "--timeout", 20)
    ranks.ready()
    ranks.wait(lambda: all(len(ranks.of("exchange", r)) >= 2 for r in range(2)), 120, "two exchanges on every rank")
    server.send_signal(signal.SIGSTOP)  # the servers take nothing from their rings
    try:
        wait_for(lambda: all(_pending(f"{job}-{r}") for r in range(2)), 30, "a move waiting in each ring")
        for r in range(2):
            _finish_job(f"{job}-{r}")
        ranks.wait(lambda: ranks.log().count("was stopped") >= 2, 30, "each bridge to see its job stopped")
    finally:
        server.send_signal(signal.SIGCONT)
    ended = ranks.finish(60)
    assert sorted(ended) == [0, 1], ranks.log()[-3000:]
    applied = _stop(server)
    for r, end in ended.items():
        assert end["reason"] == "every node finished" and end["lost"] == [], end
        assert applied[r] == end["published"] == end["moves"] >= 3, (applied, end)


@pytest.mark.parametrize("strategy", tiered(["average", "elastic", "gossip"], default=["average"]))
def test_nodes_that_finished_end_with_one_model_which_every_rank_saves(job, procs, bridges, strategy, tmp_path):
    """A node whose job finished keeps its part (average, elastic: the others go on exchanging
    with it) until every node finished; then every rank has the same model (average, gossip:
    the mean of the nodes; elastic: the centre, also their mean with nothing training) and
    --save writes it. The servers apply nothing after they stopped."""
    import torch

    server = _serve(procs, job, 2)
    ranks = bridges(2, "--strategy", strategy, "--every", 0.1, "--timeout", 20, "--save", tmp_path / "model-{rank}.pt")
    ranks.ready()
    ranks.wait(lambda: all(len(ranks.of("exchange", r)) >= 2 for r in range(2)), 120, "two exchanges on every rank")
    _finish_job(f"{job}-0")
    if strategy != "gossip":  # rank 1 keeps exchanging: rank 0 takes part with its final weights
        seen = len(ranks.of("exchange", 1))
        ranks.wait(lambda: len(ranks.of("exchange", 1)) >= seen + 3, 60, "exchanges after node 0 finished")
        assert not ranks.of("ended")
    _finish_job(f"{job}-1")
    ended = ranks.finish(60)
    assert sorted(ended) == [0, 1], ranks.log()[-3000:]
    for r, end in ended.items():
        assert end["reason"] == "every node finished" and end["lost"] == [], end
    assert ranks.proc.returncode == 0
    finals = [e for r in range(2) for e in ranks.of("exchange", r) if e["final"]]
    assert len(finals) == 2, finals
    models = [torch.load(tmp_path / f"model-{r}.pt", weights_only=True) for r in range(2)]
    weights = [np.concatenate([t.numpy().ravel() for t in m.values()]) for m in models]
    np.testing.assert_array_equal(weights[0], weights[1])
    assert np.abs(weights[0] - _initial(2).mean(axis=0)).max() <= 1e-5
    _stop(server)


# ------------------------------------------------------------------ the arithmetic, with nodes that train

LR = 0.01  # the training nodes' learning rate: each step moves a weight by LR times its N(0, 1) gradient


def _trace(folder: Path, nodes: int) -> list[list[dict]]:
    """Every rank's `--trace` records, in exchange order."""
    return [[dict(np.load(path)) for path in sorted((folder / f"rank-{r}").glob("*.npz"))] for r in range(nodes)]


def _train_and_trace(job, procs, bridges, tmp_path, strategy: str, nodes: int, *options) -> list[list[dict]]:
    """Nodes in consistent mode (whole updates in every copy) whose learner pushes its own
    fixed gradient every 2 ms, bridged every 0.2 s with --trace until every rank made 5
    exchanges while they trained; the trace and, per rank, the index of its first record
    copied while its node trained, after checking what holds for every strategy: the nodes did drift
    apart between exchanges, and each exchange's move reached the local weights as sent
    (a node's next copy is its target plus whole steps of its own gradient)."""
    server = _serve(procs, job, nodes, "--mode", "consistent", "--lr", LR)
    ranks = bridges(nodes, "--strategy", strategy, "--every", 0.2, "--timeout", 20, "--bucket-mb", 0.1,
                    "--trace", tmp_path / "trace", *options)
    ranks.ready()
    trainer = procs.start(WORKER, "train", *[f"{job}-{r}" for r in range(nodes)], "--n", N)
    read_line(trainer, 60)
    seen = [len(ranks.of("exchange", r)) for r in range(nodes)]
    ranks.wait(lambda: all(len(ranks.of("exchange", r)) >= seen[r] + 5 for r in range(nodes)), 120,
               "five exchanges on every rank under training")
    _stop(server)
    finish(trainer)
    ended = ranks.finish(60)
    assert sorted(ended) == list(range(nodes)) and all(e["lost"] == [] for e in ended.values()), ranks.log()[-3000:]
    trace = _trace(tmp_path / "trace", nodes)
    from bridge_worker import gradient

    steps = 0
    for r, records in enumerate(trace):
        g = gradient(r, N).astype(np.float64)
        for before, after in zip(records, records[1:]):
            drift = after["sent"].astype(np.float64) - before["target"]  # the learner's steps since the move
            k = -float(drift @ g) / (LR * float(g @ g))
            assert abs(k - round(k)) < 0.01 and round(k) >= 0, (r, k)
            # up to float32 rounding: half a unit in the last place per step, a few for the move
            assert np.abs(drift + LR * round(k) * g).max() <= (round(k) + 4) * _ulp(after["sent"]), (r, k)
            steps += round(k)
    assert steps >= 10 * nodes, f"the nodes hardly trained between exchanges ({steps} steps): the test proves nothing"
    return trace, [n + 1 for n in seen]


def _ulp(*vectors) -> float:
    """A unit in the last place of the largest float32 value in `vectors`."""
    return float(np.spacing(np.float32(max(np.abs(v).max() for v in vectors))))


def _apart(vectors) -> float:
    return float(np.abs(np.asarray(vectors) - vectors[0]).max())


def test_average_under_training_gives_every_node_the_mean_at_each_exchange(job, procs, bridges, tmp_path):
    nodes = 3
    trace, training = _train_and_trace(job, procs, bridges, tmp_path, "average", nodes)
    rounds = min(len(records) for records in trace)
    assert rounds >= max(training) + 3
    for n in range(rounds):
        sent = np.array([trace[r][n]["sent"] for r in range(nodes)], dtype=np.float64)
        targets = [trace[r][n]["target"] for r in range(nodes)]
        if n >= max(training):
            assert _apart(sent) > 0.05, n  # the nodes trained apart since the last exchange
        tolerance = 8 * _ulp(*sent)
        assert _apart(targets) <= tolerance, n  # every node moves to the same model
        assert np.abs(targets[0] - sent.mean(axis=0)).max() <= tolerance, n  # the mean of what they sent


@pytest.mark.long  # mpiexec runs of 10-20 s: average's are the default tier's
def test_elastic_under_training_moves_each_node_by_alpha_and_the_centre_by_the_sum(job, procs, bridges, tmp_path):
    """node i: w_i - alpha (w_i - c); centre: c + alpha sum_i (w_i - c), at the documented
    default alpha = 0.9 / nodes; the first exchange sets the centre to the mean."""
    nodes = 3
    alpha = 0.9 / nodes
    trace, training = _train_and_trace(job, procs, bridges, tmp_path, "elastic", nodes)
    rounds = min(len(records) for records in trace)
    assert rounds >= max(training) + 3
    centre = None
    for n in range(rounds):
        sent = np.array([trace[r][n]["sent"] for r in range(nodes)], dtype=np.float64)
        after = [trace[r][n]["centre"] for r in range(nodes)]
        tolerance = 8 * _ulp(*sent)
        assert _apart(after) <= tolerance, n  # every rank keeps the same centre
        if centre is None:
            expected = sent.mean(axis=0)
            assert np.abs(after[0] - expected).max() <= tolerance
            for r in range(nodes):
                assert np.abs(trace[r][n]["target"] - expected).max() <= tolerance
        else:
            if n >= max(training):
                assert _apart(sent) > 0.05, n
            assert np.abs(after[0] - (centre + alpha * (sent - centre).sum(axis=0))).max() <= tolerance, n
            for r in range(nodes):
                expected = sent[r] - alpha * (sent[r] - centre)
                assert np.abs(trace[r][n]["target"] - expected).max() <= tolerance, (n, r)
                if n >= max(training):
                    assert np.abs(trace[r][n]["target"] - sent[r]).max() > 1e-3  # it did move
        centre = after[0].astype(np.float64)


@pytest.mark.long  # mpiexec runs of 10-20 s: average's are the default tier's
def test_gossip_under_training_averages_exactly_one_active_passive_pair_per_exchange(job, procs, bridges, tmp_path):
    """Each exchange shows up on exactly two ranks, an asking (even) one and the passive (odd)
    one it asked, under the asker's request id, and both move to the mean of what the two
    sent; nobody else moves (each rank's next copy is its own target plus its own steps)."""
    nodes = 4
    trace, training = _train_and_trace(job, procs, bridges, tmp_path, "gossip", nodes)
    pairs: dict[tuple[int, int], dict[int, dict]] = {}
    for r, records in enumerate(trace):
        for n, record in enumerate(records):
            key = (int(record["asker"]), int(record["request"]))
            assert r not in pairs.setdefault(key, {}), key
            pairs[key][r] = record | {"trained": n >= training[r]}
    assert sum(all(record["trained"] for record in pair.values()) for pair in pairs.values()) >= 5
    for (asker, _), pair in pairs.items():
        assert len(pair) == 2 and asker in pair, pair.keys()  # the asker and one other rank
        passive = next(r for r in pair if r != asker)
        assert asker % 2 == 0 and passive % 2 == 1, (asker, passive)
        assert int(pair[asker]["peer"]) == passive and int(pair[passive]["peer"]) == asker
        assert bool(pair[asker]["active"]) and not bool(pair[passive]["active"])
        a, p = pair[asker]["sent"].astype(np.float64), pair[passive]["sent"].astype(np.float64)
        if pair[asker]["trained"] and pair[passive]["trained"]:
            assert np.abs(a - p).max() > 0.05  # the two had trained apart
        for r in (asker, passive):
            assert np.abs(pair[r]["target"] - (a + p) / 2).max() <= 2 * _ulp(a, p), (asker, passive, r)


# ------------------------------------------------------------------ failures


def test_a_killed_rank_ends_average_on_the_others_within_the_timeout(job, procs, bridges, tmp_path):
    timeout = 3.0
    server = _serve(procs, job, 3)
    ranks = bridges(3, "--strategy", "average", "--every", 0.1, "--timeout", timeout,
                    "--checkpoint-dir", tmp_path / "checkpoints-{rank}")
    ready = ranks.ready()
    ranks.wait(lambda: all(len(ranks.of("exchange", r)) >= 2 for r in range(3)), 120, "two exchanges on every rank")
    os.kill(ready[1]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    ranks.wait(lambda: {0, 2} <= set(ranks.ended()), timeout + 30, "the other ranks to end")
    assert time.monotonic() - killed <= timeout + 15  # the timeout, and the time to notice it on a busy machine
    ended = ranks.finish(30)
    for r in (0, 2):
        assert ended[r]["reason"] == "peer lost", ended[r]
        assert Path(ended[r]["checkpoint"]).parent == tmp_path / f"checkpoints-{r}"
        assert Path(ended[r]["checkpoint"]).exists()
    assert "goes on training on its own" in ranks.log()
    for r in range(3):  # every node's job is still served
        with Region.attach(f"{job}-{r}", readonly=True) as region:
            assert region.header.get("run_state") == SERVING and region.server_alive()
    _stop(server)


@pytest.mark.long  # mpiexec runs of 10-20 s: average's are the default tier's
def test_gossip_goes_on_without_a_killed_rank(job, procs, bridges):
    server = _serve(procs, job, 3)
    ranks = bridges(3, "--strategy", "gossip", "--every", 0.05, "--timeout", 5)
    ready = ranks.ready()
    ranks.wait(lambda: len(ranks.of("exchange", 2)) >= 2 and len(ranks.of("exchange", 0)) >= 2, 120,
               "both active ranks to exchange")
    os.kill(ready[2]["pid"], signal.SIGKILL)  # an active rank; 0 and the passive 1 go on
    before = len(ranks.of("exchange", 0))
    ranks.wait(lambda: len(ranks.of("exchange", 0)) >= before + 10, 60, "rank 0 to go on exchanging")
    _stop(server)
    ended = ranks.finish(60)
    for r in (0, 1):
        assert ended[r]["reason"] in ("the local job stopped", "no peers left"), ended[r]


@pytest.mark.long  # mpiexec runs of 10-20 s: average's are the default tier's
def test_a_passive_rank_held_up_by_one_asker_stays_the_others_peer(job, procs, bridges):
    """Rank 2 asks passive rank 1 by hand and holds each exchange half the timeout; rank 0
    (active, its only peer rank 1) is answered BUSY meanwhile and never takes rank 1 for
    lost. Then rank 2 dies right after an acknowledgement: rank 1 drops it after the
    timeout, and rank 0 exchanges with rank 1 again."""
    timeout = 3.0
    server = _serve(procs, job, 2)
    ranks = bridges(2, "--strategy", "gossip", "--every", 0.05, "--timeout", timeout, "--bucket-mb", 0.25,
                    more=(sys.executable, WORKER, "slow-asker", N, 0.25, timeout / 2))
    ranks.ready()
    ranks.wait(lambda: len(ranks.of("acked", 2)) >= 1, 60, "rank 1 to take the slow asker's request")
    ranks.wait(lambda: len(ranks.of("acked", 2)) >= 4, 4 * timeout + 30, "four held exchanges")
    acked = ranks.of("acked", 2)
    ranks.wait(lambda: len(ranks.of("acked", 2)) > len(acked), timeout + 30, "one more acknowledgement")
    last = ranks.of("acked", 2)[-1]
    os.kill(last["pid"], signal.SIGKILL)  # an asker that died after rank 1 acknowledged it
    ranks.wait(lambda: "stops pairing with rank 2" in ranks.log(), timeout + 30, "rank 1 to drop the dead asker")
    dropped = time.time()
    ranks.wait(lambda: any(e["t"] > dropped and e["peer"] == 1 for e in ranks.of("exchange", 0)), 30,
               "rank 0 to exchange with rank 1 again")
    assert "rank 0 stops pairing with rank 1" not in ranks.log()
    _stop(server)
    ended = ranks.finish(60)
    assert ended[0]["lost"] == [], ended[0]
    assert ended[1]["lost"] == [2], ended[1]


@pytest.mark.long  # mpiexec runs of 10-20 s: average's are the default tier's
@pytest.mark.alone  # the others' rates before and after: a test beside it would move them too
def test_gossip_with_a_rank_slowed_tenfold_keeps_the_others_exchange_rate(job, procs, bridges):
    """Ranks 0 and 2 ask, 1 and 3 answer. Rank 3 is then stopped 90 % of the time (SIGSTOP
    900 ms, SIGCONT 100 ms: a period much longer than the 0.1 s exchange pace, or a
    10 ms waking would still fit one exchange per 0.1 s): the askers pass it over for rank
    1, so no other rank's exchanges per second fall by more than 20 %."""
    nodes, window, pace = 4, 4.0, 0.1
    server = _serve(procs, job, nodes)
    ranks = bridges(nodes, "--strategy", "gossip", "--every", pace, "--timeout", 30)
    ready = ranks.ready()
    ranks.wait(lambda: all(len(ranks.of("exchange", r)) >= 5 for r in range(nodes)), 120,
               "five exchanges on every rank")

    def rates(start: float, end: float) -> list[float]:
        return [sum(start <= e["t"] < end for e in ranks.of("exchange", r)) / (end - start) for r in range(nodes)]

    calm_start = time.time()
    wait_for(lambda: time.time() >= calm_start + window, window + 5, "the unslowed window")
    calm_end = time.time()
    stop = threading.Event()

    def slow_down(pid: int) -> None:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            stop.wait(0.9)
            os.kill(pid, signal.SIGCONT)
            stop.wait(0.1)

    slower = threading.Thread(target=slow_down, args=(ready[3]["pid"],))
    slower.start()
    try:
        wait_for(lambda: time.time() >= calm_end + 1 + window, window + 6, "the slowed window")
    finally:
        stop.set()
        slower.join()
        os.kill(ready[3]["pid"], signal.SIGCONT)
    slow_start = calm_end + 1  # a second for the askers to learn who is slow
    wait_for(lambda: all(any(e["t"] >= slow_start + window for e in ranks.of("exchange", r)) for r in (0, 1, 2)),
             30, "the exchanges of the slowed window to be printed")
    calm, slowed = rates(calm_start, calm_end), rates(slow_start, slow_start + window)
    for r in (0, 1, 2):
        assert slowed[r] >= 0.8 * calm[r], (calm, slowed)
    assert slowed[3] < 0.5 * calm[3], f"rank 3 was not slowed, so the test proves nothing: {calm} {slowed}"
    _stop(server)
    ranks.finish(60)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"mode": "sync"}, "sync mode"),
        ({"grad_dtype": "float16"}, "float16 rings"),
        ({"grad_dtype": "bfloat16"}, "bfloat16 rings"),
    ],
)
def test_jobs_the_bridge_cannot_move_are_refused(job, options, message):
    from bridge_worker import Vector

    with gadei.Server(job, model=Vector(100, 0), learners=2, **options) as server:
        with pytest.raises(BridgeError, match=message):
            LocalNode(job, attach_timeout=5)
        assert all(server.region.entry(i).get("lease") == 0 for i in range(2))  # no ring left claimed


def test_the_option_names_are_the_strategies():
    assert tuple(STRATEGIES) == STRATEGY_NAMES
