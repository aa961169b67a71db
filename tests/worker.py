"""Processes the tests start: a server of a known model, and learners that push known gradients.

    python tests/worker.py serve JOB [--model flat|table] [--n N] [--lr LR] [--learners L]
                                     [--slots S] [--init V] [--mode M] [--grad-dtype D]
                                     [--row-sparse] [--momentum MU] [--dump FILE] ...
    python tests/worker.py push JOB --value V --steps K [--model flat|table] [--pull P]
                                    [--push P] [--slow] [--delay S] [--n N] [--device D]
                                    [--jitter SEED] [--max-jitter S] [--vary]
    python tests/worker.py two-waiters JOB [--trials T]

Models: `Flat(n)` has two parameters, (n - 7) weights and 7 biases; `Table(n)` has an
embedding table of 64 rows x 16 (1,024 weights) followed by n - 1,024 biases, so a job can
send the table's gradient as rows. A pushing learner writes the value V into every element
of each dense gradient and, for the table, into rows 0..7 with row 0 named twice (so the
server must add repeated rows), K times; with --slow it writes dense gradients in 64 chunks
with a busy pause between them (so that a SIGKILL lands mid-write), with --delay it sleeps
that long per step, with --jitter it sleeps a random 0 to --max-jitter seconds (half of the
times) in its train loop and at each injection point of the device transports' train, push
and pull threads (`gadei.device.set_injector`), --device puts the model there, and with
--vary step k's gradient is V * (1 + k % 3) (so a gradient overwritten by the next one is
seen in the sums). It prints JSON lines: {"attaching"}, {"attached"}, then {"learner",
"pushed", "dropped", "version", "weight0"}. The server prints {"ready"} and, when stopped,
its counters; with --dump it saves the final weights (NumPy .npy). `two-waiters` claims a
ring and, T times, fills it and blocks two threads on it (see `two_waiters`).
"""

import argparse
import json
import os
import random
import signal
import sys
import time

import threading

if sys.argv[1:2] == ["serve"]:  # as `gadei serve`: the kernel's OpenMP runtime loads passive, before torch's import
    from gadei.env import quiet_openmp

    quiet_openmp()

import numpy as np
import torch

import gadei
from gadei import checkpoint
from gadei.layout import ACTIVE

TABLE_ROWS, TABLE_WIDTH = 64, 16
TOUCHED = [0, 0, 1, 2, 3, 4, 5, 6, 7]  # rows a table gradient names (row 0 twice)


class Flat(torch.nn.Module):
    def __init__(self, n: int, init: float = 1.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((n - 7,), init))
        self.bias = torch.nn.Parameter(torch.full((7,), init))

    def forward(self, x):
        return x * self.weight.sum() + self.bias.sum()


class Table(torch.nn.Module):
    def __init__(self, n: int, init: float = 1.0):
        super().__init__()
        self.embedding = torch.nn.Embedding(TABLE_ROWS, TABLE_WIDTH, sparse=True)
        self.bias = torch.nn.Parameter(torch.full((n - TABLE_ROWS * TABLE_WIDTH,), init))
        with torch.no_grad():
            self.embedding.weight.fill_(init)


class Tokens(torch.nn.Module):
    """A small deterministic classifier with a sparse embedding (no dropout): sync-mode equivalence."""

    def __init__(self, n: int = 0, init: float = 0.0):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.embedding = torch.nn.Embedding(40, 8, sparse=True)
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, tokens):
        return self.out(torch.relu(self.hidden(self.embedding(tokens).mean(dim=1))))


def token_data(samples: int):
    """Fixed inputs and labels for Tokens."""
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 40, (samples, 6), generator=gen)
    labels = (tokens[:, 0] % 3).long()
    return tokens, labels


MODELS = {"flat": Flat, "table": Table, "tokens": Tokens}


def make_model() -> Flat:
    """A model factory for `gadei serve --model worker:make_model`."""
    return Flat(1000, 2.0)


def serve(args) -> int:
    server = gadei.Server(
        args.job, model=MODELS[args.model](args.n, args.init), mode=args.mode,
        rule_options=gadei.RuleOptions(lr=args.lr, momentum=args.momentum, optimizer=args.optimizer,
                                       stale_lr=args.stale_lr, stale_bound=args.stale_bound, drop_after=args.drop_after,
                                       **(dict(alpha=args.alpha, tau=args.tau) if args.mode == "elastic" else {})),
        transport=gadei.TransportOptions(grad_dtype=args.grad_dtype, row_sparse=args.row_sparse, slots=args.slots),
        learners=args.learners,
        threads=args.threads, resume=checkpoint.latest(args.resume) if args.resume else None, replace=args.replace,
    )
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    print(json.dumps({"ready": os.getpid()}), flush=True)
    try:
        report = server.serve(grace=args.grace)
        if args.checkpoint_dir:
            server.write_checkpoint(args.checkpoint_dir)
        weights = server.weights()
        if args.dump:
            np.save(args.dump, weights)
        region = server.region
        entries = [region.entry(i) for i in range(region.shape.capacity)]
        print(json.dumps({
            "applied": report.applied, "version": report.version,
            "heads": [e.get("head") for e in entries], "tails": [e.get("tail") for e in entries],
            "stale_max": [e.get("stale_max") for e in entries], "stale_hist": [e.get("stale_hist") for e in entries],
            "dropped": [e.get("dropped") for e in entries],
            "discarded": [e.get("discarded") for e in entries],
            "applied_bytes": region.header.get("applied_bytes"),
            "doorbell": region.header.get("doorbell"),
            "wmin": float(weights.min()), "wmax": float(weights.max()),
            "bias0": _bias0(server),
        }), flush=True)
    finally:
        server.close()
    return 0


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _bias0(server) -> float | None:
    """The first element of Flat's or Table's bias (dense: every gradient of value V moves each
    of its elements by lr V), or None (another model, or none recorded: no learner came)."""
    if server.region.read_spec() is None:
        return None
    bias = server.state_dict().get("bias")
    return None if bias is None else float(bias.view(-1)[0])


def _gradient(p: torch.nn.Parameter, value: float, slow: bool, table: bool) -> None:
    """Write the step's gradient of `p` (into the ring slot itself when .grad is one)."""
    if table:  # a sparse gradient naming rows 0..7, row 0 twice
        index = torch.tensor([TOUCHED], device=p.device)
        p.grad = torch.sparse_coo_tensor(index, torch.full((len(TOUCHED), TABLE_WIDTH), value, device=p.device),
                                         p.shape, check_invariants=True)
        return
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    if slow:
        for chunk in p.grad.view(-1).chunk(64):
            chunk.fill_(value)
            _busy(0.0002)
    else:
        p.grad.fill_(value)


def push(args) -> int:
    model = MODELS[args.model](args.n, 0.0)
    table_params = {id(model.embedding.weight)} if args.model == "table" else set()
    params = list(model.parameters())
    pushed = dropped = 0
    learner = gadei.Learner(model, args.job, pull=args.pull, push=args.push, device=args.device, timeout=30,
                            entry=args.entry)
    jitter = _jitter(args.jitter, args.max_jitter) if args.jitter is not None else None
    if jitter is not None:
        from gadei import device

        device.set_injector(jitter)
    print(json.dumps({"attaching": os.getpid()}), flush=True)
    with learner:  # a stopped job ends the block quietly
        print(json.dumps({"attached": learner.learner_id}), flush=True)
        _await_learners(learner, args.wait_learners)
        for step in range(args.steps):
            value = args.value * (1 + step % 3) if args.vary else args.value
            if args.delay:
                time.sleep(args.delay)
            if args.busy:
                _busy(args.busy)  # a gradient's computation: the learner keeps its core busy
            if jitter is not None:
                jitter("train")
            for p in params:
                _gradient(p, value, args.slow, id(p) in table_params)
            learner.step(samples=1)
            pushed += 1
            dropped = learner.entry.get("dropped")
    print(json.dumps({"learner": learner.learner_id, "pushed": pushed, "dropped": dropped,
                      "version": learner.version, "weight0": params[-1].view(-1)[0].item()}), flush=True)
    time.sleep(args.linger)  # gave its entry back, not exited yet (a launched learner in its shutdown)
    return 0


def _jitter(seed: int, most: float):
    """An injector: half of the calls sleep a random 0..`most` seconds (each thread its own draws)."""
    local = threading.local()

    def injector(point: str) -> None:
        rng = getattr(local, "rng", None)
        if rng is None:
            rng = local.rng = random.Random(f"{seed}-{threading.current_thread().name}")
        if rng.random() < 0.5:
            time.sleep(rng.random() * most)

    return injector


def _await_learners(learner, count: int, timeout: float = 60.0) -> None:
    """Start only when `count` learners are attached (sync rounds then hold all of them), or once
    training has begun: they were all attached then, as each waits here, and one may have done
    its steps and left before this one looked (an async job on a quick machine: 1 in 6 runs)."""
    deadline = time.monotonic() + timeout
    region = learner.region
    while sum(1 for i in range(region.shape.capacity) if region.entry(i).get("state") == ACTIVE) < count \
            and region.header.get("version") == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {count} learners attached after {timeout} s")
        time.sleep(0.01)


def read(args) -> int:
    """Pull the weights `pulls` times (pull=copy); count pulls that hold two different values.
    With `until_torn`, go on pulling after that until one pull tore or that many seconds passed."""
    model = MODELS[args.model](args.n, 0.0)
    torn = distinct = pulls = 0
    with gadei.Learner(model, args.job, pull="copy", timeout=30) as learner:
        print(json.dumps({"attached": learner.learner_id}), flush=True)
        deadline = time.monotonic() + args.until_torn
        last = None
        while pulls < args.pulls or (args.until_torn and not torn and time.monotonic() < deadline):
            pulls += 1
            learner.refresh()
            flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
            low, high = flat.min().item(), flat.max().item()
            torn += low != high
            distinct += low != last
            last = low
            time.sleep(args.delay)
        retries = learner.entry.get("pull_retries")
    print(json.dumps({"torn": int(torn), "distinct": int(distinct), "retries": retries, "pulls": pulls}), flush=True)
    return 0


def _asleep_on(thread: threading.Thread, addr: int, what: str, timeout: float = 10.0) -> None:
    """Return once `thread` sleeps in a futex wait on the word at `addr` (its syscall's first
    argument: not a wait for the GIL, and not merely about to sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/self/task/{thread.native_id}/syscall") as f:
            fields = f.read().split()
        if len(fields) > 1 and int(fields[1], 16) == addr:
            return
        if time.monotonic() > deadline or not thread.is_alive():
            raise TimeoutError(f"{what} did not sleep on the ring within {timeout} s")
        time.sleep(0.001)


def two_waiters(args) -> int:
    """The two threads of a learner with a push thread and a staleness bound, blocked on one
    ring at once: T times, fill the ring, let the train thread `drain` it and, once that one
    sleeps, the push thread `wait_space`; print {"ready"} once both sleep, then the
    time.monotonic() at which each wait returned, {"space"} and {"drained"}. The test is the
    server: it frees one slot, then the rest."""
    from gadei.region import Region
    from gadei.ring import claim

    region = Region.attach(args.job, wait=30)
    producer = claim(region, drain_timeout=30, server_alive=lambda: True)
    for trial in range(args.trials):
        while producer.has_space():
            producer.publish(0, trial, 1)
        returned = {}
        drain = threading.Thread(target=lambda: returned.update(
            drained=producer.drain(30, lambda: True) and time.monotonic()))
        space = threading.Thread(target=lambda: returned.update(
            space=producer.wait_space(lambda: None) or time.monotonic()))
        drain.start()
        tail = region.entry(producer.learner).addr("tail")
        _asleep_on(drain, tail, "drain")
        space.start()
        _asleep_on(space, tail, "wait_space")
        print(json.dumps({"ready": trial}), flush=True)
        for thread, what in ((space, "space"), (drain, "drained")):
            thread.join(30)
            print(json.dumps({what: returned[what]}), flush=True)
    producer.release()
    region.close()
    return 0


def sync_train(args) -> int:
    """Train Tokens on shard `rank` of every mini-batch of size learners x batch, for `steps` rounds."""
    model = Tokens()
    tokens, labels = token_data(args.steps * args.learners * args.batch)
    with gadei.Learner(model, args.job, timeout=30) as learner:
        print(json.dumps({"attached": learner.learner_id}), flush=True)
        _await_learners(learner, args.learners)
        for step in range(args.steps):
            start = (step * args.learners + args.rank) * args.batch
            x, y = tokens[start : start + args.batch], labels[start : start + args.batch]
            torch.nn.functional.cross_entropy(model(x), y).backward()
            learner.step(samples=len(y))
    print(json.dumps({"done": args.steps}), flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve")
    p.add_argument("job")
    p.add_argument("--model", choices=sorted(MODELS), default="flat")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--lr", type=float, default=0.125)
    p.add_argument("--init", type=float, default=1.0)
    p.add_argument("--mode", default="async")
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--stale-lr", action="store_true")
    p.add_argument("--stale-bound", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--tau", type=int, default=1)
    p.add_argument("--grad-dtype", default="float32")
    p.add_argument("--row-sparse", action="store_true")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--drop-after", type=float, default=10.0)
    p.add_argument("--dump")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--resume")
    p.add_argument("--replace", action="store_true")
    p.set_defaults(func=serve)
    p = sub.add_parser("push")
    p.add_argument("job")
    p.add_argument("--model", choices=sorted(MODELS), default="flat")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--value", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--pull", default=None)
    p.add_argument("--push", default=None)
    p.add_argument("--slow", action="store_true")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--busy", type=float, default=0.0)  # seconds of busy work before each step
    p.add_argument("--wait-learners", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--jitter", type=int, default=None)
    p.add_argument("--max-jitter", type=float, default=0.002)
    p.add_argument("--vary", action="store_true")
    p.add_argument("--entry", type=int, default=None)  # a launched learner's number (`gadei learn --entry`)
    p.add_argument("--linger", type=float, default=0.0)  # seconds to stay alive after leaving the job
    p.set_defaults(func=push)
    p = sub.add_parser("read")
    p.add_argument("job")
    p.add_argument("--model", choices=sorted(MODELS), default="flat")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--pulls", type=int, default=100)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--until-torn", type=float, default=0.0)
    p.set_defaults(func=read)
    p = sub.add_parser("sync-train")
    p.add_argument("job")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--learners", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.set_defaults(func=sync_train)
    p = sub.add_parser("two-waiters")
    p.add_argument("job")
    p.add_argument("--trials", type=int, default=5)
    p.set_defaults(func=two_waiters)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
