"""What a run is, decided once (common/runsetup.py): resolved by the runner from the registry entry, the config,
the row's labels and the library's own JSON, written as columns, and read back from the row the same."""
import json

from common.config import TrainConfig
from common.predict.memory import setup_of
from common.registry import BY_FILE
from common.runsetup import columns, from_row, resolve
from common.strategies import STRATEGIES, of, sized


def _written(run, row: dict) -> dict:
    """The row as the CSV gives it back: text, the setup columns beside the base row's."""
    base = {"model": run.model, "image_size": run.image_size, "global_batch_size": run.batch_size,
            "optimizer": run.optimizer, "script": run.script, **row, **columns(run)}
    return {k: "" if v is None else str(v) for k, v in base.items()}


def test_the_deepspeed_json_the_run_used_is_its_setup_and_its_rows(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1234, "overlap_comm": True},
                                "bf16": {"enabled": True}}))
    cfg = TrainConfig(model="resnet18", image_size=32, batch_size=16)
    cfg.deepspeed_config, cfg.offload = str(path), False  # pytorch_DeepSpeed.py's own fields
    row = {"strategy": "deepspeed_zero2", "precision": "ds_bf16", "world_size": 2, "device": "cpu"}
    run = resolve(BY_FILE["pytorch_DeepSpeed.py"], cfg, row, environ={"LOCAL_WORLD_SIZE": "2"})
    assert (run.zero_stage, run.zero["reduce_bucket_size"], run.local_world_size, run.half) == (2, 1234, 2, "bf16")
    back = from_row(_written(run, row))
    assert (back.zero, back.zero_stage, back.local_world_size, back.half) == (run.zero, 2, 2, "bf16")
    assert setup_of(back).zero["reduce_bucket_size"] == 1234 and setup_of(back).precision == "bf16"
    # accelerate names its JSON in the environment its launcher sets, whatever the script's field says
    acc = resolve(BY_FILE["accelerate_DeepSpeed.py"], TrainConfig(model="resnet18"),
                  {**row, "strategy": "accelerate_deepspeed_zero2"},
                  environ={"ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)})
    assert acc.zero["reduce_bucket_size"] == 1234 and acc.local_world_size == 0


def test_a_row_of_an_earlier_release_gets_the_shipped_json_of_its_stage():
    row = {"script": "pytorch_DeepSpeed.py", "strategy": "deepspeed_zero3", "precision": "fp32", "world_size": "2",
           "model": "resnet18", "image_size": "32", "global_batch_size": "16"}
    with open("config/zero_stage3_config.json") as fh:
        assert from_row(row).zero == json.load(fh)["zero_optimization"] and from_row(row).zero_stage == 3
    assert from_row({**row, "world_size": ""}) is None and from_row({**row, "strategy": ""}) is None
    zero0 = from_row({**row, "strategy": "deepspeed_zero0"})  # no shipped JSON for it: none assumed
    assert zero0.zero == {} and setup_of(zero0) is None


def test_the_single_device_scripts_are_the_models_half_and_amp():
    row = {"strategy": "single", "precision": "pure_fp16+bn32", "world_size": "1", "model": "resnet18",
           "image_size": "32", "global_batch_size": "16"}
    half = setup_of(from_row({**row, "script": "pytorch_half_precision.py"}))
    assert (half.strategy, half.precision, half.bn_fp32) == ("half", "fp16", True)
    amp = setup_of(from_row({**row, "script": "pytorch_auto_mixed_precision.py", "precision": "amp_bf16"}))
    assert (amp.strategy, amp.precision) == ("amp", "bf16")
    assert setup_of(from_row({**row, "script": "pytorch_PP.py", "strategy": "pp_gpipe"})) is None


def test_the_strategy_table_answers_what_the_names_spelled():
    assert sized()[:6] == ("single", "half", "amp", "dp", "ddp", "ddp_zero") and "deepspeed_zero0" not in sized()
    assert [s for s in STRATEGIES if of(s).ddp_buckets] == ["ddp", "ddp_zero", "accelerate_ddp"]
    assert of("accelerate_deepspeed_zero3").zero_stage == 3 and of("accelerate_deepspeed_zero3").gathers_per_microbatch
    assert of("fsdp_full-shard_offload").offload and of("accelerate_fsdp").sharding == "full-shard"
    zero1 = of("deepspeed_zero1_offload")  # a row's variant the table does not list: its stage's, offloaded
    assert zero1.zero_stage == 1 and zero1.offload and not zero1.sized
    assert of("pp_1f1b").family == "pp" and not of("pp_1f1b").sized and of("mp").family == "mp"
    assert of("no_such_strategy") is None


def test_offload_with_a_users_json_lets_deepspeed_take_the_torch_optimizer(tmp_path):
    """--offload with a JSON that does not say zero_force_ds_cpu_optimizer: DeepSpeed would refuse the torch
    optimizer (deepspeed/runtime/engine.py _configure_optimizer raises ZeRORuntimeException); a JSON that says
    it keeps its own word."""
    from common.deepspeed_config import resolve_ds_config

    cfg = TrainConfig(model="resnet18", image_size=32, batch_size=16)
    for given, want in (({}, False), ({"zero_force_ds_cpu_optimizer": True}, True)):
        path = tmp_path / "mine.json"
        path.write_text(json.dumps({"zero_optimization": {"stage": 2}, **given}))
        ds, _ = resolve_ds_config(cfg, str(path), 2, 8, offload=True)
        assert ds["zero_force_ds_cpu_optimizer"] is want and ds["zero_optimization"]["offload_optimizer"]
