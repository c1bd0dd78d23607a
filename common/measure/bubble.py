"""pipeline_bubble_pct: the idle share of the busiest-idle device of a split model over the timed window.

Method. Every forward and backward computation of a piece of the model is bracketed on its lane
(a pipeline rank, or a device of model parallelism): host perf_counter on CPU, where work is
synchronous; CUDA events on the lane's current stream on a GPU, read after the window closes
(device synchronized). A lane's busy time is the sum of its brackets inside the window, its idle
share 1 - busy / window wall time; the column is the largest idle share over lanes and ranks, in
percent. Idle therefore includes waiting for activations and gradients from the neighbours (the
bubble proper), sending them, the loss, the optimizer step and data loading: everything that is
not a piece's forward or backward. For p equal stages and m micro-batches GPipe and 1F1B idle
(p-1)/(m+p-1) of the time in theory; an unbalanced split idles the lighter stages more.
"""
from __future__ import annotations

import time

import torch

from ..distributed import reduce_metrics
from . import Instrument
from .steptime import time_mark


class Lane:
    """Busy time of one device: brackets opened with begin() and closed with end()."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.active = False  # set by the instrument: brackets count only inside the window
        self.busy_s = 0.0
        self.open: float | torch.cuda.Event | None = None
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _mark(self):
        return time_mark(self.device)

    def begin(self) -> None:
        if self.active:
            self.open = self._mark()

    def end(self) -> None:
        if self.open is None:
            return
        mark, self.open = self._mark(), self.open
        if self.cuda:
            self.pending.append((self.open, mark))
        else:
            self.busy_s += mark - self.open
        self.open = None

    def settle(self) -> None:
        """Adds the recorded CUDA intervals."""
        for _, b in self.pending:
            b.synchronize()  # on its own device: a lane need not rely on what the window synchronized
        self.busy_s += sum(a.elapsed_time(b) for a, b in self.pending) / 1000
        self.pending.clear()

    def timed(self, fn):
        """fn, bracketed on this lane."""
        def wrapper(*args, **kwargs):
            self.begin()
            try:
                return fn(*args, **kwargs)
            finally:
                self.end()
        return wrapper


class Bubble(Instrument):
    """pipeline_bubble_pct over the lanes of this process; `run_device` carries the reduction."""

    def __init__(self, lanes: list[Lane], run_device: torch.device):
        self.lanes, self.run_device = lanes, run_device
        self.window_s, self.t0 = 0.0, None

    def _set(self, active: bool) -> None:
        for lane in self.lanes:
            lane.active = active
            lane.open = None
            lane.settle()

    def start(self) -> None:
        self._set(True)
        self.t0 = time.perf_counter()

    resume = start

    def pause(self) -> None:
        if self.t0 is not None:
            self.window_s += time.perf_counter() - self.t0
            self.t0 = None
        self._set(False)

    stop = pause

    def local(self) -> float | None:
        if not self.window_s:
            return None
        return max(100.0 * max(0.0, 1.0 - lane.busy_s / self.window_s) for lane in self.lanes)

    def row(self) -> dict:
        got = reduce_metrics({"pipeline_bubble_pct": self.local()}, self.run_device, "max")["pipeline_bubble_pct"]
        return {"pipeline_bubble_pct": None if got is None else round(got, 2)}
