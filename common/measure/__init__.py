"""The measuring instruments, one small module each: what the training loop is measured with.

Every instrument follows one protocol (`Instrument`) over the timed window that common/train.py
opens after the timing warm-up: start() when the window opens (device synchronized), pause() and
resume() around work that is not training (epoch-end checkpoint saves), step() after every
optimizer step inside the window, stop() when training ends, and row() for its CSV columns,
reduced over ranks (row() is a collective: every rank calls it). An instrument that leaves a
column of its own empty says why under the key "notes" (joined into the row's notes column).

    probes.py       GPU memory peaks (torch.cuda, NVML) and utilization
    fingerprint.py  software and driver versions of the row
    loader.py       the input pipeline's own throughput, measured before training
    bubble.py       pipeline_bubble_pct: idle share of the devices of a split model
    model_state.py  model state measured by walking tensor storages
    steptime.py     the step-time distribution (CUDA events on GPU, wall clock on CPU)
    flops.py        FLOPs per training image, achieved TFLOP/s, the device's peak and MFU
    energy.py       energy over the window (NVML on GPU, RAPL on CPU) and images per joule
    host.py         whether the run had its CPUs to itself: other work, hypervisor steal, run-queue waits
    comm.py         every collective of the first profiled steps

The models that predict these figures live in common/predict/.
"""
from __future__ import annotations


class Instrument:
    """Base class: every hook is optional."""

    # steps this instrument needs for itself before the window opens (its work would perturb the
    # window's: the communication profiler); 0 for the instruments of the window
    outside_window = 0
    done = 0  # of those steps, how many it has run

    def prelude(self) -> None:
        """Before the last warm-up step (or at the window's opening when there is no warm-up)."""

    def start(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def step(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def row(self) -> dict:
        return {}
