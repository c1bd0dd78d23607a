"""`python benchmark.py calibrate`: the step model's inputs measured on this machine, written to
results/calibration.json (common/predict/calibration.py says what is in it), read by every run's
pred_step_ms and by `advise --calibration`.

    python benchmark.py calibrate                                  # the smoke preset's setups, 1 and 2 ranks
    python benchmark.py calibrate --preset seed --world-sizes 1,4  # on a 4-GPU machine
    python benchmark.py calibrate --model resnet50 --image-size 224 --batch-size 128 --modes fp32,amp_bf16

Compute is measured by the project's own single-device scripts (pytorch_SingleGPU.py, and
pytorch_auto_mixed_precision.py / pytorch_half_precision.py for the half modes): their
step_compute_ms and step_optimizer_ms over the timed window, so the loop's own cost is in the input.
For every world size n: each compute mode at the micro-batch a data-parallel rank of n gets (the
global batch / n) and, with --microbatches M, a pipeline's (batch / M); then the collectives at n
ranks (benchmarks/collectives.py, fitted per kind). --repeats N: N launches of each, medians kept; the
compute entries launched round by round (every entry once, then again), the collectives' launches spread
over the world size's entries (its start, middle and end).
On a CPU the compute is measured by n processes at once, each with the threads a run of n ranks gets,
meeting before every optimizer step as the ranks of a job do (common/bench/lockstep.py).
At n > 1 a ResNet's four one-stage pieces are also timed one after another at the data-parallel
micro-batch (when a rank's units' gradients are ready) and with --microbatches at the pipeline's (its
stage shares).
Entries are merged into the file: a setup measured again replaces its entry; a file calibrated on
another device is replaced whole.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

from ..config import DistributedConfig, UsageError, resolve, to_flags
from ..launching import free_port, launch_env
from ..measure.host import LaunchShare, busy_pct, describe, is_busy
from ..names import classification_models
from .lockstep import in_lockstep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("fp32", "tf32", "amp_fp16", "amp_bf16", "pure_fp16", "pure_bf16")


def add_args(p) -> None:
    p.add_argument("--preset", default="smoke", help="take model, image size, batch and optimizer from this preset")
    p.add_argument("--matrix", default=os.path.join(ROOT, "config", "benchmark.yaml"), help="matrix file")
    p.add_argument("--model", default="", help="override the preset's model")
    p.add_argument("--image-size", type=int, default=0, help="override the preset's image size")
    p.add_argument("--batch-size", type=int, default=0, help="override the preset's GLOBAL batch")
    p.add_argument("--optimizer", default="", help="override the preset's optimizer (sgd, adamw)")
    p.add_argument("--modes", default="fp32", help=f"compute modes, comma-separated: {', '.join(MODES)}")
    p.add_argument("--world-sizes", default="", help="rank counts, e.g. 1,2 (default: 1 and 2 on CPU, 1 and every "
                   "GPU on a GPU machine)")
    p.add_argument("--microbatches", type=int, default=4, help="also the micro-batch of a pipeline of M (0 = no)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--threads", type=int, default=0, help="CPU threads per process (default: the cores / the "
                   "ranks, benchmark.py's OMP_NUM_THREADS rule)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per setup (after 3 warm-up steps)")
    p.add_argument("--repeats", type=int, default=1, help="launches per compute entry and of the collectives, the "
                   "median kept (a 2-core CPU moves 15-35%% between launches: 3 make the entries steadier, at 3x "
                   "the time)")
    p.add_argument("--relaunch-busy", type=int, default=2, help="launch an entry or the collectives again, up to N "
                   "times, when the host was busy with other work or the hypervisor (10%% or more of its CPU time: "
                   "common/measure/host.py); 0: keep every launch")
    p.add_argument("--link-max-bytes", default="auto", help="largest collective message timed (K, M, G suffixes); "
                   "auto: the power of two at or above the model's fp32 parameter bytes, at least 32M (DeepSpeed "
                   "all-reduces and all-gathers them whole: resnet18's 45 MB, 64M; resnet50's 102 MB, 128M)")
    p.add_argument("--link-min-bytes", default="256", help="smallest collective message timed (default 256: a "
                   "BatchNorm's weights, which DDP+ZeRO broadcasts one by one; sizes double up to the largest)")
    p.add_argument("--channels-last", action="store_true", help="also each mode in channels-last (NHWC) at every "
                   "micro-batch; the preset's single-device runs with channels_last get theirs without it")
    p.add_argument("--no-strategies", action="store_true", help="skip the distributed runs of the preset on one "
                   "process (each strategy's own host work; fp32)")
    p.add_argument("--workers", type=int, default=None, help="loader worker processes in each compute entry's run "
                   "(default: the preset's on a GPU, 0 on a CPU), so that the entries run as the runs do")
    p.add_argument("--out", default=os.path.join("results", "calibration.json"), help="the calibration file")


# each mode's script and flags; tf32: the single device with --tf32 (tensor-core fp32 on CUDA), priced apart
# from fp32 (calibration.compute_mode)
SCRIPT = {"fp32": ("pytorch_SingleGPU.py", ()), "tf32": ("pytorch_SingleGPU.py", ("--tf32",)),
          "amp_fp16": ("pytorch_auto_mixed_precision.py", ("--precision", "fp16")),
          "amp_bf16": ("pytorch_auto_mixed_precision.py", ("--precision", "bf16")),
          "pure_fp16": ("pytorch_half_precision.py", ("--precision", "fp16")),
          "pure_bf16": ("pytorch_half_precision.py", ("--precision", "bf16"))}


def _spawn(spec: dict, procs: int, threads: int):
    """A draw of the plain compute: `procs` single-device runs at once (the project's own loop, its
    step_compute_ms and step_optimizer_ms); the slowest one's figures (it sets a synchronous step's pace)."""
    script, flags = SCRIPT[spec["mode"]]
    cmds = [[sys.executable, script, *to_flags(_run_args(spec)), *flags] for _ in range(procs)]
    return lambda: _concurrent(cmds, threads, f"{script} {spec}")


def _quiet(draw, relaunch: int, what: str):
    """draw() again, up to `relaunch` times, while the host was busy with other work or the hypervisor during
    it (BUSY_PCT or more of its CPU time): an entry measured while the hypervisor took a third of the CPUs
    prices every run from it a third slow (on a 2-core VM: one FSDP launch 1396 ms a step at 35.6% stolen, the
    others 625-671 ms at 0.1-2.3%). A draw's busy share is its row's timed window's (`_busy_pct`)
    where it is one run, else the whole launch's seen from here. The last draw is kept."""
    for attempt in range(relaunch + 1):
        with LaunchShare() as share:
            got = draw()
        row = got[1] if isinstance(got, tuple) and isinstance(got[1], dict) else {}
        busy = row.get("_busy_pct") if row.get("_busy_pct") is not None else share.pct
        if not is_busy(busy):
            return got
        again = attempt < relaunch
        split = (describe(row["host_other_pct"], row["host_steal_pct"]) if row.get("_busy_pct") is not None else
                 describe(share.other, share.steal) + ", over the whole launch")
        print(f"{what}: the host was busy ({busy:.1f}% of its CPU time: {split}): "
              + (f"launched again ({attempt + 1} of {relaunch})" if again else "kept, busy"), flush=True)
    return got


def _median_of(repeats: int, draw) -> tuple[dict, dict]:
    """`repeats` draws of (figures, row): each figure's median over the draws, and the first draw's row.
    Launch to launch is where a CPU's time moves (15-35% on 2 cores); the steps of one launch agree."""
    return _medians([draw() for _ in range(max(1, repeats))])


def _medians(draws: list) -> tuple[dict, dict]:
    import statistics

    return {k: statistics.median(d[0][k] for d in draws) for k in draws[0][0]}, draws[0][1]


def _rounds(jobs: list, repeats: int, between=None, relaunch: int = 0) -> dict:
    """{name: (each figure's median, the first draw's row)} of jobs [(name, draw, optional)], launched round
    by round (every job's r-th launch before any job's r+1-th), as the matrix runs its --repeats: a 2-core
    CPU has slow spells longer than a launch (launch-to-launch speed correlated 0.26-0.28 from one launch
    to the next), and back-to-back launches of one entry shared one (two entries of the same
    forward and backward, DeepSpeed ZeRO-1's and ZeRO-2's on one process, 119 and 95 ms). `between()` runs
    after the first round. An optional job whose launch fails is left out, with its reason. A draw on a busy
    host is drawn again, up to `relaunch` times (_quiet)."""
    draws: dict = {name: [] for name, _, _ in jobs}
    for r in range(max(1, repeats)):
        for name, draw, optional in jobs:
            if name not in draws:
                continue
            try:
                draws[name].append(_quiet(draw, relaunch, f"compute {name}"))
            except UsageError as exc:
                if not optional:
                    raise
                print(f"strategy {name}: not calibrated ({exc})", flush=True)
                del draws[name]
        print(f"round {r + 1} of {max(1, repeats)}: {len(draws)} compute entries launched", flush=True)
        if r == 0 and between is not None:
            between()
    return {name: _medians(got) for name, got in draws.items()}


def _run_args(spec: dict) -> dict:
    warmup, b = 3, spec["batch"]
    return {"device": spec["device"], "dataset": "synthetic", "pretrained": False, "model": spec["model"],
            "image_size": spec["image_size"], "batch_size": b, "optimizer": spec["optimizer"], "epochs": 1,
            "train_samples": b * (warmup + spec["steps"]), "test_samples": b, "workers": spec.get("workers", 0),
            "warmup_steps": 0,
            "log_every": 0, "timing_warmup_steps": warmup, "loader_probe_batches": 0, "epoch_checkpoints": False,
            "channels_last": bool(spec.get("channels_last"))}


def _concurrent(cmds: list[list[str]], threads: int, what: str) -> tuple[dict, dict]:
    """Runs the commands at once (each with its own results and checkpoint folder), in lockstep when there are
    several (common/bench/lockstep.py); the slowest one's compute and optimizer phases, split 1:2 into forward
    and backward as their FLOPs are, and its row."""
    from torch.distributed import TCPStore

    env = launch_env(threads)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if len(cmds) > 1 else None
    with tempfile.TemporaryDirectory() as tmp:
        running = []
        for i, cmd in enumerate(cmds):
            if store is not None:
                cmd = in_lockstep(cmd, _script_of(cmd), f"127.0.0.1:{store.port}:{len(cmds)}",
                                  os.path.join(tmp, f"{i}.waits.json"))
            cmd = cmd + ["--results", os.path.join(tmp, f"{i}.csv"), "--save-dir", os.path.join(tmp, f"ck{i}")]
            err = open(os.path.join(tmp, f"{i}.err"), "w")  # a file, not a pipe nobody reads while it runs
            running.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                             start_new_session=True), err))
        failed = _wait_all([proc for proc, _ in running])
        got = [_finished(tmp, i, proc, err, what) for i, (proc, err) in
               sorted(enumerate(running), key=lambda x: x[0] != failed)]  # the first to fail first
        got.sort(key=lambda g: g[0])
        rows, waits = [g[1] for g in got], [g[2] for g in got]
    return _figures(rows, waits)


def _script_of(cmd: list[str]) -> str:
    """The training script of a run's command: its first argument that is one of the top-level scripts."""
    from ..registry import BY_FILE

    return next(a for a in cmd if a in BY_FILE)


def _finished(tmp: str, i: int, proc, err, what: str) -> tuple[int, dict, tuple]:
    """(index, row, the window's (mean wait, mean wait when last)) of a finished run; a failed one refused."""
    from ..results import read_rows
    from .lockstep import window_waits

    err.close()
    path = os.path.join(tmp, f"{i}.csv")
    rows = read_rows(path) if os.path.exists(path) else []
    if proc.returncode or not rows or rows[-1]["status"] != "ok":
        with open(os.path.join(tmp, f"{i}.err")) as fh:
            raise UsageError(f"calibration run {what} failed (exit {proc.returncode}): {_error_line(fh.read())}")
    row, waits = rows[-1], os.path.join(tmp, f"{i}.waits.json")
    return i, row, window_waits(waits, int(float(row["timed_steps"]))) if os.path.exists(waits) else (0.0, None)


def _figures(got: list[dict], waits: list[tuple]) -> tuple[dict, dict]:
    """The entry's figures from its runs' rows and their lockstep waits (taken off their optimizer phases,
    inside which the harness meets)."""
    # one run's window holds its host share; of several at once each counts the others' work as other work,
    # and _quiet takes the whole launch's share, seen from here, instead
    busy = busy_pct(got[0]) if len(got) == 1 else None
    opts = [float(r["step_optimizer_ms"]) - 1e3 * w[0] for r, w in zip(got, waits)]
    compute = max(float(r["step_compute_ms"]) for r in got)
    opt = max(opts)
    # the entry's compute and optimizer are each the slowest run's: more than the slowest run's sum when
    # different runs are slowest in each, which is skew the wait would count again
    base = compute + opt - max(float(r["step_compute_ms"]) + o for r, o in zip(got, opts))
    # a distributed script's collectives at world size 1 (its profiled steps: common/train.py), outside
    # compute and optimizer; an n-rank prediction prices n ranks' collectives instead, a one-process one this
    own = max(float(r.get("step_comm_exposed_ms") or 0.0) for r in got)
    return {"fwd_ms": compute / 3, "bwd_ms": 2 * compute / 3, "opt_ms": opt,
            "sync_ms": max(0.0, _sync_ms(waits) - base), "own_comm_ms": own}, \
        {**got[0], "_busy_pct": busy}


def _sync_ms(waits: list[tuple]) -> float:
    """What the runs' step-to-step variation adds to a synchronous step (0 for one run), from each run's window
    waits (mean wait, mean wait when it arrived last). Run i's work between two meetings is a_i and it waits
    max_j(a_j) - a_i, so the mean step is E[a_i] + E[wait_i] for every i and its excess over the slowest run's
    mean, max_i E[a_i], is min_i E[wait_i]. A meeting also costs its store round trips, which a job's
    collective does not (its latency is the link's): that is what a run waits when it arrives last, taken off
    (two lockstep DeepSpeed ZeRO-2 runs of 16 images at 64 px on 2 cores: least waits 2.8-4.1 ms of a 245 ms
    step; the plain model's 0.5-0.9)."""
    if len(waits) < 2:
        return 0.0
    lasts = [last for _, last in waits if last is not None]
    cost = sum(lasts) / len(lasts) if lasts else 0.0
    return max(0.0, 1e3 * (min(w for w, _ in waits) - cost))


def _wait_all(procs: list) -> int | None:
    """Waits for every process; when one fails the others are stopped (in lockstep they would wait for it
    until the store's timeout). The index of the first that failed, or None."""
    import time

    def stop_all():
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the launcher and its ranks (their own session)

    failed = None
    try:
        while any(p.poll() is None for p in procs):
            if failed is None:
                failed = next((i for i, p in enumerate(procs) if p.poll()), None)
                if failed is not None:
                    stop_all()
            time.sleep(0.05)
    except BaseException:  # Ctrl-C: the runs are in sessions of their own and would not see it
        stop_all()
        raise
    return failed if failed is not None else next((i for i, p in enumerate(procs) if p.returncode), None)


def loader_workers(given: int | None, preset_args: dict, cuda: bool) -> int:
    """The loader workers of the compute entries' runs: on a GPU the preset's, so that an entry runs as the
    runs do; on a CPU 0, as the CPU grids were checked (a loader's share of the cores is priced apart: the
    loader bound of timepred.py). On an H100 an AMP step at batch 32 runs at the launching thread's pace, and
    entries measured without workers priced it 16-23% short where an entry with the runs' workers held
    (results/campaigns/2026-11-27_h100_throughput_b). An entry's 13 batches are fewer than 8 workers fetch
    ahead (2 each), so with that many they finish early in its window."""
    if given is not None and given < 0:
        raise UsageError(f"--workers {given}: 0 or more")
    if given is not None:
        return given
    return int(preset_args.get("workers", 0)) if cuda else 0


def _strategy_runs(opts, spec: dict, n: int, gpus: int, threads: int, procs: int) -> list[tuple[str, object]]:
    """Each distributed run of the preset on ONE process at a rank's micro-batch of an n-rank run, under
    its own launcher (`procs` at once on a CPU, as for the plain compute): the strategy's host work
    around the same compute (DDP's bucket copies, FSDP2's copy-in/copy-out, DeepSpeed's hooks and flat
    buffers) without a peer to talk to. (run name, draw) per run; a pipeline needs 2 ranks."""
    from ..registry import BY_FILE
    from .matrix import command, load_matrix

    out = []
    for run in load_matrix(opts.matrix, opts.preset, None, gpus):
        s = BY_FILE[run["script"]]
        if not s.distributed or s.max_processes or run["gpu_only"] and not gpus:
            continue
        run = {**run, "nproc": 1, "args": _strategy_args(run["args"], spec)}
        cmds = [command(run, gpus, os.devnull)[0] for _ in range(procs)]  # --results, --save-dir follow
        what = f"{run['name']} at 1 process"
        out.append((run["name"], lambda cmds=cmds, what=what: _concurrent(cmds, threads, what)))
    return out


def _strategy_args(args: dict, spec: dict) -> dict:
    """A preset run's arguments for its one-process entry: the entry's setup in fp32 (the key says so, whatever
    precision the run trains in), and samples for its --comm-steps on top, which profile its collectives at
    one process before the window (common/train.py communicates) and would otherwise take the window's steps."""
    out = {**args, **_run_args(spec), "precision": "fp32"}
    out["train_samples"] += spec["batch"] * resolve(DistributedConfig, out).comm_steps
    return out


def _channels_last_setups(opts, preset_batch, batch: int, modes: list[str],
                          cuda: bool) -> list[tuple[str, int, str]]:
    """(mode, batch, loader) of the preset's single-device runs in channels-last whose mode is among `modes`: the
    throughput preset's amp_bf16_fast (channels-last, its own batch of 256). The memory format changes
    which kernels run, so an NCHW entry never prices such a run (calibration.find_compute matches the key's
    cl), and without an entry of its own it gets no pred_step_ms. A run's own batch is kept; one that
    takes the preset's gets calibrate's (--batch-size)."""
    import torch

    from ..predict.calibration import compute_mode
    from ..registry import BY_FILE
    from ..strategies import model_strategy
    from .matrix import load_matrix

    out = []
    for run in load_matrix(opts.matrix, opts.preset, None, torch.cuda.device_count() if cuda else 0):
        args = run["args"]
        if not args.get("channels_last") or run["script"] not in {s for s, _ in SCRIPT.values()}:
            continue
        if run["gpu_only"] and not cuda:
            continue
        strategy = model_strategy(run["script"], "single")
        precision = str(args.get("precision") or BY_FILE[run["script"]].precisions[0])
        mode = compute_mode(strategy, precision, cuda and bool(args.get("tf32")))
        b = int(args["batch_size"]) if args.get("batch_size") not in (None, preset_batch) else batch
        if mode in modes and SCRIPT[mode][0] == run["script"] and (mode, b) not in [o[:2] for o in out]:
            out.append((mode, b, str(args.get("loader") or "torch")))
    return out


def piece_batches(batch: int, n: int, microbatches: int | None) -> list[int]:
    """The micro-batches whose pieces are timed at world size n > 1: the data-parallel ranks' (when their
    units' gradients are ready) and with --microbatches a pipeline's (its stage shares)."""
    return sorted({max(1, batch // d) for d in ([microbatches] if microbatches else []) + [n]}) if n > 1 else []


def _piece_times(spec: dict, threads: int) -> list[tuple[float, float]] | None:
    """Forward and backward ms (medians over spec["steps"] after 3 warm-up steps) of the model's four
    one-stage pieces (common/pipeline.py split [1,1,1,1]) at spec["batch"], one piece after the other in
    this process with `threads` threads and fresh gradients each step, as a stage rank runs them (its
    input a leaf that needs a gradient). None for a model a pipeline cannot split."""
    import statistics

    import torch

    device = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    got = _pieces_model(spec, device)
    if got is None:
        return None
    model, pieces, x0, autocast = got
    fwd, bwd = [[] for _ in pieces], [[] for _ in pieces]
    with _as_the_runs(device, threads):
        for _ in range(3 + spec["steps"]):
            model.zero_grad(set_to_none=True)
            _time_pieces(pieces, x0, autocast, device, fwd, bwd)
    out = [(round(statistics.median(f[3:]) * 1e3, 4), round(statistics.median(b[3:]) * 1e3, 4))
           for f, b in zip(fwd, bwd)]
    if device.type == "cuda":  # the GPU is the next calibration runs' and collectives'
        del model, pieces, x0
        torch.cuda.empty_cache()
    return out


def _pieces_model(spec: dict, device):
    """(model, its four one-stage pieces, an input batch, the autocast context) in the mode's precision; None
    for a model a pipeline cannot split."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from ..models import build_model, stages
    from ..pipeline import split
    from ..precision import steady_host_allocator

    if device.type == "cpu":  # as the runs it stands for (configure_backends)
        steady_host_allocator()
    model = build_model(SimpleNamespace(model=spec["model"], channels_last=False), pretrained=False)
    if not stages(model):
        return None
    mode = spec["mode"]
    dtype = torch.bfloat16 if mode.endswith("bf16") else torch.float16 if mode.endswith("fp16") else torch.float32
    model = model.to(device, dtype if mode.startswith("pure_") else torch.float32).train()
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if mode.startswith("amp_") else contextlib.nullcontext
    x0 = torch.randn(spec["batch"], 3, spec["image_size"], spec["image_size"], device=device,
                     dtype=dtype if mode.startswith("pure_") else torch.float32)
    return model, split(model, [1, 1, 1, 1]), x0, autocast


def _time_pieces(pieces, x0, autocast, device, fwd: list, bwd: list) -> None:
    """One step of the pieces, one after the other: each one's forward and backward seconds appended."""
    import time

    import torch

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    x, kept = x0, []
    for i, piece in enumerate(pieces):
        leaf = x.detach().requires_grad_(i > 0)
        t = clock()
        with autocast():
            y = piece(leaf)
        fwd[i].append(clock() - t)
        kept.append((leaf, y))
        x = y
    grad = torch.ones_like(x)
    for i in reversed(range(len(pieces))):
        leaf, y = kept[i]
        t = clock()
        y.backward(grad)
        bwd[i].append(clock() - t)
        grad = leaf.grad


@contextlib.contextmanager
def _as_the_runs(device, threads: int):
    """The runs' thread count and, on CUDA, their backend settings (common/precision.py configure_backends: TF32
    off by default), put back after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    flags = (cudnn.benchmark, matmul.allow_tf32, cudnn.allow_tf32)
    if device.type == "cuda":
        cudnn.benchmark, matmul.allow_tf32, cudnn.allow_tf32 = True, False, False
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if device.type == "cuda":
            cudnn.benchmark, matmul.allow_tf32, cudnn.allow_tf32 = flags


def _median_pieces(draws: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    import statistics

    return [(statistics.median(d[i][0] for d in draws), statistics.median(d[i][1] for d in draws))
            for i in range(len(draws[0]))]


def _links(world: int, device: str, threads: int, max_bytes: str = "32M", repeats: int = 1,
           taken: tuple = (), min_bytes: str = "256", relaunch: int = 0) -> tuple[dict, float]:
    """The collectives at `world` ranks, fitted per kind, and the meeting's ms; with repeats, each (kind,
    size)'s median time over the launches (one launch of benchmarks/collectives.py can catch the machine
    in a slow spell). `taken`: launches made earlier in the calibration, counted among the repeats."""
    from ..predict.calibration import fit_link

    taken = iter(taken)
    launch = lambda: _collectives(world, device, threads, max_bytes, min_bytes, relaunch)  # noqa: E731
    times = _median_of(repeats, lambda: (next(taken, None) or launch(), None))[0]
    meet = times.pop(("meet", 0), 0.0)
    return fit_link([(kind, nbytes, t) for (kind, nbytes), t in times.items()], world), meet


def _collectives(world: int, device: str, threads: int, max_bytes: str, min_bytes: str = "256",
                 relaunch: int = 0) -> dict:
    """One launch of benchmarks/collectives.py: {(kind, S bytes): seconds}; launched again, up to `relaunch`
    times, while the host was busy (_quiet)."""
    return _quiet(lambda: _collectives_once(world, device, threads, max_bytes, min_bytes), relaunch,
                  f"collectives at {world} ranks")


def _collectives_once(world: int, device: str, threads: int, max_bytes: str, min_bytes: str) -> dict:
    from .matrix import tool

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "c.json")
        env = launch_env(threads)
        cmd = [*tool("torchrun"), "--nproc_per_node", str(world),
               "--master_port", str(free_port()), os.path.join(ROOT, "benchmarks", "collectives.py"),
               "--device", device, "--min-bytes", min_bytes, "--max-bytes", max_bytes, "--iters", "10", "--json", out,
               # a step's collectives find their buffers out of cache, and meet ranks coming from their work
               "--meet", *(["--cold"] if device == "cpu" else [])]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode or not os.path.exists(out):
            raise UsageError(f"benchmarks/collectives.py at {world} ranks failed: {_error_line(proc.stderr)}")
        with open(out) as fh:
            got = json.load(fh)
        return {**{(kind, nbytes): t for kind, nbytes, t in got["points"]}, ("meet", 0): got.get("meet_ms", 0.0)}


def _nbytes(text: str) -> float:
    """A size as benchmarks/collectives.py reads it (K, M, G: powers of 1024); 0 if it is not one."""
    got = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)", text.strip(), re.IGNORECASE)
    return float(got[1]) * {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}[got[2].upper()] if got else 0.0


def _link_min(text: str, max_bytes: str) -> str:
    """--link-min-bytes: from 256 B (a BatchNorm's 64 weights, which DDP+ZeRO broadcasts alone) up to
    the largest size."""
    if not 256 <= _nbytes(text) <= _nbytes(max_bytes):
        raise UsageError(f"--link-min-bytes {text!r}: a size from 256 up to --link-max-bytes ({max_bytes})")
    return text.strip()


def _link_max(text: str, model: str, image: int) -> str:
    """--link-max-bytes: as given, or (auto) the power of two at or above the model's fp32 parameter bytes
    and at least 32 MiB: the largest message of a run (DeepSpeed's whole-model bucket and all-gather) is
    then measured, not extrapolated."""
    if text != "auto":
        # checked here, before the compute entries' minutes: a typo found after them would waste them
        if _nbytes(text) < 16 * 1024:  # at least the meeting's 16 KiB all-reduce
            raise UsageError(f"--link-max-bytes {text!r}: a size of at least 16K (K, M, G suffixes), or auto")
        return text.strip()
    from ..predict.timemodel import units

    nbytes = 4 * sum(sum(u.params) for u in units(model, image))
    size = 32 * 1024 ** 2
    while size < nbytes:
        size *= 2
    return f"{size // 1024 ** 2}M"


def _error_line(stderr: str) -> str:
    """The exception's line of a failed launch, not a launcher's warning printed after it."""
    lines = stderr.strip().splitlines() or ["?"]
    return next((x for x in reversed(lines) if "Error" in x or "Exception" in x), lines[-1]).strip()


def _plan(opts):
    """calibrate's settings from the preset and the flags, each refused in one line when out of range."""
    import types

    import torch

    from .matrix import read_preset

    # its args spelled as load_matrix spells the runs' (image-size: as image_size:): calibrate measures what they run
    args = read_preset(opts.matrix, opts.preset)["args"]
    p = types.SimpleNamespace(args=args, model=opts.model or args.get("model", "resnet50"),
                              image=opts.image_size or int(args.get("image_size", 224)),
                              batch=opts.batch_size or int(args.get("batch_size", 128)),
                              optimizer=opts.optimizer or args.get("optimizer", "sgd"),
                              modes=[m.strip() for m in opts.modes.split(",") if m.strip()])
    if p.model not in classification_models():
        raise UsageError(f"unknown model '{p.model}'")
    bad = [m for m in p.modes if m not in MODES]
    if bad:
        raise UsageError(f"--modes: {', '.join(bad)} unknown; choose from {', '.join(MODES)}")
    p.cuda = opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available())
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here")
    if "tf32" in p.modes and not p.cuda:
        raise UsageError("--modes tf32: TF32 is a CUDA math mode; on a CPU an fp32 entry prices a --tf32 run")
    p.device = torch.device("cuda", 0) if p.cuda else torch.device("cpu")
    p.worlds = _worlds(opts, p.cuda, p.batch)
    if not p.modes:
        raise UsageError(f"--modes {opts.modes!r}: at least one of {', '.join(MODES)}")
    _check_counts(opts)
    _check_out(opts.out)
    p.workers = loader_workers(opts.workers, args, p.cuda)
    p.max_bytes = _link_max(opts.link_max_bytes, p.model, p.image)
    p.min_bytes = _link_min(opts.link_min_bytes, p.max_bytes)
    return p


def _worlds(opts, cuda: bool, batch: int) -> list[int]:
    """--world-sizes, each refused where this machine or the batch cannot run it; by default 1 and the whole
    machine (2 ranks on a CPU), those of them it can."""
    import torch

    # one rank a GPU; on a CPU one a core at least, or the ranks' timings are each other's
    cap, what = (torch.cuda.device_count(), "GPUs") if cuda else (os.cpu_count() or 1, "cores")
    if not opts.world_sizes:
        worlds = sorted({1, cap if cuda else 2})
        left = [n for n in worlds if n > cap or batch % n]
        if left:
            print(f"calibrate: world size {', '.join(map(str, left))} left out (this machine has {cap} {what}; "
                  f"batch {batch})", flush=True)
        return [n for n in worlds if n not in left]
    try:
        worlds = [int(w) for w in opts.world_sizes.split(",")]
    except ValueError:
        raise UsageError(f"--world-sizes {opts.world_sizes!r}: comma-separated integers") from None
    if min(worlds) < 1:
        raise UsageError("--world-sizes: every size must be >= 1")
    if max(worlds) > cap:
        raise UsageError(f"--world-sizes {max(worlds)}: this machine has {cap} {what}")
    for n in worlds:  # the scripts refuse a global batch their ranks cannot split evenly
        if batch % n:
            raise UsageError(f"--batch-size {batch} does not divide by --world-sizes {n}")
    return worlds


def _check_out(path: str) -> None:
    """--out is written when every entry is measured: a path that cannot hold it, or a file that is not a
    calibration (a results CSV given by mistake), is refused before any of that work."""
    from ..predict.calibration import load

    if not path or os.path.isdir(path):
        raise UsageError(f"--out {path!r}: a file path is needed (the calibration's JSON)")
    if os.path.exists(path) and load(path) is None:
        raise UsageError(f"--out {path}: exists and is not a calibration file; give another path")


def _check_counts(opts) -> None:
    for flag in ("threads", "batch_size"):  # 0: not given (the cores' share, the preset's batch)
        if (getattr(opts, flag, 0) or 0) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(opts, flag)}: 0 (the default) or more")
    if opts.steps < 1:
        raise UsageError(f"--steps {opts.steps}: at least 1 timed step")
    if opts.repeats < 1:
        raise UsageError(f"--repeats {opts.repeats}: at least 1 launch")
    if opts.relaunch_busy < 0:
        raise UsageError(f"--relaunch-busy {opts.relaunch_busy}: 0 or more")
    if opts.microbatches < 0:
        raise UsageError(f"--microbatches {opts.microbatches}: 0 (no pipeline) or more")


def _compute_jobs(opts, p, n: int, procs: int, threads: int) -> tuple[list, dict, dict]:
    """(jobs [(name, draw, optional)]: the plain compute's entries, then each strategy's on one process; each
    entry key's loader workers; a strategy run's name -> (mode, micro-batch) of its entry, fp32@<strategy>)."""
    from ..predict.calibration import key

    micro = {max(1, p.batch // n)} | ({max(1, p.batch // opts.microbatches)} if opts.microbatches and n > 1 else set())
    setups = [(mode, b, False, p.workers) for mode in p.modes for b in sorted(micro)]
    setups += [(mode, b, True, p.workers) for mode in p.modes for b in sorted(micro) if opts.channels_last]
    if n == 1:
        own = _channels_last_setups(opts, p.args.get("batch_size"), p.batch, p.modes, p.cuda)
        # a run of the GPU loader has no workers: its entry has none either
        setups += [(mode, b, True, 0 if loader == "gpu" else p.workers) for mode, b, loader in own
                   if (mode, b, True) not in [x[:3] for x in setups]]
    jobs, entry_workers, strategies = [], {}, {}
    for mode, b, cl, w in setups:
        spec = {"model": p.model, "image_size": p.image, "batch": b, "mode": mode, "optimizer": p.optimizer,
                "device": p.device.type, "steps": opts.steps, "channels_last": cl, "workers": w}
        k = key(p.model, p.image, b, mode, p.optimizer, procs, threads, cl)
        entry_workers[k] = w
        jobs.append((k, _spawn(spec, procs, threads), False))
    if not opts.no_strategies:  # at 1 too: a --world-sizes 1,2 run's first point is the script alone
        for mode in [m for m in p.modes if m == "fp32"]:
            spec = {"model": p.model, "image_size": p.image, "batch": max(1, p.batch // n), "mode": mode,
                    "optimizer": p.optimizer, "device": p.device.type, "steps": opts.steps, "workers": p.workers}
            for name, draw in _strategy_runs(opts, spec, n, 1 if p.cuda else 0, threads, procs):
                jobs.append((name, draw, True))
                strategies[name] = (mode, spec["batch"])
    return jobs, entry_workers, strategies


def _store_compute(data: dict, got_all: dict, p, strategies: dict, entry_workers: dict, procs: int,
                   threads: int) -> None:
    from ..predict.calibration import key

    seen = set()
    for name, (got, row) in got_all.items():
        if name in strategies:  # two runs of one strategy (another batch, say): the first counts
            if row["strategy"] in seen:
                continue
            seen.add(row["strategy"])
            mode, b = strategies[name]
            name = key(p.model, p.image, b, f"{mode}@{row['strategy']}", p.optimizer, procs, threads)
        w = entry_workers.get(name, p.workers)
        data["compute"][name] = {m: round(v, 4) for m, v in got.items()} | ({"workers": w} if w else {})
        own = f", its own collectives at one process {got['own_comm_ms']:.2f} ms" if got.get("own_comm_ms") else ""
        print(f"compute {name}: forward {got['fwd_ms']:.2f} ms, backward {got['bwd_ms']:.2f} ms, "
              f"optimizer {got['opt_ms']:.2f} ms{own}", flush=True)


def _store_pieces(opts, data: dict, p, n: int, threads: int, timed: set) -> None:
    """A pipeline's micro-batch (its stage shares) and the data-parallel ranks' (when their units' gradients
    are ready: timemodel.time_shares): the four pieces of a ResNet, timed in this process."""
    from ..models import meta_model, stages
    from ..predict.calibration import key

    micro = piece_batches(p.batch, n, opts.microbatches)
    resnet = bool(micro) and bool(stages(meta_model(p.model, image_size=p.image)))  # the pieces are a ResNet's
    for mode, b in [(m, b) for m in p.modes for b in micro] if resnet else []:
        spec = {"model": p.model, "image_size": p.image, "batch": b, "mode": mode, "device": p.device.type,
                "steps": opts.steps}
        k = key(p.model, p.image, spec["batch"], mode, "-", 1, threads)
        if k in timed:  # a GPU's threads are 1 at every world size: the same key
            continue
        timed.add(k)
        draws = [_piece_times(spec, threads) for _ in range(max(1, opts.repeats))]
        got = _median_pieces(draws) if draws[0] else None
        if got:
            data.setdefault("pieces", {})[k] = got
            print(f"pieces {k}: " + ", ".join(f"{f:.2f}+{b:.2f} ms" for f, b in got), flush=True)


def _store_links(opts, data: dict, p, n: int, threads: int, early: list) -> None:
    links, meet = _links(n, p.device.type, threads, p.max_bytes, opts.repeats, tuple(early), p.min_bytes,
                         opts.relaunch_busy)
    data["links"][str(n)] = links
    data.setdefault("meets", {})[str(n)] = round(meet, 4)
    print(f"link {n} ranks: a meeting {meet:.3f} ms per run of collectives after compute", flush=True)
    for kind, v in links.items():
        print(f"link {n} ranks {kind}: latency {v['latency_us']:.1f} us, busbw {v['busbw_gbps']:.3f} GB/s",
              flush=True)


def calibrate(opts) -> int:
    from ..predict.calibration import fingerprint, load, save

    p = _plan(opts)
    relaunch, cores = opts.relaunch_busy, os.cpu_count() or 1
    data, timed, fp = load(opts.out) or {}, set(), fingerprint(p.device)
    if data.get("device_name") != fp["device_name"]:
        data = {**fp, "compute": {}, "links": {}}
    for n in p.worlds:
        procs = 1 if p.cuda else n
        threads = 1 if p.cuda else (opts.threads or max(1, cores // n))
        # with --repeats, the collectives' launches are spread over this world size's entries, not back to
        # back: a CPU's loopback moved between two states within an hour (all-reduce 0.94-1.57 GB/s), and
        # launches minutes apart take the median of the state the runs will see
        early = [_collectives(n, p.device.type, threads, p.max_bytes, p.min_bytes, relaunch)] \
            if n > 1 and opts.repeats > 1 else []
        jobs, entry_workers, strategies = _compute_jobs(opts, p, n, procs, threads)

        def middle(n=n, threads=threads):  # the collectives' launch between the first round and the rest
            early.append(_collectives(n, p.device.type, threads, p.max_bytes, p.min_bytes, relaunch))

        between = middle if n > 1 and opts.repeats > 2 else None
        _store_compute(data, _rounds(jobs, opts.repeats, between, relaunch), p, strategies, entry_workers, procs,
                       threads)
        _store_pieces(opts, data, p, n, threads, timed)
        if n > 1:
            _store_links(opts, data, p, n, threads, early)
    save(opts.out, data)
    print(f"calibration: {opts.out}")
    return 0


