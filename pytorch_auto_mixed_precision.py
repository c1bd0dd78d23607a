"""Automatic mixed precision: fp32 master weights, fp16/bf16 math under autocast, loss scaling for fp16.

    python pytorch_auto_mixed_precision.py                        # fp16 autocast + GradScaler
    python pytorch_auto_mixed_precision.py --precision bf16       # bf16 autocast, no scaler needed
    python pytorch_auto_mixed_precision.py --clip-grad-norm 1.0   # clipping on unscaled gradients

Shows the articles' fix for pure half precision: about half the activation memory and tensor-core
speed at fp32's accuracy. Gradients are clipped after scaler.unscale_, never on the scaled values,
and the logged loss is the true loss, not the scaled one. Skipped (overflowing) fp16 steps are
counted in the row's skipped_steps. On CPU bf16 and fp16 both run (fp16 slowly).
"""
import torch

from common import (
    DTYPES,
    Checkpointer,
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
    require_single_process,
    save_final,
    steps_per_epoch,
)


def main(cfg):
    require_single_process(__file__)
    info = init_distributed(cfg)
    rank, world_size, device = info.rank, info.world_size, info.device
    configure_backends(cfg, device)
    check_dtype_support(cfg.precision, device, cfg)
    dtype = DTYPES[cfg.precision]
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)

    model = build_model(cfg).to(device)
    optimizer = build_optimizer(cfg, model.parameters())
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)  # bf16 has fp32's range
    ctx = torch.autocast(device.type, dtype=dtype)
    scaled = ScaledStep(cfg, model, optimizer, scheduler, scaler)  # unscale_ before clipping; skips counted

    hooks = TrainHooks(scaled.backward, scaled.step, device, ctx=ctx, skipped_steps=scaled.skipped_steps,
                       optimizer=optimizer)
    metrics = fit(cfg, model, train_loader, test_loader, hooks,
                  Checkpointer(cfg, __file__, model, optimizer, scheduler, scaler, train_loader))
    save_final(model.state_dict(), cfg, __file__)
    return metrics


if __name__ == "__main__":
    launch(main, __file__)
