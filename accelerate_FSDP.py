"""accelerate + FSDP: the sharding strategy lives in config/default_FSDP.yml.

    accelerate launch --config_file config/default_FSDP.yml accelerate_FSDP.py
    accelerate launch --config_file config/default_FSDP.yml --num_machines 2 --machine_rank 0 \\
        --main_process_ip HOST0 --main_process_port 29500 accelerate_FSDP.py      # the same on each node
    torchrun --nproc_per_node 2 accelerate_FSDP.py            # GPUs, plugin built from the defaults below

Shows the articles' accelerate FSDP run against pytorch_FSDP.py's hand-written fully_shard. Started
without `accelerate launch`, the script builds the plugin itself: FSDP2, full shard, each ResNet
block a unit (transformer-style wrap by class name). accelerate's FSDP needs CUDA devices: on CPU
accelerate silently drops the plugin (DistributedType.NO, every rank training alone), so the script
refuses in one line (pytorch_FSDP.py runs FSDP2 on CPU over gloo).
"""
import os
from contextlib import nullcontext

from accelerate import Accelerator, DistributedType, FullyShardedDataParallelPlugin

from common import (
    AccelerateCheckpointer,
    build_loaders,
    build_model,
    build_optimizer,
    build_scheduler,
    configure_backends,
    fit,
    launch,
    pick_device,
    save_final,
    steps_per_epoch,
)
from common.accel import accelerate_precision, check_world, make_gather_eval, require_cuda


def main(cfg):
    require_cuda(pick_device(cfg), "accelerate's FSDP")
    plugin = None
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":  # not under accelerate launch
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                                auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["Bottleneck", "BasicBlock"],
                                                state_dict_type="FULL_STATE_DICT")
    accelerator = Accelerator(mixed_precision=accelerate_precision(cfg), fsdp_plugin=plugin)
    if accelerator.distributed_type != DistributedType.FSDP:  # never train unsharded under an FSDP label
        raise RuntimeError(f"accelerate chose {accelerator.distributed_type}, not FSDP")
    rank, world_size = check_world(accelerator)
    device = accelerator.device
    configure_backends(cfg, device)
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)  # sharded by torch.distributed

    model = build_model(cfg).to(device)
    model = accelerator.prepare(model)  # FSDP wraps before the optimizer sees the (sharded) parameters
    optimizer = build_optimizer(cfg, model.parameters())
    # not prepared: accelerate would step it num_processes times per optimizer step
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    optimizer = accelerator.prepare(optimizer)
    ctx = nullcontext()  # prepare() already wrapped forward in autocast when mixed precision is on

    def backward(loss):
        accelerator.backward(loss)

    def step():
        if cfg.clip_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()

    metrics = fit(cfg, model, train_loader, test_loader, backward=backward, step=step, ctx=ctx, device=device,
                  eval_fn=make_gather_eval(accelerator, world_size),
                  checkpointer=AccelerateCheckpointer(cfg, __file__, model, optimizer, scheduler, None, train_loader,
                                                             accelerator=accelerator))
    save_final(accelerator.get_state_dict(model), cfg, __file__)  # gathers the full weights on rank 0
    return metrics, {"precision": accelerator.mixed_precision if accelerator.mixed_precision != "no" else "fp32"}


if __name__ == "__main__":
    launch(main, __file__, strategy="accelerate_fsdp", precisions=("fp32", "fp16", "bf16"))
