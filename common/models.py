"""torchvision classifiers by name, with a 10-class head, optional activation checkpointing, and
BatchNorm that computes in its statistics' precision when a strategy casts only its parameters."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils.checkpoint import checkpoint

from .config import UsageError
from .names import NUM_CLASSES, unknown_model


def check_model_name(name: str) -> None:
    if unknown_model(name):
        raise UsageError(unknown_model(name))


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


class MixedPrecisionBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose weight and bias are used in the dtype of its running statistics.

    Sharded mixed precision casts parameters but not buffers: FSDP2's MixedPrecisionPolicy casts
    only what it shards (parameters), and DeepSpeed 0.19.8 casts parameters and leaves buffers alone
    unless `data_types.buffer_dtype` is set (engine._cast_module_mixed_precision). A BatchNorm then
    holds bf16/fp16 weights beside fp32 running statistics, which batch_norm refuses ("expected
    scalar type BFloat16 but found Float"). Upcasting the (tiny) weight and bias gives batch_norm's
    mixed-type form: half input, fp32 weight, bias and statistics, half output, statistics updated
    in fp32. It is the form CUDA AMP always runs (batch_norm is on no autocast cast list, so under
    autocast it gets half activations and the fp32 module), and CPU implements it as well. With
    weights and statistics of one dtype this is plain BatchNorm2d. Swapped in by class, so
    state_dict keys and FSDP/accelerate wrapping see the same module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = self.running_mean
        if self.weight is None or stats is None or self.weight.dtype == stats.dtype:
            return super().forward(x)
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight.to(stats.dtype),
                            self.bias.to(stats.dtype), self.training, factor, self.eps)


def mixed_precision_batchnorm(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if type(module) is nn.BatchNorm2d:
            module.__class__ = MixedPrecisionBatchNorm2d
    return model


def block_classes(model: nn.Module) -> list[str]:
    """Class names of the ResNet blocks (Bottleneck for resnet50, BasicBlock for resnet18): the
    units FSDP wraps. Read from the model, never assumed: naming a class the model does not have
    makes accelerate raise "Could not find the transformer layer class"."""
    names = []
    for stage in stages(model):
        for block in stage:
            if type(block).__name__ not in names:
                names.append(type(block).__name__)
    return names


def stages(model: nn.Module) -> list[nn.Module]:
    """ResNet's four stages (layer1..layer4), or [] for other families."""
    found = [getattr(model, n, None) for n in ("layer1", "layer2", "layer3", "layer4")]
    return found if all(isinstance(s, nn.Sequential) for s in found) else []


def enable_grad_checkpointing(model: nn.Module) -> None:
    found = stages(model)
    if not found or not all(type(s) is nn.Sequential for s in found):
        raise UsageError("--grad-checkpointing supports ResNet-family models (layer1..layer4)")
    for stage in found:
        stage.__class__ = CheckpointedSequential


def build_model(cfg, num_classes: int = NUM_CLASSES, pretrained: bool | None = None) -> nn.Module:
    """cfg.model with a num_classes head. pretrained defaults to cfg.pretrained (False for configs
    without it: model_inference.py loads its weights from a checkpoint, never from the internet)."""
    pretrained = getattr(cfg, "pretrained", False) if pretrained is None else pretrained
    check_model_name(cfg.model)
    weights = None
    if pretrained:
        weights = torchvision.models.get_model_weights(cfg.model).DEFAULT
    try:
        model = torchvision.models.get_model(cfg.model, weights=weights)
    except Exception as exc:  # offline and not cached: urllib errors, hash mismatch, truncated file
        cache = torch.hub.get_dir() + "/checkpoints"
        raise UsageError(f"could not load ImageNet weights for {cfg.model} ({type(exc).__name__}); "
                         f"put {weights.url.rsplit('/', 1)[-1]} in {cache} or use --no-pretrained") from None
    replace_head(model, num_classes)
    mixed_precision_batchnorm(model)
    if getattr(cfg, "grad_checkpointing", False):
        enable_grad_checkpointing(model)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
