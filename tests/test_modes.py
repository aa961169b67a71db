"""Modes and transports with real processes: one contract for all, and what each mode promises.

- The contract: every mode with every gradient transport starts, trains a few hundred
  steps with two learners, stops cleanly, and its counters agree.
- sync with L learners of mini-batch B is single-process SGD with mini-batch L x B.
- elastic moves the centre and the learner as the two EASGD equations say.
- consistent pulls never hold half an update, where async ones do (so the check can fail).
- a staleness bound holds with one learner slowed down, where it is broken without one.
- momentum and the staleness-aware learning rate match their NumPy references.
- Adam: sync mode is single-process torch Adam (SparseAdam on the embedding); an async Adam
  job lowers the loss; its moments and step survive a checkpoint.
"""

import importlib
import signal

import numpy as np
import psutil
import pytest
import torch

import gadei
from helpers import communicate, finish, read_line, tiered, wait_for
from gadei.modes import RuleOptions
from gadei.region import Region, inspect
from gadei.transport.slot import dense_area
from oracles import async_reference
from worker import Flat, Tokens, token_data

N = 20_000
STEPS = 200


def _serve(procs, job, *args):
    server = procs.worker("serve", job, *args)
    read_line(server, 60)
    return server


def _learn(procs, job, *args):
    return _learners(procs, job, args)[0]


def _learners(procs, job, *argsets) -> list:
    """Push workers, one per entry of `argsets`, started together (each import of torch, a second
    of CPU, beside the others'), once each has attached; each worker's `learner_id` is its entry."""
    learners = [procs.worker("push", job, *args) for args in argsets]
    for learner in learners:
        read_line(learner, 60)  # attaching
        learner.learner_id = read_line(learner, 60)["attached"]
    return learners


def _stop(server):
    server.send_signal(signal.SIGTERM)
    report = read_line(server, 60)
    finish(server)
    return report


@pytest.mark.parametrize(
    "mode, options, transports",
    tiered([
        ("async", [], []),
        ("async", ["--grad-dtype", "bfloat16", "--row-sparse"], []),
        ("async", ["--grad-dtype", "float16", "--momentum", "0.9"], []),
        ("async", ["--stale-lr", "--row-sparse"], []),
        ("async", ["--stale-bound", "4", "--grad-dtype", "float16"], []),
        ("consistent", [], []),
        ("consistent", ["--grad-dtype", "bfloat16", "--row-sparse", "--momentum", "0.5"], []),
        ("sync", [], []),
        ("sync", ["--grad-dtype", "float16", "--row-sparse"], []),
        ("sync", ["--momentum", "0.9", "--grad-dtype", "bfloat16"], []),
        ("async", ["--optimizer", "adagrad", "--row-sparse", "--grad-dtype", "float16"], []),
        ("sync", ["--optimizer", "adagrad", "--grad-dtype", "bfloat16"], []),
        ("async", ["--optimizer", "adam", "--row-sparse", "--grad-dtype", "bfloat16"], []),
        ("consistent", ["--optimizer", "adam", "--grad-dtype", "float16"], []),
        ("sync", ["--optimizer", "adam", "--row-sparse", "--grad-dtype", "float16"], []),
        ("elastic", ["--tau", "4"], []),
        ("async", [], ["--push", "thread", "--pull", "copy"]),
        ("consistent", ["--grad-dtype", "float16", "--row-sparse"], ["--push", "thread", "--pull", "copy"]),
    ], default=[  # each mode once, and the thread push with the copy pull; every combination: --long
        ("async", [], []),
        ("consistent", ["--grad-dtype", "bfloat16", "--row-sparse", "--momentum", "0.5"], []),
        ("sync", ["--grad-dtype", "float16", "--row-sparse"], []),
        ("elastic", ["--tau", "4"], []),
        ("async", [], ["--push", "thread", "--pull", "copy"]),
    ]),
)
def test_every_mode_and_transport_trains_stops_and_counts(job, procs, mode, options, transports):
    # the learners start beside their server (each waits for its region): three imports of torch at once
    server = procs.worker("serve", job, "--model", "table", "--n", N, "--mode", mode, "--learners", 2, "--lr", "0.001",
                          *options)
    # both attached before either pushes: one learner alone would finish before the other came,
    # and nothing would be stale (each learner's gradients are on the weights of its last one)
    learners = _learners(procs, job, *(("--model", "table", "--n", N, "--value", v, "--steps", STEPS,
                                        "--wait-learners", 2, *transports) for v in (1, 2)))
    read_line(server, 60)  # ready
    results = [read_line(learner, 120) for learner in learners]
    for learner in learners:
        finish(learner)
    report = _stop(server)
    assert [r["pushed"] for r in results] == [STEPS, STEPS]
    assert report["heads"] == report["tails"]  # everything published was applied
    published = sum(report["heads"])
    if mode == "elastic":
        assert published == 2 * STEPS // 4  # one exchange every tau steps
    else:
        assert published == 2 * STEPS - sum(r["dropped"] for r in results)
    assert report["applied"] == published - sum(report["discarded"])  # discarded: later than a staleness bound
    if mode == "sync":
        assert published / 2 <= report["version"] <= published  # one version per round
    else:
        assert report["version"] == report["applied"]
    # every gradient element is positive and the weights start at 1: the updates lowered the
    # (linear) loss, so weights moved down and none moved up
    assert report["wmin"] < 1.0 and report["wmax"] <= 1.0
    if "--stale-lr" in options:
        _check_stale_lr(report, {r["learner"]: v for r, v in zip(results, (1, 2))}, lr=0.001)
    assert inspect(job) is None  # stopped cleanly: the region is gone


def _check_stale_lr(report, values, lr):
    """stale_lr applies a gradient of staleness s > 1 with lr / s, one of s <= 1 with lr: a dense
    element that every gradient of value V moves (`bias0`) ends 1 - sum(lr V / max(1, s)). The
    staleness histogram (bucket b: bit_length(s) == b) brackets s, so that sum within bounds;
    a rule that scaled lr the wrong way (or by the wrong sign, or not at all) lands outside them."""
    low = high = 0.0
    for learner, value in values.items():
        hist = report["stale_hist"][learner]
        low += lr * value * (hist[0] + hist[1] + sum(n / (2**b - 1) for b, n in enumerate(hist) if b >= 2))
        high += lr * value * (hist[0] + hist[1] + sum(n / 2 ** (b - 1) for b, n in enumerate(hist) if b >= 2))
    stale = [sum(h[2:]) for h in report["stale_hist"]]
    assert any(stale), f"no gradient was stale by more than 1, so the check proves nothing: {report['stale_hist']}"
    moved = 1.0 - report["bias0"]
    assert low - 1e-4 <= moved <= high + 1e-4, (moved, low, high, report["stale_hist"])


def _trained(procs, job, learners: int, batch: int, steps: int, *serve_args) -> dict:
    """A server of the tokens model (`serve_args`) and `learners` sync-train workers of `steps`
    mini-batches each, to their end; the server's stop report."""
    server = _serve(procs, job, "--model", "tokens", "--learners", learners, *serve_args)
    workers = [procs.worker("sync-train", job, "--rank", r, "--learners", learners, "--batch", batch,
                            "--steps", steps) for r in range(learners)]
    for worker in workers:
        read_line(worker, 60)
        assert read_line(worker, 120)["done"] == steps
        finish(worker)
    return _stop(server)


def _sync_training(procs, job, learners: int, batch: int, steps: int, *serve_args) -> None:
    """`_trained` in sync mode, row-sparse: every round held every learner's gradient."""
    report = _trained(procs, job, learners, batch, steps, "--mode", "sync", "--row-sparse", *serve_args)
    assert report["version"] == steps and report["applied"] == steps * learners  # every round held both


def test_sync_is_single_process_sgd_on_the_joint_mini_batch(job, procs, tmp_path):
    learners, batch, steps, lr = 2, 4, 30, 0.1
    dump = tmp_path / "weights.npy"
    _sync_training(procs, job, learners, batch, steps, "--lr", lr, "--dump", dump)

    model = Tokens()
    tokens, labels = token_data(steps * learners * batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        joint = slice(step * learners * batch, (step + 1) * learners * batch)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(tokens[joint]), labels[joint]).backward()
        optimizer.step()
    expected = torch.cat([p.detach().view(-1) for p in model.parameters()]).numpy()
    np.testing.assert_allclose(np.load(dump), expected, rtol=2e-5, atol=2e-6)


def _lazy_adam(weight: torch.nn.Parameter, m: torch.Tensor, v: torch.Tensor, step: int, lr: float) -> None:
    """torch.optim.Adam's maths (its functional form) on the rows a sparse gradient carries,
    as SparseAdam picks them (SparseAdam itself adds eps before v's bias correction)."""
    grad = weight.grad.coalesce()
    index, values = grad.indices()[0], grad.values()
    rows, m_rows, v_rows = weight.detach()[index].clone(), m[index].clone(), v[index].clone()
    importlib.import_module("torch.optim.adam").adam(
        [rows], [values], [m_rows], [v_rows], [], [torch.tensor(float(step - 1))], foreach=False, amsgrad=False,
        beta1=0.9, beta2=0.999, lr=lr, weight_decay=0.0, eps=1e-8, maximize=False)
    with torch.no_grad():
        weight[index], m[index], v[index] = rows, m_rows, v_rows


def test_sync_adam_is_single_process_adam_on_the_joint_mini_batch(job, procs, tmp_path):
    """The server's Adam (moments in the region, t = the round's version, lazy on the row-sparse
    embedding) against torch.optim.Adam in one process, lazily on the embedding's rows."""
    learners, batch, steps = 2, 4, 30
    dump = tmp_path / "weights.npy"
    _sync_training(procs, job, learners, batch, steps, "--lr", 0.01, "--optimizer", "adam", "--dump", dump)

    model = Tokens()
    start = torch.cat([p.detach().view(-1) for p in model.parameters()]).numpy().copy()
    tokens, labels = token_data(steps * learners * batch)
    table = model.embedding.weight
    dense = torch.optim.Adam([p for p in model.parameters() if p is not table], lr=0.01, foreach=False)
    m, v = torch.zeros_like(table), torch.zeros_like(table)
    for step in range(steps):
        joint = slice(step * learners * batch, (step + 1) * learners * batch)
        dense.zero_grad()
        table.grad = None
        torch.nn.functional.cross_entropy(model(tokens[joint]), labels[joint]).backward()
        dense.step()
        _lazy_adam(table, m, v, step + 1, 0.01)
    expected = torch.cat([p.detach().view(-1) for p in model.parameters()]).numpy()
    served = np.load(dump)
    np.testing.assert_allclose(served, expected, rtol=2e-5, atol=2e-6)
    assert np.abs(served - start).max() > 0.1  # 30 steps of lr 0.01 moved the weights
    rows = served[: 40 * 8].reshape(40, 8)
    used = torch.zeros(40, dtype=torch.bool)
    used[tokens.flatten()] = True
    np.testing.assert_array_equal(rows[~used.numpy()], start[: 40 * 8].reshape(40, 8)[~used.numpy()])  # lazy


def test_an_async_adam_job_lowers_the_loss(job, procs, tmp_path):
    """Two learners train Tokens through an async Adam server; the loss over the samples they
    saw falls as much as it does with torch's Adam in one process."""
    learners, batch, steps = 2, 4, 40
    dump = tmp_path / "weights.npy"
    report = _trained(procs, job, learners, batch, steps, "--lr", 0.03, "--optimizer", "adam", "--dump", dump)
    assert report["version"] == report["applied"] == steps * learners
    model = Tokens()
    tokens, labels = token_data(steps * learners * batch)
    with torch.no_grad():
        before = torch.nn.functional.cross_entropy(model(tokens), labels).item()
        offset = 0
        for p in model.parameters():
            p.copy_(torch.from_numpy(np.load(dump)[offset : offset + p.numel()]).view(p.shape))
            offset += p.numel()
        after = torch.nn.functional.cross_entropy(model(tokens), labels).item()
    # single-process torch Adam + SparseAdam, 80 steps of 4 at lr 0.03: 1.114 -> 0.905
    assert after < 0.9 * before, (before, after)


def test_sync_leaves_a_stalled_learner_out_and_takes_it_back(job, procs):
    """A learner stopped longer than drop_after is left out of the rounds, the other goes on
    alone, and once continued it rejoins; no round is corrupted: every round moves the weights
    by lr x the mean gradient (1.0), so they stay exactly 1 - lr x version."""
    server = _serve(procs, job, "--mode", "sync", "--learners", 2, "--drop-after", 1.0)
    learners = _learners(procs, job, *[("--steps", 10**9, "--wait-learners", 2)] * 2)
    with Region.attach(job, readonly=True) as region:
        version = lambda: region.header.get("version")  # noqa: E731
        stalled = region.entry(learners[1].learner_id).get
        wait_for(lambda: version() > 20, 60, "rounds with both learners")
        learners[1].send_signal(signal.SIGSTOP)
        alone_from = version()
        wait_for(lambda: version() > alone_from + 50, 60, "rounds without the stalled learner")
        learners[1].send_signal(signal.SIGCONT)
        head = stalled("head")
        wait_for(lambda: stalled("head") > head + 20, 60, "the continued learner to take part again")
    report = _stop(server)
    for learner in learners:
        finish(learner)
    assert report["heads"] == report["tails"] and report["applied"] == sum(report["heads"])
    assert report["wmin"] == report["wmax"] == 1.0 - 0.125 * report["version"]
    assert report["version"] < report["applied"]  # most rounds held both learners


def test_elastic_follows_the_two_easgd_equations(job, procs, tmp_path):
    lr, alpha, tau, steps, value = 0.125, 0.25, 3, 30, 1.0
    dump = tmp_path / "centre.npy"
    # one slot: a learner reads the centre only after its last exchange was applied (deterministic)
    server = _serve(procs, job, "--mode", "elastic", "--lr", lr, "--alpha", alpha, "--tau", tau, "--slots", 1,
                    "--init", 1.0, "--dump", dump)
    learner = _learn(procs, job, "--value", value, "--steps", steps)
    result = read_line(learner, 60)
    finish(learner)
    report = _stop(server)
    assert report["applied"] == steps // tau

    centre, local = np.float32(1.0), np.float32(1.0)  # every element moves alike
    for step in range(1, steps + 1):
        local = np.float32(local - np.float32(lr) * np.float32(value))  # local SGD
        if step % tau == 0:
            seen = centre
            centre = np.float32(centre + np.float32(alpha) * (local - centre))  # server: c += alpha (w - c)
            local = np.float32(local - np.float32(alpha) * (local - seen))  # learner: w -= alpha (w - c)
    np.testing.assert_allclose(np.load(dump), np.full(1000, centre, np.float32), rtol=1e-6)
    assert result["weight0"] == pytest.approx(float(local), rel=1e-6)


@pytest.mark.parametrize("mode", ["consistent", "async"])
def test_consistent_pulls_never_hold_half_an_update(job, procs, mode):
    n = 2_000_000  # an update takes about as long as a pull's copy
    server = _serve(procs, job, "--mode", mode, "--n", n, "--lr", 1.0, "--init", 0.0, "--learners", 2)
    pusher = _learn(procs, job, "--n", n, "--value", 1, "--steps", 10**9, "--delay", 0.003)
    # async: a loaded machine may apply few updates during 150 pulls, so pull on until one tore
    reader = procs.worker("read", job, "--n", n, "--pulls", 150, *(["--until-torn", 60] if mode == "async" else []))
    read_line(reader, 60)
    result = read_line(reader, 120)
    finish(reader)
    pusher.send_signal(signal.SIGKILL)
    _stop(server)
    assert result["distinct"] > 10  # the pulls did see the weights move
    if mode == "consistent":
        assert result["torn"] == 0, result
    else:
        assert result["torn"] > 0, f"async pulls never tore in this setting, so the check proves nothing: {result}"


def test_a_consistent_pull_does_not_wait_forever_on_a_server_that_died_mid_update(job, procs):
    server = _serve(procs, job, "--mode", "consistent", "--learners", 2)
    learner = _learn(procs, job, "--steps", 10**9)
    server.send_signal(signal.SIGSTOP)
    wait_for(lambda: psutil.Process(server.pid).status() == psutil.STATUS_STOPPED, 30, "the server to stop")
    with Region.attach(job) as region:
        # odd: the server is inside an update, and dies there (where SIGSTOP held it inside one
        # itself, the sequence is odd already: one more would close that update)
        if not region.header.get("seq") & 1:
            region.header.add("seq", 1)
        # and a version the pull thread has not copied yet, so that it does try to copy (without
        # one it may never look, and the learner meets the dead server elsewhere first)
        region.header.add("version", 1)
    server.send_signal(signal.SIGKILL)
    server.wait()
    _, err = communicate(learner, 60)  # it leaves (ServerGone) instead of waiting for the update to end
    assert "ServerGone" in err and "the server died during an update; copying the weights as they are" in err


@pytest.mark.parametrize("bound", tiered([4, 0], default=[4]))  # 0: the control run, --long
def test_a_staleness_bound_holds_with_one_learner_slowed(job, procs, bound):
    server = _serve(procs, job, "--learners", 3, "--stale-bound", bound, "--lr", "0.001")
    fast = [_learn(procs, job, "--steps", 10**9) for _ in range(2)]
    slow = _learn(procs, job, "--steps", 25, "--delay", 0.05)
    slow_result = read_line(slow, 120)
    finish(slow)
    for learner in fast:
        learner.send_signal(signal.SIGKILL)
        learner.wait()
    report = _stop(server)
    worst = max(report["stale_max"])
    if bound:
        assert worst <= bound, report
        assert slow_result["dropped"] > 0  # the slow learner's late gradients were not applied
        # what the server took late itself it counts as discarded: every slot it took is one or the other
        assert report["applied"] + sum(report["discarded"]) == sum(report["tails"]), report
    else:
        assert worst > 4, f"without a bound the slow learner was never late, so the bound proves nothing: {report}"


def _in_process_job(job, **options):
    server = gadei.Server(job, model=Flat(100, 1.0), learners=1, **options)
    learner = gadei.Learner(Flat(100, 0.0), job).attach()
    return server, learner


def _push(server, learner, value, computed_on):
    for p in learner.model.parameters():
        p.grad.fill_(value)
    learner._producer.publish(computed_on, 0, 1)
    learner._push.bind()
    server._update([server._take(0)])


def test_momentum_matches_its_reference(job):
    server, learner = _in_process_job(job, lr=0.5, momentum=0.9)
    try:
        grads = [np.full(100, v, np.float32) for v in (1.0, -2.0, 0.5, 3.0)]
        for g in grads:
            _push(server, learner, float(g[0]), server.version)
        w, v = np.ones(100, np.float32), np.zeros(100, np.float32)
        async_reference(w, grads, RuleOptions(lr=0.5, momentum=0.9), v)
        np.testing.assert_array_equal(server.weights(), w)
        np.testing.assert_array_equal(server.region.state, v)
    finally:
        learner.close()
        server.close()


def test_adagrad_matches_its_reference_and_its_sums_survive_a_checkpoint(job, tmp_path):
    server, learner = _in_process_job(job, lr=0.5, optimizer="adagrad")
    try:
        grads = [np.full(100, v, np.float32) for v in (1.0, -2.0, 0.5, 3.0)]
        for g in grads:
            _push(server, learner, float(g[0]), server.version)
        w, s = np.ones(100, np.float32), np.zeros(100, np.float32)
        async_reference(w, grads, RuleOptions(lr=0.5, optimizer="adagrad"), s)
        np.testing.assert_array_equal(server.weights(), w)
        np.testing.assert_array_equal(server.region.state, s)  # 1 + 4 + 0.25 + 9
        from gadei import checkpoint

        assert set(checkpoint.load(server.write_checkpoint(str(tmp_path))).optimizer) == {"adagrad_sums"}
    finally:
        learner.close()
        server.close()

    with gadei.Server(job, model=Flat(100, 1.0), learners=1,
                      rule_options=gadei.RuleOptions(lr=0.5, optimizer="adagrad"),
                      resume=checkpoint.latest(tmp_path)) as again:
        np.testing.assert_array_equal(again.region.state, s)
        np.testing.assert_array_equal(again.weights(), w)
        assert again.region.header.get("optimizer") == 1


def test_adam_matches_its_reference_and_goes_on_from_a_checkpoint(job, tmp_path):
    """Four gradients, a checkpoint, a new server resumed from it, three more: the weights and
    both moments are those of seven uninterrupted steps (t goes on from the version), and
    the checkpoint names the moments. A checkpoint without them is refused. Betas other than
    torch's defaults travel through the header (the sync test holds the defaults to torch)."""
    from gadei import checkpoint
    from gadei.modes import read_options

    grads = [np.full(100, v, np.float32) for v in (1.0, -2.0, 0.5, 3.0, 0.0, -1.0, 0.25)]
    rule = RuleOptions(lr=0.5, optimizer="adam", adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-3)
    w, state = np.ones(100, np.float32), np.zeros(200, np.float32)
    server, learner = _in_process_job(job, rule_options=rule)
    try:
        for g in grads[:4]:
            _push(server, learner, float(g[0]), server.version)
        async_reference(w, grads[:4], rule, state)
        np.testing.assert_array_equal(server.weights(), w)
        np.testing.assert_array_equal(server.region.state, state)  # m, then v
        saved = checkpoint.load(server.write_checkpoint(str(tmp_path)))
        assert set(saved.optimizer) == {"adam_m", "adam_v"} and saved.version == 4
        np.testing.assert_array_equal(saved.optimizer["adam_v"].numpy(), state[100:])
    finally:
        learner.close()
        server.close()

    server, learner = _in_process_job(job, rule_options=rule, resume=checkpoint.latest(tmp_path))
    try:
        assert server.region.header.get("optimizer") == 2 and server.version == 4
        assert read_options(server.region) == rule
        np.testing.assert_array_equal(server.region.state, state)
        for g in grads[4:]:
            _push(server, learner, float(g[0]), server.version)
        async_reference(w, grads[4:], rule, state, version=4)
        np.testing.assert_array_equal(server.weights(), w)
        np.testing.assert_array_equal(server.region.state, state)
    finally:
        learner.close()
        server.close()
    fresh_steps = np.ones(100, np.float32), np.zeros(200, np.float32)
    async_reference(fresh_steps[0], grads[4:], rule, fresh_steps[1])  # t from 1 again: a different model
    assert not np.array_equal(fresh_steps[0], w)

    other = tmp_path / "adagrad"
    with gadei.Server(job, model=Flat(100, 1.0), learners=1, lr=0.5, optimizer="adagrad") as server:
        server.write_checkpoint(str(other))
    with pytest.raises(checkpoint.CheckpointError, match="holds no Adam moments .* taken with optimizer 'adagrad'"):
        gadei.Server(job, model=Flat(100, 1.0), learners=1, rule_options=rule, resume=checkpoint.latest(other))
    assert inspect(job) is None  # nothing left behind


@pytest.mark.parametrize("mode, options", [
    ("async", {"optimizer": "adagrad"}),
    ("async", {"optimizer": "adam"}),
    ("async", {"momentum": 0.9}),
    ("consistent", {"stale_lr": True, "stale_bound": 2}),
    ("elastic", {}),
])
def test_a_move_slot_lands_as_sent_whatever_the_update_rule(job, mode, options):
    """A bridge's move (slot kind MOVE) is w -= payload: no lr, momentum, adagrad sums,
    staleness scaling or bound; gradients around it still go through the rule."""
    from gadei.layout import MOVE

    server, learner = _in_process_job(job, lr=0.5, mode=mode, **options)
    try:
        if mode != "elastic":
            _push(server, learner, 1.0, server.version)  # a gradient first, so the state is not zero
        state = np.array(server.region.state, copy=True) if server.region.state is not None else None
        before = server.weights().copy()
        move = np.linspace(-3.0, 3.0, 100, dtype=np.float32)
        producer = learner._producer
        slot = dense_area(server.region, producer.learner, producer.slot)
        slot[:] = move
        producer.publish(0, 0, 0, kind=MOVE)  # computed on version 0: stale beyond the bound
        version = server.version
        server._update([server._take(0)])
        assert server.version == version + 1
        np.testing.assert_array_equal(server.weights(), before - move)
        if state is not None:
            np.testing.assert_array_equal(server.region.state, state)  # momentum buffer / adagrad sums untouched
        assert not np.any(dense_area(server.region, producer.learner, producer.slot))  # the slot was cleared
        assert server.region.entry(0).get("discarded") == 0
    finally:
        learner.close()
        server.close()


def test_staleness_aware_learning_rate_divides_by_staleness(job):
    server, learner = _in_process_job(job, lr=1.0, stale_lr=True)
    try:
        staleness = []
        for computed_on in (0, 0, 0, 1):  # applied at versions 0, 1, 2, 3: staleness 0, 1, 2, 2
            staleness.append(server.version - computed_on)
            _push(server, learner, 1.0, computed_on)
        w = np.ones(100, np.float32)
        async_reference(w, [np.ones(100, np.float32)] * 4, RuleOptions(lr=1.0, stale_lr=True), staleness=staleness)
        np.testing.assert_array_equal(server.weights(), w)
        assert server.region.entry(0).get("stale_max") == 2
    finally:
        learner.close()
        server.close()


def test_options_a_mode_cannot_use_are_refused(job):
    for mode, options, message in [
        ("sync", {"stale_bound": 8}, "stale_bound applies to async and consistent modes, not sync"),
        ("async", {"tau": 8}, "tau applies to elastic mode, not async"),
        ("elastic", {"momentum": 0.9}, "momentum applies to async, consistent and sync"),
        ("elastic", {"grad_dtype": "float16"}, "elastic mode pushes whole float32 weights"),
        ("async", {"stale_bound": 2}, "stale_bound 2 is below the 8 learner rings"),
        ("async", {"momentum": 1.5}, "momentum = 1.5 is out of range; allowed: a number from 0, below 1"),
        ("async", {"optimizer": "rmsprop"},
         "optimizer = 'rmsprop' is not one of the choices; allowed: sgd, adagrad, adam"),
        ("async", {"optimizer": "adam", "momentum": 0.9}, "momentum applies to the sgd optimizer, not adam"),
        ("elastic", {"optimizer": "adam"}, "adam optimizer applies to async, consistent and sync"),
        ("async", {"adam_beta1": 0.5}, "adam_beta1 applies to the adam optimizer only; give optimizer = 'adam'"),
        ("sync", {"optimizer": "adagrad", "adam_eps": 1e-6}, "adam_eps applies to the adam optimizer only"),
        ("async", {"optimizer": "adam", "adam_beta2": 1.0}, "adam_beta2 = 1.0 is out of range; allowed: a number "
                                                             "from 0, below 1"),
        ("async", {"slots": 0}, "slots = 0 is out of range; allowed: 1 to 64"),
        ("async", {"optimizer": "adagrad", "momentum": 0.9}, "momentum applies to the sgd optimizer"),
        ("elastic", {"optimizer": "adagrad"}, "adagrad optimizer applies to async, consistent and sync"),
    ]:
        with pytest.raises(ValueError, match=message):
            gadei.Server(job, model=Flat(100), mode=mode, **options)
        assert inspect(job) is None  # nothing left behind
    with pytest.raises(ValueError, match="row_sparse needs an nn.Embedding"):
        gadei.Server(job, model=Flat(100), transport=gadei.TransportOptions(row_sparse=True))
    with gadei.Server(job, model=Flat(100), mode="consistent"):
        with pytest.raises(gadei.RegionMismatch, match="consistent mode: pull must be one of \\['copy'\\]"):
            gadei.Learner(Flat(100), job, pull="view").attach()


def test_row_sparse_is_chosen_where_the_embedding_gradients_are_sparse(job):
    """The server carries the text CNN's embedding (sparse gradients) as row-sparse by itself,
    so that a step reads the touched rows, not the whole table; not when told otherwise, not
    in elastic mode, not for a table with dense gradients."""
    import threading

    from gadei_workloads import build_textcnn
    from gadei_workloads.text import batches
    from gadei_workloads.topics import generate_topics

    def tables(**options):
        with gadei.Server(job, model=build_textcnn(2000, 3, **options.pop("model", {})), **options) as server:
            return server.region.shape.sparse

    assert [t.rows for t in tables()] == [2000]
    assert tables(row_sparse=False) == ()
    assert tables(mode="elastic") == ()
    assert tables(model={"sparse_grad": False}) == ()
    assert [t.rows for t in tables(model={"sparse_grad": False}, row_sparse=True)] == [2000]

    train, _ = generate_topics(seed=0, n_train=200, n_test=20)
    rows = max(2000, len(train.vocab))
    model = build_textcnn(rows, train.n_labels)
    dense_bytes = sum(p.numel() for p in model.parameters()) * 4
    with gadei.Server(job, model=build_textcnn(rows, train.n_labels)) as server:
        serving = threading.Thread(target=server.serve)
        serving.start()
        try:
            with gadei.Learner(model, job) as learner:
                for x, y in batches(train, 2, epoch=0, seed=0):
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    learner.step(samples=len(y))
        finally:
            server.request_stop()
            serving.join(30)
        h = server.region.header
        assert h.get("applied") == learner.steps == 100
        assert h.get("applied_bytes") / h.get("applied") < dense_bytes - rows * 128 * 4 / 2  # a few rows, not the table
        touched = torch.zeros(rows, dtype=torch.bool)
        for x, _ in batches(train, 2, epoch=0, seed=0):
            touched[x.flatten()] = True
        touched[0] = False  # the padding row: its gradient is zero
        moved = (server.state_dict()["embedding.weight"]
                 != build_textcnn(rows, train.n_labels).embedding.weight).any(dim=1)
        assert torch.equal(moved, touched)
