"""accelerate, multi-GPU data parallel (DDP underneath): the strategy lives in config/default_DDP.yml.

    accelerate launch --config_file config/default_DDP.yml --num_processes 4 accelerate_DDP.py
    accelerate launch --config_file config/default_DDP.yml --num_machines 2 --num_processes 8 --machine_rank 0 \\
        --main_process_ip HOST0 --main_process_port 29500 accelerate_DDP.py      # the same on each node
    torchrun --nproc_per_node 2 accelerate_DDP.py --device cpu --dataset synthetic --no-pretrained   # CPU

Shows what accelerate costs over hand-written DDP (pytorch_DDP.py): the same all-reduce, hidden
behind prepare()/backward(). Test accuracy through gather_for_metrics with padding masked (the
articles' repository counted 10112 test samples instead of 10000). On CPU, use torchrun:
`accelerate launch --cpu --num_processes 2` starts a single process.
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
    init_distributed,
    launch,
    pick_device,
    save_final,
    steps_per_epoch,
)
from common.accel import (
    AccelerateStep,
    accelerate_precision,
    check_world,
    make_gather_eval,
    process_group_kwargs,
    run_precision,
)


def main(cfg):
    init_distributed(cfg)  # the group first, with its per-attempt store (restarts); accelerate joins it
    accelerator = Accelerator(cpu=pick_device(cfg).type == "cpu", mixed_precision=accelerate_precision(cfg),
                              kwargs_handlers=process_group_kwargs(cfg))
    rank, world_size = check_world(accelerator, cfg)
    if world_size > 1 and accelerator.distributed_type not in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU):
        raise RuntimeError(f"accelerate chose {accelerator.distributed_type}, not DDP")
    device = accelerator.device
    configure_backends(cfg, device)
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)  # sharded by torch.distributed

    model = build_model(cfg).to(device)
    optimizer = build_optimizer(cfg, model.parameters())
    # not prepared: accelerate would step it num_processes times per optimizer step
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    model, optimizer = accelerator.prepare(model, optimizer)  # DDP wrap, autocast and GradScaler if fp16
    ctx = nullcontext()  # prepare() already wrapped forward in autocast when mixed precision is on
    acc = AccelerateStep(cfg, accelerator, model, optimizer, scheduler)  # backward, clip, step, schedule

    hooks = TrainHooks(acc.backward, acc.step, device, ctx=ctx, no_sync=lambda: accelerator.no_sync(model),
                       evaluate=make_gather_eval(accelerator, world_size), skipped_steps=acc.skipped_steps,
                       optimizer=optimizer, precision=run_precision(accelerator))
    metrics = fit(cfg, model, train_loader, test_loader, hooks,
                  AccelerateCheckpointer(cfg, __file__, model, optimizer, scheduler, None, train_loader,
                                         accelerator=accelerator))
    save_final(accelerator.get_state_dict(model), cfg, __file__)
    return metrics, {"precision": run_precision(accelerator)}


if __name__ == "__main__":
    launch(main, __file__, cfg_cls=DistributedConfig)
