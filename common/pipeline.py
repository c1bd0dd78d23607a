"""Splitting a torchvision ResNet into consecutive pieces at its stage boundaries (model and
pipeline parallelism), and putting the pieces' weights back together.

A ResNet runs stem (conv1, bn1, relu, maxpool) -> layer1..layer4 -> avgpool -> flatten -> fc. Its
four stages are the units a split may cut between: the stem goes with the first piece, the head
with the last, so there are at most four pieces. A Piece holds the original submodules under their
own names, so its state_dict has plain torchvision keys and the union of the pieces' state_dicts
is the whole model's.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .config import UsageError
from .distributed import all_gather_object
from .models import stages

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
        raise UsageError(f"--split {text!r}: give ResNet stages per piece as integers, e.g. 2,2") from None
    return counts


def plan(model: nn.Module, pieces: int, split: str = "") -> list[int]:
    """ResNet stages per piece: --split as given, else the contiguous split whose largest piece has
    the fewest parameters (parameters, not compute: ResNet's stages have similar FLOPs but layer4
    holds most of the weights, so a parameter-balanced split is memory-balanced, not time-balanced)."""
    if not stages(model):
        raise UsageError("model and pipeline parallelism split ResNet-family models (layer1..layer4); "
                         "pick e.g. --model resnet18 or resnet50")
    if pieces > len(LAYERS):
        raise UsageError(f"{pieces} pipeline stages but a ResNet has only {len(LAYERS)} stages to split at; "
                         f"use at most {len(LAYERS)} stages")
    counts = parse_split(split)
    if counts is not None:
        if len(counts) != pieces or sum(counts) != len(LAYERS) or min(counts) < 1:
            raise UsageError(f"--split {split}: needs {pieces} positive counts of ResNet stages summing to "
                             f"{len(LAYERS)}, e.g. {','.join(['1'] * (pieces - 1) + [str(len(LAYERS) - pieces + 1)])}")
        return counts
    sizes = [sum(p.numel() for p in model.get_submodule(n).parameters()) for n in LAYERS]
    best = None
    for cuts in _cuts(len(LAYERS), pieces):
        bounds = [0, *cuts, len(LAYERS)]
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


def split(model: nn.Module, counts: list[int]) -> list[Piece]:
    """The pieces for `counts` ResNet stages each; they share the model's modules (no copy)."""
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


def gather_state_dict(pieces: list[nn.Module], group=None) -> dict:
    """Every rank's pieces' weights, on every rank, as one CPU state_dict with torchvision keys (a
    collective over `group`; pieces of the same keys on several ranks, data-parallel copies, agree)."""
    local = {}
    for piece in pieces:
        local.update({k: v.detach().cpu() for k, v in piece.state_dict().items()})
    return {k: v for part in all_gather_object(local, group) for k, v in part.items()}
