"""The step-time distribution over the timed window: step_ms_p50 and step_ms_p90.

A step is the time from one optimizer step's end to the next one's (so it includes fetching the
batch, as throughput does); the first step after the window opens or resumes starts at that moment,
so paused epoch-end work (checkpoint saves, evaluation) and the warm-up steps are in no step.
On GPU each step end is a CUDA event recorded on the run device's current stream: no host sync in
the loop; the events are read when the window pauses or stops, where the device is already
synchronized. On CPU, where work is synchronous, it is the wall clock. Across ranks each
percentile is the max over ranks: the slowest rank sets the pace of a synchronous step.
The profiled communication steps (common/measure/comm.py) precede the window: none is counted here.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..distributed import reduce_metrics
from . import Instrument


def time_mark(device: torch.device):
    """A point in time: a CUDA event on the device's current stream (read later, no host sync now), or
    the wall clock on CPU, where ops run synchronously."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


class StepTimes(Instrument):
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.marks: list = []  # this segment's step ends (CUDA events or perf_counter values)
        self.ms: list[float] = []

    def _mark(self):
        return time_mark(self.device)

    def start(self) -> None:
        self.marks = [self._mark()]

    resume = start

    def step(self) -> None:
        self.marks.append(self._mark())

    def pause(self) -> None:
        if self.cuda and self.marks:
            self.marks[-1].synchronize()  # already done: the window pauses with the device synchronized
            self.ms += [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        else:
            self.ms += [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]
        self.marks = []

    stop = pause

    def row(self) -> dict:
        ms = self.ms
        p50, p90 = np.percentile(ms, [50, 90]).tolist() if ms else (None, None)
        out = reduce_metrics({"step_ms_p50": p50, "step_ms_p90": p90}, self.device, "max")
        return {k: None if v is None else round(v, 3) for k, v in out.items()}
