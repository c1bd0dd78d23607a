import sys

import pytest
from helpers import one_line_error, rows, run_at_once, tiny_args

from common.config import TrainConfig, UsageError, parse_config
from common.registry import BY_FILE, SCRIPTS


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_yaml_then_cli_override(tmp_path):
    path = write(tmp_path, "epochs: 3\nlr: 0.5\nmodel: resnet18\n")
    cfg = parse_config(TrainConfig, argv=["--config", path, "--lr", "0.1"])
    assert (cfg.epochs, cfg.lr, cfg.model) == (3, 0.1, "resnet18")
    assert cfg.batch_size == 128 and cfg.precision == "fp32"


def test_defaults_are_the_articles_setup():
    cfg = parse_config(TrainConfig, argv=[])
    assert (cfg.model, cfg.pretrained, cfg.image_size, cfg.epochs, cfg.batch_size) == ("resnet50", True, 224, 5, 128)
    assert (cfg.dataset, cfg.optimizer, cfg.scheduler) == ("cifar10", "sgd", "cosine")


@pytest.mark.parametrize("text, words", [
    ("epochz: 3\n", ["unknown config key 'epochz'", "allowed:"]),
    ("epochs: three\n", ["'epochs' must be an integer"]),
    ("pretrained: 1\n", ["'pretrained' must be true or false"]),
    ("epochs: 0\n", ["epochs must be >= 1"]),
    ("batch_size: -4\n", ["batch_size must be >= 1"]),
    ("optimizer: lamb\n", ["optimizer must be one of sgd, adamw"]),
    ("[1, 2]\n", ["must be a mapping"]),
    ("epochs: [\n", ["not valid YAML"]),
    ("lr: .nan\n", ["lr must be a finite number; got nan"]),  # nan passes every >= check
    ("momentum: 1.0\n", ["momentum must be < 1.0"]),  # AdamW's beta1 (torch refuses 1 with a traceback)
    ("target_accuracy: 93\n", ["target_accuracy must be <= 1.0; got 93"]),  # a percent, never reached
])
def test_bad_yaml(tmp_path, text, words):
    with pytest.raises(UsageError) as exc:
        parse_config(TrainConfig, argv=["--config", write(tmp_path, text)])
    for w in words:
        assert w in str(exc.value)


@pytest.mark.parametrize("flags", [["--lr", "nan"], ["--lr", "inf"], ["--weight-decay", "nan"],
                                   ["--clip-grad-norm", "inf"]])
def test_a_number_that_is_not_finite_is_refused(flags):
    with pytest.raises(UsageError, match=f"{flags[0][2:].replace('-', '_')} must be a finite number"):
        parse_config(TrainConfig, argv=flags)


def test_precision_restricted_per_script():
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, precisions=("fp32",), argv=["--precision", "fp16"])
    assert parse_config(TrainConfig, precisions=("fp16", "bf16"), argv=[]).precision == "fp16"


HARNESS_FLAGS = ("--run-name", "--repeat", "--scaling")


def test_help_shows_the_script_s_own_defaults():
    """The half-precision scripts run fp16 unless told otherwise, the default YAML's 5 epochs beat a script's
    own 3, and model_inference.py's batch is the YAML's 128, not its field's 256: --help says what a run without
    flags gets."""
    from common.config import build_parser
    from model_inference import InferenceConfig

    shown = " ".join(build_parser(TrainConfig, "", ("fp16", "bf16"), epochs=3, grad_accum=4).format_help().split())
    assert "(default fp16)" in shown and "(default fp32)" not in shown, shown
    assert "(default 5)" in shown.split("--epochs EPOCHS passes", 1)[1][:60], shown  # the YAML's
    assert "(default 4)" in shown.split("--grad-accum GRAD_ACCUM micro-batches", 1)[1][:60], shown  # the script's
    inference = " ".join(build_parser(InferenceConfig, "", ("fp32",)).format_help().split())
    assert "(default 128)" in inference.split("--batch-size BATCH_SIZE", 2)[2][:120], inference
    assert InferenceConfig.batch_size == 256 and parse_config(InferenceConfig, argv=[]).batch_size == 128


def test_help_shows_what_a_user_types_and_the_harness_flags_still_parse():
    """benchmark.py and calibrate set these; --help hides them (docs/configuration.md lists them)."""
    from common.config import DistributedConfig, build_parser

    shown = build_parser(DistributedConfig, "", ("fp32",)).format_help()
    assert not [f for f in HARNESS_FLAGS if f + " " in shown or f + "\n" in shown], shown
    assert "--batch-size" in shown and "--comm-steps" in shown
    cfg = parse_config(TrainConfig, argv=["--run-name", "smoke/x", "--repeat", "2", "--scaling", "weak"])
    assert (cfg.run_name, cfg.repeat, cfg.scaling) == ("smoke/x", 2, "weak")
    # the step model's calibration and calibrate's lockstep are no flags of a training run: the runner predicts
    # from the calibration beside the results file, calibrate's harness meets outside fit()
    assert "--calibration" not in shown and "--lockstep" not in shown
    for flag in ("--calibration", "--lockstep"):
        with pytest.raises(SystemExit):
            parse_config(TrainConfig, argv=[flag, "x"])


def test_underscore_alias_for_deepspeed_launcher():
    from dataclasses import dataclass

    from common.config import opt

    @dataclass
    class C(TrainConfig):
        local_rank: int = opt(-1, "set by the launcher")
        deepspeed_config: str = opt("x.json", "DeepSpeed JSON")

    cfg = parse_config(C, argv=["--local_rank=1", "--deepspeed_config", "y.json", "--warmup-steps", "3"])
    assert (cfg.local_rank, cfg.deepspeed_config, cfg.warmup_steps) == (1, "y.json", 3)


def test_other_tools_keys_are_ignored_unknown_keys_refused(tmp_path):
    """The shared YAML holds training keys: inference reads past them; a key no tool knows is an error."""
    from model_inference import InferenceConfig

    path = write(tmp_path, "epochs: 3\nlr: 0.5\nmodel: resnet18\n")
    cfg = parse_config(InferenceConfig, argv=["--config", path])
    assert cfg.model == "resnet18" and not hasattr(cfg, "lr")
    with pytest.raises(UsageError, match="unknown config key 'epochz'"):
        parse_config(InferenceConfig, argv=["--config", write(tmp_path, "epochz: 3\n")])


def test_a_field_a_script_omits_is_refused_in_its_yaml(tmp_path):
    from dataclasses import dataclass

    from common.config import DistributedConfig

    @dataclass
    class NoCompile(DistributedConfig):
        OMIT = ("compile",)

    assert parse_config(NoCompile, argv=["--config", write(tmp_path, "compile: false\n")]).compile is False
    with pytest.raises(UsageError, match="does not support compile"):
        parse_config(NoCompile, argv=["--config", write(tmp_path, "compile: true\n")])
    with pytest.raises(SystemExit):
        parse_config(NoCompile, argv=["--compile"])


def test_an_unknown_model_is_refused_while_parsing():
    """Before any process group forms: found after init_process_group it made torchrun restart the group
    on two Slurm nodes, and the restart could end in gloo "Connection refused" instead of this line."""
    with pytest.raises(UsageError, match="unknown model 'no_such_model'"):
        parse_config(TrainConfig, argv=["--model", "no_such_model"])
    assert parse_config(TrainConfig, argv=["--model", "resnet18"]).model == "resnet18"


@pytest.mark.parametrize("script", [s.file for s in SCRIPTS if s.no_channels_last])
def test_channels_last_is_refused_where_the_engine_takes_no_channels_last_weight(script, tmp_path, monkeypatch,
                                                                                 capsys):
    """FSDP2 and DeepSpeed fail at wrap time on a channels-last weight, with a traceback and a failed row (the
    two-rank group of test_cluster.py checks the libraries still do): refused in one line, before any process
    group, and no row."""
    from common.config import DistributedConfig
    from common.runner import launch

    results = tmp_path / "summary.csv"
    monkeypatch.setattr(sys, "argv", [script, "--channels-last", "--device", "cpu", "--results", str(results)])
    with pytest.raises(SystemExit) as exit_:
        launch(lambda cfg: pytest.fail("it trained"), script, DistributedConfig)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"{script}: error: --channels-last: {BY_FILE[script].no_channels_last}; run without it")
    assert not results.exists()


# through the script, a refusal of each stage: argparse's, parse_config's, and the set-up's in main (each process
# imports torch first, 3-4 core-s); the other refusals are checked where they are raised, in pytest's process
# (test_an_unknown_model_is_refused_while_parsing and the one below, test_blocks.py's VGG and ViT image size)
BAD_FLAGS = [
    (["--bogus-flag"], "unrecognized arguments"),
    (["--epochs", "0"], "epochs must be >= 1"),
    (["--batch-size", "10", "--train-samples", "8"], "fewer than one global batch"),
]


def test_a_value_outside_a_flags_choices_is_refused_while_parsing(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config(TrainConfig, argv=["--optimizer", "lamb"])
    assert exit_.value.code == 2 and "invalid choice: 'lamb'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """This module's bad-input runs, started together (helpers.run_at_once): {key: (its folder, its process)}."""
    root = tmp_path_factory.mktemp("refused")
    jobs = {i: ("pytorch_SingleGPU.py", tiny_args(root / str(i)) + extra) for i, (extra, _) in enumerate(BAD_FLAGS)}
    jobs["config"] = ("pytorch_SingleGPU.py", tiny_args(root / "config") +
                      ["--config", write(root, "learning_rate: 1\n")])
    return {k: (root / str(k), proc) for k, proc in run_at_once(jobs).items()}


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(BAD_FLAGS)), ids=[w for _, w in BAD_FLAGS])
def test_bad_flags_one_line_and_results_untouched(refused, i):
    folder, proc = refused[i]
    assert BAD_FLAGS[i][1] in one_line_error(proc)
    assert not (folder / "summary.csv").exists()


@pytest.mark.slow
def test_bad_config_file_via_script(refused):
    folder, proc = refused["config"]
    assert "unknown config key 'learning_rate'" in one_line_error(proc)
    assert rows(folder / "summary.csv") == []
