"""benchmark.py predict --results CSV [--calibration FILE] [--parts]: the step model again, on rows already measured.

Each ok row's step is predicted anew by this checkout's step model (common/predict/timemodel.py) from
a calibration (default results/calibration.json), and set beside what the row measured and what it
predicted when it ran. Two uses: a calibration taken after the runs, and a change to the model judged
on the same measured rows, with the machine's drift between launches held out (docs/time.md,
"benchmark.py predict").

Each row is read back into its run's setup (common/runsetup.py from_row). What rows of earlier releases do
not hold is assumed: the shipped DeepSpeed JSON of their stage, a pipeline's default split, and for rows
written before the `workers` column the loader in the training process (`--workers`, default 0 as the
`time` preset). Per run: the median over
its launches of step_ms_p50 and of each prediction; the summary counts the runs within 15% and checks
the predicted order of every two runs whose launches' ranges do not overlap (the report's check).
--parts adds each run's components, measured against predicted now.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics

from ..config import UsageError

PARTS = ("data", "compute", "comm_exposed", "optimizer")  # StepPrediction.parts(), the rows' step_*_ms


def add_args(p) -> None:
    p.add_argument("--results", default=os.path.join("results", "summary.csv"), help="the rows to predict again")
    p.add_argument("--calibration", default="", help="the step model's inputs (default results/calibration.json)")
    p.add_argument("--parts", action="store_true", help="also each run's components, measured against predicted now "
                   "(data, compute, exposed communication, optimizer; ms, medians over the launches)")
    p.add_argument("--workers", type=int, default=0, help="loader workers of rows from before the `workers` column "
                   "(a row that has it is read as it ran): 0 adds the loader's time per step to the prediction, "
                   "N > 0 makes it a bound the step cannot go below")


def _num(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def repredict(r, calibration: str, workers: int):
    """A row's step predicted now: (StepPrediction, '') or (None, why). Rows written before the `workers`
    column ran with the loader as `workers` says."""
    from dataclasses import replace

    from ..predict import timepred
    from ..predict.calibration import load
    from ..runsetup import from_row

    run = from_row(r)
    if run is None:
        return None, f"no step model for {r.get('script')}"
    if run.workers < 0:
        run = replace(run, workers=workers)
    loader = None if math.isnan(_num(r.loader_img_s)) else _num(r.loader_img_s)
    pred, why = timepred.predict(run, load(calibration), calibration, loader)
    return (pred, "") if pred is not None else (None, why)


def _guarded(r, calibration: str, workers: int):
    try:
        return repredict(r, calibration, workers)
    except Exception as exc:  # one row the model cannot read costs that row's figure, not the table
        return None, f"{type(exc).__name__}: {exc}"


@dataclasses.dataclass
class Score:
    """The issue's three bars on one set of rows, for one column of predictions."""
    runs: int  # runs with a prediction
    median_error_pct: float  # median over the runs of |predicted - measured| / measured, medians over launches
    within_15: int  # runs predicted within 15%
    pairs: int  # pairs of runs whose launches' step p50 ranges do not overlap
    wrong: list  # those of them predicted in the other order, one line each


@dataclasses.dataclass
class Evaluation:
    ok: object  # the ok rows, with now_ms and now_<part>_ms
    med: object  # per run: the medians of step_ms_p50, pred_step_ms (in the rows) and now_ms
    span: object  # per run: min, max and count of step_ms_p50
    scores: dict  # "in the rows" and "now": a Score, or None where nothing was predicted
    missing: list  # "run: why" for rows not predicted now


def evaluate(results: str, calibration: str, workers: int = 0) -> Evaluation:
    """Every ok row of `results` predicted again from `calibration`, and the bars both predictions meet."""
    from ..report import launches, load, time_pairs

    ok = launches(load(results))  # an unreadable file: read_rows' one-line UsageError
    ok = ok[ok.step_ms_p50.notna()].copy()
    if ok.empty:
        raise UsageError(f"no ok rows with a measured step in {results}")
    now, why = zip(*(_guarded(r, calibration, workers) for _, r in ok.iterrows()))
    ok["now_ms"] = [math.nan if x is None else x.step_ms for x in now]
    for part in PARTS:
        ok[f"now_{part}_ms"] = [math.nan if x is None else x.parts()[part] for x in now]
    missing = sorted({f"{label}: {w}" for label, w in zip(ok.label, why) if w})
    med = ok.groupby("label", sort=False)[["step_ms_p50", "pred_step_ms", "now_ms"]].median()
    span = ok.groupby("label", sort=False).step_ms_p50.agg(["min", "max", "count"])
    scores = {}
    for name, col in (("in the rows", "pred_step_ms"), ("now", "now_ms")):
        e = sorted(abs(100 * (m[col] - m.step_ms_p50) / m.step_ms_p50) for _, m in med.iterrows()
                   if not math.isnan(m[col]))
        if not e:
            scores[name] = None
            continue
        pairs, wrong = time_pairs(ok, med.assign(pred_step_ms=med[col]))
        scores[name] = Score(len(e), statistics.median(e), sum(x <= 15 for x in e), pairs, wrong)
    return Evaluation(ok, med, span, scores, missing)


def predict(opts) -> int:
    from ..predict.calibration import DEFAULT, load
    from ..report import busy_launches, pairs_sentence

    if not os.path.isfile(opts.results):
        raise UsageError(f"results file not found: {opts.results}")
    calibration = opts.calibration or DEFAULT
    if not os.path.isfile(calibration):
        raise UsageError(f"calibration file not found: {calibration} (run benchmark.py calibrate)")
    if load(calibration) is None:
        raise UsageError(f"{calibration} is not a calibration file (benchmark.py calibrate writes one)")
    if getattr(opts, "workers", 0) < 0:
        raise UsageError(f"--workers {opts.workers}: 0 or more")
    ev = evaluate(opts.results, calibration, opts.workers)
    med, span = ev.med, ev.span
    print(f"{opts.results}: each run's step predicted again by this checkout's step model from {calibration}; "
          "median over the run's launches (ms):")
    print(f"{'run':32s} {'launches':>8s} {'measured (min-max)':>24s} {'in the rows':>11s} {'err %':>6s} "
          f"{'now':>8s} {'err %':>6s}")
    for label, m in med.iterrows():
        cells = []
        for col in ("pred_step_ms", "now_ms"):
            err = 100 * (m[col] - m.step_ms_p50) / m.step_ms_p50
            cells.append(f"{m[col]:>{11 if col == 'pred_step_ms' else 8}.1f} {err:>+6.1f}" if not math.isnan(err)
                         else f"{'-':>{11 if col == 'pred_step_ms' else 8}s} {'-':>6s}")
        measured = f"{m.step_ms_p50:.1f} ({span['min'][label]:.1f}-{span['max'][label]:.1f})"
        print(f"{str(label)[:32]:32s} {int(span['count'][label]):>8d} {measured:>24s} {cells[0]} {cells[1]}")
    for name, sc in ev.scores.items():
        if sc is None:
            print(f"{name}: no prediction")
            continue
        order = f"; {pairs_sentence(sc.pairs, sc.wrong)}" if sc.pairs else ""
        print(f"{name}: median error {sc.median_error_pct:.1f}%, {sc.within_15} of {sc.runs} within 15%" + order)
    for line in filter(None, busy_launches(ev.ok)):
        print(line)
    if getattr(opts, "parts", False):
        _print_parts(ev.ok)
    if ev.missing:
        print("not predicted now: " + "; ".join(ev.missing))
    return 0


def _print_parts(ok) -> None:
    """Per run, each component measured / predicted now (medians over the launches): which part of the
    step the model gets wrong, not only by how much."""
    cols = [f"step_{p}_ms" for p in PARTS] + [f"now_{p}_ms" for p in PARTS]
    med = ok.assign(**{c: ok[c].map(_num) for c in cols}).groupby("label", sort=False)[cols].median()
    print("by component, measured / predicted now (ms; the measured `other`, the loop's bookkeeping, has no "
          "counterpart):")
    print(f"{'run':32s} " + " ".join(f"{p:>15s}" for p in PARTS))
    for label, m in med.iterrows():
        print(f"{str(label)[:32]:32s} " + " ".join(f"{m[f'step_{p}_ms']:>7.1f}/{m[f'now_{p}_ms']:<7.1f}"
                                                   for p in PARTS))
