"""What every process this project starts from another one gets: its environment and a rendezvous port.

benchmark.py's matrix, calibrate (its runs and its collectives), the doctor and the tests all start runs
through these two, so that a run started from here never inherits the caller's launch variables (a
benchmark.py started inside a job would otherwise make each run join that job's group) and every launcher
gets the same thread rule.
"""
from __future__ import annotations

import os

# what a launcher (torchrun, the deepspeed launcher, Slurm's srun through torchrun) sets for its workers
LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def local_world_size(environ=None) -> int | None:
    """The processes this process's launcher started on its node: torchrun's LOCAL_WORLD_SIZE, the deepspeed
    launcher's LOCAL_SIZE; None where neither is set (one plain process, or a launcher that says nothing)."""
    env = os.environ if environ is None else environ
    value = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE")
    return int(value) if value else None


def launch_env(threads: int | None = None, nproc: int = 1, environ=None) -> dict:
    """The environment of a run started from here: the caller's launch variables removed, output unbuffered,
    and OMP_NUM_THREADS set explicitly, one rule for every launcher (torchrun and accelerate launch set 1 for
    several processes, deepspeed sets nothing, so CPU-side work would otherwise get other thread counts under
    different launchers): `threads` where the caller decides (calibrate: a run stands for a rank of n), else a
    value the user exported, else the cores over the run's processes."""
    env = {**(os.environ if environ is None else environ), "PYTHONUNBUFFERED": "1"}
    for key in LAUNCH_KEYS:
        env.pop(key, None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    else:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc))))
    return env


def free_port() -> int:
    """A TCP port free on this host right now (for a rendezvous on 127.0.0.1)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
