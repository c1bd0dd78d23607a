"""Model state measured, for the memory model's prediction beside it (common/predict/memory.py).

model_state_gib: bytes of parameters, gradients and optimizer states this rank really holds on its
    device, found by walking the unique tensor storages (deduplicated by storage address, so views
    into one flat buffer count once) reachable from the model's parameters and their .grad, the
    optimizer's state and, for wrappers (ZeroRedundancyOptimizer, DeepSpeed's ZeRO optimizers,
    accelerate's AcceleratedOptimizer), the objects they hold: DeepSpeed keeps its fp32 partitions,
    flat parameter groups and gradient partitions as attributes of its optimizer
    (deepspeed/runtime/zero/stage_1_and_2.py single_partition_of_fp32_groups, bit16_groups_flat,
    averaged_gradients; stage3.py fp32_partitioned_groups_flat, fp16_partitioned_groups_flat).
    Taken once, in the last warm-up step, right after the optimizer's update and before zero_grad (a
    global torch.optim step post-hook: gradients, weights and optimizer state all exist then), max
    over ranks; with no warm-up, in the window's first step.
The prediction's columns are the runner's, from the row once training has ended (common/runner.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..distributed import reduce_metrics
from . import Instrument

GIB = 1024 ** 3

_WRAPPER_ATTRS = 4  # how deep the walk follows plain Python objects inside optimizer wrappers


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor of a DTensor (FSDP2 shards), else the tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class StorageWalk:
    """Unique storages of one device type, keyed by device and address. A process that drives two GPUs (model
    parallelism) holds each half on its own: its total is the busiest device's, as its memory peaks are."""

    def __init__(self, device_type: str):
        self.device_type, self.sizes = device_type, {}
        self._seen_objects: set[int] = set()

    def add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        t = _local(t)
        if t.device.type != self.device_type:
            return  # offloaded state lives in host memory, not on the rank's device
        storage = t.untyped_storage()
        if storage.nbytes():
            self.sizes[(str(t.device), storage.data_ptr())] = storage.nbytes()

    def model(self, model: nn.Module) -> None:
        for p in model.parameters():
            self.add(p)
            self.add(p.grad)

    def obj(self, o, depth: int = _WRAPPER_ATTRS) -> None:
        """Tensors inside an optimizer (or wrapper): containers and the attributes of objects that are
        not modules (the module is walked apart; DeepSpeed optimizers hold references back to it)."""
        if isinstance(o, torch.Tensor):
            self.add(o)
            self.add(o.grad)
            return
        if depth < 0 or id(o) in self._seen_objects or isinstance(o, (str, bytes, int, float, bool, nn.Module)):
            return
        self._seen_objects.add(id(o))
        if isinstance(o, dict):
            for k, v in o.items():
                self.obj(k, depth - 1)
                self.obj(v, depth - 1)
        elif isinstance(o, (list, tuple, set)):
            for v in o:
                self.obj(v, depth - 1)
        elif hasattr(o, "__dict__") and type(o).__module__.split(".")[0] in ("torch", "deepspeed", "accelerate"):
            for v in vars(o).values():
                self.obj(v, depth - 1)

    @property
    def total(self) -> int:
        per_device: dict[str, int] = {}
        for (device, _), nbytes in self.sizes.items():
            per_device[device] = per_device.get(device, 0) + nbytes
        return max(per_device.values(), default=0)


def model_state_bytes(model: nn.Module, optimizer, device_type: str) -> int:
    walk = StorageWalk(device_type)
    walk.model(model)
    if optimizer is not None:
        walk.obj(optimizer)
    return walk.total


class ModelState(Instrument):
    """Measured model state after the first optimizer update."""

    def __init__(self, model: nn.Module, optimizer, device: torch.device):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.measured: int | None = None
        self._hook = None

    def prelude(self) -> None:
        # a global hook (every optimizer of the process), armed for the last warm-up step, outside
        # the window: the walk's own time is in no timed step. Removed once it fired or the run
        # ends, so that an instrument that never closes cannot fire in someone else's step.
        if self._hook is None and self.measured is None:
            self._hook = register_optimizer_step_post_hook(self._after_update)

    def start(self) -> None:
        self.prelude()  # no warm-up: the window's first step (a no-op once armed or measured)

    def _after_update(self, *_) -> None:
        # the first optimizer.step() of the window to finish (the state exists from the first update
        # on): wrappers (ZeRO, DeepSpeed) call an inner torch optimizer, whose post-hook fires before
        # the wrapper frees its gradient partitions
        self.stop()
        self.measured = model_state_bytes(self.model, self.optimizer, self.device.type)

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def row(self) -> dict:
        reduced = reduce_metrics({"m": None if self.measured is None else self.measured / GIB}, self.device, "max")
        if reduced["m"] is None:
            # the walk runs in the first optimizer update from the last warm-up step on: a library that
            # skipped all of them (non-finite gradients: see skipped_steps) updated nothing to measure
            return {"model_state_gib": None,
                    "notes": "model_state_gib: no optimizer update from the last warm-up step on (steps skipped?)"}
        return {"model_state_gib": round(reduced["m"], 6)}
