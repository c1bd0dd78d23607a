"""Images/s of the input pipeline alone (no model): --loader torch (DataLoader, CPU transforms) vs gpu.

    python benchmarks/loader_throughput.py --image-size 224 --batch-size 128 --workers 8
    python benchmarks/loader_throughput.py --dataset cifar10 --loader gpu

The training loop needs the loader to deliver well above the model's throughput (issue: >= 3x).
Each batch is moved to the training device and the device synchronized before the clock is read;
the first --warmup batches (worker start-up, cudnn/allocator warm-up) are not timed.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.config import TrainConfig  # noqa: E402
from common.data import build_loaders  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="synthetic", choices=("synthetic", "cifar10"))
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--loader", default="both", choices=("torch", "gpu", "both"))
    p.add_argument("--train-samples", type=int, default=0)
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for loader in (("torch", "gpu") if a.loader == "both" else (a.loader,)):
        cfg = TrainConfig(dataset=a.dataset, image_size=a.image_size, batch_size=a.batch_size, workers=a.workers,
                          loader=loader, train_samples=a.train_samples or (a.batches + a.warmup) * a.batch_size,
                          test_samples=100)
        train, _ = build_loaders(cfg, 0, 1, device)
        it = iter(train)
        for _ in range(a.warmup):
            next(it)[0].to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t, n = time.perf_counter(), 0
        for _ in range(a.batches):
            x, _y = next(it)
            x = x.to(device, non_blocking=True)
            n += x.shape[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        rate = n / (time.perf_counter() - t)
        name = torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU x{os.cpu_count()}"
        print(f"loader={loader} {a.dataset} {a.image_size}px batch {a.batch_size} workers {a.workers} on {name}: "
              f"{rate:.0f} img/s")


if __name__ == "__main__":
    main()
