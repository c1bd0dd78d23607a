"""Failure paths of every run: a row with the right status, or one line and nothing written."""
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, check_ok, clean_env, one_line_error, rows, run, tiny_args

from common import runner
from common.bench.matrix import tool
from common.launching import free_port
from common.results import COLUMNS


def run_launch(monkeypatch, tmp_path, main, script="pytorch_SingleGPU.py", *args):
    monkeypatch.setattr(sys, "argv", ["x.py", "--results", str(tmp_path / "s.csv"), "--model", "resnet18",
                                      "--batch-size", "64", *args])
    with pytest.raises(SystemExit) as exc:
        runner.launch(main, script)
    return exc.value.code, rows(tmp_path / "s.csv")


def test_a_failed_run_is_labelled_as_its_ok_rows_are(monkeypatch, tmp_path):
    """The registry's label goes before the precision in every row the runner writes: an AMP run that failed
    says amp_bf16, as its ok rows do, so the report sets it beside them."""
    def main(cfg):
        raise RuntimeError("cuDNN error")
    code, got = run_launch(monkeypatch, tmp_path, main, "pytorch_auto_mixed_precision.py", "--precision", "bf16")
    assert code == 1 and got[0]["status"] == "failed" and got[0]["precision"] == "amp_bf16", got


def test_out_of_memory_is_a_row_and_exit_4(monkeypatch, tmp_path, capsys):
    def main(cfg):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    code, got = run_launch(monkeypatch, tmp_path, main)
    assert code == 4 and len(got) == 1 and got[0]["status"] == "oom" and got[0]["global_batch_size"] == "64"
    assert "out of memory on rank 0 at global batch 64" in capsys.readouterr().err


def test_unexpected_failure_is_a_failed_row(monkeypatch, tmp_path):
    def main(cfg):
        raise RuntimeError("NCCL watchdog timeout")
    code, got = run_launch(monkeypatch, tmp_path, main)
    assert code == 1 and got[0]["status"] == "failed" and "NCCL watchdog timeout" in got[0]["error"]


def test_a_group_that_never_formed_keeps_the_launched_world(monkeypatch, tmp_path):
    """A peer lost during init_process_group (gloo "Connection refused" after a restart on two Slurm
    nodes): no group exists, yet the run was launched as a world of 2 and its row says so."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")

    def main(cfg):
        raise RuntimeError("Gloo connectFullMesh failed with ... Connection refused")
    code, got = run_launch(monkeypatch, tmp_path, main)
    assert code == 1 and got[0]["status"] == "failed" and got[0]["world_size"] == "2", got


INJECT_OOM = """
import os
if os.environ.get("RANK") == "1":  # an OOM on rank 1 at its second forward, injected for the test
    import torch
    import torch.nn.functional as F
    _ce, _calls = F.cross_entropy, [0]

    def cross_entropy(input, *args, **kwargs):
        if input.device.type != "meta":  # the memory model and the FLOP count run on the meta device
            _calls[0] += 1
            if _calls[0] == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected on rank 1)")
        return _ce(input, *args, **kwargs)
    F.cross_entropy = cross_entropy
"""


@pytest.mark.slow
def test_out_of_memory_on_another_rank_than_0_is_an_oom_row(tmp_path):
    """Rank 1 runs out of memory while rank 0 waits in the gradient all-reduce: the run still gets
    exactly one row, and it says oom (rank 0 alone would only have seen its peer vanish: failed)."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT_OOM)
    proc = run("pytorch_DDP.py", tiny_args(tmp_path), nproc=2, launcher="torchrun",
               env={"PYTHONPATH": str(inject)})
    assert proc.returncode != 0
    (row,) = rows(tmp_path / "summary.csv")
    assert row["status"] == "oom" and "injected on rank 1" in row["error"], row
    assert "out of memory on rank 1" in proc.stderr


@pytest.mark.beside
@pytest.mark.slow
def test_divergence_stops_the_run_with_a_row(tmp_path):
    proc = run("pytorch_SingleGPU.py", tiny_args(tmp_path, lr=1e30, max_nonfinite_steps=2, log_every=1))
    assert proc.returncode == 3 and "Traceback" not in proc.stderr
    (row,) = rows(tmp_path / "summary.csv")
    assert row["status"] == "diverged" and "non-finite" in row["error"]


@pytest.mark.beside
@pytest.mark.slow
def test_foreign_summary_csv_is_refused_before_training_and_kept(tmp_path):
    path = tmp_path / "summary.csv"
    path.write_text("name,score\nalice,3\n")
    proc = run("pytorch_SingleGPU.py", tiny_args(tmp_path))
    assert "has another header" in one_line_error(proc)
    assert path.read_text() == "name,score\nalice,3\n"
    assert not (tmp_path / "ckpt").exists()  # refused before any training


@pytest.mark.beside
@pytest.mark.slow
def test_distributed_script_without_launcher_runs_as_world_of_one(tmp_path):
    check_ok(run("pytorch_DDP.py", tiny_args(tmp_path)))
    (row,) = rows(tmp_path / "summary.csv")
    assert row["world_size"] == "1" and row["status"] == "ok" and list(row) == COLUMNS


@pytest.mark.beside
@pytest.mark.slow
def test_cifar_missing_offline_through_the_script(tmp_path):
    args = [a for a in tiny_args(tmp_path) if a != "synthetic"]
    args[args.index("--dataset") + 1:args.index("--dataset") + 1] = ["cifar10"]
    proc = run("pytorch_SingleGPU.py", args + ["--data-dir", str(tmp_path / "nodata")],
               env={"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
                    "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"})
    line = one_line_error(proc)
    assert "cifar-10-batches-py" in line and "--dataset synthetic" in line
    assert rows(tmp_path / "summary.csv") == []


KILL_AFTER_EPOCH_1 = """
import os, runpy, signal, sys
sys.path.insert(0, {root!r})
from common import checkpoint
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    save = checkpoint.Checkpointer.save

    def save_then_die(self, epoch, meta):  # a worker lost right after the epoch-1 checkpoint
        save(self, epoch, meta)
        if epoch == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    checkpoint.Checkpointer.save = save_then_die
elif os.environ.get("RANK") == "1":  # the restarted rank 1 joins late: rank 0 must wait for its new address
    import time
    time.sleep(3)
sys.argv[0] = os.path.join({root!r}, "pytorch_DDP.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.launches("pytorch_DDP-fp32-3epochs")
def test_a_killed_worker_is_restarted_and_the_run_resumes_to_the_same_result(tmp_path, runs):
    """torchrun --max-restarts 1 restarts the group after a SIGKILLed rank: the new group must form
    (it used to dial the dead attempt's gloo addresses), resume from the epoch-1 checkpoint, and
    end with one row equal to an uninterrupted run's (a shared launch of the same flags)."""
    wrapper = tmp_path / "kill_rank1.py"
    wrapper.write_text(KILL_AFTER_EPOCH_1.format(root=ROOT))
    killed = tmp_path / "killed"
    proc = subprocess.run([*tool("torchrun"), "--nproc_per_node", "2", "--max-restarts", "1",
                           "--master_port", str(free_port()), str(wrapper),
                           *tiny_args(killed, epochs=3, resume="auto")],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    check_ok(proc)
    assert "resumed after epoch 1" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    (whole,) = runs
    check_ok(whole.proc)
    (row,) = rows(killed / "summary.csv")
    ref = whole.row
    assert row["status"] == "ok" and row["resumed"] == "True" and row["restarts"] == "1", row
    for key in ("train_loss", "train_accuracy", "test_accuracy", "test_samples", "steps"):
        assert row[key] == ref[key], (key, row[key], ref[key])
