"""Process-group set-up from the launcher's environment (torchrun, deepspeed, accelerate launch).

Global rank comes from RANK, the device from LOCAL_RANK: on two nodes they differ, and using the
local rank as the global one (as the articles' repository did) makes two processes "rank 0".
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import TrainConfig, UsageError
from .launching import free_port, local_world_size


@dataclass
class DistInfo:
    rank: int  # global rank, 0..world_size-1
    local_rank: int  # index of this process on its node: picks the GPU
    world_size: int  # number of processes in the job
    device: torch.device


def pick_device(cfg, local_rank: int = 0) -> torch.device:
    """cuda:LOCAL_RANK, or cuda:0 when the process sees exactly one GPU: schedulers that give each
    process its own GPU (Slurm --gpus-per-task=1, a CUDA_VISIBLE_DEVICES per rank) leave LOCAL_RANK
    at 0..n-1 while every process sees its GPU as device 0. A launcher that starts the node's
    processes itself (torchrun's LOCAL_WORLD_SIZE, DeepSpeed's LOCAL_SIZE) gives them all the same
    GPUs: more of them than GPUs would put two ranks on one, which NCCL refuses only later, with
    "Duplicate GPU detected" and no word of why; that is refused here, before any group forms."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    if cfg.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    node = local_world_size()
    if node is not None and node > visible:
        raise UsageError(f"{node} processes on this node (the launcher's LOCAL_WORLD_SIZE) but {visible} GPU"
                         f"{'s are' if visible > 1 else ' is'} visible: start at most {visible} per node "
                         f"(torchrun --nproc-per-node, accelerate launch --num_processes, GPUS_PER_NODE), one per GPU")
    if local_rank < visible:
        return torch.device("cuda", local_rank)
    if visible == 1:
        return torch.device("cuda", 0)
    raise UsageError(f"LOCAL_RANK {local_rank} but only {visible} GPUs are visible; "
                     f"start at most that many processes per node")


# the launcher's LOCAL_RANK, kept where device_for_rank changed LOCAL_RANK to the device's index
NODE_LOCAL_RANK = "BENCH_NODE_LOCAL_RANK"


def device_for_rank(cfg) -> torch.device:
    """pick_device for this process, with LOCAL_RANK made the index of the device picked. The libraries
    read LOCAL_RANK as a device index: DeepSpeed's engine calls set_device(LOCAL_RANK)
    (deepspeed/runtime/engine.py _set_distributed_vars), accelerate barriers with
    device_ids=[LOCAL_RANK] (accelerate/state.py wait_for_everyone). A process that sees one GPU as
    cuda:0 with LOCAL_RANK 3 would fail there with "invalid device ordinal". The launcher's value,
    the process's index on its node, stays in BENCH_NODE_LOCAL_RANK for local_rank(): which rank of a
    node downloads the data and reads the host's counters."""
    node_rank = local_rank()
    device = pick_device(cfg, node_rank)
    if device.type == "cuda" and device.index != node_rank:
        os.environ[NODE_LOCAL_RANK] = str(node_rank)
        os.environ["LOCAL_RANK"] = str(device.index)
    return device


DEFAULT_DIST_TIMEOUT_S = 1800  # --dist-timeout-s's default (common/config.py), for configs without the field


def dist_timeout(cfg) -> datetime.timedelta:
    """How long a rank waits in one collective (--dist-timeout-s) before the group fails it. torch's
    defaults are 10 minutes for NCCL and 30 for gloo (torch/distributed/constants.py), DeepSpeed's 10
    (deepspeed/constants.py default_pg_timeout): while rank 0 alone downloads CIFAR10 or consolidates
    a ZeRO-3 checkpoint of a large model on a slow shared filesystem, the other ranks wait in a barrier
    and NCCL's watchdog would abort the job after its training."""
    return datetime.timedelta(seconds=getattr(cfg, "dist_timeout_s", DEFAULT_DIST_TIMEOUT_S))


def local_rank() -> int:
    """This process's index on its node, as its launcher numbered it (see device_for_rank)."""
    return int(os.environ.get(NODE_LOCAL_RANK, os.environ.get("LOCAL_RANK", "0")))


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def backend_for(cfg, device: torch.device) -> str:
    """nccl on CUDA, gloo on CPU (--backend overrides). With FSDP's --cpu-offload, sharded parameters
    and gradients live on the host, and clip_grad_norm_ reduces their norms there: an nccl-only group
    has no CPU backend for that, so the group gets both, "cuda:nccl,cpu:gloo" (as accelerate,
    torchtitan and torchtune do for CPU offload)."""
    backend = getattr(cfg, "backend", "auto")
    backend = backend if backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise UsageError("--backend nccl needs CUDA devices; use gloo on CPU")
    if backend == "nccl" and getattr(cfg, "cpu_offload", False):
        return "cuda:nccl,cpu:gloo"
    return backend


def init_distributed(cfg: TrainConfig, standalone_group: bool = False) -> DistInfo:
    """Joins the process group the launcher describes. Started with plain python (no RANK/WORLD_SIZE),
    the script runs as a world of one: with standalone_group (the distributed scripts) inside a real
    one-process group, so DDP/ZeRO/FSDP/DeepSpeed run unchanged and their overhead can be measured."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if not standalone_group:
            return DistInfo(0, 0, 1, pick_device(cfg))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = device_for_rank(cfg)
    backend = backend_for(cfg, device)
    if "gloo" in backend:
        gloo_on_loopback_when_one_node()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = dist_timeout(cfg)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                store=attempt_store(rank, world_size, timeout),
                                device_id=device if device.type == "cuda" else None)
    return DistInfo(rank, local_rank(), world_size, device)


def gloo_on_loopback_when_one_node(environ=os.environ) -> bool:
    """Every gloo rank on one node talks over loopback (GLOO_SOCKET_IFNAME=lo), unless the user named
    an interface. Without it gloo listens on the address the machine's hostname resolves to (torch's
    ProcessGroupGloo::createDefaultDevice; only an unresolvable name falls back to loopback, with the
    warning "Unable to resolve hostname to a (local) address"). A hostname mapped to an address the
    peers cannot reach (a stale /etc/hosts entry, a sandbox's interface) hangs connectFullMesh until
    the group's 30-minute timeout. On one node loopback always reaches every peer; on several it
    reaches none, so multi-node jobs keep gloo's own choice. One node: the launcher's local world
    (torchrun LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE) is the whole world."""
    import socket

    local = local_world_size(environ)
    if "GLOO_SOCKET_IFNAME" in environ or local is None or str(local) != environ.get("WORLD_SIZE"):
        return False
    loopback = [name for _, name in socket.if_nameindex() if name in ("lo", "lo0")]  # lo0: macOS
    if loopback:
        environ["GLOO_SOCKET_IFNAME"] = loopback[0]
    return bool(loopback)


def attempt_store(rank: int, world_size: int, timeout=dist.default_pg_timeout):
    """The env:// store, under a prefix per torchrun attempt; None outside torchrun.

    torchrun's workers all connect to one TCPStore that outlives its restarts: the agent's own
    (torch/distributed/rendezvous.py, _create_c10d_store: "We create a new TCPStore for every retry
    so no need to add prefix for each attempt"; static_tcp_rendezvous.py keeps self._store across
    next_rendezvous calls). Every attempt writes the same keys (default_pg/0/rank_<r>: each rank's
    gloo listening address), so a restarted rank can read its peer's address from the killed
    attempt before the peer overwrites it, and gloo's connectFullMesh dials a dead port:
    "Connection refused" on both ranks (pytorch/pytorch#167288). A prefix per attempt gives each
    attempt keys of its own."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    return dist.PrefixStore(f"attempt{restarts()}", store)


def require_single_process(script: str, instead: str = "") -> None:
    """Refuses a launcher's several processes for a one-process script (they would all take cuda:0 and each
    append a row); `instead`: what to run for them (default: pytorch_DDP.py)."""
    n = launched_world_size()
    if n > 1:
        raise UsageError(f"{os.path.basename(script)} runs as one process on one device; start it with python, "
                         f"or {instead or f'use pytorch_DDP.py for {n} processes'}")


def require_cuda(device: torch.device, message: str) -> None:
    """A flag whose work exists on CUDA only (SyncBatchNorm's kernels, offload from device to host memory)
    refuses another device in one line. On CPU, tests/twins/cuda_flags_on_cpu.py lifts it and runs the path."""
    if device.type != "cuda":
        raise UsageError(message)


def cleanup(wait_for_all: bool = False) -> None:
    """Tears the process group down while the interpreter is fully alive.

    wait_for_all (this rank's run ended well): a barrier first, so that no rank closes its connections
    while another is still in a collective or writing the final weights. gc.collect(): FSDP modules
    and their DeviceMesh sit in reference cycles that can keep the process group referenced past
    destroy_process_group, leaving gloo's threads to interpreter exit (the likely cause, not proven).
    Seen twice in about 80 CPU runs of pytorch_FSDP.py before this: rank 1 aborting at exit
    ("terminate called without an active exception") while rank 0 was still writing model_final.pt."""
    if grouped():
        if wait_for_all:
            try:
                dist.barrier()
            except (RuntimeError, dist.DistBackendError):  # a peer already gone: it failed and says so itself
                pass
        gc.collect()
        dist.destroy_process_group()
    release_deepspeed_shm()


def release_deepspeed_shm() -> None:
    """Unlinks the 66 MB shared-memory buffer a DeepSpeed process on a CPU leaves in /dev/shm. Its
    communication backend creates one per rank when every rank is local (deepspeed/comm/torch.py
    TorchBackend.__init__ -> the shm op's initialize -> shm_initialize in csrc/cpu/comm/shm.cpp:
    "deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>") and never calls its
    shared_close: /dev/shm is memory, and a few hundred runs filled 19 GB of a 24 GB machine until the
    kernel killed the test session. Training never uses the buffer (only inference_all_reduce does);
    a peer still mapping it keeps its pages until it exits."""
    name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{os.environ.get('RANK', '0')}")
    try:
        os.remove(name)
    except OSError:  # none made (not DeepSpeed, a GPU, ranks on several nodes), or no /dev/shm
        pass


def global_rank() -> int:
    return dist.get_rank() if grouped() else int(os.environ.get("RANK", "0"))


def grouped() -> bool:
    """A process group is up: n ranks', or a distributed script's own at world size 1 (init_distributed)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if grouped() else 1


# --- collectives: the one rule ---
# Every collective in common/ goes through these helpers, and every tensor they reduce lives on the
# run's device. An nccl group serves only CUDA tensors (distributed_c10d.py maps "nccl" to ["cuda"]):
# a metric tensor built on the CPU fails there with "No backend type associated with device type
# cpu", after training, losing the run's figures. gloo serves CPU and CUDA tensors alike.

# The profiler range around the harness's own collectives (metrics, the non-finite check, buffers,
# objects): common/measure/comm.py leaves out every collective that starts inside one, so that the
# record holds what the strategy sends and nothing this project adds.
HARNESS = "harness:collective"


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """In-place all-reduce of a tensor on the run's device, whenever a group exists: a world of one
    still reduces, so a single-GPU machine exercises the same nccl path as a multi-GPU one. group:
    a subgroup (tensor parallelism: the data-parallel ranks), else every rank."""
    if not grouped():
        return tensor
    with torch.profiler.record_function(HARNESS):
        dist.all_reduce(tensor, op=op, group=group)
        if tensor.device.type == "cuda":  # NCCL is asynchronous: its kernel must run inside the range too
            torch.cuda.current_stream(tensor.device).synchronize()
    return tensor


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) on every rank of a data-parallel run. DDP
    broadcasts them before every forward (broadcast_buffers=True, distributed.py
    _sync_buffers); FSDP2 and DeepSpeed do not, so each rank keeps the statistics of its own
    batches, and an evaluation where each rank scores its shard of the test set would score a mix
    of models, none of them the one saved (rank 0's state_dict)."""
    if not grouped() or dist.get_world_size() == 1:
        return
    with torch.profiler.record_function(HARNESS):
        for buf in module.buffers():
            dist.broadcast(buf.data, src=0)


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable `obj`, in rank order. On nccl the pickled bytes travel as a tensor on
    torch.cuda.current_device() (distributed_c10d.py all_gather_object: `current_device =
    _get_object_coll_device(group)`), so the caller must have set its device, as the runner does."""
    if not grouped():
        return [obj]
    parts = [None] * dist.get_world_size(group)
    with torch.profiler.record_function(HARNESS):
        dist.all_gather_object(parts, obj, group=group)
    return parts


def reduce_tensor(values, device: torch.device, op: str = "sum") -> tuple[torch.Tensor, torch.Tensor]:
    """(reduced values, ranks that measured each) as float64 tensors on `device`. NaN means "not
    measured on this rank": it is left out of max, sum and mean instead of poisoning them."""
    t = torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float64, device=device)
    present = (~torch.isnan(t)).to(torch.float64)
    filled = torch.where(present.bool(), t, torch.full_like(t, -math.inf if op == "max" else 0.0))
    all_reduce(filled, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    all_reduce(present)
    if op == "mean":
        filled = filled / present.clamp(min=1)
    return filled, present


def reduce_metrics(values: dict, device: torch.device, op: str = "max") -> dict:
    """{name: float or None} reduced over ranks with op (max, sum or mean); None where no rank measured."""
    if not values:
        return {}
    reduced, present = reduce_tensor(list(values.values()), device, op)
    if reduced.device.type == "meta":  # values this process cannot read (the tests' stand-in for a GPU)
        return dict.fromkeys(values)
    return {k: (v if n > 0 else None) for k, v, n in zip(values, reduced.tolist(), present.tolist())}


def synchronize(device: torch.device | list[torch.device]) -> None:
    """Waits for the device's queued work (a no-op on CPU, where work is synchronous); a list: every device
    one process drives (model parallelism: the second half's optimizer step can still run on its GPU when
    the first's is done)."""
    for d in device if isinstance(device, list) else [device]:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def barrier() -> None:
    if grouped():
        dist.barrier()


# --- who writes the row of a run that failed ---

def restarts() -> int:
    """How many times torchrun has restarted this worker group (TORCHELASTIC_RESTART_COUNT)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restart_pending() -> bool:
    """True when torchrun will restart the group after this attempt fails (--max-restarts not used
    up): the failure is not the run's end, so it writes no row; the final attempt writes the one."""
    return restarts() < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)


def claim_failure_row() -> bool:
    """Whether this rank writes the row of a run that failed.

    A failure can start on any rank: an OOM on rank 3 leaves rank 0 blocked in a collective until
    the launcher kills it, so rank 0 alone cannot record it. The first rank to fail claims the row
    with an atomic add on the process group's store (the TCPStore every rank already shares); a
    rank that fails later, typically because its peer is gone, finds the claim taken and writes
    nothing, so the run keeps exactly one row and it names the first cause. Without a group, or
    when the store cannot be reached, rank 0 writes as usual."""
    if not grouped() or dist.get_world_size() == 1:
        return global_rank() == 0
    try:
        import datetime

        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=10))
        return store.add(f"bench/failure_row/{restarts()}", 1) == 1
    except Exception:
        return global_rank() == 0


@contextlib.contextmanager
def fsdp_no_sync(model):
    """--grad-accum under FSDP2: the micro-batches before the last keep unsharded gradients and
    reduce-scatter nothing, as DDP's no_sync (FSDP2's set_requires_gradient_sync, which accelerate's
    no_sync calls). pytorch_FSDP.py, and pytorch_TP.py over its dp ranks."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
