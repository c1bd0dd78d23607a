"""Communication recording (common/measure/comm.py) and world-size scaling (benchmark.py --world-sizes).

On CPU, 2 gloo ranks, resnet18 with the 10-class head, fp32: every strategy's measured bytes per
step against the volume its algorithm must send (docs/communication.md)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers import ROOT, TINY, check_ok, clean_env, free_port, rows

from common.bench.matrix import tool
from common.config import TrainConfig
from common.measure.comm import CommRecorder, analyze
from common.measure.stepparts import StepParts
from common.measure.steptime import StepTimes
from common.predict.volume import expected_bytes
from common.train import TrainHooks, build_instruments

RESNET18_PARAMS = 11_181_642  # torchvision resnet18 with a 10-class fc
FAST = {"loader_probe_batches": 0, "epoch_checkpoints": False}  # nothing these tests read


class Event(SimpleNamespace):
    """Stand-in for torch's _KinetoEvent (the accessors analyze() reads)."""

    def name(self): return self.n  # noqa: E704
    def shapes(self): return self.s  # noqa: E704
    def dtypes(self): return self.d  # noqa: E704
    def start_ns(self): return self.t  # noqa: E704
    def duration_ns(self): return self.dur  # noqa: E704
    def start_thread_id(self): return self.th  # noqa: E704
    def extra_meta(self): return getattr(self, "meta", {})  # noqa: E704
    def device_type(self):  # noqa: E301
        import torch
        return torch.autograd.DeviceType.CUDA if getattr(self, "cuda", False) else torch.autograd.DeviceType.CPU


def ev(n, t, dur, th=1, s=(), d=()):
    return Event(n=n, t=t, dur=dur, th=th, s=list(s), d=list(d))


def test_analyze_counts_backend_events_once():
    """The dispatcher op wrapping a collective is not counted again; an all-gather counts its output;
    overlap is the comm time during which a training-thread op ran."""
    events = [
        ev("c10d::allreduce_", 0, 10, s=[[]], d=["TensorList"]),
        ev("gloo:all_reduce", 0, 1000, th=7, s=[[1000]], d=["float"]),  # 4000 bytes
        ev("c10d::_allgather_base_", 2000, 10, s=[[200], [100]], d=["float", "float"]),
        ev("gloo:all_gather", 2000, 1000, th=8, s=[[100]], d=["c10::BFloat16"]),  # 100 x 2 B x 2 ranks
        ev("aten::mm", 500, 1000),  # overlaps the all-reduce by 500 ns
        ev("aten::add_", 2000, 1000, th=7),  # on a gloo worker: not compute
        ev("nccl:coalesced", 5000, 10),
    ]
    got = analyze(events, n=2, steps=2)
    assert got["comm_bytes_per_step"] == (4000 + 400) / 2 and got["comm_calls_per_step"] == 1.0
    assert got["comm_ms_per_step"] == 2000 / 1e6 / 2
    assert got["busbw_gbps"] == pytest.approx((4000 * 1.0 + 400 * 0.5) / 2000)
    assert got["comm_overlap_pct"] == 25.0


def test_analyze_leaves_the_harness_collectives_out():
    """The metric all-reduces of a --log-every step run inside the harness's range: not the strategy's."""
    from common.distributed import HARNESS

    strategy = ev("gloo:all_reduce", 0, 1000, th=7, s=[[1000]], d=["float"])
    harness = [ev(HARNESS, 3000, 500), ev("c10d::allreduce_", 3010, 10, s=[[]], d=["TensorList"]),
               ev("gloo:all_reduce", 3020, 400, th=7, s=[[4]], d=["double"])]
    got = analyze([strategy, *harness], n=2, steps=1)
    assert got["comm_calls_per_step"] == 1.0 and got["comm_bytes_per_step"] == 4000
    assert analyze([strategy, *harness[1:]], n=2, steps=1)["comm_calls_per_step"] == 2.0  # no range: counted


def ddp_calls_per_step(steps: int, rebuild_in_window: bool) -> float:
    """pytorch_DDP.py's collectives per profiled step (resnet18): what the step model prices, one all-reduce
    per gradient bucket and one broadcast per buffer dtype (BatchNorm's float statistics, its int64 batch
    counts: DDP's broadcast_buffers=True before every forward), plus, once, the two broadcasts of the
    rebuilt bucket order (sizes, indices) in the second iteration's forward (Reducer::sync_bucket_indices),
    which it leaves out."""
    from common.predict.memory import Setup
    from common.predict.timemodel import Compute, Link, predict_step

    ddp = Setup(model="resnet18", image_size=32, batch_size=16, world_size=2, strategy="ddp")
    calls = predict_step(ddp, Compute(10.0, 20.0, 5.0), Link(), overlap=False).calls
    return calls + (2 / steps if rebuild_in_window else 0)


@pytest.mark.slow
@pytest.mark.launches("pytorch_DDP-fp32", "pytorch_DDP-fp32-log1")
def test_ddp_calls_per_step_do_not_change_with_log_every(runs):
    """The harness's non-finite check all-reduces at every --log-every step, inside the profiled ones:
    --log-every 1 gives the calls of --log-every 0 (test_scripts' DDP run), one all-reduce per bucket,
    2 buffer broadcasts, and the bucket rebuild's 2 broadcasts once in the 3 profiled steps."""
    import torchvision
    from test_guards import ddp_buckets

    quiet, logged = (r.row for r in runs)
    assert ddp_buckets(torchvision.models.resnet18(num_classes=10)) + 2 == ddp_calls_per_step(3, False)
    want = round(ddp_calls_per_step(3, rebuild_in_window=True), 3)
    assert float(quiet["comm_calls_per_step"]) == float(logged["comm_calls_per_step"]) == want == 5.667


@pytest.mark.slow
@pytest.mark.launches("pytorch_FSDP-fp32-accum2")
def test_fsdp_accumulation_gathers_per_micro_batch_and_reduces_once(runs):
    """--grad-accum 2: full shard gathers the weights twice per micro-batch (4x), reduce-scatters once;
    without set_requires_gradient_sync(False) it would reduce-scatter twice (24 B/param, not 20)."""
    (run_,) = runs
    check_ok(run_.proc)
    r = run_.row
    assert r["grad_accum"] == "2" and r["world_size"] == "2"
    assert expected_bytes(r["strategy"], r["precision"], RESNET18_PARAMS, 2) == 20 * RESNET18_PARAMS
    assert float(r["comm_bytes_per_step"]) == pytest.approx(20 * RESNET18_PARAMS, rel=0.10)


def test_recording_follows_comm_steps(monkeypatch):
    """--comm-steps 0 turns it off; the default records wherever there is a process group: n ranks, or a
    distributed script on one process (whose collectives still run); a single-device script has none."""
    import torch

    import common.train as train

    hooks = TrainHooks(backward=lambda loss: None, step=lambda: None, device=torch.device("cpu"))
    monkeypatch.setattr(train, "Flops", lambda *args: None)  # its FLOP count and matmul probe are not the subject
    built = lambda cfg: build_instruments(cfg, None, hooks, train.Metrics())  # noqa: E731
    parts = lambda got: next(i for i in got if isinstance(i, StepParts))  # noqa: E731
    for world in (2, 1):
        monkeypatch.setattr(train, "world_size", lambda: world)
        monkeypatch.setattr(train, "grouped", lambda: True)
        got = built(TrainConfig())
        assert CommRecorder in [type(i) for i in got] and StepTimes in [type(i) for i in got], world
        assert parts(got).comm is next(i for i in got if isinstance(i, CommRecorder))  # its exposed share
        off = built(TrainConfig(comm_steps=0))
        assert not any(isinstance(i, CommRecorder) for i in off), world
        assert parts(off).comm.exposed_ms_per_step() is None, world  # not measured: the column stays empty
    assert train.communicates(torch.device("cpu")) and not train.communicates(torch.device("cuda"))  # NCCL: 1 rank
    monkeypatch.setattr(train, "world_size", lambda: 2)
    assert train.communicates(torch.device("cuda"))
    monkeypatch.setattr(train, "grouped", lambda: False)
    assert not train.communicates(torch.device("cpu"))
    got = built(TrainConfig())
    assert not any(isinstance(i, CommRecorder) for i in got) and parts(got).comm is None  # nothing communicates


def test_expected_volumes():
    b = 4 * RESNET18_PARAMS
    assert expected_bytes("ddp", "fp32", RESNET18_PARAMS) == b
    assert expected_bytes("ddp", "amp_bf16", RESNET18_PARAMS) == b  # fp32 gradients under autocast
    assert expected_bytes("ddp_zero", "fp32", RESNET18_PARAMS) == 2 * b
    assert expected_bytes("fsdp_full-shard_offload", "fp32", RESNET18_PARAMS) == 3 * b
    assert expected_bytes("deepspeed_zero2", "ds_bf16", RESNET18_PARAMS) == b  # 2x of half-size elements
    assert expected_bytes("ddp", "pure_fp16", RESNET18_PARAMS) == b / 2  # half gradients
    assert expected_bytes("fsdp_full-shard", "mp_bf16", RESNET18_PARAMS) == 2 * b  # 2 bf16 gathers + fp32 reduce
    assert expected_bytes("accelerate_ddp", "bf16", RESNET18_PARAMS) == b  # accelerate's autocast: fp32 gradients
    assert expected_bytes("accelerate_fsdp", "bf16", RESNET18_PARAMS) == 1.5 * b  # everything in bf16
    assert expected_bytes("fsdp_hybrid", "fp32", RESNET18_PARAMS) is None


@pytest.mark.slow
@pytest.mark.parametrize("launch, factor", [
    ("pytorch_FSDP-fp32", 3.0),  # all-gather x2 + reduce-scatter
    ("pytorch_FSDP-bf16", 2.0),  # the gathers in bf16, the reduce-scatter in fp32
    ("pytorch_DDP_ZeRO-fp32", 2.0),  # all-reduce + broadcast of the shards
    ("pytorch_DeepSpeed-launcher", 2.0),  # ZeRO-2: reduce the gradients + all-gather the weights
    ("pytorch_DeepSpeed-bf16", 1.0),  # the same in bf16 (ZeRO-2 JSON)
])
@pytest.mark.launches("{launch}")
def test_sharded_strategies_send_their_expected_volume(runs, launch, factor):
    import torchvision

    r = runs[0].row
    assert r["comm_calls_per_step"] and float(r["comm_ms_per_step"]) > 0 and float(r["busbw_gbps"]) > 0
    assert r["skipped_steps"] in ("", "0"), r["skipped_steps"]  # a skipped step sends less: not this test's volume
    params = sum(p.numel() for p in getattr(torchvision.models, r["model"])(num_classes=10).parameters())
    assert expected_bytes(r["strategy"], r["precision"], params) == factor * 4 * params
    assert float(r["comm_bytes_per_step"]) == pytest.approx(factor * 4 * params, rel=0.10), (r["strategy"], r["model"])


@pytest.mark.slow
@pytest.mark.launches("pytorch_DeepSpeed-fp32")
def test_zero3_rows_count_the_collectives_the_model_prices(runs):
    """DeepSpeed ZeRO-3 (the shipped JSON, resnet18, 3 ranks) issues per step what the step model prices:
    the forward's weights in one coalesced all-gather (stage3_prefetch_bucket_size, 5e7 elements, holds
    its 11.4M), one bucket of gradients reduce-scattered, the norm's all-reduce, and each of the 50 weights
    under stage3_param_persistence_threshold gathered in a call of its own after the step (stage3.py
    _post_step): 50 calls, not one."""
    from common.predict.memory import Setup
    from common.predict.timemodel import Compute, Link, predict_step

    r = runs[0].row
    assert r["strategy"] == "deepspeed_zero3", r["strategy"]
    with open(os.path.join(ROOT, "config", "zero_stage3_config.json")) as f:
        zero = json.load(f)["zero_optimization"]
    s = Setup(model=r["model"], image_size=int(r["image_size"]), batch_size=int(r["global_batch_size"]),
              world_size=int(r["world_size"]), strategy="deepspeed_zero3", zero=zero)
    calls = predict_step(s, Compute(10.0, 20.0, 5.0), Link(), overlap=False).calls
    assert calls == 53
    # the profiled steps (TINY: after 1 warm-up step) are DeepSpeed's second to fourth. The second's forward
    # completes the trace the first recorded, and partitioned_param_coordinator.reset_step checks it across
    # ranks: 3 assert_ints_same_as_other_ranks, 2 broadcasts each (zero/utils.py). From the third on, 53
    # (a bare engine at 2 and 3 ranks: 136, 59, 53, 53 calls in its first four steps)
    got = float(r["comm_calls_per_step"])
    assert got == pytest.approx((calls + 6 + 2 * calls) / 3, abs=1e-3), got


def test_world_size_runs_names_batches_and_cap(capsys):
    from common.bench.matrix import world_size_runs
    from common.config import UsageError

    runs = [{"name": "p/pytorch_DDP", "script": "pytorch_DDP.py", "args": {"batch_size": 32, "train_samples": 64},
             "nproc": 2}, {"name": "p/pytorch_SingleGPU", "script": "pytorch_SingleGPU.py", "args": {}, "nproc": 1}]
    strong = world_size_runs(runs, "1,2,4", "strong", gpus=0)
    assert [(r["name"], r["nproc"], r["args"].get("batch_size")) for r in strong] == [
        ("p/pytorch_DDP@w1", 1, 32), ("p/pytorch_DDP@w2", 2, 32), ("p/pytorch_SingleGPU", 1, None)]
    assert "4 left out" in capsys.readouterr().out
    weak = world_size_runs(runs, "2,4", "weak", gpus=4)
    assert [(r["name"], r["args"]["batch_size"], r["args"]["train_samples"], r["args"]["scaling"])
            for r in weak[:2]] == [("p/pytorch_DDP@w2-weak", 64, 128, "weak"),
                                   ("p/pytorch_DDP@w4-weak", 128, 256, "weak")]
    for bad in ("two", "0,2", "8"):
        with pytest.raises(UsageError):
            world_size_runs(runs, bad, "strong", gpus=4)


def test_a_pipeline_never_runs_on_more_ranks_than_its_stages(capsys):
    """pytorch_PP.py has one stage per rank and ResNet 4 stages (registry max_processes): scaling
    curves and Slurm jobs leave the larger counts out instead of writing a failed row."""
    from common.bench.matrix import world_size_runs
    from common.bench.slurm import layout

    pp = {"name": "p/pytorch_PP", "script": "pytorch_PP.py", "args": {}, "nproc": 2}
    assert [r["nproc"] for r in world_size_runs([pp], "1,2,4,8", "strong", gpus=8)] == [1, 2, 4]
    assert "p/pytorch_PP left out at 8 processes" in capsys.readouterr().out
    assert layout(pp, nodes=2, gpus_per_node=8) == (2, 2)
    assert layout(pp, nodes=1, gpus_per_node=2) == (1, 2)
    assert layout({**pp, "script": "pytorch_DDP.py"}, nodes=2, gpus_per_node=8) == (2, 8)


@pytest.mark.beside
@pytest.mark.slow
def test_world_sizes_rows_ddp_volume_and_efficiency(tmp_path):
    """--world-sizes 1,2: a row per world size for the distributed run (named apart, so neither is
    skipped as done), DDP's all-reduce is 4 bytes x parameters, and the report shows the efficiency."""
    matrix = tmp_path / "m.yaml"
    args = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in {**TINY, **FAST}.items()
                     if k != "device")
    matrix.write_text(f"presets:\n  t:\n    timeout_s: 300\n    args: {{{args}}}\n    scripts: all\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "benchmark.py", "--preset", "t", "--matrix", str(matrix), "--only",
                           "pytorch_DDP.py", "--world-sizes", "1,2,4", "--results", str(tmp_path / "summary.csv"),
                           "--report", str(tmp_path / "REPORT.md"), "--log-dir", str(tmp_path / "logs"),
                           "--save-dir", str(tmp_path / "ckpt")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 left out" in proc.stdout
    got = {r["world_size"]: r for r in rows(tmp_path / "summary.csv")}
    assert sorted(got) == ["1", "2"] and all(r["status"] == "ok" and r["scaling"] == "strong" for r in got.values())
    assert {r["run_name"] for r in got.values()} == {"t/pytorch_DDP@w1", "t/pytorch_DDP@w2"}
    assert got["1"]["comm_bytes_per_step"] == ""  # one process sends nothing
    assert float(got["2"]["comm_bytes_per_step"]) == pytest.approx(4 * RESNET18_PARAMS, rel=0.02)
    report = (tmp_path / "REPORT.md").read_text()
    assert "## Scaling" in report and "efficiency %" in report and "| ddp | fp32 | 2 |" in report
    assert "measured/expected" in report
    assert any(c.startswith("scaling_") for c in os.listdir(tmp_path / "charts"))


@pytest.mark.slow
@pytest.mark.parametrize("cold", [[], ["--cold", "--meet"]])  # what calibrate times on a CPU
def test_collectives_benchmark_runs(cold, tmp_path):
    out = tmp_path / "c.json"
    proc = subprocess.run([*tool("torchrun"), "--nproc_per_node", "2",
                           "--master_port", str(free_port()), "benchmarks/collectives.py", "--device", "cpu",
                           "--min-bytes", "64K", "--max-bytes", "64K", "--iters", "1", "--warmup", "1", *cold,
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()[2:]
    assert [ln.split()[0] for ln in lines] == ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send",
                                              *(["meeting:"] if cold else [])]
    got = json.loads(out.read_text())
    assert ("meet_ms" in got) == bool(cold)
    if cold:  # what a meeting adds beyond the aligned call, clamped at 0 (_meet): 0 where the two are alike
        printed = float(lines[-1].split()[1])
        assert 0 <= got["meet_ms"] < 1000 and printed == pytest.approx(got["meet_ms"], abs=6e-4), (printed, got)


def test_a_sub_group_gather_counts_its_own_group():
    """--sharding hybrid on 8 ranks, 4 per node: FSDP gathers within the 4-rank shard group. The
    dispatcher's record (output 40, input 10) says so; without it the world size is assumed."""
    gather = [ev("c10d::_allgather_base_", 0, 10, s=[[40], [10], [], [], []], d=["float"] * 2),
              ev("gloo:all_gather", 5, 1000, th=7, s=[[10]], d=["float"])]
    got = analyze(gather, n=8, steps=1)
    assert got["comm_bytes_per_step"] == 40 * 4 and got["busbw_gbps"] == pytest.approx(160 * 3 / 4 / 1000)
    assert analyze(gather[1:], n=8, steps=1)["comm_bytes_per_step"] == 80 * 4


def test_a_sub_group_all_reduce_on_nccl_has_its_group_s_bus_factor():
    """pytorch_TP.py at tp 2 x dp 4 on 8 GPUs: the tp all-reduces run on 2-rank groups. NCCL's
    record_param_comms gives each call's group size; the bus factor is 2(g-1)/g of that group (1.0), not of
    the world (1.75). A record that matches no nccl: event leaves the world size in place; gloo has none."""
    def comms(name, nelems, group, t):
        e = ev("record_param_comms", t, 5)
        e.meta = {"Collective name": f'"{name}"', "In msg nelems": nelems, "Group size": group, "dtype": '"Float"'}
        return e

    def kernel(t):  # the NCCL kernel on the device: the collective's time
        return Event(n="ncclDevKernel_Generic", t=t, dur=1000, th=9, s=[], d=[], cuda=True)

    tp = [comms("allreduce", 1000, 2, 0), ev("nccl:all_reduce", 10, 5, s=[[1000]], d=["float"]), kernel(20),
          comms("_reduce_scatter_base", 800, 4, 2000), ev("nccl:_reduce_scatter_base", 2010, 5, s=[[800]],
                                                           d=["float"]), kernel(2020)]
    got = analyze(tp, n=8, steps=1)
    assert got["comm_bytes_per_step"] == 4000 + 3200  # the reduce-scatter's S is its input
    assert got["busbw_gbps"] == pytest.approx((4000 * 1.0 + 3200 * 3 / 4) / 2000)
    world = [ev("nccl:all_reduce", 10, 5, s=[[1000]], d=["float"]), kernel(20), comms("allreduce", 999, 2, 0)]
    assert analyze(world, n=8, steps=1)["busbw_gbps"] == pytest.approx(4000 * 1.75 / 1000)
    assert analyze(tp[1:3], n=8, steps=1)["busbw_gbps"] == pytest.approx(4000 * 1.75 / 1000)


def test_nccl_point_to_point_in_a_coalesced_batch_is_counted_from_its_param_comms():
    """A pipeline step on NCCL: batch_isend_irecv coalesces, so no nccl:send/recv event exists, only
    record_param_comms per op and a shapeless nccl:coalesced. An uncoalesced send has both: once."""
    def comms(name, nelems, t, dtype="Float"):
        e = ev("record_param_comms", t, 5)
        # kineto keeps the strings quoted
        e.meta = {"Collective name": f'"{name}"', "In msg nelems": nelems, "dtype": f'"{dtype}"'}
        return e

    coalesced = [comms("send", 1000, 0), comms("recv", 500, 10, "BFloat16"), ev("nccl:coalesced", 20, 100),
                 comms("allreduce", 99, 200)]  # a collective's record: counted from its nccl: event, not here
    got = analyze(coalesced, n=2, steps=1)
    assert got["comm_calls_per_step"] == 2 and got["comm_bytes_per_step"] == 4000 + 1000
    single = [comms("send", 1000, 0), ev("nccl:send", 10, 100, s=[[1000]], d=["float"])]
    assert analyze(single, n=2, steps=1)["comm_bytes_per_step"] == 4000
    gloo = [ev("gloo:send", 0, 100, th=7, s=[[1000]], d=["float"])]  # gloo records no param comms
    assert analyze(gloo, n=2, steps=1)["comm_bytes_per_step"] == 4000
