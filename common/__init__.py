"""Shared pieces of the benchmark scripts, one module each:

    config        typed configuration by concern (EvalConfig, TrainConfig, DistributedConfig)
    registry      the one table of scripts: strategy, launcher, precisions, configs
    data, models  CIFAR10 / synthetic loaders; torchvision classifiers with a 10-class head
    distributed   process group from the launcher's environment; collectives on the run's device
    precision     dtype, autocast, GradScaler step; optim: optimizer and schedule
    train         the train loop (fit), its timed window and evaluation
    checkpoint    resumable state per strategy, the final weights
    pipeline      a ResNet split at its stages (model and pipeline parallelism), weights gathered back
    runner        what happens around every script's main(): config, row, exit code
    results       the CSV; report: the Markdown report
    fastexit      exit without the final garbage-collector walk (0.7-0.8 s a process)
    measure/      the instruments: probes, fingerprint, loader, ...
"""
from . import fastexit  # noqa: F401  (first: see its docstring)
from .checkpoint import (
    AccelerateCheckpointer,
    Checkpointer,
    DCPCheckpointer,
    DeepSpeedCheckpointer,
    RankCheckpointer,
    ZeroCheckpointer,
    save_final,
)
from .config import DistributedConfig, EvalConfig, TrainConfig, UsageError, opt, parse_config
from .data import build_loaders, per_rank_batch
from .distributed import DistInfo, barrier, cleanup, global_rank, init_distributed, pick_device, require_single_process
from .models import build_model
from .optim import build_optimizer, build_scheduler, optimizer_spec, steps_per_epoch
from .precision import DTYPES, ScaledStep, check_dtype_support, configure_backends
from .runner import launch
from .train import Metrics, TrainHooks, evaluate, fit

__all__ = [
    "AccelerateCheckpointer", "Checkpointer", "DCPCheckpointer", "DeepSpeedCheckpointer", "RankCheckpointer",
    "ZeroCheckpointer",
    "save_final", "DistributedConfig", "EvalConfig", "TrainConfig", "UsageError", "opt", "parse_config",
    "build_loaders", "per_rank_batch", "DistInfo", "barrier", "cleanup", "global_rank", "init_distributed",
    "pick_device", "require_single_process", "build_model", "build_optimizer", "build_scheduler",
    "optimizer_spec", "steps_per_epoch", "DTYPES", "ScaledStep", "check_dtype_support", "configure_backends",
    "launch", "Metrics", "TrainHooks", "evaluate", "fit",
]
