"""benchmark.py --launcher slurm: every run of a preset becomes one Slurm job.

The job file (results/slurm/<run>.sbatch) holds the #SBATCH lines of this run and calls the
template its launcher needs (slurm/torchrun.sbatch or slurm/accelerate.sbatch), so what the matrix
submits is what a user submits by hand. The job's rank 0 appends the row to the shared CSV under
its file lock, as on one machine; a job that ends without a row (killed, timed out, never started)
gets one here, from record_missing.
"""
from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

from ..config import PROJECT_ROOT, TrainConfig, UsageError, to_flags
from ..registry import BY_FILE
from ..results import check_results_path, read_rows
from .matrix import EXIT_STATUS, last_error_line, load_matrix, only_of, record_missing

TIME = re.compile(r"^(\d+-)?\d+(:\d{2}){0,2}$")
# Slurm job states (squeue/scontrol JobState) a run can end in, as the row's status
STATE_STATUS = {"COMPLETED": "ok", "TIMEOUT": "timeout", "OUT_OF_MEMORY": "oom", "DEADLINE": "timeout"}


def hms(seconds: int) -> str:
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def job_file_name(run: dict) -> str:
    return run["name"].replace("/", "__")


def layout(run: dict, nodes: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, processes per node): one process per GPU (one on a CPU node) for the distributed
    scripts, one process on one node for the rest."""
    s = BY_FILE[run["script"]]
    if not s.distributed:
        return 1, 1
    per_node = max(gpus_per_node, 1)
    if s.max_processes and nodes * per_node > s.max_processes:  # e.g. 4 pipeline stages at most
        nodes = min(nodes, s.max_processes)
        per_node = max(1, s.max_processes // nodes)
    return nodes, per_node


@functools.lru_cache(maxsize=8)
def node_cpus(partition: str) -> int | None:
    """The fewest CPUs a node of the partition has (sinfo's %c), None where Slurm cannot be asked (a
    dry run on a machine without it): a job asking more than any node has pends forever."""
    if not shutil.which("sinfo"):
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%c", *(["-p", partition] if partition else [])],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    counts = [int(c) for c in re.findall(r"\d+", out)]
    return min(counts) if counts else None


def sbatch_text(run: dict, opts, results: str, log_dir: str) -> str:
    s = BY_FILE[run["script"]]
    nodes, per_node = layout(run, opts.nodes, opts.gpus_per_node)
    values = {k: v.format(world=nodes * per_node) if isinstance(v, str) else v for k, v in run["args"].items()}
    # the templates give each job its own checkpoint folder under SAVE_DIR, so that --resume auto
    # continues a restarted group and never an earlier job; a save_dir in the flags would override it
    save_root = (values.pop("save_dir", None) if s.distributed else None) or \
        os.path.join(os.path.dirname(log_dir), "checkpoints")
    args = shlex.join(to_flags({**values, "results": results, "run_name": run["name"]}))
    name = job_file_name(run)
    sbatch = [f"--job-name={name}", f"--nodes={nodes}", "--ntasks-per-node=1",
              f"--output={os.path.join(log_dir, name)}-%j.log", f"--time={opts.time or hms(run['timeout_s'])}"]
    # DataParallel and model parallel use the node's GPUs from one process; a pipeline asks only for its stages
    sbatch += [f"--gpus-per-node={per_node if s.distributed else opts.gpus_per_node}"] if opts.gpus_per_node else []
    sbatch += [f"--partition={opts.partition}"] if opts.partition else []
    sbatch += [f"--account={opts.account}"] if opts.account else []
    if not any(a.startswith(("--cpus-per-task", "-c", "--cpus-per-gpu", "--exclusive")) for a in opts.sbatch_arg or []):
        # every rank and its loader workers a core of their own (torchrun's agent shares): without it a
        # site with no per-GPU CPU default gives the node's one task a single core
        workers = values.get("workers", TrainConfig.workers)
        want, cap = (per_node if s.distributed else 1) * (int(workers) + 1), node_cpus(opts.partition or "")
        sbatch += [f"--cpus-per-task={want if cap is None else max(1, min(want, cap))}"]
    sbatch += list(opts.sbatch_arg or [])
    if not s.distributed:
        launch = f"srun \"$PYTHON\" {s.file} {args}"
    elif s.launcher == "accelerate" and opts.gpus_per_node:
        launch = f"bash slurm/accelerate.sbatch {s.accelerate_config} {s.file} {args}"
    else:  # torchrun, also for DeepSpeed (it reads torchrun's environment) and accelerate on CPU nodes
        launch = f"bash slurm/torchrun.sbatch {s.file} {args}"
    return "\n".join(
        ["#!/bin/bash", f"# {run['name']}: written by benchmark.py --launcher slurm; submit with sbatch"]
        + [f"#SBATCH {shlex.quote(a)}" for a in sbatch]
        + ["set -euo pipefail", f"cd {shlex.quote(PROJECT_ROOT)}",
           f"export PYTHON={shlex.quote(sys.executable)} PATH={shlex.quote(os.path.dirname(sys.executable))}:$PATH",
           f"export GPUS_PER_NODE={per_node}",  # the rendezvous port: the job's own (slurm/torchrun.sbatch)
           f"export SAVE_DIR={shlex.quote(save_root)}",
           # the steps get what this script exports under sbatch --export=NONE too (slurm/torchrun.sbatch)
           "export SLURM_EXPORT_ENV=ALL",
           # a step does not inherit the job's --cpus-per-task since Slurm 22.05 (slurm/torchrun.sbatch)
           'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi',
           launch, ""])


def submit(path: str) -> tuple[str, int, str]:
    """sbatch --wait: (job id, exit code of sbatch, the job's final state)."""
    proc = subprocess.run(["sbatch", "--wait", "--parsable", path], capture_output=True, text=True)
    job = proc.stdout.strip().split(";")[0]
    if not job:
        raise UsageError(f"sbatch {path} failed: {(proc.stderr or proc.stdout).strip()[:300]}")
    show = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    state = re.search(r"JobState=(\S+)", show)
    return job, proc.returncode, state.group(1) if state else "UNKNOWN"


def job_status(code: int, state: str) -> str:
    if state in STATE_STATUS:
        return STATE_STATUS[state]
    return EXIT_STATUS.get(code, "failed")


def job_error(lines: list[str]) -> str:
    """The script's own one-line verdict ("pytorch_DDP.py: error: ..."), else the last error line
    that is not Slurm's own aftermath (srun's "task 0: Terminated" names no cause)."""
    own = [ln.strip() for ln in lines if re.match(r"^\S+\.py: ", ln)]
    return own[-1][:300] if own else last_error_line([ln for ln in lines if not ln.startswith(("srun:", "slurmstepd"))])


def job_log(log_dir: str, run: dict, job: str) -> list[str]:
    try:
        with open(os.path.join(log_dir, f"{job_file_name(run)}-{job}.log"), errors="replace") as fh:
            return fh.readlines()[-200:]
    except OSError:
        return []


def check_opts(opts) -> None:
    if opts.nodes < 1 or opts.gpus_per_node < 0:
        raise UsageError(f"--nodes {opts.nodes} --gpus-per-node {opts.gpus_per_node}: need nodes >= 1, GPUs >= 0")
    if opts.time and not TIME.match(opts.time):
        raise UsageError(f"--time {opts.time}: expected HH:MM:SS (or D-HH:MM:SS, or minutes)")
    if not opts.dry_run and not shutil.which("sbatch"):
        raise UsageError("--launcher slurm: sbatch is not on PATH (run this on a Slurm login node, or use --dry-run)")


def run_slurm(opts) -> int:
    if getattr(opts, "repeats", 1) != 1 or getattr(opts, "world_sizes", "") or getattr(opts, "relaunch_busy", 0):
        raise UsageError("--repeats, --world-sizes and --relaunch-busy run with the local launcher only (one sbatch "
                         "job per run has no rounds, world-size sweep or relaunch yet)")
    check_opts(opts)
    only = only_of(opts)
    runs = load_matrix(opts.matrix, opts.preset, only, opts.gpus_per_node, getattr(opts, "save_dir", ""))
    check_results_path(opts.results)
    job_dir = os.path.join(os.path.dirname(opts.results), "slurm")  # results/slurm beside results/summary.csv
    log_dir = os.path.join(job_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    print(f"preset {opts.preset}: {len(runs)} Slurm jobs of up to {opts.nodes} nodes x "
          f"{max(opts.gpus_per_node, 1)} {'GPUs' if opts.gpus_per_node else 'CPU processes'}")
    failures = 0
    for i, run in enumerate(runs, 1):
        ran = [r for r in read_rows(opts.results) if r["run_name"] == run["name"]]
        if not opts.force and not opts.dry_run and any(r["status"] in ("ok", "skipped") for r in ran):
            print(f"[{i}/{len(runs)}] {run['name']}: already in {opts.results}, skipped (--force to rerun)")
            continue
        nodes, per_node = layout(run, opts.nodes, opts.gpus_per_node)
        run = {**run, "nproc": nodes * per_node}  # the world record_missing writes
        if run["gpu_only"] and not opts.gpus_per_node:
            print(f"[{i}/{len(runs)}] {run['name']}: needs GPUs (--gpus-per-node), recorded as skipped")
            if not opts.dry_run:
                record_missing(run, "skipped", "needs CUDA devices (see docs/gpu-first-hour.md)", opts.results, 0)
            continue
        path = os.path.join(job_dir, job_file_name(run) + ".sbatch")
        with open(path, "w") as fh:
            fh.write(sbatch_text(run, opts, opts.results, log_dir))
        if opts.dry_run:
            print(f"[{i}/{len(runs)}] {run['name']}: {os.path.relpath(path)}")
            continue
        start = time.time()
        print(f"[{i}/{len(runs)}] {run['name']}: sbatch --wait {os.path.relpath(path)}", flush=True)
        job, code, state = submit(path)
        status = job_status(code, state)
        print(f"    -> job {job} {state}: {status} in {time.time() - start:.0f}s", flush=True)
        if len([r for r in read_rows(opts.results) if r["run_name"] == run["name"]]) == len(ran):
            error = job_error(job_log(log_dir, run, job)) or f"job {job} ended {state}"
            record_missing(run, status if status != "ok" else "failed", error, opts.results, opts.gpus_per_node)
        failures += status != "ok"
    print(f"job files in {os.path.relpath(job_dir)}" if opts.dry_run else f"{len(runs)} jobs done, {failures} not ok")
    return failures
