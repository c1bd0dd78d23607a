"""The step model: the predicted time of one optimizer step, by component, for every strategy.

    predict_step(setup, Compute(fwd_ms=.., bwd_ms=.., opt_ms=..), Link(...), overlap=True)

Built from the model itself, as the memory model is: its units (a ResNet's stem, every block, the
head; other families one unit) with their share of the forward FLOPs (torch.utils.flop_counter on
the meta device) and their parameters in registration order. The forward and backward times of one
micro-batch (measured by `benchmark.py calibrate`, or the roofline of roofline.py for a GPU named
to `advise`) are spread over the units by that share, or by a ResNet's measured pieces (time_shares).
Then each strategy's collectives are put where its library issues them, and a two-resource schedule
(compute, communication) runs them in program order; a collective starts when its inputs are ready and
the link is free:
  ddp, accelerate_ddp    gradient buckets in reverse parameter order (first bucket 1 MiB, then 25 MiB:
                         torch/nn/parallel/distributed.py, dist._DEFAULT_FIRST_BUCKET_BYTES), each
                         all-reduced as soon as its last gradient is ready, buckets in order (the
                         Reducer launches bucket i only after bucket i-1)
  ddp_zero               as ddp, then the optimizer on 1/n of the parameters, then every parameter
                         broadcast from its owner (ZeroRedundancyOptimizer._sync_params, one call per
                         parameter without parameters_as_bucket_view)
  fsdp_full-shard        FSDP2: per unit an all-gather before its forward (issued ahead: the CPU runs
                         ahead of the device), again before its backward (prefetched one unit ahead,
                         FSDP2's default), a reduce-scatter after it; the optimizer on 1/n
  fsdp_shard-grad-op     the same without the backward all-gathers (reshard_after_forward=False)
  deepspeed_zero1/2      gradients all-reduced in reduce_bucket_size buckets as they are ready,
                         each rank keeping its partition (average_tensor: with
                         use_multi_rank_bucket_allreduce, True by default in deepspeed/runtime/zero/
                         config.py, a bucket is one all-reduce; False: a reduce to each partition's
                         owner), hidden under the backward only with overlap_comm (off by default
                         for stages 1-2: then after it), the optimizer on 1/n, then the updated weights
                         all-gathered (deepspeed/runtime/zero/stage_1_and_2.py); before the step the
                         gradient norm's one-element all-reduce (get_grad_norm_direct: compute_grad_norm
                         is on by default, zero/config.py), as in ZeRO-3 (stage3.py _get_norm_groups),
                         and in half precision the overflow check's (has_overflow; ZeRO-3: fp16 only)
  deepspeed_zero3        the weights above stage3_param_persistence_threshold elements all-gathered in
                         coalesced calls of up to stage3_prefetch_bucket_size elements, the first when
                         the forward starts, each next one a unit later (partitioned_param_coordinator
                         fetch_sub_module: with a complete trace the first module's fetch prefetches the
                         queue up to that size in one all_gather_coalesced; resnet18: one call); no gather
                         in backward while the step's trace (2 x the model's elements) is within
                         stage3_max_reuse_distance (1e9: the weights stay gathered); the gradients
                         reduce-scattered in reduce_bucket_size buckets; the norm's all-reduce; after the
                         optimizer step every persistent weight all-gathered in a call of its own,
                         issued async and waited together (stage3.py _post_step ->
                         partition_parameters.py _allgather_params_coalesced: resnet18's 50; its rows
                         count 53 collectives a step: these, the forward's one, a reduce-scatter, the norm)
  deepspeed_zero0        the gradients all-reduced after the whole backward in 5e8-element buffers
  dp                     (one process, n GPUs) weights broadcast and gradients reduced, not overlapped
  tp, tp_fsdp            the tp rank's share of the FLOPs, plus 4 activation all-reduces per block and
                         micro-batch, exposed (the next op waits on each); tp_fsdp adds FSDP over dp
  pp_gpipe, pp_1f1b      simulated op by op in the order torch's schedules run them (a forward waits for
                         the previous stage's activation, a backward for the next stage's gradient, each
                         after its send, each send a meeting): equal stages give (m + s - 1) slots of one
                         stage; unequal ones fill and drain at the other stages' pace (2 stages, the last
                         the slowest: t0 + m x t1); each rank's optimizer after its own last backward, its next
                         forward waiting for it (two steps simulated, the step their period). Interleaved
                         1F1B is not simulated: (m + n - 1) slots of the slowest of the n pieces plan()
                         gives, and the largest stage's optimizer.
                         The slowest stage is the one with the largest share of the measured time of
                         the model's four pieces (calibrate times them) where the calibration has
                         them, else of the FLOPs: on a CPU at 32 px resnet18's layer4 holds 23% of
                         the FLOPs and ~60% of the time (its weights, not its arithmetic, set its pace)
Collective time: latency + S x bus factor / bus bandwidth (nccl-tests doc/PERFORMANCE.md, the same
S and factors as the communication columns), timed after a barrier. Ranks come to a step's collectives
from their own compute instead: each meeting (the collectives a rank issues at one point of its compute,
back to back) adds Link.meet_ms, measured by benchmarks/collectives.py --meet (0 where not calibrated).
Ranks that vary from step to step wait for each other at the step's synchronizing collective: with n > 1
ranks (not a pipeline, whose stages wait by design) the step gains Compute.sync_ms, as exposed
communication (where the measured columns put a collective's wait).

overlap=False puts communication and compute on one resource: on a CPU the training thread waits on
FSDP's, ZeRO's and DeepSpeed's collectives (their rows' comm_overlap_pct is 0, ZeRO-3's 10-20), so
nothing is hidden.
DDP's buckets are the exception: gloo all-reduces them on its own threads beside the backward (62-84%
overlapped in the Xeon grids), which then loses CPU_BESIDE_COST of the time they hide, a fitted share.
On a GPU NCCL kernels run beside compute kernels: overlap=True, the compute losing the SMs they hold for the time
they hide under it (Link.sm_share, 0 where not known: a calibration's links).

Components, as the measured step_*_ms columns: data, compute (forward + backward), comm_exposed (the
schedule's length beyond compute, plus the collectives after the optimizer), optimizer.
A unit's share of the forward and backward time is its FLOP share, or for a ResNet its piece's measured
share (calibrate times the four pieces) spread by FLOPs: when a bucket is ready (time_shares).
Known limits: contention between overlapped collectives and compute is their SMs' share on a GPU (not the HBM
they move) and one fitted share for DDP on a CPU, per-unit (not per-layer) readiness, the loader as measured
(added inline, a bound with workers: timepred.py), no host overhead of a wrapper (DeepSpeed's hooks)
beyond what the calibration's plain model shows.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import torch

from ..measure.comm import bus_factor
from ..models import meta_model
from ..strategies import Strategy, of
from .memory import DS_PREFETCH_BUCKET, DS_REDUCE_BUCKET, ITEMSIZE, Setup

FIRST_BUCKET_BYTES = 1024 ** 2  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
BUCKET_BYTES = 25 * 1024 ** 2  # DistributedDataParallel(bucket_cap_mb=None) -> 25 MiB
GLOO_THREADS = 2  # ProcessGroupGloo::Options threads{2}: a process group's async work runs on two threads
# deepspeed/runtime/zero/config.py: max_reuse_distance and param_persistence_threshold's defaults
DS_REUSE_DISTANCE, DS_PERSISTENCE = 1_000_000_000, 100_000
DS_ALLREDUCE_ELEMENTS = 500_000_000  # deepspeed/runtime/engine.py MEMORY_OPT_ALLREDUCE_SIZE: ZeRO-0's buffers
# The share of the time DDP's buckets run beside the backward on a CPU that the backward loses to them. Fitted
# to four 2-core Xeon time grids (results/campaigns/*_xeon_grid*: 2 gloo ranks of one thread, resnet18): their
# rows put it at 0.2-0.5 at 32 px and 0-0.1 at 64 px (measured compute above its entry over the time hidden);
# 0.3 gives their 12 DDP-family runs the least mean absolute error (6.5%; 1.0, about hiding nothing: 9.1%). Alone, an
# all-reduce of 1-44 MiB keeps 0.66-0.83 of a core busy a rank (getrusage), but much of that waits in the
# transport and yields to compute.
CPU_BESIDE_COST = 0.3


@dataclass(frozen=True)
class Compute:
    """One rank's compute for one micro-batch at the run's precision, ms."""
    fwd_ms: float  # forward and loss
    bwd_ms: float  # backward
    opt_ms: float  # optimizer step over ALL the model's parameters (sharded strategies take 1/n)
    data_ms: float = 0.0  # waiting for and copying one micro-batch
    source: str = ""  # where the figures come from (calibration file and entry, or the datasheet)
    # per step at n ranks: what the ranks' step-to-step variation adds to a synchronous step beyond the
    # slowest rank's mean (calibration.py: the least wait of calibrate's runs in lockstep); 0 on a GPU
    sync_ms: float = 0.0
    # a distributed script's own collectives at world size 1, exposed (calibration.py own_comm_ms): what a
    # one-process run of the strategy adds to this compute; n ranks pay their link's collectives instead
    own_comm_ms: float = 0.0
    # DataParallel on GPUs (_dp_gpu): the host's time to launch one replica's forward (its threads take turns
    # at the GIL) and the global batch's bytes that GPU 0 scatters to the others
    launch_fwd_ms: float = 0.0
    scatter_bytes: float = 0.0


@dataclass(frozen=True)
class Link:
    """Collective time = latency + S x bus factor / busbw, per kind (falling back to all_reduce's). Where the
    calibration measured the kind (`points`: [(S bytes, ms)] at this world size, ascending, made
    non-decreasing by calibration.monotone), a size inside
    the measured range is interpolated between its two neighbours and one past the largest continues from
    it at the fitted bandwidth: gloo's time is not one line over sizes (2 ranks, 2 cores: a 32 MiB
    all-gather 20.5 ms, 42.7 MiB 30.8, 64 MiB 67.5; the line through 16 KiB-32 MiB gave 27 ms at 42.7)."""
    busbw_gbps: dict = field(default_factory=lambda: {"all_reduce": 10.0})  # GB/s = 1e9 B/s
    latency_us: dict = field(default_factory=lambda: {"all_reduce": 20.0})
    source: str = ""
    points: dict = field(default_factory=dict)
    world: int = 0  # the ranks the points were measured at: another group size (tp, dp sub-groups) takes the line
    # what a collective costs a step beyond its time above when the ranks come to it from their own work
    # (benchmarks/collectives.py --meet): once per meeting, a run of collectives with compute before it
    meet_ms: float = 0.0
    # on a GPU, the share of its SMs a collective's kernels hold while they run (links.sm_share): the compute it
    # overlaps loses that share of the time it hides under it (_gpu_contention); 0 on a CPU and in calibrations
    sm_share: float = 0.0

    def ms(self, kind: str, nbytes: float, n: int) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw = self.busbw_gbps.get(kind, self.busbw_gbps.get("all_reduce"))
        lat = self.latency_us.get(kind, self.latency_us.get("all_reduce", 0.0))
        per_byte = bus_factor(kind, n) / (bw * 1e9) * 1e3
        pts = self.points.get(kind) if n == self.world else None
        if not pts:
            return lat / 1e3 + nbytes * per_byte
        if nbytes < pts[0][0]:  # latency-bound: back along the first measured segment (the fitted line's
            (s0, t0), (s1, t1) = pts[0], pts[1] if len(pts) > 1 else pts[0]  # latency can be 0 on a convex curve)
            # never up: two noisy small points can fall with size (16 KiB 0.78 ms, 32 KiB 0.42), and
            # DDP+ZeRO's 62 broadcasts, most under 2 KiB, came to 1.15 ms each going back along them
            slope = max(0.0, (t1 - t0) / (s1 - s0)) if s1 > s0 else per_byte
            return max(0.0, t0 - (s0 - nbytes) * slope)
        for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
            if nbytes <= s1:
                return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0) if s1 > s0 else t1
        s_last, t_last = pts[-1]
        return t_last + (nbytes - s_last) * per_byte


@dataclass
class StepPrediction:
    data_ms: float = 0.0
    compute_ms: float = 0.0
    comm_exposed_ms: float = 0.0
    optimizer_ms: float = 0.0
    comm_ms: float = 0.0  # every collective's time, hidden or not
    # the backend collectives the model prices per rank and step, to set beside the rows' comm_calls_per_step
    # (which also counts what the model leaves out: DDP's bucket-order broadcasts in its second step); None
    # where it does not count them (DataParallel, tensor and pipeline parallelism)
    calls: int | None = None
    notes: list = field(default_factory=list)

    @property
    def step_ms(self) -> float:
        return self.data_ms + self.compute_ms + self.comm_exposed_ms + self.optimizer_ms

    def parts(self) -> dict:
        return {"data": self.data_ms, "compute": self.compute_ms, "comm_exposed": self.comm_exposed_ms,
                "optimizer": self.optimizer_ms}


@dataclass(frozen=True)
class Unit:
    name: str
    share: float  # of the forward FLOPs
    params: tuple  # element counts of its parameters, registration order


@functools.lru_cache(maxsize=16)
def units(model_name: str, image_size: int, tp: int = 1) -> tuple[Unit, ...]:
    """Forward-order units: stem, every block of models.blocks (the FSDP units), head; a model without
    repeated blocks is one unit. tp > 1: one tensor-parallel rank's model (memory.meta_model)."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..models import blocks as model_blocks

    model = meta_model(model_name, image_size=image_size, tp=tp)
    blocks = model_blocks(model)
    with torch.device("meta"), FlopCounterMode(display=False) as counter:
        model(torch.empty(2, 3, image_size, image_size))
    counts = {k.split(".", 1)[1] if "." in k else "": sum(v.values()) for k, v in counter.get_flop_counts().items()}
    total = max(1, counts.get("", 0) or sum(counts.get(n, 0) for n, _ in blocks))
    if not blocks:
        return (Unit("model", 1.0, tuple(p.numel() for p in model.parameters())),)
    inner = {id(p) for _, b in blocks for p in b.parameters()}
    head_mods = {m for name, m in model.named_children() if name in ("fc", "classifier", "head", "heads")}
    head_ids = {id(p) for m in head_mods for p in m.parameters()}
    stem = tuple(p.numel() for p in model.parameters() if id(p) not in inner and id(p) not in head_ids)
    head = tuple(p.numel() for p in model.parameters() if id(p) in head_ids)
    shares = {n: counts.get(n, 0) / total for n, _ in blocks}
    head_share = sum(counts.get(n, 0) for n, m in model.named_children() if m in head_mods) / total
    out = [Unit("stem", max(0.0, 1.0 - sum(shares.values()) - head_share), stem)]
    out += [Unit(n, shares[n], tuple(p.numel() for p in b.parameters())) for n, b in blocks]
    return tuple(out + [Unit("head", head_share, head)])


@functools.lru_cache(maxsize=16)
def forward_flops(model_name: str, image_size: int, tp: int = 1) -> int:
    """FLOPs of one image's forward (torch.utils.flop_counter on the meta device); of one
    tensor-parallel rank's share for tp > 1."""
    from torch.utils.flop_counter import FlopCounterMode

    model = meta_model(model_name, image_size=image_size, tp=tp)  # built outside the count: its size check runs it
    with torch.device("meta"), FlopCounterMode(display=False) as counter:
        model(torch.empty(1, 3, image_size, image_size))
    return counter.get_total_flops()


class _Schedule:
    """Tasks in program order on named resources; each starts when its resource is free and its
    dependencies have ended. With overlap=False every resource is the same one."""

    def __init__(self, overlap: bool, meet_ms: float = 0.0):
        self.overlap, self.free, self.end = overlap, {}, []
        self.comm, self.calls = 0.0, 0
        # Link.meet_ms once per meeting: the collectives a rank issues at one point of its compute (after the
        # same compute task: its latest dependency, else the latest added) meet once, back to back
        self.meet_ms, self.meets, self.computed, self.issued = meet_ms, 0, [], None

    def add(self, resource: str, ms: float, deps=()) -> int:
        if resource == "comm" and ms > 0:
            after = max((d for d in deps if d in self.computed), default=self.computed[-1] if self.computed else -1)
            if after != self.issued:
                ms, self.meets, self.issued = ms + self.meet_ms, self.meets + 1, after
        res = resource if self.overlap else "one"
        start = max([self.free.get(res, 0.0), *(self.end[d] for d in deps)])
        self.end.append(start + ms)
        self.free[res] = self.end[-1]
        if resource == "comm":
            self.comm, self.calls = self.comm + ms, self.calls + 1
        else:
            self.computed.append(len(self.end) - 1)
        return len(self.end) - 1

    @property
    def length(self) -> float:
        return max(self.end, default=0.0)


@functools.lru_cache(maxsize=16)
def buffer_groups(model_name: str, image_size: int) -> tuple[int, ...]:
    """Bytes of the model's buffers per dtype, in first-seen order: the messages of DDP's buffer broadcast
    (torch/csrc/distributed/c10d/comm.cpp broadcast_coalesced buckets tensors by type). BatchNorm's float
    statistics and its int64 batch counts: two for a ResNet, none for a ViT."""
    model = meta_model(model_name, image_size=image_size)
    groups: dict = {}
    for b in model.buffers():
        groups[b.dtype] = groups.get(b.dtype, 0) + b.numel() * b.element_size()
    return tuple(groups.values())


def _buckets(params: list[tuple[int, int]], elem_bytes: int, first: int, cap: int) -> list[tuple[int, float]]:
    """DDP's assignment: (unit, elements) of every parameter in reverse order, into buckets closed at
    the cap (the first at `first`). Each bucket as (the unit whose backward makes it ready, bytes):
    backward runs the units in reverse, so the bucket's earliest unit is the last to be ready."""
    out, units_, size = [], [], 0
    for unit, numel in reversed(params):
        units_.append(unit)
        size += numel * elem_bytes
        if size >= (first if not out else cap):
            out.append((min(units_), float(size)))
            units_, size = [], 0
    return out + [(min(units_), float(size))] if units_ else out


def _issued_together(times: list[float], overlap: bool) -> float:
    """Collectives issued async and waited together: NCCL runs them in order on its stream, gloo on its
    process group's worker threads (ProcessGroupGloo.hpp Options: threads{2})."""
    return _on_lanes(times, 1 if overlap else GLOO_THREADS)


def _on_lanes(times: list[float], lanes: int) -> float:
    """The makespan of work queued in order and taken by the first of `lanes` workers to be free."""
    free = [0.0] * max(1, lanes)
    for t in times:
        i = free.index(min(free))
        free[i] += t
    return max(free)


def time_shares(us, pieces: list | None = None) -> tuple[list[float], list[float]]:
    """Per unit, its share of the forward and of the backward time: the FLOP share, or with the measured
    (fwd_ms, bwd_ms) of a ResNet's four one-stage pieces (stem+layer1, layer2, layer3, layer4+head:
    calibrate times them) each piece's measured share spread over its units by FLOPs. On a CPU the two
    differ most where it matters for a bucket's readiness: resnet18's layer4+head holds 23% of the FLOPs and,
    batch 64 at 32 px on one thread, 42% of the backward time (63% at batch 8; 37% at 64 px), and it runs first."""
    flops = [u.share for u in us]
    piece = {"stem": 0, "head": 3, "layer1": 0, "layer2": 1, "layer3": 2, "layer4": 3}
    of = [piece.get(u.name.split(".")[0]) for u in us]
    usable = pieces and len(pieces) == 4 and all(
        len(p) >= 2 and all(math.isfinite(x) and x > 0 for x in p[:2]) for p in pieces)
    if not usable or None in of:  # a malformed entry must not cost the row its prediction
        return flops, flops
    out = []
    for col in (0, 1):
        total = sum(p[col] for p in pieces) or 1.0
        in_piece = [sum(f for f, k in zip(flops, of) if k == j) or 1.0 for j in range(4)]
        out.append([pieces[k][col] / total * f / in_piece[k] for f, k in zip(flops, of)])
    return out[0], out[1]


def _forward_backward(s: _Schedule, us, c: Compute, shares=None) -> tuple[list[int], list[int]]:
    fs, bs = shares or time_shares(us)
    fwd, bwd, last = [], [None] * len(us), ()
    for i in range(len(us)):
        fwd.append(s.add("compute", c.fwd_ms * fs[i], last))
        last = (fwd[-1],)
    for i in reversed(range(len(us))):
        bwd[i] = s.add("compute", c.bwd_ms * bs[i], last)
        last = (bwd[i],)
    return fwd, bwd


@dataclass(frozen=True)
class _Run:
    """What every strategy's schedule reads: the setup, its units, one rank's compute and the link."""
    setup: Setup
    info: Strategy | None  # the strategy table's entry (common/strategies.py)
    us: tuple
    c: Compute
    link: Link
    overlap: bool
    shares: tuple
    w_bytes: int  # bytes of a weight element the collectives move
    g_bytes: int  # of a gradient element

    @property
    def n(self) -> int:
        return self.setup.world_size

    @property
    def numel(self) -> int:
        return sum(sum(u.params) for u in self.us)


def _wire_bytes(setup: Setup, info: Strategy | None) -> tuple[int, int]:
    """(weight, gradient) element bytes on the wire: DeepSpeed's in its half type, FSDP's mixed precision gathers
    2-byte weights and reduces in fp32 (pytorch_FSDP.py reduce_dtype; accelerate FSDP in half), the rest fp32."""
    if info is None:
        return 4, 4
    w_bytes = ITEMSIZE.get(setup.precision, 4) if info.deepspeed else 4
    g_bytes = w_bytes
    if setup.precision in ("fp16", "bf16") and info.family == "fsdp":
        w_bytes = 2
        g_bytes = 2 if info.library == "accelerate" else 4
    return w_bytes, g_bytes


def predict_step(setup: Setup, c: Compute, link: Link, overlap: bool, *, strategy: str | None = None,
                 microbatches: int = 1, stages: list[int] | None = None,
                 pieces: list | None = None) -> StepPrediction:
    """The predicted step of `setup` (its strategy, or `strategy` for pp_* that the memory model does not
    know); c is one rank's compute at the setup's micro-batch. pieces: the measured forward and backward ms
    of the model's four one-stage pieces (calibration.find_pieces): a pipeline's stage shares, the others'
    unit shares (time_shares), else FLOP shares."""
    st = strategy or setup.strategy
    n = setup.world_size
    us = units(setup.model, setup.image_size)
    p = StepPrediction(data_ms=c.data_ms * setup.grad_accum)
    info = of(st)  # what the strategy is (common/strategies.py); None: no communication model
    if info is not None and info.family == "pp":
        return _pipeline(p, us, c, link, overlap, n, microbatches, stages or [], setup, pieces, st)
    if info is not None and info.family in ("tp", "tp_fsdp") and n > 1:
        return _tensor_parallel(p, setup, c, link, overlap)
    run = _Run(setup, info, us, c, link, overlap, time_shares(us, pieces), *_wire_bytes(setup, info))
    # DDP's buckets go out beside the backward on a CPU too: the Reducer hands each to the process group
    # and waits for them all only at the backward's end (reducer.cpp finalize_backward), and gloo runs an
    # all-reduce on its own worker threads (ProcessGroupGloo enqueue -> runLoop), not the caller's. The rows
    # measure it: comm_overlap_pct 62-84% for DDP and accelerate's DDP in the Xeon time grids, 0% for FSDP
    # and DeepSpeed ZeRO-1/2, whose collectives the training thread waits on.
    beside = not overlap and info is not None and info.ddp_buckets and n > 1
    s = _Schedule(overlap or beside, link.meet_ms if n > 1 else 0.0)
    for _ in range(setup.grad_accum - 1):  # micro-batches before the last: no gradient communication (no_sync)
        _forward_backward(s, us, c, run.shares)
    # shard: the optimizer's share of the parameters; post: collectives outside the backward (before the
    # forward, after the optimizer step), exposed; post_calls: their number (None: not counted); meets: the
    # meetings among them, a run of collectives with compute before it
    family, stage = (info.family, info.zero_stage) if info is not None else ("", None)
    if info is not None and (not info.data_parallel or n == 1):
        # DataParallel over one GPU calls its module and returns (torch/nn/parallel/data_parallel.py
        # forward: len(self.device_ids) == 1): no weights broadcast, no gradients reduced
        _forward_backward(s, us, c, run.shares)
        shard, post, post_calls, meets = 1.0, 0.0, 0, 0
    elif family == "dp":
        shard, post, post_calls, meets = _dp(s, run)
    elif family in ("ddp", "ddp_zero") or stage == 0:
        shard, post, post_calls, meets = _ddp(s, run)
    elif family == "fsdp" or stage == 3:
        shard, post, post_calls, meets = _sharded(s, run)
    elif stage in (1, 2):
        shard, post, post_calls, meets = _zero12(s, run)
    else:
        _forward_backward(s, us, c, run.shares)
        shard, post, post_calls, meets = 1.0, 0.0, None, 0
        p.notes.append(f"{st}: no communication model; compute and optimizer only")
    return _finish(p, s, run, beside, shard, post, post_calls, meets)


def _finish(p: StepPrediction, s: _Schedule, run: _Run, beside: bool, shard: float, post: float,
            post_calls: int | None, meets: int) -> StepPrediction:
    """The prediction's components from the schedule: compute, what the schedule runs past it (exposed), the
    collectives outside the backward, the ranks' skew, and the optimizer on its share."""
    c, n = run.c, run.n
    compute = (c.fwd_ms + c.bwd_ms) * run.setup.grad_accum
    one_process = run.info is not None and (not run.info.data_parallel or run.info.family == "dp")  # dp: one
    synced = n > 1 and not one_process
    exposed = max(0.0, s.length - compute)
    if beside:
        # what the buckets beside the backward take from it on a CPU, whose cores the training thread and
        # gloo's threads share: fitted, not derived (docs/time-model.md "DDP's buckets on a CPU"), on the hidden
        # meetings' waits too, as it was fitted
        compute += CPU_BESIDE_COST * max(0.0, s.comm - exposed)
    elif run.overlap:
        compute += _gpu_contention(s, exposed, run.link)
    p.compute_ms = compute
    post += meets * s.meet_ms
    own = c.own_comm_ms if n == 1 else 0.0
    p.comm_exposed_ms = exposed + post + (c.sync_ms if synced else 0.0) + own
    p.comm_ms = s.comm + post + own
    p.calls = None if post_calls is None else s.calls + post_calls
    p.optimizer_ms = c.opt_ms * shard
    return p


def _dp(s: _Schedule, run: _Run) -> tuple:
    """DataParallel: one process; the whole fp32 model's weights broadcast and gradients reduced each step
    (torch.cuda.comm, per GPU), exposed; on GPUs also its scatter and its launches (_dp_gpu)."""
    link, n = run.link, run.n
    _forward_backward(s, run.us, run.c, run.shares)
    post = link.ms("broadcast", run.numel * 4, 2) + link.ms("reduce", run.numel * 4, 2)
    if run.overlap:
        post += _dp_gpu(run.c, link, n)
    return 1.0, post, None, 0  # torch.cuda.comm's copies, not a process group's collectives


def _ddp(s: _Schedule, run: _Run) -> tuple:
    """DDP, accelerate DDP, DDP + ZeroRedundancyOptimizer and DeepSpeed's ZeRO-0: gradient buckets all-reduced
    as they are ready (ZeRO-0: after the whole backward), DDP's buffers broadcast before the next forward, and
    DDP+ZeRO's parameters broadcast from their owners after its sharded step."""
    link, n, g_bytes = run.link, run.n, run.g_bytes
    _, bwd = _forward_backward(s, run.us, run.c, run.shares)
    params = [(i, x) for i, u in enumerate(run.us) for x in u.params]
    prev = ()
    if run.info.deepspeed:  # ZeRO-0
        # no hooks: engine.backward -> allreduce_gradients -> buffered_allreduce_fallback after the whole
        # backward, in buffers of MEMORY_OPT_ALLREDUCE_SIZE (5e8) elements (deepspeed/runtime/engine.py)
        buckets = [(0, b) for _, b in _buckets(params, g_bytes, DS_ALLREDUCE_ELEMENTS * g_bytes,
                                                DS_ALLREDUCE_ELEMENTS * g_bytes)]
    else:
        buckets = _buckets(params, g_bytes, FIRST_BUCKET_BYTES, BUCKET_BYTES)
    for unit, nbytes in buckets:
        prev = (s.add("comm", link.ms("all_reduce", nbytes, n), (bwd[unit], *prev)),)
    shard, post, post_calls, meets = 1.0, 0.0, 0, 0
    if run.info.ddp_buckets:  # not DeepSpeed's ZeRO-0: its engine broadcasts the weights once, at start-up
        # before every forward that follows a synchronizing backward DDP broadcasts rank 0's buffers
        # (distributed.py _pre_forward -> _sync_buffers; forward_sync_buffers, formerly broadcast_buffers,
        # on by default; under no_sync only the first micro-batch's: require_forward_param_sync), in 250
        # MiB buckets of one dtype each, at most 2 in flight (c10d comm.cpp broadcast_coalesced): gloo's
        # two threads run them at once. The forward reads them; the ranks come from the loader: a meeting
        groups = buffer_groups(run.setup.model, run.setup.image_size)
        post += _issued_together([link.ms("broadcast", b, n) for b in groups], run.overlap)
        post_calls, meets = len(groups), 1 if groups else 0
    if run.info.family == "ddp_zero":
        shard = 1.0 / n
        # one per parameter (bus factor 1), issued with async_op=True and waited together
        # (ZeroRedundancyOptimizer._broadcast_params_from_rank)
        post += _issued_together([link.ms("broadcast", x * run.w_bytes, n) for _, x in params], run.overlap)
        post_calls += len(params)
        meets += 1  # issued back to back
    return shard, post, post_calls, meets


def _sharded(s: _Schedule, run: _Run) -> tuple:
    """FSDP2 (full-shard, shard-grad-op, hybrid priced as full-shard) and DeepSpeed ZeRO-3 (_fsdp), the optimizer
    on 1/n; ZeRO-3 then the gradient norm's all-reduce, the persistent weights' gathers, fp16's overflow check."""
    link, n, numel, w_bytes = run.link, run.n, run.numel, run.w_bytes
    regather, persist, bucket, prefetch = run.info.sharding != "shard-grad-op", 0, 0, 0
    deepspeed = run.info.deepspeed
    if deepspeed:
        z = run.setup.zero
        # partitioned_param_coordinator.__params_to_release: a module's weights stay gathered after its
        # forward when they are used again within stage3_max_reuse_distance elements of the trace
        # (forward then backward: at most 2 x the model's); parameter_offload.mark_persistent_parameters:
        # weights of at most stage3_param_persistence_threshold elements stay whole through forward and
        # backward (gathered after the step, below), not gathered per unit; stage3.py
        # reduce_independent_p_g_buckets_and_remove_grads: gradients reduce-scattered per reduce_bucket_size
        regather = 2 * numel > int(z.get("stage3_max_reuse_distance", DS_REUSE_DISTANCE))
        persist = int(z.get("stage3_param_persistence_threshold", DS_PERSISTENCE))
        bucket = int(z.get("reduce_bucket_size", DS_REDUCE_BUCKET)) * run.g_bytes
        # partitioned_param_coordinator.fetch_sub_module: the queue prefetched up to this many elements
        # (0: no prefetch, each module gathers its own: priced per unit)
        prefetch = int(z.get("stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET))
    _fsdp(s, run.us, run.c, link, n, w_bytes, run.g_bytes, regather, persist, bucket, prefetch, run.shares)
    if not deepspeed:
        return 1.0 / n, 0.0, 0, 0
    post, meets, post_calls = link.ms("all_reduce", 4, n), 1, 1  # the norm (stage3.py _get_norm_groups)
    # the persistent weights' optimizer state is partitioned too: stage3.py _post_step all-gathers
    # them after every step, one all_gather_into_tensor per parameter issued async and then waited
    # in order (partition_parameters.py _allgather_params_coalesced), as DDP+ZeRO's broadcasts
    kept = [x for u in run.us for x in u.params if x <= persist]
    if kept:
        post, meets = post + _issued_together([link.ms("all_gather", x * w_bytes, n) for x in kept], run.overlap), 2
        post_calls += len(kept)
    if run.setup.precision == "fp16":  # stage3.py _overflow_check_and_loss_scale_update: fp16 only
        post, post_calls = post + link.ms("all_reduce", 4, n), post_calls + 1
    return 1.0 / n, post, post_calls, meets


def _zero12(s: _Schedule, run: _Run) -> tuple:
    """DeepSpeed ZeRO-1/2: gradients all-reduced in reduce_bucket_size buckets (under the backward only with
    overlap_comm), the optimizer on 1/n, then the norm's all-reduce, the weights' all-gather, and in half
    precision the overflow check's all-reduce."""
    link, n, g_bytes = run.link, run.n, run.g_bytes
    _, bwd = _forward_backward(s, run.us, run.c, run.shares)
    params = [(i, x) for i, u in enumerate(run.us) for x in u.params]
    z = run.setup.zero
    cap = int(z.get("reduce_bucket_size", DS_REDUCE_BUCKET)) * g_bytes
    # average_tensor: reduce_scatter=False all-reduces the whole bucket whatever the other option says
    kind = "reduce" if z.get("reduce_scatter", True) and not z.get("use_multi_rank_bucket_allreduce", True) \
        else "all_reduce"
    # overlap_comm defaults to stage 3 only (zero/config.py overlap_comm_valid): without it ZeRO-1 reduces
    # after the backward (engine.allreduce_gradients), and ZeRO-2's hooks reduce on the compute stream
    hidden = bool(z.get("overlap_comm", False))
    prev = ()
    for unit, nbytes in _buckets(params, g_bytes, cap, cap):
        prev = (s.add("comm", link.ms(kind, nbytes, n), (bwd[unit if hidden else 0], *prev)),)
    post = link.ms("all_gather", run.numel * run.w_bytes, n) + link.ms("all_reduce", 4, n)  # + the gradient norm
    meets, post_calls = 2, 2  # the norm after its computation, the gather after the optimizer
    if run.setup.precision in ("fp16", "bf16"):  # check_overflow's all-reduce (engine.py: fp16 always, bf16 by
        post, post_calls = post + link.ms("all_reduce", 4, n), post_calls + 1  # default; not fp32)
    return 1.0 / n, post, post_calls, meets


def _gpu_contention(s: _Schedule, exposed: float, link: Link) -> float:
    """What the collectives hidden under the compute take from it on a GPU: their kernels hold link.sm_share of
    the SMs for as long as they run (NCCL runs one CTA per channel), so the compute they overlap loses that
    share of the time they hide. The exposed part (the last bucket, what the schedule waits for) is already in
    the step."""
    return getattr(link, "sm_share", 0.0) * max(0.0, s.comm - exposed)


def _dp_gpu(c: Compute, link: Link, n: int) -> float:
    """DataParallel's work over n GPUs beyond the weights' broadcast and the gradients' reduce
    (torch/nn/parallel/data_parallel.py forward): GPU 0 scatters the batch to the others (scatter_gather.py,
    one copy per GPU from GPU 0's link), and one process launches every replica's forward from its own thread
    (parallel_apply.py), the threads taking turns at the GIL: the forward takes at least n launches of one
    replica's. The backward runs on autograd's device threads, outside the GIL. The outputs' gather and the
    loss on GPU 0 are a batch of logits: left out."""
    scatter = link.ms("send", c.scatter_bytes * (n - 1) / n, 2)
    return scatter + max(0.0, n * c.launch_fwd_ms - c.fwd_ms)


def _fsdp(s: _Schedule, us, c: Compute, link: Link, n: int, w_bytes: int, g_bytes: int, regather: bool,
          persist: int = 0, bucket: int = 0, prefetch: int = 0, shares=None) -> None:
    """FSDP2 (and ZeRO-3) per unit; the stem and head form the root unit, gathered first. ZeRO-3: weights
    of at most `persist` elements are not gathered in the forward (the caller gathers them after the step),
    the others in coalesced calls of up to `prefetch` elements (DeepSpeed's prefetch bucket; 0: per unit),
    and the gradients are reduce-scattered in buckets of `bucket` bytes as they are ready, not per unit.
    shares: the units' forward and backward time shares (time_shares), else their FLOP shares."""
    fs, bs = shares or time_shares(us)
    gathered = [sum(x for x in u.params if x > persist) for u in us]
    blocks = list(range(1, len(us) - 1)) if len(us) > 1 else [0]

    def gather(elements: int, deps=()) -> int:
        return s.add("comm", link.ms("all_gather", elements * w_bytes, n), deps)

    if prefetch:
        done, last = _zero3_forward(s, c, fs, bs, gathered, prefetch, gather)
    else:
        done, last = _fsdp_forward(s, c, fs, bs, gathered, blocks, gather)
    order = list(reversed(blocks))
    gathers = {}
    for k, i in enumerate(order):
        if regather and i not in gathers:  # the unit itself (only the first has no prefetch)
            gathers[i] = gather(gathered[i], last)
        if regather and k + 1 < len(order):  # prefetch the next unit's gather when this one starts
            gathers[order[k + 1]] = gather(gathered[order[k + 1]], last)
        b = done[i] = s.add("compute", c.bwd_ms * bs[i], (*last, gathers[i]) if regather else last)
        if not bucket:
            s.add("comm", link.ms("reduce_scatter", sum(us[i].params) * g_bytes, n), (b,))
        last = (b,)
    if len(us) > 1:
        b = done[0] = s.add("compute", c.bwd_ms * bs[0], last)
        if not bucket:
            s.add("comm", link.ms("reduce_scatter", (sum(us[0].params) + sum(us[-1].params)) * g_bytes, n), (b,))
    if bucket:  # a bucket goes when its earliest unit's backward is done
        params = [(i, x) for i in range(len(us)) for x in us[i].params]
        for unit, nbytes in _buckets(params, g_bytes, bucket, bucket):
            s.add("comm", link.ms("reduce_scatter", nbytes, n), (done[unit],))


def _zero3_forward(s: _Schedule, c: Compute, fs, bs, gathered: list, prefetch: int, gather) -> tuple[dict, tuple]:
    """ZeRO-3's forward: the units' weights in forward order cut into prefetch buckets, each module's fetch
    topping up the prefetch (the next bucket goes a unit later); the head's forward and backward back to back.
    Returns ({unit: its backward}, the last task)."""
    chunks, chunk_of = [], {}  # [elements], unit -> its bucket
    for i, x in enumerate(gathered):
        if x:
            if not chunks or chunks[-1] >= prefetch:  # DeepSpeed closes a bucket once it reaches the size
                chunks.append(0)
            chunks[-1] += x
            chunk_of[i] = len(chunks) - 1
    ags, done, last, units_ = [], {}, (), len(gathered)
    for i in range(units_):
        if len(ags) < len(chunks):
            ags.append(gather(chunks[len(ags)], last))
        deps = (*last, ags[chunk_of[i]]) if i in chunk_of else last
        if i == units_ - 1 and units_ > 1:
            done[i] = s.add("compute", c.fwd_ms * fs[i] + c.bwd_ms * bs[i], deps)
            last = (done[i],)
        else:
            last = (s.add("compute", c.fwd_ms * fs[i], deps),)
    return done, last


def _fsdp_forward(s: _Schedule, c: Compute, fs, bs, gathered: list, blocks: list, gather) -> tuple[dict, tuple]:
    """FSDP2's forward: the root unit (stem and head) gathered first, then each block's all-gather (issued ahead:
    the CPU runs ahead of the device) before its forward; the head's forward and backward back to back."""
    units_ = len(gathered)
    root = gathered[0] + gathered[-1] if units_ > 1 else 0
    ag_root = gather(root) if root else None
    last, done = (ag_root,) if ag_root is not None else (), {}
    if units_ > 1:
        last = (s.add("compute", c.fwd_ms * fs[0], last),)
    for i in blocks:
        ag = gather(gathered[i], (ag_root,) if ag_root is not None else ())
        last = (s.add("compute", c.fwd_ms * fs[i], (*last, ag)),)
    if units_ > 1:
        done[units_ - 1] = s.add("compute", c.fwd_ms * fs[-1] + c.bwd_ms * bs[-1], last)
        last = (done[units_ - 1],)
    return done, last


def _tensor_parallel(p: StepPrediction, setup: Setup, c: Compute, link: Link, overlap: bool) -> StepPrediction:
    """pytorch_TP.py: each rank computes its tp rank's model (its share of the FLOPs: heads/tp heads and
    mlp/tp MLP units per block, the rest whole), and every block all-reduces micro-batch x tokens x hidden
    twice in forward and twice in backward over the tp ranks (comm.tp_expected_bytes). Those wait on the
    compute before them and the compute after waits on them (Megatron's f and g sit on the critical
    path): exposed on every device. tp_fsdp adds FSDP2 full-shard over the dp ranks of the rank's
    shards, scheduled as fsdp_full-shard. The optimizer steps the rank's shards."""
    from .volume import tp_layout

    tp, dp, accum = setup.tp, setup.dp, setup.grad_accum
    share = forward_flops(setup.model, setup.image_size, tp) / forward_flops(setup.model, setup.image_size)
    local = replace(c, fwd_ms=c.fwd_ms * share, bwd_ms=c.bwd_ms * share)
    blocks, tokens, hidden = tp_layout(setup.model, setup.image_size)
    act = setup.micro_batch * tokens * hidden
    forward = ITEMSIZE.get(setup.precision, 4)  # autocast: the forward all-reduces carry half outputs
    reduces = blocks * 2 * (link.ms("all_reduce", act * forward, tp) + link.ms("all_reduce", act * 4, tp)) * accum
    reduces += blocks * 4 * accum * link.meet_ms  # each after its own compute: a meeting
    compute = (local.fwd_ms + local.bwd_ms) * accum
    s = _Schedule(overlap, link.meet_ms)
    lus = units(setup.model, setup.image_size, tp)
    for _ in range(accum - 1 if dp > 1 else accum):
        _forward_backward(s, lus, local)
    if dp > 1:
        _fsdp(s, lus, local, link, dp, 4, 4, True)
    full = sum(sum(u.params) for u in units(setup.model, setup.image_size))
    mine = sum(sum(u.params) for u in lus)
    p.compute_ms = compute
    p.comm_exposed_ms = max(0.0, s.length - compute) + reduces + c.sync_ms
    p.comm_ms = s.comm + reduces
    p.optimizer_ms = c.opt_ms * mine / full / dp
    return p


def _pipeline(p: StepPrediction, us, c: Compute, link: Link, overlap: bool, n: int, m: int, stages: list[int],
              setup: Setup, pieces: list | None = None, schedule: str = "pp_gpipe") -> StepPrediction:
    """c is the compute of ONE micro-batch through the whole model; stages: ResNet stages per piece.
    GPipe and 1F1B (one stage per rank) are simulated op by op in the order their _step_microbatches
    runs them; interleaved 1F1B (two stages per rank) is not: (m + n - 1) slots of the slowest piece.
    compute_ms and optimizer_ms are a rank's own work, the mean over ranks as the rows' columns are; the
    rest of the step it waits, which the measured columns count as exposed communication (a receive's wait).
    Interleaved 1F1B's compute_ms is the schedule's length, bubble included, and its optimizer the largest
    stage's: its parts are not the ranks' mean."""
    shares, params, cut_bytes = _stage_split(us, stages or [4], setup)
    fwd, bwd = shares, shares
    if pieces:
        fwd, bwd = _piece_shares(pieces, stages or [4])
        p.notes.append("stage shares of the measured pieces")
    micro = max(1, setup.batch_size // max(1, m))
    # one activation forward and its gradient back per micro-batch and cut; each send is issued straight
    # after its stage's forward or backward, and its receiver's wait ends when the sender's thread gets to
    # it: a meeting (Link.meet_ms), as a data-parallel rank's collective after its compute
    sends = [link.ms("send", b * micro, 2) + link.meet_ms for b in cut_bytes]
    p.comm_ms = 2 * m * sum(sends)
    p.optimizer_ms = c.opt_ms * max(params) / max(1, sum(params))
    f = [x * c.fwd_ms for x in fwd]
    b = [x * c.bwd_ms for x in bwd]
    if schedule in ("pp_gpipe", "pp_1f1b") and len(f) == n:
        # each rank steps its own stage's optimizer when its last backward is done, and its next forward
        # waits for that and for its input: the largest stage's step hides partly behind the others' work
        opt = [c.opt_ms * x / max(1, sum(params)) for x in params]
        period, busy = _simulate_pipeline(schedule, f, b, sends, m, overlap, opt)
        # as the rows' columns, the mean over ranks: each rank's own forward, backward and optimizer, the rest
        # of its step waiting (a receive's wait, which the rows count as exposed communication)
        p.compute_ms, p.optimizer_ms = busy, sum(opt) / len(opt)
        p.comm_exposed_ms = max(0.0, period - busy - p.optimizer_ms)
        return p
    slowest = max(range(len(f)), key=lambda i: f[i] + b[i])
    p.compute_ms = (m + len(f) - 1) * (f[slowest] + b[slowest])
    p.comm_exposed_ms = p.comm_ms if not overlap else 2 * sum(sends)  # overlapped but the first and the last
    return p


def _pipeline_order(schedule: str, rank: int, s: int, m: int) -> list[tuple[str, int]]:
    """The (F|B, micro-batch) order of one rank, as torch/distributed/pipelining/schedules.py runs it:
    ScheduleGPipe._step_microbatches does every forward, then every backward in micro-batch order;
    Schedule1F1B._step_microbatches min(m, s - rank) forwards, then backward and forward alternately,
    then the remaining backwards."""
    if schedule == "pp_gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    warm = min(m, s - rank)
    order = [("F", k) for k in range(warm)]
    nf, nb = warm, 0
    while nb < m:
        order.append(("B", nb))
        nb += 1
        if nf < m:
            order.append(("F", nf))
            nf += 1
    return order


def _simulate_pipeline(schedule: str, f: list[float], b: list[float], sends: list[float], m: int,
                       overlap: bool, opt: list[float] | None = None) -> tuple[float, float]:
    """(the step's period, the ranks' mean busy time in one step) of one stage per rank: an op starts when its
    rank is free and its input has arrived (a forward: the previous stage's forward of the micro-batch plus
    the send; a backward: the next stage's backward plus the send, and its own forward). Without overlap
    (CPU: gloo's threads take the cores the rank computes on) a send also keeps its sender busy. Two
    steps run, each rank's optimizer (opt, ms) after its own last op of each: the period is the second
    step's end less the first's (a rank that finishes early steps its optimizer while the others drain)."""
    s = len(f)
    opt = opt or [0.0] * s
    orders = []
    for r in range(s):
        one = _pipeline_order(schedule, r, s, m)
        orders.append(one + [("O", 0)] + [(kind, k + m) for kind, k in one] + [("O", 1)])
    done: dict = {}
    free, pos, busy = [0.0] * s, [0] * s, 0.0
    while any(pos[r] < len(orders[r]) for r in range(s)):
        moved = False
        for r in range(s):
            while pos[r] < len(orders[r]):
                kind, k = orders[r][pos[r]]
                if kind == "O":
                    end = free[r] + opt[r]
                    done[(r, kind, k)] = free[r] = end
                    pos[r] += 1
                    moved = True
                    continue
                if kind == "F":
                    dep = (r - 1, "F", k) if r > 0 else None
                    arrive = done.get(dep, None) if dep else 0.0
                    if dep and arrive is not None:
                        arrive += sends[r - 1]
                    ms, out = f[r], sends[r] if r + 1 < s else 0.0
                else:
                    dep = (r + 1, "B", k) if r + 1 < s else (r, "F", k)
                    arrive = done.get(dep)
                    if arrive is not None and r + 1 < s:
                        arrive += sends[r]
                    ms, out = b[r], sends[r - 1] if r > 0 else 0.0
                if arrive is None:
                    break
                end = max(free[r], arrive) + ms
                done[(r, kind, k)] = end
                free[r] = end + (0.0 if overlap else out)
                busy += ms if k < m else 0.0
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule}: the simulated pipeline deadlocked")
    return max(done[(r, "O", 1)] for r in range(s)) - max(done[(r, "O", 0)] for r in range(s)), busy / s


def _piece_shares(pieces: list, counts: list[int]) -> tuple[list[float], list[float]]:
    """Per stage of `counts` ResNet stages each: its share of the forward and of the backward time,
    from the four one-stage pieces' (fwd_ms, bwd_ms) (stem with the first, head with the last)."""
    tf, tb = sum(f for f, _ in pieces) or 1.0, sum(b for _, b in pieces) or 1.0
    out_f, out_b, first = [], [], 0
    for k in counts:
        out_f.append(sum(f for f, _ in pieces[first:first + k]) / tf)
        out_b.append(sum(b for _, b in pieces[first:first + k]) / tb)
        first += k
    return out_f, out_b


def _stage_split(us, counts: list[int], setup: Setup) -> tuple[list[float], list[int], list[float]]:
    """Per pipeline stage: forward share and parameters; the activation bytes crossing each cut."""
    layer_of = [u.name.split(".")[0] for u in us]
    order = ["layer1", "layer2", "layer3", "layer4"]
    bounds, first = [], 0
    for k in counts:
        bounds.append(order[first:first + k])
        first += k
    shares, params = [], []
    for si, layers in enumerate(bounds):
        pick = [i for i, name in enumerate(layer_of) if name in layers or (name == "stem" and si == 0)
                or (name == "head" and si == len(bounds) - 1)]
        shares.append(sum(us[i].share for i in pick))
        params.append(sum(sum(us[i].params) for i in pick))
    cut_bytes = [_activation_bytes(setup, layers[-1]) for layers in bounds[:-1]]
    return shares, params, cut_bytes


def _activation_bytes(setup: Setup, layer: str) -> float:
    """Bytes per image of the activation leaving `layer` (a cut), in the dtype it travels in."""
    model = meta_model(setup.model, image_size=setup.image_size)
    out = {}
    handle = model.get_submodule(layer).register_forward_hook(lambda _m, _i, o: out.setdefault("o", o))
    with torch.device("meta"):
        model(torch.empty(2, 3, setup.image_size, setup.image_size))  # 2: BatchNorm refuses one value per channel
    handle.remove()
    return out["o"].numel() / 2 * ITEMSIZE.get(setup.precision, 4)
