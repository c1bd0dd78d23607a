"""`python benchmark.py doctor`: what a bug report needs, then the smoke preset on this machine's
devices with the invariants every row must satisfy, ending with a pass/fail table.

On a CPU-only machine it says so in one line, runs what CPU can run, checks what CPU can show
(the GPU columns empty, never zero) and exits 0 when those checks pass; on a GPU machine a failed
check exits 1.
"""
from __future__ import annotations

import os
import platform
import sys

import torch

from ..config import PROJECT_ROOT, UsageError
from ..measure.fingerprint import driver_version, nccl_version
from ..registry import BY_FILE
from ..results import read_rows

GPU_COLUMNS = ("peak_allocated_gib", "peak_reserved_gib", "peak_nvml_gib", "gpu_util_mean", "gpu_util_peak")


def _gpu_lines() -> list[tuple[str, str]]:
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        line = f"{p.name}, {p.total_memory / 1024 ** 3:.1f} GiB, compute capability {p.major}.{p.minor}"
        try:
            from ..measure.probes import nvml_handle

            pynvml, h = nvml_handle(torch.device("cuda", i))
            if h is not None:
                try:
                    current, _ = pynvml.nvmlDeviceGetMigMode(h)
                    line += ", MIG " + ("on" if current else "off")
                except pynvml.NVMLError:  # no MIG on this GPU, or this handle is a MIG instance
                    pass
            else:
                line += ", not found in NVML by UUID (GPU columns will stay empty)"
        except Exception:
            pass
        out.append((f"GPU {i}", line))
    return out


def build_deepspeed_cpu_ops() -> str:
    """Builds, where it is not built yet, the op every DeepSpeed process on a CPU JIT-compiles when its
    communication backend starts: deepspeed/comm/torch.py TorchBackend.__init__ calls build_shm_op(),
    ShareMemCommBuilder().load() (ninja and the C++ compiler, into ~/.cache/torch_extensions; about
    1-3 minutes on 2 cores, more while other runs compete). Training never calls it (only
    inference_all_reduce does), but the first DeepSpeed run of an environment waits for it, and its
    timeout counts it. Built once here, every later run loads it in a second. No-op with CUDA."""
    import time

    if torch.cuda.is_available():
        return "not needed (CUDA)"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return "not used here"
    start = time.time()
    builder.load(verbose=False)
    return f"{builder.NAME} ready ({time.time() - start:.0f} s)"


def _deepspeed_ops() -> str:
    """DeepSpeed's op compatibility, as `ds_report` shows it: which ops could be built here."""
    try:
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        ok, not_ok = [], []
        for name, builder in sorted(ALL_OPS.items()):
            try:
                (ok if builder.is_compatible(verbose=False) else not_ok).append(name)
            except Exception:
                not_ok.append(name)
        return f"{len(ok)} ops compatible, {len(not_ok)} not" + (f" ({', '.join(not_ok[:8])}...)" if not_ok else "")
    except Exception as exc:
        return f"not checked ({type(exc).__name__})"


def _accelerate_config() -> str:
    try:
        from accelerate.commands.config import default_config_file

        return default_config_file if os.path.isfile(default_config_file) else \
            f"none at {default_config_file} (the project passes config/default_*.yml)"
    except Exception as exc:
        return f"not checked ({type(exc).__name__})"


def environment() -> list[tuple[str, str]]:
    from importlib import metadata

    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    cuda = torch.cuda.is_available()
    rows = [("python", sys.version.split()[0] + " on " + platform.platform()),
            ("torch", torch.__version__),
            ("CUDA (torch build)", str(torch.version.cuda)),
            ("CUDA available", f"{cuda}, {torch.cuda.device_count()} device(s)"),
            ("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")),
            ("cuDNN", str(torch.backends.cudnn.version()) if cuda else "-"),
            ("NCCL", (nccl_version() or "-") if cuda else "-"),
            ("driver", (driver_version() or "not readable through NVML") if cuda else "-")]
    rows += _gpu_lines()
    rows += [("deepspeed", version("deepspeed")), ("deepspeed ops", _deepspeed_ops()),
             ("accelerate", version("accelerate")), ("accelerate config", _accelerate_config()),
             ("nvidia-ml-py", version("nvidia-ml-py")), ("onnxruntime", version("onnxruntime")),
             ("CPU", f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"),
             ("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "(unset)")),
             ("gloo address", _gloo_address())]
    return rows


def _gloo_address() -> str:
    """Where gloo listens unless GLOO_SOCKET_IFNAME says otherwise: the hostname's address
    (common/distributed.py: one-node runs use loopback; several nodes need this to be reachable)."""
    import socket

    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return f"interface {os.environ['GLOO_SOCKET_IFNAME']} (GLOO_SOCKET_IFNAME)"
    host = socket.gethostname()
    try:
        addrs = sorted({a[4][0] for a in socket.getaddrinfo(host, None)})
    except OSError as exc:
        return f"hostname {host} does not resolve ({exc.strerror}): gloo falls back to loopback, one node only"
    return (f"hostname {host} -> {', '.join(addrs)} (one-node runs use loopback; across nodes this address "
            f"must reach the others, else set GLOO_SOCKET_IFNAME)")


def check_rows(rows: list[dict], runs: list[dict], gpus: int, save_dir: str) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for the invariants every run of the matrix must satisfy."""
    checks = []
    by_name = {}
    for r in rows:
        by_name.setdefault(r["run_name"], []).append(r)

    def add(name, passed, detail=""):
        checks.append((name, bool(passed), detail))

    for run in runs:
        got = by_name.get(run["name"], [])
        expected = "skipped" if run["gpu_only"] and not gpus else "ok"
        add(f"{run['name']}: one row, status {expected}", len(got) == 1 and got[0]["status"] == expected,
            f"{len(got)} row(s): " + ", ".join(f"{r['status']} {r['error'][:120]}" for r in got))
    ok = [r for r in rows if r["status"] == "ok"]
    samples = {r["test_samples"] for r in ok}
    add("every run counted the same test samples", len(samples) <= 1, f"test_samples: {sorted(samples)}")
    for r in ok:
        name = r["run_name"]
        steps, timed = int(r["steps"] or 0), int(r["timed_steps"] or 0)
        add(f"{name}: timed window excludes the warm-up", 0 < timed <= steps, f"timed_steps {timed} of {steps}")
        path = os.path.join(save_dir, r["script"][:-3], "model_final.pt")
        add(f"{name}: model_final.pt loads into a bare torchvision {r['model']}",
            _loads(path, r["model"], int(r["image_size"] or 224)), path)
        if gpus:
            add(f"{name}: peak_allocated <= peak_reserved <= peak_nvml", _ordered(r), " / ".join(
                r[c] or "-" for c in GPU_COLUMNS[:3]))
            add(f"{name}: GPU utilization above zero", _float(r["gpu_util_peak"]) > 0, f"peak {r['gpu_util_peak']}%")
            add(f"{name}: CUDA fingerprint filled", all(r[c] for c in ("cuda_version", "driver_version")),
                f"cuda {r['cuda_version']}, driver {r['driver_version']}")
            entry = BY_FILE[r["script"]]
            if entry.one_process_gpus:
                add(f"{name}: DataParallel drives every visible GPU", int(r["num_devices"] or 0) == gpus,
                    f"num_devices {r['num_devices']} of {gpus}")
        else:
            add(f"{name}: GPU columns empty on CPU", all(r[c] == "" for c in GPU_COLUMNS),
                ", ".join(f"{c}={r[c]!r}" for c in GPU_COLUMNS if r[c]))
    return checks


def _float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _ordered(r: dict) -> bool:
    alloc, reserved, nvml = (_float(r[c]) for c in GPU_COLUMNS[:3])
    return alloc <= reserved <= nvml  # NaN (a missing value) fails


def _loads(path: str, model: str, image_size: int) -> bool:
    try:
        import torchvision

        from ..models import size_kwargs

        sd = torch.load(path, map_location="cpu", weights_only=True)
        torchvision.models.get_model(model, num_classes=10, **dict(size_kwargs(model, image_size))).load_state_dict(sd)
        return True
    except Exception:
        return False


def set_aside(path: str) -> str | None:
    """Each doctor run starts with a file of its own; the earlier ones are kept beside it, rotated as logs are:
    NAME.previous the last, NAME.previous.1 the one before, and so on; none is overwritten. Returns where the
    file went (None: there was none)."""
    if not os.path.exists(path):
        return None
    older = [path + ".previous"]
    while os.path.lexists(older[-1]):
        older.append(f"{path}.previous.{len(older)}")
    for dest, src in zip(older[::-1], older[-2::-1]):  # the free name first: each file one place older
        os.replace(src, dest)
    os.replace(path, older[0])
    return older[0]


def doctor(opts) -> int:
    from .matrix import hardware, load_matrix, only_of, run_matrix, world_size_runs

    if os.path.isdir(opts.results):  # before any work: set_aside would move the folder
        raise UsageError(f"--results {opts.results}: a folder; give the CSV file's path")
    print("# environment")
    for key, value in environment():
        print(f"{key:>22}: {value}")
    gpus, device = hardware()
    if not gpus:
        print("\nno CUDA device: the GPU checks are skipped; running and checking what CPU can run")
    only = only_of(opts)
    runs = load_matrix(opts.matrix, opts.preset, only, gpus, opts.save_dir)
    if getattr(opts, "world_sizes", ""):  # refused here, before any work and before the file below is moved
        world_size_runs(runs, opts.world_sizes, getattr(opts, "scaling", "strong"), gpus)
    if not gpus and any(BY_FILE[r["script"]].deepspeed_config for r in runs):
        print("DeepSpeed's CPU op, before any run's timeout starts (compiled once per environment): ", end="",
              flush=True)
        try:
            print(build_deepspeed_cpu_ops(), flush=True)
        except Exception as exc:  # the DeepSpeed runs will say it again, in their rows
            print(f"failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", flush=True)
    opts.dry_run = False
    kept = set_aside(opts.results)
    if kept:
        print(f"\nthe earlier {os.path.basename(opts.results)} is kept as {os.path.basename(kept)}")
    print(f"\n# {opts.preset} preset ({len(runs)} runs), results in {os.path.relpath(opts.results, PROJECT_ROOT)}")
    opts.runs = runs
    run_matrix(opts)
    checks = check_rows(read_rows(opts.results), runs, gpus, opts.save_dir)
    print("\n# checks\n\n| check | result | detail |\n|---|---|---|")
    for name, passed, detail in checks:
        print(f"| {name} | {'pass' if passed else 'FAIL'} | {detail} |")
    failed = sum(not p for _, p, _ in checks)
    print(f"\nchecks: {len(checks) - failed} pass, {failed} fail")
    return 1 if failed and gpus else 0
