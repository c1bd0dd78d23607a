"""Shared pieces of the benchmark scripts: config, data, model, train loop, probes, results."""
from .checkpoint import AccelerateCheckpointer, Checkpointer, DCPCheckpointer, DeepSpeedCheckpointer, ZeroCheckpointer
from .config import TrainConfig, UsageError, opt, parse_config
from .data import build_loaders, per_rank_batch
from .distributed import DistInfo, barrier, cleanup, global_rank, init_distributed, pick_device, require_single_process
from .models import build_model
from .runner import launch
from .train import (
                         DTYPES,
                         Metrics,
                         build_optimizer,
                         build_scheduler,
                         check_dtype_support,
                         configure_backends,
                         evaluate,
                         fit,
                         optimizer_spec,
                         save_final,
                         steps_per_epoch,
)

__all__ = [
    "AccelerateCheckpointer", "Checkpointer", "DCPCheckpointer", "DeepSpeedCheckpointer", "ZeroCheckpointer",
    "global_rank", "TrainConfig", "UsageError", "opt", "parse_config", "build_loaders", "per_rank_batch",
    "DistInfo", "barrier", "cleanup", "init_distributed", "pick_device", "require_single_process", "build_model",
    "launch", "DTYPES", "Metrics", "build_optimizer", "build_scheduler", "check_dtype_support", "configure_backends",
    "evaluate", "fit", "optimizer_spec", "save_final", "steps_per_epoch",
]
