"""The software a row was measured with. A value that does not apply (CUDA versions on a CPU run,
DeepSpeed on a script that does not train with it) is None: an empty cell, never 0 or a guess."""
from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import torch


def _version(package: str, module: str, used: bool) -> str | None:
    if not used or module not in sys.modules:  # accelerate imports deepspeed when installed: use, not import
        return None
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return getattr(sys.modules[module], "__version__", None)


def driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        return None


def nccl_version() -> str | None:
    try:
        v = torch.cuda.nccl.version()  # a tuple (major, minor, patch) in current torch
    except Exception:
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def fingerprint(device: torch.device, libraries: tuple[str, ...] = ()) -> dict:
    """libraries: which of "deepspeed", "accelerate" the script trains with (the registry says)."""
    cuda = device.type == "cuda"
    return {
        "cuda_version": torch.version.cuda if cuda else None,
        "cudnn_version": torch.backends.cudnn.version() if cuda else None,
        "nccl_version": nccl_version() if cuda else None,
        "driver_version": driver_version() if cuda else None,
        "deepspeed_version": _version("deepspeed", "deepspeed", "deepspeed" in libraries),
        "accelerate_version": _version("accelerate", "accelerate", "accelerate" in libraries),
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" x{os.cpu_count()}"
    except OSError:
        pass
    return platform.processor() or "cpu"
