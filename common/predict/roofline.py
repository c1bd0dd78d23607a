"""GPU compute by roofline, per layer, from the datasheet (datasheet.py, common/measure/flops.py PEAK_TFLOPS).

A training step of the model is walked once on the meta device (trace: every aten op of the forward and the
backward, with its FLOPs and the elements it reads and writes, split into what grows with the batch and what
does not). On a GPU each op then takes

    max(FLOPs / (the rate of the math it runs in x its wave efficiency), bytes / the attainable HBM rate)

with the bytes of the precision as run (fp32 and TF32 keep fp32 activations; autocast and pure half 2-byte ones,
autocast adding the weights' casts). The step is never faster than the host can launch its kernels.

The rate of a math is not its datasheet peak: it is the rate the project's own H100 rows reached, per math
(REFERENCE: their measured compute phase, solved for the rate), carried to another GPU in proportion to SMs x
boost clock (Habitat's wave scaling) and never above that GPU's datasheet peak of the math. A half convolution
in NCHW is a class of its own: cuDNN's tensor-core kernels want NHWC, and the H100 ran ResNet50's NCHW AMP step
at 1.87x the time per image of its channels-last one; that cost moved with the SMs, not the HBM (the H200, 1.43x
the bandwidth, ran the NCHW step 9% faster, the channels-last one 15%). Those constants are fitted to the four
H100 rows, so those rows check nothing: whatif.py marks them "fitted, not a prediction".
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .datasheet import hbm_tbps, run_math, sm_ghz, sms

H100 = "NVIDIA H100 80GB HBM3"
# Attainable share of the datasheet HBM rate for streaming kernels, the same for every GPU: STREAM-type copy and
# triad kernels are reported near 0.9 (one published H100 SXM run: 3.02-3.09 TB/s of 3.35). An assumption more
# than a measurement; the H100 rates absorb it: at 0.8 or 1.0 no prediction of whatif.py moves more than 3%.
HBM_SHARE = 0.9
# The implicit-GEMM tile one CTA computes: CUTLASS's default threadblock shape for SIMT GEMMs, 128 x 128
# (include/cutlass/gemm/device/default_gemm_configuration.h); a GEMM of fewer tiles than SMs leaves SMs idle.
TILE = 128
# The project's H100 rows (NVIDIA H100 80GB HBM3, torch 2.11, cuDNN 9.19): the measured compute phase
# (step_compute_ms: forward and backward) of ResNet50 at 224, solved below for each math's rate. Fitted to
# these rows: results/campaigns/2026-11-26_h100_throughput/summary.csv, pytorch_SingleGPU fp32 and
# single_tf32 (batch 128, NCHW), amp_bf16_fast (batch 256, channels-last) and amp_bf16 (batch 128, NCHW).
REFERENCE = {"fp32": (128, False, 135.275), "tf32": (128, False, 70.636), "half": (256, True, 63.744),
             "half_nchw": (128, False, 59.592)}
# The launching thread's pace, a measurement of the H100: AMP bf16 at batch 32 (2 loader workers) took 27.35 ms
# of compute with the GPU 48% busy (results/campaigns/2026-11-27_h100_throughput_b/rows.csv): the host's time
# per launched op is 27.35 ms over that step's op count.
HOST_REFERENCE = (32, 27.35)
BN_FORWARD_PASSES = 1.5  # aten/src/ATen/native/cuda/Normalization.cuh: batch_norm_stats reads x, then
BN_BACKWARD_PASSES = 5 / 3  # batch_norm_elemt reads it again; backward_reduce and backward_elemt read dy and x twice
MM = ("convolution", "convolution_backward", "mm", "addmm", "bmm")
VIEWS = ("detach", "empty", "t", "view", "expand", "ones_like", "_unsafe_view", "reshape", "permute", "transpose",
         "alias", "zeros_like", "empty_like", "lift_fresh")


@dataclass(frozen=True)
class Op:
    name: str
    phase: str  # fwd | bwd
    kind: str  # mm | bn_fwd | bn_bwd | mem
    flops: float  # per image
    act: float  # elements read and written that grow with the batch, per image
    fixed: float  # elements read and written that do not (weights, their gradients, BatchNorm's statistics)
    gemm: tuple = ()  # (output rows per image, output columns) of the GEMM its tiles cover; () if split-K


@dataclass(frozen=True)
class Spec:
    """The precision as run on one GPU."""
    math: str  # fp32 (strict), tf32, fp16, bf16: what run_math says the convolutions compute in
    act: int  # bytes of an activation element
    weight: int  # bytes of a weight element a matmul reads
    autocast: bool  # the weights cast to half before each forward and their gradients back
    channels_last: bool


def spec(gpu: str, precision: str, tf32: bool = False, pure: bool = False, channels_last: bool = False) -> Spec:
    """precision fp32 (tf32 with --tf32), or fp16/bf16: autocast, or the whole model in half when `pure`."""
    half = precision in ("fp16", "bf16")
    return Spec(run_math(gpu, precision, tf32), 2 if half else 4, 2 if half else 4, half and not pure, channels_last)


def rate_class(s: Spec) -> str:
    """fp32, tf32, half (channels-last) or half_nchw: the classes of REFERENCE."""
    if s.math in ("fp16", "bf16"):
        return "half" if s.channels_last else "half_nchw"
    return s.math


class _Recorder(TorchDispatchMode):
    """Every aten op that launches a kernel, in order: (name, FLOPs, elements read and written, GEMM shape)."""

    def __init__(self):
        super().__init__()
        self.ops, self.phase = [], "fwd"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in VIEWS:
            return out
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        if name == "convolution_backward":  # dgrad and wgrad: two cuDNN kernels, each reading the output gradient
            dy, x, w = args[0], args[1], args[2]
            fwd = _flops(torch.ops.aten.convolution.default, (x, w, None, *args[4:10]), {}, dy)
            mask = args[10]
            io = dy.numel() + x.numel() + w.numel()
            if mask[0]:  # reads dy and w, writes dx: a GEMM whose output is the input's shape
                self.ops.append(("dgrad", self.phase, fwd, io, tuple(x.shape)))
            if mask[1]:  # reads dy and x, writes dw: its reduction runs over the batch (split-K fills the GPU)
                self.ops.append(("wgrad", self.phase, fwd, io, ()))
            return out
        flops = _flops(func, args, kwargs, out) if name in MM else 0
        shape = tuple(outs[0].shape) if outs and name in MM else ()
        self.ops.append((name, self.phase, flops, sum(t.numel() for t in ins + outs), shape))
        return out


def _flops(func, args, kwargs, out) -> int:
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(func.overloadpacket)
    return formula(*args, out_val=out, **kwargs) if formula else 0


def _record(model_name: str, image_size: int, batch: int, train: bool) -> list:
    import torch.nn.functional as F

    from ..models import meta_model

    model = meta_model(model_name, image_size=image_size)
    model.train(train)
    rec = _Recorder()
    with torch.device("meta"):
        x, y = torch.empty(batch, 3, image_size, image_size), torch.zeros(batch, dtype=torch.long)
        if not train:
            with torch.no_grad(), rec:
                model(x)
            return rec.ops
        with rec:
            loss = F.cross_entropy(model(x), y)
            rec.phase = "bwd"
            loss.backward()
    return rec.ops


def _kind(name: str, train: bool) -> str:
    if name in MM or name in ("dgrad", "wgrad"):
        return "mm"
    if "batch_norm" in name and train:
        return "bn_bwd" if "backward" in name else "bn_fwd"
    return "mem"


@functools.lru_cache(maxsize=16)
def trace(model_name: str, image_size: int, train: bool = True) -> tuple[Op, ...]:
    """The model's training step (train) or evaluation forward as Ops: traced at two batch sizes on the meta
    device, each op's elements split into a part per image and a part the batch does not change."""
    a, b = _record(model_name, image_size, 2, train), _record(model_name, image_size, 4, train)
    if [r[0] for r in a] != [r[0] for r in b]:
        raise RuntimeError(f"{model_name}: the traced ops differ between batch sizes")
    out = []
    for (name, phase, f2, e2, s2), (_, _, f4, e4, _) in zip(a, b):
        act = (e4 - e2) / 2
        gemm = ()
        if s2 and s2[0] == 2 and name != "wgrad":  # an output that grows with the batch: its rows are per image
            gemm = (math.prod(s2[2:]) if len(s2) > 2 else 1, s2[1] if len(s2) > 1 else 1)
        out.append(Op(name, phase, _kind(name, train), (f4 - f2) / 2, act, max(0.0, e2 - 2 * act), gemm))
    return tuple(out)


def weight_elements(model_name: str, image_size: int) -> int:
    """Elements of the convolution and linear weights: what autocast casts to half before each forward."""
    from ..models import model_facts

    return model_facts(model_name, image_size)[2]


def _waves(op: Op, batch: int, gpu: str) -> float:
    """The share of the GPU a GEMM's tiles keep busy: tiles / (SMs x full waves). A batch-32 layer4 of ResNet50
    (1,568 output rows, 512 columns: 52 tiles) fills 39% of an H100's 132 SMs, 87% of a P40's 30."""
    if not op.gemm:
        return 1.0
    rows, cols = op.gemm
    tiles = math.ceil(batch * rows / TILE) * math.ceil(cols / TILE)
    waves = tiles / sms(gpu)
    return waves / math.ceil(waves)


def _phase_ms(ops, gpu: str, s: Spec, batch: int, rate: float) -> dict:
    """GPU ms per phase: each op the slower of its math at `rate` FLOP/s and its bytes at the HBM rate."""
    hbm = hbm_tbps(gpu) * 1e12 * HBM_SHARE
    out = {"fwd": 0.0, "bwd": 0.0}
    for op in ops:
        passes = BN_FORWARD_PASSES if op.kind == "bn_fwd" else BN_BACKWARD_PASSES if op.kind == "bn_bwd" else 1.0
        nbytes = op.act * batch * s.act * passes + op.fixed * (s.weight if op.kind == "mm" else 4)
        t = nbytes / hbm
        if op.kind == "mm":
            t = max(t, op.flops * batch / (rate * _waves(op, batch, gpu)))
        out[op.phase] += t * 1e3
    return out


def _casts_ms(model_name: str, image_size: int, gpu: str, s: Spec) -> float:
    """Autocast's weight casts, one way: every conv and linear weight read in fp32 and written in half (the
    backward casts their gradients back, the same bytes)."""
    if not s.autocast:
        return 0.0
    return weight_elements(model_name, image_size) * 6 / (hbm_tbps(gpu) * 1e12 * HBM_SHARE) * 1e3


def launches(model_name: str, image_size: int, s: Spec, train: bool = True) -> int:
    """Kernels the host launches for one step (or one evaluation forward): the traced ops, and with autocast a
    cast per weight each way."""
    n = len(trace(model_name, image_size, train))
    if s.autocast:
        n += sum(1 for op in trace(model_name, image_size, train) if op.name in ("convolution", "addmm", "mm")
                 and op.phase == "fwd") * (2 if train else 1)
    return n


def _gpu_ms(model_name: str, image_size: int, gpu: str, s: Spec, batch: int, rate: float,
            train: bool = True) -> tuple[float, float]:
    ph = _phase_ms(trace(model_name, image_size, train), gpu, s, batch, rate)
    cast = _casts_ms(model_name, image_size, gpu, s)
    return ph["fwd"] + cast, ph["bwd"] + (cast if train else 0.0)


def _solve(f, lo: float, hi: float, target: float) -> float:
    """The x in [lo, hi] where the decreasing f(x) meets target (bisection; an end when it never does)."""
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
    return math.sqrt(lo * hi)


@functools.cache
def reference_rate(cls: str) -> float:
    """FLOP/s that the H100's convolutions of class `cls` (rate_class) reached in the project's own rows
    (REFERENCE): the rate at which the roofline gives their measured compute phase."""
    from ..measure.flops import gpu_peak_tflops

    batch, cl, target = REFERENCE[cls]
    half = cls.startswith("half")
    s = Spec("bf16" if half else cls, 2 if half else 4, 2 if half else 4, half, cl)
    return _solve(lambda r: sum(_gpu_ms("resnet50", 224, H100, s, batch, r)), 1e11,
                  gpu_peak_tflops(H100, s.math) * 1e12, target)


def rate(gpu: str, s: Spec) -> float:
    """FLOP/s of the convolutions of `s` on `gpu`: the H100's measured rate of their class x (SMs x clock) / the
    H100's, at most the datasheet's dense peak of their math."""
    from ..measure.flops import gpu_peak_tflops

    return min(gpu_peak_tflops(gpu, s.math) * 1e12, reference_rate(rate_class(s)) * sm_ghz(gpu) / sm_ghz(H100))


@functools.cache
def host_us() -> float:
    """The host's time per launched op, µs (HOST_REFERENCE: a launch-bound H100 step over its op count)."""
    _, ms = HOST_REFERENCE
    return ms * 1e3 / launches("resnet50", 224, Spec("bf16", 2, 2, True, False))


def compute_ms(model_name: str, image_size: int, gpu: str, s: Spec, batch: int,
               train: bool = True) -> tuple[float, float]:
    """(forward ms, backward ms) of `batch` images on `gpu` (train=False: one evaluation forward, backward 0):
    the roofline per op, and never less than the host's launches take."""
    fwd, bwd = _gpu_ms(model_name, image_size, gpu, s, batch, rate(gpu, s), train)
    host = launches(model_name, image_size, s, train) * host_us() / 1e3
    if host > fwd + bwd:  # launch-bound: the GPU waits for the host between kernels
        scale = host / (fwd + bwd)
        fwd, bwd = fwd * scale, bwd * scale
    return fwd, bwd
