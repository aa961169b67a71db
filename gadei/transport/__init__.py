"""A learner's transports: how its gradients reach its ring (push) and weights reach its model (pull).

Each direction is one interface with several implementations, chosen per learner:

push
    `publish` (CPU default): where the job's gradients are float32, the model's `.grad`
        tensors are views of the free ring slot, so backward accumulates straight into
        shared memory and pushing is publishing the slot (two atomic stores). Row-sparse
        tables and float16/bfloat16 gradients are written into the slot by the train thread
        at `step()` (only the touched rows; a converting copy).
    `thread` (the paper's push thread): backward writes private gradients; a push thread
        writes the finished one into the free slot and publishes it while the train thread
        goes on with the next step. One item in flight.
    `weights` (elastic mode): local SGD steps on a private model; every tau steps the
        model's weights go into the slot and the model moves towards the centre.
    `device` (GPU learners; also runs on a CPU "device"): after backward the train thread
        copies the gradients, on the model's device, into one of two device staging buffers
        (converted there to the ring's float16/bfloat16) and goes on; a push thread copies
        the staged gradient into the free slot on its own CUDA stream, waits for that
        stream, and publishes.

pull
    `view` (default): the model's parameters are views of the region's weights (Hogwild,
        no copies); the server's updates show up in the model as they happen.
    `copy`: a pull thread copies the weights into a private staging buffer whenever the
        server's version moved, and the train thread swaps it in between steps (a pointer
        swap); at most one pull per step. In consistent mode the copy is taken inside the
        server's seqlock, so it never holds half an update.
    `local` (elastic mode): the model is private; it starts from the centre.
    `device` (GPU learners; also runs on a CPU "device"): `copy` with device buffers: the
        pull thread copies new weights from the (page-locked) region into a device staging
        buffer on its own stream; the train thread swaps it in between steps.

The package: `slot` (a slot's format, and what the server reads of a slot it takes: torch-free),
`writer` (`SlotWriter`: a learner's gradients into a slot where the format says), `handoff`,
`push`, `pull`, and `device` (both directions for a model on a device; the device push lays
its staging buffer out as a slot's dense area and hands table rows to the writer's areas).

Every hand-off between the train thread and a push or pull thread holds at most one item,
every wait on it is cut into WAIT_SLICE pieces that look for an error or a shutdown, and
an error in a helper thread is raised in the train thread at its next step.

`options` (`TransportOptions`) is torch-free, and the rest is imported when one of its names is
first touched (PEP 562): the job file's checks import `options`, and `gadei status`, `stop` and
`clean` import those, without torch.
"""

import importlib

_LAZY = {  # name -> the module of this package that defines it
    "DevicePull": ".device", "DevicePush": ".device",
    "CopyPull": ".pull", "LocalPull": ".pull", "Pull": ".pull", "ViewPull": ".pull",
    "ElasticPush": ".push", "PublishPush": ".push", "Push": ".push", "ThreadPush": ".push",
    "TORCH_DTYPES": ".writer", "SlotWriter": ".writer",
}

__all__ = ["PULLS", "PUSHES", "TORCH_DTYPES", "CopyPull", "DevicePull", "DevicePush", "ElasticPush", "LocalPull",
           "PublishPush", "Pull", "Push", "SlotWriter", "ThreadPush", "ViewPull"]


def _registries() -> dict:
    """PUSHES and PULLS: each direction's implementations by their name (`TransportOptions`)."""
    from .device import DevicePull, DevicePush
    from .pull import CopyPull, LocalPull, ViewPull
    from .push import ElasticPush, PublishPush, ThreadPush

    return {"PUSHES": {cls.name: cls for cls in (PublishPush, ThreadPush, ElasticPush, DevicePush)},
            "PULLS": {cls.name: cls for cls in (ViewPull, CopyPull, LocalPull, DevicePull)}}


def __getattr__(name: str):
    if name in ("PUSHES", "PULLS"):
        found = _registries()
        globals().update(found)  # the next lookup finds them without coming here
        return found[name]
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
