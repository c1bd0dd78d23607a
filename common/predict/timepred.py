"""pred_step_ms, pred_img_s, pred_time_error_pct: the step model's prediction for this run, beside
what it measured.

The prediction (common/predict/timemodel.py) takes this run's setup (strategy, world size, precision,
micro-batch, optimizer: the memory model's Setup, or a pipeline's schedule) and the measured inputs
of `python benchmark.py calibrate` for this machine (--calibration, default results/calibration.json):
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
Without a calibration for the run the columns stay empty and the notes say what is missing.
"""
from __future__ import annotations

import os

import torch

from ..distributed import global_rank, world_size
from ..measure import Instrument
from .calibration import DEFAULT, compute_mode, compute_of, find_compute, find_link, find_pieces, load
from .timemodel import Link, predict_step

# StepPrediction.parts() -> the row's columns (common/results.py PRED_TIME_PARTS)
PARTS = {"data": "pred_data_ms", "compute": "pred_compute_ms", "comm_exposed": "pred_comm_exposed_ms",
         "optimizer": "pred_optimizer_ms"}


class TimePrediction(Instrument):
    def __init__(self, cfg, setup, device: torch.device, steptimes, loader_img_s: float | None, strategy: str,
                 where: tuple | None = None):
        self.cfg, self.setup, self.device, self.steptimes = cfg, setup, device, steptimes
        self.loader_img_s, self.strategy = loader_img_s, strategy
        # (device name, processes on the node, threads per process) of a run re-predicted from its row
        # (benchmark.py predict); None: this process's own
        self.where = where

    def predict(self):
        """(StepPrediction, None) or (None, why)."""
        cfg, s = self.cfg, self.setup
        if s is None:
            return None, "no step model for this script"
        if s.strategy.endswith("_offload"):
            return None, "offload is not in the step model (host transfers, CPU optimizer)"
        path = getattr(cfg, "calibration", "") or DEFAULT
        data = load(path)
        from ..measure.fingerprint import device_name

        pp = self.strategy.startswith("pp_")
        micro = s.batch_size // cfg.microbatches if pp else s.micro_batch
        cuda = self.device.type == "cuda"
        mode = compute_mode(s.strategy, s.precision, cuda and bool(getattr(cfg, "tf32", False)))
        name, procs, threads = self.where or (device_name(self.device), int(os.environ.get(
            "LOCAL_WORLD_SIZE", world_size())), torch.get_num_threads())
        procs, threads = (1, 1) if cuda else (procs, threads)
        args = (data, name, s.model, s.image_size, micro)
        rest = (s.optimizer, procs, threads, s.channels_last)
        # the strategy's own run on one process (its host work around the compute), else the plain model's
        c, why = find_compute(*args, f"{mode}@{self.strategy}", *rest)
        if c is None:
            c, why = find_compute(*args, mode, *rest)
        if c is None:
            return None, f"{why} in {path}: run benchmark.py calibrate"
        link = find_link(data, s.world_size) if s.world_size > 1 else Link()
        if link is None:
            return None, f"no collectives calibrated at {s.world_size} ranks in {path}: run benchmark.py calibrate"
        # loader_img_s is summed over data-parallel ranks (each loads its share of the global batch) and
        # the slowest stage's for a pipeline (each loads all of it): either way global batch / rate a step
        load_ms = s.batch_size / self.loader_img_s * 1e3 if self.loader_img_s else 0.0
        # --loader gpu has no workers: its transforms run on the step's own stream, before the forward
        inline = cfg.workers == 0 or getattr(cfg, "loader", "torch") == "gpu"
        # Compute.data_ms is one micro-batch's: predict_step counts it grad_accum times a step
        compute = compute_of(c, load_ms / max(1, s.grad_accum) if inline else 0.0, why)
        stages = pieces = None
        if pp:
            from ..models import meta_model
            from ..models import stages as resnet_stages
            from ..pipeline import plan

            model = meta_model(s.model, image_size=s.image_size)
            if not resnet_stages(model):
                return None, "the step model splits a pipeline at ResNet stages only (not at blocks)"
            stages = plan(model, s.world_size, cfg.split)
            pieces = find_pieces(data, name, s.model, s.image_size, micro, mode, rest[2])
        elif s.world_size > 1:  # when each of its units' gradients is ready (timemodel.time_shares)
            pieces = find_pieces(data, name, s.model, s.image_size, micro, mode, rest[2], nearest=True)
        pred = predict_step(s, compute, link, overlap=cuda, strategy=self.strategy,
                            microbatches=getattr(cfg, "microbatches", 1), stages=stages, pieces=pieces)
        if not inline and load_ms > pred.step_ms:
            pred.data_ms += load_ms - pred.step_ms
        return pred, None

    def row(self) -> dict:
        out = dict.fromkeys(("pred_step_ms", "pred_img_s", "pred_time_error_pct", *PARTS.values()))
        # a collective: every rank calls it, whatever the prediction does
        measured = self.steptimes.row().get("step_ms_p50") if self.steptimes is not None else None
        if global_rank() != 0:  # the row is rank 0's
            return out
        try:
            pred, why = self.predict()
        except Exception as exc:  # a prediction must never cost the run its row
            pred, why = None, f"{type(exc).__name__}: {exc}"
        if pred is None:
            out["notes"] = f"pred_step_ms: {why}"
            return out
        out["pred_step_ms"] = round(pred.step_ms, 3)
        # the components beside the measured step_*_ms (the model has no `other`: the loop's bookkeeping)
        out.update({col: round(pred.parts()[part], 3) for part, col in PARTS.items()})
        out["pred_img_s"] = round(self.cfg.batch_size / pred.step_ms * 1e3, 2) if pred.step_ms else None
        if measured:
            out["pred_time_error_pct"] = round(100 * (pred.step_ms - measured) / measured, 2)
        return out
