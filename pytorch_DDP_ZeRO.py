"""DDP + ZeroRedundancyOptimizer: each rank keeps the optimizer state of 1/W of the parameters.

    torchrun --nproc_per_node 4 pytorch_DDP_ZeRO.py --optimizer adamw     # the articles ran it with Adam
    torchrun --nproc_per_node 2 pytorch_DDP_ZeRO.py --device cpu --dataset synthetic --no-pretrained

Shows ZeRO stage 1 in plain PyTorch: optimizer-state memory divided by the world size (SGD momentum:
1 copy of the weights; AdamW: 2), at the cost of a parameter broadcast after each step. Gradients
and weights stay whole on every rank. The optimizer state is consolidated on rank 0 before it is saved.
"""
from contextlib import nullcontext

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (
    DTYPES,
    DistributedConfig,
    ScaledStep,
    TrainHooks,
    ZeroCheckpointer,
    build_loaders,
    build_model,
    build_scheduler,
    check_dtype_support,
    configure_backends,
    fit,
    global_rank,
    init_distributed,
    launch,
    optimizer_spec,
    save_final,
    steps_per_epoch,
)


def main(cfg):
    info = init_distributed(cfg, standalone_group=True)
    rank, world_size, device = info.rank, info.world_size, info.device
    configure_backends(cfg, device)
    check_dtype_support(cfg.precision, device, cfg)
    dtype = DTYPES[cfg.precision]
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)

    model = build_model(cfg).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer_class, optimizer_kwargs = optimizer_spec(cfg)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, **optimizer_kwargs)
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ctx = nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    scaled = ScaledStep(cfg, model, optimizer, scheduler, scaler)  # backward, clip, step, zero_grad, schedule

    hooks = TrainHooks(scaled.backward, scaled.step, device, ctx=ctx, no_sync=model.no_sync,
                       skipped_steps=scaled.skipped_steps, optimizer=optimizer)
    metrics = fit(cfg, model, train_loader, test_loader, hooks,
                  ZeroCheckpointer(cfg, __file__, model, optimizer, scheduler, scaler, train_loader))
    path = save_final(model.module.state_dict(), cfg, __file__)
    optimizer.consolidate_state_dict(to=0)  # a collective: every rank takes part, rank 0 receives
    if global_rank() == 0:
        torch.save(optimizer.state_dict(), path.replace("model_final.pt", "optimizer_final.pt"))
    return metrics


if __name__ == "__main__":
    launch(main, __file__, cfg_cls=DistributedConfig)
