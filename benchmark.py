"""Runs the whole comparison, one fresh process per experiment, then writes results/REPORT.md.

    python benchmark.py --preset smoke            # every script, tiny settings: minutes on a 2-core CPU
    python benchmark.py --preset throughput       # ResNet50/224 speed and memory, fixed steps per script
    python benchmark.py --preset seed             # the articles' experiment for every script (hours)
    python benchmark.py --preset smoke --only pytorch_DDP.py,pytorch_FSDP.py --force
    python benchmark.py report                    # rewrite the report from the CSV

The matrix lives in config/benchmark.yaml. Each run gets the launcher it needs (python, torchrun,
deepspeed, accelerate launch) and one process per GPU, or 2 gloo processes on a CPU-only machine.
A run that fails, runs out of memory, diverges or passes its time limit becomes a row with that
status and the matrix goes on. Runs already in the CSV (same run name, same device, status ok or
skipped) are not run again unless --force.
"""
from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import yaml

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)

from common.config import UsageError  # noqa: E402
from common.results import append_row, check_results_path, read_rows  # noqa: E402

DISTRIBUTED = {"pytorch_DDP.py", "pytorch_DDP_ZeRO.py", "pytorch_FSDP.py", "pytorch_DeepSpeed.py",
               "accelerate_DDP.py", "accelerate_FSDP.py", "accelerate_DeepSpeed.py"}
ACCELERATE_CONFIG = {"accelerate_DDP.py": "config/default_DDP.yml", "accelerate_FSDP.py": "config/default_FSDP.yml",
                     "accelerate_DeepSpeed.py": "config/default_DeepSpeed.yml"}
EXIT_STATUS = {3: "diverged", 4: "oom"}
PROGRESS = re.compile(r"\[progress\] epoch=(\S+) step=(\S+) loss=(\S+)(?: img_s=(\S+))?")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hardware() -> tuple[int, str]:
    import torch

    from common.runner import device_name

    gpus = torch.cuda.device_count()
    return gpus, device_name(torch.device("cuda", 0) if gpus else torch.device("cpu"))


def load_matrix(path: str, preset: str, only: list[str] | None, gpus: int) -> list[dict]:
    with open(path) as fh:
        presets = yaml.safe_load(fh)["presets"]
    if preset not in presets:
        raise UsageError(f"unknown preset '{preset}'; {path} has: {', '.join(presets)}")
    spec = presets[preset]
    runs, names = [], set()
    for run in spec["runs"]:
        script = run["script"]
        if only and script not in only and run.get("name") not in only:
            continue
        name = f"{preset}/{run.get('name', script[:-3])}"
        if name in names:
            raise UsageError(f"{path}: run name {name} appears twice; give one a 'name'")
        names.add(name)
        args = {**spec.get("args", {}), **run.get("args", {}), **run.get("gpu_args" if gpus else "cpu_args", {})}
        runs.append({"name": name, "script": script, "args": args, "gpu_only": run.get("gpu_only", False),
                     "timeout_s": run.get("timeout_s", spec.get("timeout_s", 3600))})
    if only:
        unknown = set(only) - {r["script"] for r in runs} - {r["name"].split("/", 1)[1] for r in runs}
        if unknown:
            raise UsageError(f"--only: {', '.join(sorted(unknown))} not in preset {preset}")
    return runs


def flags(args: dict) -> list[str]:
    out = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        else:
            out += [flag, str(value)]
    return out


def command(run: dict, gpus: int, results: str) -> tuple[list[str], int]:
    script, bindir = run["script"], os.path.dirname(sys.executable)
    nproc = max(gpus, 1) if gpus else 2
    # "{world}" in a value is the process count: per-GPU batch 1 is batch_size: "{world}"
    values = {k: v.format(world=nproc) if isinstance(v, str) else v for k, v in run["args"].items()}
    args = flags({**values, "results": results, "run_name": run["name"]})
    if script not in DISTRIBUTED:
        return [sys.executable, script] + args, (max(gpus, 1) if script == "pytorch_DP.py" else 1)
    port = str(free_port())
    if script == "pytorch_DeepSpeed.py":
        launcher = [os.path.join(bindir, "deepspeed"), "--num_gpus", str(nproc), "--master_port", port]
    elif script in ACCELERATE_CONFIG and gpus:
        launcher = [os.path.join(bindir, "accelerate"), "launch", "--config_file", ACCELERATE_CONFIG[script],
                    "--num_processes", str(nproc), "--main_process_port", port]
    else:  # CPU: `accelerate launch --cpu --num_processes 2` starts one process; torchrun starts two
        launcher = [os.path.join(bindir, "torchrun"), "--nproc_per_node", str(nproc), "--master_port", port]
    return launcher + [script] + args, nproc


def _reader(stream, q):
    for line in iter(stream.readline, ""):
        q.put(line)
    q.put(None)


def last_error_line(lines: list[str]) -> str:
    for line in reversed(lines):
        if re.search(r"error|Error|exception|Killed", line) and "elastic" not in line:
            return line.strip()[:300]
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")[:300]


def execute(run: dict, i: int, n: int, gpus: int, results: str, log_dir: str, t0: float) -> tuple[int, str, list[str]]:
    cmd, nproc = command(run, gpus, results)
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, run["name"].replace("/", "__") + ".log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    start = time.time()
    launcher = os.path.basename(cmd[0]) if run["script"] in DISTRIBUTED else "python"
    head = f"[{i}/{n}] {run['name']} ({launcher} x{nproc})"
    print(head, flush=True)
    lines: list[str] = []
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
        timed_out = False
        while True:
            try:
                line = q.get(timeout=1.0)
            except queue.Empty:
                line = ""
            if line is None:
                break
            if line:
                log.write(line)
                lines = (lines + [line])[-200:]
                m = PROGRESS.search(line)
                if m:
                    rate = f" {float(m.group(4)):.1f} img/s" if m.group(4) else ""
                    print(f"    {time.time() - start:6.0f}s run, {time.time() - t0:6.0f}s total | epoch {m.group(1)} "
                          f"step {m.group(2)} loss {m.group(3)}{rate}", flush=True)
            if time.time() - start > run["timeout_s"] and not timed_out:
                timed_out = True
                os.killpg(proc.pid, signal.SIGTERM)
                threading.Timer(10, lambda: proc.poll() is None and os.killpg(proc.pid, signal.SIGKILL)).start()
        code = proc.wait()
    status = "timeout" if timed_out else ("ok" if code == 0 else EXIT_STATUS.get(code, "failed"))
    print(f"    -> {status} in {time.time() - start:.0f}s (log: {os.path.relpath(log_path, ROOT)})", flush=True)
    return code, status, lines


def record_missing(run: dict, status: str, error: str, results: str, device: str, gpus: int) -> None:
    """The script could not write its own row (killed, crashed before the end, timed out)."""
    a = run["args"]
    append_row(results, {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "script": run["script"],
        "strategy": "", "precision": a.get("precision", ""), "world_size": command(run, gpus, results)[1],
        "device": "cuda" if gpus else "cpu", "device_name": device, "model": a.get("model", "resnet50"),
        "dataset": a.get("dataset", "cifar10"), "image_size": a.get("image_size", 224),
        "global_batch_size": a.get("batch_size", 128), "epochs": a.get("epochs", 5), "status": status,
        "run_name": run["name"], "error": error})


def run_matrix(opts) -> int:
    gpus, device = hardware()
    only = [s.strip() for s in opts.only.split(",")] if opts.only else None
    runs = load_matrix(opts.matrix, opts.preset, only, gpus)
    check_results_path(opts.results)
    print(f"preset {opts.preset}: {len(runs)} runs on {device} ({gpus} GPUs)" if gpus else
          f"preset {opts.preset}: {len(runs)} runs on {device} (no GPU: 2 gloo processes per distributed run)")
    t0 = time.time()
    failures = 0
    for i, run in enumerate(runs, 1):
        done = [r for r in read_rows(opts.results) if r["run_name"] == run["name"] and r["device_name"] == device]
        if not opts.force and any(r["status"] in ("ok", "skipped") for r in done):
            print(f"[{i}/{len(runs)}] {run['name']}: already in {opts.results}, skipped (--force to rerun)")
            continue
        if opts.dry_run:
            print(" ".join(command(run, gpus, opts.results)[0]))
            continue
        if run["gpu_only"] and not gpus:
            print(f"[{i}/{len(runs)}] {run['name']}: needs a GPU, recorded as skipped")
            record_missing(run, "skipped", "needs CUDA devices (see README)", opts.results, device, gpus)
            continue
        before = len(done)
        code, status, lines = execute(run, i, len(runs), gpus, opts.results, opts.log_dir, t0)
        after = [r for r in read_rows(opts.results) if r["run_name"] == run["name"] and r["device_name"] == device]
        if len(after) == before:
            record_missing(run, status if status != "ok" else "failed", last_error_line(lines), opts.results,
                           device, gpus)
        failures += status != "ok"
    print(f"matrix done in {time.time() - t0:.0f}s, {failures} run(s) not ok")
    if not opts.dry_run:
        write(opts)
    return 0


def write(opts) -> None:
    from common.report import write_report

    path = write_report(opts.results, opts.report, os.path.join(ROOT, "results", "reference.csv"))
    print(f"report: {os.path.relpath(path, ROOT)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="run", choices=("run", "report"),
                        help="run the matrix (then report), or only rewrite the report")
    parser.add_argument("--preset", default="smoke", help="smoke, seed or throughput (config/benchmark.yaml)")
    parser.add_argument("--only", default="", help="comma-separated scripts or run names of the preset")
    parser.add_argument("--results", default="results/summary.csv", help="CSV the runs append to")
    parser.add_argument("--report", default="results/REPORT.md", help="Markdown report (charts beside it)")
    parser.add_argument("--matrix", default=os.path.join(ROOT, "config", "benchmark.yaml"), help="matrix file")
    parser.add_argument("--log-dir", default="results/logs", help="one log file per run")
    parser.add_argument("--force", action="store_true", help="rerun runs already in the CSV")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    opts = parser.parse_args()
    opts.results, opts.report, opts.log_dir = (os.path.abspath(p) for p in (opts.results, opts.report, opts.log_dir))
    try:
        if opts.command == "report":
            write(opts)
            return 0
        return run_matrix(opts)
    except UsageError as exc:
        print(f"benchmark.py: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, yaml.YAMLError, KeyError) as exc:
        print(f"benchmark.py: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
