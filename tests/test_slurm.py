"""Slurm, for real: a two-node cluster on this host (tests/slurm_cluster.py), the sbatch templates
and benchmark.py --launcher slurm. In CI (CI=true) a cluster that cannot start is a failure."""
import os
import subprocess
import sys

import launches
import pytest
import torch
from helpers import ROOT, TINY, clean_env, rows, tiny_args
from slurm_cluster import Cluster, ClusterError, missing_tools
from test_comm import RESNET18_PARAMS

from common.config import TrainConfig
from common.launching import free_port
from common.models import blocks, build_model
from common.registry import SCRIPTS


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if missing_tools() and os.environ.get("CI") != "true":
        pytest.skip(f"Slurm not installed ({', '.join(missing_tools())}); .ci/run installs it")
    c = Cluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        c.start()
    except (ClusterError, OSError, subprocess.SubprocessError) as exc:
        c.stop()
        pytest.fail(f"cannot start the test Slurm cluster: {exc}")
    yield c
    c.stop()


def slurm_env(c: Cluster) -> dict:
    """The jobs' environment, without tests/conftest.py's GLOO_SOCKET_IFNAME=lo: the templates pick gloo's
    interface for a job of several nodes themselves (slurm/node_ifname.sh), as they would on a cluster."""
    env = clean_env({"SLURM_CONF": c.conf, "PYTHON": sys.executable,
                     "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")})
    return {k: v for k, v in env.items() if k != "GLOO_SOCKET_IFNAME"}


def gloo_lines() -> list[str]:
    """What each of the two nodes' tasks prints: gloo on the interface that holds the rendezvous address."""
    addr = subprocess.run(["bash", "slurm/node_addr.sh", "2"], cwd=ROOT, capture_output=True, text=True).stdout
    ifname = subprocess.run(["bash", "slurm/node_ifname.sh", addr.strip()], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    assert ifname and ifname != "lo", (addr, ifname)
    return [f"gloo on node {n}: {ifname}" for n in (0, 1)]


def benchmark(c: Cluster, tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """benchmark.py with every output under tmp_path (the repository's results/ and checkpoints/ untouched)."""
    out = ["--results", str(tmp_path / "summary.csv"), "--report", str(tmp_path / "REPORT.md"),
           "--log-dir", str(tmp_path / "logs"), "--save-dir", str(tmp_path / "ckpt")]
    return subprocess.run([sys.executable, "benchmark.py", *args, *out], cwd=ROOT, env=env or slurm_env(c),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.beside
@pytest.mark.slow
def test_benchmark_smoke_preset_as_slurm_jobs(cluster, tmp_path):
    """The smoke preset's DDP run, cut to TINY's 4 steps (the job files and their launchers are the subject,
    not the training), and a job that fails (an unknown model): it becomes a failed row with the script's
    own error, and the matrix goes on. The DDP job runs slurm/torchrun.sbatch on 2 nodes, as `sbatch
    slurm/torchrun.sbatch pytorch_DDP.py` does (whose own #SBATCH lines sbatch --test-only checks here,
    without a second training job). The deepspeed launcher's runs take the same template
    (common/bench/slurm.py; their job files: test_dry_run_writes_job_files_that_bash_accepts), and
    DeepSpeed on 2 nodes trains in the accelerate template's test below.
    The job asks 2 CPUs per task of a cluster that binds steps to their CPUs (task/affinity): each node's
    step must get both (a plain srun gets one since Slurm 22.05), and torch's threads follow the step's
    CPUs (OMP_NUM_THREADS left unset), so the row's cpu_threads says so too. It is submitted with --export=NONE,
    as sites that keep the submit shell's environment out of jobs do: the steps still get what the job file and
    the template export (their SLURM_EXPORT_ENV=ALL); the accelerate test below runs with Slurm's default."""
    results, matrix = tmp_path / "summary.csv", tmp_path / "m.yaml"
    cpus = min(2, len(os.sched_getaffinity(0)))  # the test cluster's CPUs per node (tests/slurm_cluster.py)
    args = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in TINY.items()
                     if k != "device")
    matrix.write_text(f"presets:\n  smoke:\n    timeout_s: 300\n    args: {{{args}}}\n    scripts: all\n"
                      "    runs: [{name: crash, script: pytorch_DDP.py, args: {model: no_such_model}}]\n")
    env = {k: v for k, v in slurm_env(cluster).items() if k != "OMP_NUM_THREADS"}
    proc = benchmark(cluster, tmp_path, "--preset", "smoke", "--matrix", str(matrix), "--only", "pytorch_DDP.py",
                     "--launcher", "slurm", "--nodes", "2", f"--sbatch-arg=--cpus-per-task={cpus}",
                     "--sbatch-arg=--export=NONE", env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = {r["run_name"]: r for r in rows(results)}
    assert sorted(got) == ["smoke/crash", "smoke/pytorch_DDP"], rows(results)
    crash = got.pop("smoke/crash")
    assert crash["status"] == "failed" and crash["world_size"] == "2", crash
    assert crash["error"].startswith("pytorch_DDP.py: error: ") and "no_such_model" in crash["error"], crash
    assert all(r["status"] == "ok" and r["world_size"] == "2" for r in got.values()), got
    ddp = got["smoke/pytorch_DDP"]
    assert ddp["restarts"] == "0" and int(ddp["test_samples"]) == 37  # odd over 2 ranks: every sample once
    (log,) = (tmp_path / "slurm" / "logs").glob("smoke__pytorch_DDP-*.log")
    assert "2 nodes x 1 processes" in log.read_text()
    assert all(ln in log.read_text() for ln in gloo_lines()), log.read_text()[-3000:]
    # the step's os.sched_getaffinity(0), as rank 0 found it (common/data.py size_workers), and torch's threads
    assert f"rank 0: {cpus} CPUs for 1 processes on its node" in log.read_text(), log.read_text()[-3000:]
    assert ddp["cpu_threads"] == str(cpus), ddp
    for template in ("slurm/torchrun.sbatch", "slurm/accelerate.sbatch"):
        check = subprocess.run(["sbatch", "--test-only", template], cwd=ROOT, env=slurm_env(cluster),
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0 and "to start at" in check.stderr, (template, check.stderr)
    assert (tmp_path / "slurm" / "smoke__pytorch_DDP.sbatch").exists()
    # --save-dir reached the job, as the root of its own folder (--resume auto never sees another job's)
    assert len(list(tmp_path.glob("ckpt/job*/pytorch_DDP/model_final.pt"))) == 1


@pytest.mark.beside
@pytest.mark.slow
def test_accelerate_deepspeed_through_the_accelerate_template_on_two_nodes(cluster, tmp_path):
    """accelerate's multi-node DeepSpeed default, pdsh, would run `deepspeed --hostfile` on each node;
    config/default_DeepSpeed.yml asks for the standard launcher: one torchrun per node, one world."""
    log = tmp_path / "job.log"
    # 2 CPUs per task: the steps are bound (tests/slurm_cluster.py), and with one each both nodes' ranks,
    # on this one host, would share its first core
    cpus = min(2, len(os.sched_getaffinity(0)))
    proc = subprocess.run(["sbatch", "--wait", "--nodes=2", f"--cpus-per-task={cpus}", f"--output={log}",
                           "slurm/accelerate.sbatch", "config/default_DeepSpeed.yml", "accelerate_DeepSpeed.py",
                           *tiny_args(tmp_path)], cwd=ROOT,
                          env={**slurm_env(cluster), "RDZV_PORT": str(free_port()), "GPUS_PER_NODE": "1"},
                          capture_output=True, text=True, timeout=300)
    text = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, (proc.stderr, text[-4000:])
    (row,) = rows(tmp_path / "summary.csv")
    assert row["status"] == "ok" and row["world_size"] == "2" and row["strategy"] == "accelerate_deepspeed_zero2", row
    assert int(row["test_samples"]) == 37
    assert all(ln in text for ln in gloo_lines()), text[-3000:]


@pytest.mark.beside
@pytest.mark.slow
@pytest.mark.launches("pytorch_SingleGPU-fp32", "pytorch_FSDP-fp32")
def test_fsdp_hybrid_sharding_on_two_nodes_trains_like_one_process(cluster, runs, tmp_path):
    """--sharding hybrid as a cluster runs it: slurm/torchrun.sbatch on 2 nodes x 2 processes, so each node's
    pair shards the model and the nodes replicate it (pytorch_FSDP.py build_mesh: a 2 x 2 mesh from torchrun's
    LOCAL_WORLD_SIZE; FSDP2 reduce-scatters within a node, all-reduces across). The batch of 12 over 4 ranks
    trains as the shared one-process run does (tests/launches.py EQUAL: no augmentation, frozen BatchNorm; 4
    steps), to test_equivalence's tolerance, and sends what full sharding sends plus the all-reduce across nodes."""
    one, full = runs
    log, cpus = tmp_path / "job.log", min(2, len(os.sched_getaffinity(0)))
    args = tiny_args(tmp_path, **{**launches.EQUAL, **launches.AT_3, "sharding": "hybrid", "epoch_checkpoints": False})
    proc = subprocess.run(["sbatch", "--wait", "--nodes=2", f"--cpus-per-task={cpus}", f"--output={log}",
                           "slurm/torchrun.sbatch", "pytorch_FSDP.py", *args], cwd=ROOT,
                          env={**slurm_env(cluster), "RDZV_PORT": str(free_port()), "GPUS_PER_NODE": "2"},
                          capture_output=True, text=True, timeout=300)
    text = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, (proc.stderr, text[-4000:])
    assert "2 nodes x 2 processes" in text, text[-3000:]
    (row,) = rows(tmp_path / "summary.csv")
    assert (row["status"], row["strategy"], row["world_size"], row["local_world_size"]) == \
        ("ok", "fsdp_hybrid", "4", "2"), row
    assert int(row["test_samples"]) == 37
    (final,) = tmp_path.glob("ckpt/**/pytorch_FSDP/model_final.pt")  # the flags' --save-dir, after the template's
    sd, ref = (torch.load(f, map_location="cpu", weights_only=True) for f in (final, one.final()))
    diff = max((sd[k] - ref[k]).abs().max().item() for k in ref if ref[k].is_floating_point())
    assert diff < 1e-4, diff  # test_equivalence.TOLERANCE
    assert abs(float(row["train_loss"]) - float(one.row["train_loss"])) < 1e-4
    # beyond full sharding's collectives (the shared 3-rank run: calls per step do not depend on the world
    # size), one all-reduce per FSDP unit a step across the nodes, of the node's half of the fp32 gradients
    # (less the padding of 3-rank shards, which full sharding's own gathers and reduce-scatters carry: 2.3%)
    units = 1 + len(list(blocks(build_model(TrainConfig(model="resnet18", pretrained=False)))))
    assert float(row["comm_calls_per_step"]) - float(full.row["comm_calls_per_step"]) == units
    extra = float(row["comm_bytes_per_step"]) - float(full.row["comm_bytes_per_step"])
    assert extra == pytest.approx(4 * RESNET18_PARAMS / 2, rel=0.05), extra


@pytest.mark.beside
@pytest.mark.slow  # launches processes
def test_dry_run_writes_job_files_that_bash_accepts(tmp_path):
    results = tmp_path / "summary.csv"
    proc = subprocess.run([sys.executable, "benchmark.py", "--preset", "smoke", "--launcher", "slurm", "--nodes", "2",
                           "--gpus-per-node", "4", "--partition", "gpu", "--sbatch-arg=--qos=high", "--dry-run",
                           "--results", str(results), "--save-dir", "/ck"], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    files = sorted((tmp_path / "slurm").glob("*.sbatch"))
    assert len(files) == len(SCRIPTS) and not results.exists()  # the smoke preset runs every script
    for f in files + [os.path.join(ROOT, "slurm", n) for n in ("torchrun.sbatch", "accelerate.sbatch")]:
        check = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert check.returncode == 0, (f, check.stderr)
    ddp = (tmp_path / "slurm" / "smoke__pytorch_DDP.sbatch").read_text()
    assert "#SBATCH --nodes=2" in ddp and "#SBATCH --gpus-per-node=4" in ddp and "#SBATCH --qos=high" in ddp
    assert "#SBATCH --cpus-per-task=4" in ddp  # 4 ranks x (0 loader workers in the smoke preset + 1)
    assert "export SAVE_DIR=/ck" in ddp and "--save-dir" not in ddp  # the template makes /ck/job<id>
    assert "--save-dir /ck" in (tmp_path / "slurm" / "smoke__pytorch_SingleGPU.sbatch").read_text()  # no template
    assert "slurm/accelerate.sbatch config/default_DDP.yml accelerate_DDP.py" in \
        (tmp_path / "slurm" / "smoke__accelerate_DDP.sbatch").read_text()
    # the deepspeed launcher's script under Slurm: one torchrun per node, whose environment DeepSpeed reads
    assert "bash slurm/torchrun.sbatch pytorch_DeepSpeed.py" in \
        (tmp_path / "slurm" / "smoke__pytorch_DeepSpeed.sbatch").read_text()


def test_cores_asked_are_capped_at_the_partitions_smallest_node(monkeypatch, tmp_path):
    """4 loader workers + the rank = 5 cores, on nodes of 1 core: a job asking 5 would pend forever."""
    from types import SimpleNamespace

    from common.bench import slurm

    opts = SimpleNamespace(nodes=2, gpus_per_node=0, time="", partition="", account="", sbatch_arg=[])
    run = {"name": "p/ddp", "script": "pytorch_DDP.py", "args": {"workers": 4}, "timeout_s": 60, "nproc": 2}
    monkeypatch.setattr(slurm, "node_cpus", lambda partition: 1)
    assert "#SBATCH --cpus-per-task=1" in slurm.sbatch_text(run, opts, str(tmp_path / "s.csv"), str(tmp_path))
    monkeypatch.setattr(slurm, "node_cpus", lambda partition: None)  # Slurm not reachable: what the run needs
    assert "#SBATCH --cpus-per-task=5" in slurm.sbatch_text(run, opts, str(tmp_path / "s.csv"), str(tmp_path))
    opts.sbatch_arg = ["--cpus-per-gpu=2"]
    assert "--cpus-per-task" not in slurm.sbatch_text(run, opts, str(tmp_path / "s.csv"), str(tmp_path))
