"""DDP + ZeroRedundancyOptimizer: each rank keeps the optimizer state of 1/W of the parameters.

    torchrun --nproc_per_node 4 pytorch_DDP_ZeRO.py --optimizer adamw     # the articles ran it with Adam
    torchrun --nproc_per_node 2 pytorch_DDP_ZeRO.py --device cpu --dataset synthetic --no-pretrained

Shows ZeRO stage 1 in plain PyTorch: optimizer-state memory divided by the world size (SGD momentum:
1 copy of the weights; AdamW: 2), at the cost of a parameter broadcast after each step. Gradients
and weights stay whole on every rank. The optimizer state is consolidated on rank 0 before it is saved.
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (
    DTYPES,
    TrainConfig,
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


@dataclass
class ZeROConfig(TrainConfig):
    pass


def main(cfg):
    info = init_distributed(cfg, standalone_group=True)
    rank, world_size, device = info.rank, info.world_size, info.device
    configure_backends(cfg, device)
    check_dtype_support(cfg.precision, device)
    dtype = DTYPES[cfg.precision]
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)

    model = build_model(cfg).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer_class, optimizer_kwargs = optimizer_spec(cfg)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, **optimizer_kwargs)
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ctx = nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)

    def backward(loss):
        scaler.scale(loss).backward()

    def step():
        if cfg.clip_grad_norm:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    metrics = fit(cfg, model, train_loader, test_loader, backward=backward, step=step, ctx=ctx, device=device,
                  no_sync=model.no_sync,
                  checkpointer=ZeroCheckpointer(cfg, __file__, model, optimizer, scheduler, scaler, train_loader))
    path = save_final(model.module.state_dict(), cfg, __file__)
    optimizer.consolidate_state_dict(to=0)  # a collective: every rank takes part, rank 0 receives
    if global_rank() == 0:
        torch.save(optimizer.state_dict(), path.replace("model_final.pt", "optimizer_final.pt"))
    return metrics, {"precision": cfg.precision if dtype == torch.float32 else f"amp_{cfg.precision}"}


if __name__ == "__main__":
    launch(main, __file__, strategy="ddp_zero", precisions=("fp32", "fp16", "bf16"), cfg_cls=ZeROConfig)
