"""Bad input to benchmark.py's subcommands and the scripts' path flags: one line, a non-zero exit, no traceback,
and no results, report or calibration file lost or overwritten (found by a sweep of ~470 bad commands)."""
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT, clean_env, one_line_error

import benchmark
from common.config import TrainConfig, UsageError, load_yaml
from common.deepspeed_config import resolve_ds_config

CAMPAIGN = f"{ROOT}/results/campaigns/2026-11-26_h100_throughput"


def refused(capsys, argv: list[str], quiet: bool = False) -> str:
    """benchmark.py's main() in this process: exit 2 and one line (quiet: and nothing printed before it)."""
    assert benchmark.main(argv) == 2
    out, err = capsys.readouterr()
    err = err.strip()
    assert len(err.splitlines()) == 1 and "benchmark.py: error: " in err, err
    assert not quiet or out == "", out
    return err


def test_no_file_is_lost_to_a_refused_command(tmp_path, capsys):
    """doctor moved a --results file aside only after its flags; calibrate wrote over any --out; report rewrote a
    report as "No runs yet" from a mistyped CSV."""
    csv, report = tmp_path / "summary.csv", tmp_path / "REPORT.md"
    shutil.copy(f"{CAMPAIGN}/summary.csv", csv)
    report.write_text("# kept\n")
    before = csv.read_bytes()
    assert "--world-sizes" in refused(capsys, ["doctor", "--world-sizes", "x", "--results", str(csv)])
    assert "not a calibration file" in refused(capsys, ["calibrate", "--out", str(csv), "--model", "resnet18",
                                                        "--no-strategies", "--world-sizes", "1"])
    assert "results file not found" in refused(capsys, ["report", "--results", str(tmp_path / "typo.csv"),
                                                        "--report", str(report)])
    assert csv.read_bytes() == before and report.read_text() == "# kept\n"


def test_foreign_files_and_out_of_range_numbers_are_refused(tmp_path, capsys):
    junk = tmp_path / "m.yaml"
    junk.write_text("[1, 2, 3]\n")
    assert "not a matrix file" in refused(capsys, ["run", "--matrix", str(junk), "--preset", "smoke"])
    assert "not a matrix file" in refused(capsys, ["calibrate", "--matrix", str(junk)])
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    assert "markers" in refused(capsys, ["report", "--results", f"{CAMPAIGN}/summary.csv", "--report",
                                         str(tmp_path / "R.md"), "--readme", str(readme)])
    assert "not a calibration file" in refused(capsys, ["predict", "--results", f"{CAMPAIGN}/summary.csv",
                                                        "--calibration", str(junk)])
    a100 = ["advise", "--gpus", "4", "--gpu", "NVIDIA A100-SXM4-80GB"]
    for flags, word in ((["--busbw-gbps", "-1"], "busbw"), (["--busbw-gbps", "nan"], "busbw"),
                        (["--gpu-memory-gib", "inf"], "gpu-memory"), (["--dataset-images", "0"], "dataset-images"),
                        (["--tp", "0"], "--tp")):
        assert word in refused(capsys, a100 + flags), flags
    assert "--threads" in refused(capsys, ["calibrate", "--threads", "-1", "--model", "resnet18"])
    assert "--report" in refused(capsys, ["run", "--preset", "smoke", "--report", str(tmp_path), "--dry-run"])
    for flags, word in ((["--only", ""], "--only"), (["--world-sizes", ","], "--world-sizes"),
                        (["--scaling", "weak"], "--world-sizes"), (["--nodes", "2", "--partition", "p"], "--launcher")):
        assert word in refused(capsys, ["run", "--preset", "smoke", "--dry-run", *flags]), flags


@pytest.mark.beside  # one process at a time, no timing
@pytest.mark.slow
def test_a_bad_flag_of_a_subcommand_is_one_line():
    for argv in (["calibrate", "--device", "tpu"], ["compare", "a.csv"], ["frobnicate"]):
        proc = subprocess.run([sys.executable, "benchmark.py", *argv], cwd=ROOT, env=clean_env(), capture_output=True,
                              text=True, timeout=120)
        one_line_error(proc)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_folder_given_for_a_config_file_is_refused(tmp_path):
    with pytest.raises(UsageError, match="cannot be read"):
        resolve_ds_config(TrainConfig(batch_size=16), str(tmp_path), world_size=2, micro_batch=8)
    with pytest.raises(UsageError, match="cannot be read"):
        load_yaml(str(tmp_path))


@pytest.mark.beside  # one process, no timing: a shared launch of the tests ahead runs beside it
@pytest.mark.slow
@pytest.mark.parametrize("flags, word", [(["--results", ""], "--results"), (["--save-dir", "FILE"], "--save-dir")])
def test_a_script_refuses_a_path_it_cannot_use_before_training(tmp_path, flags, word):
    afile = tmp_path / "f.txt"
    afile.write_text("x")
    flags = [str(afile) if f == "FILE" else f for f in flags]
    args = ["--device", "cpu", "--dataset", "synthetic", "--no-pretrained", "--model", "resnet18", "--image-size",
            "32", "--batch-size", "8", "--train-samples", "16", "--test-samples", "8",
            "--results", str(tmp_path / "s.csv"), "--save-dir", str(tmp_path / "ckpt"), *flags]
    proc = subprocess.run([sys.executable, "pytorch_SingleGPU.py", *args], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert word in one_line_error(proc)
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]  # refused before a row or a checkpoint was written


def test_model_inference_refuses_a_launcher_s_several_processes(monkeypatch):
    """Under torchrun --nproc-per-node 2 both processes would measure cuda:0 and each append a row."""
    import model_inference

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="one per GPU, each with its own CUDA_VISIBLE_DEVICES"):
        model_inference.main(None)  # refused before the config is read
