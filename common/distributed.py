"""Process-group set-up from the launcher's environment (torchrun, deepspeed, accelerate launch).

Global rank comes from RANK, the device from LOCAL_RANK: on two nodes they differ, and using the
local rank as the global one (as the articles' repository did) makes two processes "rank 0".
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import TrainConfig, UsageError


@dataclass
class DistInfo:
    rank: int  # global rank, 0..world_size-1
    local_rank: int  # index of this process on its node: picks the GPU
    world_size: int  # number of processes in the job
    device: torch.device


def pick_device(cfg: TrainConfig, local_rank: int = 0) -> torch.device:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    if cfg.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise UsageError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                         f"start at most that many processes per node")
    return torch.device("cuda", local_rank)


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(cfg: TrainConfig, standalone_group: bool = False) -> DistInfo:
    """Joins the process group the launcher describes. Started with plain python (no RANK/WORLD_SIZE),
    the script runs as a world of one: with standalone_group (the distributed scripts) inside a real
    one-process group, so DDP/ZeRO/FSDP/DeepSpeed run unchanged and their overhead can be measured."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if not standalone_group:
            return DistInfo(0, 0, 1, pick_device(cfg))
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(cfg, local_rank)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise UsageError("--backend nccl needs CUDA devices; use gloo on CPU")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                device_id=device if device.type == "cuda" else None)
    return DistInfo(rank, local_rank, world_size, device)


def require_single_process(script: str) -> None:
    if launched_world_size() > 1:
        raise UsageError(f"{os.path.basename(script)} trains on one device; start it with python, or use pytorch_DDP.py "
                         f"for {launched_world_size()} processes")


def cleanup(wait_for_all: bool = False) -> None:
    """Tears the process group down while the interpreter is fully alive.

    wait_for_all (this rank's run ended well): a barrier first, so that no rank closes its connections
    while another is still in a collective or writing the final weights. gc.collect(): FSDP modules
    and their DeviceMesh sit in reference cycles that can keep the process group referenced past
    destroy_process_group, leaving gloo's threads to interpreter exit (the likely cause, not proven).
    Seen twice in about 80 CPU runs of pytorch_FSDP.py before this: rank 1 aborting at exit
    ("terminate called without an active exception") while rank 0 was still writing model_final.pt."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait_for_all:
        try:
            dist.barrier()
        except (RuntimeError, dist.DistBackendError):  # a peer already gone: it failed and says so itself
            pass
    gc.collect()
    dist.destroy_process_group()


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce when a group exists; gloo wants CPU tensors, nccl device tensors."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    backend_cpu = dist.get_backend() == "gloo"
    work = tensor.cpu() if backend_cpu and tensor.device.type != "cpu" else tensor
    dist.all_reduce(work, op=op)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
