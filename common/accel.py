"""accelerate helpers shared by the three accelerate_*.py scripts."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from . import distributed
from .config import TrainConfig, UsageError


def accelerate_precision(cfg: TrainConfig) -> str | None:
    """accelerate's mixed_precision: --precision when given as fp16/bf16, else whatever the accelerate
    config (ACCELERATE_MIXED_PRECISION, set by `accelerate launch --config_file`) says."""
    return {"fp16": "fp16", "bf16": "bf16"}.get(cfg.precision)


def run_precision(accelerator) -> str:
    """What accelerate trains in (fp32, fp16, bf16): its mixed_precision, which `accelerate launch
    --mixed_precision` or ACCELERATE_MIXED_PRECISION sets while --precision stays fp32."""
    return {"fp16": "fp16", "bf16": "bf16"}.get(accelerator.mixed_precision, "fp32")


def check_precision(accelerator) -> None:
    """accelerate on CPU keeps mixed_precision="fp16" but runs no autocast (accelerator.py sets
    native_amp only for fp16 on a GPU-like device): the run would train in fp32 under an fp16 label."""
    from accelerate import DistributedType

    if (accelerator.mixed_precision not in ("no", None) and not accelerator.native_amp
            and accelerator.distributed_type != DistributedType.DEEPSPEED):
        raise UsageError(f"accelerate runs {accelerator.mixed_precision} mixed precision only on a GPU here (on "
                         f"{accelerator.device.type} it would silently train in fp32); use --precision bf16 or fp32")


def check_no_dynamo(accelerator) -> None:
    """accelerate's own compile (`accelerate launch --dynamo_backend`, ACCELERATE_DYNAMO_BACKEND): prepare() would
    compile the model where no timer sees it (accelerator.py prepare_model), the row would say compile False, and
    in fp32 on CUDA it turns TF32 on whatever --tf32 says (accelerate/state.py AcceleratorState.__init__)."""
    from accelerate.utils import DynamoBackend

    backend = accelerator.state.dynamo_plugin.backend
    if backend != DynamoBackend.NO:
        raise UsageError(f"accelerate's dynamo backend ({backend.value.lower()}) compiles the model inside prepare(), "
                         f"untimed and unrecorded; drop it (a script's own --compile is timed apart)")


def check_world(accelerator, cfg: TrainConfig) -> tuple[int, int]:
    """Rank and world size from torch.distributed. Under accelerate's DeepSpeed path on CPU, accelerate
    has been seen reporting num_processes=1 and process_index=0 on every one of 2 ranks: trusting it
    would write two rows and train each rank on the whole data set."""
    from .precision import check_cpu_bf16_convolutions

    check_precision(accelerator)
    check_no_dynamo(accelerator)
    check_cpu_bf16_convolutions(cfg, accelerator.mixed_precision, accelerator.device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if accelerator.num_processes != world and rank == 0:
        print(f"note: accelerate reports {accelerator.num_processes} processes, torch.distributed {world}: "
              f"ranks, data split and metrics follow torch.distributed", file=sys.stderr)
    return rank, world


def make_gather_eval(accelerator, world: int):
    """Evaluation through accelerator.gather_for_metrics when accelerate's world is the real one; the
    loader yields (x, y, valid) shards and padding is dropped by the valid mask, so every test sample
    counts once either way."""
    from .distributed import all_reduce

    @torch.no_grad()
    def evaluate(model, loader, *, ctx, device, input_dtype=torch.float32, channels_last=False):
        model.eval()
        correct = torch.zeros((), dtype=torch.int64, device=device)
        count = torch.zeros((), dtype=torch.int64, device=device)
        for x, y, valid in loader:
            x = x.to(device, dtype=input_dtype, non_blocking=True)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            y, valid = y.to(device), valid.to(device)
            with ctx:
                pred = model(x).argmax(1)
            hits = (pred == y) & valid
            if accelerator.num_processes == world:
                hits, valid = accelerator.gather_for_metrics((hits, valid))
            correct += hits.sum()
            count += valid.sum()
        if accelerator.num_processes != world:
            all_reduce(correct), all_reduce(count)
        return (correct / count).item() if count else float("nan"), int(count)

    return evaluate


def process_group_kwargs(cfg: TrainConfig) -> list:
    """Accelerator(kwargs_handlers=...): --dist-timeout-s for a group accelerate forms itself (its own
    default is 10 minutes on NCCL, accelerate/utils/dataclasses.py InitProcessGroupKwargs), and for
    DeepSpeed's, which accelerate starts with the same kwargs (accelerate/state.py:
    dist.init_distributed(dist_backend=..., auto_mpi_discovery=False, **kwargs)). The scripts form the
    group first (init_distributed, with the same timeout); then both libraries join it as it is."""
    from accelerate.utils import InitProcessGroupKwargs

    from .distributed import dist_timeout

    return [InitProcessGroupKwargs(timeout=dist_timeout(cfg))]


def require_cuda(device: torch.device, what: str) -> None:
    distributed.require_cuda(device, f"{what} needs CUDA devices (on CPU accelerate drops the plugin and every "
                                     "rank trains alone); for FSDP on CPU use pytorch_FSDP.py")


class AccelerateStep:
    """backward and the optimizer step through accelerate (its GradScaler for fp16, its no-op
    clipping under DeepSpeed, whose engine clips from the JSON's gradient_clipping). The scheduler
    is ours, not prepared: accelerate would step it num_processes times per optimizer step. Under FSDP2
    accelerate's scaler is a plain GradScaler, not ShardedGradScaler, and the ranks still skip together: the
    gradients are DTensors, whose found_inf check takes the max over the mesh
    (torch/distributed/tensor/_dispatch.py found_inf_reduce_handler; tests/test_cluster.py)."""

    def __init__(self, cfg: TrainConfig, accelerator, model, optimizer, scheduler):
        self.cfg, self.accelerator, self.model, self.optimizer, self.scheduler = (cfg, accelerator, model, optimizer,
                                                                                  scheduler)
        self.skipped = 0

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def step(self) -> None:
        if self.cfg.clip_grad_norm:
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.clip_grad_norm)
        scaler = self.scaler()
        scale = scaler._scale.clone() if scaler is not None else None  # set by the backward's scaler.scale
        self.optimizer.step()  # accelerate's AcceleratedOptimizer.step: scaler.step, then scaler.update
        if scale is not None:
            self.skipped = self.skipped + skipped_by_scale(scale, scaler._scale)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def scaler(self):
        """accelerate's GradScaler where it made an enabled one (fp16 on a GPU, not under DeepSpeed), else None."""
        scaler = getattr(self.accelerator, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    def skipped_steps(self) -> int | None:
        """Steps skipped for overflow (None where accelerate made no scaler). A host sync: after training."""
        return int(self.skipped) if self.scaler() is not None else None


def skipped_by_scale(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """1 where the step was skipped, on the device. accelerate's step_was_skipped is set only when GradScaler
    did not call optimizer.step (accelerate/optimizer.py step), but a fused optimizer, accelerate_DDP.py's on
    CUDA, is stepped every time and skips inside its kernel on found_inf (torch/amp/grad_scaler.py step:
    `_step_supports_amp_scaling`). The scale tells both apart: update() multiplies it in place by
    backoff_factor (< 1) after an overflow and keeps or raises it otherwise (torch._amp_update_scale_). A scale
    halved down to 0 stays there, and then every step overflows (the gradients are unscaled by 1/0)."""
    return ((after < before) | (after == 0)).to(torch.int64)


def fsdp_plugin(model):
    """accelerate's FSDP plugin: what `accelerate launch --config_file config/default_FSDP.yml` put in
    the environment (FSDP_*), else the YAML's defaults, and the wrap classes read from the model
    unless the YAML names them (accelerate raises "Could not find the transformer layer class" for a
    class the model does not have: Bottleneck is resnet50's block, BasicBlock resnet18's)."""
    from accelerate import FullyShardedDataParallelPlugin

    from .models import block_classes

    env = os.environ
    listed = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    kwargs = {"transformer_cls_names_to_wrap": listed.split(",") if listed else block_classes(model)}
    defaults = {"FSDP_VERSION": ("fsdp_version", 2), "FSDP_AUTO_WRAP_POLICY": ("auto_wrap_policy",
                                                                                "transformer_based_wrap"),
                "FSDP_RESHARD_AFTER_FORWARD": ("reshard_after_forward", True),
                "FSDP_STATE_DICT_TYPE": ("state_dict_type", "FULL_STATE_DICT")}
    for var, (name, value) in defaults.items():
        if var not in env:
            kwargs[name] = value
    return FullyShardedDataParallelPlugin(**kwargs)
