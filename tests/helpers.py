"""Test helpers: run a script the way a user would (python, torchrun, deepspeed) on tiny CPU settings."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.config import to_flags  # noqa: E402
from common.launching import free_port, launch_env  # noqa: E402

TINY = {"device": "cpu", "dataset": "synthetic", "pretrained": False, "model": "resnet18", "image_size": 32,
        "epochs": 1, "batch_size": 16, "train_samples": 64, "test_samples": 37, "workers": 0, "warmup_steps": 1,
        "log_every": 0, "lr": 0.05, "timing_warmup_steps": 1}


def tiny_args(tmp_path, **over) -> list[str]:
    """resnet18 at 32 px on a few synthetic samples: seconds per run on 2 cores."""
    return to_flags({**TINY, "results": str(tmp_path / "summary.csv"), "save_dir": str(tmp_path / "ckpt"), **over})


def half_size(precision: str) -> dict:
    """The image size of a half-precision case: 16 px where this CPU runs torch's reference half kernels
    (~30x slower than fp32: AVX2-only CPUs, or ONEDNN_MAX_CPU_ISA=AVX2), the default 32 px where oneDNN's
    native kernels run. There 16 px would put ResNet's layer4.0.conv1 (stride 2) on a 1x1 map, whose
    bf16 weight gradient oneDNN leaves uninitialised; the scripts refuse it (common/precision.py)."""
    from common.precision import native_half_kernels  # the smoke preset's rule too (common/bench/matrix.py)

    return {} if native_half_kernels(precision) else {"image_size": 16}


_HELD: set[int] = set()  # rendezvous ports of the launchers these tests have running
_HELD_LOCK = threading.Lock()  # tests/launches.py starts launchers from two threads


def hold_port() -> int:
    """A free port that no launcher these tests started holds: free_port binds and closes, so two launchers
    started together can draw the same one before either binds it. release_port(p) once its launcher ended."""
    with _HELD_LOCK:
        while (p := free_port()) in _HELD:
            pass
        _HELD.add(p)
        return p


def release_port(port: int | None) -> None:
    with _HELD_LOCK:
        _HELD.discard(port)


def launchers() -> dict[str, list[str]]:
    """Each launcher's command as found now (tests/launches.py keeps the session's first)."""
    from common.bench.matrix import tool  # benchmark.py's own lookup: a --target install runs them too

    return {"python": [sys.executable], "torchrun": tool("torchrun"), "deepspeed": tool("deepspeed")}


def launcher_cmd(launcher: str, nproc: int, port: int | None = None, found: dict | None = None) -> list[str]:
    head = (found or launchers())[launcher]
    if launcher == "torchrun":
        return [*head, "--nproc_per_node", str(nproc), "--master_port", str(port or free_port())]
    if launcher == "deepspeed":
        return [*head, "--num_gpus", str(nproc), "--master_port", str(port or free_port())]
    return head


def clean_env(env: dict | None = None) -> dict:
    """benchmark.py's environment of a run (common/launching.py) with one thread, and `env` on top."""
    return {**launch_env(threads=1), **(env or {})}


def command(script: str, args: list[str], nproc: int = 1, launcher: str = "python", port: int | None = None,
            launcher_args: tuple = (), found: dict | None = None) -> list[str]:
    return [*launcher_cmd(launcher, nproc, port, found), *launcher_args, script, *args]


def start(script: str, args: list[str], nproc: int = 1, launcher: str = "python", env: dict | None = None,
          port: int | None = None, launcher_args: tuple = (), **popen) -> subprocess.Popen:
    """run()'s command, started in the background (popen: Popen's own arguments, such as stdout)."""
    return subprocess.Popen(command(script, args, nproc, launcher, port, launcher_args), cwd=ROOT,
                            env=clean_env(env), text=True, **popen)


def run(script: str, args: list[str], nproc: int = 1, launcher: str = "python", timeout: int = 300,
        env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command(script, args, nproc, launcher), cwd=ROOT, env=clean_env(env),
                          capture_output=True, text=True, timeout=timeout)


def run_at_once(jobs: dict, timeout: int = 300) -> dict:
    """{key: (script, args) or (script, args, launch)} -> {key: CompletedProcess}: each a `python script
    args` of its own, or under launch's {"launcher": "torchrun", "nproc": 2, "launcher_args": [...],
    "env": {...}} (each launcher its own rendezvous port), all started together. For the checks whose
    process only starts and refuses (a bad flag, a bad file): each spends its ~3.5 s importing torch on
    one core, so on two cores they take half the time one after another would; two small independent
    trainings overlap in their imports, start-up, waits and exits. Output goes to files (a full pipe
    nobody reads would stall a process)."""
    import tempfile

    ports = []
    with tempfile.TemporaryDirectory() as tmp:
        started = {}
        for i, (key, (script, args, *launch)) in enumerate(jobs.items()):
            launch = launch[0] if launch else {}
            out, err = open(os.path.join(tmp, f"{i}.out"), "w+"), open(os.path.join(tmp, f"{i}.err"), "w+")
            launcher = launch.get("launcher", "python")
            if launcher != "python":
                ports.append(hold_port())
            proc = start(script, args, launch.get("nproc", 1), launcher, launch.get("env"),
                         ports[-1] if launcher != "python" else None, launch.get("launcher_args", ()), stdout=out,
                         stderr=err)
            started[key] = (proc.args, proc, out, err)
        done = {}
        try:
            for key, (cmd, proc, out, err) in started.items():
                try:
                    code = proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code = proc.wait()
                texts = []
                for fh in (out, err):
                    fh.seek(0)
                    texts.append(fh.read())
                done[key] = subprocess.CompletedProcess(cmd, code, *texts)
        finally:  # an interrupted wait leaves no process running
            for _, proc, out, err in started.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                out.close()
                err.close()
            for port in ports:
                release_port(port)
    return done


def rows(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def proc_stat(pid: int | str) -> tuple[str, list[str]] | None:
    """(command name, the fields after it) of /proc/PID/stat, None when the process is gone: the name, in
    parentheses, may hold spaces and ')' (proc(5)), so the fields start after the last ')'. fields[0] is the
    state (Z: a zombie), [1] the parent pid, [11] and [12] utime and stime in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    end = stat.rindex(")")
    return stat[stat.index("(") + 1:end], stat[end + 2:].split()


def descendants(root: int) -> dict[int, str]:
    """{pid: command name} of every live process under root, read from /proc."""
    parent, name = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        got = proc_stat(entry)
        if got is not None and got[1][0] != "Z":
            parent[int(entry)], name[int(entry)] = int(got[1][1]), got[0]
    found, frontier = {}, [root]
    while frontier:
        here = frontier.pop()
        for pid, ppid in parent.items():
            if ppid == here and pid not in found:
                found[pid] = name[pid]
                frontier.append(pid)
    return found


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {ended(proc.returncode)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def ended(code: int) -> str:
    """An exit code as a person reads it: a signal's name says who may have sent it (SIGKILL: a timeout or the
    kernel's OOM killer; SIGTERM: a process that meant to stop something)."""
    import signal

    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name}: the process was stopped)"
    except ValueError:
        return f"{code} (signal {-code})"


def one_line_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """Exit code, no traceback from the script, and its own message on one line."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ": error: " in ln]
    assert lines, proc.stderr
    return lines[0]


def pp_bytes_per_step(model: str, image_size: int, batch: int, pieces: int = 2, split: str = "") -> float:
    """What a 2-stage pipeline sends per optimizer step and rank, as the row counts it: the activation at
    the cut forward and its gradient back, for the whole batch (its micro-batches add up), one send and
    one receive per rank."""
    import torch

    from common.models import meta_model
    from common.pipeline import plan
    from common.pipeline import split as split_pieces

    net = meta_model(model).eval()
    first = split_pieces(net, plan(net, pieces, split))[0]
    act = first(torch.empty(batch, 3, image_size, image_size, device="meta"))
    return 2 * act.numel() * act.element_size()



def _pair_worker(rank, world, port, queue):
    import torch
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
        x = torch.ones(4)
        dist.all_reduce(x)
        dist.destroy_process_group()
        queue.put((rank, x.tolist()))
    except Exception as exc:
        queue.put((rank, repr(exc)))


# The full suite's peak under its basetemp: 3.7 GiB (results/campaigns/2026-11-28_xeon-amx_suite_b, its disk log),
# most of it the shared launches' checkpoints (each vit_b_16 launch's final weights are 343 MB)
SUITE_DISK_GIB = 5


def disk_problem(where: str, need_gib: float | None = None) -> str | None:
    """None when `where`'s file system has need_gib free; else why the suite cannot start. A full disk fails
    tests far from the cause (a launch's checkpoint, pytest's own tmp_path), ten of them before --maxfail."""
    import shutil

    need_gib = SUITE_DISK_GIB if need_gib is None else need_gib
    free = shutil.disk_usage(where).free / 2**30
    if free >= need_gib:
        return None
    return (f"{free:.1f} GiB free under {where}, and the full suite writes up to {need_gib:g} GiB there "
            "(its shared launches' checkpoints): free some, or give pytest --basetemp on a larger disk")


# What the suite's processes use beside its files when those are in memory: 12.4 GiB at the peak of a CI on
# 24 GiB (MemTotal - MemAvailable - Shmem every 5 s; results/campaigns/2026-12-02_epyc-avx512_suite_c)
LAUNCH_MEMORY_GIB = 14
RAM_FS = ("tmpfs", "ramfs")


def ram_temproot(basetemp: str | None, environ=None, candidate: str = "/dev/shm", mounts: str = "/proc/mounts",
                 meminfo: str = "/proc/meminfo") -> str | None:
    """The folder in memory for pytest's temporary files (conftest.py sets PYTEST_DEBUG_TEMPROOT to it), or
    None to leave them where pytest puts them. A launch's checkpoints written to a disk's page cache cost
    several times the system time of the same bytes in a tmpfs on the VMs CI runs on (the suite writes
    about 13 GB: results/campaigns/2026-12-02_epyc-avx512_suite_c). Taken when nobody chose a place
    (--basetemp, TMPDIR, PYTEST_DEBUG_TEMPROOT), `candidate` is a tmpfs with SUITE_DISK_GIB free, and the
    memory left holds the suite's files and LAUNCH_MEMORY_GIB more."""
    environ = os.environ if environ is None else environ
    if basetemp or environ.get("TMPDIR") or environ.get("PYTEST_DEBUG_TEMPROOT"):
        return None
    try:
        with open(mounts) as f:
            kinds = {parts[1]: parts[2] for parts in (line.split() for line in f) if len(parts) > 2}
        with open(meminfo) as f:
            kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f if ":" in line)}
        room = disk_problem(candidate) is None
    except (OSError, ValueError):
        return None
    available = kib.get("MemAvailable", 0) / 2**20
    if kinds.get(candidate) in RAM_FS and os.access(candidate, os.W_OK) and room \
            and available >= SUITE_DISK_GIB + LAUNCH_MEMORY_GIB:
        return candidate
    return None


def gloo_pair_problem(timeout: float = 90) -> str | None:
    """None when two spawned processes form a gloo group and all-reduce within timeout; else why not,
    with what gloo's address depends on. Every end-to-end test needs this; on a machine where it fails
    they would each wait out their own timeout, for hours."""
    import multiprocessing as mp
    import queue as queues
    import socket

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_pair_worker, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=timeout) for _ in procs)
        problem = None if all(v == [2.0] * 4 for v in got.values()) else f"results {got}"
    except queues.Empty:
        problem = f"no result within {timeout:.0f} s"
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    if problem is None:
        return None
    try:
        addrs = sorted({a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)})
    except OSError as exc:
        addrs = [f"unresolvable ({exc.strerror})"]
    return (f"two processes on this host could not form a gloo group and all-reduce: {problem}; hostname "
            f"{socket.gethostname()} -> {', '.join(addrs)}, GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME')}")


def spawn_ranks(target, world: int = 2) -> dict:
    """A real gloo group of `world` spawned processes in-test: target(rank, world, port, queue) puts
    (rank, result) on the queue; returns {rank: result}."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    return results
