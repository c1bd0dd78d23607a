"""The multi-node paths no one-host run exercises, checked on CPU: the collective timeout, the Slurm
templates' rendezvous address and CPUs per step, the shared --save-dir, the loader's workers per node, and
the fp16 skips of accelerate's CUDA-only paths (FSDP2's scaler, fused optimizers)."""
import datetime
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, spawn_ranks

from common.config import DistributedConfig, TrainConfig
from common.distributed import init_distributed
from common.launching import free_port, local_world_size


def test_dist_timeout_reaches_the_process_group(monkeypatch):
    """--dist-timeout-s is the group's own timeout (gloo's here, NCCL's watchdog on GPUs), and the timeout of
    the per-attempt store torchrun's restarts use, not torch's 10-30 minute defaults."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # the attempt_store path, as under torchrun
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    init_distributed(DistributedConfig(device="cpu", dist_timeout_s=1234))
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert backend.options._timeout == datetime.timedelta(seconds=1234)
        store = dist.distributed_c10d._get_default_store()
        assert store.underlying_store.timeout == datetime.timedelta(seconds=1234)
    finally:
        dist.destroy_process_group()


def test_deepspeed_and_accelerate_are_given_the_timeout(monkeypatch):
    """Where DeepSpeed or accelerate form the group themselves they use 10 minutes unless told; the scripts tell
    them (common/deepspeed_config.py join_deepspeed, common/accel.py process_group_kwargs)."""
    from common.accel import process_group_kwargs
    from common.deepspeed_config import join_deepspeed

    (handler,) = process_group_kwargs(DistributedConfig(dist_timeout_s=2400))
    assert handler.to_kwargs()["timeout"] == datetime.timedelta(seconds=2400)
    calls = []
    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(init_distributed=lambda **kw: calls.append(kw)))
    join_deepspeed(DistributedConfig(dist_timeout_s=2400))
    assert calls and calls[0]["timeout"] == datetime.timedelta(seconds=2400)
    assert DistributedConfig().dist_timeout_s == 1800


def test_the_row_shows_the_timeout():
    from common.runner import base_row

    row = base_row(DistributedConfig(device="cpu", dist_timeout_s=900), "pytorch_DDP.py", "ddp")
    assert row["dist_timeout_s"] == 900
    assert base_row(TrainConfig(device="cpu"), "pytorch_SingleGPU.py", "single")["dist_timeout_s"] is None


FAKES = {
    # the first node of a stock Debian host: its name resolves to 127.0.1.1; its interfaces are $FAKE_ADDRS
    "hostname": 'case "$1" in --ip-address|-i) echo 127.0.1.1 ;; --all-ip-addresses|-I) echo "$FAKE_ADDRS" ;; '
                '*) echo node1 ;; esac',
    "scontrol": 'echo n1; echo n2',
    # srun: a step of one task runs its command once; the job's step runs it on each node of $FAKE_NODEIDS. A job
    # submitted with --export=NONE has SLURM_EXPORT_ENV=NONE, and its steps get only SLURM_* (sbatch(1) --export;
    # PATH and the fakes' FAKE_* kept here, for the fakes)
    "srun": 'one=0; while [ "${1#-}" != "$1" ]; do [ "$1" = --ntasks=1 ] && one=1; shift; done\n'
            'step() { [ "${SLURM_EXPORT_ENV:-ALL}" != NONE ] && { "$@"; return; }\n'
            '    mapfile -t keep < <(env | grep -E "^(SLURM|FAKE)_[A-Za-z_]*=")\n'
            '    env -i PATH="$PATH" "${keep[@]}" "$@"; }\n'
            'if [ $one = 1 ]; then step "$@"; exit; fi\n'
            'for n in $FAKE_NODEIDS; do echo "step cpus ${SRUN_CPUS_PER_TASK:-unset}"\n'
            '    SLURM_NODEID=$n step "$@" || exit; done',
    # node 0 holds the address node_addr.sh found (on ens5); the others route to it through ib0
    "ip": 'case "$*" in "-o -4 addr show to "*) [ "$SLURM_NODEID" = 0 ] && for a in $FAKE_ADDRS; do\n'
          '    [ "$a" = "$6" ] && echo "2: ens5    inet $a/24 brd 10.1.2.255 scope global ens5"; done ;;\n'
          '"-o route get "*) echo "$4 via 10.1.0.1 dev ib0 src 10.1.2.4 uid 0 \\    cache" ;; esac; true',
    "launcher": 'echo "node $SLURM_NODEID: gloo=${GLOO_SOCKET_IFNAME:-unset} $*"',
}


def run_template(tmp_path, template: str, *args: str, nodes: str = "0 1", **env) -> subprocess.CompletedProcess:
    """slurm/<template> as a 2-node job of 3 CPUs per task would run it, with srun, scontrol and hostname faked
    (tests/slurm_cluster.py runs the real ones, where every node is this host on 127.0.0.1)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in {**FAKES, "accelerate": FAKES["launcher"]}.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    job = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "3",
           "PYTHON": str(bin_dir / "launcher"), "FAKE_NODEIDS": nodes, "FAKE_ADDRS": "", "RDZV_PORT": "29555"}
    base = {k: v for k, v in os.environ.items() if k not in ("RDZV_ADDR", "SRUN_CPUS_PER_TASK", "GLOO_SOCKET_IFNAME")}
    return subprocess.run(["bash", f"slurm/{template}", *args], cwd=ROOT, capture_output=True, text=True, timeout=30,
                          env={**base, **job, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env})


def test_torchrun_template_rendezvouses_on_an_address_the_other_nodes_reach(tmp_path):
    """hostname --ip-address gives 127.0.1.1 (stock Debian): the template takes the interface's address, node 0
    alone serves the store (torch would otherwise treat a loopback endpoint as every node's own), and each
    step gets the job's CPUs per task."""
    proc = run_template(tmp_path, "torchrun.sbatch", "pytorch_DDP.py", "--epochs", "1", FAKE_ADDRS="10.1.2.3 fd00::1")
    assert proc.returncode == 0, proc.stderr
    nodes = [ln for ln in proc.stdout.splitlines() if ln.startswith("node ")]
    assert len(nodes) == 2 and all("--rdzv-endpoint=10.1.2.3:29555" in ln for ln in nodes), proc.stdout
    assert "is_host=1" in nodes[0] and "is_host=0" in nodes[1], nodes
    assert proc.stdout.count("step cpus 3") == 2, proc.stdout  # SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
    assert "--rdzv-endpoint=10.9.9.9:29555" in run_template(tmp_path, "torchrun.sbatch", "pytorch_DDP.py",
                                                            RDZV_ADDR="10.9.9.9").stdout  # the user's choice


def test_a_job_rendezvouses_on_a_port_of_its_own(tmp_path):
    """Two jobs sharing a node would both take torchrun's default 29500 and the second's store fail to bind: the
    templates take 20000 + the job id mod 10000 on every node, unless RDZV_PORT is given."""
    for template, args, flag in (("torchrun.sbatch", ["pytorch_DDP.py"], "--rdzv-endpoint=10.1.2.3:{} "),
                                 ("accelerate.sbatch", ["config/default_DDP.yml", "accelerate_DDP.py"],
                                  "--main_process_port {} ")):
        for job, given, port in (("7", "", 20007), ("10008", "", 20008), ("7", "29555", 29555)):
            proc = run_template(tmp_path, template, *args, FAKE_ADDRS="10.1.2.3", RDZV_PORT=given, SLURM_JOB_ID=job,
                                GLOO_SOCKET_IFNAME="eth7")
            nodes = [ln for ln in proc.stdout.splitlines() if ln.startswith("node ")]
            assert proc.returncode == 0 and len(nodes) == 2, (proc.stdout, proc.stderr)
            assert all(flag.format(port) in ln for ln in nodes), nodes


def test_each_node_names_gloo_the_interface_it_reaches_the_first_node_through(tmp_path):
    """Without GLOO_SOCKET_IFNAME gloo listens where the host name resolves, 127.0.1.1 here, which no other node
    reaches (slurm/node_ifname.sh): node 0 takes the interface that holds the rendezvous address, node 1 the one
    its route to it leaves by. The user's choice stands, and one node keeps gloo's own (common/distributed.py
    then puts it on loopback)."""
    for template, args in (("torchrun.sbatch", ["pytorch_DDP.py"]),
                           ("accelerate.sbatch", ["config/default_DDP.yml", "accelerate_DDP.py"])):
        proc = run_template(tmp_path, template, *args, FAKE_ADDRS="10.1.2.3")
        nodes = [ln for ln in proc.stdout.splitlines() if ln.startswith("node ")]
        assert proc.returncode == 0 and len(nodes) == 2, (proc.stdout, proc.stderr)
        assert "gloo=ens5 " in nodes[0] and "gloo=ib0 " in nodes[1], nodes
        assert "gloo on node 1: ib0" in proc.stdout  # the job's log says so
        mine = run_template(tmp_path, template, *args, FAKE_ADDRS="10.1.2.3", GLOO_SOCKET_IFNAME="eth7").stdout
        assert mine.count("gloo=eth7 ") == 2, mine
        one = run_template(tmp_path, template, *args, nodes="0", FAKE_ADDRS="10.1.2.3", SLURM_NNODES="1").stdout
        assert "gloo=unset " in one, one


def test_a_job_submitted_with_export_none_still_hands_its_steps_what_they_read(tmp_path):
    """sbatch --export=NONE (sites that keep the submit shell's environment out of jobs) sets SLURM_EXPORT_ENV=NONE,
    which every srun in the script inherits: its steps would get none of what the script exported (the head's
    address, the accelerate config and script). The templates set SLURM_EXPORT_ENV=ALL, as sbatch(1) --export
    advises."""
    for template, args in (("torchrun.sbatch", ["pytorch_DDP.py"]),
                           ("accelerate.sbatch", ["config/default_DDP.yml", "accelerate_DDP.py"])):
        proc = run_template(tmp_path, template, *args, FAKE_ADDRS="10.1.2.3", SLURM_EXPORT_ENV="NONE")
        nodes = [ln for ln in proc.stdout.splitlines() if ln.startswith("node ")]
        assert proc.returncode == 0 and len(nodes) == 2, (proc.stdout, proc.stderr)
        assert "gloo=ens5 " in nodes[0] and "gloo=ib0 " in nodes[1], nodes
        assert all("10.1.2.3" in ln and args[-1] in ln for ln in nodes), nodes


def test_a_head_node_with_only_loopback_is_refused_in_one_line(tmp_path):
    proc = run_template(tmp_path, "torchrun.sbatch", "pytorch_DDP.py")
    assert proc.returncode != 0 and "node " not in proc.stdout, proc.stdout  # no torchrun started
    assert proc.stderr.strip().count("\n") == 0 and "node_addr.sh: " in proc.stderr and "RDZV_ADDR" in proc.stderr
    one = subprocess.run(["bash", "slurm/node_addr.sh", "1"], cwd=ROOT, capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "FAKE_ADDRS": ""})
    assert one.stdout.strip() == "127.0.1.1"  # one node: loopback is what it needs


def test_accelerate_template_does_the_same(tmp_path):
    proc = run_template(tmp_path, "accelerate.sbatch", "config/default_DDP.yml", "accelerate_DDP.py", nodes="0",
                        FAKE_ADDRS="10.1.2.3")
    assert proc.returncode == 0, proc.stderr
    (node,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("node ")]
    assert "--main_process_ip 10.1.2.3" in node and "--rdzv_conf is_host=1" in node, node
    assert "step cpus 3" in proc.stdout


def test_generated_job_files_give_each_step_the_jobs_cpus(tmp_path):
    from types import SimpleNamespace

    from common.bench import slurm

    opts = SimpleNamespace(nodes=1, gpus_per_node=0, time="", partition="", account="", sbatch_arg=[])
    run = {"name": "p/one", "script": "pytorch_SingleGPU.py", "args": {}, "timeout_s": 60, "nproc": 1}
    text = slurm.sbatch_text(run, opts, str(tmp_path / "s.csv"), str(tmp_path))
    export = text.index("export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK")
    assert export < text.index('srun "$PYTHON" pytorch_SingleGPU.py')
    assert text.index("export SLURM_EXPORT_ENV=ALL") < export  # under sbatch --export=NONE too


def test_the_nodes_process_count_is_read_from_either_launcher():
    """torchrun's LOCAL_WORLD_SIZE, else the deepspeed launcher's LOCAL_SIZE; nothing set (one plain process, or
    an empty value) is None. One reader for the device check, the loader's workers, the shared-folder check, the
    loopback choice and the row."""
    assert local_world_size({"LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "2"}) == 4
    assert local_world_size({"LOCAL_SIZE": "2"}) == 2
    assert local_world_size({"LOCAL_WORLD_SIZE": "", "LOCAL_SIZE": "8"}) == 8
    assert local_world_size({}) is None and local_world_size({"LOCAL_WORLD_SIZE": ""}) is None


def test_loader_workers_are_sized_to_the_nodes_cpus(monkeypatch, capsys):
    """8 ranks of 4 workers on 16 CPUs would be 40 processes resizing images: each rank gets its share, 2."""
    from common import data

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(data, "_SIZED", [])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    cfg = TrainConfig(device="cpu", dataset="synthetic", image_size=8, batch_size=4, train_samples=8, test_samples=4,
                      workers=4)
    train, test = data.build_loaders(cfg, 0, 1, torch.device("cpu"))
    assert train.num_workers == test.num_workers == cfg.workers == 2  # the row's `workers` says what ran
    assert "rank 0: 16 CPUs for 8 processes on its node; 2 DataLoader workers per rank (--workers 4 capped" in \
        capsys.readouterr().out
    assert data.size_workers(TrainConfig(workers=4), {"LOCAL_WORLD_SIZE": "2"}) == 4  # 8 CPUs each: as asked
    assert data.size_workers(TrainConfig(workers=4), {"LOCAL_SIZE": "32"}) == 1  # fewer CPUs than ranks
    assert data.size_workers(TrainConfig(workers=0), {}) == 0
    assert capsys.readouterr().out == ""  # said once per process


def _save_dir(rank, root) -> dict:
    from common.checkpoint import check_shared_dir
    from common.config import UsageError

    check_shared_dir(os.path.join(root, "shared"))  # one folder for both: passes
    try:  # rank 1's "node" has a folder of its own under the same name
        check_shared_dir(os.path.join(root, f"node{rank}"), flag="--results")
    except UsageError as exc:
        return {"error": str(exc)}
    return {}


def _fsdp2_scaler_step(rank, world) -> dict:
    """One fp16-scaled step of a model sharded by FSDP2 with the GradScaler accelerate makes for it (a plain one,
    not ShardedGradScaler: accelerate/accelerator.py, get_fsdp2_grad_scaler), a gradient non-finite on rank 1's
    shard alone."""
    import torch.nn as nn
    from accelerate.utils.fsdp_utils import get_fsdp2_grad_scaler
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from common.accel import skipped_by_scale

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))  # dim 0 over the ranks: rank 1 holds rows 4-7
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = get_fsdp2_grad_scaler(device="cpu", init_scale=256.0)
    before = [p.full_tensor().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    if rank == 1:
        with torch.no_grad():
            model[0].weight.grad.to_local().view(-1)[0] = float("inf")
    scale = scaler._scale.clone()
    scaler.step(optimizer)
    scaler.update()
    return {"skipped": int(skipped_by_scale(scale, scaler._scale)), "scale": scaler.get_scale(),
            "unchanged": all(torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))}


def _engines_take_channels_last(rank, world) -> dict:
    """{engine: whether it wrapped a channels-last model, whether the same model in NCHW}: FSDP2's fully_shard and
    DeepSpeed's initialize, on the group as the scripts have it."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before the import, as pytorch_DeepSpeed.py
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # as a launcher sets them
    import deepspeed

    def wraps(engine, channels_last):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())
        model = model.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        try:
            if engine == "fsdp2":
                fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
            else:
                deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     config={"train_micro_batch_size_per_gpu": 1})
            return True
        except (NotImplementedError, RuntimeError):  # fully_shard's, and a tensor's .view(torch.uint8)
            return False

    return {engine: (wraps(engine, True), wraps(engine, False)) for engine in ("fsdp2", "deepspeed")}


def _two_ranks(rank, world, port, queue, root):
    """Each check's result, or its error, under its own name: one failing leaves the other's test to its own."""
    out = {}
    try:  # a rank left alone in a collective by the other's error gives up within a minute, not gloo's 30
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60),
                                store=dist.TCPStore("127.0.0.1", port, world, rank == 0))
        for name, check in (("save_dir", lambda: _save_dir(rank, root)),
                            ("fsdp2_scaler", lambda: _fsdp2_scaler_step(rank, world)),
                            ("channels_last", lambda: _engines_take_channels_last(rank, world))):
            try:
                out[name] = check()
            except Exception as exc:
                out[name] = {"error": repr(exc)}
        dist.destroy_process_group()
    except Exception as exc:
        out = {name: {"error": repr(exc)} for name in ("save_dir", "fsdp2_scaler", "channels_last")}
    queue.put((rank, out))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One gloo group of 2 spawned processes (helpers.spawn_ranks) for the checks below: (its folder, each rank's
    results)."""
    import functools

    root = tmp_path_factory.mktemp("two_ranks")
    return root, spawn_ranks(functools.partial(_two_ranks, root=str(root)))


@pytest.mark.slow  # spawns a gloo group of 2 processes (helpers.spawn_ranks)
def test_a_folder_only_one_rank_sees_is_refused_before_training(two_ranks):
    """Two ranks whose --results (as --save-dir) is a different folder on each "node" (a node-local /tmp): both
    refuse, in one line that names the flag, the folder and the rank that cannot see rank 0's files, where a
    failed run's row would have gone to the other node's disk (training would have failed at the first epoch's
    checkpoint, for --save-dir). fit() runs the check before resuming or training (common/train.py)."""
    root, got = two_ranks
    for rank in (0, 1):
        error = got[rank]["save_dir"].get("error", "")
        assert error.startswith(f"--results {root}/node{rank} is not one folder for every rank: rank 1 ("), got
        assert "\n" not in error
    assert os.listdir(root / "shared") == []  # the token is gone


@pytest.mark.slow  # the same group
def test_every_fsdp2_rank_skips_a_step_one_shard_overflowed(two_ranks):
    """accelerate_FSDP.py --precision fp16 runs on CUDA only; this is its scaler on CPU. FSDP2's gradients are
    DTensors, each rank holding its shard, and accelerate's plain GradScaler checks only what a rank holds. The
    check itself is a DTensor op whose handler takes the max of found_inf over the mesh
    (torch/distributed/tensor/_dispatch.py found_inf_reduce_handler): both ranks skip, back off the same scale
    and count the skip (common/accel.py skipped_by_scale). A rank that stepped while the other skipped would
    update its shard alone, and the two would scale the next loss differently."""
    _, got = two_ranks
    for rank in (0, 1):
        assert got[rank]["fsdp2_scaler"] == {"skipped": 1, "scale": 128.0, "unchanged": True}, (rank, got)


@pytest.mark.slow  # the same group
def test_fsdp2_and_deepspeed_still_take_no_channels_last_weight(two_ranks):
    """What the scripts' --channels-last refusal stands on (common/strategies.py): FSDP2's fully_shard and
    DeepSpeed's initialize reject a channels-last model and wrap the same model in NCHW. A release that takes it
    turns this red, and the refusal can go."""
    _, got = two_ranks
    for rank in (0, 1):
        assert got[rank]["channels_last"] == {"fsdp2": (False, True), "deepspeed": (False, True)}, (rank, got)


def test_fit_checks_the_save_dir_before_resuming_or_training(monkeypatch):
    from common import train
    from common.config import UsageError

    checked = []

    def refuse(folder, flag="--save-dir"):
        checked.append((flag, folder))
        if flag == "--save-dir":
            raise UsageError(f"checked {folder}")

    monkeypatch.setattr(train, "check_shared_dir", refuse)
    hooks = types.SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(UsageError, match="checked /nowhere"):  # before resume() reads or a batch is drawn
        train.fit(TrainConfig(save_dir="/nowhere", resume="auto"), None, [None], None, hooks, checkpointer=object())
    # no epoch checkpoint, no resume: only rank 0's final weights, so a node-local folder is fine, unless the final
    # weights are consolidated from every rank's shards (DeepSpeed's ZeRO)
    from common.checkpoint import Checkpointer, DeepSpeedCheckpointer

    quiet = TrainConfig(save_dir="/nowhere", epoch_checkpoints=False, results="/shared/runs/summary.csv",
                        figures="/shared/logs/run.json")
    monkeypatch.setattr(train, "resume", lambda *a: (_ for _ in ()).throw(RuntimeError("went on to train")))
    checked.clear()
    with pytest.raises(RuntimeError, match="went on to train"):
        train.fit(quiet, None, [None], None, hooks, checkpointer=Checkpointer.__new__(Checkpointer))
    # a failed run's row is written by the first rank to fail, on any node: the folders it writes are checked
    assert checked == [("--results", "/shared/runs"), ("--figures", "/shared/logs")]
    with pytest.raises(UsageError, match="checked /nowhere"):
        train.fit(quiet, None, [None], None, hooks, checkpointer=DeepSpeedCheckpointer.__new__(DeepSpeedCheckpointer))


def test_a_loader_bound_run_says_so_in_its_row():
    from common.train import loader_row

    assert loader_row(600.0, 560.0)["notes"] == ("the loader may bound the step: it delivered 600 img/s alone, "
                                                 "training ran at 560")
    assert loader_row(2000.0, 560.0) == {"loader_img_s": 2000.0, "notes": None}
    assert loader_row(None, 560.0)["notes"] is None  # not probed (--loader-probe-batches 0)


def test_a_foreach_optimizers_state_resumes_into_a_fused_one():
    """A checkpoint written before the optimizer was fused (or by a CPU run, which stays foreach) resumed by a
    fused one: the saved group flags must not switch its kernel back, or fp16's GradScaler step fails."""
    from common.checkpoint import load_optimizer

    model = torch.nn.Linear(4, 2)
    old = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    old.step()
    new = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    load_optimizer(new, old.state_dict())
    assert new.param_groups[0]["fused"] is True and new.state[model.weight]["momentum_buffer"] is not None
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.step(new)  # foreach flags restored here: "Expected grad_scale and found_inf to be None"


def test_another_optimizers_state_is_refused_before_the_first_step():
    """A checkpoint older than the fits check (no "fits" in run.pt) trained with AdamW, resumed with SGD: the
    load succeeds with AdamW's groups, and SGD's first step raised KeyError 'momentum' as a traceback."""
    from common.checkpoint import load_optimizer

    model = torch.nn.Linear(4, 2)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="no dampening, momentum: it was written by another optimizer"):
        load_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), adamw.state_dict())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    load_optimizer(sgd, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9).state_dict())
    assert sgd.param_groups[0]["lr"] == 0.2


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_an_optimizer_step_does_not_wait_for_the_device(monkeypatch, precision, name):
    """The host syncs (Tensor.item, Tensor.cpu) in one ScaledStep.step of the optimizer CUDA parameters get.
    Run on CPU, where GradScaler takes the same path: it depends on the optimizer alone
    (_step_supports_amp_scaling), and torch has fused SGD and AdamW kernels for CPU too. With foreach (what
    CPU parameters still get, and CUDA's before) fp16 waits once a step in _maybe_opt_step's found_inf.item()."""
    from common.optim import build_optimizer, optimizer_spec
    from common.precision import ScaledStep

    cfg = TrainConfig(optimizer=name, precision=precision)
    cuda = torch.nn.Parameter(torch.empty(2, device="meta"))
    monkeypatch.setattr(torch.nn.Parameter, "is_cuda", property(lambda self: True))  # as on a GPU
    cls, kwargs = optimizer_spec(cfg, fused=True)
    assert build_optimizer(cfg, [cuda]).defaults["fused"] is True
    assert build_optimizer(cfg, [cuda], fused=False).defaults["fused"] in (None, False)
    monkeypatch.undo()
    model = torch.nn.Linear(8, 4)
    optimizer = cls(model.parameters(), **kwargs)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    step = ScaledStep(cfg, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), scaler)
    syncs = []
    for method in ("item", "cpu"):
        real = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda self, *a, _real=real, _m=method, **k:
                            syncs.append(_m) or _real(self, *a, **k))
    for _ in range(2):
        step.backward(model(torch.randn(4, 8)).square().mean())
        syncs.clear()
        step.step()
        assert syncs == [], syncs


@pytest.mark.parametrize("backend", ["inductor", "no"])
def test_accelerates_own_compile_is_refused(monkeypatch, backend):
    """`accelerate launch --dynamo_backend inductor` sets ACCELERATE_DYNAMO_BACKEND, which accelerate's plugin
    reads (utils/dataclasses.py TorchDynamoPlugin.__post_init__): the model would be compiled in prepare(), untimed,
    under a row saying compile False (and TF32 turned on in fp32 on CUDA)."""
    from accelerate import DistributedType
    from accelerate.utils import TorchDynamoPlugin

    from common.accel import check_world
    from common.config import UsageError

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", backend)
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(dynamo_plugin=TorchDynamoPlugin()),
                                        mixed_precision="no", native_amp=False, num_processes=1,
                                        distributed_type=DistributedType.NO, device=torch.device("cpu"))
    if backend == "no":  # what every accelerate script checks once accelerate has set up
        assert check_world(accelerator, TrainConfig()) == (0, 1)
        return
    with pytest.raises(UsageError, match=r"accelerate's dynamo backend \(inductor\) compiles the model inside "):
        check_world(accelerator, TrainConfig())


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")  # the first step: skipped
@pytest.mark.parametrize("fused", [True, False])
def test_accelerate_counts_the_steps_its_scaler_skips(monkeypatch, fused):
    """accelerate_DDP.py's fp16 step on CUDA: accelerate's own optimizer wrapper and GradScaler, and the fused
    SGD the scripts build there (foreach on CPU). A fused optimizer is stepped even when the scaler found an
    overflow and skips inside its kernel, which accelerate's step_was_skipped does not see. Run on CPU, where
    GradScaler and the fused kernels take the same path; accelerate makes no fp16 scaler for a CPU itself."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState

    from common.accel import AccelerateStep

    Accelerator(cpu=True)  # the state AcceleratedOptimizer reads
    try:
        model = torch.nn.Linear(8, 4)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
        scheduler = torch.optim.lr_scheduler.LambdaLR(sgd, lambda s: 1.0)  # before prepare, as the scripts
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        optimizer = AcceleratedOptimizer(sgd, device_placement=False, scaler=scaler)
        accelerator = SimpleNamespace(scaler=scaler, backward=lambda loss: scaler.scale(loss).backward())
        step = AccelerateStep(TrainConfig(clip_grad_norm=0), accelerator, model, optimizer, scheduler)
        syncs = []
        monkeypatch.setattr(torch.Tensor, "item", lambda self, _real=torch.Tensor.item: syncs.append(1) or _real(self))
        before = model.weight.detach().clone()
        for overflow in (True, False, False):
            step.backward(model(torch.randn(4, 8)).sum() * (float("inf") if overflow else 1.0))
            step.step()
            if overflow:
                assert torch.equal(model.weight, before)  # the step was skipped, fused or not
        assert not torch.equal(model.weight, before)
        assert syncs == [] or not fused, "a fused step waited for the device"
        assert step.skipped_steps() == 1
    finally:
        AcceleratorState._reset_state(True)


@pytest.mark.parametrize("before, after, skipped", [(2.0, 1.0, 1), (2.0, 2.0, 0), (2.0, 4.0, 0), (0.0, 0.0, 1)])
def test_a_step_is_skipped_where_the_scale_backs_off_or_has_reached_zero(before, after, skipped):
    """A scale halved down to 0 stays 0, and from then on every step overflows (gradients unscaled by 1/0)."""
    from common.accel import skipped_by_scale

    assert skipped_by_scale(torch.tensor(before), torch.tensor(after)).item() == skipped
