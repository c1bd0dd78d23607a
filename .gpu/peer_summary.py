"""The peer beside ours, from a lease's files (.gpu/peer.sh): python .gpu/peer_summary.py PEER_LOG_DIR ROWS_CSV

The peer (NVIDIA's ResNet50 v1.5 trainer, benchmark_training_short) logs every iteration's rate: train.total_ips
is 256 images over the iteration's wall time, from the end of the previous one (the batch's fetch included) to
the end of its train_step, whose torch.cuda.synchronize() closes it (image_classification/training.py,
train()). An optimizer step comes every 8th iteration, so its
figure here is the mean iteration over whole cycles after a warm-up of 2 (iterations 17-96 of 100), not its
run summary, which averages the rates of all its iterations, the first ones included. Ours is the timed
window of each launch (step = 8 micro-batches of 256): throughput_img_s, and the same without the GPU loader's
time (step_data_ms), since the peer's synthetic batch is one tensor made once. The ratio is of the medians
over launches, with their range."""
from __future__ import annotations

import csv
import glob
import json
import os
import statistics
import sys

BATCH, CYCLE, FIRST, LAST = 256, 8, 17, 96


def peer_launch(path: str) -> dict | None:
    """One launch's dllogger JSON: the mean iteration (ms) and compute part over iterations FIRST..LAST."""
    its, comp = {}, {}
    with open(path) as fh:
        for line in fh:
            if not line.startswith("DLLL "):
                continue
            rec = json.loads(line[5:])
            step, data = rec.get("step"), rec.get("data", {})
            if isinstance(step, list) and len(step) == 2 and "train.total_ips" in data:
                its[step[1]] = BATCH / data["train.total_ips"] * 1e3
                comp[step[1]] = data.get("train.compute_time", float("nan")) * 1e3
    window = [i for i in range(FIRST, LAST + 1) if i in its]
    if len(window) < LAST - FIRST + 1:
        return None
    ms = statistics.fmean(its[i] for i in window)
    return {"iteration_ms": ms, "compute_ms": statistics.fmean(comp[i] for i in window), "img_s": BATCH / ms * 1e3}


def ours(rows_csv: str) -> list[dict]:
    out = []
    with open(rows_csv) as fh:
        for r in csv.DictReader(fh):
            if not r.get("run_name", "").startswith("lease/peer_ours") or r.get("status") != "ok":
                continue
            step, data, batch = float(r["step_ms_mean"]), float(r["step_data_ms"]), float(r["global_batch_size"])
            out.append({"run": r["run_name"], "img_s": float(r["throughput_img_s"]),
                        "img_s_without_data": batch / (step - data) * 1e3, "iteration_ms": step / CYCLE,
                        "data_ms": data / CYCLE})
    return out


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f}, {len(xs)} launches)"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python .gpu/peer_summary.py PEER_LOG_DIR ROWS_CSV", file=sys.stderr)
        return 2
    peer = [p for p in (peer_launch(f) for f in sorted(glob.glob(os.path.join(argv[0], "dle_amp_*.json")))) if p]
    mine = ours(argv[1])
    if not peer or not mine:
        print(f"peer_summary: {len(peer)} complete peer launches, {len(mine)} of ours: nothing to set side by side")
        return 1
    p_ips = [p["img_s"] for p in peer]
    print("| trainer | img/s, median (range) | iteration ms (256 images) |\n|---|---|---|")
    print(f"| NVIDIA ResNet50 v1.5, iterations {FIRST}-{LAST} | {_spread(p_ips)} | "
          f"{statistics.median(p['iteration_ms'] for p in peer):.2f} |")
    print(f"| ours, timed window | {_spread([m['img_s'] for m in mine])} | "
          f"{statistics.median(m['iteration_ms'] for m in mine):.2f} |")
    print(f"| ours, without the GPU loader's time | {_spread([m['img_s_without_data'] for m in mine])} | "
          f"{statistics.median(m['iteration_ms'] - m['data_ms'] for m in mine):.2f} |")
    ratio = statistics.median(m["img_s"] for m in mine) / statistics.median(p_ips)
    bare = statistics.median(m["img_s_without_data"] for m in mine) / statistics.median(p_ips)
    print(f"\nours/peer: {ratio:.3f} (without our loader's time: {bare:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
