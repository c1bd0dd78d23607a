"""One precision per run, the one the library trains in (issue 23, item 1): accelerate's
mixed_precision set by its launcher or environment, a DeepSpeed JSON that enables bf16, reach the
FLOP peak, the memory prediction and the row as --precision bf16 does."""
import pytest
import torch
from helpers import check_ok, half_size, rows, run, tiny_args
from launches import HALF_MODEL

import common.train as train
from common.config import TrainConfig
from common.measure.model_state import ModelState, setup_of
from common.predict.memory import GIB, predict
from common.train import TrainHooks, build_instruments


def test_the_instruments_read_the_run_precision_not_the_flag(monkeypatch):
    from common import registry

    seen = {}
    monkeypatch.setattr(train, "Flops", lambda model, size, precision, *rest: seen.setdefault("flops", precision))
    monkeypatch.setattr(registry, "running", registry.BY_FILE["accelerate_DDP.py"])
    hooks = TrainHooks(backward=lambda loss: None, step=lambda: None, device=torch.device("cpu"), precision="bf16")
    built = build_instruments(TrainConfig(precision="fp32", comm_steps=0), None, hooks, train.Metrics())
    (state,) = [i for i in built if isinstance(i, ModelState)]
    assert seen["flops"] == "bf16" and state.setup.precision == "bf16"
    hooks.precision = None  # a script whose library follows --precision
    built = build_instruments(TrainConfig(precision="fp32", comm_steps=0), None, hooks, train.Metrics())
    (state,) = [i for i in built if isinstance(i, ModelState)]
    assert seen["flops"] == "bf16" and state.setup.precision == "fp32"  # setdefault: the first call's


def predicted_activation(script: str, precision: str, size: int, **cfg) -> float:
    from common import registry

    registry.running = registry.BY_FILE[script]
    try:
        config = TrainConfig(image_size=size, batch_size=16, model="resnet18", precision=precision)
        config.__dict__.update(cfg)  # the DeepSpeed script's own field: its JSON
        setup = setup_of(config, 2)
    finally:
        registry.running = None
    return round(predict(setup).activations / GIB, 6)


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
    want = predicted_activation(script, "bf16", size, **extra)
    assert float(row["pred_activation_gib"]) == want != predicted_activation(script, "fp32", size, **extra)
    assert float(row["mfu"]) == pytest.approx(float(row["achieved_tflops"]) / float(row["peak_tflops"]), rel=0.01)
