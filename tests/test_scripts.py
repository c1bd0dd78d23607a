"""Every training script x every precision it accepts, end to end on CPU: one valid row, loadable
fp32 weights, clear refusals. The cases come from the registry, so a new script or precision is
covered (or the completeness test below fails)."""
import functools
import glob
import math
import os

import pytest
import torch
import torchvision
from helpers import TINY, check_ok, half_size, one_line_error, pp_bytes_per_step, rows, run, run_at_once, tiny_args
from launches import HALF_MODEL, precisions_run
from test_comm import ddp_calls_per_step
from test_memory import check_model_state

from common.config import TrainConfig
from common.registry import BY_FILE, SCRIPTS
from common.results import COLUMNS

pytestmark = pytest.mark.slow

# CPU cannot run these; each refuses in one line instead (the row would otherwise lie)
REFUSED = {("accelerate_DDP.py", "fp16"): "would silently train in fp32",
           ("accelerate_FSDP.py", "fp32"): "needs CUDA devices"}


def cases():
    """Every script at every precision it accepts (launches.precisions_run: a script that needs CUDA once)."""
    return [pytest.param(s, p, id=f"{s.name}-{p}") for s in SCRIPTS for p in precisions_run(s)]


def check_row(row, script, world, precision, steps=4):
    assert row["script"] == script and row["status"] == "ok", (row["status"], row["error"])
    assert int(row["world_size"]) == world and list(row) == COLUMNS
    assert int(row["test_samples"]) == 37  # 37 divides by neither 2 nor 3: nothing dropped or doubled
    # one warm-up step outside the window; at several ranks the --comm-steps profiled after it too, unless no
    # other steps are left (common/train.py)
    profiled = TrainConfig.comm_steps if world > 1 and steps - 1 > TrainConfig.comm_steps else 0
    assert int(row["steps"]) == steps and int(row["timed_steps"]) == steps - 1 - profiled
    assert float(row["train_time_s"]) > 0 and float(row["throughput_img_s"]) > 0
    assert math.isfinite(float(row["train_loss"])) and 0 <= float(row["test_accuracy"]) <= 1
    label = row["precision"]
    assert label == "fp32" if precision == "fp32" else label.startswith(BY_FILE[script].label + precision), label
    for col in ("peak_allocated_gib", "peak_reserved_gib", "peak_nvml_gib", "gpu_util_mean", "gpu_util_peak",
                "cuda_version", "cudnn_version", "nccl_version", "driver_version"):
        assert row[col] == "", col  # CPU: empty, never a fake zero
    assert row["device"] == "cpu" and row["torch_version"] == torch.__version__
    assert float(row["loader_img_s"]) > 0 and int(row["cpu_threads"]) >= 1 and row["workers"] == "0"  # helpers.TINY
    check_model_state(row)  # measured model state within 1% (5% DeepSpeed, accelerate) of the prediction
    check_time(row)


def check_time(row):
    """The step components tile the window (docs/time.md); the prediction is filled or says why not."""
    parts = [float(row[c]) for c in ("step_data_ms", "step_compute_ms", "step_comm_exposed_ms", "step_optimizer_ms",
                                     "step_other_ms")]
    assert min(parts) >= 0 and sum(parts) == pytest.approx(float(row["step_ms_mean"]), abs=0.01)
    if int(row["world_size"]) == 1:  # the window's time per step, as throughput counts it
        want = int(row["global_batch_size"]) / float(row["throughput_img_s"]) * 1e3
        assert float(row["step_ms_mean"]) == pytest.approx(want, rel=0.05)
    # (several ranks: step_ms_mean is their mean, throughput rank 0's window; these runs' 3 timed steps hold
    # the communication profiler's trace processing, which takes each rank its own time)
    predicted = [row[f"pred_{p}_ms"] for p in ("data", "compute", "comm_exposed", "optimizer")]
    if row["pred_step_ms"]:  # a results/calibration.json of this machine covers the run
        assert float(row["pred_img_s"]) == pytest.approx(int(row["global_batch_size"]) / float(row["pred_step_ms"])
                                                          * 1e3, rel=1e-3)
        assert sum(map(float, predicted)) == pytest.approx(float(row["pred_step_ms"]), abs=0.01)
    else:
        assert "pred_step_ms: " in row["notes"], row["notes"]
        assert predicted == [""] * 4
    # the host's share (common/measure/host.py): Linux's /proc on every host these tests run on; the tests
    # beside a shared launch make "other" anything from 0 to most of the host
    share = [float(row[c]) for c in ("host_other_pct", "host_steal_pct")]
    share += [float(row["cpu_wait_pct"])] if row["cpu_wait_pct"] else []  # empty without schedstats (gVisor)
    assert all(0 <= v <= 100 for v in share), share


def load_bare(final, model="resnet18", image_size=None):
    """The checkpoint's state_dict, after loading it strictly into a bare torchvision model. The same file
    (unchanged since) is read once: several tests compare with one reference run's 343 MB ViT."""
    stat = os.stat(final)
    return _load_bare(str(final), stat.st_mtime_ns, stat.st_size, model, image_size)


@functools.lru_cache(maxsize=4)
def _load_bare(final, _mtime, _size, model, image_size):
    from common.models import size_kwargs

    sd = torch.load(final, map_location="cpu", weights_only=True)
    bare = getattr(torchvision.models, model)(num_classes=10, **dict(size_kwargs(model, image_size)))
    bare.load_state_dict(sd)  # strict: no prefixes, nothing missing
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())
    return sd


@pytest.mark.parametrize("entry, precision", cases())
@pytest.mark.launches("{entry.name}-{precision}")
def test_every_script_and_precision(runs, entry, precision):
    (r,) = runs
    if (entry.file, precision) in REFUSED:
        assert r.proc.returncode != 0 and REFUSED[entry.file, precision] in r.proc.stderr, r.proc.stderr[-2000:]
        assert r.rows == []
        return
    check_ok(r.proc)
    row, extra = r.row, dict(r.launch.over)
    assert row["model"] == extra.get("model", "resnet18")
    flags = {**TINY, **r.launch.flags()}  # the ViT cases train 2 steps (tests/launches.py VIT_STEPS)
    check_row(row, entry.file, r.launch.nproc, precision, int(flags["train_samples"]) // int(flags["batch_size"]))
    assert r.resume_saved  # the epoch checkpoint of --resume was written (deleted since: disk)
    if "deepspeed_config" in extra:
        assert row["strategy"].endswith(f"zero{extra['deepspeed_config'][-13]}")  # ..._stageN_config.json
        assert row["deepspeed_version"]
    if entry.launcher == "accelerate":
        assert row["accelerate_version"]
    if entry.file == "pytorch_DDP.py" and precision == "fp32":  # one all-reduce per bucket, and nothing else
        assert float(row["comm_calls_per_step"]) == round(ddp_calls_per_step(3, rebuild_in_window=True), 3)
    if entry.file == "pytorch_PP.py":  # the activation at the cut and its gradient, nothing else
        want = pp_bytes_per_step("resnet18", 32, int(row["global_batch_size"]))
        assert float(row["comm_bytes_per_step"]) == want, row["comm_bytes_per_step"]
    if precision == "fp16" and entry.file != "pytorch_half_precision.py":
        # a GradScaler (or DeepSpeed's loss scaler) ran, was counted, and let some steps update the weights
        assert 0 <= int(row["skipped_steps"]) < int(row["steps"]), (row["skipped_steps"], row["steps"])
    load_bare(r.final(), row["model"], int(row["image_size"]))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.launches("accelerate_FSDP-twin-{precision}")
def test_accelerate_fsdp_cpu_twin(runs, precision):
    """accelerate's own FSDP2 path (prepare of model and optimizer together, the wrap policy from the
    model's block class, mixed precision with BatchNorm statistics in fp32), forced on over gloo."""
    (r,) = runs
    check_ok(r.proc)
    check_row(r.row, "accelerate_FSDP.py", 2, precision)
    load_bare(r.final(), r.row["model"])


def test_deepspeed_refuses_a_dtype_its_accelerator_lacks(tmp_path, monkeypatch):
    """One line before the engine is built, instead of DeepSpeed's traceback from _do_sanity_check."""
    from deepspeed.accelerator import get_accelerator

    from common.config import TrainConfig, UsageError
    from common.deepspeed_config import resolve_ds_config

    path = tmp_path / "z2.json"
    path.write_text('{"zero_optimization": {"stage": 2}}')
    resolve = lambda precision: resolve_ds_config(TrainConfig(batch_size=16, precision=precision), str(path),  # noqa: E731
                                                  world_size=2, micro_batch=8)[1]
    acc = get_accelerator()
    monkeypatch.setattr(type(acc), "is_fp16_supported", lambda self: False)
    with pytest.raises(UsageError, match="DeepSpeed does not support fp16 on this cpu device"):
        resolve("fp16")
    assert resolve("bf16") == "bf16"
    monkeypatch.setattr(type(acc), "is_fp16_supported", lambda self: True)
    assert resolve("fp16") == "fp16"


@pytest.mark.launches("pytorch_DeepSpeed-launcher")
def test_deepspeed_launcher(runs):
    (r,) = runs
    check_ok(r.proc)
    check_row(r.row, "pytorch_DeepSpeed.py", 2, "fp32")
    # under its launcher (LOCAL_SIZE = the world) each rank's backend made a 66 MB buffer in /dev/shm,
    # which DeepSpeed never unlinks; the run's cleanup does (common/distributed.py release_deepspeed_shm)
    port = r.proc.args[r.proc.args.index("--master_port") + 1]
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")


DS_REFUSALS = [
    ('{"train_batch_size": 64}', "train_batch_size is 64 but the flags give 16"),
    ('{"gradient_accumulation_steps": 2}', "or 1 (the DeepSpeed scripts do not accumulate gradients)"),
    ('{"optimizer": {"type": "Adam", "params": {"lr": 0.001}}}', "defines a optimizer"),
    ('{"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": false}}',
     "stage3_gather_16bit_weights_on_model_save is false"),
]


@pytest.fixture(scope="module")
def ds_refused(tmp_path_factory):
    """pytorch_DeepSpeed.py on the first bad JSON of DS_REFUSALS, with a flag it does not take (--compile), and on a
    JSON it cannot read, started together (helpers.run_at_once): {key: (its folder, its process)}."""
    root = tmp_path_factory.mktemp("ds_refused")
    (root / "json").mkdir()
    (root / "json" / "ds.json").write_text(DS_REFUSALS[0][0])
    jobs = {"json": ("pytorch_DeepSpeed.py", tiny_args(root / "json", deepspeed_config=str(root / "json" / "ds.json")))}
    jobs["compile"] = ("pytorch_DeepSpeed.py", tiny_args(root / "compile") + ["--compile"])
    (root / "notjson").mkdir()
    (root / "notjson" / "ds.json").write_text("{zero: 2")
    for key, path in (("missing", root / "no_such.json"), ("notjson", root / "notjson" / "ds.json")):
        jobs[key] = ("pytorch_DeepSpeed.py", tiny_args(root / key, deepspeed_config=str(path)))
    return {k: (root / str(k), proc) for k, proc in run_at_once(jobs).items()}


@pytest.mark.beside  # in pytest's process: one core, no timing
@pytest.mark.parametrize("content, words", DS_REFUSALS, ids=[c for c, _ in DS_REFUSALS])
def test_deepspeed_json_refusals(tmp_path, content, words):
    """Each refusal of the JSON by the function both DeepSpeed scripts read it with (common/deepspeed_config.py), at
    TINY's batch on one process; the first also through the script itself, below."""
    from common.config import UsageError
    from common.deepspeed_config import resolve_ds_config

    path = tmp_path / "ds.json"
    path.write_text(content)
    with pytest.raises(UsageError) as err:
        resolve_ds_config(TrainConfig(batch_size=16), str(path), world_size=1, micro_batch=16)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_deepspeed_json_refusal_is_one_line_and_no_row(ds_refused):
    """Refused after the process group and DeepSpeed's comm layer started (pytorch_DeepSpeed.py main): one line
    all the same, and no row."""
    folder, proc = ds_refused["json"]
    assert DS_REFUSALS[0][1] in one_line_error(proc)
    assert rows(folder / "summary.csv") == []


@pytest.mark.parametrize("key, words", [("missing", "DeepSpeed config not found: "),
                                        ("notjson", "is not valid JSON")])
def test_a_deepspeed_json_that_cannot_be_read_is_one_line_before_deepspeed_starts(ds_refused, key, words):
    """Read before the process group and DeepSpeed's comm layer, whose op build on a CPU warned on stderr first
    (torch's cpp_extension: "No CUDA runtime is found")."""
    folder, proc = ds_refused[key]
    assert words in one_line_error(proc)
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert rows(folder / "summary.csv") == []


def test_zero3_gathers_the_final_weights_unless_told_not_to(tmp_path):
    """accelerate's get_state_dict raises under ZeRO-3 unless the 16-bit weights are gathered on
    save: a stage-3 JSON that does not say so gets the flag set, so model_final.pt can be written."""
    from common.config import TrainConfig
    from common.deepspeed_config import resolve_ds_config

    path = tmp_path / "z3.json"
    path.write_text('{"zero_optimization": {"stage": 3}}')
    ds, _ = resolve_ds_config(TrainConfig(batch_size=16), str(path), world_size=2, micro_batch=8)
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_deepspeed_without_zero_writes_the_final_weights(tmp_path):
    """A JSON with no zero_optimization section is stage 0: no ZeRO checkpoint files exist for
    zero_to_fp32 to read (it raised after training); the whole model is on every rank instead."""
    path = tmp_path / "plain.json"
    path.write_text("{}")
    check_ok(run("pytorch_DeepSpeed.py", tiny_args(tmp_path, deepspeed_config=str(path)), nproc=2, launcher="torchrun"))
    (row,) = rows(tmp_path / "summary.csv")
    assert row["status"] == "ok" and row["strategy"] == "deepspeed_zero0", row
    load_bare(tmp_path / "ckpt" / "pytorch_DeepSpeed" / "model_final.pt")


def test_deepspeed_refuses_flags_it_does_not_use(ds_refused):
    _, proc = ds_refused["compile"]
    assert "unrecognized arguments: --compile" in one_line_error(proc)


@pytest.fixture(scope="module")
def refused_under_torchrun(tmp_path_factory):
    """Two 2-rank launches that refuse, started together (helpers.run_at_once): {key: (folder, process)}."""
    root = tmp_path_factory.mktemp("refused_torchrun")
    two = {"launcher": "torchrun", "nproc": 2}
    got = run_at_once({"batch": ("pytorch_DDP.py", tiny_args(root / "batch", batch_size=15), two),
                       "single": ("pytorch_SingleGPU.py", tiny_args(root / "single"), two)})
    return {k: (root / k, proc) for k, proc in got.items()}


def test_global_batch_must_divide_world(refused_under_torchrun):
    folder, proc = refused_under_torchrun["batch"]
    assert proc.returncode != 0 and "does not divide by world size 2" in proc.stderr
    assert rows(folder / "summary.csv") == []


def test_single_device_script_refuses_torchrun(refused_under_torchrun):
    folder, proc = refused_under_torchrun["single"]
    assert proc.returncode != 0 and "use pytorch_DDP.py" in proc.stderr
    assert rows(folder / "summary.csv") == []


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """The one-process trainings of the two tests below, all started together (helpers.run_at_once): each keeps
    one core busy with its imports and one-thread steps, and neither test checks a timing against another run.
    A small learning rate for the compile pair: at 0.05 these 4 steps are unstable enough that inductor's
    rounding alone moved the loss by 1e-2 on an AMD EPYC; at 1e-3 both give the same loss to 1e-6, while a
    warm-up gradient left in place moves it by 4e-4."""
    root = tmp_path_factory.mktemp("one_process")
    jobs = {"learns": tiny_args(root / "learns", epochs=2, train_samples=1024, test_samples=500, batch_size=64,
                                warmup_steps=5, target_accuracy=0.3),
            "plain": tiny_args(root / "plain", lr=1e-3),
            "compiled": tiny_args(root / "compiled", compile=True, lr=1e-3)}
    got = run_at_once({k: ("pytorch_SingleGPU.py", args) for k, args in jobs.items()}, timeout=600)
    return {k: (proc, root / k) for k, proc in got.items()}


@pytest.mark.beside
def test_training_learns_on_synthetic_data(one_process_runs):
    proc, folder = one_process_runs["learns"]
    check_ok(proc)
    (row,) = rows(folder / "summary.csv")
    assert float(row["test_accuracy"]) > 0.5, row  # chance is 0.1
    # reached at an epoch end: no later than the whole training time
    assert 0 < float(row["time_to_target_s"]) <= float(row["train_time_s"])


@pytest.mark.beside
def test_compile_time_kept_apart_and_same_training(one_process_runs):
    (plain, plain_dir), (compiled, compiled_dir) = one_process_runs["plain"], one_process_runs["compiled"]
    check_ok(plain)
    check_ok(compiled)
    (a,), (b,) = rows(plain_dir / "summary.csv"), rows(compiled_dir / "summary.csv")
    assert a["compile_time_s"] == "" and float(b["compile_time_s"]) > float(b["train_time_s"])
    # the compile warm-up step leaves no trace: same start, same updates (up to kernel rounding)
    assert abs(float(a["train_loss"]) - float(b["train_loss"])) < 1e-4


def test_deepspeed_bf16_counts_the_steps_it_skips(tmp_path):
    """DeepSpeed skips a bf16 (or fp32) step whose gradients are not finite as it does an fp16 one
    (engine.py: skipped_steps += 1 whenever the optimizer reports overflow): the row counts them, and
    when every timed step was skipped the empty model state says why. Step 3 poisoned, and all 4: the
    two runs at once, one rank each (the engine's count does not depend on the world size)."""
    cases = {"3": 1, "1,2,3,4": 4}
    got = run_at_once({p: ("tests/twins/nonfinite_grad.py", ["pytorch_DeepSpeed.py"] + tiny_args(
        tmp_path / str(n), precision="bf16", model=HALF_MODEL, **half_size("bf16")),
        {"launcher": "torchrun", "nproc": 1, "env": {"NONFINITE_AT": p}}) for p, n in cases.items()})
    for poisoned, skipped in cases.items():
        check_ok(got[poisoned])
        (row,) = rows(tmp_path / str(skipped) / "summary.csv")
        assert row["status"] == "ok" and row["precision"] == "ds_bf16", row
        assert int(row["skipped_steps"]) == skipped, (poisoned, row["skipped_steps"])
        if skipped == 4:  # every step skipped: no update for the model-state walk to measure
            assert row["model_state_gib"] == "" and "no optimizer update" in row["notes"], row["notes"]
        else:
            assert float(row["model_state_gib"]) > 0 and "model_state_gib" not in row["notes"], row["notes"]
