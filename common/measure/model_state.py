"""Model state measured beside the memory model's prediction (common/predict/memory.py).

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
pred_model_state_gib, pred_activation_gib, pred_peak_gib: memory.predict() for this run's setup, and
    its components pred_params_gib, pred_grads_gib, pred_optimizer_gib, pred_master_gib, pred_comm_gib.
pred_error_pct: on CUDA, (pred_peak - peak_allocated) / peak_allocated in percent.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..distributed import global_rank, reduce_metrics, world_size
from ..predict.memory import GIB, STRATEGIES, Setup, predict
from . import Instrument

_WRAPPER_ATTRS = 4  # how deep the walk follows plain Python objects inside optimizer wrappers


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor of a DTensor (FSDP2 shards), else the tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class StorageWalk:
    """Unique storages of one device type, keyed by address."""

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
            self.sizes[storage.data_ptr()] = storage.nbytes()

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
        return sum(self.sizes.values())


def model_state_bytes(model: nn.Module, optimizer, device_type: str) -> int:
    walk = StorageWalk(device_type)
    walk.model(model)
    if optimizer is not None:
        walk.obj(optimizer)
    return walk.total


def _ds_zero(cfg) -> dict:
    from ..deepspeed_config import resolve_path

    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or getattr(cfg, "deepspeed_config", "")
    with open(resolve_path(path)) as fh:
        return json.load(fh).get("zero_optimization", {})


def setup_of(cfg, world: int, precision: str | None = None) -> Setup | None:
    """The memory model's setup of this run, from its config, the precision the run really trains in
    (default --precision) and the registry (None for a script the model does not know)."""
    from ..registry import running as entry

    if entry is None:
        return None
    strategy, zero = entry.strategy, {}
    if entry.file == "pytorch_half_precision.py":
        strategy = "half"
    elif entry.file == "pytorch_auto_mixed_precision.py":
        strategy = "amp"
    elif strategy == "fsdp":
        strategy = f"fsdp_{cfg.sharding}" + ("_offload" if getattr(cfg, "cpu_offload", False) else "")
    elif strategy == "accelerate_fsdp":
        strategy = "accelerate_fsdp"
    elif strategy == "tp":  # pytorch_TP.py: the 2-D mesh when processes are left over the tp degree
        strategy = "tp" if world == cfg.tp else "tp_fsdp"
    elif entry.deepspeed_config:
        zero = _ds_zero(cfg)
        strategy = f"{strategy}_zero{zero.get('stage', 0)}" + ("_offload" if getattr(cfg, "offload", False) else "")
    if strategy not in STRATEGIES or strategy.endswith("zero0"):
        return None  # a split model (mp, pp_*) or a layout the model does not reproduce: measured only
    precision = "fp32" if strategy == "dp" else precision or cfg.precision
    if strategy == "dp" and torch.cuda.is_available() and str(cfg.device) != "cpu":
        world = max(1, torch.cuda.device_count())  # one process drives every visible GPU (pytorch_DP.py)
    return Setup(model=cfg.model, image_size=cfg.image_size, batch_size=cfg.batch_size, world_size=world,
                 precision=precision, optimizer=cfg.optimizer, strategy=strategy, momentum=cfg.momentum,
                 grad_accum=cfg.grad_accum, grad_checkpointing=cfg.grad_checkpointing,
                 channels_last=cfg.channels_last, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 0)),
                 zero=zero, bn_fp32=bool(getattr(cfg, "bn_fp32", False)), tp=getattr(cfg, "tp", 1))


class ModelState(Instrument):
    """Measured model state after the first optimizer update, and the memory model's prediction."""

    def __init__(self, cfg, model: nn.Module, optimizer, device: torch.device, probes=None,
                 precision: str | None = None):
        self.cfg, self.model, self.optimizer, self.device, self.probes = cfg, model, optimizer, device, probes
        self.measured: int | None = None
        self.setup = setup_of(cfg, world_size(), precision)
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
        local = {"m": None if self.measured is None else self.measured / GIB,
                 "peak": self.probes.local()["peak_allocated_gib"] if self.probes is not None else None}
        reduced = reduce_metrics(local, self.device, "max")
        measured, peak_allocated_gib = reduced["m"], reduced["peak"]
        out = dict.fromkeys(("model_state_gib", "pred_model_state_gib", "pred_activation_gib", "pred_peak_gib",
                             "pred_error_pct", "pred_params_gib", "pred_grads_gib", "pred_optimizer_gib",
                             "pred_master_gib", "pred_comm_gib"))
        out["model_state_gib"] = None if measured is None else round(measured, 6)
        if measured is None:
            # the walk runs in the first optimizer update from the last warm-up step on: a library that
            # skipped all of them (non-finite gradients: see skipped_steps) updated nothing to measure
            out["notes"] = "model_state_gib: no optimizer update from the last warm-up step on (steps skipped?)"
        # the prediction is the row's, which rank 0 writes: the other ranks skip its walk (0.3-0.6 s of a CPU
        # the ranks may share)
        if self.setup is not None and global_rank() == 0:
            pred = predict(self.setup)
            out.update(pred_model_state_gib=round(pred.model_state / GIB, 6),
                       pred_activation_gib=round(pred.activations / GIB, 6), pred_peak_gib=round(pred.peak / GIB, 6))
            # the components, so that the report draws this run's prediction rather than rebuilding it
            out.update({f"pred_{c}_gib": round(getattr(pred, c) / GIB, 6)
                        for c in ("params", "grads", "optimizer", "master", "comm")})
            if peak_allocated_gib:
                out["pred_error_pct"] = round(100 * (pred.peak / GIB - peak_allocated_gib) / peak_allocated_gib, 2)
        return out
