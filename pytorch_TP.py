"""Tensor parallelism (torch.distributed.tensor.parallel), Megatron-style, on a vision transformer; the
ranks left over train as FSDP2 data parallelism on a 2-D (dp x tp) device mesh, as torchtitan does.

    torchrun --nproc_per_node 4 pytorch_TP.py --model vit_b_16                # tp 4: every GPU splits every block
    torchrun --nproc_per_node 8 pytorch_TP.py --model vit_b_16 --tp 2         # tp 2 x FSDP over dp 4
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST0:29500 \\
        pytorch_TP.py --model vit_l_16 --tp 8                                # tp inside a node, FSDP across
    torchrun --nproc_per_node 2 pytorch_TP.py --model vit_b_16 --image-size 32 --device cpu --dataset synthetic \\
        --no-pretrained                                                      # CPU, gloo

Shows the other half of model parallelism (seed 004's 层内并行): each rank holds 1/tp of every block's
attention heads and MLP units (common/tensor_parallel.py), so weights, gradients and optimizer state
shrink by tp without any gathering, but every block all-reduces its activations twice in forward and
twice in backward: batch x tokens x hidden per call, on the critical path. tp ranks are neighbours on
the mesh's inner dimension (one node's fast links); the tp ranks of one dp group see the same batch.
Only models with nn.MultiheadAttention blocks split (torchvision's ViTs): the config's ResNet50 is refused.
Final weights are gathered to rank 0 and saved with torchvision's keys (q, k, v packed into in_proj).
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from common import (
    DTYPES,
    DCPCheckpointer,
    DistributedConfig,
    ScaledStep,
    TrainHooks,
    UsageError,
    build_loaders,
    build_model,
    build_optimizer,
    build_scheduler,
    check_dtype_support,
    configure_backends,
    evaluate,
    fit,
    init_distributed,
    launch,
    opt,
    save_final,
    steps_per_epoch,
)
from common.distributed import fsdp_no_sync
from common.models import blocks
from common.tensor_parallel import (
    check_degree,
    check_layout,
    default_degree,
    merge_attention,
    param_groups,
    plan,
    same_kernels_on_every_rank,
    split_attention,
)


@dataclass
class TPConfig(DistributedConfig):
    tp: int = opt(0, "tensor-parallel degree: ranks that split every block; the world size over it is the "
                  "FSDP data-parallel degree; 0 = the largest dividing both a node's processes and the heads", min=0)

    # one loss on tp ranks, DTensor and plain gradients mixed: a norm over them is not offered
    OMIT = ("compile", "clip_grad_norm", "grad_checkpointing")


def main(cfg):
    info = init_distributed(cfg, standalone_group=True)
    world_size, device = info.world_size, info.device
    configure_backends(cfg, device)
    same_kernels_on_every_rank(device)  # the replicated weights' gradients, bitwise equal on the tp ranks
    check_dtype_support(cfg.precision, device, cfg)
    model = split_attention(build_model(cfg)).to(device)  # same weights, q/k/v apart; every rank builds all of it
    cfg.tp = cfg.tp or default_degree(world_size, model)  # 0: e.g. 4 on a node of 8 GPUs for 12 heads, 1 on one
    if world_size % cfg.tp:
        raise UsageError(f"--tp {cfg.tp} does not divide the {world_size} processes")
    check_degree(model, cfg.tp)
    check_layout(cfg.channels_last, world_size, cfg.tp)
    dp = world_size // cfg.tp
    mesh = init_device_mesh(device.type, (dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    # the tp ranks of a dp group see the same images: loaders by dp rank
    train_loader, test_loader = build_loaders(cfg, mesh.get_local_rank("dp"), dp, device)

    for _, block in blocks(model):  # each EncoderBlock: heads and MLP units split over the tp ranks
        parallelize_module(block, mesh["tp"], plan())
    if dp > 1:
        for _, block in blocks(model):  # 2-D: the tp shards themselves sharded over dp
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    optimizer = build_optimizer(cfg, param_groups(model))  # split and replicated apart: see param_groups
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    dtype = DTYPES[cfg.precision]
    # bf16 by autocast, as torchtitan without FSDP: the per-op casts happen on the DTensors (fp32 weights,
    # gradients and optimizer state stay). No fp16: GradScaler's unscale is one foreach call over every
    # gradient, and torch 2.14 refuses DTensor and plain gradients mixed in it
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    ctx = nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    scaled = ScaledStep(cfg, model, optimizer, scheduler, scaler)  # backward, step, zero_grad, schedule

    def evaluate_dp(model, loader, **kwargs):  # counts summed over dp: tp ranks saw the same samples
        return evaluate(model, loader, group=mesh["dp"].get_group(), **kwargs)

    hooks = TrainHooks(scaled.backward, scaled.step, device, ctx=ctx, optimizer=optimizer,
                       no_sync=(lambda: fsdp_no_sync(model)) if dp > 1 else nullcontext, evaluate=evaluate_dp,
                       skipped_steps=scaled.skipped_steps)
    metrics = fit(cfg, model, train_loader, test_loader, hooks,
                  DCPCheckpointer(cfg, __file__, model, optimizer, scheduler, scaler, train_loader))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    save_final(merge_attention(full), cfg, __file__)  # a collective above; rank 0 writes
    return metrics, {"strategy": "tp" if dp == 1 else "tp_fsdp", "tp_size": cfg.tp}


if __name__ == "__main__":
    launch(main, __file__, cfg_cls=TPConfig)
