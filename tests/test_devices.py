"""CUDA-only decisions checked on CPU against fakes of what torch.cuda and NVML return: the device
a rank picks, the process-group backend, the NVML handle and memory query, the fingerprint."""
import types

import pytest
import torch

from common.config import TrainConfig, UsageError
from common.distributed import backend_for, pick_device
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


def test_fingerprint_empty_where_it_does_not_apply():
    import deepspeed  # noqa: F401  (loaded, but this script does not train with it)

    row = fp.fingerprint(torch.device("cpu"), libraries=("accelerate",))
    assert all(row[k] is None for k in ("cuda_version", "cudnn_version", "nccl_version", "driver_version"))
    assert row["deepspeed_version"] is None
    assert fp.fingerprint(torch.device("cpu"), libraries=("deepspeed",))["deepspeed_version"]
