"""Precision as data (nanoGPT's way): --precision -> a dtype, a context (nullcontext or autocast) and
a GradScaler that is enabled only where fp16 needs it; plus the device checks and backend switches."""
from __future__ import annotations

import sys

import torch

from .config import EvalConfig, TrainConfig, UsageError
from .distributed import global_rank

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # --precision -> torch dtype


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def configure_backends(cfg: EvalConfig, device: torch.device) -> None:
    seed_everything(cfg.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest conv algorithms once
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32


def check_dtype_support(precision: str, device: torch.device) -> None:
    """bf16 needs compute capability 8.0 (Ampere); fp16 arithmetic 5.3, tensor cores 7.0 (the
    articles' P40 is 6.1: fp16 runs there, but no faster than fp32)."""
    if device.type != "cuda" or precision not in ("fp16", "bf16"):
        return
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError(f"{name} (compute capability {major}.{minor}) has no bf16 support (needs 8.0+); "
                         f"use --precision fp16")
    if precision == "fp16" and (major, minor) < (5, 3):
        raise UsageError(f"{name} (compute capability {major}.{minor}) has no fp16 arithmetic (needs 5.3+)")
    if precision == "fp16" and major < 7 and global_rank() == 0:
        print(f"note: {name} (compute capability {major}.{minor}) has no fp16 tensor cores: "
              f"fp16 saves memory here but not time", file=sys.stderr)


class ScaledStep:
    """backward and the optimizer step around a GradScaler, shared by the scripts whose strategy does
    not own the step (single device, DataParallel, DDP, DDP+ZeRO, FSDP). With the scaler disabled
    (fp32, bf16) scale() and step() are plain backward() and optimizer.step(). Gradients are clipped
    after unscale_, never on the scaled values; fp16 steps the scaler skips (overflow) are counted
    on the device, so there is no host sync per step."""

    def __init__(self, cfg: TrainConfig, model, optimizer, scheduler, scaler):
        self.cfg, self.model, self.optimizer, self.scheduler, self.scaler = cfg, model, optimizer, scheduler, scaler
        self.skipped = None

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self) -> None:
        if self.cfg.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad_norm)
        self.scaler.step(self.optimizer)
        if self.scaler.is_enabled():
            found = sum(self.scaler._found_inf_per_device(self.optimizer).values())
            self.skipped = found if self.skipped is None else self.skipped + found
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def skipped_steps(self) -> int | None:
        """Steps skipped for overflow (None when no scaler ran). A host sync: call after training."""
        if not self.scaler.is_enabled():
            return None
        return 0 if self.skipped is None else int(self.skipped)
