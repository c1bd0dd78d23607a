"""CPU twin for DeepSpeed in fp16 (pytorch_DeepSpeed.py, accelerate_DeepSpeed.py): the unchanged
script with DeepSpeed's CPU accelerator told that fp16 is supported.

DeepSpeed's CPU accelerator claims fp16 only where oneDNN has fp16 kernels (cpu_accelerator.py
is_fp16_supported: torch.ops.mkldnn._is_mkldnn_fp16_supported(), AVX512-FP16/AMX-FP16), and the
scripts refuse fp16 elsewhere; torch's own fp16 CPU kernels still run, slowly, so with the claim
forced the engine's fp16 path (FP16 optimizer, dynamic loss scaler, skipped steps, fp32 weights
gathered at the end) runs on any CPU:

    torchrun --nproc_per_node 2 tests/twins/deepspeed_fp16_on_cpu.py pytorch_DeepSpeed.py --precision fp16 ...
"""
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.chdir(ROOT)

from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator  # noqa: E402

CPU_Accelerator.is_fp16_supported = lambda self: True
if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    sys.argv[0] = os.path.join(ROOT, sys.argv[0])
    runpy.run_path(sys.argv[0], run_name="__main__")
