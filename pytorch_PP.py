"""Pipeline parallelism (torch.distributed.pipelining): each rank runs consecutive pieces of the model
(ResNet stages; any other family's blocks, e.g. a ViT's EncoderBlocks: common/pipeline.py), every batch
is cut into micro-batches that flow through the ranks.

    torchrun --nproc_per_node 4 pytorch_PP.py --microbatches 8                  # GPipe, 4 stages
    torchrun --nproc_per_node 2 pytorch_PP.py --schedule 1f1b --split 2,2       # 2 ResNet stages per rank
    torchrun --nproc_per_node 2 pytorch_PP.py --schedule interleaved-1f1b       # 2 pipeline stages per rank
    torchrun --nproc_per_node 4 pytorch_PP.py --model vit_b_16                  # 3 EncoderBlocks per rank
    torchrun --nproc_per_node 2 pytorch_PP.py --device cpu --dataset synthetic --no-pretrained   # gloo

Shows what splitting the model costs against replicating it: every rank holds only its stages'
weights and optimizer state, but waits for its neighbours (pipeline_bubble_pct in the row;
textbook (p-1)/(m+p-1) for p equal stages, m micro-batches). Every rank is a pipeline stage (two
with interleaved-1f1b); there are no data-parallel replicas. --batch-size is the batch per optimizer
step, as everywhere; evaluation gathers the weights and shards the test set over all ranks.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from common import (
    DistributedConfig,
    RankCheckpointer,
    ScaledStep,
    TrainHooks,
    UsageError,
    build_loaders,
    build_model,
    build_optimizer,
    build_scheduler,
    configure_backends,
    evaluate,
    fit,
    init_distributed,
    launch,
    opt,
    save_final,
    steps_per_epoch,
)
from common.data import build_test_loader
from common.measure.bubble import Bubble, Lane
from common.pipeline import evaluate_whole, gather_state_dict, plan, split

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


@dataclass
class PPConfig(DistributedConfig):
    schedule: str = opt("gpipe", "gpipe: all forwards, then all backwards; 1f1b: one forward, one backward "
                        "(fewer activations kept); interleaved-1f1b: two stages per rank, smaller bubble",
                        choices=tuple(SCHEDULES))
    microbatches: int = opt(4, "micro-batches each batch is cut into (the pipeline's m)", min=1)
    split: str = opt("", "units per pipeline stage (ResNet stages, else the model's blocks), e.g. 2,2; empty = "
                     "balanced by parameter count")

    # the schedule scales gradients by 1/m itself (accumulating steps would rescale them), and a
    # gradient norm is per stage here: these flags would be wrong, so they are not offered
    OMIT = ("compile", "grad_accum", "clip_grad_norm")


def check(cfg, num_stages, world_size):
    if cfg.batch_size % cfg.microbatches:
        raise UsageError(f"--batch-size {cfg.batch_size} does not split into {cfg.microbatches} micro-batches; "
                         f"use a multiple of {cfg.microbatches}")
    if cfg.schedule == "1f1b" and cfg.microbatches < num_stages:
        raise UsageError(f"--schedule 1f1b needs at least as many micro-batches as stages ({num_stages})")
    rounds = max(1, cfg.microbatches // world_size)  # ScheduleInterleaved1F1B's number_of_rounds
    if cfg.schedule == "interleaved-1f1b" and cfg.microbatches % rounds:
        raise UsageError(f"--schedule interleaved-1f1b needs --microbatches a multiple of {rounds} here")


def main(cfg):
    info = init_distributed(cfg, standalone_group=True)
    rank, world_size, device = info.rank, info.world_size, info.device
    configure_backends(cfg, device)
    num_stages = world_size * (2 if cfg.schedule == "interleaved-1f1b" else 1)
    check(cfg, num_stages, world_size)
    # every rank walks the same batches: the first stage (rank 0's) feeds their images, the last their labels;
    # the other ranks load no image, as the stages of a pipeline that are not its first read none
    train_loader, _ = build_loaders(cfg, 0, 1, device, inputs=rank == 0)
    test_loader = build_test_loader(cfg, rank, world_size, device, max(1, cfg.batch_size // world_size))

    model = build_model(cfg)  # the whole model on every rank first: same initial weights as one process
    micro = torch.zeros(cfg.batch_size // cfg.microbatches, 3, cfg.image_size, cfg.image_size)
    pieces = split(model, plan(model, num_stages, cfg.split), micro)  # ResNet stages; else blocks, traced
    mine = list(range(rank, num_stages, world_size))  # stage i on rank i % world, the library's mapping
    local = nn.ModuleList([pieces[i] for i in mine]).to(device)
    stages = [PipelineStage(pieces[i], i, num_stages, device) for i in mine]
    lane = Lane(device)  # busy time of this rank's forward and backward computations
    for stage in stages:
        stage.forward_one_chunk = lane.timed(stage.forward_one_chunk)
        stage.backward_one_chunk = lane.timed(stage.backward_one_chunk)
    # cross_entropy averages each micro-batch; the schedule divides the summed gradients by m
    schedule = SCHEDULES[cfg.schedule](stages if len(stages) > 1 else stages[0], cfg.microbatches,
                                       loss_fn=F.cross_entropy)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    optimizer = build_optimizer(cfg, local.parameters())
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    scaler = torch.amp.GradScaler(device.type, enabled=False)  # fp32 gradients do not underflow
    scaled = ScaledStep(cfg, local, optimizer, scheduler, scaler)  # step, zero_grad, schedule

    def forward_backward(x, y):
        losses = []
        out = schedule.step(*([x] if first else []), target=y if last else None, losses=losses if last else None)
        return (out, torch.stack(losses).mean()) if last else (None, None)

    def evaluate_gathered(_, loader, **kwargs):  # the whole model on every rank, each its test shard
        return evaluate_whole(model, list(local), device, evaluate, loader, **kwargs)

    hooks = TrainHooks(scaled.backward, scaled.step, device, optimizer=optimizer, forward_backward=forward_backward,
                       evaluate=evaluate_gathered, instruments=[Bubble([lane], device)])
    metrics = fit(cfg, local, train_loader, test_loader, hooks,
                  RankCheckpointer(cfg, __file__, local, optimizer, scheduler, scaler, train_loader))
    save_final(gather_state_dict(list(local)), cfg, __file__)
    return metrics, {"strategy": "pp_" + cfg.schedule.replace("-", "_"), "microbatches": cfg.microbatches}


if __name__ == "__main__":
    launch(main, __file__, cfg_cls=PPConfig)
