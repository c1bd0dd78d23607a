"""The memory model: predicted bytes per rank, by component, for every strategy of the project.

    predict(Setup(model="resnet50", image_size=224, batch_size=128, world_size=4, strategy="ddp"))

Components (bytes on the busiest rank's accelerator, at the training peak):
  params       the weights the rank keeps between steps (sharded for FSDP / ZeRO-3)
  grads        the gradients it keeps until the optimizer step (sharded for FSDP / ZeRO-2/3)
  optimizer    optimizer states: SGD momentum 1 x, AdamW exp_avg + exp_avg_sq 2 x the parameters
               it updates (fp32), plus AdamW's per-tensor `step` scalars
  master       fp32 copies of half weights kept apart from the model (DeepSpeed keeps one always)
  activations  tensors autograd saves for backward, measured from the model itself: a forward on
               the meta device with torch.autograd.graph.saved_tensors_hooks, counting each
               saved storage once (no memory is allocated: ResNet50/224/128 takes a second on CPU)
  comm         communication buffers and gathered shards alive at the peak (DDP's gradient
               buckets, FSDP's unsharded units, ZeRO-3 live parameters, DeepSpeed reduce buckets)
  model_state  params + grads + optimizer + master: what common/measure/model_state.py measures
  peak         params + optimizer + master + comm + max(activations, grads): with
               zero_grad(set_to_none=True) the gradients of the last step are gone when the next
               forward saves its activations, and backward frees activations as gradients appear.

Known limits: no allocator fragmentation or caching (compare with peak_allocated_gib, not
reserved), no cuDNN/cuBLAS workspaces, no CUDA context or NCCL buffers (peak_nvml_gib has them),
no transient temporaries of single kernels (the backward of the largest layer), and mixed
precision under autocast is modelled as half activations plus half copies of conv/linear weights.
"""
from __future__ import annotations

import functools
import math
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..models import meta_model, model_facts, norm_numel
from ..runsetup import RunSetup
from ..strategies import model_strategy, of, sized

GIB = 1024 ** 3
MIB = 1024 ** 2
ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}
DDP_BUCKET_CAP_MIB = 25  # torch/nn/parallel/distributed.py DistributedDataParallel(bucket_cap_mb=None -> 25)
# DeepSpeed defaults (deepspeed/runtime/zero/config.py DeepSpeedZeroConfig)
DS_REDUCE_BUCKET = 500_000_000
DS_PREFETCH_BUCKET = 50_000_000
DS_PERSISTENCE_THRESHOLD = 100_000
DS_MAX_LIVE = 1_000_000_000

# every strategy the memory model sizes, as predict() and `benchmark.py advise` name them (common/strategies.py)
STRATEGIES = sized()
COMPONENTS = ("params", "grads", "optimizer", "master", "activations", "comm")


@dataclass(frozen=True)
class Setup:
    model: str = "resnet50"
    image_size: int = 224
    batch_size: int = 128  # global, per optimizer step
    world_size: int = 1
    precision: str = "fp32"  # fp32, or the half type of mixed / pure half precision
    optimizer: str = "sgd"  # sgd (with momentum) or adamw
    strategy: str = "single"
    momentum: float = 0.9
    grad_accum: int = 1
    grad_checkpointing: bool = False
    channels_last: bool = False
    local_world_size: int = 0  # fsdp_hybrid: ranks per node (shard group); 0 = world_size
    bn_fp32: bool = False  # pure half (pytorch_half_precision.py --bn-fp32): BatchNorm parameters stay fp32
    zero: dict = field(default_factory=dict)  # DeepSpeed's zero_optimization section (bucket sizes)
    tp: int = 1  # tp, tp_fsdp (pytorch_TP.py): ranks that split every block; world_size / tp data-parallel

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each sees its own share of the batch (tensor-parallel ranks share theirs)."""
        return max(1, self.world_size // self.tp)

    @property
    def micro_batch(self) -> int:
        """Images one rank's forward sees: DataParallel and single devices split nothing across processes."""
        ranks = 1 if self.strategy in ("single", "half", "amp") else self.dp
        return max(1, math.ceil(self.batch_size / ranks / self.grad_accum))


@dataclass
class Prediction:
    setup: Setup
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    master: float = 0.0
    activations: float = 0.0
    comm: float = 0.0
    notes: list[str] = field(default_factory=list)
    curve: tuple = ()  # backward_curve of the setup's micro-batch

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.optimizer + self.master

    @property
    def backward_peak(self) -> float:
        """The most the saved activations, the gradients and the gradient flowing back hold together,
        along backward_curve (the activations scaled to this setup's: precision, autocast copies,
        checkpointing); max(activations, grads) where the walk is not available."""
        curve = self.curve or ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0))
        if self.setup.grad_accum > 1:  # from the second micro-batch on, every gradient is already there
            curve = [(a, 1.0, f) for a, _, f in curve]
        return max(a * self.activations + g * self.grads + f for a, g, f in curve)

    @property
    def peak(self) -> float:
        return self.params + self.optimizer + self.master + self.comm + self.backward_peak

    def gib(self) -> dict:
        out = {c: getattr(self, c) / GIB for c in COMPONENTS}
        out.update(model_state=self.model_state / GIB, peak=self.peak / GIB)
        return out


def _numel(shape) -> int:
    return math.prod(shape)


def _storage_key(t: torch.Tensor) -> int:
    # StorageImpl address: unique per storage even on the meta device, where data_ptr() is 0
    return t.untyped_storage()._cdata


@contextmanager
def _block_tracker(model: nn.Module, current: list):
    """current[0]: the index in models.blocks of the block whose forward is running, None outside them."""
    from ..models import blocks

    handles = []
    for i, (_, b) in enumerate(blocks(model)):
        handles.append(b.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        handles.append(b.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@functools.lru_cache(maxsize=64)  # advise asks for the same forward under several strategies
def saved_activation_bytes(model_name: str, image_size: int, batch: int, dtype: torch.dtype = torch.float32,
                           channels_last: bool = False, grad_checkpointing: bool = False,
                           tp: int = 1) -> tuple[int, dict]:
    """Bytes autograd saves in one training forward of `batch` images (parameters and buffers left
    out: they are model state), and the bytes first saved inside each block of models.blocks (key: its
    index; None: outside every block). A meta-device forward under saved_tensors_hooks
    (torch/autograd/graph.py): the same autograd formulas as on a device, no data. Each storage counts
    once (in-place ReLU saves the storage BatchNorm wrote). With grad_checkpointing the blocks are the
    checkpointed ones and the walk sees what non-reentrant checkpoint keeps: nothing saved inside a block
    (its own saved_tensors_hooks hold no tensor), and each block's inputs, which it saves through
    _NoopSaveInputs (torch/utils/checkpoint.py) under this walk's hooks."""
    model = meta_model(model_name, grad_checkpointing, image_size, tp).to(dtype=dtype)
    for m in model.modules():  # BatchNorm statistics stay fp32, as MixedPrecisionBatchNorm2d keeps them
        if isinstance(m, nn.BatchNorm2d):
            m.float()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    owned = {_storage_key(t) for t in list(model.parameters()) + list(model.buffers())}
    seen: dict[int, int] = {}
    per_stage: dict = {}
    current = [None]

    def pack(t):
        key = _storage_key(t)
        if key not in owned and key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            per_stage[current[0]] = per_stage.get(current[0], 0) + seen[key]
        return t

    x = torch.empty(batch, 3, image_size, image_size, device="meta", dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with _block_tracker(model, current), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            _fused_attention():
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.float(), torch.zeros(batch, dtype=torch.long, device="meta"))
    return sum(seen.values()), per_stage


@contextmanager
def _fused_attention():
    """The walks' attention as the devices run it. On the meta device scaled_dot_product_attention takes the
    math path (aten attention.cpp _fused_sdp_choice_meta returns math), which saves the softmax's B x heads x
    L x L weights. A training step's attention without a mask or dropout runs a fused kernel instead, on
    CUDA (efficient attention in fp32, flash in half) and on a CPU (_scaled_dot_product_flash_attention_for_cpu):
    it saves the output and a logsumexp of B x heads x L. The walks price the efficient kernel's saves,
    whose meta kernels exist for forward and backward (torch/_meta_registrations.py); the others' differ by
    the logsumexp's padding to 32."""
    with _SDPA_SWAP:  # one walk at a time swaps it: two threads' swaps could restore each other's
        sdpa = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = functools.partial(_fused_sdpa, sdpa)
        try:
            yield
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa


_SDPA_SWAP = threading.RLock()


def _fused_sdpa(sdpa, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
    if attn_mask is not None or dropout_p > 0 or enable_gqa or query.device.type != "meta":
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, None, True, 0.0,
                                                                  is_causal, scale=scale)[0]


@functools.lru_cache(maxsize=64)
def backward_curve(model_name: str, image_size: int, batch: int, dtype: torch.dtype = torch.float32,
                   channels_last: bool = False, tp: int = 1) -> tuple[tuple[float, float, float], ...]:
    """The backward pass in order, on the meta device: after each step, (share of the saved
    activations still alive, share of the parameters whose gradient exists, bytes of the gradient
    flowing back at that point). A saved storage is freed when autograd unpacks it for the last
    time (saved_tensors_hooks' unpack); a gradient appears when it is accumulated
    (register_post_accumulate_grad_hook). ResNet's layer4 and fc hold most of the parameters and
    their gradients appear first, while layer1-3's activations are still alive: at small batches
    that sum, not max(activations, gradients), is the peak."""
    model = _training_model(model_name, image_size, dtype, channels_last, tp)
    params = list(model.parameters())
    tracker = _BackwardTracker({_storage_key(t) for t in params + list(model.buffers())})
    handles = [p.register_post_accumulate_grad_hook(tracker.accumulated) for p in params]
    x = torch.empty(batch, 3, image_size, image_size, device="meta", dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    try:
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack), _fused_attention():
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.float(), torch.zeros(batch, dtype=torch.long,
                                                                                  device="meta"))
            start = tracker.alive
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    total_params = sum(p.numel() for p in params)
    return tuple((a / start if start else 0.0, g / total_params, f) for a, g, f in [(start, 0, 0), *tracker.curve])


def _training_model(model_name: str, image_size: int, dtype: torch.dtype, channels_last: bool, tp: int) -> nn.Module:
    """The meta-device model in its training dtype and layout, BatchNorm in fp32 as the scripts keep it."""
    model = meta_model(model_name, image_size=image_size, tp=tp).to(dtype=dtype)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.float()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train()
    return model


class _BackwardTracker:
    """The saved storages alive, the parameters' gradients accumulated and the gradient flowing back, recorded
    as (alive bytes, gradient elements, flowing bytes) at every unpack and accumulation of backward_curve."""

    def __init__(self, owned: set):
        self.owned, self.uses, self.size = owned, {}, {}
        self.alive = self.grads = self.flow = 0
        self.curve: list[tuple[int, int, int]] = []

    def pack(self, t):
        key = _storage_key(t)
        if key not in self.owned:
            if key not in self.size:
                self.size[key] = t.untyped_storage().nbytes()
                self.alive += self.size[key]
            self.uses[key] = self.uses.get(key, 0) + 1
        return t

    def unpack(self, t):
        key = _storage_key(t)
        # the gradient flowing back through this node has the shape of what it saved (a conv's
        # input, a ReLU's output): alive beside the saved tensors while the node runs
        self.flow = t.untyped_storage().nbytes()
        if key in self.uses:
            self.uses[key] -= 1
            if self.uses[key] == 0:
                self.alive -= self.size.pop(key)
                del self.uses[key]
            self.curve.append((self.alive, self.grads, self.flow))
        return t

    def accumulated(self, p):
        self.grads += p.numel()
        self.curve.append((self.alive, self.grads, self.flow))


def _curve(s: Setup) -> tuple:
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(s.precision, torch.float32)
    try:
        return backward_curve(s.model, s.image_size, s.micro_batch, dtype, s.channels_last, s.tp)
    except Exception:  # a model whose backward the meta device cannot run: the plain max instead
        return ()


def activation_bytes(s: Setup) -> float:
    """Saved activations of one rank's micro-batch, by precision and checkpointing.

    Half precision of every kind computes in half: FSDP's MixedPrecisionPolicy and DeepSpeed cast the
    parameters, autocast casts each conv/linear input and weight (its autocast fp16 list), and the
    project's BatchNorm keeps half activations beside fp32 statistics. autocast additionally saves the
    half copy of each conv/linear weight it made (torch/csrc/autograd autocast cache): counted here.
    --grad-checkpointing (common/models.py checkpointed, torch.utils.checkpoint non-reentrant) keeps what
    is saved outside the blocks and each block's inputs (the walk of the checkpointed model); backward
    recomputes one block at a time, so the largest block's own activations come back once."""
    half = s.precision != "fp32"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(s.precision, torch.float32)
    total, per_block = saved_activation_bytes(s.model, s.image_size, s.micro_batch, dtype, s.channels_last, False, s.tp)
    inside = [v for k, v in per_block.items() if k is not None]
    if s.grad_checkpointing and inside:
        kept, _ = saved_activation_bytes(s.model, s.image_size, s.micro_batch, dtype, s.channels_last, True, s.tp)
        total = kept + max(inside)
    if half and s.strategy in ("amp", "ddp", "ddp_zero", "dp", "accelerate_ddp", "tp", "tp_fsdp"):
        total += 2 * model_facts(s.model, s.image_size, s.tp)[2]
    return float(total)


# --- sharding of the model state -----------------------------------------------------------------

def _opt_slots(s: Setup) -> int:
    """fp32 optimizer-state tensors per parameter: torch/optim/sgd.py keeps momentum_buffer only when
    momentum != 0; torch/optim/adamw.py (adam.py _init_group) keeps exp_avg and exp_avg_sq."""
    if s.optimizer == "adamw":
        return 2
    return 1 if s.momentum else 0


def _step_bytes(s: Setup, tensors: int) -> int:
    """AdamW's `step` is a float32 scalar tensor per parameter tensor (adam.py _init_group)."""
    return 4 * tensors if s.optimizer == "adamw" else 0


def _zero1_max_rank(shapes, world: int) -> list[int]:
    """torch/distributed/optim/zero_redundancy_optimizer.py _partition_parameters: parameters sorted
    by size, largest first, each to the rank with the smallest total so far (the first such rank).
    Returns (numel, tensors) of the rank that holds the most."""
    sizes, counts = [0] * world, [0] * world
    for n in sorted((_numel(sh) for sh in shapes), reverse=True):
        r = sizes.index(min(sizes))
        sizes[r] += n
        counts[r] += 1
    r = max(range(world), key=lambda i: sizes[i])
    return [sizes[r], counts[r]]


def _fsdp_shard_numel(shapes, world: int) -> int:
    """FSDP2 pads every parameter's dim-0 chunk to rank 0's (torch/distributed/fsdp/_fully_shard/
    _fsdp_param.py _init_sharded_param: padded_sharded_size = chunks[0].size()), and each rank's
    parameter storage is that padded shard; the reduce-scattered gradient of a unit is one flat
    buffer of the padded shard sizes (_fsdp_collectives.py foreach_reduce)."""
    out = 0
    for sh in shapes:
        rows = sh[0] if len(sh) else 1
        out += math.ceil(rows / world) * _numel(sh[1:]) if len(sh) else 1
    return out


def _ds_partition(total: int, world: int, half: bool) -> int:
    """DeepSpeed ZeRO-1/2 flattens each param group and pads it to nccl_start_alignment_factor x world
    elements (stage_1_and_2.py __init__: alignment = 2 * world; flatten_dense_tensors_aligned), then
    each rank owns an equal slice."""
    align = 2 * world
    return math.ceil(total / align) * align // world


def predict(s: Setup) -> Prediction:
    """Bytes per rank by component for the setup (see the module doc for each component)."""
    if s.strategy not in STRATEGIES:
        from ..config import UsageError

        raise UsageError(f"unknown strategy {s.strategy!r}; one of {', '.join(STRATEGIES)}")
    shapes, units, _ = model_facts(s.model, s.image_size, s.tp)  # tp > 1: one tensor-parallel rank's shards
    n, tensors = sum(_numel(sh) for sh in shapes), len(shapes)
    half = ITEMSIZE[s.precision]
    w = s.world_size
    slots = _opt_slots(s)
    p = Prediction(s, activations=activation_bytes(s), curve=_curve(s))
    st = of(s.strategy)
    if st.family in ("single", "amp", "dp", "ddp", "tp"):
        # autocast keeps fp32 weights, gradients and optimizer state (torch/amp/autocast_mode.py casts per op)
        p.params = p.grads = 4 * n
        p.optimizer = 4 * slots * n + _step_bytes(s, tensors)
    if st.family == "half":  # pytorch_half_precision.py: model.to(half); SGD/AdamW state follows the param dtype
        bn = norm_numel(s.model) if s.bn_fp32 else 0  # --bn-fp32: those weights, their grads and state in fp32
        per_slot = half * (n - bn) + 4 * bn
        p.params = p.grads = per_slot
        p.optimizer = slots * per_slot + _step_bytes(s, tensors)
    if st.family == "dp" and w > 1:
        # torch/nn/parallel/data_parallel.py: the whole batch lands on device 0 and is scattered from
        # there, outputs are gathered there, and replicate.py's Broadcast.backward reduces every
        # replica's gradients onto device 0 (comm.reduce_add_coalesced): one more gradient-sized buffer
        p.comm = 4 * n + 4 * s.batch_size * 3 * s.image_size ** 2
        p.notes.append("device 0 holds the whole input batch and the reduced gradients")
    if st.family == "ddp":
        # torch/nn/parallel/distributed.py: with gradient_as_bucket_view=False (the default, used here)
        # the Reducer keeps its flat bucket buffers (bucket_cap_mb=25 MiB each, covering every
        # parameter) beside param.grad: "the saved memory size will be equal to the total gradients size"
        p.comm = 4 * n
    if st.family == "ddp_zero":
        # DDP as above; ZeroRedundancyOptimizer shards only the optimizer state, by whole parameters
        p.params = p.grads = p.comm = 4 * n
        numel, count = _zero1_max_rank(shapes, w)
        p.optimizer = 4 * slots * numel + _step_bytes(s, count)
    if st.fsdp:
        # tp_fsdp: FSDP2 over the dp ranks of each tensor-parallel rank's local shards (pytorch_TP.py), without
        # a MixedPrecisionPolicy (bf16 is autocast there): units gathered and reduced in fp32
        p = _fsdp(s, p, units, tensors, slots, 4 if st.family == "tp_fsdp" else half)
    if st.deepspeed:
        p = _deepspeed(s, p, units, shapes, n, slots, half)
    return p


def _fsdp(s: Setup, p: Prediction, units, tensors, slots, half) -> Prediction:
    """FSDP2 fully_shard per block of models.blocks + root (pytorch_FSDP.py; accelerate_FSDP.py with
    config/default_FSDP.yml: full shard, no offload). Sharded parameters stay fp32 (they are the master
    weights: MixedPrecisionPolicy casts only the all-gathered copy to param_dtype), gradients are
    reduce-scattered in fp32 (reduce_dtype), the optimizer steps on the local shards."""
    st = of(s.strategy)
    mode, offload = st.sharding, st.offload
    shard_world = (s.local_world_size or s.world_size) if mode == "hybrid" else s.dp
    shard = sum(_fsdp_shard_numel(u, shard_world) for u in units)
    gathered = [half * sum(_numel(sh) for sh in u) for u in units]
    if offload:
        # torch/distributed/fsdp/_fully_shard/_fsdp_api.py CPUOffloadPolicy: sharded params, grads and
        # the optimizer step live in host memory; the device holds only gathered units
        p.notes.append("params, grads and optimizer state in host memory")
    else:
        p.params = p.grads = 4 * shard
        p.optimizer = 4 * slots * shard + _step_bytes(s, tensors)
    if mode == "shard-grad-op":
        # reshard_after_forward=False: every unit stays unsharded from its forward to its backward
        p.comm = sum(gathered)
    else:
        # reshard_after_forward=True: one unit in use and the next prefetched (_fsdp_state.py
        # pre-forward prefetch; backward prefetch of the next unit), plus its reduce-scatter input
        big = sorted(gathered, reverse=True)
        p.comm = sum(big[:2]) + big[0] * 4 / half
    if s.grad_accum > 1 and not offload:
        # --grad-accum with set_requires_gradient_sync(False) (pytorch_FSDP.py's no_sync, accelerate's):
        # each unit keeps its whole gradient, in reduce_dtype fp32 (_fsdp_param.py
        # unsharded_accumulated_grad), from the first micro-batch to the last one's reduce-scatter
        p.comm += 4 * sum(sum(_numel(sh) for sh in u) for u in units)
        p.notes.append("--grad-accum: whole fp32 gradients held between micro-batches")
    return p


def _deepspeed(s: Setup, p: Prediction, units, shapes, n, slots, half) -> Prediction:
    """DeepSpeed ZeRO from the JSON's zero_optimization (pytorch_DeepSpeed.py, accelerate_DeepSpeed.py).

    Stage 1/2 (deepspeed/runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__): the model's
    parameters become views of one flat, padded buffer per group in the training dtype
    (bit16_groups_flat); each rank keeps an fp32 clone of its 1/W slice (single_partition_of_fp32_groups,
    cloned even in fp32 training) that the wrapped torch optimizer steps, so optimizer state is 1/W.
    Stage 1 keeps whole gradients until the step boundary (param.grad), stage 2 only its slice
    (grads_in_partition, contiguous_gradients) plus a reduce bucket (ipg_buffer, reduce_bucket_size
    elements, two when overlap_comm); both step on an fp32 gradient slice.
    Stage 3 (stage3.py DeepSpeedZeroOptimizer_Stage3): parameters are partitioned too
    (partition_parameters.py, each parameter padded to a multiple of W); the rank keeps its fp16/32
    partition (fp16_partitioned_groups_flat), the fp32 copy (fp32_partitioned_groups_flat), its
    gradient slice twice (accumulation buffer, fp32 copy for the step) and the reduce bucket
    (IPGBucketZ3.buffer, reduce_bucket_size elements however small the model), and at the peak the
    live gathered parameters (prefetch bucket and small parameters below
    stage3_param_persistence_threshold, which stay whole on every rank).
    Offload (offload_optimizer/offload_param device cpu): the fp32 copy, optimizer state (and for
    stage 3 the parameter partitions) in host memory."""
    st = of(s.strategy)
    stage, offload = st.zero_stage, st.offload
    w = s.world_size
    z = s.zero
    part = _ds_partition(n, w, half)
    dt = half  # the training dtype: parameters and gradients
    opt_bytes = 4 * slots * part
    if stage in (1, 2):
        p.params = dt * part * w
        p.master = 0 if offload else 4 * part
        p.optimizer = 0 if offload else opt_bytes + _step_bytes(s, 1)
        # at the step both stages keep only the fp32 gradient slice the optimizer reads
        # (single_partition_of_fp32_groups[i].grad); stage 1 gets there from whole gradients that
        # wait in param.grad until the reduce at the step boundary, stage 2 from reduce buckets
        p.grads = 0 if offload else 4 * part
        if stage == 1:
            p.comm = dt * n
        else:
            bucket = int(z.get("reduce_bucket_size", DS_REDUCE_BUCKET))
            p.comm = dt * min(bucket, n) * (2 if z.get("overlap_comm") else 1)
    else:
        threshold = int(z.get("stage3_param_persistence_threshold", DS_PERSISTENCE_THRESHOLD))
        persistent = sum(_numel(sh) for sh in shapes if _numel(sh) <= threshold)
        per_param = sum(math.ceil(_numel(sh) / w) for sh in shapes)
        p.params = 0 if offload else dt * per_param
        p.master = 0 if offload else 4 * per_param
        p.optimizer = 0 if offload else 4 * slots * per_param + _step_bytes(s, 1)
        # gradient slices accumulate in grad_partitions_flat_buffer (training dtype) and are
        # flattened again into an fp32 .grad for the optimizer (_prepare_fp32_grad_for_sub_group);
        # contiguous_gradients (on by default) allocates the reduce bucket once, whole, at init
        bucket = int(z.get("reduce_bucket_size", DS_REDUCE_BUCKET)) if z.get("contiguous_gradients", True) else 0
        p.grads = 0 if offload else (dt + 4) * per_param + dt * bucket
        prefetch = int(z.get("stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET))
        largest_unit = max(sum(_numel(sh) for sh in u) for u in units)
        p.comm = dt * (persistent + min(n, max(prefetch, 2 * largest_unit)))
    return p


def setup_of(s: RunSetup) -> Setup | None:
    """The memory and step models' Setup of a run; None for one they do not size (a split model: mp, pp_*,
    a hybrid they do not reproduce, DeepSpeed without ZeRO)."""
    strategy = model_strategy(s.script, s.strategy)
    if strategy not in STRATEGIES:
        return None
    return Setup(model=s.model, image_size=s.image_size, batch_size=s.batch_size, world_size=s.world_size,
                 precision="fp32" if strategy == "dp" else s.half, optimizer=s.optimizer, strategy=strategy,
                 momentum=s.momentum, grad_accum=s.grad_accum, grad_checkpointing=s.grad_checkpointing,
                 channels_last=s.channels_last, local_world_size=s.local_world_size, zero=s.zero,
                 bn_fp32=s.bn_fp32, tp=s.tp)


# the row's memory prediction (common/results.py, group "memory"), beside model_state_gib and the measured peaks
PRED_COLUMNS = ("pred_model_state_gib", "pred_activation_gib", "pred_peak_gib", "pred_error_pct", "pred_params_gib",
                "pred_grads_gib", "pred_optimizer_gib", "pred_master_gib", "pred_comm_gib")


def columns(run: RunSetup, peak_allocated_gib: float | None = None) -> dict:
    """The row's pred_*_gib columns for a run, and pred_error_pct against its measured peak_allocated_gib (CUDA's
    allocator; none on a CPU). Empty where the model does not size the run."""
    out = dict.fromkeys(PRED_COLUMNS)
    setup = setup_of(run)
    if setup is None:
        return out
    pred = predict(setup)
    out.update(pred_model_state_gib=round(pred.model_state / GIB, 6),
               pred_activation_gib=round(pred.activations / GIB, 6), pred_peak_gib=round(pred.peak / GIB, 6))
    # the components, so that the report draws this run's prediction rather than rebuilding it
    out.update({f"pred_{c}_gib": round(getattr(pred, c) / GIB, 6) for c in ("params", "grads", "optimizer", "master",
                                                                            "comm")})
    if peak_allocated_gib:
        out["pred_error_pct"] = round(100 * (pred.peak / GIB - peak_allocated_gib) / peak_allocated_gib, 2)
    return out
