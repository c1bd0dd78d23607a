"""Every training script end to end on CPU: one valid row, loadable weights, clear refusals."""
import math

import pytest
import torch
import torchvision
from conftest import check_ok, one_line_error, rows, run, tiny_args

from common.results import COLUMNS

SINGLE = ["pytorch_SingleGPU.py", "pytorch_DP.py"]
MULTI = ["pytorch_DDP.py", "pytorch_DDP_ZeRO.py", "pytorch_FSDP.py", "accelerate_DDP.py", "accelerate_DeepSpeed.py",
         "pytorch_DeepSpeed.py"]


def check_row(row, script, world):
    assert row["script"] == script and row["status"] == "ok" and int(row["world_size"]) == world
    assert int(row["test_samples"]) == 37  # 37 does not divide by 2: nothing dropped or doubled
    assert int(row["steps"]) == 4 and float(row["train_time_s"]) > 0 and float(row["throughput_img_s"]) > 0
    assert math.isfinite(float(row["train_loss"])) and 0 <= float(row["test_accuracy"]) <= 1
    for col in ("peak_allocated_gib", "peak_reserved_gib", "peak_nvml_gib", "gpu_util_mean", "gpu_util_peak"):
        assert row[col] == "", col  # CPU: empty, never a fake zero
    assert row["device"] == "cpu" and row["torch_version"] == torch.__version__


def load_bare(tmp_path, script):
    path = tmp_path / "ckpt" / script[:-3] / "model_final.pt"
    sd = torch.load(path, map_location="cpu", weights_only=True)
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(sd)  # strict: no wrapper prefixes, no missing or extra keys
    return sd


@pytest.mark.parametrize("script", SINGLE)
def test_single_process_scripts(tmp_path, script):
    check_ok(run(script, tiny_args(tmp_path)))
    (row,) = rows(tmp_path / "summary.csv")
    check_row(row, script, 1)
    assert list(row) == COLUMNS
    load_bare(tmp_path, script)


@pytest.mark.parametrize("script, precision, extra", [
    ("pytorch_half_precision.py", "fp16", {}),
    ("pytorch_half_precision.py", "bf16", {"bn_fp32": True, "loss_scale": 128}),
    ("pytorch_auto_mixed_precision.py", "fp16", {"clip_grad_norm": 1.0}),
    ("pytorch_auto_mixed_precision.py", "bf16", {}),
])
def test_precision_scripts(tmp_path, script, precision, extra):
    # fp16 convolutions are emulated on CPU and slow: 16 px images keep it to seconds
    check_ok(run(script, tiny_args(tmp_path, precision=precision, image_size=16, **extra)))
    (row,) = rows(tmp_path / "summary.csv")
    assert row["status"] == "ok" and precision in row["precision"] and int(row["test_samples"]) == 37
    sd = load_bare(tmp_path, script)
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())


@pytest.mark.parametrize("script", MULTI)
def test_distributed_scripts_two_ranks(tmp_path, script):
    proc = run(script, tiny_args(tmp_path), nproc=2, launcher="torchrun")
    check_ok(proc)
    (row,) = rows(tmp_path / "summary.csv")
    check_row(row, script, 2)
    load_bare(tmp_path, script)


@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_stages(tmp_path, stage):
    cfg = f"config/zero_stage{stage}_config.json"
    check_ok(run("pytorch_DeepSpeed.py", tiny_args(tmp_path, deepspeed_config=cfg), nproc=2, launcher="torchrun"))
    (row,) = rows(tmp_path / "summary.csv")
    assert row["strategy"] == f"deepspeed_zero{stage}" and int(row["world_size"]) == 2
    load_bare(tmp_path, "pytorch_DeepSpeed.py")


def test_deepspeed_launcher(tmp_path):
    check_ok(run("pytorch_DeepSpeed.py", tiny_args(tmp_path), nproc=2, launcher="deepspeed", timeout=400))
    (row,) = rows(tmp_path / "summary.csv")
    check_row(row, "pytorch_DeepSpeed.py", 2)


def test_deepspeed_json_with_own_optimizer_is_refused(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"train_batch_size": 64, "optimizer": {"type": "Adam", "params": {"lr": 0.001}}}')
    proc = run("pytorch_DeepSpeed.py", tiny_args(tmp_path, deepspeed_config=str(bad)))
    line = one_line_error(proc)
    assert "train_batch_size is 64 but the flags give 16" in line or "defines a optimizer" in line
    assert rows(tmp_path / "summary.csv") == []


def test_accelerate_fsdp_refuses_cpu_in_one_line(tmp_path):
    proc = run("accelerate_FSDP.py", tiny_args(tmp_path))
    assert "needs CUDA devices" in one_line_error(proc)
    assert rows(tmp_path / "summary.csv") == []


def test_global_batch_must_divide_world(tmp_path):
    proc = run("pytorch_DDP.py", tiny_args(tmp_path, batch_size=15), nproc=2, launcher="torchrun")
    assert proc.returncode != 0 and "does not divide by world size 2" in proc.stderr
    assert rows(tmp_path / "summary.csv") == []


def test_single_device_script_refuses_torchrun(tmp_path):
    proc = run("pytorch_SingleGPU.py", tiny_args(tmp_path), nproc=2, launcher="torchrun")
    assert proc.returncode != 0 and "use pytorch_DDP.py" in proc.stderr
    assert rows(tmp_path / "summary.csv") == []


def test_training_learns_on_synthetic_data(tmp_path):
    args = tiny_args(tmp_path, epochs=2, train_samples=1024, test_samples=500, batch_size=64, warmup_steps=5)
    check_ok(run("pytorch_SingleGPU.py", args))
    (row,) = rows(tmp_path / "summary.csv")
    assert float(row["test_accuracy"]) > 0.5, row  # chance is 0.1


def test_ddp_grad_accum_learns(tmp_path):
    args = tiny_args(tmp_path, epochs=2, train_samples=512, test_samples=200, batch_size=32, grad_accum=2,
                     warmup_steps=2)
    check_ok(run("pytorch_DDP.py", args, nproc=2, launcher="torchrun"))
    (row,) = rows(tmp_path / "summary.csv")
    assert row["grad_accum"] == "2" and int(row["steps"]) == 32 and float(row["test_accuracy"]) > 0.3, row


def test_compile_time_kept_apart_and_same_training(tmp_path):
    plain, compiled = tmp_path / "plain", tmp_path / "compiled"
    check_ok(run("pytorch_SingleGPU.py", tiny_args(plain)))
    check_ok(run("pytorch_SingleGPU.py", tiny_args(compiled, compile=True), timeout=600))
    (a,), (b,) = rows(plain / "summary.csv"), rows(compiled / "summary.csv")
    assert a["compile_time_s"] == "" and float(b["compile_time_s"]) > float(b["train_time_s"])
    # the compile warm-up step leaves no trace: same start, same updates (up to kernel rounding)
    assert abs(float(a["train_loss"]) - float(b["train_loss"])) < 1e-3
