"""torchvision classifiers by name, with a 10-class head and optional activation checkpointing."""
from __future__ import annotations

import torch
import torch.nn as nn
import torchvision
from torch.utils.checkpoint import checkpoint

from .config import TrainConfig, UsageError
from .data import NUM_CLASSES


def classification_models() -> list[str]:
    return sorted(torchvision.models.list_models(module=torchvision.models))


def replace_head(model: nn.Module, num_classes: int) -> nn.Module:
    """Swaps the last Linear layer (fc, classifier[-1], heads.head, ...) for a fresh num_classes one."""
    name, last = None, None
    for name_, module in model.named_modules():
        if isinstance(module, nn.Linear):
            name, last = name_, module
    if last is None:
        raise UsageError(f"model {type(model).__name__} has no Linear classifier head to replace")
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    setattr(parent, name.rpartition(".")[2], nn.Linear(last.in_features, num_classes))
    return model


class CheckpointedSequential(nn.Sequential):
    """A ResNet stage that keeps no activations; backward recomputes them. Swapped in by class, so
    state_dict keys, DataParallel replicas and FSDP wrapping see the same module. Caveat: BatchNorm
    running statistics are updated again during the recomputation."""

    def forward(self, x):
        if self.training and torch.is_grad_enabled():
            return checkpoint(super().forward, x, use_reentrant=False)
        return super().forward(x)


def enable_grad_checkpointing(model: nn.Module) -> None:
    stages = [getattr(model, n, None) for n in ("layer1", "layer2", "layer3", "layer4")]
    if not all(type(s) is nn.Sequential for s in stages):
        raise UsageError("--grad-checkpointing supports ResNet-family models (layer1..layer4)")
    for stage in stages:
        stage.__class__ = CheckpointedSequential


def build_model(cfg: TrainConfig, num_classes: int = NUM_CLASSES) -> nn.Module:
    if cfg.model not in classification_models():
        raise UsageError(f"unknown model '{cfg.model}'; any torchvision classification model works, "
                         f"e.g. resnet18, resnet50, mobilenet_v3_small, vit_b_16")
    weights = None
    if cfg.pretrained:
        weights = torchvision.models.get_model_weights(cfg.model).DEFAULT
    try:
        model = torchvision.models.get_model(cfg.model, weights=weights)
    except Exception as exc:  # offline and not cached: urllib errors, hash mismatch, truncated file
        cache = torch.hub.get_dir() + "/checkpoints"
        raise UsageError(f"could not load ImageNet weights for {cfg.model} ({type(exc).__name__}); "
                         f"put {weights.url.rsplit('/', 1)[-1]} in {cache} or use --no-pretrained") from None
    replace_head(model, num_classes)
    if cfg.grad_checkpointing:
        enable_grad_checkpointing(model)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
