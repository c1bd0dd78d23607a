"""Where a training step's time goes: torch.profiler over a few steps of the single-device loop.

    python benchmarks/profile_step.py --model resnet50 --image-size 224 --batch-size 256 \\
        --precision bf16 --channels-last --loader gpu                 # the fast AMP configuration
    python benchmarks/profile_step.py --trace results/profile_trace.json   # Chrome/Perfetto trace too

Prints the top operators by self device time (CUDA) or CPU time, and the share of the profiled
wall time the device spent in kernels: what is compute, and what is left (launch gaps, copies,
the Python loop, the input pipeline).
"""
import argparse
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.config import TrainConfig  # noqa: E402
from common.data import build_loaders  # noqa: E402
from common.models import build_model  # noqa: E402
from common.optim import build_optimizer  # noqa: E402
from common.precision import DTYPES, configure_backends  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"))
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--tf32", action="store_true")
    p.add_argument("--loader", default="torch", choices=("torch", "gpu"))
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="profiled steps (after 5 warm-up steps)")
    p.add_argument("--trace", default="", help="write a Chrome trace JSON here")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(model=a.model, pretrained=False, image_size=a.image_size, batch_size=a.batch_size,
                      dataset="synthetic", train_samples=a.batch_size * (a.steps + 8), test_samples=16,
                      workers=a.workers, loader=a.loader, channels_last=a.channels_last, tf32=a.tf32)
    configure_backends(cfg, device)
    train, _ = build_loaders(cfg, 0, 1, device)
    model = build_model(cfg).to(device)
    opt = build_optimizer(cfg, model.parameters())
    dtype = DTYPES[a.precision]
    ctx = nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    it = iter(train)
    with profile(activities=activities, schedule=schedule(wait=0, warmup=5, active=a.steps)) as prof:
        for i in range(5 + a.steps):
            if i == 5:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
            x, y = next(it)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if a.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with ctx:
                loss = F.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            prof.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=key, row_limit=15))
    if device.type == "cuda":
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
        print(f"device busy in kernels: {kernel_us / 1e6:.3f} s of {wall:.3f} s wall "
              f"({100 * kernel_us / 1e6 / wall:.1f}%); {a.batch_size * a.steps / wall:.0f} img/s while profiled")
    else:
        print(f"{a.steps} steps in {wall:.3f} s wall on CPU ({a.batch_size * a.steps / wall:.0f} img/s while profiled)")
    if a.trace:
        prof.export_chrome_trace(a.trace)
        print(f"trace: {a.trace}")


if __name__ == "__main__":
    main()
