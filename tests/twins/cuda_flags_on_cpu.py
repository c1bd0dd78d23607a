"""CPU twin for the flags that need CUDA: the unchanged script with `require_cuda` lifted and, for
--sync-bn, the five kernels SyncBatchNorm calls registered for CPU tensors.

    torchrun --nproc_per_node 3 tests/twins/cuda_flags_on_cpu.py pytorch_DDP.py --sync-bn --device cpu ...
    torchrun --nproc_per_node 3 tests/twins/cuda_flags_on_cpu.py pytorch_FSDP.py --cpu-offload ...
    torchrun --nproc_per_node 3 tests/twins/cuda_flags_on_cpu.py pytorch_DeepSpeed.py --offload ...

- --sync-bn: SyncBatchNorm's autograd function (torch/nn/modules/_functions.py) all-gathers each rank's
  mean, inverse std and count, and all-reduces the two backward sums; its kernels (batch_norm_stats,
  batch_norm_gather_stats_with_counts, batch_norm_elemt, batch_norm_backward_reduce,
  batch_norm_backward_elemt) exist for CUDA only (native_functions.yaml), and SyncBatchNorm.forward
  refuses a CPU input before it calls them (torch/nn/modules/batchnorm.py), as DDP refuses the layer in a
  CPU module (torch/nn/parallel/distributed.py): the twin lifts both checks. The kernels below follow
  aten/src/ATen/native/cuda/Normalization.cuh: invstd is 1/sqrt(biased variance + eps), the global
  variance merges the ranks' (mean, variance, count), and the running variance takes the unbiased one.
- --cpu-offload: FSDP2's CPUOffloadPolicy pins host memory by default, which needs an accelerator;
  the twin takes pin_memory=False (fully_shard then copies the shards to the device with blocking
  copies: torch/distributed/fsdp/_fully_shard/_fsdp_param.py).
- --offload: DeepSpeed's CPU accelerator pins nothing (cpu_accelerator.py pin_memory returns the
  tensor), so the script's JSON runs as it is.
"""
import functools
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.chdir(ROOT)

import torch  # noqa: E402
import torch.distributed.fsdp as fsdp  # noqa: E402

import common.distributed  # noqa: E402


def _dims(x):
    return [d for d in range(x.dim()) if d != 1]


def _per_channel(v, x):
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def batch_norm_stats(x, eps):
    var, mean = torch.var_mean(x, dim=_dims(x), correction=0)
    return mean, torch.rsqrt(var + eps)


def batch_norm_gather_stats_with_counts(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    counts = counts.to(mean_all.dtype).view(-1, 1)
    n = counts.sum()
    mean = (counts * mean_all).sum(0) / n
    var_all = invstd_all.pow(-2) - eps  # each rank's biased variance
    m2 = (counts * (var_all + (mean_all - mean).pow(2))).sum(0)
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    if running_var is not None:
        running_var.mul_(1 - momentum).add_((m2 / (n - 1)).to(running_var.dtype), alpha=momentum)
    return mean, torch.rsqrt(m2 / n + eps)


def batch_norm_elemt(x, weight, bias, mean, invstd, eps):
    y = (x - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        y = y * _per_channel(weight, x)
    return y + _per_channel(bias, x) if bias is not None else y


def batch_norm_backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    sum_dy = dy.sum(_dims(x))
    sum_dy_xmu = (dy * (x - _per_channel(mean, x))).sum(_dims(x))
    grad_weight = sum_dy_xmu * invstd if weight_g else torch.empty(0)
    return sum_dy, sum_dy_xmu, grad_weight, sum_dy.clone() if bias_g else torch.empty(0)


def batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    n = count.sum().to(x.dtype)
    xmu = x - _per_channel(mean, x)
    scale = invstd if weight is None else invstd * weight
    return (dy - _per_channel(sum_dy / n, x) - xmu * _per_channel(invstd.pow(2) * sum_dy_xmu / n, x)) \
        * _per_channel(scale, x)


KERNELS = (batch_norm_stats, batch_norm_gather_stats_with_counts, batch_norm_elemt, batch_norm_backward_reduce,
           batch_norm_backward_elemt)
_LIB = torch.library.Library("aten", "IMPL")  # kept: the registrations live as long as the library object
for kernel in KERNELS:
    _LIB.impl(kernel.__name__, kernel, "CPU")

_forward = torch.nn.SyncBatchNorm.forward


def forward(self, x):
    """SyncBatchNorm.forward with CPU among the devices it accepts (it reads the PrivateUse1 backend's name
    at every call, in training with a process group, before it runs the kernels above)."""
    name = torch._C._get_privateuse1_backend_name
    torch._C._get_privateuse1_backend_name = lambda: "cpu"
    try:
        return _forward(self, x)
    finally:
        torch._C._get_privateuse1_backend_name = name


torch.nn.SyncBatchNorm.forward = forward
# DDP refuses SyncBatchNorm in a CPU module at wrap time (torch/nn/parallel/distributed.py
# _passing_sync_batchnorm_handle); it only checks the device
torch.nn.parallel.DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None
common.distributed.require_cuda = lambda device, what: None
fsdp.CPUOffloadPolicy = functools.partial(fsdp.CPUOffloadPolicy, pin_memory=False)
if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    sys.argv[0] = os.path.join(ROOT, sys.argv[0])
    runpy.run_path(sys.argv[0], run_name="__main__")
