"""accelerate + DeepSpeed ZeRO: the stage lives in config/default_DeepSpeed.yml and the JSON it names.

    accelerate launch --config_file config/default_DeepSpeed.yml --num_processes 4 accelerate_DeepSpeed.py
    accelerate launch --config_file config/default_DeepSpeed.yml --num_machines 2 --num_processes 8 --machine_rank 0 \\
        --main_process_ip HOST0 --main_process_port 29500 accelerate_DeepSpeed.py   # the same on each node
    torchrun --nproc_per_node 2 accelerate_DeepSpeed.py --device cpu --dataset synthetic --no-pretrained

Shows DeepSpeed through accelerate against pytorch_DeepSpeed.py. The JSON (deepspeed_config_file in
the YAML, or --deepspeed-config under torchrun) has its "auto" values filled from the flags, as in
pytorch_DeepSpeed.py. Ranks, the data split and the CSV row follow torch.distributed, not accelerate's
own process count (which has been wrong on CPU).
"""
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede the deepspeed import
from accelerate import Accelerator, DeepSpeedPlugin, DistributedType  # noqa: E402

from common import (  # noqa: E402
    DTYPES,
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
    opt,
    per_rank_batch,
    save_final,
    steps_per_epoch,
)
from common.accel import AccelerateStep, check_world, make_gather_eval, process_group_kwargs  # noqa: E402
from common.deepspeed_config import resolve_ds_config  # noqa: E402


@dataclass
class AccelerateDeepSpeedConfig(DistributedConfig):
    OMIT = ("compile", "grad_accum")  # DeepSpeed has its own compile config and accumulates inside its engine
    deepspeed_config: str = opt("config/zero_stage2_config.json", "DeepSpeed JSON when not set by the accelerate "
                                "config's deepspeed_config_file")


def main(cfg):
    # torch.distributed first: the rank and world every metric relies on
    info = init_distributed(cfg, standalone_group=True)
    world_size = info.world_size
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", cfg.deepspeed_config)
    ds_config, precision = resolve_ds_config(cfg, path, world_size, per_rank_batch(cfg, world_size))
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config)
    # never cpu=True: accelerate then drops the plugin and silently runs plain DDP
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision=precision if precision != "fp32" else "no",
                              kwargs_handlers=process_group_kwargs(cfg))
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise RuntimeError(f"accelerate chose {accelerator.distributed_type}, not DeepSpeed")
    rank, world_size = check_world(accelerator, cfg)
    device = info.device
    configure_backends(cfg, device)
    dtype = DTYPES[precision]
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)  # sharded by torch.distributed

    model = build_model(cfg).to(device)
    optimizer = build_optimizer(cfg, model.parameters(), fused=False)  # ZeRO's flat partitions: pytorch_DeepSpeed.py
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    # the DeepSpeed engine owns loss scaling, clipping, the step and zero_grad; the scheduler stays ours
    model, optimizer = accelerator.prepare(model, optimizer)
    ctx = nullcontext()  # DeepSpeed casts the parameters for fp16/bf16 (not BatchNorm's statistics: see models.py)
    acc = AccelerateStep(cfg, accelerator, model, optimizer, scheduler)  # the engine clips; the schedule is ours

    hooks = TrainHooks(acc.backward, acc.step, device, ctx=ctx, input_dtype=dtype,
                       evaluate=make_gather_eval(accelerator, world_size), optimizer=optimizer,
                       skipped_steps=lambda: model.skipped_steps, precision=precision,  # any non-finite step
                       step_inside_backward=model)  # accelerator.backward steps the engine: timed as the optimizer
    metrics = fit(cfg, model, train_loader, test_loader, hooks,
                  AccelerateCheckpointer(cfg, __file__, model, optimizer, scheduler, None, train_loader,
                                         accelerator=accelerator))
    state = accelerator.get_state_dict(model)  # a collective under ZeRO-3: every rank calls it
    save_final(state, cfg, __file__)
    stage = ds_config["zero_optimization"].get("stage", 0)
    return metrics, {"precision": precision,
                     "strategy": f"accelerate_deepspeed_zero{stage}"}


if __name__ == "__main__":
    launch(main, __file__, cfg_cls=AccelerateDeepSpeedConfig)
