"""Where a step's time goes, measured over the timed window: the step_*_ms columns.

The loop (common/train.py) marks the end of each phase of a step; a phase's time is the time from
the previous mark to its own, so the phases tile the window and their sum is the window's time:
  step_data_ms          waiting for the loader's next batch and copying it to the device
  step_compute_ms       forward and backward (a pipeline's whole schedule), less the exposed
                        communication that fell in it
  step_optimizer_ms     the optimizer step (with zero_grad, the scaler, the LR scheduler), less the
                        exposed communication that fell in it (ZeRO's broadcasts, DeepSpeed's gathers)
  step_comm_exposed_ms  communication during which the training thread ran no compute: collectives
                        it waited for (DDP's last buckets, FSDP's unprefetched gathers, ZeRO's
                        broadcasts, a pipeline's receives), and on CPU its own share of a collective
                        (inside the dispatcher op: gloo's reduce-scatter copies its whole input there)
  step_other_ms         the rest: the loop's bookkeeping, progress lines, the non-finite check
  step_ms_mean          their sum: the window's time per optimizer step (what throughput inverts)
Each is per optimizer step, the mean over the window's steps, then the mean over ranks.

On GPU each mark is a CUDA event on the run device's current stream (no host synchronization in the
loop), so a phase is the device's time between two marks: data is the copy plus any time the device
sat idle waiting for the host to hand it the batch. On CPU, where ops run synchronously, it is the
wall clock.

Exposed communication cannot be seen by marks. It is measured over the profiled communication steps
(common/measure/comm.py, before the window): per phase, the time inside that phase with a collective
in flight and no compute op on the training thread (on GPU: no compute kernel). That time per step,
taken out of the phase it fell in, is the window's step_comm_exposed_ms. Single-device rows have none; a
distributed script on one CPU process has its own collectives' (gloo still runs them at world size 1). One
process on several GPUs (DataParallel, model parallelism) leaves it empty: its copies between GPUs are not
collectives the profiler separates, and they stay in step_compute_ms.
"""
from __future__ import annotations

import torch

from ..distributed import reduce_metrics
from . import Instrument
from .steptime import time_mark

PHASES = ("data", "compute", "optimizer", "other")
COLUMNS = ("step_data_ms", "step_compute_ms", "step_comm_exposed_ms", "step_optimizer_ms", "step_other_ms",
           "step_ms_mean")


class StepParts(Instrument):
    def __init__(self, device: torch.device, comm=None):
        # comm: the CommRecorder whose profiled steps give the exposed share; None where nothing communicates
        self.device, self.comm = device, comm
        self.cuda = device.type == "cuda"
        self.pending: list = []  # (phase, start mark, end mark) of this segment, read at pause (CUDA events)
        self.ms = dict.fromkeys(PHASES, 0.0)
        self.last = None
        self.steps = 0

    def _now(self):
        return time_mark(self.device)

    def start(self) -> None:
        self.last = self._now()

    resume = start

    def mark(self, phase: str) -> None:
        if self.last is None:
            return
        now = self._now()
        if self.cuda:
            self.pending.append((phase, self.last, now))
        else:
            self.ms[phase] += (now - self.last) * 1e3
        self.last = now

    def step(self) -> None:
        self.steps += 1

    def pause(self) -> None:
        if self.last is None:
            return
        self.mark("other")  # the end of the segment: what followed the last step's marks
        if self.cuda and self.pending:
            self.pending[-1][2].synchronize()  # the window pauses with the device synchronized
            for phase, a, b in self.pending:
                self.ms[phase] += a.elapsed_time(b)
        self.pending, self.last = [], None

    stop = pause

    def local(self) -> dict:
        if not self.steps:
            return dict.fromkeys(COLUMNS)
        per = {p: self.ms[p] / self.steps for p in PHASES}
        out = {"step_data_ms": per["data"], "step_compute_ms": per["compute"], "step_comm_exposed_ms": 0.0,
               "step_optimizer_ms": per["optimizer"], "step_other_ms": per["other"],
               "step_ms_mean": sum(per.values())}
        if self.comm is None:  # no process group: nothing to communicate
            return out
        exposed = self.comm.exposed_ms_per_step()
        if exposed is None:  # --comm-steps 0, or no step profiled: left in the phases it fell in
            return {**out, "step_comm_exposed_ms": None}
        for phase in ("compute", "optimizer"):
            taken = min(per[phase], exposed.get(phase, 0.0))
            out[f"step_{phase}_ms"] -= taken
            out["step_comm_exposed_ms"] += taken
        return out

    def row(self) -> dict:
        out = reduce_metrics(self.local(), self.device, "mean")
        return {k: None if v is None else round(v, 3) for k, v in out.items()}
