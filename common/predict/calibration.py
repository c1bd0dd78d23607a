"""The step model's measured inputs: what `python benchmark.py calibrate` writes and the rows read.

results/calibration.json holds, with the machine's fingerprint (device name, CPU threads):
  compute  per (model, image size, micro-batch, compute mode, optimizer, processes, threads): one
           process's forward, backward and optimizer-step time, ms, from the project's single-device
           script of that mode (its step_compute_ms split 1:2 as the FLOPs are, and its
           step_optimizer_ms: common/bench/calibrate.py). On a CPU `procs` processes measure at once,
           each with the threads a run of
           that many ranks gets (benchmark.py's OMP_NUM_THREADS rule): two ranks on two cores compete
           for the cores and the memory bandwidth as the real run's ranks do; the slowest process
           counts. On a GPU one process measures (each rank has its own device).
           The processes meet before every optimizer step (common/bench/lockstep.py); sync_ms is the least of their
           mean waits there: what the step-to-step variation of n ranks adds to a synchronous step
           beyond the slowest one's mean (calibrate.py _sync_ms; 0 for one process, absent before).
  links    per world size: latency (us) and bus bandwidth (GB/s) of each collective, fitted to
           benchmarks/collectives.py over message sizes (t = latency + S x bus factor / busbw), and the
           measured points [S bytes, ms] the model interpolates (the fit below and beyond them).
  compute entries whose mode reads "fp32@<strategy>" (fp32@fsdp_full-shard, fp32@deepspeed_zero2, ...):
           the distributed script of that strategy run on ONE process at a rank's micro-batch, under its
           own launcher. Its compute and optimizer phases carry the strategy's host work (DDP's bucket
           copies, FSDP2's copy-in/copy-out, DeepSpeed's hooks and flat buffers) with no peer to wait
           for; the links add the communication. A run of that strategy reads this entry first.
           own_comm_ms: the time in the script's own collectives at world size 1 (gloo still copies:
           DeepSpeed ZeRO-3's gradient reduce-scatter), measured as a run's exposed communication and
           kept out of forward, backward and optimizer; only a one-process run of the strategy pays it
           (an older file without it holds it in its compute, and n ranks pay it twice).
  pieces   per (model, image size, micro-batch, compute mode, threads): the forward and backward
           ms of a ResNet's four one-stage pieces (stem+layer1, layer2, layer3, layer4+head: the finest
           pipeline split), timed one after another in one process, at the pipeline's micro-batch and
           the data-parallel ranks'. A pipeline's stage shares come from them, and the
           other strategies' unit shares (when a DDP bucket is ready: timemodel.time_shares); the compute
           entry still gives the whole micro-batch's time, under the ranks' contention. FLOPs misjudge
           them on a CPU, where a small layer4's weights set its pace.
Compute modes: fp32; amp_fp16/amp_bf16 (autocast: DDP, ZeRO, accelerate DDP, FSDP's param_dtype is
close to it); pure_fp16/pure_bf16 (the model in half: pytorch_half_precision.py, DeepSpeed).
"""
from __future__ import annotations

import json
import math
import os

import torch

DEFAULT = "results/calibration.json"


def beside(results_csv: str) -> str:
    """The calibration a run's row is predicted from: calibration.json in its results file's folder (the
    default results/summary.csv reads results/calibration.json, where `benchmark.py calibrate` writes)."""
    return os.path.join(os.path.dirname(results_csv) or ".", "calibration.json")


def compute_mode(strategy: str, precision: str, tf32: bool = False) -> str:
    """The calibration mode a run's compute is priced from. `tf32`: an fp32 run on CUDA with TF32 allowed
    (--tf32), whose matmuls and convolutions run on tensor cores (2-3x an fp32 step on an A100 or H100),
    so it is never priced from an fp32 entry; on a CPU the flag changes no kernel and fp32 serves."""
    if precision not in ("fp16", "bf16"):
        return "tf32" if tf32 else "fp32"
    from ..strategies import of

    st = of(strategy)
    pure = st is not None and st.half_weights
    return ("pure_" if pure else "amp_") + precision


def fingerprint(device: torch.device) -> dict:
    from ..measure.fingerprint import device_name

    return {"device_name": device_name(device), "device_type": device.type}


def key(model: str, image_size: int, batch: int, mode: str, optimizer: str, procs: int, threads: int,
        channels_last: bool = False) -> str:
    return f"{model}|{image_size}|{batch}|{mode}|{optimizer}|p{procs}|t{threads}|cl{int(channels_last)}"


def load(path: str) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "compute" in data else None


def save(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)


def find_compute(data: dict, device_name: str, model: str, image_size: int, batch: int, mode: str,
                 optimizer: str, procs: int, threads: int, channels_last: bool = False) -> tuple[dict | None, str]:
    """The calibration entry of a run, or (None, why). A batch that was not measured is scaled from
    the nearest measured one of the same setup (time linear in the batch; said in the source)."""
    if data is None:
        return None, "no calibration file"
    if data.get("device_name") != device_name:
        return None, f"calibrated on {data.get('device_name')}, not {device_name}"
    compute = data["compute"]
    k = key(model, image_size, batch, mode, optimizer, procs, threads, channels_last)
    if k in compute:
        return compute[k], f"calibrated {k}"
    stem = key(model, image_size, 0, mode, optimizer, procs, threads, channels_last).split("|")
    near = []
    for other, v in compute.items():
        parts = other.split("|")
        if parts[:2] == stem[:2] and parts[3:] == stem[3:]:
            near.append((abs(int(parts[2]) - batch), int(parts[2]), other, v))
    if not near:
        return None, f"nothing calibrated for {k}"
    _, b, other, v = min(near)
    scale = batch / b
    return {**v, "fwd_ms": v["fwd_ms"] * scale, "bwd_ms": v["bwd_ms"] * scale}, f"scaled x{scale:.2f} from {other}"


def compute_of(entry: dict, data_ms: float, source: str):
    """The step model's Compute of a compute entry (sync_ms and own_comm_ms: 0 in a file written before them)."""
    from .timemodel import Compute

    return Compute(entry["fwd_ms"], entry["bwd_ms"], entry["opt_ms"], data_ms, source, entry.get("sync_ms", 0.0),
                   entry.get("own_comm_ms", 0.0))


def find_pieces(data: dict | None, device_name: str, model: str, image_size: int, batch: int, mode: str,
                threads: int, nearest: bool = False) -> list | None:
    """[(fwd_ms, bwd_ms)] of the four pieces at exactly this setup, or None (FLOP shares then). nearest:
    else those of the nearest micro-batch timed at this model, size, mode and threads (shares only: an
    older calibration timed the pieces at the pipeline's micro-batch alone)."""
    if not data or data.get("device_name") != device_name:
        return None
    pieces = data.get("pieces", {})
    got = pieces.get(key(model, image_size, batch, mode, "-", 1, threads))
    if not got and nearest:  # nearest by ratio: 64 is nearer 32 than 8 is
        near = []
        for k, v in pieces.items():
            f = k.split("|")
            if len(f) > 2 and f[2].isdigit() and int(f[2]) > 0 and \
                    k == key(model, image_size, int(f[2]), mode, "-", 1, threads):
                near.append((abs(math.log(int(f[2]) / max(1, batch))), int(f[2]), v))
        got = min(near)[2] if near else None
    return [tuple(v) for v in got] if got else None


def find_link(data: dict | None, world: int):
    """The Link of a world size from the file, or None."""
    from .timemodel import Link

    if data is None:
        return None
    got = data.get("links", {}).get(str(world))
    if not got:
        return None
    return Link(busbw_gbps={k: v["busbw_gbps"] for k, v in got.items()},
                latency_us={k: v["latency_us"] for k, v in got.items()}, source=f"calibrated at {world} ranks",
                points={k: monotone([tuple(p) for p in v["points"]]) for k, v in got.items() if v.get("points")},
                world=world, meet_ms=float(data.get("meets", {}).get(str(world), 0.0)))


def monotone(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The least-squares non-decreasing fit of (S, ms) points in size order (pool adjacent violators): a
    message is never faster than a smaller one, but single cold calls of a few KiB scatter by +-0.5 ms
    (a broadcast at 256 B 1.51 ms, 4 KiB 0.21, 16 KiB 0.92 in one calibration), and DDP+ZeRO's 62
    per-parameter broadcasts, most under 2 KiB, summed that scatter: 29-73 ms over three calibrations
    interpolated point to point, 49-63 pooled, against about 45 measured in its steps."""
    blocks: list[list] = []  # [sum of ms, count, sizes]
    for size, ms in sorted(points):
        blocks.append([ms, 1, [size]])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count, sizes = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
            blocks[-1][2] += sizes
    return [(size, total / count) for total, count, sizes in blocks for size in sizes]


def fit_link(points: list[tuple[str, int, float]], world: int) -> dict:
    """Least squares of t = latency + S x factor / busbw per collective kind, from (kind, S bytes, s), and
    the measured (S, ms) themselves, ascending (Link interpolates them)."""
    from ..measure.comm import bus_factor

    out = {}
    for kind in sorted({k for k, _, _ in points}):
        xs = [s * bus_factor(kind, world) for k, s, _ in points if k == kind]
        ts = [t for k, _, t in points if k == kind]
        mx, mt = sum(xs) / len(xs), sum(ts) / len(ts)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var else 0.0
        lat = max(0.0, mt - slope * mx)
        out[kind] = {"latency_us": round(lat * 1e6, 3), "busbw_gbps": round(1 / slope / 1e9, 4) if slope > 0 else 1e3,
                     "points": sorted((s, round(t * 1e3, 4)) for k, s, t in points if k == kind)}
    return out
