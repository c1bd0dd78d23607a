"""accelerate helpers shared by the three accelerate_*.py scripts."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from .config import TrainConfig, UsageError


def accelerate_precision(cfg: TrainConfig) -> str | None:
    """accelerate's mixed_precision: --precision when given as fp16/bf16, else whatever the accelerate
    config (ACCELERATE_MIXED_PRECISION, set by `accelerate launch --config_file`) says."""
    return {"fp16": "fp16", "bf16": "bf16"}.get(cfg.precision)


def check_world(accelerator) -> tuple[int, int]:
    """Rank and world size from torch.distributed. Under accelerate's DeepSpeed path on CPU, accelerate
    has been seen reporting num_processes=1 and process_index=0 on every one of 2 ranks: trusting it
    would write two rows and train each rank on the whole data set."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if accelerator.num_processes != world and rank == 0:
        print(f"note: accelerate reports {accelerator.num_processes} processes, torch.distributed {world}: "
              f"ranks, data split and metrics follow torch.distributed", file=sys.stderr)
    return rank, world


def make_gather_eval(accelerator, world: int):
    """Evaluation through accelerator.gather_for_metrics when accelerate's world is the real one; the
    loader yields (x, y, valid) shards and padding is dropped by the valid mask, so every test sample
    counts once either way."""
    from .distributed import all_reduce

    @torch.no_grad()
    def evaluate(model, loader, *, ctx, device, input_dtype=torch.float32, channels_last=False):
        model.eval()
        correct = torch.zeros((), dtype=torch.int64, device=device)
        count = torch.zeros((), dtype=torch.int64, device=device)
        for x, y, valid in loader:
            x = x.to(device, dtype=input_dtype, non_blocking=True)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            y, valid = y.to(device), valid.to(device)
            with ctx:
                pred = model(x).argmax(1)
            hits = (pred == y) & valid
            if accelerator.num_processes == world:
                hits, valid = accelerator.gather_for_metrics((hits, valid))
            correct += hits.sum()
            count += valid.sum()
        if accelerator.num_processes != world:
            all_reduce(correct), all_reduce(count)
        return (correct / count).item() if count else float("nan"), int(count)

    return evaluate


def require_cuda(device: torch.device, what: str) -> None:
    if device.type != "cuda":
        raise UsageError(f"{what} needs CUDA devices (on CPU accelerate drops the plugin and every rank "
                         f"trains alone); for FSDP on CPU use pytorch_FSDP.py")
