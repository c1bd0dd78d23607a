"""Splitting a model into consecutive pieces at the boundaries of its repeated units (model and
pipeline parallelism), and putting the pieces' weights back together.

A ResNet runs stem (conv1, bn1, relu, maxpool) -> layer1..layer4 -> avgpool -> flatten -> fc. Its
four stages are the units a split may cut between: the stem goes with the first piece, the head
with the last, so there are at most four pieces. A Piece holds the original submodules under their
own names, so its state_dict has plain torchvision keys and the union of the pieces' state_dicts
is the whole model's.

Any other family is cut between its repeated blocks (models.blocks: ViT's EncoderBlocks, ConvNeXt's
CNBlocks, ...) by torch.distributed.pipelining's tracer (pipeline() with SplitPoint.BEGINNING at the
first block of each piece after the first): torch.export traces the model's own forward, whatever glue
it has between blocks (ViT's class token, position embedding, the head on token 0), and each stage
module keeps the original parameters under their torchvision names. The trace fixes the batch size
of the example (the micro-batch) and the train/eval mode of every op: models with BatchNorm are
refused there (its mode could not follow --freeze-bn or evaluation), and evaluation runs the whole
model, never the traced pieces.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .config import UsageError
from .distributed import all_gather_object
from .models import blocks, stages

STEM = ("conv1", "bn1", "relu", "maxpool")
HEAD = ("avgpool", "fc")
LAYERS = ("layer1", "layer2", "layer3", "layer4")


class Piece(nn.Module):
    """Consecutive top-level modules of a ResNet, run in order (flatten before fc, as ResNet.forward)."""

    def __init__(self, model: nn.Module, names: list[str]):
        super().__init__()
        for name in names:
            self.add_module(name, model.get_submodule(name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, module in self.named_children():
            x = module(torch.flatten(x, 1) if name == "fc" else x)
        return x


def parse_split(text: str) -> list[int] | None:
    if not text:
        return None
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        raise UsageError(f"--split {text!r}: give units (ResNet stages, blocks) per piece as integers, "
                         f"e.g. 2,2") from None
    return counts


def units(model: nn.Module) -> list[str]:
    """The names a split may cut between: ResNet's four stages, else the model's repeated blocks."""
    return list(LAYERS) if stages(model) else [name for name, _ in blocks(model)]


def plan(model: nn.Module, pieces: int, split: str = "") -> list[int]:
    """Units (ResNet stages, else blocks) per piece: --split as given, else the contiguous split whose
    largest piece has the fewest parameters (parameters, not compute: ResNet's stages have similar
    FLOPs but layer4 holds most of the weights, so a parameter-balanced split is memory-balanced, not
    time-balanced; a ViT's blocks are equal, so there it is both)."""
    names = units(model)
    kind = "ResNet stages" if stages(model) else f"{type(model).__name__} blocks"
    if not names:
        raise UsageError(f"model and pipeline parallelism cut a model between its repeated blocks, and "
                         f"{type(model).__name__} has none; pick e.g. --model resnet18 or vit_b_16")
    if pieces > len(names):
        raise UsageError(f"{pieces} pipeline stages but the model has only {len(names)} {kind} to split at; "
                         f"use at most {len(names)} stages")
    counts = parse_split(split)
    if counts is not None:
        if len(counts) != pieces or sum(counts) != len(names) or min(counts) < 1:
            raise UsageError(f"--split {split}: needs {pieces} positive counts of {kind} summing to "
                             f"{len(names)}, e.g. {','.join(['1'] * (pieces - 1) + [str(len(names) - pieces + 1)])}")
        return counts
    sizes = [sum(p.numel() for p in model.get_submodule(n).parameters()) for n in names]
    best = None
    for cuts in _cuts(len(names), pieces):
        bounds = [0, *cuts, len(names)]
        heaviest = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        if best is None or heaviest < best[0]:
            best = (heaviest, [b - a for a, b in zip(bounds, bounds[1:])])
    return best[1]


def _cuts(n: int, pieces: int, start: int = 1):
    if pieces == 1:
        yield []
        return
    for c in range(start, n - pieces + 2):
        for rest in _cuts(n, pieces - 1, c + 1):
            yield [c, *rest]


def split(model: nn.Module, counts: list[int], example: torch.Tensor | None = None) -> list[nn.Module]:
    """The pieces for `counts` units each; they share the model's modules and parameters (no copy).
    example: one micro-batch of inputs (its shape), for the traced split of a non-ResNet model."""
    if not stages(model):
        return traced(model, counts, example)
    out, first = [], 0
    for i, n in enumerate(counts):
        names = list(LAYERS[first:first + n])
        first += n
        if i == 0:
            names = [*STEM, *names]
        if i == len(counts) - 1:
            names = [*names, *HEAD]
        out.append(Piece(model, names))
    return out


def traced(model: nn.Module, counts: list[int], example: torch.Tensor) -> list[nn.Module]:
    """torch.distributed.pipelining's tracer, cut before the first block of every piece but the first."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise UsageError(f"{type(model).__name__} has BatchNorm: the traced split would fix its train/eval mode; "
                         f"model and pipeline parallelism split ResNets at their stages and BatchNorm-free "
                         f"models (ViT, ConvNeXt, Swin) at their blocks")
    names, bounds = units(model), [sum(counts[:i]) for i in range(1, len(counts))]
    pipe = pipeline(model, mb_args=(example,), split_spec={names[b]: SplitPoint.BEGINNING for b in bounds})
    pieces = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    for piece in pieces:
        # the trace keeps each op's memory layout: a ViT's token activations come out as a transposed view
        # (strides (768, 3072, 1)) and so do their gradients, and point-to-point sends need contiguous
        # buffers (gloo: "input tensor has to be contiguous")
        piece.register_forward_pre_hook(_contiguous_input_grads)
        piece.register_forward_hook(lambda module, args, out: _contiguous(out))
    return pieces


def _contiguous(out):
    if isinstance(out, torch.Tensor):
        return out.contiguous()
    return type(out)(_contiguous(o) for o in out) if isinstance(out, (tuple, list)) else out


def _contiguous_input_grads(module, args) -> None:
    for t in args:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda g: g.contiguous())


def gather_state_dict(pieces: list[nn.Module], group=None) -> dict:
    """Every rank's pieces' weights, on every rank, as one CPU state_dict with torchvision keys (a
    collective over `group`; pieces of the same keys on several ranks, data-parallel copies, agree)."""
    local = {}
    for piece in pieces:
        local.update({k: v.detach().cpu() for k, v in piece.state_dict().items()})
    return {k: v for part in all_gather_object(local, group) for k, v in part.items()}


def evaluate_whole(model: nn.Module, pieces: list[nn.Module], device: torch.device, evaluate, loader, /, **kwargs):
    """A pipeline's evaluation: every rank's pieces gathered into a copy of the whole model on this rank's
    device, each rank its test shard. A copy, dropped afterwards with the allocator's cache: the pieces share
    the model's modules (split), so moving the model itself there would leave every other stage's weights
    resident and in the next epoch's peak memory. kwargs: evaluate's own (its device among them)."""
    import copy

    whole = copy.deepcopy(model).to(device)
    whole.load_state_dict(gather_state_dict(pieces))
    try:
        return evaluate(whole, loader, **kwargs)
    finally:
        del whole
        if device.type == "cuda":
            torch.cuda.empty_cache()
