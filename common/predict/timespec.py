"""The step model's inputs for hardware the user does not have: a GPU by its datasheet name and a named
interconnect (`benchmark.py advise --gpu ... --interconnect ...`).

  compute      roofline.py: per op, the slower of its FLOPs at the rate of its math and its bytes at the HBM
               rate; rates measured on the project's H100 rows and carried by SMs x clock, at most the peak
  optimizer    its bytes (parameters, gradients, state read and written) at the HBM rate, or the host's time
               to issue it where that is longer (OPT_HOST_MS, DS_PER_TENSOR_MS)
  data         the batch's copy from the host over the GPU's PCIe link (the scripts copy on the step's stream),
               or the GPU loader's transforms
  skew         ranks wait at the step's collective for the slowest: E[max of n] - mean of a step that varies by
               STEP_CV
  collectives  links.py: nccl-tests' bus bandwidth and latency per interconnect, the SMs they take
"""
from __future__ import annotations

import functools
import math

from ..measure.flops import PEAK_TFLOPS
from ..strategies import of
from . import roofline
from .datasheet import hbm_tbps, pcie_gbps, sm_ghz
from .links import LINKS, NCCL  # noqa: F401  (re-exported: advise lists them)

# The project's own H100 (results/campaigns/2026-11-27_h100_throughput_b/summary.csv, one process, fp32,
# ResNet50/224, batch 128, not rows of the check table): accelerate_DDP's optimizer phase, the foreach SGD's
# kernels (the campaigns predate the fused ones), zero_grad and the LR scheduler, 0.478 ms where its bytes take
# 0.17; DeepSpeed ZeRO-2's, 10.0 ms for ResNet50's 161 parameter tensors (its step walks them on the host:
# flattening, norms, copies back).
OPT_HOST_MS = 0.478
DS_PER_TENSOR_MS = 10.002 / 161
# A for-loop optimizer (torch.optim without foreach, before torch 2.0): SGD's step over ResNet101's 314
# tensors took 6.28 ms (github.com/pytorch/pytorch pull 45299, "Perf results", timeit)
LOOP_PER_TENSOR_MS = 6.28 / 314
# The batch's copy to the device, measured on the H100 (pytorch_DDP at one process, 2026-11-26_h100_throughput
# summary.csv): 128 x 3 x 224 x 224 fp32 images, 77.07 MB, in 1.447 ms: 53.3 GB/s of PCIe Gen5's 63, 0.846.
# The GPU loader (--loader gpu) took 2.7 ms for 256 images (amp_bf16_fast, the same campaign): its
# transforms' kernels, carried by SMs x clock.
COPY_SHARE = 77.07e6 / 1.447e-3 / 63e9
GPU_LOADER_MS_PER_IMAGE = 2.7 / 256
# A step's spread: the same DDP row's p50 138.937 ms and p90 139.076 ms give sigma = (p90 - p50) / 1.2816 =
# 0.108 ms, 0.078% of the step
STEP_CV = (139.076 - 138.937) / 1.2816 / 138.937
GPU_MEMORY_GIB = {  # nominal memory of each datasheet name (GB as sold; the usable GiB is a little less)
    "NVIDIA H100 80GB HBM3": 80, "NVIDIA H100 PCIe": 80, "NVIDIA H100 NVL": 94, "NVIDIA H200": 141,
    "NVIDIA H200 NVL": 141, "NVIDIA A100-SXM4-80GB": 80, "NVIDIA A100-SXM4-40GB": 40, "NVIDIA A100-PCIE-40GB": 40,
    "NVIDIA A100 80GB PCIe": 80, "NVIDIA A40": 48, "NVIDIA A10": 24, "NVIDIA L4": 24, "NVIDIA L40S": 48,
    "NVIDIA GeForce RTX 4090": 24, "Tesla V100-SXM2-16GB": 16, "Tesla V100-SXM2-32GB": 32,
    "Tesla V100-PCIE-16GB": 16, "Tesla V100-PCIE-32GB": 32, "Tesla T4": 16, "Tesla P40": 24,
}


def gpu_names() -> list[str]:
    return sorted(PEAK_TFLOPS)


def run_spec(gpu: str, setup, tf32: bool = False) -> roofline.Spec:
    """The precision as a strategy runs it: autocast (AMP, DDP, ZeRO, accelerate), the model in half
    (pytorch_half_precision.py, DeepSpeed's fp16/bf16), FSDP's mixed precision (half weights gathered, no casts)."""
    half, info = setup.precision in ("fp16", "bf16"), of(setup.strategy)
    pure = half and info.half_weights
    s = roofline.spec(gpu, setup.precision, tf32, pure, setup.channels_last)
    if half and info.family == "fsdp":
        s = roofline.Spec(s.math, 2, 2, False, s.channels_last)
    return s


def optimizer_ms(gpu: str, setup, loop: bool = False) -> float:
    """One optimizer step over all the parameters: its bytes at the HBM rate (SGD with momentum: parameter,
    gradient and buffer read, parameter and buffer written; AdamW two moments), or the host's time to issue
    it: DeepSpeed's per-tensor walk, a for-loop optimizer's (`loop`), else the fused step's."""
    from ..models import model_facts

    shapes = model_facts(setup.model, setup.image_size)[0]
    numel = sum(math.prod(s) for s in shapes)
    passes = 7 if setup.optimizer == "adamw" else 5
    if setup.precision == "fp16" and of(setup.strategy).family != "half":
        passes += 2  # GradScaler's unscale reads and writes every gradient
    nbytes = numel * 4 * passes / (hbm_tbps(gpu) * 1e12 * roofline.HBM_SHARE) * 1e3
    if of(setup.strategy).deepspeed:
        host = DS_PER_TENSOR_MS * len(shapes)
    else:
        host = LOOP_PER_TENSOR_MS * len(shapes) if loop else OPT_HOST_MS
    return max(host, nbytes)


def input_bytes(images: int, image_size: int) -> float:
    return images * 3 * image_size * image_size * 4.0


def data_ms(gpu: str, images: int, image_size: int, loader: str = "torch") -> float:
    """The batch's arrival on the device: torch (CPU workers): its fp32 copy over the GPU's PCIe link, on the
    step's stream; gpu: the GPU loader's transforms; prefetch: a copy on a side stream, hidden."""
    if loader == "prefetch":
        return 0.0
    if loader == "gpu":
        return GPU_LOADER_MS_PER_IMAGE * images * sm_ghz(roofline.H100) / sm_ghz(gpu)
    return input_bytes(images, image_size) / (pcie_gbps(gpu) * 1e9 * COPY_SHARE) * 1e3


@functools.lru_cache(maxsize=64)
def expected_max(n: int) -> float:
    """E[max of n standard normals] (0 for one): how far the slowest of n ranks' steps lies above the mean."""
    from statistics import NormalDist

    if n <= 1:
        return 0.0
    d, lo, steps = NormalDist(), -8.0, 4000
    h = 16.0 / steps
    xs = [lo + i * h for i in range(steps + 1)]
    return sum(x * n * d.pdf(x) * d.cdf(x) ** (n - 1) for x in xs) * h


def gpu_compute(gpu: str, setup, tf32: bool = False, loader: str = "torch", loop_optimizer: bool = False):
    """The Compute of one rank of `setup` on `gpu` (timemodel.Compute), from the datasheet alone."""
    from .timemodel import Compute

    s = run_spec(gpu, setup, tf32)
    micro = setup.micro_batch
    fwd, bwd = roofline.compute_ms(setup.model, setup.image_size, gpu, s, micro)
    info = of(setup.strategy)
    n = setup.world_size if info.data_parallel else 1
    dp = info.family == "dp" and n > 1
    images = setup.batch_size if dp else micro
    data = data_ms(gpu, images, setup.image_size, loader)
    sync = STEP_CV * expected_max(n) * (fwd + bwd) if n > 1 and not dp else 0.0
    launch = roofline.launches(setup.model, setup.image_size, s, False) * roofline.host_us() / 1e3 if dp else 0.0
    source = (f"{gpu}: roofline, {s.math} at {roofline.rate(gpu, s) / 1e12:.1f} TFLOP/s (the H100's measured "
              f"{roofline.rate_class(s)} rate x SMs x clock), HBM {hbm_tbps(gpu):g} TB/s x {roofline.HBM_SHARE:g}")
    return Compute(fwd, bwd, optimizer_ms(gpu, setup, loop_optimizer), data, source, sync_ms=sync,
                   launch_fwd_ms=launch, scatter_bytes=input_bytes(setup.batch_size, setup.image_size) if dp else 0.0)


def gpu_compute_ms(gpu: str, precision: str, model: str, image_size: int, batch: int,
                   tf32: bool = False, channels_last: bool = False) -> tuple[float, float, str]:
    """(forward ms, backward ms, source) of `batch` images under autocast (fp16/bf16) or fp32 (strict unless
    tf32) on `gpu`."""
    s = roofline.spec(gpu, precision, tf32, False, channels_last)
    fwd, bwd = roofline.compute_ms(model, image_size, gpu, s, batch)
    return fwd, bwd, f"{gpu}: roofline, {s.math}"


def eval_ms(gpu: str, setup, tf32: bool = False, loader: str = "torch", link=None) -> float:
    """One evaluation step of a rank (no_grad forward at its micro-batch, and its batch's arrival); DataParallel
    also replicates the weights (a broadcast from GPU 0) and scatters the batch, every step."""
    from ..models import model_facts

    s = run_spec(gpu, setup, tf32)
    fwd, _ = roofline.compute_ms(setup.model, setup.image_size, gpu, s, setup.micro_batch, train=False)
    n = setup.world_size
    if setup.strategy != "dp" or n <= 1:
        return fwd + data_ms(gpu, setup.micro_batch, setup.image_size, loader)
    out = fwd + data_ms(gpu, setup.batch_size, setup.image_size, loader)
    if link is not None:
        numel = sum(math.prod(x) for x in model_facts(setup.model, setup.image_size)[0])
        out += link.ms("broadcast", numel * 4, 2) + link.ms("send", input_bytes(setup.batch_size, setup.image_size)
                                                               * (n - 1) / n, 2)
    return out


def transfer(c, setup, from_gpu: str, to_gpu: str, tf32: bool = False, loader: str = "torch"):
    """A Compute calibrated on one GPU carried to another (Habitat's way): its forward and backward times the
    roofline's ratio between the two GPUs for this setup, its optimizer the optimizer model's ratio, and the
    target's own batch arrival."""
    from dataclasses import replace

    a = roofline.compute_ms(setup.model, setup.image_size, from_gpu, run_spec(from_gpu, setup, tf32),
                            setup.micro_batch)
    b = roofline.compute_ms(setup.model, setup.image_size, to_gpu, run_spec(to_gpu, setup, tf32), setup.micro_batch)
    opt = optimizer_ms(to_gpu, setup) / optimizer_ms(from_gpu, setup)
    return replace(c, fwd_ms=c.fwd_ms * b[0] / a[0], bwd_ms=c.bwd_ms * b[1] / a[1], opt_ms=c.opt_ms * opt,
                   data_ms=data_ms(to_gpu, setup.micro_batch, setup.image_size, loader),
                   source=f"{c.source}, carried to {to_gpu} by the roofline's ratio")


def link_for(name: str = "", busbw_gbps: float = 0.0, gpu: str = "", gpus_per_node: int = 0, inter: str = ""):
    """The Link of a named interconnect (links.py; with nodes of gpus_per_node joined by `inter`), or of a bus
    bandwidth the user gives (20 µs a call)."""
    from .datasheet import sms
    from .links import link
    from .timemodel import Link

    if busbw_gbps:
        return Link({"all_reduce": busbw_gbps}, {"all_reduce": 20.0}, f"busbw {busbw_gbps:g} GB/s given")
    return link(name, gpus_per_node, inter, sms(gpu) if gpu else 0)


def epoch_s(step_ms: float, eval_step_ms: float, setup, dataset_images: int, eval_images: int,
            loader_img_s: float = 0.0, drop_last: bool = False) -> tuple[float, float]:
    """(training s, evaluation s) of one epoch as the articles timed it: every optimizer step of the training
    set (the last one partial, priced as a whole step, unless the loader drops it: `drop_last`), held to the
    loader's rate where one is given (its workers build the next batches while the step runs), then one
    evaluation pass over the test set, each rank its share at its micro-batch."""
    steps = (dataset_images // setup.batch_size) if drop_last else math.ceil(dataset_images / setup.batch_size)
    if loader_img_s:
        step_ms = max(step_ms, setup.batch_size / loader_img_s * 1e3)
    info = of(setup.strategy)
    ranks = setup.dp if info.data_parallel and info.family != "dp" else 1
    per_step = setup.batch_size if info.family == "dp" else setup.micro_batch * setup.grad_accum
    evals = math.ceil(eval_images / ranks / per_step) if eval_images else 0
    return steps * step_ms / 1e3, evals * eval_step_ms / 1e3
