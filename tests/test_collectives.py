"""The one rule for collectives: every metric tensor lives on the run's device.

An nccl group serves only CUDA tensors; its CPU twin is a "cuda:gloo" group, which has no backend
for CPU tensors either ("No backend type associated with device type cpu") but runs here. The
metric helpers are given the "meta" device, the stand-in for a device whose tensors are not on
the CPU: they must complete under that group, and the same call on the CPU device must fail (so
the group really is strict). A source scan keeps every collective of common/ inside these helpers.
"""
import functools
import os
import re

import pytest
import torch
from helpers import spawn_ranks

from common.distributed import claim_failure_row, gloo_on_loopback_when_one_node, reduce_metrics, restart_pending

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank, world, port, queue, spec):
    import torch.distributed as dist

    from common.measure.probes import Probes

    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group(spec, rank=rank, world_size=world, store=store)
        out = {}
        meta = torch.device("meta")
        out["metrics_on_meta"] = reduce_metrics({"a": 1.0, "b": None}, meta, "max")
        probes = Probes([torch.device("cpu")], meta)  # a CPU-only process reporting through the run's device
        probes.start()
        probes.stop()
        out["probes_on_meta"] = probes.row()
        try:
            reduce_metrics({"a": 1.0}, torch.device("cpu"), "max")
            out["cpu"] = "no error"
        except RuntimeError as exc:
            out["cpu"] = str(exc)
        out["claim"] = claim_failure_row()
        dist.destroy_process_group()
        queue.put((rank, out))
    except Exception as exc:  # reported to the test, not swallowed
        queue.put((rank, {"error": repr(exc)}))


def run_group(spec: str, world: int = 2) -> dict:
    return spawn_ranks(functools.partial(_worker, spec=spec), world)


@pytest.fixture(scope="module")
def cuda_only_group():
    return run_group("cuda:gloo")


@pytest.mark.slow  # spawns a gloo group of 2 processes (helpers.spawn_ranks)
def test_helpers_follow_the_device_they_are_given(cuda_only_group):
    for out in cuda_only_group.values():
        assert "error" not in out, out
        assert out["metrics_on_meta"] == {"a": None, "b": None}  # completed; meta values are unreadable
        assert set(out["probes_on_meta"]) >= {"peak_allocated_gib", "gpu_util_mean"}


@pytest.mark.slow  # spawns a gloo group of 2 processes (helpers.spawn_ranks)
def test_the_twin_group_rejects_cpu_tensors(cuda_only_group):
    """What the defect did (metric tensors built on the CPU under nccl) fails under the twin."""
    for out in cuda_only_group.values():
        assert "No backend type associated with device type cpu" in out["cpu"]


@pytest.mark.slow  # spawns a gloo group of 2 processes (helpers.spawn_ranks)
def test_one_rank_claims_a_failed_runs_row(cuda_only_group):
    assert sorted(out["claim"] for out in cuda_only_group.values()) == [False, True]


def test_gloo_talks_over_loopback_only_on_one_node():
    """One node (the launcher's local world is the world): loopback, which reaches every peer whatever
    the hostname resolves to. Several nodes, no launcher, or an interface the user named: untouched."""
    one = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert gloo_on_loopback_when_one_node(one) and one["GLOO_SOCKET_IFNAME"] == "lo"
    ds = {"WORLD_SIZE": "2", "LOCAL_SIZE": "2"}  # DeepSpeed's launcher
    assert gloo_on_loopback_when_one_node(ds) and ds["GLOO_SOCKET_IFNAME"] == "lo"
    for env in ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, {"WORLD_SIZE": "2"},
                {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "eth0"}):
        before = dict(env)
        assert not gloo_on_loopback_when_one_node(env) and env == before


def test_reduce_metrics_without_a_group():
    cpu = torch.device("cpu")
    assert reduce_metrics({"x": 2.5, "y": None}, cpu, "max") == {"x": 2.5, "y": None}
    assert reduce_metrics({"x": 2.5}, cpu, "mean") == {"x": 2.5}


def test_restart_pending_reads_torchelastic(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    assert restart_pending()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not restart_pending()
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS")
    assert not restart_pending()


def test_no_collective_outside_the_helpers():
    """Every collective in common/ and the scripts goes through common/distributed.py's helpers
    (or a library's own: DDP, FSDP, DeepSpeed, accelerate), never a hand-built dist.* call."""
    pattern = re.compile(r"\bdist\.(all_reduce|all_gather|reduce_scatter|broadcast|reduce|all_to_all)\w*\(")
    offenders, scanned = [], set()
    for folder, _, files in os.walk(ROOT):
        parts = os.path.relpath(folder, ROOT).split(os.sep)  # the checkout's own folders, not where it lies
        if set(parts) & {".venv", "tests", ".git", "results"} or parts[0] == "shared":  # shared: others' code a
            continue                                                                   # lease carries (fetch_peer.sh)
        for name in files:
            path = os.path.join(folder, name)
            # the helpers themselves, and the benchmark whose subject is the raw collectives
            own = (os.path.join(ROOT, "common", "distributed.py"), os.path.join(ROOT, "benchmarks", "collectives.py"))
            if name.endswith(".py") and path not in own:
                scanned.add(os.path.relpath(path, ROOT))
                with open(path) as fh:
                    offenders += [f"{path}:{i}" for i, line in enumerate(fh, 1) if pattern.search(line)]
    assert offenders == []
    assert {"pytorch_DDP.py", "accelerate_FSDP.py", os.path.join("common", "train.py"),
            os.path.join("common", "measure", "comm.py")} <= scanned, sorted(scanned)


def _eval_worker(rank, world, port, queue):
    import torch.distributed as dist
    import torch.nn as nn

    from common.train import TrainHooks, run_eval

    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
        model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 3))
        with torch.no_grad():  # statistics of each rank's own batches, as FSDP2 and DeepSpeed leave them
            model[0].running_mean.fill_(float(rank + 1))
            model[0].running_var.fill_(float(rank + 2))
        loader = [(torch.randn(5, 4), torch.randint(0, 3, (5,)), torch.ones(5, dtype=torch.bool))]
        acc, n = run_eval(model, loader, TrainHooks(lambda loss: None, lambda: None, torch.device("cpu")), False)
        queue.put((rank, {"mean": model[0].running_mean.tolist(), "var": model[0].running_var.tolist(), "n": n}))
        dist.destroy_process_group()
    except Exception as exc:
        queue.put((rank, {"error": repr(exc)}))


@pytest.mark.slow
def test_evaluation_scores_rank_zeros_statistics_on_every_rank():
    """Each rank scores its shard of the test set: with per-rank BatchNorm statistics (FSDP2 and
    DeepSpeed do not broadcast buffers as DDP does) the accuracy would mix models, none of them the
    saved one (rank 0's). run_eval gives every rank rank 0's buffers first."""
    got = spawn_ranks(_eval_worker)
    for rank in (0, 1):
        assert got[rank] == {"mean": [1.0] * 4, "var": [2.0] * 4, "n": 10}, got
