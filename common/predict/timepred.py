"""pred_step_ms, pred_img_s, pred_time_error_pct: the step model's prediction for this run, beside
what it measured.

The prediction (common/predict/timemodel.py) takes the run's setup (common/runsetup.py: strategy, world
size, precision, micro-batch, optimizer, a pipeline's schedule) and the measured inputs of `python
benchmark.py calibrate` for its machine (the calibration.json beside the run's results file; `benchmark.py
predict --calibration FILE` for another):
one process's forward, backward and optimizer time at the run's micro-batch and compute mode (of
this strategy's script run on one process where calibrate ran it, else of the single-device script), and
the collectives' latency and bus bandwidth at the run's world size. The input pipeline's time per
step comes from this run's loader_img_s (measured before training). With the loader in the training
process (--workers 0, or --loader gpu, whose transforms run on the step's stream) it adds to the step.
With workers, they produce the next batches while the step runs (the DataLoader keeps prefetch_factor
batches a worker in flight), so the step waits only for what production takes beyond its own work:
step = max(work, global batch / loader_img_s), the excess as data. On a GPU a small batch can meet that
bound: ResNet50/224 in AMP bf16 at batch 32 on an H100 with 2 workers measured 32.6 ms a step against
25.2 ms of calibrated work (980 img/s; the row was not kept, and 8 workers probed 1,320-4,530 img/s on
that machine), most likely loader-bound. On a CPU the workers also take cores from the step, which the
model does not price.
Nothing of the timed window enters the prediction. Its components, pred_data_ms, pred_compute_ms,
pred_comm_exposed_ms and pred_optimizer_ms, add up to pred_step_ms and stand beside the measured
step_*_ms (the model has no `other`). pred_time_error_pct = (pred_step_ms - step_ms_p50) / step_ms_p50
x 100: the median step, which a pause or a slow first step does not move. A loader-bound run whose
workers finish in step with each other is the exception: a round of W batches lands at once, and W - 1 of
its steps find their batch waiting, so its median is one of those and its mean step is the one to compare
(workers with real transforms drift apart: the H100 run above had a p50 of 32.6 ms, the bound).
Without a calibration for the run the columns stay empty and the notes say what is missing. The runner
computes these columns once training has ended (common/runner.py), outside every timed window, on global
rank 0, which writes the row; `benchmark.py predict` calls the same functions on rows already written.
"""
from __future__ import annotations

from ..runsetup import RunSetup
from .calibration import compute_mode, compute_of, find_compute, find_link, find_pieces, load
from .memory import setup_of
from .timemodel import Link, predict_step

# StepPrediction.parts() -> the row's columns (common/results.py GROUPS["model"])
PARTS = {"data": "pred_data_ms", "compute": "pred_compute_ms", "comm_exposed": "pred_comm_exposed_ms",
         "optimizer": "pred_optimizer_ms"}
COLUMNS = ("pred_step_ms", "pred_img_s", "pred_time_error_pct", *PARTS.values())


def step_setup(run: RunSetup):
    """(the step model's Setup, its strategy) of a run, or (None, why): a pipeline is priced on the whole
    model's Setup with its schedule as the strategy."""

    from .memory import Setup

    if run.pipeline:
        # its stages' pieces are calibrated in NCHW (calibrate _piece_times), as a pipeline's run is priced
        setup = Setup(model=run.model, image_size=run.image_size, batch_size=run.batch_size,
                      world_size=run.world_size, precision=run.half, optimizer=run.optimizer, strategy="single")
        return setup, run.strategy
    setup = setup_of(run)
    if setup is None:
        return None, f"no step model for {run.strategy or run.script}"
    return setup, setup.strategy


def _where(run: RunSetup) -> tuple[str, int, int]:
    """(device name, processes on the node, threads per process) the calibration is looked up by."""
    if run.device == "cuda":
        return run.device_name, 1, 1
    return run.device_name, run.local_world_size or run.world_size, run.threads or 1


def _pipeline_inputs(run: RunSetup, data, name, micro, mode, threads):
    from ..models import meta_model
    from ..models import stages as resnet_stages
    from ..pipeline import plan

    model = meta_model(run.model, image_size=run.image_size)
    if not resnet_stages(model):
        return None, None, "the step model splits a pipeline at ResNet stages only (not at blocks)"
    pieces = find_pieces(data, name, run.model, run.image_size, micro, mode, threads)
    return plan(model, run.world_size, run.split), pieces, None


def predict(run: RunSetup, data: dict | None, path: str, loader_img_s: float | None):
    """(StepPrediction, None) or (None, why) for a run from a calibration (`data`, read from `path`)."""
    s, strategy = step_setup(run)
    if s is None:
        return None, strategy
    return predict_setup(s, strategy, run, data, path, loader_img_s)


def predict_setup(s, strategy: str, run: RunSetup, data: dict | None, path: str, loader_img_s: float | None):
    """predict() for the step model's Setup `s` and strategy of a run (its device, loader and schedule)."""
    if s.strategy.endswith("_offload"):
        return None, "offload is not in the step model (host transfers, CPU optimizer)"
    if data is None:
        return None, f"no calibration in {path}: run benchmark.py calibrate"
    cuda = run.device == "cuda"
    micro = s.batch_size // run.microbatches if run.pipeline else s.micro_batch
    mode = compute_mode(s.strategy, s.precision, cuda and run.tf32)
    name, procs, threads = _where(run)
    args, rest = (data, name, s.model, s.image_size, micro), (s.optimizer, procs, threads, s.channels_last)
    # the strategy's own run on one process (its host work around the compute), else the plain model's
    c, why = find_compute(*args, f"{mode}@{strategy}", *rest)
    if c is None:
        c, why = find_compute(*args, mode, *rest)
    if c is None:
        return None, f"{why} in {path}: run benchmark.py calibrate"
    link = find_link(data, s.world_size) if s.world_size > 1 else Link()
    if link is None:
        return None, f"no collectives calibrated at {s.world_size} ranks in {path}: run benchmark.py calibrate"
    # loader_img_s is summed over data-parallel ranks (each loads its share of the global batch) and
    # the slowest stage's for a pipeline (the first stage's: the only one that loads images, all of them):
    # either way global batch / rate a step
    load_ms = s.batch_size / loader_img_s * 1e3 if loader_img_s else 0.0
    # --loader gpu has no workers: its transforms run on the step's own stream, before the forward
    inline = run.workers == 0 or run.loader == "gpu"
    # Compute.data_ms is one micro-batch's: predict_step counts it grad_accum times a step
    compute = compute_of(c, load_ms / max(1, s.grad_accum) if inline else 0.0, why)
    stages = pieces = None
    if run.pipeline:
        stages, pieces, why = _pipeline_inputs(run, data, name, micro, mode, threads)
        if why:
            return None, why
    elif s.world_size > 1:  # when each of its units' gradients is ready (timemodel.time_shares)
        pieces = find_pieces(data, name, s.model, s.image_size, micro, mode, threads, nearest=True)
    pred = predict_step(s, compute, link, overlap=cuda, strategy=strategy, microbatches=run.microbatches,
                        stages=stages, pieces=pieces)
    if not inline and load_ms > pred.step_ms:
        pred.data_ms += load_ms - pred.step_ms
    return pred, None


def columns(run: RunSetup, path: str, loader_img_s: float | None, measured_p50: float | None) -> dict:
    """The row's pred_* time columns (COLUMNS), and under "notes" why they are empty where they are."""
    out = dict.fromkeys(COLUMNS)
    try:
        pred, why = predict(run, load(path), path, loader_img_s)
    except Exception as exc:  # a prediction must never cost the run its row
        pred, why = None, f"{type(exc).__name__}: {exc}"
    if pred is None:
        out["notes"] = f"pred_step_ms: {why}"
        return out
    out["pred_step_ms"] = round(pred.step_ms, 3)
    # the components beside the measured step_*_ms (the model has no `other`: the loop's bookkeeping)
    out.update({col: round(pred.parts()[part], 3) for part, col in PARTS.items()})
    out["pred_img_s"] = round(run.batch_size / pred.step_ms * 1e3, 2) if pred.step_ms else None
    if measured_p50:
        out["pred_time_error_pct"] = round(100 * (pred.step_ms - measured_p50) / measured_p50, 2)
    return out
