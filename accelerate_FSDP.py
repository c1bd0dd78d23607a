"""accelerate + FSDP2: the sharding strategy lives in config/default_FSDP.yml.

    accelerate launch --config_file config/default_FSDP.yml --num_processes 4 accelerate_FSDP.py
    accelerate launch --config_file config/default_FSDP.yml --num_processes 4 --mixed_precision bf16 accelerate_FSDP.py
    accelerate launch --config_file config/default_FSDP.yml --num_machines 2 --num_processes 8 --machine_rank 0 \\
        --main_process_ip HOST0 --main_process_port 29500 accelerate_FSDP.py      # the same on each node
    torchrun --nproc_per_node 2 accelerate_FSDP.py            # GPUs, plugin built from the defaults below

Shows the articles' accelerate FSDP run against pytorch_FSDP.py's hand-written fully_shard. The
units are the model's blocks, their class read from the model (Bottleneck for resnet50, BasicBlock
for resnet18, EncoderBlock for vit_b_16; naming one the model lacks makes accelerate raise). Started without
`accelerate launch`, the script builds the plugin from the same defaults as the YAML: FSDP2, full
shard, full state dict. accelerate's FSDP needs CUDA devices: on CPU accelerate silently drops the
plugin (DistributedType.NO, every rank training alone), so the script refuses in one line
(pytorch_FSDP.py runs FSDP2 on CPU over gloo).
"""
from contextlib import nullcontext

from accelerate import Accelerator, DistributedType

from common import (
    AccelerateCheckpointer,
    DistributedConfig,
    TrainHooks,
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
from common.accel import (
    AccelerateStep,
    accelerate_precision,
    check_world,
    fsdp_plugin,
    make_gather_eval,
    process_group_kwargs,
    require_cuda,
    run_precision,
)
from common.distributed import init_distributed, local_rank


def main(cfg):
    device = pick_device(cfg, local_rank())
    require_cuda(device, "accelerate's FSDP")
    init_distributed(cfg)  # the group first, with its per-attempt store (restarts); accelerate joins it
    configure_backends(cfg, device)
    model = build_model(cfg)  # before the plugin: the wrap classes come from the model
    accelerator = Accelerator(mixed_precision=accelerate_precision(cfg), fsdp_plugin=fsdp_plugin(model),
                              kwargs_handlers=process_group_kwargs(cfg))
    if accelerator.distributed_type != DistributedType.FSDP:  # never train unsharded under an FSDP label
        raise RuntimeError(f"accelerate chose {accelerator.distributed_type}, not FSDP")
    rank, world_size = check_world(accelerator, cfg)
    device = accelerator.device
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)  # sharded by torch.distributed

    model = model.to(device)
    optimizer = build_optimizer(cfg, model.parameters(), fused=False)  # prepare() makes them DTensors: no fused SGD
    # not prepared: accelerate would step it num_processes times per optimizer step
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    # FSDP2 needs both at once: prepare() shards the model, then points the optimizer at the shards
    model, optimizer = accelerator.prepare(model, optimizer)
    ctx = nullcontext()  # prepare() wrapped forward in autocast; the policy casts parameters, not BN statistics
    acc = AccelerateStep(cfg, accelerator, model, optimizer, scheduler)  # backward, clip, step, schedule

    hooks = TrainHooks(acc.backward, acc.step, device, ctx=ctx, evaluate=make_gather_eval(accelerator, world_size),
                       no_sync=lambda: accelerator.no_sync(model),  # FSDP2: set_requires_gradient_sync(False)
                       skipped_steps=acc.skipped_steps, optimizer=optimizer, precision=run_precision(accelerator))
    metrics = fit(cfg, model, train_loader, test_loader, hooks,
                  AccelerateCheckpointer(cfg, __file__, model, optimizer, scheduler, None, train_loader,
                                         accelerator=accelerator))
    save_final(accelerator.get_state_dict(model), cfg, __file__)  # gathers the full weights on rank 0
    return metrics, {"precision": run_precision(accelerator)}


if __name__ == "__main__":
    launch(main, __file__, cfg_cls=DistributedConfig)
