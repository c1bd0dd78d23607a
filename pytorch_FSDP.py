"""FSDP2 (fully_shard): parameters, gradients and optimizer state sharded over the ranks.

    torchrun --nproc_per_node 4 pytorch_FSDP.py                              # full shard, fp32
    torchrun --nproc_per_node 4 pytorch_FSDP.py --sharding shard-grad-op --precision bf16
    torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --rdzv_endpoint HOST0:29500 \\
        pytorch_FSDP.py --sharding hybrid                                   # shard in a node, replicate across
    torchrun --nproc_per_node 2 pytorch_FSDP.py --device cpu --dataset synthetic --no-pretrained   # gloo

Shows what sharding saves per GPU and what it costs in communication: every block of the model
(ResNet's Bottleneck, ViT's EncoderBlock: common/models.py blocks) is its own FSDP unit (all-gathered
just before use, freed after), the root holds the stem and the head. ResNet50's 25.6 M parameters are
small: expect memory close to DDP's, since activations dominate; try --model vit_l_16 for the opposite.
Final weights are gathered to rank 0 into the same plain model_final.pt every script writes.
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

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
    fit,
    init_distributed,
    launch,
    opt,
    require_cuda,
    save_final,
    steps_per_epoch,
)
from common.distributed import fsdp_no_sync
from common.models import blocks


@dataclass
class FSDPConfig(DistributedConfig):
    sharding: str = opt("full-shard", "full-shard: reshard after forward (least memory); shard-grad-op: keep "
                        "gathered weights from forward to backward (less communication); hybrid: shard within "
                        "a node, replicate across nodes", choices=("full-shard", "shard-grad-op", "hybrid"))
    cpu_offload: bool = opt(False, "keep sharded parameters, gradients and optimizer state in host memory")


def build_mesh(cfg, world_size, device):
    import os

    if cfg.sharding != "hybrid":
        return init_device_mesh(device.type, (world_size,))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % per_node:
        raise UsageError(f"--sharding hybrid needs the same process count on every node ({world_size} "
                         f"processes, {per_node} on this node)")
    return init_device_mesh(device.type, (world_size // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def main(cfg):
    info = init_distributed(cfg, standalone_group=True)
    rank, world_size, device = info.rank, info.world_size, info.device
    configure_backends(cfg, device)
    check_dtype_support(cfg.precision, device, cfg)
    if cfg.cpu_offload:
        require_cuda(device, "--cpu-offload moves sharded state from GPU to host memory: it needs CUDA devices")
    dtype = DTYPES[cfg.precision]
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)

    model = build_model(cfg).to(device)
    fsdp_kwargs = dict(
        mesh=build_mesh(cfg, world_size, device),
        reshard_after_forward=cfg.sharding != "shard-grad-op",
        # compute in half, reduce gradients in fp32: sharded fp32 master weights stay exact
        mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
        offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else None,
    )
    fsdp_kwargs = {k: v for k, v in fsdp_kwargs.items() if v is not None}
    for _, block in blocks(model):  # the repeated block (BasicBlock, EncoderBlock, CNBlock, ...): one unit each
        fully_shard(block, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    optimizer = build_optimizer(cfg, model.parameters())
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    # each rank sees only its shard's overflows: the sharded scaler agrees on skipping across ranks
    scaler = ShardedGradScaler(device.type, enabled=dtype == torch.float16)
    ctx = nullcontext()  # MixedPrecisionPolicy casts the parameters (not BatchNorm's statistics: see models.py)
    scaled = ScaledStep(cfg, model, optimizer, scheduler, scaler)  # backward, clip, step, zero_grad, schedule

    hooks = TrainHooks(scaled.backward, scaled.step, device, ctx=ctx, input_dtype=dtype,
                       no_sync=lambda: fsdp_no_sync(model),
                       skipped_steps=scaled.skipped_steps, optimizer=optimizer)
    metrics = fit(cfg, model, train_loader, test_loader, hooks,
                  DCPCheckpointer(cfg, __file__, model, optimizer, scheduler, scaler, train_loader))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    save_final(full, cfg, __file__)  # a collective above; rank 0 alone holds and writes the full weights
    return metrics, {"strategy": f"fsdp_{cfg.sharding}" + ("_offload" if cfg.cpu_offload else "")}


if __name__ == "__main__":
    launch(main, __file__, cfg_cls=FSDPConfig)
