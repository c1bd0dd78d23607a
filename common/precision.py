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


# glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30  # mallopt takes an int


def steady_host_allocator() -> bool:
    """Fix glibc malloc's mmap and trim thresholds, so that a CPU run's step time does not depend on
    the allocator's history. By default glibc moves both as chunks are freed (the mmap threshold to the
    size of the largest mmapped chunk freed so far, up to 32 MiB; the trim threshold to twice that), so
    where they settle depends on what the imports happened to allocate and free. Where the trim threshold
    settles below what a step allocates, every step hands its activations back to the OS and faults them
    in again: a resnet18 step of 16 images at 32 px on one thread took 458 page faults in some processes
    and 4,576 (9 ms of system time, 12% of the step) in others; a 2-rank GPipe run's median step moved
    from 157 to 235 ms between launches, 141-163 ms with this. Setting them turns the adjustment off
    (mallopt(3)); memory a step frees stays with the process, as torch's CPU launcher arranges with
    jemalloc (torch/backends/xeon/run_cpu.py: dirty_decay_ms and muzzy_decay_ms at 9e9).
    Chunks above the ceiling would still be mmapped and unmapped at every allocation: gloo's temporaries
    for a 45 MiB all-gather or reduce-scatter (DeepSpeed's ZeRO-1/2 of resnet18 all-gathers that size),
    whose time that doubled (2 ranks: 42 ms, 19-22 with these). M_MMAP_MAX = 0 serves them from the heap
    too; a request a thread's arena cannot hold falls back to the main one (glibc malloc.c,
    arena_get_retry). False where the C
    library has no mallopt (macOS, Windows) or refuses a value."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return all(bool(mallopt(option, value)) for option, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_MMAP_MAX, 0)))


def configure_backends(cfg: EvalConfig, device: torch.device) -> None:
    seed_everything(cfg.seed)
    if device.type == "cpu":
        steady_host_allocator()
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest conv algorithms once
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32


def onednn_bf16_kernels() -> bool:
    """True where torch's CPU convolutions run oneDNN's native bf16 kernels (avx512_bf16, AMX);
    ONEDNN_MAX_CPU_ISA=AVX2 turns them off, and bf16 then falls back to reference kernels."""
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def native_half_kernels(precision: str) -> bool:
    """True where this CPU's convolutions run oneDNN's native kernels for `precision`: always for fp32; bf16
    needs avx512_bf16 or AMX, fp16 AVX512-FP16 or AMX-FP16. Elsewhere torch's reference kernels run, 16-34x
    fp32's time on a ResNet, 4-6x on shufflenet_v2_x0_5 (2-core AVX-512 EPYC:
    results/campaigns/2026-12-02_epyc-avx512_doc_figures)."""
    if precision == "bf16":
        return onednn_bf16_kernels()
    if precision != "fp16":
        return True
    try:
        return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def strided_past_input(model_name: str, image_size: int) -> list[str]:
    """Convolutions (kernel > 1) whose input is smaller than their stride in some spatial dimension, at
    this image size: e.g. ResNet's layer4.0.conv1 (3x3, stride 2) on the 1x1 map of a 16 px image.
    Found by a meta-device forward: no memory, no compute."""
    from .models import meta_model

    model, found = meta_model(model_name, image_size=image_size), []

    def hook(name):
        def pre(conv, args):
            small = [s for s, st in zip(args[0].shape[2:], conv.stride) if s < st]
            if small and max(conv.kernel_size) > 1:
                found.append(name)
        return pre

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        model.eval()(torch.empty(2, 3, image_size, image_size, device="meta"))
    return found


def check_cpu_bf16_convolutions(cfg: EvalConfig, precision: str, device: torch.device) -> None:
    """Refuses what oneDNN's bf16 backward-weights kernel gets wrong. Seen with torch 2.14.1 (oneDNN
    3.12.0, `jit_bf16:avx512_core_bf16`, ONEDNN_VERBOSE=1) on an AMD EPYC with avx512_bf16: for a
    convolution whose input is smaller than its stride, the weight gradient of the taps that only
    ever meet padding is left uninitialised: 1e34 or inf in some runs and not others, so identical
    seeded runs differ and bf16 DeepSpeed skips "overflowing" steps at random. fp32, the reference
    bf16 kernels (no avx512_bf16, or ONEDNN_MAX_CPU_ISA=AVX2) and CUDA are right at the same shapes
    (tests/test_precision.py)."""
    if device.type != "cpu" or precision != "bf16" or not onednn_bf16_kernels():
        return
    bad = strided_past_input(cfg.model, cfg.image_size)
    if bad:
        raise UsageError(f"{cfg.model} at --image-size {cfg.image_size} puts {bad[0]} (stride > its input) where "
                         f"this CPU's oneDNN bf16 kernels return garbage weight gradients: use a larger "
                         f"--image-size, fp32, or ONEDNN_MAX_CPU_ISA=AVX2 (slow reference bf16 kernels)")


def check_dtype_support(precision: str, device: torch.device, cfg: EvalConfig | None = None) -> None:
    """bf16 needs compute capability 8.0 (Ampere); fp16 arithmetic 5.3, tensor cores 7.0 (the
    articles' P40 is 6.1: fp16 runs there, but no faster than fp32). On CPU: the oneDNN bf16 check."""
    if cfg is not None:
        check_cpu_bf16_convolutions(cfg, precision, device)
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


def skipped_now(found_inf_per_device: dict) -> torch.Tensor:
    """1 when this step was skipped, else 0, on the device (no host sync). Not the flags' sum: a model over
    several devices has one flag each, and ShardedGradScaler all-reduces its flags over the ranks, summing
    the ranks that overflowed (torch/distributed/fsdp/sharded_grad_scaler.py unscale_, dist.all_reduce)."""
    flags = list(found_inf_per_device.values())
    return torch.stack([f.to(flags[0].device) for f in flags]).amax().gt(0).to(torch.int64)


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
            found = skipped_now(self.scaler._found_inf_per_device(self.optimizer))
            self.skipped = found if self.skipped is None else self.skipped + found
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def skipped_steps(self) -> int | None:
        """Steps skipped for overflow (None when no scaler ran). A host sync: call after training."""
        if not self.scaler.is_enabled():
            return None
        return 0 if self.skipped is None else int(self.skipped)
