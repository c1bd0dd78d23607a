"""benchmark.py: the smoke preset end to end, failures recorded, reruns skipped, report from bad CSVs."""
import os
import signal
import subprocess
import sys

import pytest
from helpers import ROOT, proc_stat, rows, run_at_once

from common.registry import BY_FILE, SCRIPTS
from common.report import update_readme, write_report
from common.results import append_row

# one script per launcher the matrix uses on a CPU (python, torchrun, deepspeed; an accelerate script runs under
# torchrun there: matrix.launcher), and accelerate_FSDP.py, which needs CUDA: its skipped row stands for the
# accelerate launcher (accelerate_DeepSpeed.py goes through `accelerate launch` in tests/test_slurm.py's template)
LAUNCHER_SAMPLE = ["pytorch_SingleGPU.py", "pytorch_DDP.py", "pytorch_DeepSpeed.py", "accelerate_FSDP.py"]


def bench(tmp_path, *args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "benchmark.py", "--results", str(tmp_path / "summary.csv"),
                           "--report", str(tmp_path / "REPORT.md"), "--log-dir", str(tmp_path / "logs"),
                           "--save-dir", str(tmp_path / "ckpt"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def _running(marker: str) -> list[int]:
    """The processes whose command line holds marker."""
    out = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if marker.encode() in fh.read():
                    out.append(int(pid))
        except OSError:
            continue
    return out


def _cpu_s(pid: int) -> float:
    got = proc_stat(pid)
    return 0.0 if got is None else (int(got[1][11]) + int(got[1][12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.slow
def test_a_stopped_matrix_stops_its_launch(tmp_path):
    """The launches run in sessions of their own (a timeout kills the whole session): stopped by SIGTERM (timeout,
    scancel; Ctrl-C takes the same path), benchmark.py stops torchrun and its ranks instead of leaving them
    training. A run that prints dies of its closed pipe at its next line, so this one is stopped inside 1000 quiet
    steps: no progress lines, no profiler, past its start-up (6 s of CPU a rank)."""
    import time

    matrix, marker = tmp_path / "m.yaml", str(tmp_path / "ckpt")
    matrix.write_text("presets:\n  t:\n    args: {dataset: synthetic, pretrained: false, model: resnet18, "
                      "image_size: 32, epochs: 1, batch_size: 16, train_samples: 16000, workers: 0, log_every: 0, "
                      "comm_steps: 0, loader_probe_batches: 0}\n    runs: [{script: pytorch_DDP.py}]\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "benchmark.py", "--preset", "t", "--matrix", str(matrix),
                             "--results", str(tmp_path / "s.csv"), "--log-dir", str(tmp_path / "logs"),
                             "--save-dir", marker, "--report", str(tmp_path / "R.md")],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks, deadline = [], time.time() + 180
    while time.time() < deadline and not (len(ranks) == 2 and min(map(_cpu_s, ranks)) > 6):
        ranks = [p for p in _running(marker) if "pytorch_DDP.py" in open(f"/proc/{p}/cmdline").read()
                 and "torchrun" not in open(f"/proc/{p}/cmdline").read()]
        time.sleep(0.5)
    assert len(ranks) == 2 and proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.time() + 20
    while _running(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert _running(marker) == []


@pytest.mark.beside
@pytest.mark.slow
def test_failures_are_recorded_and_the_matrix_goes_on(tmp_path):
    matrix = tmp_path / "m.yaml"
    matrix.write_text("""presets:
  t:
    timeout_s: 120
    args: {dataset: synthetic, pretrained: false, model: resnet18, image_size: 32, epochs: 1, batch_size: 16,
           train_samples: 64, test_samples: 20, workers: 0, log_every: 0}
    runs:
      - {name: bad_model, script: pytorch_SingleGPU.py, args: {model: resnet5000}}
      - {name: too_slow, script: pytorch_SingleGPU.py, args: {epochs: 50, train_samples: 5000}, timeout_s: 3}
      - {name: diverges, script: pytorch_SingleGPU.py, args: {lr: 1.0e+30, max_nonfinite_steps: 1, log_every: 1}}
      - {name: fine, script: pytorch_SingleGPU.py}
""")
    proc = bench(tmp_path, "--preset", "t", "--matrix", str(matrix))
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_name = {r["run_name"]: r for r in rows(tmp_path / "summary.csv")}
    assert by_name["t/bad_model"]["status"] == "failed" and "resnet5000" in by_name["t/bad_model"]["error"]
    assert by_name["t/too_slow"]["status"] == "timeout"
    assert by_name["t/diverges"]["status"] == "diverged" and "non-finite" in by_name["t/diverges"]["error"]
    assert by_name["t/fine"]["status"] == "ok"
    assert len(rows(tmp_path / "summary.csv")) == 4  # the script's own row is not doubled
    assert "not ok: t/bad_model: failed" in (tmp_path / "REPORT.md").read_text().lower()


def test_report_from_partial_and_failed_rows(tmp_path):
    csv = str(tmp_path / "s.csv")
    append_row(csv, {"script": "pytorch_SingleGPU.py", "precision": "fp32", "status": "ok", "device_name": "GPU X",
                     "model": "resnet50", "image_size": 224, "throughput_img_s": 100.0, "peak_allocated_gib": 10.0,
                     "test_accuracy": 0.8, "tf32": False})
    append_row(csv, {"script": "pytorch_DDP.py", "precision": "amp_bf16", "status": "ok", "device_name": "GPU X",
                     "model": "resnet50", "image_size": 224, "throughput_img_s": 250.0, "peak_allocated_gib": 5.0,
                     "world_size": 2})
    append_row(csv, {"script": "pytorch_FSDP.py", "status": "oom", "device_name": "GPU X", "model": "resnet50",
                     "image_size": 224, "error": "CUDA out of memory"})
    append_row(csv, {"script": "pytorch_DP.py", "status": "failed"})  # almost everything missing
    write_report(csv, str(tmp_path / "R.md"), os.path.join(ROOT, "results", "reference.csv"))
    text = (tmp_path / "R.md").read_text()
    assert "2.50x" in text and "0.50x" in text  # speed-up and memory ratio against single fp32
    assert "oom (CUDA out of memory)" in text and "pytorch_DP" in text


def test_report_says_which_runs_ran_reference_kernels(tmp_path):
    """A half-precision row on a CPU without native kernels carries the Flops instrument's note; the report's
    section names those runs and why their time is the CPU's; a section without such rows says nothing."""
    from common.measure.flops import REFERENCE_KERNELS

    csv = str(tmp_path / "s.csv")
    base = {"status": "ok", "device_name": "CPU X", "image_size": 16, "dataset": "synthetic", "global_batch_size": 32,
            "model": "shufflenet_v2_x0_5", "throughput_img_s": 50.0}
    append_row(csv, {**base, "script": "pytorch_half_precision.py", "run_name": "smoke/pytorch_half_precision",
                     "precision": "pure_bf16", "notes": f"bf16 {REFERENCE_KERNELS}: this CPU has no native ..."})
    append_row(csv, {**base, "script": "pytorch_auto_mixed_precision.py", "precision": "amp_bf16",
                     "run_name": "smoke/pytorch_auto_mixed_precision", "notes": "something else"})
    append_row(csv, {**base, "script": "pytorch_SingleGPU.py", "precision": "fp32", "model": "resnet18",
                     "run_name": "smoke/pytorch_SingleGPU", "image_size": 32})
    text = open(write_report(csv, str(tmp_path / "R.md"))).read()
    lines = [ln for ln in text.splitlines() if ln.startswith("Reference kernels:")]
    assert lines == [lines[0]] and "smoke/pytorch_half_precision ran pure_bf16 on torch's reference" in lines[0]
    assert "auto_mixed" not in lines[0] and "cpu_emulated_half_args" in lines[0]


def test_readme_figures_put_the_articles_beside_the_newest_gpu_campaign(tmp_path):
    """The README's results table: per articles' run, the newest GPU campaign's row of its script at the
    articles' setup (the default run over a TF32 one), never a CPU row, another setup or another GPU than the
    newest row's (a folder name is no clock: the rows' timestamps order them); a provenance line per
    campaign used."""
    readme, camps = tmp_path / "README.md", tmp_path / "campaigns"
    readme.write_text("# x\n<!-- scripts:start -->\n<!-- scripts:end -->\n<!-- figures:start -->\nold\n"
                      "<!-- figures:end -->\ntail\n")
    gpu = {"status": "ok", "device": "cuda", "device_name": "GPU X", "model": "resnet50", "image_size": 224,
           "global_batch_size": 128, "num_devices": 1, "precision": "fp32", "driver_version": "580.1",
           "torch_version": "2.11", "timestamp": "2026-02-01T00:00:00+00:00"}
    older = {**gpu, "device_name": "GPU Y", "timestamp": "2026-01-20T00:00:00+00:00"}
    for name, rows_ in {
        "2026-01-01_gpux_throughput": [{**gpu, "script": "pytorch_DDP.py", "run_name": "t/pytorch_DDP",
                                        "step_ms_p50": 100.0, "throughput_img_s": 1280.0,
                                        "timestamp": "2026-01-01T00:00:00+00:00"}],
        # named after the newest, measured before it, on another GPU: none of its rows is used
        "2026-02-01_gpuy_throughput": [{**older, "script": "pytorch_DP.py", "throughput_img_s": 6666.0,
                                        "run_name": "t/pytorch_DP"}],
        "2026-02-01_gpux_throughput": [
            {**gpu, "script": "pytorch_DDP.py", "run_name": "t/pytorch_DDP", "step_ms_p50": 90.0,
             "throughput_img_s": 1422.2, "peak_allocated_gib": 3.3},
            {**gpu, "script": "pytorch_SingleGPU.py", "run_name": "t/pytorch_SingleGPU", "throughput_img_s": 900.0},
            {**gpu, "script": "pytorch_SingleGPU.py", "run_name": "t/single_tf32", "tf32": True,
             "throughput_img_s": 1800.0},
            {**gpu, "script": "pytorch_FSDP.py", "run_name": "t/pytorch_FSDP", "global_batch_size": 256,
             "throughput_img_s": 7777.0}],
        "2026-03-01_cpu_grid": [{**gpu, "device": "cpu", "device_name": "CPU Y", "script": "pytorch_DP.py",
                                 "run_name": "t/pytorch_DP", "throughput_img_s": 5555.0}],
    }.items():
        (camps / name).mkdir(parents=True)
        for r in rows_:
            append_row(str(camps / name / "summary.csv"), r)
    update_readme(str(readme), str(camps), os.path.join(ROOT, "results", "reference.csv"))
    text = readme.read_text()
    lines = {ln.split(" | ")[0]: ln for ln in text.splitlines() if ln.startswith("| ")}
    ddp = lines["| DDP"]
    assert "| 3.12 | 560 | 446 |" in ddp and "2026-02-01_gpux_throughput" in ddp and "| 90.0 | 1422 | 3.30 |" in ddp
    assert "| 900 |" in lines["| single GPU fp32"] and "1800" not in text
    for run in ("| FSDP", "| DataParallel"):  # another setup, a CPU row
        assert "not measured yet" in lines[run], lines[run]
    assert "5555" not in text and "7777" not in text and "6666" not in text and "GPU Y" not in text
    assert "old" not in text and text.endswith("tail\n")
    assert "- [2026-02-01_gpux_throughput](results/campaigns/2026-02-01_gpux_throughput/): GPU X, driver 580.1, " \
           "torch 2.11" in text and "2026-01-01" not in text


def test_the_committed_report_sample_is_what_report_writes(tmp_path):
    """results/sample/REPORT.md is generated from a committed campaign by the README's one command: a change to the
    report (or to the campaign) that leaves the sample stale fails here."""
    from common.report import REPORT_SAMPLE, SAMPLE_COMMAND

    got = write_report(os.path.join(ROOT, REPORT_SAMPLE), str(tmp_path / "REPORT.md"),
                       os.path.join(ROOT, "results", "reference.csv"))
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert f"<!-- sample:start -->\n`{SAMPLE_COMMAND}`\n<!-- sample:end -->" in readme
    sample = os.path.join(ROOT, "results", "sample")
    with open(os.path.join(sample, "REPORT.md")) as fh:
        assert fh.read() == open(got).read(), "results/sample/REPORT.md is stale: run the README's command"
    assert sorted(os.listdir(tmp_path / "charts")) == sorted(os.listdir(os.path.join(sample, "charts")))


def test_report_of_an_empty_or_missing_csv(tmp_path):
    write_report(str(tmp_path / "none.csv"), str(tmp_path / "R.md"))
    assert "No runs yet" in (tmp_path / "R.md").read_text()


TOOLS = [
    ["benchmarks/loader_throughput.py", "--image-size", "64", "--batch-size", "8", "--workers", "0", "--batches", "3",
     "--warmup", "1"],
    ["benchmarks/profile_step.py", "--model", "resnet18", "--image-size", "32", "--batch-size", "8", "--steps", "2",
     "--workers", "0"],
    ["benchmarks/loop_overhead.py", "--steps", "3", "--warmup", "1", "--rounds", "1", "--batch-size", "8"],
]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """TOOLS, the seed preset's dry run and an unknown preset: processes that each spend most of their time
    importing torch on one core, started together (helpers.run_at_once). {key: CompletedProcess}"""
    root = tmp_path_factory.mktemp("quick")
    out = ["--results", str(root / "summary.csv"), "--report", str(root / "REPORT.md"), "--log-dir", str(root / "logs"),
           "--save-dir", str(root / "ckpt")]
    jobs = {i: (cmd[0], cmd[1:]) for i, cmd in enumerate(TOOLS)}
    jobs.update(seed=("benchmark.py", [*out, "--preset", "seed", "--dry-run"]),
                nope=("benchmark.py", [*out, "--preset", "nope"]))
    return run_at_once(jobs)


@pytest.mark.slow
def test_unknown_preset_one_line(quick):
    proc = quick["nope"]
    assert proc.returncode == 2 and "unknown preset 'nope'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(TOOLS)), ids=[c[0].split("/")[1][:-3] for c in TOOLS])
def test_benchmark_tools_run(quick, i):
    """They run and print their figure (no timing is asserted: measuring is their job, not the tests')."""
    proc = quick[i]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "img/s" in proc.stdout or "ratio fit/bare" in proc.stdout


@pytest.mark.slow
def test_seed_preset_commands(quick):
    """The articles' matrix, printed not run: launchers, process count and per-GPU batch-1 runs."""
    proc = quick["seed"]
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ".py" in ln and "--run-name" in ln]
    assert len(lines) == 19
    tp = next(ln for ln in lines if "pytorch_TP.py" in ln)  # tensor parallelism needs attention heads: a ViT
    assert "--model vit_b_16" in tp and "torchrun --nproc_per_node 2" in tp
    fsdp1 = next(ln for ln in lines if "seed/fsdp_batch1" in ln)
    assert "torchrun --nproc_per_node 2" in fsdp1 and "--batch-size 2 " in fsdp1  # 1 image per process
    assert any("deepspeed --num_gpus 2" in ln and "pytorch_DeepSpeed.py" in ln for ln in lines)
    assert all("--pretrained" in ln and "--dataset cifar10" in ln for ln in lines)


@pytest.mark.beside
@pytest.mark.slow
def test_doctor_on_cpu(tmp_path):
    """On a CPU-only machine: one line saying so, the environment, the runs, every check passing, exit 0.
    Also the smoke preset end to end through benchmark.py: one script per launcher (python, torchrun,
    deepspeed, accelerate launch with a DeepSpeed config) and one that needs CUDA, the report, its
    charts, and a rerun skipped. Every script itself runs in test_scripts.py. The preset's own arguments
    cut to 4 steps (the doctor at its full size runs in the GPU tier)."""
    import yaml

    smoke = yaml.safe_load(open(os.path.join(ROOT, "config", "benchmark.yaml")))["presets"]["smoke"]
    smoke["args"].update(train_samples=128, test_samples=40, epochs=1)
    matrix = tmp_path / "m.yaml"
    matrix.write_text(yaml.safe_dump({"presets": {"smoke": smoke}}))
    proc = subprocess.run([sys.executable, "benchmark.py", "doctor", "--only", ",".join(LAUNCHER_SAMPLE),
                           "--matrix", str(matrix),
                           "--results", str(tmp_path / "summary.csv"), "--report", str(tmp_path / "REPORT.md"),
                           "--save-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "logs")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "no CUDA device: the GPU checks are skipped" in out
    for key in ("torch", "CUDA (torch build)", "cuDNN", "NCCL", "driver", "deepspeed ops", "accelerate config"):
        assert f"{key}:" in out
    assert "| smoke/pytorch_DDP: GPU columns empty on CPU | pass |" in out
    assert "| smoke/accelerate_FSDP: one row, status skipped | pass |" in out
    assert "FAIL" not in out and ", 0 fail" in out

    got = {r["script"]: r for r in rows(tmp_path / "summary.csv")}
    assert sorted(got) == sorted(LAUNCHER_SAMPLE)
    assert {BY_FILE[s].launcher for s in got} == {s.launcher for s in SCRIPTS}
    for script, r in got.items():
        expected = "skipped" if BY_FILE[script].needs_cuda else "ok"  # accelerate's FSDP needs CUDA
        assert r["status"] == expected, (script, r["status"], r["error"])
    assert "step=4/4" in out and "img_s=" in out  # live progress: the runs' own lines, echoed
    report = (tmp_path / "REPORT.md").read_text()
    assert "smoke/pytorch_DeepSpeed" in report and "Published figures" in report and "Tesla P40" in report
    charts = os.listdir(tmp_path / "charts")
    assert any(c.endswith("throughput_img_s.png") for c in charts)
    assert any(c.endswith("test_accuracy.png") for c in charts)
    again = bench(tmp_path, "--preset", "smoke", "--matrix", str(matrix), "--only", "pytorch_SingleGPU.py")
    assert "already in" in again.stdout and len(rows(tmp_path / "summary.csv")) == len(LAUNCHER_SAMPLE)


def test_memory_chart_draws_the_rows_own_prediction():
    """A DataParallel row's prediction is made with the GPU count its process drives, which the row's
    world_size (1) does not say: the chart takes the row's pred_*_gib, and rebuilds only old rows."""
    import pandas as pd

    from common.report import _predicted_parts

    row = pd.Series({"pred_params_gib": 0.1, "pred_grads_gib": 0.1, "pred_optimizer_gib": 0.1,
                     "pred_master_gib": 0.0, "pred_comm_gib": 0.5, "pred_activation_gib": 1.0, "pred_peak_gib": 1.8,
                     "script": "pytorch_DP.py", "strategy": "dp", "world_size": 1.0})
    parts = _predicted_parts(row)
    assert parts["comm"] == 0.5 and parts["backward"] == pytest.approx(0.1)
    old = row.drop(["pred_params_gib", "pred_grads_gib", "pred_optimizer_gib", "pred_master_gib", "pred_comm_gib"])
    old = pd.concat([old, pd.Series({"model": "resnet18", "image_size": 32, "global_batch_size": 16,
                                     "precision": "fp32", "optimizer": "sgd", "grad_accum": 1,
                                     "grad_checkpointing": False})])
    rebuilt = _predicted_parts(old)  # world 1: DataParallel's comm term (whole batch on GPU 0) is 0
    assert rebuilt is not None and rebuilt["comm"] == 0.0


def test_help_lists_every_subcommand(capsys):
    """argparse %-formats a subcommand's help: a bare "95% CIs" ended `benchmark.py --help` in a traceback."""
    import benchmark

    with pytest.raises(SystemExit) as exit_:
        benchmark.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in benchmark.COMMANDS:
        assert name in out
    assert "95% CIs" in out


def test_a_subcommand_s_help_lists_its_flags(capsys):
    """benchmark.py builds the named command's flags only (the others' import torch)."""
    import benchmark

    for name, flag in (("calibrate", "--world-sizes"), ("advise", "--gpu-memory-gib"), ("predict", "--calibration")):
        with pytest.raises(SystemExit):
            benchmark.main([name, "--help"])
        assert flag in capsys.readouterr().out, name


def test_the_commands_that_read_rows_import_no_torch():
    """The report, compare and the help of benchmark.py read CSVs and YAML: no torch import (2-4 s a process)."""
    code = ("import sys, benchmark\nfrom common import report\nfrom common.bench import compare\n"
            "for argv in (['compare', 'a', 'b'], ['report'], ['--preset', 'smoke']):\n    benchmark.parse(argv)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_doctor_keeps_every_earlier_results_file(tmp_path):
    """Each doctor run starts a file of its own: the earlier ones are kept, none overwritten, and a folder given as
    --results is refused before any work (it would have been moved aside)."""
    from types import SimpleNamespace

    from common.bench.doctor import doctor, set_aside
    from common.config import UsageError

    path = tmp_path / "summary.csv"
    assert set_aside(str(path)) is None
    for text in ("first", "second", "third"):
        path.write_text(text)
        set_aside(str(path))
    assert not path.exists()
    kept = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert kept == {"summary.csv.previous": "third", "summary.csv.previous.1": "second",
                    "summary.csv.previous.2": "first"}
    with pytest.raises(UsageError, match="a folder"):
        doctor(SimpleNamespace(results=str(tmp_path)))
    assert {p.name for p in tmp_path.iterdir()} == set(kept)


def test_report_refuses_a_campaigns_folder_that_is_not_there(tmp_path):
    """`report --readme --campaigns TYPO` would empty the README's results table: refused before anything is
    written."""
    from types import SimpleNamespace

    import benchmark
    from common.config import UsageError

    (tmp_path / "s.csv").write_text("")
    readme = tmp_path / "README.md"
    readme.write_text("kept")
    opts = SimpleNamespace(results=str(tmp_path / "s.csv"), report=str(tmp_path / "REPORT.md"), readme=str(readme),
                           campaigns=str(tmp_path / "nowhere"))
    with pytest.raises(UsageError, match="--campaigns .*nowhere: no such folder"):
        benchmark.cmd_report(opts)
    assert readme.read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "s.csv"]
