"""One precision per run, the one the library trains in (issue 23, item 1): accelerate's
mixed_precision set by its launcher or environment, a DeepSpeed JSON that enables bf16, reach the
FLOP peak, the memory prediction and the row as --precision bf16 does."""
import pytest
import torch
from helpers import check_ok, half_size, rows, run, tiny_args
from launches import HALF_MODEL

import common.train as train
from common.config import TrainConfig
from common.predict.memory import GIB, predict, setup_of
from common.registry import BY_FILE
from common.runsetup import resolve
from common.train import TrainHooks, build_instruments


def test_the_instruments_read_the_run_precision_not_the_flag(monkeypatch):
    seen = {}
    monkeypatch.setattr(train, "Flops", lambda model, size, precision, *rest: seen.setdefault("flops", precision))
    hooks = TrainHooks(backward=lambda loss: None, step=lambda: None, device=torch.device("cpu"), precision="bf16")
    build_instruments(TrainConfig(precision="fp32", comm_steps=0), None, hooks, train.Metrics())
    assert seen.pop("flops") == "bf16"
    hooks.precision = None  # a script whose library follows --precision
    build_instruments(TrainConfig(precision="fp32", comm_steps=0), None, hooks, train.Metrics())
    assert seen["flops"] == "fp32"


def test_the_memory_prediction_reads_the_rows_precision_not_the_flag():
    """The runner's setup of a run is the row's: accelerate's label says what it trained in (bf16), whatever
    --precision said (fp32)."""
    config = TrainConfig(precision="fp32", model="resnet18", image_size=32, batch_size=16)
    row = {"strategy": "accelerate_ddp", "precision": "bf16", "world_size": 2}
    assert setup_of(resolve(BY_FILE["accelerate_DDP.py"], config, row)).precision == "bf16"
    assert setup_of(resolve(BY_FILE["accelerate_DDP.py"], config, {**row, "precision": "fp32"})).precision == "fp32"


def predicted_activation(script: str, row: dict, precision: str, size: int, **cfg) -> float:
    """The activation prediction of the run that wrote `row`, had it trained in `precision`."""
    config = TrainConfig(image_size=size, batch_size=16, model=HALF_MODEL, precision=precision)
    config.__dict__.update(cfg)  # the DeepSpeed script's own field: its JSON
    label = precision if precision == "fp32" or not row["precision"].startswith("ds_") else f"ds_{precision}"
    run = resolve(BY_FILE[script], config, {**row, "precision": label})
    return round(predict(setup_of(run)).activations / GIB, 6)


@pytest.mark.slow
@pytest.mark.parametrize("script, how", [
    ("accelerate_DDP.py", "environment"),  # what `accelerate launch --mixed_precision bf16` sets
    ("pytorch_DeepSpeed.py", "json"),
])
def test_precision_set_outside_the_flag(tmp_path, script, how):
    size = half_size("bf16").get("image_size", 32)
    env, extra = {}, {}
    if how == "environment":
        env = {"ACCELERATE_MIXED_PRECISION": "bf16"}
    else:
        path = tmp_path / "bf16.json"
        path.write_text('{"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}}')
        extra = {"deepspeed_config": str(path)}
    extra["model"] = HALF_MODEL  # cheap where the half kernels are torch's reference ones
    check_ok(run(script, tiny_args(tmp_path, image_size=size, comm_steps=0, **extra), nproc=2, launcher="torchrun",
                 env=env))
    (row,) = rows(tmp_path / "summary.csv")
    assert row["precision"] in ("bf16", "ds_bf16"), row["precision"]
    want = predicted_activation(script, row, "bf16", size, **extra)
    assert float(row["pred_activation_gib"]) == want != predicted_activation(script, row, "fp32", size, **extra)
    assert float(row["mfu"]) == pytest.approx(float(row["achieved_tflops"]) / float(row["peak_tflops"]), rel=0.01)
