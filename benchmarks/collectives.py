"""Bus bandwidth of all-reduce, all-gather and reduce-scatter over message sizes on this machine:
the ceiling the strategies' busbw_gbps column is compared with (nccl-tests' method, in torch).

    torchrun --nproc_per_node 4 benchmarks/collectives.py                 # GPUs: nccl
    torchrun --nproc_per_node 2 benchmarks/collectives.py --device cpu    # gloo
    torchrun --nproc_per_node 8 benchmarks/collectives.py --min-bytes 1M --max-bytes 1G --iters 50
    torchrun --nproc_per_node 2 benchmarks/collectives.py --device cpu --overlap-model resnet18 --overlap-image-size 32

Message size S as nccl-tests counts it (doc/PERFORMANCE.md): the all-reduce buffer, the all-gather
output, the reduce-scatter input. Per size: `warmup` untimed calls, then `iters` calls timed
together (device synchronized, barrier before), time = the slowest rank's mean. algbw = S / time;
busbw = algbw x 2(n-1)/n (all-reduce) or (n-1)/n (all-gather, reduce-scatter), which for a ring
is what each link carried, comparable across world sizes.

--overlap-model: also what a collective costs when it runs beside compute (the step model's
overlap_cost, common/measure/timemodel.py). Each rank runs the model's forward and backward on a
batch; steps of compute alone, of an all-reduce alone, and of the two at once (the all-reduce
issued async before the forward, waited after the backward, as DDP's buckets run beside the
backward) are interleaved; cost = (both - compute alone) / all-reduce alone, medians of each step's
slowest rank. 0: the collective is hidden for free (NCCL's kernels beside the compute's); 1: it
takes its own time from the compute (gloo's threads on the cores the ranks compute on); above 1:
worse than running it after the compute (cache and core contention). The message is the model's
fp32 gradients, halved until it takes at most half the compute (hidden, not exposed).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.distributed import synchronize as sync  # noqa: E402
from common.measure.comm import bus_factor  # noqa: E402
from common.precision import steady_host_allocator  # noqa: E402

UNITS = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def size(text: str) -> int:
    return int(float(text[:-1]) * UNITS[text[-1].upper()]) if text[-1].upper() in UNITS else int(text)


def op(kind: str, n: int, elems: int, device: torch.device):
    """A closure issuing one collective of message size elems x 4 bytes (S as nccl-tests counts it)."""
    shard = max(1, elems // n)
    if kind == "all_reduce":
        buf = torch.ones(shard * n, device=device)
        return lambda: dist.all_reduce(buf)
    if kind == "all_gather":
        inp, out = torch.ones(shard, device=device), torch.empty(shard * n, device=device)
        return lambda: dist.all_gather_single(out, inp)
    if kind == "broadcast":
        buf = torch.ones(shard * n, device=device)
        return lambda: dist.broadcast(buf, 0)
    inp, out = torch.ones(shard * n, device=device), torch.empty(shard, device=device)
    return lambda: dist.reduce_scatter_single(out, inp)


def overlap_cost(a, device: torch.device) -> dict:
    """The module docstring's --overlap-model measurement."""
    import statistics
    from types import SimpleNamespace

    import torch.nn.functional as F

    from common.models import build_model

    torch.manual_seed(0)
    cfg = SimpleNamespace(model=a.overlap_model, image_size=a.overlap_image_size, channels_last=False)
    model = build_model(cfg, num_classes=10, pretrained=False).to(device)
    x = torch.randn(a.overlap_batch, 3, a.overlap_image_size, a.overlap_image_size, device=device)
    y = torch.randint(0, 10, (a.overlap_batch,), device=device)
    buf = torch.ones(sum(p.numel() for p in model.parameters()), device=device)

    def compute():
        model.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()

    def alone():
        dist.all_reduce(buf)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    def timed(fn) -> float:
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    def slowest(ts: list[float]) -> float:
        t = torch.tensor(ts, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a synchronous step waits for its slowest rank
        return statistics.median(t.tolist()) * 1e3

    for fn in (compute, compute, alone, both):
        timed(fn)
    c0 = slowest([timed(compute) for _ in range(3)])
    while buf.numel() > (1 << 18) and slowest([timed(alone) for _ in range(3)]) > c0 / 2:
        buf = buf[: buf.numel() // 2].clone()
    got = {compute: [], alone: [], both: []}
    for _ in range(max(1, a.overlap_steps)):
        for fn in got:
            got[fn].append(timed(fn))
    c, b, cb = (slowest(got[fn]) for fn in (compute, alone, both))
    return {"bytes": buf.numel() * 4, "compute_ms": round(c, 3), "alone_ms": round(b, 3), "both_ms": round(cb, 3),
            "cost": round(max(0.0, (cb - c) / b), 3) if b > 0 else 0.0, "model": a.overlap_model,
            "image_size": a.overlap_image_size, "batch": a.overlap_batch}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--min-bytes", default="64K", help="smallest S (K, M, G suffixes: powers of 1024)")
    p.add_argument("--max-bytes", default="64M", help="largest S; sizes double from the smallest")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--kinds", default="all_reduce,all_gather,reduce_scatter,broadcast", help="collectives to time")
    p.add_argument("--json", default="", help="also write the points (kind, S bytes, seconds) here (rank 0)")
    p.add_argument("--overlap-model", default="", help="also measure a collective's cost beside this model's "
                   "forward and backward (a torchvision classifier name)")
    p.add_argument("--overlap-image-size", type=int, default=32)
    p.add_argument("--overlap-batch", type=int, default=16, help="the model's batch per rank")
    p.add_argument("--overlap-steps", type=int, default=10, help="steps of each kind, interleaved")
    a = p.parse_args()
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # as the training runs it stands for (common/precision.py configure_backends)
        steady_host_allocator()
    dist.init_process_group("nccl" if cuda else "gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        print(f"{dist.get_backend()} on {n} ranks ({device.type}); GB/s = 1e9 bytes/s")
        print(f"{'collective':>15} {'S bytes':>12} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    points = []
    for kind in a.kinds.split(","):
        s = size(a.min_bytes)
        while s <= size(a.max_bytes):
            call = op(kind, n, s // 4, device)
            nbytes = (s // 4 // n) * n * 4
            for _ in range(a.warmup):
                call()
            sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                call()
            sync(device)
            elapsed = torch.tensor([(time.perf_counter() - t0) / a.iters], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            t = elapsed.item()
            points.append((kind, nbytes, t))
            if rank == 0:
                algbw = nbytes / t / 1e9
                print(f"{kind:>15} {nbytes:>12} {t * 1e6:>10.1f} {algbw:>11.3f} {algbw * bus_factor(kind, n):>11.3f}",
                      flush=True)
            s *= 2
    overlap = overlap_cost(a, device) if a.overlap_model else None
    if overlap and rank == 0:
        print("overlap: " + ", ".join(f"{k} {v}" for k, v in overlap.items()), flush=True)
    if a.json and rank == 0:
        with open(a.json, "w") as fh:
            json.dump({"world_size": n, "backend": dist.get_backend(), "points": points,
                       **({"overlap": overlap} if overlap else {})}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
