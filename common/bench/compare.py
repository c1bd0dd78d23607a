"""benchmark.py compare BASE.csv NEW.csv: the regression gate between two result files.

Per run present in both (same run name, same device), the ratio of median throughputs new/base
with a bootstrap 95% confidence interval (both files' launches resampled), and a verdict: faster or
slower when the whole interval lies above or below 1, else the same within noise. Exit 1 when some
run is slower beyond noise by more than the threshold (the interval's upper end below 1 - threshold),
else 0; bad input exits 2 with one line. With one launch per side there is no noise to measure and
the interval is the single ratio: run both sides with benchmark.py --repeats N.
"""
from __future__ import annotations

import csv
import os

from ..config import UsageError
from ..predict.stats import median, ratio_ci, verdict


def samples(path: str) -> dict[tuple[str, str], list[float]]:
    """{(run label, device name): throughputs of its ok launches} of one results file."""
    from ..report import launches, load

    if not os.path.isfile(path):
        raise UsageError(f"results file not found: {path}")
    try:
        df = load(path)
    except (csv.Error, ValueError) as exc:
        raise UsageError(f"results file {path} cannot be read as a results CSV ({exc})") from None
    out = {}
    for (label, device), runs in launches(df).groupby(["label", "device_name"], sort=False):
        speeds = [x for x in runs.throughput_img_s if x > 0]  # NaN (no figure) fails the test too
        if speeds:
            out[label, device] = speeds
    return out


def compare(base_path: str, new_path: str, threshold: float = 0.05) -> int:
    if not 0 <= threshold < 1:
        raise UsageError(f"--threshold must be a fraction in [0, 1); got {threshold}")
    base, new = samples(base_path), samples(new_path)
    both = [key for key in base if key in new]
    if not both:
        raise UsageError(f"no run with an ok throughput in both {base_path} and {new_path} "
                         f"(runs are matched by run name and device)")
    lines = ["| run | device | launches base / new | base img/s (median) | new img/s (median) | new / base | "
             "95% CI | verdict |", "|" + "---|" * 8]
    failing = []
    for key in both:
        ratio, lo, hi = ratio_ci(base[key], new[key])
        word = verdict(lo, hi)
        if hi < 1 - threshold:
            failing.append(key[0])
            word += f" (by more than {threshold:.0%}: gate fails)"
        lines.append(f"| {key[0]} | {key[1]} | {len(base[key])} / {len(new[key])} | {median(base[key]):.1f} | "
                     f"{median(new[key]):.1f} | {ratio:.3f} | {lo:.3f}–{hi:.3f} | {word} |")
    print("\n".join(lines))
    alone = sorted({k[0] for k in set(base) ^ set(new)})
    if alone:
        print(f"\nin one file only (not compared): {', '.join(alone)}")
    if any(len(base[k]) < 2 or len(new[k]) < 2 for k in both):
        print("\nnote: a run with one launch on a side has no noise estimate (its interval is the single ratio); "
              "measure both sides with benchmark.py --repeats N")
    print(f"\ngate (threshold {threshold:.0%}): " +
          (f"FAIL, slower beyond noise: {', '.join(failing)}" if failing else "pass"))
    return 1 if failing else 0
