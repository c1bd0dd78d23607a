"""The lease's prepared scripts (.gpu/): what can be checked without a GPU. The shell scripts parse; the DALI
stand-in that lets NVIDIA's ConvNets trainer import (its dataloaders define DALI pipelines at module level) can be
subclassed, fails when used, and leaves the `nvidia` namespace to torch's CUDA wheels."""
import ast
import os
import subprocess
import sys

import pytest
from helpers import ROOT, proc_stat

GPU_DIR = os.path.join(ROOT, ".gpu")


@pytest.mark.parametrize("script", ["run.sh", "peer.sh", "fetch_peer.sh", "fetch_wheels.sh"])
def test_the_lease_scripts_parse(script):
    assert subprocess.run(["bash", "-n", os.path.join(GPU_DIR, script)]).returncode == 0


def test_the_dali_stand_in_imports_as_the_trainer_imports_it():
    code = """
from nvidia.dali.plugin.pytorch import DALIClassificationIterator
from nvidia.dali.pipeline import Pipeline
import nvidia.dali.ops as ops
import nvidia.dali.types as types
import nvidia
class HybridTrainPipe(Pipeline):  # what image_classification/dataloaders.py does at import
    pass
for make in (HybridTrainPipe, DALIClassificationIterator, lambda: ops.FileReader, lambda: types.FLOAT):
    try:
        make()
        raise SystemExit("the stand-in ran")
    except RuntimeError as e:
        assert "DALI is not installed" in str(e), e
print(sorted(p for p in nvidia.__path__))
"""
    env = {**os.environ, "PYTHONPATH": os.path.join(GPU_DIR, "peer_stubs")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    paths = ast.literal_eval(proc.stdout.strip())
    assert any("peer_stubs" in p for p in paths), paths
    # a namespace package: torch's nvidia.* CUDA wheels, where this venv has them, are still found beside it
    site = subprocess.run([sys.executable, "-c", "import nvidia; print(list(nvidia.__path__))"], capture_output=True,
                          text=True, cwd=ROOT)
    wheels = ast.literal_eval(site.stdout.strip()) if site.returncode == 0 else []
    if any(os.path.isdir(os.path.join(p, "cudnn")) for p in wheels):
        proc = subprocess.run([sys.executable, "-c", "import nvidia.cudnn, nvidia.dali"], env=env,
                              capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr


FAKE_PYTHON = r"""#!/usr/bin/env bash
# stands in for the device's python: a training script appends its --run-name to its --results file
# a run that outlives its call (in a session of its own, as the matrix starts them): once, where STRAY names a file
if [ "$1" = -m ] && [ -n "${STRAY:-}" ] && [ ! -e "$STRAY" ]; then
  setsid sleep 300 > /dev/null 2>&1 & echo $! > "$STRAY"
fi
case "$1" in -c|-m) exit 0;; esac
results=""; name=""
while [ $# -gt 0 ]; do case "$1" in --results) results=$2;; --run-name) name=$2;; esac; shift; done
[ -n "$results" ] && echo "$name" >> "$results"
exit 0
"""


def _lease(tmp_path, part: str, deadline_s: int, peer: str = "no_peer",
           extra: dict | None = None) -> tuple[subprocess.CompletedProcess, str, str]:
    bin_dir, out, work = tmp_path / "bin", tmp_path / "out", tmp_path / "work"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("nvidia-smi", "#!/bin/sh\necho fake GPU\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "WORK": str(work),
           "DEADLINE_S": str(deadline_s), "PEER": str(tmp_path / peer), **(extra or {})}
    proc = subprocess.run(["bash", os.path.join(GPU_DIR, "run.sh"), part], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    return proc, str(out), str(work)


def test_part_1_skips_what_no_longer_fits_and_packs_what_it_ran(tmp_path):
    """With 50 s before the deadline, the runs that usually take longer are skipped (and listed), those that fit
    run, and $OUT holds the rows and one archive of the logs: never more than the 8 files that come back."""
    import tarfile

    proc, out, _ = _lease(tmp_path, "1", 50)
    assert proc.returncode == 0, proc.stderr
    ran = open(os.path.join(out, "rows.csv")).read().split()
    assert ran == ["lease/amp_bf16_gpu_no-channels-last", "lease/amp_bf16_gpu_channels-last",
                   "lease/tf32_gpu_no-channels-last", "lease/tf32_gpu_channels-last", "lease/amp_defaults_32"]
    assert sorted(os.listdir(out)) == ["env.txt", "logs.tgz", "rows.csv"]
    with tarfile.open(os.path.join(out, "logs.tgz")) as tar:
        names = tar.getnames()
        skipped = tar.extractfile("logs/skipped.txt").read().decode()
        steps = tar.extractfile("logs/steps.txt").read().decode()
    assert "logs/amp_defaults_32.log" in names
    assert [ln.split()[0] for ln in skipped.splitlines()] == ["amp_defaults_256", "fp32_gpu_no-channels-last",
                                                              "fp32_gpu_channels-last"]
    assert [ln.split()[0] for ln in steps.splitlines() if " exit " in ln] == [r.split("/")[1] for r in ran]


def test_the_peer_s_launches_are_packed_as_they_finish(tmp_path):
    """The peer's and our launches at its settings land in rows.csv and logs.tgz after each one."""
    import tarfile

    (tmp_path / "peer" / "ConvNets").mkdir(parents=True)
    (tmp_path / "peer" / "ConvNets" / "launch.py").write_text("")
    (tmp_path / "peer" / "dllogger").mkdir()
    proc, out, _ = _lease(tmp_path, "1", 500, peer="peer")
    assert proc.returncode == 0, proc.stderr
    ran = open(os.path.join(out, "rows.csv")).read().split()
    assert ran[-5:] == [*(f"lease/peer_ours_amp_fp16_{i}" for i in (1, 2, 3)), "lease/fp32_gpu_no-channels-last",
                        "lease/fp32_gpu_channels-last"]  # fp32's layout pair last: it matters least there
    with tarfile.open(os.path.join(out, "logs.tgz")) as tar:
        assert {f"logs/peer/dle_amp_{i}.log" for i in (1, 2, 3)} <= set(tar.getnames())
    assert len(os.listdir(out)) <= 8


def test_part_2_says_what_it_skipped_in_the_files_that_come_back(tmp_path):
    proc, out, _ = _lease(tmp_path, "2", 100)
    assert proc.returncode == 0, proc.stderr
    assert "what-if check skipped" in open(os.path.join(out, "whatif.txt")).read()
    assert os.path.exists(os.path.join(out, "gpu_tier.txt")) and len(os.listdir(out)) <= 8
    (tmp_path / "short").mkdir()
    proc, out, _ = _lease(tmp_path / "short", "2", 30)
    assert "gpu tier (not throughput_single_rows" in open(os.path.join(out, "gpu_tier.txt")).read()
    assert ") skipped: " in open(os.path.join(out, "gpu_tier.txt")).read()


def test_part_2_runs_what_changed_first_and_names_the_commit(tmp_path):
    """TIER_FIRST's tests before the rest of the untimed tier, each pass's exit in steps.txt, which comes back; the
    tree travels without .git, so env.txt names the commit the caller gives."""
    proc, out, _ = _lease(tmp_path, "2", 400, extra={"TIER_FIRST": "FSDP or inference", "GIT_COMMIT": "abc1234"})
    assert proc.returncode == 0, proc.stderr
    steps = [ln for ln in open(os.path.join(out, "steps.txt")).read().splitlines() if ln.startswith("gpu tier (")]
    assert [ln.split(") exit ")[0] for ln in steps] == [
        "gpu tier ((not throughput_single_rows and not calibrated and not bubble_lane) and (FSDP or inference)",
        "gpu tier ((not throughput_single_rows and not calibrated and not bubble_lane) and not (FSDP or inference)"]
    assert "commit abc1234" in open(os.path.join(out, "env.txt")).read()


def _gone(pid: int) -> bool:
    got = proc_stat(pid)
    return got is None or got[1][0] == "Z"


def test_part_2_stops_the_runs_it_started_and_no_other(tmp_path):
    """After the what-if check, part 2 ends what that check left running (the matrix's runs are in sessions of
    their own): those it started, and not a training run of the same script name beside it, which a pattern
    on command lines ended (the suite's own shared launches, when this test ran beside them)."""
    stray = tmp_path / "stray.pid"
    beside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "pytorch_SingleGPU.py",
                               "benchmark.py", "run"])
    try:
        proc, out, _ = _lease(tmp_path, "2", 300, extra={"STRAY": str(stray)})
        assert proc.returncode == 0, proc.stderr
        assert beside.poll() is None, f"part 2 stopped a process it did not start (exit {beside.returncode})"
        assert "No such" not in proc.stderr and "denied" not in proc.stderr, proc.stderr[-500:]  # /proc, read quietly
        pid = int(stray.read_text())
        assert _gone(pid), f"the run part 2 started, {pid}, still runs"
    finally:
        beside.kill()
        beside.wait()
    try:
        os.waitpid(pid, os.WNOHANG)  # the suite is the subreaper (tests/conftest.py): the stopped run is its zombie
    except ChildProcessError:
        pass


def test_the_peer_summary_takes_whole_accumulation_cycles_after_the_warm_up(tmp_path):
    """The peer's figure is the mean iteration over iterations 17-96 (10 optimizer cycles of 8), whatever its slow
    first iterations; ours is each launch's timed window; the ratio is of the medians."""
    import json

    peer_dir = tmp_path / "peer"
    peer_dir.mkdir()
    for k, it_ms in enumerate((64.0, 62.0, 66.0), 1):
        lines = ['DLLL {"type": "PARAMETER", "step": "PARAMETER", "data": {}}']
        for i in range(1, 100):
            ms = 900.0 if i <= 3 else it_ms + (8.0 if i % 8 == 0 else 0.0)  # slow start; optimizer every 8th
            lines.append("DLLL " + json.dumps({"type": "LOG", "step": [1, i], "data": {
                "train.total_ips": 256 / ms * 1e3, "train.compute_time": ms / 1e3 - 1e-4}}))
        (peer_dir / f"dle_amp_{k}.json").write_text("\n".join(lines) + "\n")
    rows = tmp_path / "rows.csv"
    rows.write_text("run_name,status,step_ms_mean,step_data_ms,global_batch_size,throughput_img_s\n"
                    "lease/peer_ours_amp_fp16_1,ok,512,16,2048,4000\nlease/peer_ours_amp_fp16_2,ok,512,16,2048,4100\n"
                    "lease/amp_bf16_gpu_channels-last,ok,60,2,256,4266\n")
    proc = subprocess.run([sys.executable, os.path.join(GPU_DIR, "peer_summary.py"), str(peer_dir), str(rows)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    peer_ips = 256 / 65.0 * 1e3  # the median launch: 64 ms, plus 8 ms every 8th iteration
    assert f"| {peer_ips:.0f} (" in proc.stdout
    assert f"ours/peer: {4050 / peer_ips:.3f} (without our loader's time: {2048 / 496 * 1e3 / peer_ips:.3f})" \
        in proc.stdout
