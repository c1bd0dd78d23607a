"""DataParallel: one process drives every visible GPU; the batch is scattered, the model replicated each step.

    python pytorch_DP.py                                        # all visible GPUs
    CUDA_VISIBLE_DEVICES=0,1 python pytorch_DP.py               # two of them
    python pytorch_DP.py --device cpu --dataset synthetic --no-pretrained   # no GPU: runs as plain training

Shows why PyTorch recommends DDP instead: one Python thread feeds all GPUs, weights are broadcast and
outputs gathered on GPU 0 every step, so GPU 0 holds more memory and the others wait. The row's
world_size and num_devices are the GPUs actually used (1 on CPU), since DP has one process.
"""
from contextlib import nullcontext

import torch
import torch.nn as nn

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
    gpus = list(range(torch.cuda.device_count())) if device.type == "cuda" else []
    if len(gpus) > 1:
        model = nn.DataParallel(model, device_ids=gpus)  # replicas on every GPU; outputs gathered on GPU 0
    optimizer = build_optimizer(cfg, model.parameters())
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # fp32 gradients do not underflow
    ctx = nullcontext()
    scaled = ScaledStep(cfg, model, optimizer, scheduler, scaler)  # backward, clip, step, zero_grad, schedule

    devices = [torch.device("cuda", i) for i in gpus] or [device]  # peaks of the busiest GPU (GPU 0 gathers)
    hooks = TrainHooks(scaled.backward, scaled.step, device, ctx=ctx, probe_devices=devices, optimizer=optimizer)
    metrics = fit(cfg, model, train_loader, test_loader, hooks,
                  Checkpointer(cfg, __file__, model, optimizer, scheduler, scaler, train_loader))
    save_final(model.state_dict(), cfg, __file__)  # save_final strips DataParallel's 'module.' prefix
    used = max(1, len(gpus))
    return metrics, {"world_size": used, "num_devices": used}


if __name__ == "__main__":
    launch(main, __file__)
