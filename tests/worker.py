"""Processes the tests start: a server of a known model, and learners that push known gradients.

    python tests/worker.py serve JOB --n N --lr LR [--learners L] [--slots S] [--init V]
    python tests/worker.py push JOB --value V --steps K [--pull copy|view] [--push publish|thread]
                                    [--slow] [--n N]

The model is `Flat(n)`: two parameters, (n - 7) weights and 7 biases, so the region holds
more than one tensor. A pushing learner writes the value V into every element of its
gradient (directly into `.grad`, which is the ring slot with push=publish) and publishes,
K times; with --slow it writes the slot in 64 chunks with a busy pause between them, so
that a SIGKILL lands mid-write. It prints one JSON line: {"learner", "pushed", "version"}.
"""

import argparse
import json
import os
import signal
import sys
import time

import torch

import gadei


class Flat(torch.nn.Module):
    def __init__(self, n: int, init: float = 1.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((n - 7,), init))
        self.bias = torch.nn.Parameter(torch.full((7,), init))

    def forward(self, x):
        return x * self.weight.sum() + self.bias.sum()


def make_model() -> Flat:
    """A model factory for `gadei serve --model worker:make_model`."""
    return Flat(1000, 2.0)


def serve(args) -> int:
    server = gadei.Server(args.job, model=Flat(args.n, args.init), lr=args.lr, learners=args.learners,
                          slots=args.slots, threads=args.threads)
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    print(json.dumps({"ready": os.getpid()}), flush=True)
    try:
        report = server.serve(grace=args.grace)
        weights = server.weights()
        region = server.region
        heads = [region.entry(i).get("head") for i in range(region.shape.capacity)]
        tails = [region.entry(i).get("tail") for i in range(region.shape.capacity)]
        print(json.dumps({"applied": report.applied, "version": report.version, "heads": heads, "tails": tails,
                          "wmin": float(weights.min()), "wmax": float(weights.max())}), flush=True)
    finally:
        server.close()
    return 0


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def push(args) -> int:
    model = Flat(args.n, 0.0)
    params = list(model.parameters())
    pushed = 0
    learner = gadei.Learner(model, args.job, pull=args.pull, push=args.push, timeout=30)
    print(json.dumps({"attaching": os.getpid()}), flush=True)
    with learner:  # a stopped job ends the block quietly
        print(json.dumps({"attached": learner.learner_id}), flush=True)
        for _ in range(args.steps):
            for p in params:
                if args.slow:
                    for chunk in p.grad.view(-1).chunk(64):
                        chunk.fill_(args.value)
                        _busy(0.0002)
                else:
                    p.grad.fill_(args.value)
            learner.step(samples=1)
            pushed += 1
    print(json.dumps({"learner": learner.learner_id, "pushed": pushed, "version": learner.version,
                      "weight0": model.weight[0].item()}), flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve")
    p.add_argument("job")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--lr", type=float, default=0.125)
    p.add_argument("--init", type=float, default=1.0)
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--grace", type=float, default=5.0)
    p.set_defaults(func=serve)
    p = sub.add_parser("push")
    p.add_argument("job")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--value", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--pull", default="copy")
    p.add_argument("--push", default="publish")
    p.add_argument("--slow", action="store_true")
    p.set_defaults(func=push)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
