"""Compute efficiency: FLOPs per training image, achieved TFLOP/s, the device's peak and MFU.

train_gflop_per_img: forward + backward FLOPs of one training image, counted by
    torch.utils.flop_counter.FlopCounterMode on a copy of the model built on the meta device (shapes
    only: no memory, no arithmetic, no RNG draw, the run's model and its BatchNorm statistics
    untouched). These are model FLOPs (the FLOP formulas of matmuls and convolutions, forward and
    both gradients): activation checkpointing's recomputation is not counted, elementwise ops
    (BatchNorm, ReLU, pooling, the optimizer) count zero, as in PaLM's MFU definition.
achieved_tflops: train_gflop_per_img * throughput_img_s / 1000, all devices together.
peak_tflops: the dense peak of the run's math (fp32; TF32 where the run allows it, cuDNN or cuBLAS;
    fp16 or bf16 tensor cores for --precision fp16/bf16, pure or autocast), times the GPUs the run
    drives. Read from PEAK_TFLOPS by the exact torch.cuda.get_device_name(): a device that is not in
    the table (A10G, MIG slices, ...) gets an empty peak and MFU, never another device's figure.
    On CPU it is measured: see cpu_gemm_tflops.
mfu: achieved_tflops / peak_tflops.
"""
from __future__ import annotations

import math
import sys
import time
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from ..distributed import barrier, global_rank, reduce_metrics
from ..precision import DTYPES, native_half_kernels
from . import Instrument

# Dense (no 2:4 sparsity) peak TFLOP/s per GPU: (fp32, tf32, fp16, bf16). None: the math does not
# exist on that device or its datasheet gives no figure. Datasheets quote tensor-core figures "with
# sparsity": those are halved here. Pre-Ampere GPUs have no TF32: allowing it leaves fp32 math.
_H100_SXM = (67.0, 494.5, 989.5, 989.5)  # TF32 989, FP16/BF16 1979 with sparsity
_H100_PCIE = (51.0, 378.0, 756.5, 756.5)  # TF32 756, FP16/BF16 1513 with sparsity
_NVL = (60.0, 417.5, 835.5, 835.5)  # H100 NVL and H200 NVL: TF32 835, FP16/BF16 1671 with sparsity
_A100 = (19.5, 156.0, 312.0, 312.0)  # every A100 form factor and memory size
PEAK_TFLOPS = {
    # https://www.nvidia.com/en-us/data-center/h100/ (datasheet table: SXM, PCIe, NVL)
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": _H100_PCIE,
    "NVIDIA H100 NVL": _NVL,
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: the H100 SXM compute, more memory)
    "NVIDIA H200": _H100_SXM,
    "NVIDIA H200 NVL": _NVL,
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    # https://images.nvidia.com/content/Solutions/data-center/a40/nvidia-a40-datasheet.pdf
    "NVIDIA A40": (37.4, 74.8, 149.7, 149.7),
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/datasheet-new/nvidia-a10-datasheet.pdf
    # (AWS's A10G is another part with no NVIDIA datasheet: not listed, so it gets no MFU)
    "NVIDIA A10": (31.2, 62.5, 125.0, 125.0),
    # https://www.nvidia.com/en-us/data-center/l4/ (datasheet: TF32 120, FP16/BF16 242.5 with sparsity)
    "NVIDIA L4": (30.3, 60.0, 121.0, 121.0),
    # https://www.nvidia.com/en-us/data-center/l40s/ (datasheet gives dense | sparse: TF32 183 | 366,
    # FP16/BF16 362.05 | 733)
    "NVIDIA L40S": (91.6, 183.0, 362.05, 362.05),
    # https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf
    # (RTX 4090 column; FP16/BF16 tensor with FP32 accumulate, which is what PyTorch uses)
    "NVIDIA GeForce RTX 4090": (82.6, 82.6, 165.2, 165.2),
    # https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf
    "Tesla V100-SXM2-16GB": (15.7, 15.7, 125.0, None),
    "Tesla V100-SXM2-32GB": (15.7, 15.7, 125.0, None),
    "Tesla V100-PCIE-16GB": (14.0, 14.0, 112.0, None),
    "Tesla V100-PCIE-32GB": (14.0, 14.0, 112.0, None),
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf
    "Tesla T4": (8.1, 8.1, 65.0, None),
    # https://images.nvidia.com/content/pdf/tesla/184427-Tesla-P40-Datasheet-NV-Final-Letter-Web.pdf
    # (12 TFLOPS single precision; no fp16 figure: sm_61 runs fp16 at a small fraction of fp32)
    "Tesla P40": (12.0, 12.0, None, None),
}
MATHS = ("fp32", "tf32", "fp16", "bf16")


def run_math(precision: str, device: torch.device) -> str:
    """The math the run's matmuls and convolutions use: its half type, else TF32 when either cuDNN
    or cuBLAS may use it (common/precision.configure_backends sets both from --tf32), else fp32."""
    if precision in ("fp16", "bf16"):
        return precision
    if device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32):
        return "tf32"
    return "fp32"


def gpu_peak_tflops(name: str, math_: str) -> float | None:
    """The datasheet's dense peak for `math_` on the GPU named exactly `name`, else None."""
    peaks = PEAK_TFLOPS.get(name)
    return None if peaks is None else peaks[MATHS.index(math_)]


def conv_backward_flop(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                       _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    """Each gradient of a convolution (input, weight) costs what its forward does. torch's own
    formula (torch/utils/flop_counter.py conv_backward_flop, torch 2.14) ignores `groups` in the
    weight gradient and counts a depthwise convolution's weight gradient `groups` times over
    (MobileNet and EfficientNet came out 10x too high); w_shape already holds in_channels/groups."""
    forward = conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return forward * (bool(output_mask[0]) + bool(output_mask[1]))


def train_flops_per_image(model: str, image_size: int, batch: int = 2) -> float:
    """Forward + backward FLOPs of one image (cross-entropy loss, input needs no gradient)."""
    from ..models import build_model

    # no checkpointing, no weights; built for image_size where the family fixes it (ViT)
    spec = types.SimpleNamespace(model=model, channels_last=False, image_size=image_size)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        net = build_model(spec, pretrained=False)
        net.train()
        x = torch.empty(batch, 3, image_size, image_size)
        y = torch.zeros(batch, dtype=torch.long)
        mapping = {torch.ops.aten.convolution_backward: conv_backward_flop}
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            F.cross_entropy(net(x), y).backward()
    return counter.get_total_flops() / batch


GEMM_SIZES = (256, 512, 1024, 2048)


def cpu_gemm_tflops(dtype: torch.dtype = torch.float32, budget_s: float = 0.2,
                    agree: Callable[[bool], bool] = lambda stop: stop) -> float:
    """This process's best matmul rate on CPU, TFLOP/s: n x n torch.mm in `dtype` with
    torch.get_num_threads() threads, each size warmed up once and then timed best-of-3 or more,
    over the sizes of GEMM_SIZES until budget_s is spent (a size whose 4 calls at the best rate yet
    would end past budget_s is not started: every launch pays for the probe, and on 2 cores a 2048
    GEMM's 4 calls took 0.4 s, twice the budget, for a rate below the 1024's), the best size kept (one size is not the
    peak: a 1024 GEMM ran at 0.085 TFLOP/s where a 512 one, in cache, ran at 0.18, on 2 EPYC cores).
    CPUs have no datasheet figure that PyTorch reaches (turbo, AVX clocks, the BLAS), so the peak is
    measured like this; every rank probes at the same time (after a barrier), so ranks sharing cores
    each see their share and the run's peak, their sum, is that of the cores the run uses.
    Convolutions can still beat it (oneDNN's Winograd and direct kernels do fewer multiply-adds
    than the FLOPs counted): Flops.row says so in the notes when MFU comes out above 1."""
    best_rate, start = 0.0, time.perf_counter()
    for n in GEMM_SIZES:
        a = torch.ones(n, n, dtype=dtype)  # no random draw: the run's RNG stream stays as it was
        b = torch.ones(n, n, dtype=dtype)
        torch.mm(a, b)  # first call at this size: BLAS set-up, packing, thread pool start
        best, reps, size_start = math.inf, 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - size_start < budget_s / len(GEMM_SIZES):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best, reps = min(best, time.perf_counter() - t0), reps + 1
        best_rate = max(best_rate, 2 * n ** 3 / best / 1e12)
        # past the budget, or the next size's 4 calls at the best rate yet would end past it (reference
        # bf16 kernels: 3 GFLOP/s, 3 s for a 1024 GEMM's warm-up and 3 repetitions)
        # `agree`: ranks sharing cores stop together (any rank's stop), so that none probes a size alone
        spent = time.perf_counter() - start
        if agree(spent > budget_s or spent + 4 * 16 * n ** 3 / (best_rate * 1e12) > budget_s):
            break
    return best_rate


def _sig(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


REFERENCE_KERNELS = "ran torch's reference kernels"  # the report finds such rows by it


class Flops(Instrument):
    """FLOPs per image, counted once when the instruments are built (before the window opens), the
    peak of this process's devices, and, at row(), the achieved rate at the run's throughput."""

    def __init__(self, model: str, image_size: int, precision: str, devices: list[torch.device],
                 run_device: torch.device, throughput: Callable[[], float]):
        self.run_device, self.throughput = run_device, throughput
        self.reference_kernels = run_device.type == "cpu" and not native_half_kernels(precision)
        self.precision, self.flops_per_img = precision, None
        if global_rank() == 0:  # the row's, which rank 0 writes: the others skip the count (a CPU they may share)
            try:
                self.flops_per_img = train_flops_per_image(model, image_size)
            except Exception as exc:  # a model that cannot be built on the meta device still trains
                print(f"note: FLOPs of {model} not counted on the meta device ({type(exc).__name__}): "
                      f"train_gflop_per_img, achieved_tflops and mfu stay empty", file=sys.stderr, flush=True)
        gpus = list(dict.fromkeys(d for d in devices if d.type == "cuda"))  # MP on one GPU names it twice
        if gpus:
            math_ = run_math(precision, gpus[0])
            peaks = [gpu_peak_tflops(torch.cuda.get_device_name(d), math_) for d in gpus]
            self.peak = None if None in peaks else sum(peaks)
        else:
            barrier()
            self.peak = cpu_gemm_tflops(DTYPES[precision], agree=lambda stop: bool(
                reduce_metrics({"stop": float(stop)}, run_device, "max")["stop"]))

    def row(self) -> dict:
        # a rank whose device is not in the table makes the whole run's peak unknown, not smaller
        total = reduce_metrics({"peak": self.peak or 0.0, "unknown": float(self.peak is None)}, self.run_device, "sum")
        peak = total["peak"] if total["unknown"] == 0 else None
        throughput = self.throughput()
        per_img = self.flops_per_img
        achieved = per_img * throughput / 1e12 if throughput and per_img else None
        mfu = achieved / peak if achieved is not None and peak else None
        row = {"train_gflop_per_img": _sig(per_img and per_img / 1e9), "achieved_tflops": _sig(achieved),
               "peak_tflops": _sig(peak), "mfu": _sig(mfu)}
        notes = []
        if self.reference_kernels:  # the report names such runs (common/report.py _reference_kernels)
            notes.append(f"{self.precision} {REFERENCE_KERNELS}: no native oneDNN {self.precision} kernels here")
        if mfu is not None and mfu > 1:
            notes.append("mfu above 1: the peak is this machine's best measured GEMM rate, which "
                         "convolution kernels doing fewer multiply-adds than the FLOPs counted (Winograd) can beat"
                         if self.run_device.type == "cpu" else "mfu above 1: the FLOP count exceeds the work done")
        if notes:
            row["notes"] = "; ".join(notes)
        return row
