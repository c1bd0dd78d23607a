"""DistributedDataParallel: one process per GPU, gradients all-reduced during backward.

    torchrun --nproc_per_node 4 pytorch_DDP.py                              # one node, 4 GPUs
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 4 \\
        --rdzv_backend c10d --rdzv_endpoint HOST0:29500 pytorch_DDP.py      # the same on each node
    torchrun --nproc_per_node 2 pytorch_DDP.py --device cpu --dataset synthetic --no-pretrained   # CPU, gloo
    torchrun --nproc_per_node 4 pytorch_DDP.py --precision bf16 --sync-bn --grad-accum 2

Shows what data parallelism buys over pytorch_SingleGPU.py: --batch-size stays the GLOBAL batch, so
each of W ranks sees batch/W images per step and the optimization is the same as on one GPU.
Without a launcher it runs as a world of one (the DDP overhead measurement).
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (
    DTYPES,
    Checkpointer,
    DistributedConfig,
    ScaledStep,
    TrainHooks,
    build_loaders,
    build_model,
    build_optimizer,
    build_scheduler,
    check_dtype_support,
    configure_backends,
    fit,
    init_distributed,
    launch,
    opt,
    require_cuda,
    save_final,
    steps_per_epoch,
)


@dataclass
class DDPConfig(DistributedConfig):
    sync_bn: bool = opt(False, "SyncBatchNorm: BatchNorm statistics over the global batch (CUDA only)")


def main(cfg):
    info = init_distributed(cfg, standalone_group=True)
    rank, world_size, device = info.rank, info.world_size, info.device
    configure_backends(cfg, device)
    check_dtype_support(cfg.precision, device, cfg)
    dtype = DTYPES[cfg.precision]
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)

    model = build_model(cfg).to(device)
    if cfg.sync_bn:
        require_cuda(device, "--sync-bn needs CUDA devices (SyncBatchNorm has no CPU kernel)")
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = build_optimizer(cfg, model.parameters())
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ctx = nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    scaled = ScaledStep(cfg, model, optimizer, scheduler, scaler)  # backward, clip, step, zero_grad, schedule

    # no_sync: accumulate micro-batches locally, all-reduce only on the last one
    hooks = TrainHooks(scaled.backward, scaled.step, device, ctx=ctx, no_sync=model.no_sync,
                       skipped_steps=scaled.skipped_steps, optimizer=optimizer)
    metrics = fit(cfg, model, train_loader, test_loader, hooks,
                  Checkpointer(cfg, __file__, model, optimizer, scheduler, scaler, train_loader))
    save_final(model.module.state_dict(), cfg, __file__)
    return metrics


if __name__ == "__main__":
    launch(main, __file__, cfg_cls=DDPConfig)
