"""CUDA-only decisions checked on CPU against fakes of what torch.cuda and NVML return: the device
a rank picks, the process-group backend, the NVML handle and memory query, the fingerprint."""
import os
import time
import types

import pytest
import torch

from common.config import TrainConfig, UsageError
from common.distributed import NODE_LOCAL_RANK, backend_for, device_for_rank, local_rank, pick_device
from common.measure import fingerprint as fp
from common.measure import probes


def fake_cuda(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_one_visible_gpu_per_process_uses_cuda0(monkeypatch):
    """Slurm --gpus-per-task=1: LOCAL_RANK 3 sees its one GPU as device 0."""
    fake_cuda(monkeypatch, 1)
    assert pick_device(TrainConfig(), 3) == torch.device("cuda", 0)


def test_local_rank_beyond_several_visible_gpus_is_refused(monkeypatch):
    fake_cuda(monkeypatch, 2)
    assert pick_device(TrainConfig(), 1) == torch.device("cuda", 1)
    with pytest.raises(UsageError, match="LOCAL_RANK 3 but only 2 GPUs"):
        pick_device(TrainConfig(), 3)


@pytest.mark.parametrize("var, count, visible", [("LOCAL_WORLD_SIZE", 4, 2), ("LOCAL_WORLD_SIZE", 2, 1),
                                                  ("LOCAL_SIZE", 8, 4)])
def test_more_local_ranks_than_visible_gpus_is_refused_before_nccl(monkeypatch, var, count, visible):
    """torchrun --nproc-per-node 4 on 2 GPUs (LOCAL_WORLD_SIZE; the deepspeed launcher's LOCAL_SIZE): every
    rank sees the same GPUs, so two would share one and NCCL would fail later with "Duplicate GPU
    detected". Refused in one line by the rank whose LOCAL_RANK still fits, before any group forms."""
    fake_cuda(monkeypatch, visible)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv(var, str(count))
    with pytest.raises(UsageError, match=f"{count} processes on this node .* but {visible} GPU"):
        pick_device(TrainConfig(), 0)


def test_local_rank_is_made_the_index_of_the_device_picked(monkeypatch):
    """A process that sees one GPU (its own CUDA_VISIBLE_DEVICES) as cuda:0 with LOCAL_RANK 3: DeepSpeed's
    engine would set_device(3) and accelerate barrier on device 3 ("invalid device ordinal"). LOCAL_RANK
    becomes 0; local_rank() still says 3 (the launcher's index: which rank of the node downloads)."""
    fake_cuda(monkeypatch, 1)
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(NODE_LOCAL_RANK, "0")  # so that the one device_for_rank sets is undone after the test
    monkeypatch.delenv(NODE_LOCAL_RANK)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device_for_rank(TrainConfig()) == torch.device("cuda", 0)
    assert os.environ["LOCAL_RANK"] == "0" and local_rank() == 3
    fake_cuda(monkeypatch, 4)  # four visible GPUs: LOCAL_RANK 2 is cuda:2 already, nothing to change
    monkeypatch.delenv(NODE_LOCAL_RANK)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert device_for_rank(TrainConfig()) == torch.device("cuda", 2) and os.environ["LOCAL_RANK"] == "2"
    assert NODE_LOCAL_RANK not in os.environ  # no launcher's index to keep aside: the two agree


def test_cpu_offload_gets_a_cpu_backend_beside_nccl():
    cuda = torch.device("cuda", 0)
    assert backend_for(types.SimpleNamespace(backend="auto"), cuda) == "nccl"
    assert backend_for(types.SimpleNamespace(backend="auto", cpu_offload=True), cuda) == "cuda:nccl,cpu:gloo"
    assert backend_for(types.SimpleNamespace(backend="auto", cpu_offload=True), torch.device("cpu")) == "gloo"
    with pytest.raises(UsageError, match="nccl needs CUDA"):
        backend_for(types.SimpleNamespace(backend="nccl"), torch.device("cpu"))


class FakeNVML:
    """pynvml as a MIG instance shows it: only its MIG- UUID is known, and the memory query has a
    v1 form (used includes driver-reserved memory) and a v2 form (it does not)."""
    NVMLError = RuntimeError
    nvmlMemory_v2 = 0x02000028

    def __init__(self, known):
        self.known = known

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.known:
            raise self.NVMLError("not found")
        return f"handle:{uuid}"

    def nvmlDeviceGetHandleByIndex(self, index):
        raise AssertionError("the CUDA index is not NVML's index under CUDA_VISIBLE_DEVICES")

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        return types.SimpleNamespace(used=5 if version == self.nvmlMemory_v2 else 7)


@pytest.fixture
def uuid(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid="abc-123"))
    return "abc-123"


@pytest.mark.parametrize("known, found", [({"GPU-abc-123"}, "GPU-abc-123"), ({"MIG-abc-123"}, "MIG-abc-123"),
                                          (set(), None)])
def test_nvml_handle_by_uuid_never_by_index(monkeypatch, uuid, known, found):
    fake = FakeNVML(known)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    lib, handle = probes.nvml_handle(torch.device("cuda", 1))
    assert handle == (f"handle:{found}" if found else None)


def test_nvml_memory_uses_the_v2_query():
    assert probes.nvml_used_bytes(FakeNVML(set()), "h") == 5


def test_the_gpu_probes_read_nothing_after_the_window_and_no_idle_before_it(monkeypatch):
    """CPU twin of the CUDA probes (common/measure/probes.py) with fake counters: the last epoch's checkpoint
    save and evaluation come after its pause and before stop(); neither their allocator peak nor their NVML
    memory counts. The utilization thread's first sample waits an interval (here longer than the window): the
    only sample is the one taken as the window pauses, not one at its opening describing the idle before it."""
    state = {"peak": 0, "used": 0, "util": 0.0}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: state.update(peak=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: state["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: state["peak"])

    class NVML(FakeNVML):
        def nvmlDeviceGetUtilizationRates(self, handle):
            return types.SimpleNamespace(gpu=state["util"])

        def nvmlDeviceGetMemoryInfo(self, handle, version=None):
            return types.SimpleNamespace(used=state["used"])

    p = probes.Probes([], torch.device("cpu"), interval_s=60.0)
    p.devices, p.pynvml, p.handles = [torch.device("cuda", 0)], NVML(set()), ["h"]
    p.start()  # the window opens on an idle GPU
    time.sleep(0.05)  # a sampler that reads at the opening has done so by now
    state.update(peak=5 << 30, used=6 << 30, util=90.0)  # the timed steps
    p.pause()  # the last epoch's end
    state.update(peak=9 << 30, used=10 << 30, util=10.0)  # its checkpoint save and final evaluation
    p.stop()
    assert (p.alloc_peak, p.reserved_peak, p.nvml_peak) == (5 << 30, 5 << 30, 6 << 30)
    assert p.util_samples == [90.0]


def test_fingerprint_empty_where_it_does_not_apply():
    import deepspeed  # noqa: F401  (loaded, but this script does not train with it)

    row = fp.fingerprint(torch.device("cpu"), libraries=("accelerate",))
    assert all(row[k] is None for k in ("cuda_version", "cudnn_version", "nccl_version", "driver_version"))
    assert row["deepspeed_version"] is None
    assert fp.fingerprint(torch.device("cpu"), libraries=("deepspeed",))["deepspeed_version"]
