"""The registry is the one table of scripts: everything that lists scripts must agree with it, and
each tool's flags are the ones it uses."""
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys

import pytest

from common import registry
from common.bench import matrix
from common.config import DistributedConfig, EvalConfig, TrainConfig, build_parser
from common.launching import launch_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# batch_size is both: the global training batch, and inference's throughput batch (its own field there)
TRAIN_ONLY = {f.name for f in dataclasses.fields(TrainConfig)} - {f.name for f in dataclasses.fields(EvalConfig)} \
    - {"batch_size"}


def test_every_top_level_script_is_registered():
    assert registry.top_level_scripts() == sorted(s.file for s in registry.SCRIPTS)


def test_readme_script_table_is_the_registrys():
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"<!-- scripts:start -->\n(.*?)\n<!-- scripts:end -->", readme, re.S)
    assert block, "README.md lacks the scripts markers"
    assert block.group(1).strip() == registry.readme_table().strip(), "run: python benchmark.py report"


def config_class(file):
    """The config class a script hands to launch() (TrainConfig when it names none)."""
    source = open(os.path.join(ROOT, file)).read()
    found = re.search(r"(?:launch|launch_tool)\(main, __file__, (?:cfg_cls=)?(\w+)", source)
    module = importlib.import_module(file[:-3])
    return getattr(module, found.group(1)) if found else TrainConfig


def flags(cls):
    return {a.dest for a in build_parser(cls, "", ("fp32",))._actions} - {"help"}


@pytest.mark.parametrize("entry", registry.SCRIPTS, ids=lambda s: s.name)
def test_each_script_offers_only_flags_it_uses(entry):
    cls = config_class(entry.file)
    got = flags(cls)
    if not entry.distributed:
        assert "backend" not in got  # one process: no process group to configure
    if entry.deepspeed_config:
        assert not {"compile", "grad_accum"} & got  # the engine's own config owns these
    sources = open(os.path.join(ROOT, entry.file)).read() + "".join(
        open(os.path.join(d, f)).read() for d, _, files in os.walk(os.path.join(ROOT, "common"))
        for f in files if f.endswith(".py"))
    unused = [name for name in got if f"cfg.{name}" not in sources and f'"{name}"' not in sources]
    assert unused == []


def test_model_inference_lists_no_training_flag():
    got = flags(config_class("model_inference.py"))
    assert not got & TRAIN_ONLY, got & TRAIN_ONLY
    assert {"checkpoint", "onnx", "batch_size", "precision", "model", "dataset", "results"} <= got


@pytest.mark.parametrize("visible, gpus, expected", [
    (None, 0, ["deepspeed", "--num_gpus", "2"]),
    (None, 4, ["deepspeed", "--num_gpus", "4"]),
    ("2,3", 2, ["deepspeed", "--include", "localhost:2,3"]),  # --num_gpus would drop CUDA_VISIBLE_DEVICES
    ("GPU-aa,GPU-bb", 2, ["torchrun", "--nproc_per_node", "2"]),  # UUIDs: deepspeed cannot name them
])
def test_deepspeed_keeps_the_visible_gpus(monkeypatch, visible, gpus, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(matrix, "tool", lambda name: [name])  # the flags are the point here, not the lookup
    cmd = matrix.launcher("pytorch_DeepSpeed.py", gpus or 2, gpus, 29500)
    assert cmd[:3] == expected


@pytest.mark.parametrize("script", ["pytorch_SingleGPU.py", "pytorch_DDP.py", "pytorch_DeepSpeed.py",
                                    "accelerate_DDP.py"])
def test_every_launcher_gets_the_same_thread_rule(monkeypatch, script):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    nproc = matrix.processes(script, 0)
    assert launch_env(nproc=nproc)["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // nproc))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch_env(nproc=nproc)["OMP_NUM_THREADS"] == "3"  # the user's choice is kept


def test_presets_cover_every_registered_script():
    path = os.path.join(ROOT, "config", "benchmark.yaml")
    for preset in ("smoke", "seed", "throughput"):
        runs = matrix.load_matrix(path, preset, None, gpus=0)
        assert {r["script"] for r in runs} == set(registry.BY_FILE), preset
        assert all(r["gpu_only"] for r in runs if registry.BY_FILE[r["script"]].needs_cuda)
    smoke = {r["name"]: r for r in matrix.load_matrix(path, "smoke", None, gpus=0)}
    assert smoke["smoke/pytorch_half_precision"]["args"]["precision"] == "bf16"  # the registry's CPU override
    gpu = {r["name"]: r for r in matrix.load_matrix(path, "smoke", None, gpus=4)}
    assert gpu["smoke/pytorch_half_precision"]["args"]["precision"] == "fp16"
    assert gpu["smoke/pytorch_DDP"]["nproc"] == 4 and gpu["smoke/pytorch_SingleGPU"]["nproc"] == 1
    seed = {r["name"]: r for r in matrix.load_matrix(path, "seed", None, gpus=0)}
    assert seed["seed/pytorch_DDP_ZeRO"]["args"]["optimizer"] == "adamw"  # an entry without name changes the default
    moved = matrix.load_matrix(path, "seed", None, gpus=0, save_dir="/elsewhere")  # benchmark.py --save-dir
    assert {r["args"]["save_dir"] for r in moved} == {"/elsewhere"}


@pytest.mark.parametrize("native", [True, False])
def test_smoke_trains_a_smaller_model_where_half_precision_has_no_native_kernels(monkeypatch, native):
    """On a CPU without native bf16 kernels the smoke preset's half-precision runs train the preset's
    cpu_emulated_half_args; every other run, and every run on a GPU, keeps the preset's model."""
    import common.precision as precision

    monkeypatch.setattr(precision, "native_half_kernels", lambda p: native or p == "fp32")
    path = os.path.join(ROOT, "config", "benchmark.yaml")
    cpu = {r["name"]: r for r in matrix.load_matrix(path, "smoke", None, gpus=0)}
    half = {n for n, r in cpu.items() if r["args"].get("precision", "fp32") != "fp32"}
    assert half == {"smoke/pytorch_half_precision", "smoke/pytorch_auto_mixed_precision"}
    for name, r in cpu.items():
        small = not native and name in half
        own = registry.BY_FILE[r["script"]].preset_args.get("model", "resnet18")  # pytorch_TP.py: its ViT
        assert (r["args"]["model"], r["args"]["image_size"], r["emulated_half"]) == (
            ("shufflenet_v2_x0_5", 16, True) if small else (own, 32, False)), name
    gpu = matrix.load_matrix(path, "smoke", None, gpus=1)
    assert {r["args"]["model"] for r in gpu} == {"resnet18", "vit_b_16"} and not any(r["emulated_half"] for r in gpu)


def test_distributed_config_is_what_multi_process_scripts_use():
    for entry in registry.SCRIPTS:
        cls = config_class(entry.file)
        assert issubclass(cls, DistributedConfig) == entry.distributed, entry.file


@pytest.mark.parametrize("name", sorted(matrix.LAUNCHER_MODULES))
def test_a_launcher_not_beside_python_runs_as_its_module(tmp_path, monkeypatch, name):
    """`pip install --target` (how a wheel reaches a GPU machine without an index) leaves deepspeed's script
    neither beside python nor on PATH: a GPU machine once lost every DeepSpeed run to that. The
    fallback must be the very module the installed script runs, and a module `python -m` can run."""
    import importlib.util
    from importlib.metadata import distribution, entry_points

    monkeypatch.setattr(matrix.sys, "executable", str(tmp_path / "python"))
    other = tmp_path / "other-env"  # a script on PATH may start its workers under another python: not taken
    other.mkdir()
    (other / name).write_text("#!/bin/sh\n")
    (other / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(other))
    module = matrix.LAUNCHER_MODULES[name]
    assert matrix.tool(name) == [str(tmp_path / "python"), "-m", module]
    points = [e.value for e in entry_points(group="console_scripts", name=name)]
    if points:  # torchrun, accelerate: setup.py entry points
        assert points[0].split(":")[0] == module
    else:  # deepspeed ships bin/deepspeed as a script file
        (path,) = [f for f in distribution(name).files if str(f).endswith(f"bin/{name}")]
        assert f"from {module} import main" in path.read_text()
    source = open(importlib.util.find_spec(module).origin).read()
    assert re.search(r"^if __name__ == .__main__.:\n\s+main\(\)", source, re.M)


def test_a_row_the_matrix_records_for_a_run_is_labelled_as_the_runner_labels(tmp_path):
    """A run killed or timed out gets the row it would have started (matrix.record_missing): its precision
    carries the script's label, as the runner's rows do (Script.labelled)."""
    from common.results import read_rows

    path = os.path.join(ROOT, "config", "benchmark.yaml")
    smoke = {r["name"]: r for r in matrix.load_matrix(path, "smoke", None, gpus=0)}
    csv = str(tmp_path / "s.csv")
    for name in ("smoke/pytorch_auto_mixed_precision", "smoke/pytorch_SingleGPU"):
        matrix.record_missing(smoke[name], "timeout", "killed", csv, 0)
    got = [r["precision"] for r in read_rows(csv)]
    assert got == ["amp_bf16", "fp32"], got
    assert registry.BY_FILE["pytorch_half_precision.py"].labelled("fp16+bn32") == "pure_fp16+bn32"
    assert registry.BY_FILE["accelerate_DDP.py"].labelled("bf16") == "bf16"  # accelerate's: as given


@pytest.mark.parametrize("preset, run, shown", [
    ("timeout_s: abc", "", "'abc'"), ("timeout_s: 0", "", "0"), ("timeout_s: .inf", "", "inf"),
    ("", ", timeout_s: true", "True"),
])
def test_a_timeout_that_is_not_seconds_is_refused_as_the_matrix_loads(tmp_path, preset, run, shown):
    """Refused with the file, before any run, not by the run's clock."""
    from common.config import UsageError

    path = tmp_path / "m.yaml"
    path.write_text(f"presets:\n  p:\n    {preset}\n    runs: [{{script: pytorch_SingleGPU.py{run}}}]\n")
    want = f"p/pytorch_SingleGPU's timeout_s must be a number of seconds > 0; got {shown}"
    with pytest.raises(UsageError, match=want):
        matrix.load_matrix(str(path), "p", None, gpus=0)


@pytest.mark.parametrize("preset, run, gpus, shown", [
    ("args: {nosuchflag: 3}", "pytorch_SingleGPU.py", 0, "pytorch_SingleGPU.py has no --nosuchflag"),
    ("", "pytorch_DeepSpeed.py, args: {compile: true}", 0, "pytorch_DeepSpeed.py has no --compile"),  # its OMIT
    ("", "pytorch_DDP.py, gpu_args: {sync-bn: true, shard: 2}", 2, "pytorch_DDP.py has no --shard"),
    ("", "pytorch_DDP.py, gpu_args: {shard: 2}", 0, "pytorch_DDP.py has no --shard"),  # on the CPU host too
    ("", "pytorch_DDP.py, cpu_args: {shard: 2}", 2, "pytorch_DDP.py has no --shard"),
    ("args: {sharding: hybrid}", "pytorch_DDP.py", 0, "pytorch_DDP.py has no --sharding"),  # pytorch_FSDP.py's
])
def test_an_arg_the_script_has_no_flag_for_is_refused_as_the_matrix_loads(tmp_path, preset, run, gpus, shown):
    """A typo was a failed row per run, each after its launch's start-up, and a matrix that exits 0."""
    from common.config import UsageError

    path = tmp_path / "m.yaml"
    path.write_text(f"presets:\n  p:\n    {preset}\n    runs: [{{script: {run}}}]\n")
    with pytest.raises(UsageError, match=shown + r" \(python"):
        matrix.load_matrix(str(path), "p", None, gpus=gpus)


@pytest.mark.slow
@pytest.mark.beside
def test_every_script_s_flags_are_read_from_its_source_as_its_parser_builds_them():
    """scriptflags reads the config class from the source; the scripts, imported (torch, DeepSpeed: seconds, in
    a process of their own), build the parser whose flags the matrix's args must be."""
    from common.bench.scriptflags import script_flags

    code = ("import json, runpy, sys\nfrom common import config, runner\ngot, out = [], {}\n"
            "runner.launch = lambda main, file, cfg_cls=config.TrainConfig, **kw: got.append(cfg_cls)\n"
            "runner.launch_tool = lambda main, file, cfg_cls, **kw: got.append(cfg_cls)\n"
            "for f in sys.argv[1:]:\n"
            "    runpy.run_path(f, run_name='__main__')  # its launch(...) hands over the class it parses with\n"
            "    out[f] = sorted(a.dest for a in config.build_parser(got.pop(), '', ('fp32',))._actions\n"
            "                    if a.dest != 'help')\n"
            "print(json.dumps(out))\n")
    files = [s.file for s in registry.SCRIPTS] + ["model_inference.py"]
    proc = subprocess.run([sys.executable, "-c", code, *files], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {f: sorted(script_flags(f)) for f in files} == built


def test_an_arg_spelled_with_dashes_is_one_key_with_its_underscore_spelling(tmp_path):
    """batch-size in the preset and batch_size in the run were two keys: two --batch-size flags, the harness
    (world_size_runs, slurm.py) reading the other."""
    path = tmp_path / "m.yaml"
    path.write_text("presets:\n  p:\n    args: {batch-size: 32, sync-bn: true}\n"
                    "    runs: [{script: pytorch_DDP.py, args: {batch_size: 16}}]\n")
    (run,) = matrix.load_matrix(str(path), "p", None, gpus=0)
    assert run["args"] == {"batch_size": 16, "sync_bn": True}


@pytest.mark.parametrize("text, shown", [
    ("presets:\n  p: [1]\n", "preset p must be a mapping"),
    ("presets:\n  p:\n    args: [1]\n    runs: [{script: pytorch_DDP.py}]\n", "p's args must be a mapping"),
    ("presets:\n  p:\n    runs: [{script: pytorch_DDP.py, gpu_args: 5}]\n", "DDP.py's gpu_args must be a mapping"),
    ("presets:\n  p:\n    scripts: all\n    runs: [{script: pytorch_DDP.py, args: [1]}]\n", "args must be"),
    ("presets:\n  p:\n    runs: [3]\n", "run 3 names no script"),
])
def test_a_matrix_part_that_is_not_a_mapping_is_one_line(tmp_path, text, shown):
    """A list where the flags' mapping goes was a traceback (AttributeError, TypeError) on every load."""
    from common.config import UsageError

    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(UsageError, match=shown):
        matrix.load_matrix(str(path), "p", None, gpus=0)


def test_calibrate_reads_a_preset_spelled_with_dashes_as_its_runs_do(tmp_path):
    """calibrate read image_size and batch_size only: a preset's image-size: 32 ran at 32 px and was measured at
    224."""
    import benchmark
    from common.bench import calibrate

    path = tmp_path / "m.yaml"
    path.write_text("presets:\n  p:\n    args: {model: resnet18, image-size: 32, batch-size: 16}\n"
                    "    runs: [{script: pytorch_DDP.py}]\n")
    opts = benchmark.parse(["calibrate", "--matrix", str(path), "--preset", "p",
                            "--device", "cpu", "--out", str(tmp_path / "c.json")])
    p = calibrate._plan(opts)
    (run,) = matrix.load_matrix(str(path), "p", None, gpus=0)
    assert (p.image, p.batch, p.args["batch_size"]) == (32, 16, 16) == (run["args"]["image_size"],
                                                                        run["args"]["batch_size"], 16)


@pytest.mark.parametrize("omit, shown", [
    ("OMIT: ClassVar[tuple[str, ...]] = ('compile',)", None),  # as common/config.py spells it
    ("OMIT = ('compile',)", None),
    ("OMIT = TrainConfig.OMIT + ('compile',)", "its OMIT is not a literal tuple"),
])
def test_a_script_s_omit_is_read_however_it_is_written(tmp_path, omit, shown):
    """An annotated OMIT was skipped (the base's taken: the omitted flag accepted), a computed one a ValueError
    traceback on every matrix load."""
    from common.bench.scriptflags import script_flags
    from common.config import UsageError

    script = tmp_path / "s.py"
    script.write_text("from typing import ClassVar\nfrom common.config import TrainConfig\nfrom common.runner import "
                      f"launch\n\n\nclass Cfg(TrainConfig):\n    {omit}\n    extra: int = 0\n\n\n"
                      "launch(print, __file__, Cfg)\n")
    if shown:
        with pytest.raises(UsageError, match=shown):
            script_flags(str(script))
    else:
        assert "extra" in script_flags(str(script)) and "compile" not in script_flags(str(script))
        assert "compile" in script_flags("pytorch_SingleGPU.py")
