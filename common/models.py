"""torchvision classifiers by name, with a 10-class head, optional activation checkpointing, and
BatchNorm that computes in its statistics' precision when a strategy casts only its parameters."""
from __future__ import annotations

import copy
import functools
import inspect

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


def checkpointed(cls: type) -> type:
    """cls whose forward keeps no activations but its inputs; backward recomputes them
    (torch.utils.checkpoint, non-reentrant). A subclass of the same name, swapped in by class, so
    state_dict keys, DataParallel replicas and FSDP's and accelerate's wrapping by class name see the same
    module. Caveat: BatchNorm running statistics are updated again during the recomputation."""
    # the same __name__ (accelerate wraps by class name); pickle finds it here by module and qualname
    qualname = f"Checkpointed_{cls.__module__.replace('.', '_')}_{cls.__qualname__.replace('.', '_')}"
    if qualname not in globals():
        def forward(self, *args, **kwargs):
            inner = super(sub, self).forward
            if self.training and torch.is_grad_enabled():
                return checkpoint(inner, *args, use_reentrant=False, **kwargs)
            return inner(*args, **kwargs)

        sub = type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__, "__qualname__": qualname,
                                          "checkpointed": True})
        globals()[qualname] = sub
    return globals()[qualname]


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


CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks, (qualified name, module) in registration order (torchvision registers
    in forward order): the units FSDP wraps, in one place for the scripts, the memory model (the gathered
    unit) and the expected communication. Found from the model, not named per family.

    A block class is a class with two or more instances that is neither a container (Sequential,
    ModuleList, ModuleDict and their subclasses: ResNet's layer1, ViT's MLPBlock) nor a leaf (it has
    children) and holds parameters, unless most of its parameters sit inside instances of another such
    class (ViT's MultiheadAttention inside EncoderBlock, EfficientNet's SqueezeExcitation inside MBConv).
    resnet18: 8 BasicBlocks; resnet50: 16 Bottlenecks; vit_b_16: 12 EncoderBlocks; swin_t: 12
    SwinTransformerBlocks and 3 PatchMergings; convnext_tiny: 18 CNBlocks; efficientnet_v2_s: its
    FusedMBConvs and MBConvs; googlenet: its Inceptions and its 2 auxiliary heads. A model without one
    (vgg, alexnet) gets []: FSDP shards it as one unit."""
    named = [(n, m) for n, m in model.named_modules()
             if n and not isinstance(m, CONTAINERS) and next(m.children(), None) is not None and _numel(m)]
    by_class: dict[type, list] = {}
    for n, m in named:
        by_class.setdefault(type(m), []).append((n, m))
    repeated = {c: v for c, v in by_class.items() if len(v) >= 2}
    prefixes = {c: tuple(n + "." for n, _ in v) for c, v in repeated.items()}
    kept = set()
    for c, members in repeated.items():
        others = tuple(p for c2, ps in prefixes.items() if c2 is not c for p in ps)
        inside = sum(_numel(m) for n, m in members if n.startswith(others)) if others else 0
        if 2 * inside <= sum(_numel(m) for _, m in members):
            kept.add(c)
    out: list[tuple[str, nn.Module]] = []
    for n, m in named:  # outermost instances only, in registration order
        if type(m) in kept and not any(n.startswith(o + ".") for o, _ in out):
            out.append((n, m))
    return out


def block_classes(model: nn.Module) -> list[str]:
    """Class names of the model's blocks (Bottleneck for resnet50, BasicBlock for resnet18, EncoderBlock
    for vit_b_16), for accelerate's transformer_cls_names_to_wrap. Read from the model, never assumed:
    naming a class the model does not have makes accelerate raise "Could not find the transformer layer
    class"."""
    names: list[str] = []
    for _, block in blocks(model):
        if type(block).__name__ not in names:
            names.append(type(block).__name__)
    return names


def stages(model: nn.Module) -> list[nn.Module]:
    """ResNet's four stages (layer1..layer4), or [] for other families."""
    found = [getattr(model, n, None) for n in ("layer1", "layer2", "layer3", "layer4")]
    return found if all(isinstance(s, nn.Sequential) for s in found) else []


def enable_grad_checkpointing(model: nn.Module) -> None:
    """Every block of blocks() recomputed in backward: the unit FSDP wraps is the unit recomputed."""
    found = blocks(model)
    if not found:
        raise UsageError(f"--grad-checkpointing recomputes the model's repeated blocks, and "
                         f"{type(model).__name__} has none (VGG and AlexNet are plain layer stacks)")
    for _, block in found:
        if not getattr(block, "checkpointed", False):
            block.__class__ = checkpointed(type(block))


@functools.lru_cache(maxsize=32)
def size_kwargs(name: str, image_size: int | None) -> tuple:
    """The constructor argument of a family built for one input size, as (key, value) pairs: ViT's
    image_size (its position embedding has one entry per patch), MaxViT's input_size; () for the rest,
    which pool to any size. Read from the class's signature, built once on the meta device."""
    if image_size is None:
        return ()
    try:
        with torch.device("meta"):
            params = inspect.signature(type(torchvision.models.get_model(name)).__init__).parameters
    except Exception:  # RegNet's constructor reads tensor values (.tolist()), which the meta device has not
        return ()      # got; it pools to any size
    if "image_size" in params:
        return (("image_size", image_size),)
    if "input_size" in params:
        return (("input_size", (image_size, image_size)),)
    return ()


@functools.lru_cache(maxsize=32)
def check_image_size(name: str, image_size: int) -> None:
    """One line for a size the family cannot take (ViT: not a multiple of its patch; AlexNet and
    inception_v3 at 32 px: a map shrinks below its kernel), found by an evaluation forward of one image on
    the meta device. A model the meta device cannot build (RegNet) is left to the run itself."""
    try:
        with torch.device("meta"):
            net = torchvision.models.get_model(name, **dict(size_kwargs(name, image_size))).eval()
    except Exception as exc:
        if size_kwargs(name, image_size):  # a size the constructor itself refuses (ViT's patch grid)
            text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            raise UsageError(f"--image-size {image_size}: {name} cannot take it ({text})") from None
        return
    try:
        with torch.device("meta"), torch.no_grad():
            net(torch.empty(1, 3, image_size, image_size))
    except Exception as exc:
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise UsageError(f"--image-size {image_size}: {name} cannot take it ({text})") from None


def _pretrained(name: str, weights, image_size: int | None) -> nn.Module:
    """The ImageNet weights in a model built for the run's size. torchvision pins a ViT to its weights' size
    (_ovewrite_named_param); its position embedding is interpolated to the run's patch grid by torchvision's
    own vision_transformer.interpolate_embeddings, as its fine-tuning recipes do."""
    model = torchvision.models.get_model(name, weights=weights)
    sized = dict(size_kwargs(name, image_size))
    native = weights.meta.get("min_size", (None,))[0]
    if not sized or image_size == native:
        return model
    state = model.state_dict()
    target = torchvision.models.get_model(name, **sized)
    if "encoder.pos_embedding" in state and hasattr(target, "patch_size"):
        from torchvision.models.vision_transformer import interpolate_embeddings

        state = interpolate_embeddings(image_size, target.patch_size, state)
    try:
        target.load_state_dict(state)
    except RuntimeError:
        raise UsageError(f"the ImageNet weights of {name} are for {native} px: use --image-size {native} or "
                         f"--no-pretrained") from None
    return target


def build_model(cfg, num_classes: int = NUM_CLASSES, pretrained: bool | None = None) -> nn.Module:
    """cfg.model with a num_classes head, built for cfg.image_size where the family fixes its input size.
    pretrained defaults to cfg.pretrained (False for configs without it: model_inference.py loads its
    weights from a checkpoint, never from the internet)."""
    pretrained = getattr(cfg, "pretrained", False) if pretrained is None else pretrained
    check_model_name(cfg.model)
    image_size = getattr(cfg, "image_size", None)
    if image_size is not None:
        check_image_size(cfg.model, image_size)
    weights = None
    if pretrained:
        weights = torchvision.models.get_model_weights(cfg.model).DEFAULT
    try:
        if weights is None:
            model = torchvision.models.get_model(cfg.model, **dict(size_kwargs(cfg.model, image_size)))
        else:
            model = _pretrained(cfg.model, weights, image_size)
    except UsageError:
        raise
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


# --- the model on the meta device: its facts without allocating it ----------------------------------

def meta_model(name: str, grad_checkpointing: bool = False, image_size: int | None = None, tp: int = 1) -> nn.Module:
    """The project's model (10-class head, its BatchNorm, optional checkpointed blocks) on the meta device,
    built for image_size where the family fixes its input size (ViT). tp > 1: one tensor-parallel rank's
    model (common/tensor_parallel.py): heads/tp heads and mlp_dim/tp MLP units per block, the rest whole.
    Its parameters are the rank's local shards and its forward saves what the rank's forward saves."""
    from .tensor_parallel import split_attention

    model = copy.deepcopy(_meta_built(name, grad_checkpointing, image_size))  # the callers change theirs (.to)
    return split_attention(model, local=tp) if tp > 1 else model


@functools.lru_cache(maxsize=16)
def _meta_built(name: str, grad_checkpointing: bool, image_size: int | None) -> nn.Module:
    """Built once a setup: advise's tables and a run's predictions ask for the same model 10-30 times, and a
    copy takes 6-13 ms where vit_b_16's build takes 350."""
    class Cfg:  # the fields build_model reads
        model, pretrained, channels_last = name, False, False

    Cfg.grad_checkpointing = grad_checkpointing
    Cfg.image_size = image_size
    with torch.device("meta"):
        return build_model(Cfg)


@functools.lru_cache(maxsize=8)
def model_facts(name: str, image_size: int | None = None,
                tp: int = 1) -> tuple[list[torch.Size], list[list[torch.Size]], int]:
    """(parameter shapes, FSDP units' parameter shapes, elements of conv/linear weights) of a model built for
    image_size (a ViT's position embedding has one entry per patch); of one tensor-parallel rank for tp > 1."""
    model = meta_model(name, image_size=image_size, tp=tp)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    return [p.shape for p in model.parameters()], fsdp_units(model), matmul


@functools.lru_cache(maxsize=8)
def norm_numel(name: str) -> int:
    """Elements of a model's BatchNorm weights and biases."""
    return sum(p.numel() for m in meta_model(name).modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
               for p in m.parameters())


def fsdp_units(model: nn.Module) -> list[list[torch.Size]]:
    """The FSDP units pytorch_FSDP.py and accelerate_FSDP.py make: every block of models.blocks (ResNet's
    BasicBlock, ViT's EncoderBlock, ...), then the root with what is left (stem, head). A model without
    repeated blocks is one unit."""
    found = [b for _, b in blocks(model)]
    inner = {id(p) for b in found for p in b.parameters()}
    root = [p.shape for p in model.parameters() if id(p) not in inner]
    return [[p.shape for p in b.parameters()] for b in found] + [root]
