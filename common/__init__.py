"""Shared pieces of the benchmark scripts, one module each:

    config        typed configuration by concern (EvalConfig, TrainConfig, DistributedConfig)
    registry      the one table of scripts: strategy, launcher, precisions, configs
    strategies    the one table of strategies: what the models and advise need of each
    runsetup      what a run is, decided once by the runner, written to the row and read back from it
    launching     the environment and rendezvous port of every process started from another
    data, models  CIFAR10 / synthetic loaders; torchvision classifiers with a 10-class head
    distributed   process group from the launcher's environment; collectives on the run's device
    precision     dtype, autocast, GradScaler step; optim: optimizer and schedule
    train         the train loop (fit), its timed window and evaluation
    checkpoint    resumable state per strategy, the final weights
    pipeline      a ResNet split at its stages (model and pipeline parallelism), weights gathered back
    runner        what happens around every script's main(): config, row, its predictions, exit code
    results       the CSV; report: the Markdown report
    fastexit      the garbage collector's walks over the imports' objects skipped, in the run and at exit
    measure/      the instruments: probes, fingerprint, loader, ...
    predict/      the models: memory, expected volume, step time, as functions of a row and a calibration
    bench/        benchmark.py's subcommands

What each layer may import from: tests/test_imports.py LAYERS.
"""
from . import fastexit  # noqa: F401  (first: see its docstring)

# The names the scripts import, each from its module on first use (PEP 562): a process that needs one
# module (benchmark.py's driver, a report, a results append) does not pay torch and torchvision's import
# (5 s on a slow 2-core host) for the others.
_FROM = {
    "AccelerateCheckpointer": "checkpoint", "Checkpointer": "checkpoint", "DCPCheckpointer": "checkpoint",
    "DeepSpeedCheckpointer": "checkpoint", "RankCheckpointer": "checkpoint", "ZeroCheckpointer": "checkpoint",
    "save_final": "checkpoint", "DistributedConfig": "config", "EvalConfig": "config", "TrainConfig": "config",
    "UsageError": "config", "opt": "config", "parse_config": "config", "build_loaders": "data",
    "per_rank_batch": "data", "DistInfo": "distributed", "barrier": "distributed", "cleanup": "distributed",
    "global_rank": "distributed", "init_distributed": "distributed", "pick_device": "distributed",
    "require_single_process": "distributed", "require_cuda": "distributed", "build_model": "models",
    "build_optimizer": "optim",
    "build_scheduler": "optim", "optimizer_spec": "optim", "steps_per_epoch": "optim", "DTYPES": "precision",
    "ScaledStep": "precision", "check_dtype_support": "precision", "configure_backends": "precision",
    "launch": "runner", "Metrics": "train", "TrainHooks": "train", "evaluate": "train", "fit": "train",
}


def __getattr__(name: str):
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_FROM[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_FROM))


__all__ = [
    "AccelerateCheckpointer", "Checkpointer", "DCPCheckpointer", "DeepSpeedCheckpointer", "RankCheckpointer",
    "ZeroCheckpointer",
    "save_final", "DistributedConfig", "EvalConfig", "TrainConfig", "UsageError", "opt", "parse_config",
    "build_loaders", "per_rank_batch", "DistInfo", "barrier", "cleanup", "global_rank", "init_distributed",
    "pick_device", "require_single_process", "require_cuda", "build_model", "build_optimizer", "build_scheduler",
    "optimizer_spec", "steps_per_epoch", "DTYPES", "ScaledStep", "check_dtype_support", "configure_backends",
    "launch", "Metrics", "TrainHooks", "evaluate", "fit",
]
