"""What a GPU's datasheet says beyond its peak TFLOP/s (common/measure/flops.py PEAK_TFLOPS, per math): its HBM
bandwidth, its streaming multiprocessors and boost clock, and the host link a batch crosses. The roofline
(roofline.py) reads them; every entry of PEAK_TFLOPS has one here (tests/test_whatif.py holds them together).

Sources, per family (NVIDIA's product datasheets and architecture whitepapers):
  H100 SXM5 / PCIe / NVL   https://www.nvidia.com/en-us/data-center/h100/ (memory bandwidth 3.35 / 2.0 / 3.9 TB/s,
                           PCIe Gen5); SMs and boost clock: NVIDIA H100 Tensor Core GPU Architecture whitepaper
                           (SXM5 132 SMs, 1,980 MHz max boost; PCIe 114 SMs, 1,755 MHz)
  H200 SXM / NVL           https://www.nvidia.com/en-us/data-center/h200/ (4.8 TB/s HBM3e; the H100's GH100 die:
                           132 SMs)
  A100 SXM4 / PCIe         A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf: 80GB SXM 2,039 GB/s,
                           80GB PCIe 1,935 GB/s, 40GB 1,555 GB/s, PCIe Gen4); NVIDIA A100 Tensor Core GPU
                           Architecture whitepaper (108 SMs, 1,410 MHz boost)
  A40, A10, L4, L40S       their datasheets (696, 600, 300, 864 GB/s); SMs and boost clocks from the NVIDIA Ampere
                           GA102 and Ada Lovelace (ada-gpu-architecture.pdf) whitepapers
  RTX 4090                 nvidia-ada-gpu-architecture.pdf (128 SMs, 2,520 MHz, 1,008 GB/s)
  V100 SXM2 / PCIe         volta-v100-datasheet (900 GB/s, PCIe Gen3); Volta whitepaper (80 SMs, 1,530 / 1,380 MHz)
  T4                       t4-tensor-core-datasheet (320 GB/s; 40 SMs, 1,590 MHz)
  Tesla P40                184427-Tesla-P40-Datasheet (346 GB/s GDDR5, PCIe Gen3 x16); Pascal GP102: 30 SMs, 1,531
                           MHz boost (the 12 TFLOP/s fp32 of the datasheet is 30 x 128 lanes x 2 x 1.531 GHz)
PCIe per direction, x16 (PCI-SIG: 8 / 16 / 32 GT/s, 128b/130b): Gen3 15.75, Gen4 31.5, Gen5 63 GB/s.
The NVL parts' boost clocks (1,785 MHz) are the least certain entries: no datasheet states them as the SXM's do.
"""
from __future__ import annotations

PCIE_GBPS = {3: 15.75, 4: 31.5, 5: 63.0}

# name (as torch.cuda.get_device_name gives it): (HBM TB/s, SMs, boost GHz, PCIe generation)
SPECS = {
    "NVIDIA H100 80GB HBM3": (3.35, 132, 1.98, 5),
    "NVIDIA H100 PCIe": (2.0, 114, 1.755, 5),
    "NVIDIA H100 NVL": (3.9, 132, 1.785, 5),
    "NVIDIA H200": (4.8, 132, 1.98, 5),
    "NVIDIA H200 NVL": (4.8, 132, 1.785, 5),
    "NVIDIA A100-SXM4-80GB": (2.039, 108, 1.41, 4),
    "NVIDIA A100-SXM4-40GB": (1.555, 108, 1.41, 4),
    "NVIDIA A100-PCIE-40GB": (1.555, 108, 1.41, 4),
    "NVIDIA A100 80GB PCIe": (1.935, 108, 1.41, 4),
    "NVIDIA A40": (0.696, 84, 1.74, 4),
    "NVIDIA A10": (0.6, 72, 1.695, 4),
    "NVIDIA L4": (0.3, 58, 2.04, 4),
    "NVIDIA L40S": (0.864, 142, 2.52, 4),
    "NVIDIA GeForce RTX 4090": (1.008, 128, 2.52, 4),
    "Tesla V100-SXM2-16GB": (0.9, 80, 1.53, 3),
    "Tesla V100-SXM2-32GB": (0.9, 80, 1.53, 3),
    "Tesla V100-PCIE-16GB": (0.9, 80, 1.38, 3),
    "Tesla V100-PCIE-32GB": (0.9, 80, 1.38, 3),
    "Tesla T4": (0.32, 40, 1.59, 3),
    "Tesla P40": (0.346, 30, 1.531, 3),
}


def hbm_tbps(gpu: str) -> float:
    return SPECS[gpu][0]


def sm_ghz(gpu: str) -> float:
    """SMs x boost GHz: what a compute-bound kernel's rate scales with from one GPU to another (Habitat's wave
    scaling, Yu et al., USENIX ATC 2021, section 3.2), below the datasheet peak of its math."""
    _, sms, ghz, _ = SPECS[gpu]
    return sms * ghz


def sms(gpu: str) -> int:
    return SPECS[gpu][1]


def pcie_gbps(gpu: str) -> float:
    """The host link's rate per direction, GB/s: what a batch copied from the host crosses."""
    return PCIE_GBPS[SPECS[gpu][3]]


def run_math(gpu: str, precision: str, tf32: bool = False) -> str:
    """The math a run's convolutions and matmuls use on `gpu`: fp32 (strict, as the scripts run it by default),
    tf32 (--tf32, where the GPU has it), or the half type; a GPU without fast half math (the P40: sm_61) keeps
    half storage and computes in fp32, as cuDNN does there."""
    from ..measure.flops import gpu_peak_tflops

    if precision in ("fp16", "bf16"):
        peak = gpu_peak_tflops(gpu, precision)
        return precision if peak and peak > (gpu_peak_tflops(gpu, "fp32") or 0) else "fp32"
    if tf32 and (gpu_peak_tflops(gpu, "tf32") or 0) > (gpu_peak_tflops(gpu, "fp32") or 0):
        return "tf32"
    return "fp32"
