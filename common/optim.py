"""Optimizer and learning-rate schedule from the config: the same for every strategy."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .config import TrainConfig


def optimizer_spec(cfg: TrainConfig, fused: bool = False) -> tuple[type, dict]:
    """(class, keyword arguments): ZeroRedundancyOptimizer wants them apart. fused: torch's fused kernel
    (build_optimizer says where)."""
    extra = {"fused": True} if fused else {}
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW, dict(lr=cfg.lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay, **extra)
    return torch.optim.SGD, dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **extra)


def fusable(params: list) -> bool:
    """Every parameter a plain tensor on CUDA. Not DTensors (FSDP2, tensor parallelism): DTensor has sharding
    rules for _fused_adamw_ but none for _fused_sgd_ (torch/distributed/tensor/_ops/_pointwise_ops.py); not
    on CPU, where the project's CPU timings and calibrations were measured with the foreach kernels."""
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    return bool(tensors) and all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_cuda for p in tensors)


def build_optimizer(cfg: TrainConfig, params, fused: bool | None = None) -> torch.optim.Optimizer:
    """fused (None: where fusable): on CUDA, one kernel for every parameter, and with fp16's GradScaler no
    host sync per step. A fused optimizer takes the loss scale and the inf flag as device tensors
    (torch/optim/sgd.py and adamw.py: `if fused: self._step_supports_amp_scaling = True`), so GradScaler.step
    hands it both and calls its step directly (torch/amp/grad_scaler.py step); a foreach optimizer is
    stepped through _maybe_opt_step, whose `v.item()` on found_inf waits for the device every step.
    fused=False where the parameters become DTensors after this (accelerate's FSDP2 prepare) and where
    DeepSpeed's ZeRO steps it (the DeepSpeed scripts: flat partitions, offloaded to the host by --offload or
    by the JSON)."""
    params = [dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in params]
    if fused is None:
        fused = fusable(params)
    cls, kwargs = optimizer_spec(cfg, fused)
    return cls(params, **kwargs)


def lr_lambda(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up over warmup_steps, then cosine to zero at total_steps (or constant)."""
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.scheduler == "none":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


def build_scheduler(cfg: TrainConfig, optimizer, steps_per_epoch: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, steps_per_epoch * cfg.epochs))


def steps_per_epoch(cfg: TrainConfig, train_loader) -> int:
    steps = len(train_loader) // cfg.grad_accum
    return min(steps, cfg.max_steps) if cfg.max_steps else steps
