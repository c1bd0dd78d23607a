"""Pure half precision: the whole model cast to fp16 (or bf16), as the articles did, and why it loses accuracy.

    python pytorch_half_precision.py                                  # the articles' run: model.half()
    python pytorch_half_precision.py --bn-fp32 --loss-scale 1024      # the two fixes that need no AMP
    python pytorch_half_precision.py --precision bf16                 # bf16: fp32's range, 8-bit mantissa

Shows what halving every tensor saves (memory, time on tensor-core GPUs) and costs: with fp16
weights an SGD update smaller than half an ulp of the weight is lost (no fp32 master copy), small
gradients underflow to zero without loss scaling, and BatchNorm statistics lose precision. The
articles lost ~10 points of accuracy this way; pytorch_auto_mixed_precision.py is the real fix.
On CPU fp16 runs (slowly, to exercise the code path); its timings mean nothing there.
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn

from common import (
    DTYPES,
    Checkpointer,
    TrainConfig,
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
    require_single_process,
    save_final,
    steps_per_epoch,
)


@dataclass
class HalfConfig(TrainConfig):
    bn_fp32: bool = opt(False, "keep BatchNorm weights and statistics in fp32 (inputs stay half)")
    loss_scale: float = opt(1.0, "static loss scale: loss x S before backward, gradients / S before the step; "
                                 "1 = none, as the articles", min=1.0)


def main(cfg):
    require_single_process(__file__)
    info = init_distributed(cfg)
    rank, world_size, device = info.rank, info.world_size, info.device
    configure_backends(cfg, device)
    check_dtype_support(cfg.precision, device, cfg)
    dtype = DTYPES[cfg.precision]
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)

    model = build_model(cfg).to(device).to(dtype)  # weights, gradients and optimizer state all in half
    if cfg.bn_fp32:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.float()
    optimizer = build_optimizer(cfg, model.parameters())
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    scaler = None  # GradScaler refuses half gradients: it unscales into fp32 master weights we do not have
    ctx = nullcontext()  # no autocast: every op runs in the dtype of its inputs and weights

    def backward(loss):
        (loss * cfg.loss_scale).backward()

    def step():
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if cfg.loss_scale != 1.0:
            torch._foreach_div_(grads, cfg.loss_scale)
        if cfg.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    hooks = TrainHooks(backward, step, device, ctx=ctx, input_dtype=dtype, optimizer=optimizer)
    metrics = fit(cfg, model, train_loader, test_loader, hooks,
                  Checkpointer(cfg, __file__, model, optimizer, scheduler, scaler, train_loader))
    save_final(model.state_dict(), cfg, __file__)
    suffix = ("+bn32" if cfg.bn_fp32 else "") + (f"+ls{cfg.loss_scale:g}" if cfg.loss_scale != 1.0 else "")
    return metrics, {"precision": f"{cfg.precision}{suffix}"}


if __name__ == "__main__":
    launch(main, __file__, cfg_cls=HalfConfig)
