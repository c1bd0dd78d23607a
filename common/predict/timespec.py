"""The step model's inputs for hardware the user does not have: GPU compute from the datasheet peak
(common/measure/flops.py PEAK_TFLOPS) times a published efficiency, and named interconnects.

Efficiency = a published ResNet50 training throughput x its FLOPs per image (this project's count,
torch.utils.flop_counter at 224 px) / the datasheet's dense peak of the math it ran in. Source:
NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "Training
performance results" (pytorch-21.03 NGC container, batch 256 per GPU, DALI loader):
  fp32 math     1x V100 16GB FP32             367 img/s  (peak 15.7 TFLOP/s, V100 SXM2 datasheet)
  tf32 math     1x A100 80GB TF32             938 img/s  (peak 156)
  fp16/bf16     1x A100 80GB mixed precision 2470 img/s  (peak 312)
The figure includes the optimizer step, so a predicted step's compute carries it and its optimizer
part is 0. It transfers between GPUs of one math only as far as ResNet-like models are bound the
same way on both (memory-bound layers: BatchNorm, ReLU, are a larger share on a GPU with less
memory bandwidth per FLOP, e.g. the P40: the prediction is then optimistic).

Interconnects: bus bandwidth = 80% of the per-direction link rate (the share nccl-tests' all-reduce
busbw typically reaches; an assumption, stated), latency as given:
  nvlink3  A100 NVLink: 600 GB/s bidirectional per GPU (A100 datasheet) -> 300 per direction
  nvlink4  H100 NVLink: 900 GB/s bidirectional (H100 datasheet) -> 450
  pcie3/4/5  x16: 15.75 / 31.5 / 63 GB/s per direction (PCI-SIG: 8/16/32 GT/s, 128b/130b)
  ib200 / ib400  one HDR / NDR InfiniBand port per GPU: 200 / 400 Gb/s = 25 / 50 GB/s
"""
from __future__ import annotations

import functools

from ..measure.flops import PEAK_TFLOPS, gpu_peak_tflops

# published single-GPU ResNet50 v1.5 training throughput (img/s) and the GPU and math it ran on
PUBLISHED = {"fp32": (367.0, "Tesla V100-SXM2-16GB", "fp32"), "tf32": (938.0, "NVIDIA A100-SXM4-80GB", "tf32"),
             "half": (2470.0, "NVIDIA A100-SXM4-80GB", "fp16")}
BUSBW_SHARE = 0.8
LINKS = {  # name: (GB/s per direction, latency us)
    "nvlink3": (300.0, 10.0), "nvlink4": (450.0, 10.0),
    "pcie3": (15.75, 20.0), "pcie4": (31.5, 20.0), "pcie5": (63.0, 20.0),
    "ib200": (25.0, 30.0), "ib400": (50.0, 30.0),
}
GPU_MEMORY_GIB = {  # nominal memory of each datasheet name (GB as sold; the usable GiB is a little less)
    "NVIDIA H100 80GB HBM3": 80, "NVIDIA H100 PCIe": 80, "NVIDIA H100 NVL": 94, "NVIDIA H200": 141,
    "NVIDIA H200 NVL": 141, "NVIDIA A100-SXM4-80GB": 80, "NVIDIA A100-SXM4-40GB": 40, "NVIDIA A100-PCIE-40GB": 40,
    "NVIDIA A100 80GB PCIe": 80, "NVIDIA A40": 48, "NVIDIA A10": 24, "NVIDIA L4": 24, "NVIDIA L40S": 48,
    "NVIDIA GeForce RTX 4090": 24, "Tesla V100-SXM2-16GB": 16, "Tesla V100-SXM2-32GB": 32,
    "Tesla V100-PCIE-16GB": 16, "Tesla V100-PCIE-32GB": 32, "Tesla T4": 16, "Tesla P40": 24,
}


def gpu_names() -> list[str]:
    return sorted(PEAK_TFLOPS)


@functools.lru_cache(maxsize=4)
def efficiency(kind: str) -> float:
    """Achieved / peak of the published figure of `kind` (fp32, tf32, half)."""
    img_s, gpu, math_ = PUBLISHED[kind]
    return img_s * _flops_per_image("resnet50", 224) / (gpu_peak_tflops(gpu, math_) * 1e12)


@functools.lru_cache(maxsize=32)
def _flops_per_image(model: str, image_size: int) -> float:
    from ..measure.flops import train_flops_per_image

    return train_flops_per_image(model, image_size)


def gpu_compute_ms(gpu: str, precision: str, model: str, image_size: int, batch: int) -> tuple[float, float, str]:
    """(forward ms, backward ms, source) of `batch` images on `gpu`: FLOPs / (peak x efficiency), split
    1:2 as the FLOPs are. fp32 runs in TF32 where the GPU has it (PyTorch's cuDNN default)."""
    if precision in ("fp16", "bf16"):
        math_, kind = precision, "half"
    else:
        tf32 = gpu_peak_tflops(gpu, "tf32")
        math_, kind = ("tf32", "tf32") if tf32 and tf32 > gpu_peak_tflops(gpu, "fp32") else ("fp32", "fp32")
    peak = gpu_peak_tflops(gpu, math_)
    if not peak:
        raise ValueError(f"{gpu} has no {math_} figure in the datasheet table")
    eff = efficiency(kind)
    total = _flops_per_image(model, image_size) * batch / (peak * 1e12 * eff) * 1e3
    source = f"{gpu} {math_} peak {peak:g} TFLOP/s x efficiency {eff:.1%} (published {PUBLISHED[kind][1]})"
    return total / 3, 2 * total / 3, source


def link_for(name: str = "", busbw_gbps: float = 0.0):
    from .timemodel import Link

    if busbw_gbps:
        return Link({"all_reduce": busbw_gbps}, {"all_reduce": 20.0}, f"busbw {busbw_gbps:g} GB/s given")
    rate, lat = LINKS[name]
    return Link({"all_reduce": rate * BUSBW_SHARE}, {"all_reduce": lat},
                f"{name}: {BUSBW_SHARE:.0%} of {rate:g} GB/s, {lat:g} us")
