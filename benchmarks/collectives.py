"""Bus bandwidth of all-reduce, all-gather, reduce-scatter, broadcast and a point-to-point send over message
sizes on this machine: the ceiling the strategies' busbw_gbps column is compared with (nccl-tests' method, in
torch); the send is what a pipeline's stages pass each other (rank 0 to rank 1, the others idle).

    torchrun --nproc_per_node 4 benchmarks/collectives.py                 # GPUs: nccl
    torchrun --nproc_per_node 2 benchmarks/collectives.py --device cpu    # gloo
    torchrun --nproc_per_node 8 benchmarks/collectives.py --min-bytes 1M --max-bytes 1G --iters 50

Message size S as nccl-tests counts it (doc/PERFORMANCE.md): the all-reduce buffer, the all-gather
output, the reduce-scatter input. Per size: `warmup` untimed calls, then `iters` calls timed
together (device synchronized, barrier before), time = the slowest rank's mean; with --cold each
call alone, after the caches are evicted (what benchmark.py calibrate uses on a CPU). algbw = S / time;
busbw = algbw x 2(n-1)/n (all-reduce) or (n-1)/n (all-gather, reduce-scatter), which for a ring
is what each link carried, comparable across world sizes.
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
    if kind == "send":  # a pipeline's activation or gradient to the next stage
        buf, rank = torch.ones(elems, device=device), dist.get_rank()
        return lambda: dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0) if rank == 1 else None
    inp, out = torch.ones(shard * n, device=device), torch.empty(shard, device=device)
    return lambda: dist.reduce_scatter_single(out, inp)


def _flush_bytes(cuda: bool) -> int:
    """Twice the last-level cache, at least 64 MiB: a CPU's as Linux reports it (sysfs cache index3); a
    GPU's L2 is 50 MiB (H100) to 126 MiB (B200)."""
    if cuda:
        return 256 * 1024 ** 2
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as fh:
            text = fh.read().strip()
        llc = int(text[:-1]) * UNITS[text[-1].upper()] if text[-1].upper() in UNITS else int(text)
    except (OSError, ValueError, IndexError):
        llc = 0
    return max(64 * 1024 ** 2, 2 * llc)


def _meet(n: int, nbytes: int, device: torch.device, flush, iters: int) -> float:
    """Seconds a collective costs a step beyond its time after a barrier, when the ranks come to it from work
    of their own (a step's collectives follow a unit's forward or backward, not a barrier): they arrive
    apart, the early one waits, the backend's thread wakes from idle on cores the work kept busy. Each
    rank does the same work (evicts the caches, then 32 matrix products of 256 x 256), then times an
    all-reduce of `nbytes`; the same again with a barrier between the work and the call. The step pays
    the least rank's mean (the rank that arrived last waited least: its time is what the step adds
    beyond the slower rank's work), less the slowest rank's aligned mean (the collective's own time, as
    the points above take it). Alternated, so drifts fall on both."""
    call = op("all_reduce", n, nbytes // 4, device)
    flush = flush if flush is not None else torch.empty(_flush_bytes(device.type == "cuda"), dtype=torch.uint8,
                                                        device=device)
    a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)
    spent = {"meet": 0.0, "aligned": 0.0}
    for _ in range(max(iters, 30)):
        for mode in spent:
            flush.add_(1)
            for _ in range(32):
                torch.mm(a, b)
            sync(device)
            if mode == "aligned":
                dist.barrier()
            t0 = time.perf_counter()
            call()
            sync(device)
            spent[mode] += time.perf_counter() - t0
    got = torch.tensor([spent["meet"], -spent["aligned"]], dtype=torch.float64, device=device) / max(iters, 30)
    dist.all_reduce(got, op=dist.ReduceOp.MIN)  # the least meet; the largest aligned (negated)
    return max(0.0, got[0].item() + got[1].item())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--min-bytes", default="64K", help="smallest S (K, M, G suffixes: powers of 1024)")
    p.add_argument("--max-bytes", default="64M", help="largest S; sizes double from the smallest")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--kinds", default="all_reduce,all_gather,reduce_scatter,broadcast,send", help="collectives to time")
    p.add_argument("--cold", action="store_true", help="evict the caches before every call and time each call "
                   "alone (barrier first), as a training step's collective meets its buffers: on a CPU a warm loop "
                   "keeps messages up to the L3's size in cache, which a step's activations have evicted")
    p.add_argument("--meet", action="store_true", help="also time what ranks pay to meet: a 16 KiB all-reduce "
                   "issued straight after each rank's own work, no barrier, against the same call after a "
                   "barrier (JSON: meet_ms)")
    p.add_argument("--json", default="", help="also write the points (kind, S bytes, seconds) here (rank 0)")
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
    flush = torch.empty(_flush_bytes(cuda), dtype=torch.uint8, device=device) if a.cold else None
    for kind in a.kinds.split(","):
        s = size(a.min_bytes)
        while s <= size(a.max_bytes):
            call = op(kind, n, s // 4, device)
            nbytes = (s // 4) * 4 if kind == "send" else (s // 4 // n) * n * 4
            for _ in range(a.warmup):
                call()
            sync(device)
            dist.barrier()
            if a.cold:
                spent = 0.0
                for _ in range(a.iters):
                    flush.add_(1)
                    sync(device)
                    dist.barrier()
                    t0 = time.perf_counter()
                    call()
                    sync(device)
                    spent += time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    call()
                sync(device)
                spent = time.perf_counter() - t0
            elapsed = torch.tensor([spent / a.iters], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            t = elapsed.item()
            points.append((kind, nbytes, t))
            if rank == 0:
                algbw = nbytes / t / 1e9
                print(f"{kind:>15} {nbytes:>12} {t * 1e6:>10.1f} {algbw:>11.3f} {algbw * bus_factor(kind, n):>11.3f}",
                      flush=True)
            s *= 2
    meet = _meet(n, 16 * 1024, device, flush, a.iters) if a.meet else None
    if meet is not None and rank == 0:
        print(f"meeting: {meet * 1e3:.3f} ms per collective over one after a barrier", flush=True)
    if a.json and rank == 0:
        with open(a.json, "w") as fh:
            json.dump({"world_size": n, "backend": dist.get_backend(), "points": points,
                       **({"meet_ms": meet * 1e3} if meet is not None else {})}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
