"""GPU memory and utilization probes. On CPU every value is None (an empty CSV cell), never 0.

peak_allocated_gib / peak_reserved_gib: torch.cuda's peak counters for this process (tensors /
    tensors + the caching allocator's free blocks), reset when the probe starts.
peak_nvml_gib: the device's used memory as NVML sees it (CUDA context, NCCL buffers and every other
    process on that GPU included), peak of the samples.
gpu_util_mean / gpu_util_peak: NVML's utilization.gpu in percent (share of time a kernel ran),
    sampled every `interval_s` by a background thread while the probe runs.
"""
from __future__ import annotations

import threading

import torch

from .distributed import all_reduce

GIB = 1024 ** 3


def _nvml_handle(device: torch.device):
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        uuid = uuid if uuid.startswith("GPU-") else "GPU-" + uuid
        try:  # CUDA_VISIBLE_DEVICES renumbers devices; the UUID does not lie
            return pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except pynvml.NVMLError:
            return pynvml, pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
    except Exception:
        return None, None


class Probes:
    def __init__(self, devices: list[torch.device], interval_s: float = 0.2):
        self.devices = [d for d in devices if d.type == "cuda"]
        self.interval_s = interval_s
        self.handles = []
        self.pynvml = None
        for d in self.devices:
            self.pynvml, h = _nvml_handle(d)
            if h is not None:
                self.handles.append(h)
        self.util_samples: list[float] = []
        self.nvml_peak = 0
        self._stop = threading.Event()
        self._thread = None

    def _sample(self) -> None:
        for h in self.handles:
            try:
                self.util_samples.append(float(self.pynvml.nvmlDeviceGetUtilizationRates(h).gpu))
                self.nvml_peak = max(self.nvml_peak, self.pynvml.nvmlDeviceGetMemoryInfo(h).used)
            except self.pynvml.NVMLError:
                pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> "Probes":
        for d in self.devices:
            torch.cuda.reset_peak_memory_stats(d)
        if self.handles:
            self._sample()
            self._thread = threading.Thread(target=self._run, name="gpu-probe", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict:
        """Stops sampling; returns this process's figures reduced over all ranks (max, mean of means)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()
        if not self.devices:
            local = torch.tensor([float("nan")] * 5, dtype=torch.float64)
        else:
            alloc = max(torch.cuda.max_memory_allocated(d) for d in self.devices) / GIB
            reserved = max(torch.cuda.max_memory_reserved(d) for d in self.devices) / GIB
            nvml = self.nvml_peak / GIB if self.handles else float("nan")
            mean = sum(self.util_samples) / len(self.util_samples) if self.util_samples else float("nan")
            peak = max(self.util_samples) if self.util_samples else float("nan")
            local = torch.tensor([alloc, reserved, nvml, mean, peak], dtype=torch.float64)
        maxes = all_reduce(local.clone(), op=torch.distributed.ReduceOp.MAX)
        means = all_reduce(local.clone()) / torch.distributed.get_world_size() \
            if torch.distributed.is_initialized() else local
        values = [maxes[0], maxes[1], maxes[2], means[3], maxes[4]]
        names = ["peak_allocated_gib", "peak_reserved_gib", "peak_nvml_gib", "gpu_util_mean", "gpu_util_peak"]
        return {k: (None if torch.isnan(v) else round(float(v), 3)) for k, v in zip(names, values)}
