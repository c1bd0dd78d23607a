"""Shared helpers: run a script the way a user would (python, torchrun, deepspeed) on tiny CPU settings."""
from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_args(tmp_path, **over) -> list[str]:
    """resnet18 at 32 px on a few synthetic samples: seconds per run on 2 cores."""
    args = {"device": "cpu", "dataset": "synthetic", "model": "resnet18", "image-size": 32, "epochs": 1,
            "batch-size": 16, "train-samples": 64, "test-samples": 37, "workers": 0, "warmup-steps": 1,
            "log-every": 0, "lr": 0.05, "results": str(tmp_path / "summary.csv"),
            "save-dir": str(tmp_path / "ckpt"), "timing-warmup-steps": 1}
    args.update({k.replace("_", "-"): v for k, v in over.items()})
    out = ["--no-pretrained"]
    for k, v in args.items():
        if v is True:
            out.append(f"--{k}")
        elif v is False:
            out.append(f"--no-{k}")
        elif v is not None:
            out += [f"--{k}", str(v)]
    return out


def run(script: str, args: list[str], nproc: int = 1, launcher: str = "python", timeout: int = 300,
        env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    if launcher == "torchrun":
        cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
               script]
    elif launcher == "deepspeed":
        cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), script]
    else:
        cmd = [sys.executable, script]
    return subprocess.run(cmd + args, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def rows(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def one_line_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    """Exit code, no traceback, and the script's own message on one line."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ": error: " in ln]
    assert lines, proc.stderr
    return lines[0]


@pytest.fixture
def tmp(tmp_path):
    return tmp_path
