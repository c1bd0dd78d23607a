"""Kill -9 in the middle of a run, resume with --resume auto: same final loss and accuracy as a run
that was never interrupted, and one CSV row for the run, marked resumed. One case per checkpointer of
common/checkpoint.py but the plain one (single device, DataParallel, DDP, model parallelism), whose kill and
resume is test_reliability's restarted DDP worker; a single device's refusals are below."""
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import helpers
import pytest
import torch
from helpers import check_ok, hold_port, one_line_error, release_port, rows, run, run_at_once, tiny_args

SCRIPTS = ["accelerate_DeepSpeed.py", "pytorch_DDP_ZeRO.py", "pytorch_FSDP.py", "pytorch_DeepSpeed.py"]
NPROC = 2

pytestmark = pytest.mark.slow


def args(tmp_path):
    # 4 steps an epoch; killed after the first epoch's checkpoint. No communication profile and no loader probe:
    # neither changes what is trained (a resumed group that profiles is test_reliability's restart test)
    return tiny_args(tmp_path, epochs=2, comm_steps=0, loader_probe_batches=0)


def start(script, argv, stderr=subprocess.PIPE, port=None):
    """In a session of its own, so that kill_all finds the launcher and its workers below it."""
    return helpers.start(script, argv, NPROC, "torchrun", port=port,
                         stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)


def kill_all(proc) -> None:
    """SIGKILL to the launcher and every process below it (torchrun starts its workers in sessions of their own:
    its process group would leave them training); none once it has been waited for, when its pid may be
    another process's."""
    if proc.poll() is not None:
        return
    for pid in [proc.pid, *helpers.descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


@pytest.mark.parametrize("script", SCRIPTS)
def test_kill_and_resume_matches_uninterrupted(tmp_path, script):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    # the uninterrupted reference trains beside the run that is killed: on 2 cores the two overlap in their
    # imports, start-up and exits, and neither's result depends on timing (gloo's sums, no timed draw)
    ref.mkdir()
    ports = [hold_port(), hold_port()]  # two launches at once: two rendezvous ports
    with open(ref / "stderr.txt", "w+") as ref_err:
        ref_proc = start(script, args(ref), stderr=ref_err, port=ports[0])
        proc = start(script, args(cut) + ["--resume", "auto"], port=ports[1])
        try:
            latest = cut / "ckpt" / script[:-3] / "resume" / "latest"
            deadline = time.time() + 240
            while not latest.exists() and proc.poll() is None and time.time() < deadline:
                time.sleep(0.02)
            assert proc.poll() is None, "finished before it could be killed: " + proc.stderr.read()[-2000:]
            kill_all(proc)  # SIGKILL, mid-run, somewhere after the first epoch's checkpoint
            assert rows(cut / "summary.csv") == []  # a killed run leaves no row
            ref_proc.wait(timeout=300)
        finally:  # neither launch outlives a failed assertion
            kill_all(proc)
            kill_all(ref_proc)
            for port in ports:
                release_port(port)
        ref_err.seek(0)
        assert ref_proc.returncode == 0, ref_err.read()[-3000:]
    (expected,) = rows(ref / "summary.csv")

    proc2 = run(script, args(cut) + ["--resume", "auto"], nproc=NPROC, launcher="torchrun")
    check_ok(proc2)
    assert "resumed after epoch" in proc2.stdout
    (got,) = rows(cut / "summary.csv")
    assert got["resumed"] == "True" and got["status"] == "ok" and got["steps"] == expected["steps"]
    assert float(got["train_loss"]) == pytest.approx(float(expected["train_loss"]), abs=1e-5)
    assert got["test_accuracy"] == expected["test_accuracy"]


@pytest.mark.beside
def test_resume_path_missing_or_corrupt(tmp_path):
    """Each refusal is a process that starts and stops: those that do not depend on each other start together
    (helpers.run_at_once), each corrupt checkpoint in a copy of its own."""
    main, missing = tmp_path / "main", tmp_path / "missing"
    got = run_at_once({"missing": ("pytorch_SingleGPU.py", tiny_args(missing, resume=str(tmp_path / "nowhere"))),
                       "first": ("pytorch_SingleGPU.py", tiny_args(main, epochs=1))})
    assert "no checkpoint there" in one_line_error(got["missing"])
    check_ok(got["first"])
    folder = Path("ckpt") / "pytorch_SingleGPU" / "resume" / "epoch1"
    old, cut = tmp_path / "old", tmp_path / "cut"
    for copy in (old, cut):
        shutil.copytree(main / "ckpt", copy / "ckpt")
    # written before checkpoints said their flags: refused by its load
    state = torch.load(old / folder / "run.pt", weights_only=False)
    torch.save({k: v for k, v in state.items() if k != "fits"}, old / folder / "run.pt")
    (cut / folder / "native.pt").write_bytes(b"truncated")
    # a checkpoint of other flags, refused before it is loaded; the two above, refused by their load
    cases = ((main, {"model": "resnet34"}, "trained with --model resnet18"),
             (main, {"optimizer": "adamw"}, "trained with --optimizer sgd"),
             (old, {"model": "resnet34"}, "does not fit this run (Error(s) in loading state_dict for ResNet"),
             (cut, {}, "is corrupt"))
    got = run_at_once({why: ("pytorch_SingleGPU.py", tiny_args(where, resume="auto", epochs=2, **over))
                       for where, over, why in cases})
    for why, proc in got.items():
        assert why in one_line_error(proc)
    assert len(rows(main / "summary.csv")) == 1  # only the first, complete run
    assert not any(os.path.exists(where / "summary.csv") for where in (missing, old, cut))


@pytest.mark.parametrize("visible, saved_on, want", [
    (2, 1, [("all", 2)]),  # the same layout: every device's state back
    (1, 1, [("one", "s1")]),  # 1 node x 2 GPUs -> one GPU visible per process: this rank's own state
    (1, None, []),  # a checkpoint from before the device was saved: the fresh state stays
])
def test_cuda_random_state_resumes_under_another_gpu_layout(monkeypatch, visible, saved_on, want):
    """CPU twin of a CUDA line: set_rng_state_all with more saved states than visible GPUs raises IndexError
    (torch/cuda/random.py indexes default_generators), a failed resume where the world size is the same."""
    from common import checkpoint

    calls, state = [], checkpoint.rng_state(None)  # this host's, before CUDA is faked
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: calls.append(("all", len(states))))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": calls.append(("one", s)))
    state = {**state, "cuda": ["s0", "s1"], "cuda_device": saved_on}
    if saved_on is None:
        del state["cuda_device"]
    checkpoint.set_rng_state(state, None)
    assert calls == want
