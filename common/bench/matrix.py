"""The benchmark matrix: presets of config/benchmark.yaml expanded over the registry, one fresh
process (group) per run with the launcher its script needs, every outcome a CSV row.

A preset has common `args`, a `timeout_s`, `scripts: all` (one run per registry script, with the
registry's preset_args) and `runs`: an entry without `name` changes the default run of its script,
an entry with a `name` adds a run. `gpu_args` / `cpu_args` apply on that hardware only, and
`gpu_only: true` (or the registry's needs_cuda) records a run as skipped on a CPU-only machine.
`cpu_emulated_half_args` apply, on a CPU, to a run in a half precision that this CPU has no native
kernels for (torch's reference kernels take 16-34x fp32's time on a ResNet: the smoke preset trains a smaller model).
"""
from __future__ import annotations

import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import yaml

from ..config import PROJECT_ROOT, DistributedConfig, UsageError, resolve, to_flags
from ..launching import free_port, launch_env
from ..measure.host import busy_pct, describe, is_busy
from ..registry import BY_FILE, SCRIPTS
from ..results import append_row, read_figures, read_rows
from .scriptflags import unknown_args

EXIT_STATUS = {3: "diverged", 4: "oom"}
PROGRESS = "[progress] "  # a run's progress line (common/train.py progress): echoed for people, never parsed


def hardware() -> tuple[int, str]:
    import torch

    from ..measure.fingerprint import device_name

    gpus = torch.cuda.device_count()
    return gpus, device_name(torch.device("cuda", 0) if gpus else torch.device("cpu"))


def processes(script: str, gpus: int) -> int:
    """Processes a run of `script` starts: one per GPU (2 gloo processes without GPUs) for the
    distributed scripts, up to the registry's max_processes; one for the rest."""
    if not BY_FILE[script].distributed:
        return 1
    return min(gpus, BY_FILE[script].max_processes or gpus) if gpus else 2


def _entries(spec: dict, path: str) -> list[dict]:
    """The preset's run entries: the registry's default runs (scripts: all), changed or extended by `runs`."""
    runs = []
    for r in spec.get("runs") or []:
        if not isinstance(r, dict) or r.get("script") not in BY_FILE:
            raise UsageError(f"{path}: run {r} names no script of common/registry.py")
        runs.append({**r, **{k: snake_args(r.get(k), f"{path}: run {r.get('name', r['script'])}'s {k}")
                             for k in ("args", "cpu_args", "gpu_args")}})
    if spec.get("scripts") != "all":
        return runs
    out = []
    for s in SCRIPTS:
        base = {"script": s.file, "args": dict(s.preset_args), "cpu_args": dict(s.cpu_preset_args),
                "gpu_only": s.needs_cuda}
        for r in runs:
            if r["script"] == s.file and "name" not in r:  # changes the default run
                base = {**base, **{k: v for k, v in r.items() if k not in ("args", "cpu_args", "gpu_args")},
                        "args": {**base["args"], **r.get("args", {})},
                        "cpu_args": {**base["cpu_args"], **r.get("cpu_args", {})}, "gpu_args": r.get("gpu_args", {})}
        out.append(base)
        out += [r for r in runs if r["script"] == s.file and "name" in r]
    return out


def _emulated_half(spec: dict, script: str, args: dict, gpus: int) -> dict:
    """The preset's cpu_emulated_half_args where this run's half precision (its flag, else the script's default)
    would run reference kernels on this machine's CPU (with --launcher slurm: the submitting host's)."""
    from ..precision import native_half_kernels

    extra = snake_args(spec.get("cpu_emulated_half_args"), "cpu_emulated_half_args")
    precision = str(args.get("precision", BY_FILE[script].precisions[0]))
    if gpus or not extra or native_half_kernels(precision):
        return {}
    return extra


def read_presets(path: str) -> dict:
    """The presets of a matrix file, refused in one line when the file is not one."""
    with open(path) as fh:
        doc = yaml.safe_load(fh)
    presets = doc.get("presets") if isinstance(doc, dict) else None
    if not isinstance(presets, dict):
        raise UsageError(f"{path}: not a matrix file (a mapping with 'presets:' at its top)")
    return presets


def only_of(opts) -> list[str] | None:
    """--only as a list of scripts or run names; None: the whole preset."""
    return [s.strip() for s in opts.only.split(",")] if opts.only else None


def snake_args(args, where: str) -> dict:
    """Keys as the config spells its fields (batch-size -> batch_size): one key per flag when the preset's,
    the run's and the hardware's args merge, and the one the harness reads (world_size_runs, slurm.py,
    calibrate). where names the mapping in the refusal of one that is not."""
    if args is not None and not isinstance(args, dict):
        raise UsageError(f"{where} must be a mapping of flags to values; got {type(args).__name__}")
    return {str(k).replace("-", "_"): v for k, v in (args or {}).items()}


def read_preset(path: str, preset: str) -> dict:
    """One preset of a matrix file, refused in one line when the file has none of that name or it is not a
    mapping; its args spelled as the config spells its fields (snake_args)."""
    presets = read_presets(path)
    if preset not in presets:
        raise UsageError(f"unknown preset '{preset}'; {path} has: {', '.join(presets)}")
    spec = presets[preset]
    if not isinstance(spec, dict):
        raise UsageError(f"{path}: preset {preset} must be a mapping (scripts:, runs:, args:, ...)")
    return {**spec, "args": snake_args(spec.get("args"), f"{path}: {preset}'s args")}


def load_matrix(path: str, preset: str, only: list[str] | None, gpus: int, save_dir: str = "") -> list[dict]:
    """The preset's runs; save_dir (benchmark.py --save-dir) replaces every run's checkpoint folder."""
    spec = read_preset(path, preset)
    runs, names = [], set()
    for run in _entries(spec, path):
        script = run["script"]
        if only and script not in only and run.get("name") not in only:
            continue
        name = f"{preset}/{run.get('name', script[:-3])}"
        if name in names:
            raise UsageError(f"{path}: run name {name} appears twice; give one a 'name'")
        names.add(name)
        hw = {k: run.get(k) or {} for k in ("gpu_args", "cpu_args")}  # spelled by _entries, as spec's args
        args = {**spec["args"], **run.get("args", {}), **hw["gpu_args" if gpus else "cpu_args"],
                **({"save_dir": save_dir} if save_dir else {})}
        timeout = run.get("timeout_s", spec.get("timeout_s", 3600))
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise UsageError(f"{path}: {name}'s timeout_s must be a number of seconds > 0; got {timeout!r}")
        emulated = _emulated_half(spec, script, args, gpus)
        args.update(emulated)
        # the other hardware's args too: a typo in gpu_args is refused on the CPU host that writes the matrix
        unknown = unknown_args(script, {**args, **hw["cpu_args"], **hw["gpu_args"]})
        if unknown:  # else each such run launches, fails on argparse and leaves a failed row
            raise UsageError(f"{path}: {name}: {script} has no {', '.join(unknown)} (python {script} --help "
                             "lists its flags)")
        runs.append({"name": name, "script": script, "args": args, "nproc": processes(script, gpus),
                     "emulated_half": bool(emulated),
                     "gpu_only": run.get("gpu_only", False) or BY_FILE[script].needs_cuda,
                     "timeout_s": timeout})
    if only:
        unknown = set(only) - {r["script"] for r in runs} - {r["name"].split("/", 1)[1] for r in runs}
        if unknown:
            raise UsageError(f"--only: {', '.join(sorted(unknown))} not in preset {preset}")
    return runs


def world_size_runs(runs: list[dict], sizes: str, scaling: str, gpus: int) -> list[dict]:
    """Each distributed run once per process count of `sizes` ("1,2,4,8"), capped at the GPUs (2 on
    CPU); the others once. Strong scaling keeps the global batch; weak keeps the per-rank batch, so
    the preset's batch_size (and train_samples, to keep the step count) is multiplied by the count.
    The count is in the run name: the done-row skipping tells the world sizes apart."""
    try:
        counts = sorted({int(v) for v in sizes.split(",") if v.strip()})
    except ValueError:
        raise UsageError(f"--world-sizes: expected comma-separated integers, got '{sizes}'") from None
    cap = gpus if gpus else 2
    if not counts or counts[0] < 1:
        raise UsageError(f"--world-sizes: process counts must be >= 1, got '{sizes}'")
    kept = [c for c in counts if c <= cap]
    if len(kept) < len(counts):
        print(f"--world-sizes: {', '.join(str(c) for c in counts if c > cap)} left out: "
              f"this machine runs at most {cap} processes per run")
    if not kept:
        raise UsageError(f"--world-sizes {sizes}: none fits on this machine (at most {cap} processes)")
    out = []
    for run in runs:
        s = BY_FILE[run["script"]]
        if not s.distributed:
            out.append(run)
            continue
        too_many = [w for w in kept if s.max_processes and w > s.max_processes]
        if too_many:
            print(f"--world-sizes: {run['name']} left out at {', '.join(map(str, too_many))} processes: "
                  f"{s.file} runs at most {s.max_processes}")
        for w in (w for w in kept if w not in too_many):
            args = {**run["args"], "scaling": scaling}
            if scaling == "weak":
                for key in ("batch_size", "train_samples"):
                    value = args.get(key, resolve(DistributedConfig, {}).__dict__[key])
                    if not (isinstance(value, str) and "{world}" in value):  # already scales with the world
                        args[key] = int(value) * w
            suffix = f"@w{w}" + ("-weak" if scaling == "weak" else "")
            out.append({**run, "name": run["name"] + suffix, "args": args, "nproc": w})
    return out


def visible_gpu_ids() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list of ids, or None when unset."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


# The module behind each launcher's console script (torch's, deepspeed's and accelerate's setup.py
# entry points; each module ends in `if __name__ == "__main__": main()`).
LAUNCHER_MODULES = {"torchrun": "torch.distributed.run", "deepspeed": "deepspeed.launcher.runner",
                    "accelerate": "accelerate.commands.accelerate_cli"}


def tool(name: str) -> list[str]:
    """A launcher's command: its script beside this python (bin/ of the venv), else `python -m` its
    module where this python imports it, else the script on PATH. The second catches installs whose
    scripts went elsewhere (`pip install --target`, `--user` without ~/.local/bin on PATH), where every
    run of that launcher failed to start; it comes before PATH, whose script may belong to another
    environment and start the workers under another python."""
    import importlib.util
    import shutil

    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(beside):
        return [beside]
    module = LAUNCHER_MODULES[name]
    try:
        importable = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the package itself is missing
        importable = False
    found = None if importable else shutil.which(name)
    return [found] if found else [sys.executable, "-m", module]


def launcher(script: str, nproc: int, gpus: int, port: int) -> list[str]:
    """The launcher command for one run. The GPUs are those CUDA_VISIBLE_DEVICES leaves visible,
    for every launcher alike:
      torchrun, accelerate launch  inherit CUDA_VISIBLE_DEVICES and number the visible GPUs 0..n-1;
      deepspeed                    deletes CUDA_VISIBLE_DEVICES when given --num_gpus and then uses
                                   GPUs 0..n-1 of the whole machine (deepspeed/launcher/runner.py:
                                   "ignoring it because one or several of --include/--exclude/
                                   --num_gpus/--num_nodes cl args were used"); --include
                                   localhost:<the visible ids> keeps the same GPUs. Ids that are
                                   not integers (GPU-/MIG- UUIDs) cannot be named that way: such a
                                   run goes through torchrun, which pytorch_DeepSpeed.py supports."""
    s = BY_FILE[script]
    if s.launcher == "deepspeed":
        ids = visible_gpu_ids()
        if not gpus or ids is None:
            return [*tool("deepspeed"), "--num_gpus", str(nproc), "--master_port", str(port)]
        if all(i.isdigit() for i in ids):
            return [*tool("deepspeed"), "--include", "localhost:" + ",".join(ids[:nproc]), "--master_port", str(port)]
    if s.launcher == "accelerate" and gpus:
        return [*tool("accelerate"), "launch", "--config_file", s.accelerate_config,
                "--num_processes", str(nproc), "--main_process_port", str(port)]
    # torchrun; also accelerate on CPU, where `accelerate launch --cpu --num_processes 2` starts one process
    return [*tool("torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(port)]


def command(run: dict, gpus: int, results: str) -> tuple[list[str], int]:
    script, nproc = run["script"], run["nproc"]
    # "{world}" in a value is the process count: per-GPU batch 1 is batch_size: "{world}"
    values = {k: v.format(world=nproc) if isinstance(v, str) else v for k, v in run["args"].items()}
    args = to_flags({**values, "results": results, "run_name": run["name"]})
    if not BY_FILE[script].distributed:
        return [sys.executable, script] + args, (max(gpus, 1) if BY_FILE[script].one_process_gpus else 1)
    return launcher(script, nproc, gpus, free_port()) + [script] + args, nproc


def _reader(stream, q):
    for line in iter(stream.readline, ""):
        q.put(line)
    q.put(None)


def last_error_line(lines: list[str]) -> str:
    for line in reversed(lines):
        if re.search(r"error|Error|exception|Killed", line) and "elastic" not in line:
            return line.strip()[:300]
    return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")[:300]


def execute(run: dict, i: int, n: int, gpus: int, results: str, log_dir: str, t0: float) -> tuple:
    """One launch of a run: (exit code, status, the log's last lines, the row it wrote or None). The row is read
    from the JSON the run writes beside its log (--figures), not found again among the CSV's."""
    cmd, nproc = command(run, gpus, results)
    os.makedirs(log_dir, exist_ok=True)
    suffix = f"__repeat{run['args']['repeat']}" if run.get("repeats", 1) > 1 else ""
    log_path = os.path.join(log_dir, run["name"].replace("/", "__") + suffix + ".log")
    figures = log_path[:-len(".log")] + ".json"
    if os.path.exists(figures):
        os.remove(figures)  # an earlier launch's
    cmd += ["--figures", figures]
    start = time.time()
    name = "python"
    if BY_FILE[run["script"]].distributed:  # the launcher run, also when started as `python -m` its module
        name = {m: k for k, m in LAUNCHER_MODULES.items()}.get(cmd[2], cmd[2]) if cmd[1:2] == ["-m"] \
            else os.path.basename(cmd[0])
    print(f"[{i}/{n}] {label(run)} ({name} x{nproc})", flush=True)
    lines: list[str] = []
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=launch_env(nproc=nproc), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
        timed_out = False
        try:
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
                    if line.startswith(PROGRESS):
                        print(f"    {time.time() - start:6.0f}s run, {time.time() - t0:6.0f}s total | "
                              f"{line[len(PROGRESS):].rstrip()}", flush=True)
                if time.time() - start > run["timeout_s"] and not timed_out:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGTERM)
                    threading.Timer(10, lambda: proc.poll() is None and os.killpg(proc.pid, signal.SIGKILL)).start()
        except BaseException:  # Ctrl-C, or SIGTERM (benchmark.py): the run's own session would not see it
            stop(proc)
            raise
        code = proc.wait()
    status = "timeout" if timed_out else ("ok" if code == 0 else EXIT_STATUS.get(code, "failed"))
    print(f"    -> {status} in {time.time() - start:.0f}s (log: {os.path.relpath(log_path, PROJECT_ROOT)})", flush=True)
    return code, status, lines, read_figures(figures)


def stop(proc, grace_s: float = 10) -> None:
    """A launch and every process of its session: SIGTERM (torchrun and deepspeed pass it to their ranks), then
    SIGKILL after grace_s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(grace_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def record_missing(run: dict, status: str, error: str, results: str, gpus: int) -> None:
    """The script could not write its own row (killed, crashed before the end, timed out): the row
    it would have started, from the same config resolution and row builder the scripts use."""
    from ..runner import base_row

    s = BY_FILE[run["script"]]
    values = {k: v.format(world=run["nproc"]) if isinstance(v, str) else v for k, v in run["args"].items()}
    try:
        cfg = resolve(DistributedConfig, {**values, "run_name": run["name"], "results": results})
    except (UsageError, TypeError):  # the run's own flags are what failed: keep what is known
        cfg = resolve(DistributedConfig, {"run_name": run["name"], "results": results,
                                          "repeat": run["args"].get("repeat", 0)})
    row = base_row(cfg, s.file, s.strategy, s.libraries)
    used = command(run, gpus, results)[1]
    append_row(results, {**row, "world_size": used, "num_devices": used, "status": status, "error": error,
                         "cpu_threads": None, "precision": s.labelled(str(row["precision"]))})


def repeat_of(row: dict) -> int:
    """The launch index of a row; a row written without one (before --repeats) is the first launch."""
    return int(row["repeat"]) if row.get("repeat") else 1


def label(run: dict) -> str:
    repeats = run.get("repeats", 1)
    return run["name"] + (f" repeat {run['args']['repeat']}/{repeats}" if repeats > 1 else "")


def done_rows(results: str, run: dict, device: str) -> list[dict]:
    """The rows of this run (and of this launch of it) on this device."""
    return [r for r in read_rows(results) if r["run_name"] == run["name"] and r["device_name"] == device
            and repeat_of(r) == run["args"]["repeat"]]


def rounds(runs: list[dict], repeats: int, gpus: int) -> list[dict]:
    """Every run `repeats` times, interleaved (round r of every run, then round r + 1), so that drift
    over the matrix (thermals, other tenants, caches) hits every run alike rather than the last ones.
    A run recorded as skipped (a GPU run on a CPU-only machine) is recorded once."""
    out = []
    for r in range(1, repeats + 1):
        out += [{**run, "args": {**run["args"], "repeat": r}, "repeats": repeats} for run in runs
                if r == 1 or not (run["gpu_only"] and not gpus)]
    return out


def _counts(opts) -> tuple[int, int]:
    """(--repeats, --relaunch-busy), refused in one line when out of range."""
    repeats, relaunch = getattr(opts, "repeats", 1), getattr(opts, "relaunch_busy", 0)
    if repeats < 1:
        raise UsageError(f"--repeats must be >= 1; got {repeats}")
    if relaunch < 0:
        raise UsageError(f"--relaunch-busy must be >= 0; got {relaunch}")
    return repeats, relaunch


def _announce(opts, runs: list, device: str, gpus: int, repeats: int) -> None:
    times = f", each launched {repeats} times, round by round" if repeats > 1 else ""
    print(f"preset {opts.preset}: {len(runs)} runs on {device} ({gpus} GPUs){times}" if gpus else
          f"preset {opts.preset}: {len(runs)} runs on {device} (no GPU: 2 gloo processes per distributed run){times}")
    emulated = [r for r in runs if r.get("emulated_half")]
    if emulated:
        first = emulated[0]["args"]
        kinds = ", ".join(sorted({str(r["args"].get("precision", BY_FILE[r["script"]].precisions[0]))
                                  for r in emulated}))
        print(f"this CPU has no native kernels for {kinds}: "
              f"{len(emulated)} half-precision run(s) train {first.get('model')} at {first.get('image_size')} px "
              "(the preset's cpu_emulated_half_args)")


def _launch(opts, run: dict, i: int, n: int, gpus: int, relaunch: int, t0: float) -> str:
    """One run of the matrix, launched again up to `relaunch` times while its window found the host busy; its
    status. A launch that wrote no row gets one that says why."""
    status = "ok"
    for attempt in range(relaunch + 1):
        code, status, lines, row = execute(run, i, n, gpus, opts.results, opts.log_dir, t0)
        if attempt and status != "ok":  # the busy launch's ok row stands; the failed relaunch's log says why
            print("    the launch again did not end ok: the busy launch is kept", flush=True)
            return "ok"
        if row is None:  # no figures: a run that ended ok wrote its row before them (common/runner.py _figures)
            if status != "ok":
                record_missing(run, status, last_error_line(lines), opts.results, gpus)
            return status
        if status != "ok" or not is_busy(busy_pct(row)):
            return status
        again = attempt < relaunch
        share = describe(row.get("host_other_pct"), row.get("host_steal_pct"))
        print(f"    the host was busy in its window ({share}): "
              + (f"launched again ({attempt + 1} of {relaunch}); the report reads the newest launch" if again
                 else "kept, busy"), flush=True)
    return status


def run_matrix(opts) -> int:
    """The matrix on this machine (benchmark.py sends --launcher slurm to common/bench/slurm.py)."""
    from ..results import check_results_path

    gpus, device = hardware()
    only = only_of(opts)
    repeats, relaunch = _counts(opts)
    runs = getattr(opts, "runs", None) or load_matrix(opts.matrix, opts.preset, only, gpus,
                                                      getattr(opts, "save_dir", ""))
    if getattr(opts, "world_sizes", ""):
        runs = world_size_runs(runs, opts.world_sizes, opts.scaling, gpus)
    check_results_path(opts.results)
    _announce(opts, runs, device, gpus, repeats)
    runs = rounds(runs, repeats, gpus)
    t0, failures = time.time(), 0
    for i, run in enumerate(runs, 1):
        done = done_rows(opts.results, run, device)
        if not opts.force and any(r["status"] in ("ok", "skipped") for r in done):
            print(f"[{i}/{len(runs)}] {label(run)}: already in {opts.results}, skipped (--force to rerun)")
        elif opts.dry_run:
            print(" ".join(command(run, gpus, opts.results)[0]))
        elif run["gpu_only"] and not gpus:
            print(f"[{i}/{len(runs)}] {run['name']}: needs a GPU, recorded as skipped")
            record_missing(run, "skipped", "needs CUDA devices (see docs/gpu-first-hour.md)", opts.results, gpus)
        else:
            failures += _launch(opts, run, i, len(runs), gpus, relaunch, t0) != "ok"
    print(f"matrix done in {time.time() - t0:.0f}s, {failures} run(s) not ok")
    return failures
