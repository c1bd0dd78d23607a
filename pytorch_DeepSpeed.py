"""DeepSpeed ZeRO (stage 1, 2 or 3 from the JSON), with the project's own optimizer and schedule.

    deepspeed --num_gpus 4 pytorch_DeepSpeed.py --deepspeed_config config/zero_stage2_config.json
    deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 4 pytorch_DeepSpeed.py   # several nodes
    torchrun --nproc_per_node 4 pytorch_DeepSpeed.py --deepspeed_config config/zero_stage3_config.json
    deepspeed --num_gpus 2 pytorch_DeepSpeed.py --device cpu --dataset synthetic --no-pretrained  # CPU, gloo

Shows ZeRO's memory savings (1: optimizer state sharded, 2: + gradients, 3: + parameters) and their
communication cost on the articles' setup, which the articles never got running. The JSON's "auto"
values are filled from --batch-size, --clip-grad-norm and --precision (gradient_accumulation_steps: 1,
the scripts do not accumulate); explicit values must agree. The optimizer is a plain torch one
(no fused-Adam build), the schedule the same as every other script's. Saves a DeepSpeed checkpoint
and the consolidated fp32 model_final.pt.
"""
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede the deepspeed import
import deepspeed  # noqa: E402
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: E402

from common import (  # noqa: E402
    DTYPES,
    DeepSpeedCheckpointer,
    DistributedConfig,
    TrainHooks,
    barrier,
    build_loaders,
    build_model,
    build_optimizer,
    build_scheduler,
    check_dtype_support,
    configure_backends,
    fit,
    global_rank,
    init_distributed,
    launch,
    opt,
    per_rank_batch,
    require_cuda,
    save_final,
    steps_per_epoch,
)
from common.deepspeed_config import join_deepspeed, read_ds_json, resolve_ds_config  # noqa: E402


@dataclass
class DeepSpeedConfig(DistributedConfig):
    OMIT = ("compile", "grad_accum")  # DeepSpeed has its own compile config and accumulates inside step()
    deepspeed_config: str = opt("config/zero_stage2_config.json", "DeepSpeed JSON (relative to the working "
                                "directory or the project): ZeRO stage, precision, batch keys")
    offload: bool = opt(False, "ZeRO-Offload: optimizer state (stage 2/3) and parameters (stage 3) in host memory")
    local_rank: int = opt(-1, "passed by the deepspeed launcher; LOCAL_RANK from the environment is used")


def main(cfg):
    read_ds_json(cfg.deepspeed_config)  # a bad file refused before the group and DeepSpeed's comm layer start
    info = init_distributed(cfg, standalone_group=True)
    join_deepspeed(cfg)  # DeepSpeed's comm layer over this group, with --dist-timeout-s
    rank, world_size, device = info.rank, info.world_size, info.device
    configure_backends(cfg, device)
    if cfg.offload:
        require_cuda(device, "--offload moves ZeRO state from GPU to host memory: it needs CUDA devices")
    ds_config, precision = resolve_ds_config(cfg, cfg.deepspeed_config, world_size, per_rank_batch(cfg, world_size),
                                             cfg.offload)
    check_dtype_support(precision, device, cfg)
    dtype = DTYPES[precision]
    train_loader, test_loader = build_loaders(cfg, rank, world_size, device)

    model = build_model(cfg).to(device)
    # foreach: ZeRO steps it on one flat partition per group (nothing for a fused kernel to gather), and on the
    # host where the JSON offloads it; DeepSpeed's own overflow check syncs either way (stage_1_and_2.py)
    optimizer = build_optimizer(cfg, model.parameters(), fused=False)
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch(cfg, train_loader))
    # the engine owns loss scaling (fp16), clipping, the optimizer step, zero_grad and scheduler.step
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                           config=ds_config)
    ctx = nullcontext()  # DeepSpeed casts the parameters for fp16/bf16 (not BatchNorm's statistics: see models.py)

    hooks = TrainHooks(engine.backward, engine.step, device, ctx=ctx, input_dtype=dtype, optimizer=optimizer,
                       skipped_steps=lambda: engine.skipped_steps, precision=precision)  # non-finite: any precision
    metrics = fit(cfg, engine, train_loader, test_loader, hooks,
                  DeepSpeedCheckpointer(cfg, __file__, engine, optimizer, scheduler, None, train_loader))
    stage = ds_config["zero_optimization"].get("stage", 0)
    if stage == 0:  # no partitions: every rank holds the whole model (zero_to_fp32 reads ZeRO files only);
        # in fp16/bf16 these are the half weights the row's accuracy was measured with, upcast
        save_final(engine.module.state_dict(), cfg, __file__)
    else:
        ckpt_dir = os.path.join(cfg.save_dir, "pytorch_DeepSpeed", "ds_checkpoint")
        engine.save_checkpoint(ckpt_dir, tag="final")  # every rank writes its shard
        barrier()
        if global_rank() == 0:
            save_final(get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag="final"), cfg, __file__)
    return metrics, {"precision": precision,
                     "strategy": f"deepspeed_zero{stage}" + ("_offload" if cfg.offload else "")}


if __name__ == "__main__":
    launch(main, __file__, cfg_cls=DeepSpeedConfig)
