"""What a GPU machine must show before its figures are trusted. Run first on any new GPU machine:

    python -m pytest -m gpu tests -x -q          # about 10-20 minutes on one modern GPU

Written and reviewed against the libraries' sources without a GPU to run them on: a failure here is
the first contact of the CUDA paths with hardware, and says exactly which invariant broke.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from helpers import ROOT, check_ok, clean_env, rows, run, tiny_args
from test_memory import check_model_state

from common.bench import matrix
from common.launching import free_port, launch_env
from common.measure.flops import MATHS, PEAK_TFLOPS
from common.measure.probes import nvml_handle
from common.registry import BY_FILE, SCRIPTS

GPUS = torch.cuda.device_count()
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, {GPUS} visible")
BF16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


WORKERS = 2


def gpu_args(tmp_path, **over):
    """A few real steps at the articles' shapes: ResNet50 at 224, batch 32 per GPU."""
    world = over.pop("world", 1)
    args = dict(device="cuda", model="resnet50", image_size=224, batch_size=32 * world, train_samples=32 * world * 8,
                test_samples=64, max_steps=8, timing_warmup_steps=3, workers=WORKERS, warmup_steps=0, log_every=0)
    return tiny_args(tmp_path, **{**args, **over})


def as_float(row, col):
    assert row[col] != "", f"{col} is empty"
    return float(row[col])


# training GFLOP per image at 224: torchvision's weights tables list 4.09 (ResNet50) and 17.56 (ViT-B/16)
# "GFLOPS" per forward, which are multiply-adds: x 2 FLOPs x 3 (forward, two backward products)
TRAIN_GFLOP = {"resnet50": 24.3, "vit_b_16": 105.4}


def check_gpu_row(row, world, profiled=False):
    assert row["status"] == "ok", row["error"]
    assert row["device"] == "cuda" and int(row["world_size"]) == world
    alloc, reserved, nvml = (as_float(row, c) for c in ("peak_allocated_gib", "peak_reserved_gib", "peak_nvml_gib"))
    # the allocator's tensors fit in what it reserved, which fits in what the device has in use
    assert 0 < alloc <= reserved <= nvml, (alloc, reserved, nvml)
    assert 0 < as_float(row, "gpu_util_peak") <= 100 and 0 <= as_float(row, "gpu_util_mean") <= 100
    for col in ("cuda_version", "cudnn_version", "nccl_version", "driver_version"):
        assert row[col], col
    # the warm-up, and a distributed run's --comm-steps (3) before its window (not at one GPU: common/train.py)
    assert int(row["timed_steps"]) == int(row["steps"]) - 3 - (3 if profiled else 0)
    check_model_state(row)  # measured vs predicted model state, and pred_error_pct against peak_allocated_gib
    check_efficiency(row)


def nvml_energy_supported() -> bool:
    lib, handle = nvml_handle(torch.device("cuda", 0))
    if handle is None:
        return False
    try:
        return lib.nvmlDeviceGetTotalEnergyConsumption(handle) > 0
    except lib.NVMLError:
        return False


def check_efficiency(row):
    """Step times from CUDA events, the datasheet peak of the run's math (MFU) and NVML energy."""
    p50, p90 = as_float(row, "step_ms_p50"), as_float(row, "step_ms_p90")
    mean_ms = 1000 * int(row["global_batch_size"]) / as_float(row, "throughput_img_s")
    assert 0 < p50 <= p90 and mean_ms / 4 < p50 < 4 * mean_ms, (p50, p90, mean_ms)  # events read in ms
    assert as_float(row, "train_gflop_per_img") == pytest.approx(TRAIN_GFLOP[row["model"]], rel=0.02)
    label = row["precision"]  # amp_fp16, pure_bf16+bn32, mp_bf16, ds_fp16, fp32 ...
    math_ = next((h for h in ("bf16", "fp16") if h in label), "tf32" if row["tf32"] == "True" else "fp32")
    peak = PEAK_TFLOPS.get(row["device_name"], (None,) * 4)[MATHS.index(math_)]
    if peak is None:  # not in the table: no figure, never a guess
        assert row["peak_tflops"] == "" and row["mfu"] == "", row["device_name"]
    else:
        # one peak per GPU the run drives (common/measure/flops.py Flops): the row's num_devices, which is the
        # world but for model parallelism, one process over two GPUs (pytorch_MP.py)
        assert as_float(row, "peak_tflops") == pytest.approx(peak * int(row["num_devices"]), rel=1e-3)
        assert 0 < as_float(row, "mfu") <= 1
    window_s = int(row["timed_steps"]) * mean_ms / 1000
    if nvml_energy_supported() and window_s > 1:  # a shorter window may end before the counter moves
        assert as_float(row, "energy_j") > 0 and as_float(row, "img_per_j") > 0
    elif nvml_energy_supported():
        assert row["energy_j"] == "" or as_float(row, "energy_j") > 0
    else:
        assert row["energy_j"] == "", "energy from a GPU without NVML's energy counter"
    # the host's share of the window (common/measure/host.py): the GPU hosts these tests run on are Linux
    assert all(0 <= as_float(row, c) <= 100 for c in ("host_other_pct", "host_steal_pct", "cpu_wait_pct")), \
        [row[c] for c in ("host_other_pct", "host_steal_pct", "cpu_wait_pct")]


def gpu_cases():
    out = []
    for s in SCRIPTS:
        for precision in s.precisions:
            no_bf16 = precision == "bf16" and torch.cuda.is_available() and not BF16
            marks = [pytest.mark.skipif(no_bf16, reason="this GPU has no bf16 (compute capability < 8.0)")]
            out.append(pytest.param(s, precision, marks=marks, id=f"{s.name}-{precision}"))
    return out


@pytest.mark.parametrize("entry, precision", gpu_cases())
def test_every_script_and_precision_at_resnet50_224(tmp_path, entry, precision):
    world = matrix.processes(entry.file, GPUS) if entry.distributed else GPUS if entry.one_process_gpus else 1
    cmd, nproc = matrix.command({"script": entry.file, "nproc": matrix.processes(entry.file, GPUS),
                                 "args": {}, "name": "gpu/" + entry.name}, GPUS, str(tmp_path / "summary.csv"))
    model = entry.preset_args.get("model", "resnet50")  # pytorch_TP.py splits a ViT's heads: ResNet50 is refused
    # fp16's loss scaler skips its first steps (2^16 overflows): 16 steps, so that some update after the warm-up
    # and the model state is measured (check_model_state)
    more = {"max_steps": 16, "train_samples": 32 * world * 16} if precision == "fp16" else {}
    args = gpu_args(tmp_path, precision=precision, world=world, model=model, **more)
    proc = subprocess.run(cmd + args, cwd=ROOT, env=launch_env(nproc=nproc), capture_output=True, text=True,
                          timeout=900)
    check_ok(proc)
    (row,) = rows(tmp_path / "summary.csv")
    check_gpu_row(row, world, profiled=entry.distributed and world > 1)
    if precision == "fp16" and entry.file != "pytorch_half_precision.py":  # a dynamic loss scaler at 2^16
        # overflows first and skips: counted, fused optimizers (accelerate's scaler) included
        assert 1 <= int(row["skipped_steps"]) < int(row["steps"]), row["skipped_steps"]
    sd = torch.load(tmp_path / "ckpt" / entry.name / "model_final.pt", map_location="cpu", weights_only=True)
    torchvision.models.get_model(model, num_classes=10).load_state_dict(sd)


def test_amp_fp16_counts_skipped_steps(tmp_path):
    """GradScaler starts at 2**16: the first steps overflow and are skipped, by design, and counted."""
    check_ok(run("pytorch_auto_mixed_precision.py", gpu_args(tmp_path, precision="fp16", max_steps=20)))
    (row,) = rows(tmp_path / "summary.csv")
    assert 1 <= int(row["skipped_steps"]) < int(row["steps"]), row["skipped_steps"]


def test_inference_on_cuda_with_the_device_loader_and_onnx(tmp_path):
    """model_inference.py on CUDA: the device-side loader's validity mask lives on the GPU (the logits
    are brought to the CPU before indexing), bf16 on the device beside the fp32 ONNX export, and
    onnxruntime bound to device buffers (IOBinding) when onnxruntime-gpu is installed."""
    check_ok(run("pytorch_SingleGPU.py", tiny_args(tmp_path, device="cuda")))
    out = tmp_path / "inference.csv"
    ckpt = tmp_path / "ckpt" / "pytorch_SingleGPU" / "model_final.pt"
    precision = "bf16" if BF16 else "fp16"
    check_ok(run("model_inference.py", ["--checkpoint", str(ckpt), "--results", str(out), "--device", "cuda",
                                        "--dataset", "synthetic", "--model", "resnet18", "--image-size", "32",
                                        "--test-samples", "37", "--batch-size", "16", "--loader", "gpu", "--onnx",
                                        "--precision", precision]))
    torch_row, ort_row = rows(out)
    assert torch_row["device"] == "cuda" and int(torch_row["test_samples"]) == 37
    assert int(ort_row["test_samples"]) == 37 and float(ort_row["top1_agreement"]) >= 0.9
    assert float(torch_row["latency_ms_p50"]) > 0 and float(ort_row["latency_ms_p50"]) > 0


@two_gpus
def test_ddp_on_two_gpus_trains_like_one(tmp_path):
    """As tests/test_equivalence.py on CPU: frozen BatchNorm, no augmentation, the same global batch.
    cuDNN picks per-shape algorithms, so sums differ in rounding: 1e-3 still sits an order of
    magnitude below a wrong gradient average (lr x |grad| ~ 1e-2)."""
    common = dict(device="cuda", train_samples=96, batch_size=16, augment=False, freeze_bn=True, warmup_steps=0)
    one, two = tmp_path / "one", tmp_path / "two"
    check_ok(run("pytorch_SingleGPU.py", tiny_args(one, **common)))
    check_ok(run("pytorch_DDP.py", tiny_args(two, **common), nproc=2, launcher="torchrun"))
    a = torch.load(one / "ckpt" / "pytorch_SingleGPU" / "model_final.pt", weights_only=True)
    b = torch.load(two / "ckpt" / "pytorch_DDP" / "model_final.pt", weights_only=True)
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert diff < 1e-3, diff


def equal_to_one_gpu(tmp_path, script, nproc, **extra):
    """SingleGPU and `script` with frozen BatchNorm on the same batches; the largest weight difference."""
    common = dict(device="cuda", train_samples=96, batch_size=16, augment=False, freeze_bn=True, warmup_steps=0)
    one, two = tmp_path / "one", tmp_path / "two"
    check_ok(run("pytorch_SingleGPU.py", tiny_args(one, **common)))
    check_ok(run(script, tiny_args(two, **common, **extra), nproc=nproc,
                 launcher="torchrun" if nproc > 1 else "python"))
    a = torch.load(one / "ckpt" / "pytorch_SingleGPU" / "model_final.pt", weights_only=True)
    b = torch.load(two / "ckpt" / script[:-3] / "model_final.pt", weights_only=True)
    (row,) = rows(two / "summary.csv")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a), row


@two_gpus
def test_model_parallel_on_two_gpus_trains_like_one(tmp_path):
    """The halves on cuda:0 and cuda:1: the same weights, two devices in the row, and each GPU idle
    while the other works (the lighter half, layer4 with the head, idles most)."""
    diff, row = equal_to_one_gpu(tmp_path, "pytorch_MP.py", 1)
    assert diff < 1e-3, diff
    assert int(row["num_devices"]) == 2 and float(row["pipeline_bubble_pct"]) > 40, row["pipeline_bubble_pct"]


@two_gpus
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_on_two_gpus_trains_like_one(tmp_path, schedule):
    diff, row = equal_to_one_gpu(tmp_path, "pytorch_PP.py", 2, schedule=schedule, microbatches=4)
    assert diff < 1e-3, diff
    assert 0 < float(row["pipeline_bubble_pct"]) < 100


def test_bubble_lane_times_the_gpu():
    """CUDA events on the lane's stream: the busy time is the GPU's, read after the window closes."""
    import time

    from common.measure.bubble import Bubble, Lane

    lane = Lane(torch.device("cuda", 0))
    bubble = Bubble([lane], lane.device)
    x = torch.randn(4096, 4096, device=lane.device)
    bubble.start()
    start = time.perf_counter()
    lane.timed(lambda: [x @ x for _ in range(50)])()
    torch.cuda.synchronize()
    time.sleep(0.2)  # idle, as long as the work or longer
    bubble.pause()
    assert lane.busy_s > 0 and lane.busy_s < time.perf_counter() - start
    assert 0 < bubble.row()["pipeline_bubble_pct"] < 100


@two_gpus
def test_probes_report_the_busiest_gpu():
    """DataParallel's one process drives every GPU: its peak is the largest of them."""
    from common.measure.probes import Probes

    devices = [torch.device("cuda", i) for i in range(GPUS)]
    p = Probes(devices, devices[0])
    p.start()
    small = torch.empty(64 * 2 ** 20, dtype=torch.uint8, device=devices[0])  # 64 MiB on GPU 0
    big = torch.empty(2 ** 30, dtype=torch.uint8, device=devices[1])  # 1 GiB on GPU 1
    torch.cuda.synchronize()
    p.stop()
    del small, big
    assert p.row()["peak_allocated_gib"] >= 1.0


@two_gpus
def test_dataparallel_row_counts_every_gpu(tmp_path):
    check_ok(run("pytorch_DP.py", gpu_args(tmp_path, world=GPUS)))
    (row,) = rows(tmp_path / "summary.csv")
    check_gpu_row(row, GPUS)
    assert int(row["num_devices"]) == GPUS


def uuids_seen(script_cmd: list[str], env: dict) -> set[str]:
    proc = subprocess.run(script_cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line.split("uuid=")[1].strip() for line in proc.stdout.splitlines() if line.startswith("WHOAMI")}


@two_gpus
@pytest.mark.parametrize("script", ["pytorch_SingleGPU.py", "pytorch_DDP.py", "pytorch_DeepSpeed.py",
                                    "accelerate_DDP.py"])
def test_every_launcher_honours_cuda_visible_devices(script, monkeypatch):
    """The last GPU alone is made visible; whatever launcher benchmark.py picks, the process must see
    that GPU (deepspeed --num_gpus would drop CUDA_VISIBLE_DEVICES and take GPU 0)."""
    target = str(torch.cuda.get_device_properties(GPUS - 1).uuid)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(GPUS - 1))
    entry = BY_FILE[script]
    if entry.distributed:
        cmd = matrix.launcher(script, 1, 1, free_port())
    else:
        cmd = [sys.executable]
    env = {**clean_env(), "CUDA_VISIBLE_DEVICES": str(GPUS - 1)}
    seen = uuids_seen(cmd + [os.path.join("tests", "gpu", "whoami.py")], env)
    assert seen == {target}, (seen, target)


def test_doctor_passes_on_this_gpu_machine(tmp_path):
    proc = subprocess.run([sys.executable, "benchmark.py", "doctor", "--results", str(tmp_path / "d.csv"),
                           "--report", str(tmp_path / "D.md"), "--save-dir", str(tmp_path / "ckpt"),
                           "--log-dir", str(tmp_path / "logs")], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert ", 0 fail" in proc.stdout


@two_gpus
@pytest.mark.parametrize("script,launcher,factor", [("pytorch_DDP.py", "torchrun", 1.0),
                                                    ("pytorch_FSDP.py", "torchrun", 3.0)])
def test_comm_columns_from_nccl_kernels(tmp_path, script, launcher, factor):
    """The CUDA path of common/measure/comm.py: bytes from the nccl:* events' input tensors, time and
    overlap from the NCCL kernels (ncclDevKernel_*) against the other kernels."""
    check_ok(run(script, gpu_args(tmp_path, world=2, model="resnet18"), nproc=2, launcher=launcher))
    (row,) = rows(tmp_path / "summary.csv")
    check_gpu_row(row, 2, profiled=True)
    assert as_float(row, "comm_bytes_per_step") == pytest.approx(factor * 4 * 11_181_642, rel=0.10)
    assert as_float(row, "comm_ms_per_step") > 0 and as_float(row, "busbw_gbps") > 0
    assert 0 <= as_float(row, "comm_overlap_pct") <= 100


@two_gpus
def test_pipeline_bytes_on_nccl_are_the_activations_sent(tmp_path):
    """1F1B on NCCL: batch_isend_irecv coalesces every send and receive, which then have no nccl:send
    event of their own; the row counts them from record_param_comms (common/measure/comm.py)."""
    from helpers import pp_bytes_per_step

    args = gpu_args(tmp_path, world=2, model="resnet18")
    check_ok(run("pytorch_PP.py", args + ["--schedule", "1f1b", "--microbatches", "4"], nproc=2, launcher="torchrun"))
    (row,) = rows(tmp_path / "summary.csv")
    size, batch = int(row["image_size"]), int(row["global_batch_size"])
    assert as_float(row, "comm_bytes_per_step") == pytest.approx(pp_bytes_per_step("resnet18", size, batch), rel=0.01)


def test_calibrated_step_model_predicts_single_and_ddp(tmp_path):
    """benchmark.py calibrate on this GPU, then the single-device runs and DDP (every visible GPU) at the
    calibrated setup: pred_step_ms within 15% of the median step (docs/time.md)."""
    cal = tmp_path / "cal.json"
    world = max(1, GPUS)
    proc = subprocess.run([sys.executable, "benchmark.py", "calibrate", "--model", "resnet50", "--image-size", "224",
                           "--batch-size", str(32 * world), "--world-sizes", ",".join(sorted({"1", str(world)})),
                           "--modes", "fp32,amp_bf16" if BF16 else "fp32", "--microbatches", "0", "--out", str(cal),
                           "--workers", str(WORKERS),  # the runs' loader beside the launching thread
                           # on one GPU no strategy runs here: their one-process entries would go unread
                           *(["--no-strategies"] if world == 1 else [])],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [("pytorch_SingleGPU.py", 1, {"batch_size": 32 * world})]
    if BF16:
        runs.append(("pytorch_auto_mixed_precision.py", 1, {"batch_size": 32 * world, "precision": "bf16"}))
    if world > 1:
        runs.append(("pytorch_DDP.py", world, {"world": world}))
    for script, nproc, over in runs:
        out = tmp_path / script[:-3]
        out.mkdir()
        shutil.copy(cal, out / "calibration.json")  # the runner predicts from the calibration beside the results
        args = gpu_args(out, max_steps=20, train_samples=32 * world * 20, **over)
        check_ok(run(script, args, nproc=nproc, launcher="torchrun" if nproc > 1 else "python"))
        (row,) = rows(out / "summary.csv")
        err = as_float(row, "pred_time_error_pct")
        # kept in the log (-rA): pytest drops a passing test's folder, and these rows with it
        print(script, {c: row[c] for c in ("pred_step_ms", "step_ms_p50", "pred_compute_ms", "step_compute_ms",
                                           "pred_optimizer_ms", "step_optimizer_ms", "pred_data_ms", "step_data_ms",
                                           "loader_img_s", "pred_time_error_pct")})
        assert abs(err) <= 15, (script, row["pred_step_ms"], row["step_ms_p50"], row["notes"])


# the throughput preset's single-GPU rows (config/benchmark.yaml) and the calibration modes they need
THROUGHPUT_SINGLE = ("pytorch_SingleGPU.py", "single_tf32", "amp_bf16", "amp_bf16_fast")


def test_throughput_single_rows_predicted_within_10pct(tmp_path):
    """Issue 60's GPU check: `calibrate` on this GPU (the throughput preset's single-device setups, its
    channels-last entry at 256 from the preset's amp_bf16_fast run), then the preset's single-GPU rows with that
    calibration beside their results, then `benchmark.py predict`'s evaluation: every row within 10% of its
    median step. GPU_TIER_KEEP=DIR keeps the calibration, rows and logs there (.gpu/run.sh: the campaign's)."""
    from common.bench.predict import evaluate

    keep = os.environ.get("GPU_TIER_KEEP")
    out = Path(keep).resolve() if keep else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    cal, csv = out / "calibration.json", out / "summary.csv"  # the runner reads the calibration beside the CSV
    for old in (cal, csv):  # a kept folder's earlier rows would be evaluated with these
        old.unlink(missing_ok=True)
    only = [r for r in THROUGHPUT_SINGLE if BF16 or "bf16" not in r]
    steps = [["calibrate", "--preset", "throughput", "--modes", "fp32,tf32,amp_bf16" if BF16 else "fp32,tf32",
              "--world-sizes", "1", "--no-strategies", "--microbatches", "0", "--out", str(cal)],
             ["run", "--preset", "throughput", "--only", ",".join(only), "--results", str(csv), "--force",
              "--log-dir", str(out / "logs"), "--report", str(out / "REPORT.md"), "--save-dir", str(tmp_path / "ckpt")],
             ["predict", "--results", str(csv), "--calibration", str(cal)]]
    for argv in steps:
        proc = subprocess.run([sys.executable, "benchmark.py", *argv], cwd=ROOT, env=clean_env(), capture_output=True,
                              text=True, timeout=900)
        print(proc.stdout[-4000:])  # -rA keeps the predict table in the log
        assert proc.returncode == 0, (argv[0], proc.stderr[-3000:])
    ev = evaluate(str(csv), str(cal))
    assert not ev.missing and len(ev.med) == len(only), (ev.missing, list(ev.med.index))
    errors = (100 * (ev.med.now_ms / ev.med.step_ms_p50 - 1)).round(1).to_dict()
    assert all(abs(e) <= 10 for e in errors.values()), errors


# --- the multi-GPU and multi-node paths (issue 58): what a lent multi-GPU machine runs first ---

@two_gpus
@pytest.mark.parametrize("script, extra", [
    ("pytorch_FSDP.py", {}), ("pytorch_DDP_ZeRO.py", {}), ("pytorch_DeepSpeed.py", {}),
    ("pytorch_TP.py", {"model": "vit_b_16"}),  # it splits attention heads: a ResNet is refused (tensor_parallel.py)
    ("pytorch_DeepSpeed.py", {"deepspeed_config": "config/zero_stage3_config.json"})])
def test_sharded_strategies_at_two_ranks(tmp_path, script, extra):
    """Each sharded strategy at 2 ranks on NCCL (DeepSpeed through torchrun, as under Slurm): an ok row that
    counted its collectives, and the collective timeout the group was given (--dist-timeout-s)."""
    check_ok(run(script, gpu_args(tmp_path, world=2, **{"model": "resnet18", **extra}), nproc=2, launcher="torchrun"))
    (row,) = rows(tmp_path / "summary.csv")
    assert row["status"] == "ok" and row["device"] == "cuda" and row["world_size"] == "2", row
    assert row["dist_timeout_s"] == "1800"
    assert as_float(row, "comm_bytes_per_step") > 0


@pytest.mark.parametrize("script, extra, strategy", [
    ("pytorch_DDP.py", {"sync_bn": True}, "ddp"), ("pytorch_FSDP.py", {"cpu_offload": True}, "fsdp_full-shard_offload"),
    ("pytorch_DeepSpeed.py", {"offload": True}, "deepspeed_zero2_offload"),
    ("pytorch_DeepSpeed.py", {"offload": True, "deepspeed_config": "config/zero_stage3_config.json"},
     "deepspeed_zero3_offload"),
    ("pytorch_FSDP.py", {"sharding": "hybrid"}, "fsdp_hybrid")])
def test_cuda_only_flags(tmp_path, script, extra, strategy):
    """The flags whose CPU runs are twins (tests/twins/cuda_flags_on_cpu.py), on the GPUs this machine has (2 at
    most; one is enough for the CUDA paths: SyncBatchNorm's layers in a CUDA DDP module, offload to pinned host
    memory and back, a hybrid mesh of one node): an ok row that names the strategy and counted its collectives.
    FSDP2's offload leaves no model state on the GPU after the step: the shards live on the host
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: offload_to_cpu moves the sharded parameter to CPU, and
    the reduce-scattered gradient with it; the optimizer's state follows its parameters)."""
    world = min(GPUS, 2)
    check_ok(run(script, gpu_args(tmp_path, world=world, **{"model": "resnet18", **extra}), nproc=world,
                 launcher="torchrun"))
    (row,) = rows(tmp_path / "summary.csv")
    check_gpu_row(row, world)
    assert row["strategy"] == strategy and row["offload"] == str("offload" in strategy), row
    assert world == 1 or as_float(row, "comm_bytes_per_step") > 0
    if strategy == "fsdp_full-shard_offload":
        assert as_float(row, "model_state_gib") < 1e-3, row["model_state_gib"]


def test_more_processes_than_gpus_is_refused_in_one_line(tmp_path):
    """torchrun --nproc-per-node GPUs+1: two ranks would share a GPU and NCCL fail with "Duplicate GPU
    detected"; every rank refuses first (common/distributed.py pick_device), in one line (exit 2, which
    torchrun reports as its own failure)."""
    proc = run("pytorch_DDP.py", gpu_args(tmp_path, world=GPUS + 1, model="resnet18"), nproc=GPUS + 1,
               launcher="torchrun")
    assert proc.returncode != 0 and "Duplicate GPU" not in proc.stderr, proc.stderr[-3000:]
    assert f"pytorch_DDP.py: error: {GPUS + 1} processes on this node" in proc.stderr, proc.stderr[-3000:]
    assert not rows(tmp_path / "summary.csv")  # bad input: no row


@two_gpus
def test_two_node_rendezvous_over_a_non_loopback_address(tmp_path):
    """Two torchruns as two nodes of one GPU each, meeting at the address slurm/node_addr.sh picks (never
    loopback), with the first alone serving the store as the Slurm templates say (is_host): the group forms,
    trains and writes one row of world 2, in well under the join timeout."""


    addr = subprocess.run(["bash", "slurm/node_addr.sh", "2"], cwd=ROOT, capture_output=True, text=True)
    if addr.returncode:
        pytest.skip(f"no non-loopback address here: {addr.stderr.strip()}")
    endpoint = f"{addr.stdout.strip()}:{free_port()}"
    args = gpu_args(tmp_path, world=2, model="resnet18")
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-conf=is_host={int(node == 0)}",
               "--rdzv-id=issue58", "pytorch_DDP.py", *args]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**clean_env(), "CUDA_VISIBLE_DEVICES": str(node)},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[-2000:] for o in outs]
    (row,) = rows(tmp_path / "summary.csv")
    assert row["status"] == "ok" and row["world_size"] == "2", row
