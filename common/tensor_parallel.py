"""Megatron-style tensor parallelism for torchvision's vision transformers (pytorch_TP.py), and the
per-rank model the memory model walks.

torchvision's EncoderBlock attends with nn.MultiheadAttention, which packs q, k and v into one
`in_proj_weight` (3h x h): ColwiseParallel would cut that tensor into row blocks that mix q, k and v
rows, so each rank would get whole q heads and no k or v at all. SplitAttention is the same attention
(F.scaled_dot_product_attention over heads of h/heads, the same weights as three Linears), and
`merge_attention` packs a state_dict back so that model_final.pt loads into a bare torchvision ViT.

The plan per block (Shoeybi et al. 2019, Megatron-LM, section 3: "f" and "g" conjugate operators):
  q, k, v   ColwiseParallel: each rank holds heads/tp heads' rows and attends with its own heads only
  out_proj  RowwiseParallel: each rank's partial sum of its heads' columns, all-reduced (forward "g")
  mlp.0     ColwiseParallel: mlp_dim/tp hidden units per rank; GELU is elementwise, so it stays local
  mlp.3     RowwiseParallel: all-reduced in forward
In backward, the gradient of each block's two replicated inputs (ln_1's and ln_2's outputs) is a
partial sum per rank and is all-reduced once each ("f"): PrepareModuleInput makes the attention's input
one DTensor before q, k and v read it, so their three partial gradients are added as DTensors and
reduced once (torch/distributed/tensor/_api.py _FromTorchTensor.backward redistributes the summed
Partial gradient to Replicate), not three times. LayerNorms, the patch embedding, the class token,
the position embedding and the head stay replicated: every rank computes them on the same replicated
activations, so their gradients agree without communication, as long as every rank runs the same
deterministic kernels (same_kernels_on_every_rank).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import UsageError
from .strategies import FSDP2_NO_CHANNELS_LAST


class SplitAttention(nn.Module):
    """nn.MultiheadAttention(batch_first=True) self-attention without masks, q, k and v as separate
    Linears. The head count follows the weights (q's rows / head_dim): a rank holding heads/tp heads'
    rows attends with those heads."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0, local: int = 1):
        super().__init__()
        self.head_dim, self.dropout = hidden // heads, dropout
        width = hidden // local  # the memory model's per-rank module (local = tp); 1 for the real one
        self.q, self.k, self.v = (nn.Linear(hidden, width) for _ in range(3))
        self.out_proj = nn.Linear(width, hidden)

    def forward(self, query, key=None, value=None, need_weights=False):
        b, t = query.shape[:2]

        def heads(x):  # (b, t, heads x head_dim) -> (b, heads, t, head_dim); heads: this rank's
            return x.view(b, t, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q(query)), heads(self.k(query)), heads(self.v(query)),
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, -1)), None


def _attentions(model: nn.Module):
    for module in model.modules():
        if isinstance(getattr(module, "self_attention", None), nn.MultiheadAttention):
            yield module


def tp_able(model: nn.Module) -> bool:
    return any(True for _ in _attentions(model))


def split_attention(model: nn.Module, local: int = 1) -> nn.Module:
    """Every EncoderBlock's nn.MultiheadAttention swapped for a SplitAttention with its weights (on the
    meta device: shapes only). local > 1: the per-rank shapes of a tp-way split (memory model), with
    the MLP narrowed alike."""
    blocks = list(_attentions(model))
    if not blocks:
        raise UsageError(f"{type(model).__name__} has no nn.MultiheadAttention blocks to split over ranks: tensor "
                         f"parallelism here is for the vision transformers (vit_b_16, vit_l_16, ...)")
    for block in blocks:
        mha = block.self_attention
        if not (mha.batch_first and mha._qkv_same_embed_dim and mha.in_proj_bias is not None):
            raise UsageError("tensor parallelism expects torchvision's attention (batch_first, packed q/k/v, bias)")
        h = mha.embed_dim
        new = SplitAttention(h, mha.num_heads, mha.dropout, local).to(mha.in_proj_weight.device,
                                                                       mha.in_proj_weight.dtype)
        if local == 1 and mha.in_proj_weight.device.type != "meta":
            with torch.no_grad():
                for i, lin in enumerate((new.q, new.k, new.v)):
                    lin.weight.copy_(mha.in_proj_weight[i * h:(i + 1) * h])
                    lin.bias.copy_(mha.in_proj_bias[i * h:(i + 1) * h])
                new.out_proj.load_state_dict(mha.out_proj.state_dict())
        block.self_attention = new
        if local > 1:
            fc1, fc2 = block.mlp[0], block.mlp[3]
            block.mlp[0] = nn.Linear(fc1.in_features, fc1.out_features // local).to(fc1.weight.device, fc1.weight.dtype)
            block.mlp[3] = nn.Linear(fc2.in_features // local, fc2.out_features).to(fc2.weight.device, fc2.weight.dtype)
    return model


def merge_attention(state_dict: dict) -> dict:
    """A SplitAttention model's state_dict with torchvision's keys: q, k, v packed into in_proj."""
    out = {}
    for key, value in state_dict.items():
        head, _, leaf = key.rpartition(".")  # ...self_attention.q, weight
        prefix, _, name = head.rpartition(".")
        if name in ("q", "k", "v") and prefix.endswith("self_attention"):
            if name == "q":
                parts = [state_dict[f"{prefix}.{n}.{leaf}"] for n in "qkv"]
                out[f"{prefix}.in_proj_{leaf}"] = torch.cat(parts)
            continue
        out[key] = value
    return out


def param_groups(model: nn.Module) -> list[dict]:
    """The DTensor parameters (split over the tp ranks) and the plain ones (replicated), as two optimizer
    groups: the foreach step CUDA optimizers take by default (torch/optim/optimizer.py
    _default_to_fused_or_foreach) runs one list per group, and DTensor refuses a list that mixes both
    (torch/distributed/tensor/_dispatch.py: "got mixed torch.Tensor and DTensor")."""
    from torch.distributed.tensor import DTensor

    split = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    return [{"params": ps} for ps in (split, plain) if ps]


def heads(model: nn.Module) -> int:
    """Attention heads per block (torchvision's attention or already split)."""
    for block in model.modules():
        att = getattr(block, "self_attention", None)
        if isinstance(att, SplitAttention):
            return att.q.out_features // att.head_dim
        if isinstance(att, nn.MultiheadAttention):
            return att.num_heads
    return 0


def default_degree(world_size: int, model: nn.Module, environ=None) -> int:
    """--tp 0: the largest degree that divides the heads and the processes of one node (the launcher's local
    world), so that every tp group is consecutive ranks on one node (the mesh is (dp, tp), row-major; torchrun
    numbers a node's ranks consecutively) and its 4 all-reduces per block ride the node's links, never the
    network."""
    from .launching import local_world_size

    local = local_world_size(environ) or world_size
    return math.gcd(math.gcd(world_size, local), heads(model))


def check_degree(model: nn.Module, tp: int) -> None:
    """tp must divide every block's heads and MLP width (each rank takes whole heads); the model's
    attention either torchvision's or already split."""
    for block in model.modules():
        if getattr(block, "self_attention", None) is None:
            continue
        n, mlp = heads(block), block.mlp[0].out_features
        if n % tp or mlp % tp:
            raise UsageError(f"--tp {tp} does not divide the model's {n} attention heads and MLP width {mlp}; "
                             f"use a divisor of {n}")


def same_kernels_on_every_rank(device: torch.device) -> None:
    """The replicated weights stay bitwise equal on the tp ranks only if each computes their gradients with
    the same deterministic kernels. On CUDA, cuDNN autotuning (configure_backends turns it on) times the
    candidate algorithms on each rank apart and may pick another one per rank for the patch embedding's
    convolution, some of them non-deterministic (PyTorch's reproducibility notes: cudnn.benchmark and
    cudnn.deterministic): the copies would drift apart, and rank 0's is the one saved. Without autotuning,
    cuDNN's heuristic picks the same deterministic algorithm on every rank of one GPU model; a ViT has this
    one convolution, so little speed is given up."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


def check_layout(channels_last: bool, world_size: int, tp: int) -> None:
    """The ranks left over tp shard with FSDP2, which takes no channels-last weight; tp alone (tp = world size)
    keeps them."""
    if channels_last and world_size // tp > 1:
        raise UsageError(f"--channels-last with {world_size // tp} data-parallel ranks (--tp {tp} of {world_size} "
                         f"processes): {FSDP2_NO_CHANNELS_LAST}; run without it, or with no data-parallel "
                         f"ranks (--tp {world_size}, where it divides the heads)")


def plan() -> dict:
    """The parallelize_module plan of one EncoderBlock (after split_attention)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    return {
        # one DTensor input for q, k and v: their partial input gradients are summed, then reduced once
        "self_attention": PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                             desired_input_layouts=(Replicate(), None, None)),
        "self_attention.q": ColwiseParallel(),
        "self_attention.k": ColwiseParallel(),
        "self_attention.v": ColwiseParallel(),
        "self_attention.out_proj": RowwiseParallel(),
        "mlp.0": ColwiseParallel(),
        "mlp.3": RowwiseParallel(),
    }
