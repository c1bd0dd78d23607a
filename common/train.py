"""The train loop and evaluation every script shares. A script passes in only what IS its strategy:
the (wrapped) model, the precision context, `backward(loss)`, `step()` and, for DDP, `no_sync`.

Timing (what the CSV's columns mean):
  train_time_s      every training epoch, wall clock, device synchronized at both ends; excludes
                    data set loading, evaluation, checkpoint saving and torch.compile's first call.
  throughput_img_s  images / second over the window that starts after `timing_warmup_steps`
                    optimizer steps and ends with the last step (synchronized at both ends); when a
                    run is shorter than its warm-up the whole train time is used (timed_steps = 0).
The hot loop keeps loss and accuracy sums on the device: the host waits on the device only at
progress lines (every `log_every` steps) and epoch ends.
"""
from __future__ import annotations

import math
import os
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import TrainConfig
from .distributed import all_reduce, global_rank
from .probes import Probes


class Diverged(RuntimeError):
    """Loss stayed non-finite for cfg.max_nonfinite_steps steps in a row."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def configure_backends(cfg: TrainConfig, device: torch.device) -> None:
    seed_everything(cfg.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest conv algorithms once
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # --precision -> torch dtype


def check_dtype_support(precision: str, device: torch.device) -> None:
    """bf16 needs compute capability 8.0 (Ampere); fp16 arithmetic 5.3, tensor cores 7.0 (the
    articles' P40 is 6.1: fp16 runs there, but no faster than fp32)."""
    from .config import UsageError

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_epoch(loader, epoch: int) -> None:
    target = getattr(loader, "sampler", None)
    target = target if hasattr(target, "set_epoch") else loader
    if hasattr(target, "set_epoch"):
        target.set_epoch(epoch)


@dataclass
class Metrics:
    steps: int = 0  # optimizer steps, all epochs
    train_time_s: float = 0.0
    throughput_img_s: float = 0.0
    timed_steps: int = 0  # optimizer steps inside the throughput window
    compile_time_s: float | None = None  # torch.compile's first forward+backward, outside train_time_s
    resumed: bool = False  # training state was restored from an epoch checkpoint
    train_loss: float = float("nan")  # mean over the last epoch's samples, all ranks
    train_accuracy: float = float("nan")  # same window, augmented training images
    test_accuracy: float = float("nan")
    test_samples: int = 0
    probes: dict = field(default_factory=dict)

    def row(self) -> dict:
        r = {k: v for k, v in self.__dict__.items() if k != "probes"}
        for k in ("train_time_s", "throughput_img_s", "compile_time_s"):
            r[k] = None if r[k] is None else round(r[k], 3)
        for k in ("train_loss", "train_accuracy", "test_accuracy"):
            r[k] = None if math.isnan(r[k]) else round(r[k], 6)
        return {**r, **self.probes}


def _to_device(x, y, device, input_dtype, channels_last):
    x = x.to(device, dtype=input_dtype, non_blocking=True)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y.to(device, non_blocking=True)


def fit(cfg: TrainConfig, model: nn.Module, train_loader, test_loader, *, backward: Callable[[torch.Tensor], None],
        step: Callable[[], None], ctx: ContextManager, device: torch.device,
        no_sync: Callable[[], ContextManager] = nullcontext, input_dtype: torch.dtype = torch.float32,
        probe_devices: list[torch.device] | None = None, eval_fn: Callable | None = None,
        checkpointer=None) -> Metrics:
    """Trains cfg.epochs epochs, then evaluates once. `backward` gets the micro-batch loss already
    divided by grad_accum; `step` runs once per optimizer step (optimizer, scaler, scheduler, zero_grad).
    With a checkpointer, training state is saved after every epoch (outside the timed window) and,
    with --resume, restored before the first one."""
    rank0 = global_rank() == 0
    spe = steps_per_epoch(cfg, train_loader)
    m = Metrics()
    start_epoch, window_time, window_steps, saved = 0, 0.0, 0, None
    if checkpointer is not None and cfg.resume:
        saved = checkpointer.load(cfg.resume)
        if saved is not None:
            start_epoch, window_time, window_steps = saved["epoch"], saved["window_time"], saved["window_steps"]
            m.steps, m.train_time_s, m.resumed = saved["steps"], saved["train_time_s"], True
            if rank0:
                print(f"resumed after epoch {start_epoch} (step {m.steps}) from {checkpointer.describe()}", flush=True)
    net = model
    if cfg.compile:
        net, m.compile_time_s = compile_model(model, train_loader, ctx, device, input_dtype, cfg.channels_last)
    probes = Probes(probe_devices or [device]).start()
    streak = torch.zeros((), dtype=torch.int32, device=device)
    for epoch in range(start_epoch, cfg.epochs):
        set_epoch(train_loader, epoch)
        model.train()
        if cfg.freeze_bn:
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
        _sync(device)
        epoch_start = time.perf_counter()
        # the throughput window: this epoch from its start, or from the step that ends the timing warm-up
        seg_start, seg_steps0 = (epoch_start, m.steps) if m.steps >= cfg.timing_warmup_steps else (None, 0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        seen, epoch_steps, micro = 0, 0, 0
        for x, y in train_loader:
            x, y = _to_device(x, y, device, input_dtype, cfg.channels_last)
            micro += 1
            boundary = micro % cfg.grad_accum == 0
            with nullcontext() if boundary else no_sync():
                with ctx:
                    logits = net(x)
                    loss = F.cross_entropy(logits.float(), y)
                backward(loss / cfg.grad_accum)
            loss_d = loss.detach().float()
            streak = torch.where(torch.isfinite(loss_d), torch.zeros_like(streak), streak + 1)
            loss_sum += loss_d.double() * y.shape[0]
            correct += (logits.detach().argmax(1) == y).sum()
            seen += y.shape[0]
            if not boundary:
                continue
            step()
            m.steps += 1
            epoch_steps += 1
            if seg_start is None and m.steps == cfg.timing_warmup_steps:
                _sync(device)
                seg_start, seg_steps0 = time.perf_counter(), m.steps
            if cfg.log_every and epoch_steps % cfg.log_every == 0:
                _check_finite(streak, cfg)
                if rank0:
                    done = window_steps + (m.steps - seg_steps0 if seg_start is not None else 0)
                    spent = window_time + (time.perf_counter() - seg_start if seg_start is not None else 0.0)
                    rate = f" img_s={done * cfg.batch_size / spent:.1f}" if done and spent > 0 else ""
                    print(f"[progress] epoch={epoch + 1}/{cfg.epochs} step={epoch_steps}/{spe} "
                          f"loss={loss_d.item():.4f}{rate}", flush=True)
            if epoch_steps >= spe:
                break
        _sync(device)
        epoch_end = time.perf_counter()
        m.train_time_s += epoch_end - epoch_start
        if seg_start is not None:
            window_time += epoch_end - seg_start
            window_steps += m.steps - seg_steps0
        _check_finite(streak, cfg)
        stats = all_reduce(torch.stack([loss_sum, correct.double(), torch.tensor(float(seen), dtype=torch.float64,
                                                                                    device=device)]))
        m.train_loss, m.train_accuracy = (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item()
        if checkpointer is not None and cfg.epoch_checkpoints:
            checkpointer.save(epoch + 1, {"epoch": epoch + 1, "steps": m.steps, "train_time_s": m.train_time_s,
                                          "window_time": window_time, "window_steps": window_steps,
                                          "train_loss": m.train_loss, "train_accuracy": m.train_accuracy})
    m.probes = probes.stop()
    if window_steps:
        m.timed_steps = window_steps
        m.throughput_img_s = window_steps * cfg.batch_size / window_time
    else:  # shorter than the timing warm-up: the whole training time
        m.throughput_img_s = m.steps * cfg.batch_size / m.train_time_s if m.train_time_s else 0.0
    if start_epoch == cfg.epochs and saved is not None:  # resumed after the last epoch: nothing left to train
        m.train_loss, m.train_accuracy = saved["train_loss"], saved["train_accuracy"]
    m.test_accuracy, m.test_samples = (eval_fn or evaluate)(model, test_loader, ctx=ctx, device=device,
                                                           input_dtype=input_dtype, channels_last=cfg.channels_last)
    return m


def compile_model(model: nn.Module, train_loader, ctx, device, input_dtype, channels_last):
    """torch.compile, then one forward+backward on a real batch so that compilation happens here and
    not in the timed loop. Gradients are dropped and BatchNorm statistics restored: training starts
    from exactly the state it would have had without compiling."""
    from .checkpoint import _rng_state, _set_rng_state

    compiled = torch.compile(model)
    buffers = {k: v.clone() for k, v in model.state_dict().items() if not isinstance(v, nn.Parameter)}
    rng = _rng_state(train_loader)  # drawing a batch advances the augmentation RNG: put it back after
    x, y = next(iter(train_loader))
    x, y = _to_device(x, y, device, input_dtype, channels_last)
    model.train()
    _sync(device)
    start = time.perf_counter()
    with ctx:
        loss = F.cross_entropy(compiled(x).float(), y)
    loss.backward()
    _sync(device)
    elapsed = time.perf_counter() - start
    for p in model.parameters():
        p.grad = None
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k in buffers:
                v.copy_(buffers[k])
    _set_rng_state(rng, train_loader)
    return compiled, elapsed


def _check_finite(streak: torch.Tensor, cfg: TrainConfig) -> None:
    worst = all_reduce(streak.clone(), op=torch.distributed.ReduceOp.MAX)
    if int(worst) >= cfg.max_nonfinite_steps:
        raise Diverged(f"loss was non-finite for {int(worst)} consecutive steps")


@torch.no_grad()
def evaluate(model: nn.Module, loader, *, ctx: ContextManager, device: torch.device,
             input_dtype: torch.dtype = torch.float32, channels_last: bool = False) -> tuple[float, int]:
    """Top-1 accuracy over the whole test set: each rank sees its shard, padding is masked out,
    the counts are summed over ranks, so every test sample counts exactly once."""
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    for x, y, valid in loader:
        x, y = _to_device(x, y, device, input_dtype, channels_last)
        valid = valid.to(device, non_blocking=True)
        with ctx:
            pred = model(x).argmax(1)
        correct += ((pred == y) & valid).sum()
        count += valid.sum()
    totals = all_reduce(torch.stack([correct, count]))
    return (totals[0] / totals[1]).item() if totals[1] else float("nan"), int(totals[1])


def strip_prefixes(state_dict: dict) -> dict:
    """Plain torchvision keys: no 'module.' (DDP/DP), '_orig_mod.' (torch.compile) prefixes."""
    out = {}
    for k, v in state_dict.items():
        for p in ("module.", "_orig_mod."):
            while k.startswith(p):
                k = k[len(p):]
        out[k] = v.detach().cpu() if isinstance(v, torch.Tensor) else v
    return out


def final_path(cfg: TrainConfig, script: str) -> str:
    return os.path.join(cfg.save_dir, os.path.splitext(os.path.basename(script))[0], "model_final.pt")


def save_final(state_dict: dict, cfg: TrainConfig, script: str) -> str:
    """Global rank 0 writes the bare model's fp32 state_dict atomically (temporary file, then rename)."""
    path = final_path(cfg, script)
    if global_rank() != 0:
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sd = {k: (v.float() if torch.is_floating_point(v) else v) for k, v in strip_prefixes(state_dict).items()}
    tmp = path + ".tmp"
    torch.save(sd, tmp)
    os.replace(tmp, path)
    return path
