"""Statistics over repeated launches of one run (benchmark.py --repeats N) and between two result
files (benchmark.py compare): pure functions of lists of numbers.

The median, not the mean, is the centre: a launch that hit a slow node or a noisy neighbour moves
the mean but not the median. Spread is the interquartile range (as torch.utils.benchmark reports
it) and the min-max; uncertainty of the median is a percentile bootstrap 95% confidence interval
(resampling the launches with replacement, a fixed seed so that a report is reproducible). With
three launches the interval is close to the min-max: more launches narrow it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
SEED = 0
NOISY_IQR = 0.05  # a run whose IQR exceeds 5% of its median is flagged: its figure moves between launches


def median(xs: Sequence[float]) -> float:
    return float(np.median(np.asarray(xs, dtype=float)))


def iqr(xs: Sequence[float]) -> float:
    """Interquartile range, quartiles by linear interpolation (numpy's default, as torch.utils.benchmark)."""
    q1, q3 = np.percentile(np.asarray(xs, dtype=float), [25, 75])
    return float(q3 - q1)


def noisy(xs: Sequence[float], limit: float = NOISY_IQR) -> bool:
    return iqr(xs) > limit * abs(median(xs))


def _resampled_medians(xs: Sequence[float], rng: np.random.Generator, resamples: int) -> np.ndarray:
    x = np.asarray(xs, dtype=float)
    return np.median(x[rng.integers(0, len(x), size=(resamples, len(x)))], axis=1)


def _interval(values: np.ndarray, level: float) -> tuple[float, float]:
    lo, hi = np.percentile(values, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def median_ci(xs: Sequence[float], level: float = 0.95, resamples: int = RESAMPLES,
              seed: int = SEED) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the median."""
    return _interval(_resampled_medians(xs, np.random.default_rng(seed), resamples), level)


def ratio_ci(base: Sequence[float], new: Sequence[float], level: float = 0.95, resamples: int = RESAMPLES,
             seed: int = SEED) -> tuple[float, float, float]:
    """median(new) / median(base) and its percentile bootstrap confidence interval, both samples
    resampled independently (they are independent launches)."""
    rng = np.random.default_rng(seed)
    b, n = _resampled_medians(base, rng, resamples), _resampled_medians(new, rng, resamples)
    return (median(new) / median(base), *_interval(n / b, level))


def verdict(lo: float, hi: float) -> str:
    """faster / slower when the whole interval of new/base is above / below 1, else the difference is noise."""
    if lo > 1:
        return "faster"
    if hi < 1:
        return "slower"
    return "same within noise"


@dataclass
class Summary:
    n: int
    median: float
    iqr: float
    min: float
    max: float
    ci_low: float
    ci_high: float
    noisy: bool


def summarize(xs: Sequence[float]) -> Summary:
    lo, hi = median_ci(xs)
    return Summary(len(xs), median(xs), iqr(xs), float(min(xs)), float(max(xs)), lo, hi, noisy(xs))
