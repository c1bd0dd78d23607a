"""The one table of strategies: what the memory model, the expected-volume model, the step model and
`advise` need to know of each, as data.

A strategy's name is the row's `strategy` (model_strategy below for the single-device scripts:
`half` and `amp`). The models dispatch on the fields below, never on the name's spelling.

    STRATEGIES["deepspeed_zero2"].zero_stage      # 2
    of("fsdp_full-shard_offload").offload         # True
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    name: str
    family: str  # single, half, amp, dp, ddp, ddp_zero, fsdp, deepspeed, tp, tp_fsdp: how the models size and time it
    library: str = "torch"  # torch, accelerate, deepspeed: whose code runs it
    sized: bool = True  # the memory and step models size it (False: measured only, e.g. DeepSpeed without ZeRO)
    data_parallel: bool = True  # each rank trains its share of the global batch (a single device: the whole batch)
    ddp_buckets: bool = False  # gradients all-reduced in DDP's buckets during backward (DDP, DDP+ZeRO, accelerate DDP)
    sharding: str | None = None  # FSDP: full-shard, shard-grad-op, hybrid
    zero_stage: int | None = None  # DeepSpeed's ZeRO stage
    offload: bool = False  # parameters, gradients or optimizer state in host memory
    half_weights: bool = False  # the model's own weights in half precision (pure half, DeepSpeed's engine)
    # the expected volume per optimizer step and rank, in parameter bytes B: (weights x B, gradients x B), what is
    # sent; None: not modelled. Sources: nccl-tests doc/PERFORMANCE.md (S and the bus factors); ZeRO
    # (Rajbhandari et al. 2020, section 7): DDP and ZeRO-1/2 move 2B on the wire per rank (reduce-scatter +
    # all-gather, or the all-reduce that is both), ZeRO-3 3B. In S terms an all-reduce of the gradients is S = B.
    sends: tuple[float, float] | None = None
    sends_what: str = ""
    # the weights gathered for every forward (and backward): with --grad-accum N that is N times a step, while the
    # gradients are reduced once (FSDP2's set_requires_gradient_sync, accelerate's no_sync, as DDP's no_sync)
    gathers_per_microbatch: bool = False

    @property
    def fsdp(self) -> bool:
        return self.family in ("fsdp", "tp_fsdp")

    @property
    def deepspeed(self) -> bool:
        return self.family == "deepspeed"

    @property
    def no_channels_last(self) -> str:
        """Why its engine cannot train channels-last weights (its scripts refuse --channels-last); "" where it can."""
        return FSDP2_NO_CHANNELS_LAST if self.fsdp else DEEPSPEED_NO_CHANNELS_LAST if self.deepspeed else ""


# the engines that take no channels-last weight, on any device: the call that rejects one
FSDP2_NO_CHANNELS_LAST = ("FSDP2 shards contiguous parameters only (torch/distributed/fsdp/_fully_shard/_fsdp_param.py "
                          "FSDPParam._init_sharded_param raises NotImplementedError)")
DEEPSPEED_NO_CHANNELS_LAST = ("DeepSpeed's initialize broadcasts every parameter viewed as bytes, which a "
                              "channels-last weight cannot be (deepspeed/runtime/engine.py "
                              "DeepSpeedEngine._broadcast_model), and ZeRO re-lays the weights out as views of one "
                              "contiguous buffer")


_ALL_REDUCE = "all-reduce the gradients"
# DeepSpeed 0.19 all-reduces each gradient bucket (average_tensor, use_multi_rank_bucket_allreduce on by default):
# the same S as a reduce-scatter, twice its bytes per link
_ZERO12 = "all-reduce the gradient buckets + all-gather the updated weights"
# stage 3 keeps a module's gathered weights for backward when their reuse comes within stage3_max_reuse_distance
# elements (1e9 by default: any model under 500M parameters), and gathers the persistent ones
# (stage3_param_persistence_threshold) after the step (stage3.py _post_step)
_ZERO3 = "all-gather the weights once (kept for backward) + reduce-scatter the gradients"
_FULL = "all-gather forward + all-gather backward + reduce-scatter the gradients"


def _fsdp(name: str, sharding: str, sends, what: str, offload: bool = False, library: str = "torch") -> Strategy:
    return Strategy(name, "fsdp", library, sharding=sharding, offload=offload, sends=sends, sends_what=what,
                    gathers_per_microbatch=True)


def _zero(stage: int, library: str = "deepspeed", offload: bool = False) -> Strategy:
    prefix = "accelerate_" if library == "accelerate" else ""
    sends, what = ((0.0, 1.0), _ALL_REDUCE) if stage == 0 else ((1.0, 1.0), _ZERO3 if stage == 3 else _ZERO12)
    return Strategy(f"{prefix}deepspeed_zero{stage}" + ("_offload" if offload else ""), "deepspeed", library,
                    sized=stage > 0, zero_stage=stage, offload=offload, half_weights=True, sends=sends,
                    sends_what=what if library == "deepspeed" else f"as deepspeed_zero{stage}",
                    gathers_per_microbatch=stage == 3)


TABLE = [
    Strategy("single", "single", data_parallel=False),
    Strategy("half", "half", data_parallel=False, half_weights=True),
    Strategy("amp", "amp", data_parallel=False),
    Strategy("dp", "dp", sends=(1.0, 1.0), sends_what="broadcast the weights to every GPU + reduce the gradients "
             "to GPU 0 (torch.cuda.comm)"),
    Strategy("ddp", "ddp", ddp_buckets=True, sends=(0.0, 1.0), sends_what=_ALL_REDUCE),
    Strategy("ddp_zero", "ddp_zero", ddp_buckets=True, sends=(1.0, 1.0),
             sends_what="all-reduce the gradients + broadcast each rank's updated shard"),
    _fsdp("fsdp_full-shard", "full-shard", (2.0, 1.0), _FULL),
    _fsdp("fsdp_shard-grad-op", "shard-grad-op", (1.0, 1.0), "all-gather forward + reduce-scatter the gradients"),
    _fsdp("fsdp_hybrid", "hybrid", None, ""),
    _fsdp("fsdp_full-shard_offload", "full-shard", (2.0, 1.0), _FULL, offload=True),
    _zero(1), _zero(2), _zero(3), _zero(2, offload=True), _zero(3, offload=True),
    Strategy("accelerate_ddp", "ddp", "accelerate", ddp_buckets=True, sends=(0.0, 1.0), sends_what=_ALL_REDUCE),
    _fsdp("accelerate_fsdp", "full-shard", (2.0, 1.0), "full-shard (config/default_FSDP.yml): 2 all-gathers + "
          "reduce-scatter", library="accelerate"),
    _zero(1, "accelerate"), _zero(2, "accelerate"), _zero(3, "accelerate"),
    Strategy("tp", "tp"),
    Strategy("tp_fsdp", "tp_fsdp", sharding="full-shard"),
    _zero(0), _zero(0, "accelerate"),
    # the split models: the memory and step models size their pieces by measurement (a pipeline's schedule is
    # the step model's, common/predict/timemodel.py _pipeline), each rank or device sees the whole batch
    Strategy("mp", "mp", sized=False, data_parallel=False),
    *(Strategy(f"pp_{schedule}", "pp", sized=False, data_parallel=False)
      for schedule in ("gpipe", "1f1b", "interleaved_1f1b")),
]
STRATEGIES = {s.name: s for s in TABLE}


# the single-device scripts whose row says "single" but whose models differ by how the half precision is applied
BY_SCRIPT = {"pytorch_half_precision.py": "half", "pytorch_auto_mixed_precision.py": "amp"}


def model_strategy(script: str, strategy: str) -> str:
    """The strategy as the models name it of a run of `script` whose row says `strategy`."""
    return BY_SCRIPT.get(script, strategy)


def of(name: str) -> Strategy | None:
    """The table's entry for a strategy name, None for one the models do not know. A row's offload
    variant the table does not list (deepspeed_zero1_offload) is its stage's, offloaded, and not sized."""
    from dataclasses import replace

    if name in STRATEGIES:
        return STRATEGIES[name]
    base = STRATEGIES.get(name.removesuffix("_offload")) if name.endswith("_offload") else None
    return None if base is None else replace(base, name=name, offload=True, sized=False)


def sized() -> tuple[str, ...]:
    """The strategies the memory and step models size, in the table's order."""
    return tuple(s.name for s in TABLE if s.sized)
