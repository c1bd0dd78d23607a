"""GPU memory and utilization over the timed window. On CPU every value is None (an empty CSV cell), never 0.

peak_allocated_gib / peak_reserved_gib: torch.cuda's peak counters (tensors / tensors + the caching
    allocator's cached blocks). Reset when the window opens, so the warm-up steps' cuDNN autotuning
    workspaces and compile autotuning do not count in the allocated peak; reset again after every pause,
    so an epoch-end checkpoint save does not count either (the peak before the pause is kept). A reset
    sets a peak to the current value: the reserved one keeps the blocks cached before the window.
peak_nvml_gib: the device's used memory as NVML sees it (CUDA context, NCCL buffers and every other
    process on that GPU included), the largest sample taken inside the window. NVML's v2 memory
    query is used: its `used` excludes the memory the driver reserves for itself, which v1 counts.
gpu_util_mean / gpu_util_peak: NVML's utilization.gpu in percent (share of the sample period in
    which a kernel ran), sampled every `interval_s` by a background thread, inside the window only
    (not during worker start-up, warm-up or checkpoint saves): the first sample an interval after the
    window opens or resumes (one taken at the opening would describe the idle time before it), the last
    as it pauses.
Nothing is read after the last pause: the last epoch's checkpoint save and evaluation come between it
    and stop().

Across ranks: peaks are the max over ranks, the utilization mean is the mean over ranks. A
DataParallel process drives several GPUs: its peaks are those of the busiest GPU.
"""
from __future__ import annotations

import threading

import torch

from ..distributed import reduce_metrics
from . import Instrument

GIB = 1024 ** 3


def nvml_handle(device: torch.device):
    """(pynvml, handle) for a CUDA device, found by its UUID, or (None, None).

    The UUID is the only safe key: CUDA_VISIBLE_DEVICES renumbers devices, so CUDA index i is not
    NVML index i. torch's uuid has no prefix; NVML names full GPUs "GPU-<uuid>" and MIG instances
    "MIG-<uuid>" (pynvml.nvmlDeviceGetHandleByUUID accepts both). When neither is found the
    columns stay empty rather than describe some other GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:
        return None, None
    candidates = [uuid] if uuid.startswith(("GPU-", "MIG-")) else ["GPU-" + uuid, "MIG-" + uuid]
    for name in candidates:
        try:
            return pynvml, pynvml.nvmlDeviceGetHandleByUUID(name)
        except pynvml.NVMLError:
            continue
    return None, None


def nvml_used_bytes(pynvml, handle) -> int:
    """Used device memory, v2 query (pynvml.nvmlDeviceGetMemoryInfo(h, version=nvmlMemory_v2)
    calls nvmlDeviceGetMemoryInfo_v2, whose `used` leaves out driver-reserved memory)."""
    return pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).used


class Probes(Instrument):
    """GPU memory and utilization of `devices` (this process's GPUs); `run_device` carries the reduction."""

    def __init__(self, devices: list[torch.device], run_device: torch.device, interval_s: float = 0.2):
        self.devices = [d for d in devices if d.type == "cuda"]
        self.run_device = run_device
        self.interval_s = interval_s
        self.pynvml, self.handles = None, []
        for d in self.devices:
            lib, h = nvml_handle(d)
            if h is not None:
                self.pynvml = lib
                self.handles.append(h)
        self.util_samples: list[float] = []
        self.nvml_peak = 0
        self.alloc_peak = self.reserved_peak = 0
        self._sampling = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread's check and sample against a pause
        self._opened = 0  # windows opened so far: a sample waits a whole interval inside its window
        self._thread = None
        self.started = self.active = False

    # --- the window ---
    def start(self) -> None:
        self.started = self.active = True
        self._opened += 1
        self._reset_peaks()
        if self.handles:
            self._thread = threading.Thread(target=self._run, name="gpu-probe", daemon=True)
            self._sampling.set()
            self._thread.start()

    def pause(self) -> None:
        if not self.active:
            return
        with self._lock:
            self.active = False
            self._sampling.clear()
            if self._thread is not None:
                self._sample()
        self._keep_peaks()

    def resume(self) -> None:
        with self._lock:
            self.active = True
            self._opened += 1
        self._reset_peaks()
        if self._thread is not None:
            self._sampling.set()

    def stop(self) -> None:
        self.pause()  # a window still open ends here; after a pause nothing more is the window's
        if self._thread is not None:
            self._stop.set()
            self._sampling.set()
            self._thread.join()
            self._thread = None

    # --- sampling ---
    def _reset_peaks(self) -> None:
        for d in self.devices:
            torch.cuda.reset_peak_memory_stats(d)

    def _keep_peaks(self) -> None:
        for d in self.devices:
            self.alloc_peak = max(self.alloc_peak, torch.cuda.max_memory_allocated(d))
            self.reserved_peak = max(self.reserved_peak, torch.cuda.max_memory_reserved(d))

    def _sample(self) -> None:
        for h in self.handles:
            try:
                self.util_samples.append(float(self.pynvml.nvmlDeviceGetUtilizationRates(h).gpu))
            except self.pynvml.NVMLError:  # MIG instances report no utilization
                pass
            try:
                self.nvml_peak = max(self.nvml_peak, nvml_used_bytes(self.pynvml, h))
            except self.pynvml.NVMLError:
                pass

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sampling.wait()
            opened = self._opened
            self._stop.wait(self.interval_s)  # a period inside the window first
            with self._lock:
                if self._stop.is_set():
                    break
                if self._sampling.is_set() and self._opened == opened:  # no pause and resume in between
                    self._sample()

    # --- the row ---
    def local(self) -> dict:
        if not self.devices or not self.started:
            return dict.fromkeys(("peak_allocated_gib", "peak_reserved_gib", "peak_nvml_gib", "gpu_util_mean",
                                  "gpu_util_peak"))
        util = self.util_samples
        return {"peak_allocated_gib": self.alloc_peak / GIB, "peak_reserved_gib": self.reserved_peak / GIB,
                "peak_nvml_gib": self.nvml_peak / GIB if self.nvml_peak else None,
                "gpu_util_mean": sum(util) / len(util) if util else None,
                "gpu_util_peak": max(util) if util else None}

    def row(self) -> dict:
        local = self.local()
        mean = reduce_metrics({"gpu_util_mean": local.pop("gpu_util_mean")}, self.run_device, "mean")
        out = {**reduce_metrics(local, self.run_device, "max"), **mean}
        return {k: None if v is None else round(v, 3) for k, v in out.items()}
