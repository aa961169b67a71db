"""The processes of `gadei bench peers` and `gadei bench scaling`: one training run of the text
CNN by gadei or by one of the ways a PyTorch user would train it instead, each written as its
own documentation shows it.

plain    one process, `torch.optim.SGD` (the PyTorch training loop).
hogwild  N processes sharing the model (`model.share_memory()`, torch.multiprocessing, each with
         its own SGD optimizer: PyTorch's mnist_hogwild example).
ddp      N processes, `DistributedDataParallel` over gloo, one SGD optimizer each (PyTorch's DDP
         tutorial); gradients are averaged, so each step is one update of N mini-batches.
rpc      1 parameter server + N trainers over `torch.distributed.rpc` (PyTorch's batch-updating
         parameter server, tutorial "Implementing Batch RPC Processing Using Asynchronous
         Executions"): each trainer sends its gradients and gets the new model back; the server
         sums N gradients, averages, steps its SGD optimizer and answers all N.
gadei    N learners (`gadei.Learner`, the default transports) and a server (`gadei.Server`
         with its defaults) in their own processes.

Every method takes the workload's gradient (`Workload.gradient`: the n-gram model's in closed
form, the others' by autograd; DDP's always by autograd, whose hooks carry its allreduce).
Every process uses one PyTorch thread (plain and gadei's learners: `threads`, for `gadei bench
threads`); every worker reports its wall-clock start and end, samples, its PyTorch threads,
and the CPU seconds of its process (all threads) over its training loop, so that the runner
can put CPU seconds per sample beside samples/s; and every process (each learner, process or
trainer, the gadei server, the RPC parameter server) its role, pid and OS thread count at the
end of its loop, while its OpenMP, torch and gloo threads still exist (`_me`). A run's test
accuracy is measured by the runner on the final weights.
"""

import math
import os
import time
import warnings

import torch

from .timing import process_threads


def _setup(threads: int = 1, workload: str = "textcnn"):
    torch.set_num_threads(threads)
    from gadei_workloads import get

    return get(workload)


def os_threads() -> int:
    """The OS threads this process has now (OpenMP's, torch's and gloo's included)."""
    return process_threads(os.getpid())


def _me(role: str, threads: int | None = None) -> dict:
    """What a process reports of itself beside its figures: its role ("learner", "process",
    "trainer", "server", "parameter server"), pid and OS threads (`threads`, else now)."""
    return {"role": role, "pid": os.getpid(), "threads": os_threads() if threads is None else threads}


def model_for(workload, train, seed: int, filters: int | None = None):
    """The run's model, the workload's (the same initial weights in every process for a seed);
    for the text CNN, with `filters` filters per convolution width (None: the workload's, 100)."""
    if filters is None:
        return workload.build_model(train, seed)
    from gadei_workloads.textcnn import build_textcnn

    return build_textcnn(len(train.vocab), train.n_labels, seed=seed, filters=filters)


def steps_in_lockstep(n: int, world: int, batch: int) -> int:
    """Mini-batches every one of `world` shards of `n` samples has (the synchronous peers'
    ranks must take the same number of steps, or the last allreduce / round waits forever)."""
    return min(math.ceil(len(range(r, n, world)) / batch) for r in range(world))


def _loop(workload, model, train, rank: int, world: int, batch: int, epochs: int, seed: int, lr: float,
          limit: int, step, before=None, lockstep: bool = False) -> tuple[float, float, int, float, int]:
    """Train over this rank's shard: `before()` ahead of each backward, `step(samples)` after it.
    Returns (start, end, samples, CPU seconds of this process, its OS threads at the end)."""
    batches = workload.batches
    steps = steps_in_lockstep(len(train), world, batch) if lockstep else None
    if limit:
        steps = min(steps or limit, max(1, limit // (world * batch)))
    cpu, start, samples = time.process_time(), time.time(), 0
    for epoch in range(epochs):
        for i, (x, y) in enumerate(batches(train, batch, epoch=epoch, seed=seed, shard=rank, shards=world)):
            if steps is not None and i >= steps:
                break
            if before is not None:
                before()
            workload.gradient(model, x, y, lr)
            step(len(y))
            samples += len(y)
    return start, time.time(), samples, time.process_time() - cpu, os_threads()


class _Front:
    """What the training loop calls as the model: `forward(x)`, and the text CNN's constraint
    on `target` (a module, or a function returning the current one)."""

    def __init__(self, forward, target):
        self.forward = forward
        self.target = target

    def __call__(self, x):
        return self.forward(x)

    def constrain_grads(self, lr: float) -> None:
        target = self.target() if callable(self.target) and not isinstance(self.target, torch.nn.Module) else \
            self.target
        target.constrain_grads(lr)


def numpy_state(model) -> dict:
    """The model's weights as NumPy copies (they travel through a queue by value)."""
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def local_worker(kind, rank, world, batch, epochs, seed, lr, data, limit, shared, barrier, queue, threads=1,
                 filters=None, workload="textcnn"):
    """plain (world 1) or hogwild (`shared` is the shared model), with `threads` PyTorch threads;
    the workload's model (its sparse embedding gradients applied sparsely by SGD)."""
    workload = _setup(threads, workload)
    train, _ = workload.load_data(data)
    model = shared if shared is not None else model_for(workload, train, seed, filters)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    barrier.wait()
    start, end, samples, cpu, running = _loop(workload, model, train, rank, world, batch, epochs, seed, lr, limit,
                                              lambda _: optimizer.step(), lambda: optimizer.zero_grad())
    queue.put({"rank": rank, "start": start, "end": end, "samples": samples, "cpu": cpu,
               "torch_threads": torch.get_num_threads(), **_me("process", running),
               "state": numpy_state(model) if kind == "plain" else None})


def gadei_learner(rank, world, batch, epochs, seed, lr, data, limit, job, barrier, queue, threads=1, filters=None,
                  workload="textcnn"):
    """A gadei learner with `threads` PyTorch threads."""
    from ..learner import Learner

    workload = _setup(threads, workload)
    train, _ = workload.load_data(data)
    model = model_for(workload, train, seed, filters)
    model.train()
    learner = Learner(model, job).attach()
    barrier.wait()
    start, end, samples, cpu, running = _loop(workload, model, train, rank, world, batch, epochs, seed, lr, limit,
                                              lambda n: learner.step(samples=n))
    learner.close()
    queue.put({"rank": rank, "start": start, "end": end, "samples": samples, "cpu": cpu,
               "torch_threads": torch.get_num_threads(), **_me("learner", running), "state": None})


def gadei_server(job, data, seed, world, lr, options, filters, workload, queue, failed):
    """The server, through the Python API, until `stop_job`; reports the CPU seconds of `serve`
    and its OS threads when `serve` returns (its kernel's OpenMP team outlives the call)."""
    from ..server import Server

    try:
        workload = _setup(workload=workload)
        train, _ = workload.load_data(data)
        server = Server(job, model=model_for(workload, train, seed, filters), learners=world, lr=lr, **options)
    except Exception as err:
        failed.put(f"{type(err).__name__}: {err}")
        raise
    try:
        cpu = time.process_time()
        server.serve()
        queue.put({"rank": -1, "cpu": time.process_time() - cpu, **_me("server")})
    finally:
        server.close()


def _loopback(port: int) -> None:
    """Both peers talk over loopback only."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      TP_SOCKET_IFNAME="lo")
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")  # torch's own use of its API, at shutdown


def ddp_worker(rank, world, batch, epochs, seed, lr, data, limit, port, queue):
    """One DDP process (the DDP tutorial's `demo_basic`, on the text CNN)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    _loopback(port)
    workload = _setup()
    train, _ = workload.load_data(data)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = model_for(workload, train, seed)
        ddp_model = DDP(model)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
        dist.barrier()
        # forward through DDP; the constraint's correction (workload.backward) on the module's
        # gradients after the allreduce, the same on every rank
        start, end, samples, cpu, running = _loop(workload, _Front(ddp_model, model), train, rank, world, batch,
                                                  epochs, seed, lr, limit, lambda _: optimizer.step(),
                                                  lambda: optimizer.zero_grad(), lockstep=True)
        queue.put({"rank": rank, "start": start, "end": end, "samples": samples, "cpu": cpu,
                   "torch_threads": torch.get_num_threads(), **_me("process", running),
                   "state": numpy_state(model) if rank == 0 else None})
    finally:
        dist.destroy_process_group()


class BatchUpdateParameterServer:
    """PyTorch's batch-updating parameter server (the tutorial's class, on the text CNN): gradients
    of `batch_update_size` trainers are summed into the model's `.grad`, averaged, and applied
    with one SGD step; every trainer of the round then gets the new model."""

    def __init__(self, model, batch_update_size: int, lr: float):
        import threading

        self.model = model
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @torch.distributed.rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        for p, g in zip(self.model.parameters(), grads):
            p.grad += g
        with self.lock:
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


def _rpc_trainer(ps_rref, rank, world, batch, epochs, seed, lr, data, limit):
    """A trainer of the RPC parameter server (runs in the trainer's RPC thread, as in the tutorial)."""
    import torch.distributed.rpc as rpc

    workload = _setup()
    train, _ = workload.load_data(data)
    state = {"model": ps_rref.rpc_sync().get_model()}

    def before():
        for p in state["model"].parameters():
            p.grad = None

    def step(_):
        grads = [p.grad for p in state["model"].parameters()]
        state["model"] = rpc.rpc_sync(ps_rref.owner(), BatchUpdateParameterServer.update_and_fetch_model,
                                      args=(ps_rref, grads))

    # the model object is a new one after every step: forward and the constraint use the current one
    start, end, samples, cpu, running = _loop(workload, _Front(lambda x: state["model"](x), lambda: state["model"]),
                                              train, rank, world, batch, epochs, seed, lr, limit, step, before,
                                              lockstep=True)
    return {"rank": rank, "start": start, "end": end, "samples": samples, "cpu": cpu,
            "torch_threads": torch.get_num_threads(), **_me("trainer", running), "state": None}


def rpc_worker(rank, trainers, batch, epochs, seed, lr, data, limit, port, queue):
    """Rank 0: the parameter server, which starts every trainer's loop and waits for them; ranks
    1..N: trainers, which serve RPCs until shutdown."""
    import torch.distributed.rpc as rpc

    _loopback(port)
    workload = _setup()
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=trainers + 1)
    try:
        if rank == 0:
            train, _ = workload.load_data(data)
            ps = BatchUpdateParameterServer(model_for(workload, train, seed), trainers, lr)
            ps_rref = rpc.RRef(ps)
            cpu = time.process_time()
            # timeout 0: a trainer's whole loop runs as this one call (an epoch at batch 1 takes
            # longer than RPC's default 60 s on a busy machine)
            futs = [rpc.rpc_async(f"trainer{r}", _rpc_trainer,
                                  args=(ps_rref, r - 1, trainers, batch, epochs, seed, lr, data, limit), timeout=0)
                    for r in range(1, trainers + 1)]
            results = torch.futures.wait_all(futs)
            queue.put({"rank": -1, "cpu": time.process_time() - cpu, **_me("parameter server")})
            for result in results:
                queue.put(result)
            queue.put({"rank": 0, "state": numpy_state(ps.model), "start": None})
    finally:
        rpc.shutdown()
