"""Optimizer and learning-rate schedule from the config: the same for every strategy."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .config import TrainConfig


def optimizer_spec(cfg: TrainConfig) -> tuple[type, dict]:
    """(class, keyword arguments): ZeroRedundancyOptimizer wants them apart."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW, dict(lr=cfg.lr, betas=(cfg.momentum, 0.999), weight_decay=cfg.weight_decay)
    return torch.optim.SGD, dict(lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def build_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_spec(cfg)
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
