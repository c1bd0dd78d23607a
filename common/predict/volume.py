"""The volume each strategy is expected to send per optimizer step and rank, in nccl-tests' S terms:
what common/measure/comm.py measures (comm_bytes_per_step) is set beside it in the report and the tests."""
from __future__ import annotations

import math

from ..models import meta_model, model_facts
from ..strategies import of


def expected_factors(strategy: str) -> tuple[float, float] | None:
    """(weights, gradients) sent per step in parameter counts for a row's strategy (common/strategies.py sends;
    None: not modelled, e.g. hybrid sharding). Weights travel (gathers, broadcasts) and gradients travel
    (reductions) in their own dtypes under mixed precision, so each strategy's S is split into the two."""
    st = of(strategy)
    return None if st is None else st.sends


def comm_element_bytes(precision: str, strategy: str) -> tuple[int, int]:
    """Bytes of (a sent weight, a sent gradient element) for a row's precision label."""
    if precision.startswith(("pure_", "ds_")):
        # half weights and gradients; DeepSpeed reduces in communication_data_type, which is the
        # model's fp16/bf16 unless the JSON says otherwise (deepspeed/runtime/engine.py)
        return 2, 2
    if precision.startswith("mp_"):
        return 2, 4  # pytorch_FSDP.py: MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32)
    st = of(strategy)
    if precision in ("fp16", "bf16") and st is not None and st.fsdp and st.library == "accelerate":
        # accelerate's FullyShardedDataParallelPlugin.set_mixed_precision: param_dtype = reduce_dtype
        return 2, 2
    return 4, 4  # fp32, and autocast (amp_*, accelerate DDP's plain label): fp32 weights and gradients


def expected_bytes(strategy: str, precision: str, params: int, grad_accum: int = 1) -> float | None:
    factors = expected_factors(strategy)
    if factors is None:
        return None
    (weights, grads), (w_bytes, g_bytes) = factors, comm_element_bytes(precision, strategy)
    if of(strategy).gathers_per_microbatch:
        weights *= grad_accum
    return params * (weights * w_bytes + grads * g_bytes)


def tp_expected_bytes(model: str, image_size: int, batch_size: int, world_size: int, tp: int,
                      grad_accum: int = 1, precision: str = "fp32") -> float:
    """pytorch_TP.py per optimizer step and rank, S terms. Tensor parallelism (Megatron-LM, Shoeybi et al.
    2019, section 3): every block all-reduces micro-batch x tokens x hidden twice in forward
    (RowwiseParallel's outputs: attention out_proj, mlp.3) and twice in backward (the gradients of the
    block's two replicated inputs, common/tensor_parallel.py), for every micro-batch. Under autocast
    (amp_bf16) the forward ones are the half outputs of the linears; the backward ones are fp32, the
    gradient of the fp32 LayerNorm output that autocast cast to half inside the linear. With
    data-parallel ranks left over (tp_fsdp), FSDP2 full-shard over them as above, fp32 (no
    MixedPrecisionPolicy), on each tp rank's local shards: 2 all-gathers per micro-batch (the root's once),
    one reduce-scatter."""
    blocks, tokens, hidden = tp_layout(model, image_size)
    dp = world_size // tp
    micro = batch_size // dp // grad_accum
    forward = 2 if precision.startswith("amp_") else 4
    out = 2 * blocks * micro * tokens * hidden * (forward + 4) * grad_accum
    if dp > 1:
        shapes, units, _ = model_facts(model, image_size, tp)
        local, root = sum(math.prod(sh) for sh in shapes), sum(math.prod(sh) for sh in units[-1])
        # the root unit (patch embedding, tokens, head) stays gathered from forward to backward: pytorch_TP.py
        # leaves reshard_after_forward unset, which FSDP2 resolves to False for the root
        # (torch/distributed/fsdp/_fully_shard/_fsdp_state.py _lazy_init)
        out += (local * (2 * grad_accum + 1) - root * grad_accum) * 4
    return float(out)


def tp_layout(model: str, image_size: int) -> tuple[int, int, int]:
    """(transformer blocks, tokens, hidden width) of a ViT at image_size: the all-reduced activation of
    tensor parallelism is micro-batch x tokens x hidden."""
    net = meta_model(model, image_size=image_size)
    layers = [m for m in net.modules() if hasattr(m, "self_attention")]
    tokens = (image_size // net.patch_size) ** 2 + 1  # the patches and the class token
    return len(layers), tokens, layers[0].self_attention.embed_dim
