"""Single device, fp32: the baseline every other strategy is compared with.

    python pytorch_SingleGPU.py                  # the articles' run: pretrained ResNet50, CIFAR10 at 224
    python pytorch_SingleGPU.py --tf32           # fp32 storage, TF32 tensor-core math (Ampere and newer)
    python pytorch_SingleGPU.py --device cpu --dataset synthetic --no-pretrained --model resnet18 --image-size 32

Shows the cost of plain fp32 training: time, throughput, peak memory, GPU utilization, accuracy.
Appends one row to results/summary.csv; final weights in checkpoints/pytorch_SingleGPU/model_final.pt.
"""
from contextlib import nullcontext

import torch

from common import (
    Checkpointer,
    ScaledStep,
    TrainHooks,
    build_loaders,
    build_model,
    build_optimizer,
    build_scheduler,
    configure_backends,
    fit,
    init_distributed,
    launch,
    require_single_process,
    save_final,
    steps_per_epoch,
)


def main(cfg):
    require_single_process(__file__)
    info = init_distributed(cfg)
    rank, world_size, device = info.rank, info.world_size, info.device
    configure_backends(cfg, device)
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)

    model = build_model(cfg).to(device)
    optimizer = build_optimizer(cfg, model.parameters())
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # fp32 gradients do not underflow
    ctx = nullcontext()
    scaled = ScaledStep(cfg, model, optimizer, scheduler, scaler)  # backward, clip, step, zero_grad, schedule

    hooks = TrainHooks(scaled.backward, scaled.step, device, ctx=ctx, optimizer=optimizer)
    metrics = fit(cfg, model, train_loader, test_loader, hooks,
                  Checkpointer(cfg, __file__, model, optimizer, scheduler, scaler, train_loader))
    save_final(model.state_dict(), cfg, __file__)
    return metrics


if __name__ == "__main__":
    launch(main, __file__)
