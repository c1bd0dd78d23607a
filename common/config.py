"""Typed configuration by concern: defaults here, then the YAML file (--config), then command-line flags.

    EvalConfig         data, model, precision, device and output: what every tool reads
    TrainConfig        + training data and model options, optimization, measurement, saved state
    DistributedConfig  + the process-group backend (multi-process scripts)

A script subclasses the one it needs and adds its own fields; model_inference.py extends
EvalConfig, so its --help shows no training flag. Every field's metadata is its documentation
(shown by --help, grouped by the class that defines it) and its validation (choices, min). A YAML
key that no config of the project names is an error; a key another tool uses (the shared
config/classifier_cifar10.yaml holds training keys) is ignored by a tool that does not.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import yaml

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(PROJECT_ROOT, "config", "classifier_cifar10.yaml")


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2, nothing written to results."""


def opt(default, help, choices=None, min=None, max=None, below=None, hidden=False):
    """A config field; min and max bound it inclusively, below exclusively. hidden: set by the harness
    (benchmark.py, calibrate), not typed by users: accepted, but left out of --help (docs/configuration.md
    lists them)."""
    return field(default=default, metadata={"help": help, "choices": choices, "min": min, "max": max,
                                            "below": below, "hidden": hidden})


@dataclass
class EvalConfig:
    """data, model, precision, device and output"""
    # --- data ---
    dataset: str = opt("cifar10", "data; synthetic has CIFAR10's shapes and needs no download",
                       choices=("cifar10", "synthetic"))
    data_dir: str = opt("data", "CIFAR10 folder (holds cifar-10-batches-py/); downloaded there when missing")
    image_size: int = opt(224, "side of the square image, pixels (CIFAR10 is 32, resized)", min=8)
    test_samples: int = opt(0, "use the first N test samples (synthetic: dataset size); 0 = all 10,000", min=0)
    workers: int = opt(4, "DataLoader worker processes per rank", min=0)
    loader: str = opt("torch", "input pipeline: torch = DataLoader with CPU transforms; "
                      "gpu = whole uint8 dataset on the device, transforms on the device",
                      choices=("torch", "gpu"))
    # --- model ---
    model: str = opt("resnet50", "any torchvision classification model name")
    channels_last: bool = opt(False, "NHWC memory format for model and inputs (faster convs on tensor cores)")
    compile: bool = opt(False, "torch.compile the model (compile time reported apart from the timed figures)")
    # --- precision and device ---
    precision: str = opt("fp32", "numeric precision (the choices depend on the script)")
    tf32: bool = opt(False, "allow TF32 tensor cores for fp32 matmul/conv (Ampere and newer)")
    device: str = opt("auto", "auto = cuda when available", choices=("auto", "cuda", "cpu"))
    # --- output ---
    seed: int = opt(0, "seed for weights, data order, augmentation and synthetic data", min=0)
    results: str = opt("results/summary.csv", "CSV that gets one row per run")
    config: str = opt(DEFAULT_CONFIG, "YAML file with defaults for any of these fields")

    # fields of a parent class this script does not use: no flag; a YAML value other than the
    # default is refused (e.g. --compile for DeepSpeed engines)
    OMIT: ClassVar[tuple[str, ...]] = ()


@dataclass
class TrainConfig(EvalConfig):
    """training"""
    # --- data ---
    train_samples: int = opt(0, "use the first N training samples (synthetic: dataset size); 0 = all 50,000", min=0)
    augment: bool = opt(True, "random crop (padding size/8) and horizontal flip on training images")
    # --- model ---
    pretrained: bool = opt(True, "start from ImageNet weights (head replaced for 10 classes)")
    freeze_bn: bool = opt(False, "BatchNorm in eval mode while training (running statistics frozen): "
                          "the loss no longer depends on how the batch is split over ranks")
    grad_checkpointing: bool = opt(False, "recompute each of the model's repeated blocks in backward (ResNet's "
                                   "BasicBlock/Bottleneck, ViT's EncoderBlock, ConvNeXt's CNBlock, ...): less "
                                   "activation memory, about one more forward of compute")
    # --- optimization ---
    epochs: int = opt(5, "passes over the training set", min=1)
    batch_size: int = opt(128, "GLOBAL batch per optimizer step, images (split over ranks and --grad-accum)", min=1)
    grad_accum: int = opt(1, "micro-batches accumulated per optimizer step", min=1)
    lr: float = opt(0.01, "peak learning rate", min=0.0)
    momentum: float = opt(0.9, "SGD momentum (AdamW: beta1)", min=0.0, below=1.0)  # 1: AdamW refuses, SGD never decays
    weight_decay: float = opt(5e-4, "weight decay (decoupled for AdamW)", min=0.0)
    optimizer: str = opt("sgd", "optimizer", choices=("sgd", "adamw"))
    scheduler: str = opt("cosine", "learning-rate schedule after warm-up", choices=("cosine", "none"))
    warmup_steps: int = opt(100, "linear learning-rate warm-up, optimizer steps", min=0)
    clip_grad_norm: float = opt(0.0, "clip the gradient norm to this value; 0 = off", min=0.0)
    max_steps: int = opt(0, "cap on optimizer steps per epoch; 0 = the whole epoch", min=0)
    # --- measurement ---
    timing_warmup_steps: int = opt(10, "first optimizer steps left out of the timed window (throughput, "
                                   "memory peaks, utilization, step times, energy)", min=0)
    comm_steps: int = opt(3, "distributed runs: profile every collective of N steps right after the warm-up, "
                          "before the timed window opens (comm_* columns, step_comm_exposed_ms; on one CPU process "
                          "only the latter); 0 = off", min=0)
    log_every: int = opt(50, "print progress every N optimizer steps (one host sync each); 0 = never", min=0)
    max_nonfinite_steps: int = opt(5, "stop as 'diverged' after this many consecutive non-finite losses", min=1)
    target_accuracy: float = opt(0.0, "evaluate after every epoch and record time_to_target_s, the training "
                                 "time until the test accuracy first reaches this (a fraction: 0.9); 0 = off",
                                 min=0.0, max=1.0)
    loader_probe_batches: int = opt(10, "before training, time this many batches of the input pipeline alone "
                                    "(loader_img_s; a warning when it is the bottleneck); 0 = off", min=0)
    run_name: str = opt("", "label stored in the CSV row's run_name (benchmark.py sets it)", hidden=True)
    repeat: int = opt(0, "launch index stored in the row's repeat (benchmark.py --repeats sets it); 0 = none", min=0,
                 hidden=True)
    scaling: str = opt("", "strong or weak, stored in the row's scaling (benchmark.py --world-sizes sets it)",
                       choices=("", "strong", "weak"), hidden=True)
    figures: str = opt("", "the run's row written there as JSON too, by the rank that writes it (benchmark.py sets "
                       "it beside the run's log and reads the run's figures there)", hidden=True)
    # --- training state ---
    resume: str = opt("", "auto = continue from <save_dir>/<script>/resume when there is one (else start); "
                      "PATH = that checkpoint, which must exist; empty = start from scratch")
    epoch_checkpoints: bool = opt(True, "write the resumable training state after every epoch (atomically; "
                                  "outside the timed window)")
    save_dir: str = opt("checkpoints", "final weights go to <save_dir>/<script>/model_final.pt")


@dataclass
class DistributedConfig(TrainConfig):
    """processes"""
    backend: str = opt("auto", "torch.distributed backend; auto = nccl on cuda, gloo on cpu",
                       choices=("auto", "nccl", "gloo"))
    dist_timeout_s: int = opt(1800, "seconds a rank may wait in one collective before the run fails (NCCL's "
                              "watchdog, gloo's timeout): it must cover what rank 0 does alone while the others "
                              "wait (the data set download, DeepSpeed's consolidation of the final weights)", min=1)


def _type_name(tp) -> str:
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}[tp]


def _check_type(key: str, value: Any, tp: str) -> Any:
    if tp == "bool" and isinstance(value, bool):
        return value
    if tp == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp == "str" and isinstance(value, str):
        return value
    raise UsageError(f"config key '{key}' must be {_type_name(tp)}, got {value!r}")


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _tp(f: dataclasses.Field) -> str:
    return f.type if isinstance(f.type, str) else f.type.__name__


def _known() -> set[str]:
    """Keys some tool of the project reads (script-specific fields aside)."""
    return set(_fields(DistributedConfig))


def load_yaml(path: str, cls=TrainConfig) -> dict[str, Any]:
    """The YAML's values for the fields of cls; keys only other tools read are dropped."""
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise UsageError(f"config file not found: {path}") from None
    except OSError as exc:  # a folder, no permission
        raise UsageError(f"config file {path} cannot be read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must be a mapping of keys to values")
    fields = _fields(cls)
    known = (_known() | set(fields)) - {"config"}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise UsageError(f"unknown config key '{key}' in {path}; allowed: {', '.join(sorted(known))}")
        if name not in fields:
            continue  # another tool's key (e.g. epochs for model_inference.py)
        value = _check_type(name, value, _tp(fields[name]))
        if name in cls.OMIT:
            if value != fields[name].default:
                raise UsageError(f"config key '{key}' in {path}: this script does not support {name}")
            continue
        out[name] = value
    return out


def validate(cfg: EvalConfig) -> EvalConfig:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        choices, low = f.metadata.get("choices"), f.metadata.get("min")
        if choices and value not in choices:
            raise UsageError(f"{f.name} must be one of {', '.join(choices)}; got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):  # nan passes every comparison below
            raise UsageError(f"{f.name} must be a finite number; got {value!r}")
        if low is not None and value < low:
            raise UsageError(f"{f.name} must be >= {low}; got {value!r}")
        high, below = f.metadata.get("max"), f.metadata.get("below")
        if high is not None and value > high:
            raise UsageError(f"{f.name} must be <= {high}; got {value!r}")
        if below is not None and value >= below:
            raise UsageError(f"{f.name} must be < {below}; got {value!r}")
    return cfg


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


OneLineParser = _Parser  # benchmark.py's subcommands refuse bad flags the same way


def _groups(parser, cls) -> dict[str, Any]:
    """One --help section per config class, in definition order (data/model/output first)."""
    groups = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            doc = (klass.__doc__ or "").strip()
            title = doc if doc and len(doc) < 60 and not doc.startswith(klass.__name__) else "this script"
            group = parser.add_argument_group(title)
            for name in klass.__dict__.get("__annotations__", {}):
                groups.setdefault(name, group)
    return groups


def build_parser(cls, description: str, precisions: Sequence[str], **script_defaults) -> argparse.ArgumentParser:
    """--help shows each flag's default as a run without flags gets it (parse_config): the field's, then the
    script's (its first precision), then the default YAML's (config/classifier_cifar10.yaml; model_inference.py's
    batch 128). A default YAML that cannot be read leaves the rest: a run given --config never reads it."""
    shown = {f.name: f.default for f in dataclasses.fields(cls)} | {"precision": precisions[0], **script_defaults}
    try:
        shown |= load_yaml(DEFAULT_CONFIG, cls)
    except UsageError:
        pass
    parser = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                     argument_default=argparse.SUPPRESS)
    groups = _groups(parser, cls)
    for f in dataclasses.fields(cls):
        if f.name in cls.OMIT:
            continue
        group = groups.get(f.name, parser)
        flags = ["--" + f.name.replace("_", "-")]
        if f.name in ("local_rank", "deepspeed_config"):  # DeepSpeed's launcher and docs spell them so
            flags.append("--" + f.name)
        choices = f.metadata.get("choices")
        if f.name == "precision":
            choices = tuple(precisions)
        help_ = argparse.SUPPRESS if f.metadata.get("hidden") else \
            f.metadata["help"] + (f" (default {shown[f.name]})" if shown[f.name] not in ("", None) else "")
        if _tp(f) == "bool":
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, help=help_)
        else:
            group.add_argument(*flags, dest=f.name, type={"int": int, "float": float, "str": str}[_tp(f)],
                                choices=choices, metavar=None if choices else f.name.upper(), help=help_)
    return parser


def parse_config(cls=TrainConfig, description: str = "", precisions: Sequence[str] = ("fp32",),
                 argv: Sequence[str] | None = None, **script_defaults) -> EvalConfig:
    """Defaults < script_defaults < YAML < CLI. Raises UsageError on any bad value."""
    parser = build_parser(cls, description, precisions, **script_defaults)
    args = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    values = dict(script_defaults)
    values.setdefault("precision", precisions[0])
    config_path = args.pop("config", DEFAULT_CONFIG)
    if config_path:
        values.update(load_yaml(config_path, cls))
    values.update(args)
    cfg = validate(cls(config=config_path, **values))
    if cfg.precision not in precisions:
        raise UsageError(f"precision must be one of {', '.join(precisions)} for this script; got {cfg.precision!r}")
    if getattr(cfg, "model", ""):
        # here, before any process group forms: a bad name found after init_process_group makes torchrun
        # restart the group (--max-restarts), and on two nodes the restart can die of a peer already gone
        # (gloo "Connection refused") instead of saying what was wrong
        from .names import unknown_model

        if unknown_model(cfg.model):
            raise UsageError(unknown_model(cfg.model))
    return cfg


def to_flags(values: dict) -> list[str]:
    """{name: value} -> command-line flags (True -> --flag, False -> --no-flag, None -> left out)."""
    out = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        elif value is not None:
            out += [flag, str(value)]
    return out


def resolve(cls, values: dict, config_path: str = DEFAULT_CONFIG) -> EvalConfig:
    """The config a script would build from `values` (its flags as a dict) over the default YAML,
    without parsing a command line; keys cls does not have (script-specific flags) are ignored."""
    fields = _fields(cls)
    merged = load_yaml(config_path, cls) if config_path else {}
    merged.update({k.replace("-", "_"): v for k, v in values.items() if k.replace("-", "_") in fields})
    merged.pop("config", None)
    return cls(config=config_path, **merged)
