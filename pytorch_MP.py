"""Naive model parallelism, one process: the first half of the model on cuda:0, the second on cuda:1 (cut
between ResNet stages; any other family between its blocks, e.g. a ViT's EncoderBlocks: common/pipeline.py).

    CUDA_VISIBLE_DEVICES=0,1 python pytorch_MP.py
    CUDA_VISIBLE_DEVICES=0,1 python pytorch_MP.py --model vit_b_16
    python pytorch_MP.py --device cpu --dataset synthetic --no-pretrained   # one device: both halves on it

Shows what splitting the model costs against replicating it: each GPU holds half the weights (split
by parameter count) and its optimizer state, but works only while the other waits, because the
second half needs the first half's activations and backward runs the other way. pipeline_bubble_pct
is each GPU's idle share; pytorch_PP.py fills the gaps with micro-batches. With fewer than two GPUs
both halves run on the one device (the row's num_devices says 1).
"""
import copy
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
    evaluate,
    fit,
    init_distributed,
    launch,
    require_single_process,
    save_final,
    steps_per_epoch,
)
from common.measure.bubble import Bubble, Lane
from common.models import stages
from common.pipeline import plan, split


class TwoDevices(nn.Module):
    """The model's two halves on two devices; activations cross forward, their gradients backward.
    Registered as `module`, so saved keys are torchvision's; the halves share its submodules."""

    def __init__(self, model: nn.Module, devices: list[torch.device], example: torch.Tensor):
        super().__init__()
        self.module, self.devices = model, devices
        self.halves = tuple(half.to(d) for half, d in zip(split(model, plan(model, 2), example), devices))
        self.traced = not stages(model)  # halves traced for the training batch's shape: evaluate the whole
        self.lanes = [Lane(devices[0])] * 2 if devices[0] == devices[1] else [Lane(d) for d in devices]

    def forward(self, x):
        (a, b), (la, lb) = self.halves, self.lanes
        la.begin()
        h = a(x.to(self.devices[0]))
        la.end()
        h1 = h.to(self.devices[1])  # the activation copy between the GPUs
        lb.begin()
        out = b(h1)
        lb.end()
        if out.requires_grad:  # backward brackets: b from the logits' gradient to h1's, then a from h's
            out.register_hook(lambda g: lb.begin())
            h1.register_hook(lambda g: lb.end())
            h.register_hook(lambda g: la.begin())  # closed after backward returns (see main)
        return out.to(self.devices[0])  # logits beside the labels


def main(cfg):
    require_single_process(__file__)
    info = init_distributed(cfg)
    rank, world_size, device = info.rank, info.world_size, info.device
    configure_backends(cfg, device)
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)

    two = device.type == "cuda" and torch.cuda.device_count() > 1
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)] if two else [device, device]
    if not two:
        print(f"note: fewer than two GPUs: both halves run on {device} (the split, not its speed-up)", flush=True)
    model = TwoDevices(build_model(cfg), devices, torch.zeros(cfg.batch_size // cfg.grad_accum, 3, cfg.image_size,
                                                              cfg.image_size))
    optimizer = build_optimizer(cfg, model.parameters())
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # fp32 gradients do not underflow
    ctx = nullcontext()
    scaled = ScaledStep(cfg, model, optimizer, scheduler, scaler)  # backward, clip, step, zero_grad, schedule

    def backward(loss):
        scaled.backward(loss)
        model.lanes[0].end()  # the first half's backward is the last work queued on its device

    def evaluate_whole(_, loader, **kwargs):  # the test batches' shape, on the first device
        return evaluate(copy.deepcopy(model.module).to(devices[0]), loader, **kwargs)

    hooks = TrainHooks(backward, scaled.step, devices[0], ctx=ctx, optimizer=optimizer, probe_devices=devices,
                       instruments=[Bubble(list(dict.fromkeys(model.lanes)), devices[0])],
                       evaluate=evaluate_whole if model.traced else None)
    metrics = fit(cfg, model, train_loader, test_loader, hooks,
                  Checkpointer(cfg, __file__, model, optimizer, scheduler, scaler, train_loader))
    save_final(model.module.state_dict(), cfg, __file__)
    return metrics, {"num_devices": len(set(devices))}


if __name__ == "__main__":
    launch(main, __file__)
