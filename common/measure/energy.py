"""Energy over the timed window, as MLPerf Power reports it: energy_j and img_per_j.

GPU: NVML's total-energy counter (pynvml.nvmlDeviceGetTotalEnergyConsumption: millijoules since
    the driver loaded, Volta and newer), read when the window opens, pauses, resumes and stops, so
    paused epoch-end work is not counted. It is the whole board's energy (idle power, and any other
    process on that GPU, included). Summed over the run's GPUs: each rank reads the GPUs it drives
    (one, or all of them for DataParallel), and no GPU is driven by two ranks (NCCL refuses it). A
    GPU without the counter (MIG instances, older boards: NVMLError_NotSupported) empties the column
    for the run: a sum over some of the GPUs would look like a frugal run.
CPU: RAPL's package counters, /sys/class/powercap/intel-rapl:*/energy_uj of the zones named
    package-N (DRAM and psys zones are left out: psys already contains the packages), read by local
    rank 0 of each host only, since the ranks of a host share its packages; the whole packages'
    energy, other processes included. The counter wraps at max_energy_range_uj: it is read at least
    every `poll_s` inside the window so that no wrap goes unseen. Since Linux 5.10 energy_uj is
    readable by root only; where it is unreadable the columns stay empty.
img_per_j: images trained inside the window (timed steps x global batch) per joule.
A counter that did not move over the whole window (shorter than its update period) reads as empty.
"""
from __future__ import annotations

import glob
import os
import time

import torch

from ..distributed import local_rank, reduce_metrics
from . import Instrument
from .probes import nvml_handle

RAPL_ROOT = "/sys/class/powercap"


def rapl_zones(root: str = RAPL_ROOT) -> list[str]:
    """The package zones whose counter this process can read."""
    zones = []
    for path in sorted(glob.glob(os.path.join(root, "intel-rapl:*"))):
        try:
            with open(os.path.join(path, "name")) as fh:
                if not fh.read().startswith("package"):
                    continue
            read_uj(path, "energy_uj")
            read_uj(path, "max_energy_range_uj")
        except (OSError, ValueError):
            continue
        zones.append(path)
    return zones


def read_uj(zone: str, name: str) -> int:
    with open(os.path.join(zone, name)) as fh:
        return int(fh.read())


class RaplCounter:
    """Joules spent by the package zones since start(), wraparound included."""

    def __init__(self, zones: list[str]):
        self.zones = zones
        self.ranges = [read_uj(z, "max_energy_range_uj") for z in zones]
        self.last: list[int] = []
        self.joules = 0.0

    def start(self) -> None:
        self.last = [read_uj(z, "energy_uj") for z in self.zones]

    def poll(self) -> None:
        now = [read_uj(z, "energy_uj") for z in self.zones]
        for before, after, span in zip(self.last, now, self.ranges):
            self.joules += ((after - before) if after >= before else (after + span - before)) / 1e6
        self.last = now


class NvmlCounter:
    """Joules spent by the GPUs since start(); None once any of them lacks the counter."""

    def __init__(self, devices: list[torch.device]):
        found = [nvml_handle(d) for d in devices]
        self.pynvml = next((lib for lib, _ in found if lib is not None), None)
        self.handles = [h for _, h in found]
        self.last: list[int] = []
        self.joules: float | None = 0.0 if self.pynvml is not None and None not in self.handles else None

    def _read(self) -> list[int] | None:
        try:
            return [self.pynvml.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles]
        except self.pynvml.NVMLError:  # NVMLError_NotSupported on MIG and pre-Volta boards
            self.joules = None
            return None

    def start(self) -> None:
        if self.joules is not None:
            self.last = self._read() or []

    def poll(self) -> None:
        if self.joules is None:
            return
        now = self._read()
        if now is not None:
            self.joules += sum(b - a for a, b in zip(self.last, now)) / 1e3
            self.last = now


class Energy(Instrument):
    def __init__(self, devices: list[torch.device], run_device: torch.device, batch_size: int,
                 rapl_root: str = RAPL_ROOT, poll_s: float = 1.0):
        self.run_device, self.batch_size, self.poll_s = run_device, batch_size, poll_s
        gpus = list(dict.fromkeys(d for d in devices if d.type == "cuda"))  # MP on one GPU names it twice
        self.counter = None
        if gpus:
            self.counter = NvmlCounter(gpus)
        elif local_rank() == 0:
            zones = rapl_zones(rapl_root)
            self.counter = RaplCounter(zones) if zones else None
        self.owner = bool(gpus) or local_rank() == 0  # ranks that report a counter (or its absence)
        self.steps = 0
        self.last_poll = 0.0
        self.running = False

    def start(self) -> None:
        if self.counter is not None:
            self.counter.start()
            self.last_poll, self.running = time.monotonic(), True

    resume = start

    def step(self) -> None:
        self.steps += 1
        if self.running and time.monotonic() - self.last_poll >= self.poll_s:
            self.counter.poll()
            self.last_poll = time.monotonic()

    def pause(self) -> None:
        if self.running:  # stop() after a pause adds nothing: the paused time is not the window's
            self.counter.poll()
            self.running = False

    stop = pause

    def joules(self) -> float | None:
        """This rank's share of the run's energy: None where it should have read a counter and could not."""
        if not self.owner:
            return 0.0
        return None if self.counter is None else self.counter.joules

    def row(self) -> dict:
        j = self.joules()
        total = reduce_metrics({"j": j or 0.0, "missing": float(j is None)}, self.run_device, "sum")
        # no change at all: a window shorter than the counter's update period, not a run that cost nothing
        energy = total["j"] if total["missing"] == 0 and total["j"] else None
        images = self.steps * self.batch_size
        return {"energy_j": None if energy is None else round(energy, 3),
                "img_per_j": float(f"{images / energy:.4g}") if energy and images else None}
