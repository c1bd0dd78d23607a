"""Per-step cost of common/train.py's fit() against a bare ten-line PyTorch loop, same model and batches.

    python benchmarks/loop_overhead.py                         # resnet18 at 32 px, batch 32, CPU or GPU
    python benchmarks/loop_overhead.py --model resnet50 --image-size 224 --batch-size 64 --steps 50

Both loops train the same model (fresh copy from one seed) on the same pre-built batches held in
memory, so only the loop itself differs (progress/finite checks, device-side loss sums, scheduler,
timing). Rounds alternate bare/fit to spread machine noise; the figure is the ratio of medians of
per-step time over rounds (time of `steps` steps, device synchronized, first `warmup` steps excluded).
"""
import argparse
import copy
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.config import TrainConfig  # noqa: E402
from common.distributed import synchronize as sync  # noqa: E402
from common.models import build_model  # noqa: E402
from common.optim import build_optimizer, build_scheduler  # noqa: E402
from common.train import TrainHooks, fit  # noqa: E402


def bare(model, opt, batches, device):
    for x, y in batches:  # the ten-line loop
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = TrainConfig(model=a.model, pretrained=False, image_size=a.image_size, batch_size=a.batch_size, epochs=1,
                      warmup_steps=0, timing_warmup_steps=a.warmup, log_every=50, scheduler="none",
                      loader_probe_batches=0)
    torch.manual_seed(0)
    base = build_model(cfg).to(device)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(a.batch_size, 3, a.image_size, a.image_size, generator=g),
                torch.randint(0, 10, (a.batch_size,), generator=g)) for _ in range(a.warmup + a.steps)]
    bare_t, fit_t = [], []
    for r in range(a.rounds):
        model = copy.deepcopy(base)
        opt = build_optimizer(cfg, model.parameters())
        bare(model, opt, batches[:a.warmup], device)
        t = time.perf_counter()
        bare(model, opt, batches[a.warmup:], device)
        bare_t.append((time.perf_counter() - t) / a.steps)

        model = copy.deepcopy(base)
        opt = build_optimizer(cfg, model.parameters())
        sched = build_scheduler(cfg, opt, len(batches))

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        hooks = TrainHooks(lambda loss: loss.backward(), step, device, ctx=nullcontext(),
                           evaluate=lambda *args, **kw: (float("nan"), 0))
        m = fit(cfg, model, batches, [], hooks)
        fit_t.append(a.batch_size / m.throughput_img_s)  # seconds per step over the same window
        print(f"round {r + 1}: bare {bare_t[-1] * 1000:.1f} ms/step, fit {fit_t[-1] * 1000:.1f} ms/step", flush=True)
    b, f = statistics.median(bare_t), statistics.median(fit_t)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU x{os.cpu_count()}"
    print(f"{a.model} {a.image_size}px batch {a.batch_size} on {name}, torch {torch.__version__}: "
          f"bare {b * 1000:.2f} ms/step, fit {f * 1000:.2f} ms/step, ratio fit/bare = {f / b:.3f}")


if __name__ == "__main__":
    main()
