"""The train loop every script shares. A script passes in only what IS its strategy, as TrainHooks:
the (wrapped) model, the precision context, `backward(loss)`, `step()` and, for DDP, `no_sync`.

Timing (what the CSV's columns mean):
  train_time_s      every training epoch, wall clock, device synchronized at both ends; excludes
                    data set loading, the loader probe, evaluation, checkpoint saving and
                    torch.compile's first call.
  the timed window  opens after `timing_warmup_steps` optimizer steps (device synchronized) and
                    closes after the last one; epoch-end work (checkpoint saves, evaluation for
                    --target-accuracy) is paused out of it. throughput_img_s, the memory peaks,
                    utilization and every other instrument of common/measure/ cover this window.
                    A run with no more steps than the warm-up has no warm-up: its window opens at
                    the first step.
                    In a distributed run the --comm-steps steps after the warm-up are profiled
                    (common/measure/comm.py) and the window opens after them: no instrument sees
                    them, unless the run has no other steps left (then they are the window).
The hot loop keeps loss and accuracy sums on the device: the host waits on the device only at
progress lines (every `log_every` steps) and epoch ends.
"""
from __future__ import annotations

import gc
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .checkpoint import check_shared_dir
from .config import TrainConfig
from .distributed import (
    all_reduce,
    barrier,
    broadcast_buffers,
    global_rank,
    grouped,
    reduce_metrics,
    synchronize,
    world_size,
)
from .measure import Instrument
from .measure.comm import PHASE, CommRecorder
from .measure.energy import Energy
from .measure.flops import Flops
from .measure.host import HostShare
from .measure.loader import probe_loader
from .measure.model_state import ModelState
from .measure.probes import Probes
from .measure.stepparts import StepParts
from .measure.steptime import StepTimes
from .optim import steps_per_epoch


class Diverged(RuntimeError):
    """Loss stayed non-finite for cfg.max_nonfinite_steps steps in a row."""


@dataclass
class TrainHooks:
    """What a script hands to fit(): the lines that are its strategy."""
    backward: Callable[[torch.Tensor], None]  # gets the micro-batch loss, already divided by grad_accum
    step: Callable[[], None]  # once per optimizer step: optimizer, scaler, scheduler, zero_grad
    device: torch.device  # this rank's device: batches, metric tensors and collectives live there
    ctx: ContextManager = field(default_factory=nullcontext)  # autocast, or nothing
    no_sync: Callable[[], ContextManager] = nullcontext  # DDP: accumulate micro-batches without all-reduce
    input_dtype: torch.dtype = torch.float32  # pure half precision, FSDP and DeepSpeed feed half inputs
    probe_devices: list[torch.device] | None = None  # GPUs this process drives (DataParallel: all of them)
    evaluate: Callable | None = None  # accelerate: through gather_for_metrics
    # optimizer steps skipped for non-finite gradients (fp16's scaler; DeepSpeed's engine in every
    # precision), read after training; None where nothing can skip
    skipped_steps: Callable[[], int | None] | None = None
    optimizer: Any = None  # what holds the optimizer state (for the instruments that measure it)
    # pipelining: the schedule runs forward and backward of all micro-batches in one call, (x, y) ->
    # (logits, loss) on the last stage, (None, None) on the others
    forward_backward: Callable[[torch.Tensor, torch.Tensor], tuple] | None = None
    instruments: list = field(default_factory=list)  # the script's own instruments (pipeline bubble)
    # the precision the library really trains in (fp32/fp16/bf16) where it is not --precision:
    # accelerate's mixed_precision (set by `accelerate launch --mixed_precision` or its config),
    # DeepSpeed's JSON. Every instrument and the memory prediction read it.
    precision: str | None = None
    # an object whose step() the backward calls (accelerate's DeepSpeedEngineWrapper.backward runs
    # engine.step() after engine.backward(): accelerate/utils/deepspeed.py): its step is timed as the
    # optimizer phase, not as compute
    step_inside_backward: Any = None


@dataclass
class Metrics:
    steps: int = 0  # optimizer steps, all epochs
    train_time_s: float = 0.0
    throughput_img_s: float = 0.0
    timed_steps: int = 0  # optimizer steps inside the timed window
    compile_time_s: float | None = None  # torch.compile's first forward+backward, outside train_time_s
    resumed: bool = False  # training state was restored from an epoch checkpoint
    train_loss: float = float("nan")  # mean over the last epoch's samples, all ranks
    train_accuracy: float = float("nan")  # same window, augmented training images
    test_accuracy: float = float("nan")
    test_samples: int = 0
    time_to_target_s: float | None = None
    skipped_steps: int | None = None
    extra: dict = field(default_factory=dict)  # the instruments' columns

    def row(self) -> dict:
        r = {k: v for k, v in self.__dict__.items() if k != "extra"}
        for k in ("train_time_s", "throughput_img_s", "compile_time_s", "time_to_target_s"):
            r[k] = None if r[k] is None else round(r[k], 3)
        for k in ("train_loss", "train_accuracy", "test_accuracy"):
            r[k] = None if math.isnan(r[k]) else round(r[k], 6)
        return {**r, **self.extra}


class TimedWindow:
    """The timed window: opens once `opens_at` optimizer steps are done, accumulates time and steps
    across epochs, and is paused at every epoch end. Drives the instruments' hooks.

    One window for every instrument. What perturbs the run happens outside it: an instrument that
    needs steps of its own (`outside_window`, the communication profiler) runs them first, and the
    window opens after them (after the profiler's stop and trace processing too); each process of a
    resumed run profiles its own first steps the same way. Only when the steps left are no more than
    the profiler needs is it run inside the window (there is nothing else to time). The garbage the
    set-up left is collected before the window opens. `prelude()` arms
    an instrument before the last warm-up step (the model-state walk runs in that step)."""

    def __init__(self, opens_at: int, device: torch.device | list[torch.device], instruments: list[Instrument],
                 time_s: float = 0.0, steps: int = 0, total_steps: int | None = None):
        self.opens_at, self.device, self.total_steps = opens_at, device, total_steps
        self.instruments = [i for i in instruments if not i.outside_window]
        self.parts = next((i for i in instruments if isinstance(i, StepParts)), None)
        self.before = [i for i in instruments if i.outside_window]  # not run yet in this process
        self.profiling: list[Instrument] = []
        self.profiled: list[Instrument] = []  # ran their steps: only their rows are left
        self.time_s, self.steps = time_s, steps  # restored from a resumed run's checkpoint
        self.started = self.running = False
        self.t0 = 0.0

    def _prelude(self, steps_done: int) -> None:
        if steps_done == self.opens_at - 1:
            for i in self.instruments + self.before:
                i.prelude()

    def _open(self, steps_done: int, collected: bool = False) -> None:
        left = None if self.total_steps is None else self.total_steps - steps_done
        first = [i for i in self.before if left is None or left > i.outside_window]
        if first:  # their steps, then the window
            self.before = [i for i in self.before if i not in first]
            self.profiling = first
            for i in first:
                i.start()
            for i in self.instruments:  # a resumed process, or no warm-up: the walk in a profiled step
                i.prelude()
            return
        self.instruments += self.before  # too few steps left to keep them out: inside the window
        self.before = []
        # a full collection the set-up (or the profiler's trace processing) left pending is not a step's:
        # 155 ms for a DDP+ZeRO rank's 345,000 tracked objects (the collections the steps cause stay in); the
        # ranks meet after it, or the first timed step's collective would hold one rank's wait for another's
        if not collected:
            gc.collect()
            barrier()
        synchronize(self.device)
        self.t0, self.running = time.perf_counter(), True
        # the step components first: the window's time from t0 on is theirs to tile
        ordered = sorted(self.instruments, key=lambda i: i is not self.parts)
        if not self.started:
            self.started = True
            for i in ordered:
                i.start()
        else:
            for i in ordered:
                i.resume()

    def epoch_start(self, steps_done: int) -> None:
        self._prelude(steps_done)
        if steps_done >= self.opens_at:
            self._open(steps_done)

    def after_step(self, steps_done: int) -> None:
        if self.profiling:
            for i in self.profiling:
                i.step()
            if all(i.done >= i.outside_window for i in self.profiling):
                self._finish_profiling()
                gc.collect()  # the trace's objects, before the ranks meet: the window opens right after
                # ranks end their trace processing at different times: without this the first timed
                # step would hold the wait for the slowest (idle time a pipeline's bubble would count)
                barrier()
                self._open(steps_done, collected=True)
        elif self.running:
            self.steps += 1
            for i in self.instruments:
                i.step()
        elif steps_done == self.opens_at:
            self._open(steps_done)
        else:
            self._prelude(steps_done)

    def _finish_profiling(self) -> None:
        for i in self.profiling:
            i.stop()
        # an epoch that ended before their first step: they start again with the next epoch
        self.before += [i for i in self.profiling if i.done == 0]
        self.profiled += [i for i in self.profiling if i.done > 0]
        self.profiling = []

    def epoch_end(self) -> None:
        """Called with the device already synchronized."""
        if self.profiling:  # the epoch ended first: profiled fewer steps than asked
            self._finish_profiling()
        if self.running:
            self.time_s += time.perf_counter() - self.t0
            self.running = False
            for i in self.instruments:
                i.pause()

    def mark(self, phase: str) -> None:
        """The end of one phase of a step (common/measure/stepparts.py), inside the window only."""
        if self.running and self.parts is not None:
            self.parts.mark(phase)

    def phase(self, name: str):
        """Around a phase while the communication profiler records (before the window, or inside it when
        too few steps were left): its name in the trace."""
        recording = self.profiling or any(i.outside_window and i.done < i.outside_window for i in self.instruments)
        return torch.profiler.record_function(PHASE + name) if recording else nullcontext()

    def elapsed(self) -> float:
        return self.time_s + (time.perf_counter() - self.t0 if self.running else 0.0)

    def timed(self) -> tuple[int, float]:
        """(steps, seconds) of the window: what throughput counts."""
        return self.steps, self.time_s

    def close(self) -> dict:
        """Stops the instruments and returns their columns (a collective: every rank calls it)."""
        if self.profiling:
            self._finish_profiling()
        row, notes = {}, []
        for i in self.profiled + self.instruments + self.before:
            if self.started:
                i.stop()
            cols = i.row()
            notes += [cols.pop("notes")] if cols.get("notes") else []
            row.update(cols)
        return {**row, "notes": "; ".join(notes) or None}


def build_instruments(cfg: TrainConfig, model: nn.Module, hooks: TrainHooks, m: Metrics) -> list[Instrument]:
    """Everything measured over the timed window (common/measure/). Built before the window opens:
    the FLOP count and the CPU matmul probe happen here, outside it. What the models predict of the run
    is computed from its row once training has ended (common/runner.py), not here."""
    devices = hooks.probe_devices or [hooks.device]
    precision = hooks.precision or cfg.precision
    probes = Probes(devices, hooks.device)
    measured = communicates(hooks.device)
    profiled = cfg.comm_steps if measured else 0
    comm = [CommRecorder(cfg.comm_steps, hooks.device)] if profiled else []  # its steps precede the window
    parts = StepParts(hooks.device, exposed_comm_source(comm, measured, devices))
    state, times = ModelState(model, hooks.optimizer, hooks.device), StepTimes(hooks.device)
    return [probes, state, *comm, times, parts, Energy(devices, hooks.device, cfg.batch_size), HostShare(hooks.device),
            Flops(cfg.model, cfg.image_size, precision, devices, hooks.device, lambda: m.throughput_img_s),
            *hooks.instruments]


def communicates(device: torch.device) -> bool:
    """Whether a run's collectives are profiled: n ranks', and on a CPU a world of one's too, since gloo still
    runs them on the training thread there (a reduce-scatter clones its whole input: DeepSpeed ZeRO-3's 45 MB of
    resnet18 gradients, 19 ms a step) and that time is communication, not compute, as at n ranks (calibrate's
    one-process entries: an n-rank prediction prices n ranks' collectives). NCCL runs a one-rank collective as
    a device copy or its oneRankReduce kernel (enqueue.cc: nRanks == 1 -> ncclLaunchOneRank), no NCCL kernel
    to find: the device's own work, compute's."""
    return grouped() and (world_size() > 1 or device.type != "cuda")


class _NoProfile:
    """A distributed run with --comm-steps 0, or one process driving several GPUs: its exposed communication
    was not measured."""

    @staticmethod
    def exposed_ms_per_step():
        return None


def exposed_comm_source(comm: list, measured: bool, devices: list) -> object | None:
    """What StepParts reads the exposed communication from: the profiler's steps; nothing measured (an empty
    column) for a distributed run that profiled none, or for one process on several GPUs (DataParallel's
    scatter, replicate and gather, model parallelism's copies between its halves: inside forward and backward,
    never profiled as collectives); None, 0 ms, where nothing communicates."""
    if comm:
        return comm[0]
    return _NoProfile() if measured or len(set(devices)) > 1 else None


def _to_device(x, y, device, input_dtype, channels_last):
    x = x.to(device, dtype=input_dtype, non_blocking=True)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y.to(device, non_blocking=True)


def set_epoch(loader, epoch: int) -> None:
    target = getattr(loader, "sampler", None)
    target = target if hasattr(target, "set_epoch") else loader
    if hasattr(target, "set_epoch"):
        target.set_epoch(epoch)


def train_mode(model: nn.Module, freeze_bn: bool) -> None:
    model.train()
    if freeze_bn:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()


@dataclass
class EpochStats:
    loss_sum: torch.Tensor
    correct: torch.Tensor
    seen: int = 0


def train_epoch(cfg: TrainConfig, net: nn.Module, loader, hooks: TrainHooks, window: TimedWindow, m: Metrics,
                streak: torch.Tensor, epoch: int, spe: int) -> tuple[EpochStats, torch.Tensor]:
    """One epoch of at most spe optimizer steps; returns the device-side sums and the non-finite streak."""
    device = hooks.device
    stats = EpochStats(torch.zeros((), dtype=torch.float64, device=device),
                       torch.zeros((), dtype=torch.int64, device=device))
    epoch_steps = micro = 0
    for x, y in loader:
        x, y = _to_device(x, y, device, hooks.input_dtype, cfg.channels_last)
        window.mark("data")
        micro += 1
        boundary = micro % cfg.grad_accum == 0
        with nullcontext() if boundary else hooks.no_sync(), window.phase("compute"):
            if hooks.forward_backward is not None:
                logits, loss = hooks.forward_backward(x, y)
            else:
                with hooks.ctx:
                    logits = net(x)
                    loss = F.cross_entropy(logits.float(), y)
                hooks.backward(loss / cfg.grad_accum)
        window.mark("compute")
        loss_d = None
        if logits is not None:  # a pipeline's earlier stages hold no outputs: they count nothing
            loss_d = loss.detach().float()
            streak = torch.where(torch.isfinite(loss_d), torch.zeros_like(streak), streak + 1)
            stats.loss_sum += loss_d.double() * y.shape[0]
            stats.correct += (logits.detach().argmax(1) == y).sum()
            stats.seen += y.shape[0]
        window.mark("other")
        if not boundary:
            continue
        with window.phase("optimizer"):
            hooks.step()
        window.mark("optimizer")
        m.steps += 1
        epoch_steps += 1
        window.after_step(m.steps)
        if cfg.log_every and epoch_steps % cfg.log_every == 0:
            _check_finite(streak, cfg)
            progress(cfg, window, epoch, epoch_steps, spe, loss_d)
        window.mark("other")
        if epoch_steps >= spe:
            break
    return stats, streak


def progress(cfg: TrainConfig, window: TimedWindow, epoch: int, epoch_steps: int, spe: int,
             loss: torch.Tensor | None):
    if global_rank() != 0:
        return
    spent = window.elapsed()
    rate = f" img_s={window.steps * cfg.batch_size / spent:.1f}" if window.steps and spent > 0 else ""
    shown = "n/a" if loss is None else f"{loss.item():.4f}"  # rank 0 is a pipeline's first stage: no loss there
    print(f"[progress] epoch={epoch + 1}/{cfg.epochs} step={epoch_steps}/{spe} loss={shown}{rate}", flush=True)


def _time_as_optimizer(owner, window: TimedWindow) -> None:
    """owner.step() is called inside the backward hook: the time before it stays compute, its own time
    is the optimizer phase (a mark, and its range while the communication profiler records)."""
    inner = owner.step

    def step(*args, **kwargs):
        window.mark("compute")
        with window.phase("optimizer"):
            out = inner(*args, **kwargs)
        window.mark("optimizer")
        return out

    owner.step = step


def fit(cfg: TrainConfig, model: nn.Module, train_loader, test_loader, hooks: TrainHooks,
        checkpointer=None) -> Metrics:
    """Trains cfg.epochs epochs, then evaluates once. With a checkpointer, training state is saved
    after every epoch (outside the timed window) and, with --resume, restored before the first one."""
    spe, device, m = steps_per_epoch(cfg, train_loader), hooks.device, Metrics()
    if checkpointer is not None and (cfg.epoch_checkpoints or cfg.resume or checkpointer.final_reads_every_rank):
        check_shared_dir(cfg.save_dir)  # every rank writes and reads there: refused before training if not shared
    for flag, path in (("--results", cfg.results), ("--figures", getattr(cfg, "figures", ""))):
        if path:  # a failed run's row: written by the first rank to fail, on any node
            check_shared_dir(os.path.dirname(os.path.abspath(path)), flag=flag)
    saved = resume(cfg, checkpointer, m)
    loader_img_s = probe_loader(train_loader, cfg, hooks)
    net = model
    if cfg.compile:
        net, m.compile_time_s = compile_model(model, train_loader, hooks, cfg.channels_last)
    opens_at = cfg.timing_warmup_steps if cfg.timing_warmup_steps < spe * cfg.epochs else 0
    every = hooks.probe_devices or [device]  # what the window and the epoch's clock wait for
    window = TimedWindow(opens_at, every, build_instruments(cfg, model, hooks, m),
                         *(saved["window_time"], saved["window_steps"]) if saved else (), total_steps=spe * cfg.epochs)
    if hooks.step_inside_backward is not None:
        _time_as_optimizer(hooks.step_inside_backward, window)
    streak = torch.zeros((), dtype=torch.int32, device=device)
    for epoch in range(saved["epoch"] if saved else 0, cfg.epochs):
        set_epoch(train_loader, epoch)
        train_mode(model, cfg.freeze_bn)
        synchronize(every)
        epoch_start = time.perf_counter()
        window.epoch_start(m.steps)
        stats, streak = train_epoch(cfg, net, train_loader, hooks, window, m, streak, epoch, spe)
        synchronize(every)
        m.train_time_s += time.perf_counter() - epoch_start
        window.epoch_end()
        _check_finite(streak, cfg)
        epoch_end(cfg, model, test_loader, hooks, window, m, stats, epoch, checkpointer)
    m.timed_steps, timed_s = window.timed()
    m.throughput_img_s = m.timed_steps * cfg.batch_size / timed_s if timed_s else 0.0
    closed, loader = window.close(), loader_row(loader_img_s, m.throughput_img_s)
    m.extra = {**closed, **loader, "notes": "; ".join(n for n in (closed.get("notes"), loader["notes"]) if n) or None}
    if saved and saved["epoch"] == cfg.epochs:  # resumed after the last epoch: nothing left to train
        m.train_loss, m.train_accuracy = saved["train_loss"], saved["train_accuracy"]
    if math.isnan(m.test_accuracy):  # not already evaluated after the last epoch
        m.test_accuracy, m.test_samples = run_eval(model, test_loader, hooks, cfg.channels_last)
    m.skipped_steps = hooks.skipped_steps() if hooks.skipped_steps else None
    return m


def resume(cfg: TrainConfig, checkpointer, m: Metrics) -> dict | None:
    if checkpointer is None or not cfg.resume:
        return None
    saved = checkpointer.load(cfg.resume)
    if saved is not None:
        m.steps, m.train_time_s, m.resumed = saved["steps"], saved["train_time_s"], True
        m.time_to_target_s = saved.get("time_to_target_s")
        if global_rank() == 0:
            print(f"resumed after epoch {saved['epoch']} (step {m.steps}) from {checkpointer.describe()}", flush=True)
    return saved


def epoch_end(cfg: TrainConfig, model, test_loader, hooks: TrainHooks, window: TimedWindow, m: Metrics,
              stats: EpochStats, epoch: int, checkpointer) -> None:
    """Outside the timed window: the epoch's loss and accuracy over all ranks, the evaluation that
    --target-accuracy asks for, and the resumable state."""
    totals = all_reduce(torch.stack([stats.loss_sum, stats.correct.double(),
                                     torch.tensor(float(stats.seen), dtype=torch.float64, device=hooks.device)]))
    m.train_loss, m.train_accuracy = (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()
    m.test_accuracy = float("nan")
    if cfg.target_accuracy:
        m.test_accuracy, m.test_samples = run_eval(model, test_loader, hooks, cfg.channels_last)
        if m.time_to_target_s is None and m.test_accuracy >= cfg.target_accuracy:
            m.time_to_target_s = m.train_time_s
    if checkpointer is not None and cfg.epoch_checkpoints:
        window_steps, window_time = window.timed()
        checkpointer.save(epoch + 1, {"epoch": epoch + 1, "steps": m.steps, "train_time_s": m.train_time_s,
                                      "window_time": window_time, "window_steps": window_steps,
                                      "train_loss": m.train_loss, "train_accuracy": m.train_accuracy,
                                      "time_to_target_s": m.time_to_target_s})


def loader_row(loader_img_s: float | None, throughput: float) -> dict:
    """loader_img_s, and where the input pipeline is not clearly faster than training a warning and a note
    in the row: a sweep's rows then say which ran loader-bound, not only its log."""
    bound = loader_img_s is not None and throughput and loader_img_s < 1.2 * throughput
    if bound and global_rank() == 0:
        print(f"warning: the input pipeline delivers {loader_img_s:.0f} img/s and training ran at "
              f"{throughput:.0f} img/s: the loader may be the bottleneck (raise --workers, or --loader gpu)",
              file=sys.stderr, flush=True)
    return {"loader_img_s": None if loader_img_s is None else round(loader_img_s, 1),
            "notes": f"the loader may bound the step: it delivered {loader_img_s:.0f} img/s alone, training ran at "
                     f"{throughput:.0f}" if bound else None}


def run_eval(model, test_loader, hooks: TrainHooks, channels_last: bool) -> tuple[float, int]:
    if hooks.forward_backward is None:  # data-parallel replicas (a pipeline's ranks hold different pieces)
        broadcast_buffers(model)
    return (hooks.evaluate or evaluate)(model, test_loader, ctx=hooks.ctx, device=hooks.device,
                                        input_dtype=hooks.input_dtype, channels_last=channels_last)


def compile_model(model: nn.Module, train_loader, hooks: TrainHooks, channels_last: bool):
    """torch.compile, then one forward+backward on a real batch so that compilation happens here and
    not in the timed loop. Gradients are dropped and BatchNorm statistics restored: training starts
    from exactly the state it would have had without compiling."""
    from .checkpoint import rng_state, set_rng_state

    compiled = torch.compile(model)
    buffers = {k: v.clone() for k, v in model.state_dict().items() if not isinstance(v, nn.Parameter)}
    rng = rng_state(train_loader)  # drawing a batch advances the augmentation RNG: put it back after
    x, y = next(iter(train_loader))
    x, y = _to_device(x, y, hooks.device, hooks.input_dtype, channels_last)
    model.train()
    synchronize(hooks.device)
    start = time.perf_counter()
    with hooks.ctx:
        loss = F.cross_entropy(compiled(x).float(), y)
    loss.backward()
    synchronize(hooks.device)
    elapsed = time.perf_counter() - start
    for p in model.parameters():
        p.grad = None
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k in buffers:
                v.copy_(buffers[k])
    set_rng_state(rng, train_loader)
    return compiled, elapsed


def _check_finite(streak: torch.Tensor, cfg: TrainConfig) -> None:
    worst = reduce_metrics({"streak": float(streak)}, streak.device, "max")["streak"]
    if worst >= cfg.max_nonfinite_steps:
        raise Diverged(f"loss was non-finite for {int(worst)} consecutive steps")


@torch.no_grad()
def evaluate(model: nn.Module, loader, *, ctx: ContextManager, device: torch.device,
             input_dtype: torch.dtype = torch.float32, channels_last: bool = False, group=None) -> tuple[float, int]:
    """Top-1 accuracy over the whole test set: each rank sees its shard, padding is masked out,
    the counts are summed over ranks, so every test sample counts exactly once. group: the ranks that
    hold distinct shards when several ranks compute one forward together (tensor parallelism's dp group)."""
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    for x, y, valid in loader:
        x, y = _to_device(x, y, device, input_dtype, channels_last)
        valid = valid.to(device, non_blocking=True)
        with ctx:
            pred = model(x).argmax(1)
        correct += ((pred == y) & valid).sum()
        count += valid.sum()
    totals = all_reduce(torch.stack([correct, count]), group=group)
    return (totals[0] / totals[1]).item() if totals[1] else float("nan"), int(totals[1])
