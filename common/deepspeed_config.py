"""Reads a DeepSpeed JSON and fills its "auto" values from the run's flags, so the JSON and
--batch-size/--precision can never silently disagree. The optimizer and the schedule come from the
script's flags (client objects, the same as every other script): a JSON that names its own is
refused, since DeepSpeed would otherwise run one and the script believe in the other."""
from __future__ import annotations

import json
import os

from .config import PROJECT_ROOT, TrainConfig, UsageError


def resolve_path(path: str) -> str:
    """As given (absolute or relative to the working directory), else relative to the project."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return os.path.join(PROJECT_ROOT, path)


def _fill(ds: dict, key: str, value, path: str, fix: str = "change the flags"):
    current = ds.get(key, "auto")
    if current == "auto":
        ds[key] = value
    elif current != value:
        raise UsageError(f"{path}: {key} is {current} but the flags give {value}; set it to \"auto\" or {fix}")


def check_accelerator_supports(precision: str) -> None:
    """DeepSpeed refuses a dtype its accelerator does not support, after building the engine and
    with a traceback (engine.py _do_sanity_check). Its CPU accelerator supports fp16 only where
    oneDNN has fp16 kernels (cpu_accelerator.py is_fp16_supported:
    torch.ops.mkldnn._is_mkldnn_fp16_supported(), AVX512-FP16/AMX-FP16 CPUs), so say so first."""
    if precision not in ("fp16", "bf16"):
        return
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if not (acc.is_fp16_supported() if precision == "fp16" else acc.is_bf16_supported()):
        raise UsageError(f"DeepSpeed does not support {precision} on this {acc.device_name()} device "
                         f"(deepspeed.accelerator is_{precision}_supported() is False); use --precision "
                         f"{'bf16' if precision == 'fp16' else 'fp16'} or fp32")


def read_ds_json(path: str) -> dict:
    """The DeepSpeed JSON at path (relative to the working directory or the project) as a dict; a file that is
    missing, unreadable or not a JSON object is refused in one line. pytorch_DeepSpeed.py reads it first, before
    the process group and DeepSpeed's comm layer start (whose op build warns on stderr)."""
    try:
        with open(resolve_path(path)) as fh:
            ds = json.load(fh)
    except FileNotFoundError:
        raise UsageError(f"DeepSpeed config not found: {path}") from None
    except OSError as exc:  # a folder, no permission
        raise UsageError(f"DeepSpeed config {path} cannot be read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"DeepSpeed config {path} is not valid JSON ({exc})") from None
    if not isinstance(ds, dict):
        raise UsageError(f"DeepSpeed config {path} must be a JSON object")
    return ds


def resolve_ds_config(cfg: TrainConfig, path: str, world_size: int, micro_batch: int,
                      offload: bool = False) -> tuple[dict, str]:
    """Returns (config dict for deepspeed.initialize, precision actually used: fp32/fp16/bf16).

    ZeRO-3: stage3_gather_16bit_weights_on_model_save defaults to true here. accelerate's
    get_state_dict (and engine.save_16bit_model) raise without it, since under stage 3 no rank
    holds whole parameters; with it the weights are gathered to rank 0 on save."""
    ds = read_ds_json(path)
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise UsageError(f"{path} defines a {key}; this project takes the optimizer and schedule from "
                             f"--optimizer/--lr/--scheduler (one source of truth): remove the \"{key}\" section")
    _fill(ds, "train_batch_size", cfg.batch_size, path)
    _fill(ds, "train_micro_batch_size_per_gpu", micro_batch, path)
    # the DeepSpeed scripts omit --grad-accum (OMIT in them): cfg.grad_accum is its default, 1
    _fill(ds, "gradient_accumulation_steps", cfg.grad_accum, path,
          fix=f"{cfg.grad_accum} (the DeepSpeed scripts do not accumulate gradients)")
    if ds["train_batch_size"] != ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world_size:
        raise UsageError(f"{path}: train_batch_size must equal micro batch x accumulation x world size ({world_size})")
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = cfg.clip_grad_norm
    enabled = {}
    for name in ("fp16", "bf16"):
        section = ds.setdefault(name, {})
        flag = section.get("enabled", "auto")
        if flag == "auto":
            section["enabled"] = cfg.precision == name
        elif flag is True and cfg.precision not in (name, "fp32"):
            raise UsageError(f"{path} enables {name} but --precision is {cfg.precision}")
        enabled[name] = section["enabled"] is True
    if enabled["fp16"] and enabled["bf16"]:
        raise UsageError(f"{path} enables both fp16 and bf16")
    precision = "fp16" if enabled["fp16"] else "bf16" if enabled["bf16"] else "fp32"
    check_accelerator_supports(precision)
    zero = ds.setdefault("zero_optimization", {"stage": 0})
    # the optimizer is always a torch one (never a DeepSpeed JSON section): DeepSpeed asserts on any
    # optimizer it did not build unless told (engine.py _configure_zero_optimizer)
    ds.setdefault("zero_allow_untested_optimizer", True)
    if zero.get("stage", 0) == 3:
        if zero.setdefault("stage3_gather_16bit_weights_on_model_save", True) is not True:
            raise UsageError(f"{path}: stage3_gather_16bit_weights_on_model_save is false, so the final weights "
                             f"cannot be gathered into model_final.pt; set it to true")
    if offload:
        if zero.get("stage", 0) < 2:
            raise UsageError("--offload needs ZeRO stage 2 or 3 (config/zero_stage2_config.json or stage3)")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        # the optimizer is a torch one: with offload DeepSpeed refuses any but its CPUAdam/CPULion unless told
        # (deepspeed/runtime/engine.py _configure_optimizer, ZeRORuntimeException); the shipped JSONs say so
        ds.setdefault("zero_force_ds_cpu_optimizer", False)
        if zero["stage"] == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return ds, precision


def join_deepspeed(cfg: TrainConfig) -> None:
    """DeepSpeed's communication layer over the process group init_distributed formed. deepspeed.initialize
    would call init_distributed with DeepSpeed's own 10 minutes (deepspeed/constants.py default_pg_timeout,
    or DEEPSPEED_TIMEOUT); it adopts a group torch already has (deepspeed/comm/comm.py init_distributed:
    "The user initialized torch.dist themselves, create cdb and short-circuit"), whose timeout is
    --dist-timeout-s. Joining here, with that timeout, keeps the two the same whichever forms the group."""
    import deepspeed

    from .distributed import dist_timeout

    deepspeed.init_distributed(timeout=dist_timeout(cfg), verbose=False)
