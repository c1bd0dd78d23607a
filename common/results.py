"""results/summary.csv: one row per run, appended under a file lock by global rank 0.

A file whose first line is not our header (another tool's CSV, garbage, an older schema) or whose
last line is cut short is never written to: the run stops with a one-line error and the file is kept.
"""
from __future__ import annotations

import csv
import io
import os

from filelock import FileLock, Timeout

from .config import UsageError

# The contract other tools rely on, in this order; extra columns follow.
COLUMNS = [
    "timestamp", "script", "strategy", "precision", "world_size", "device", "model", "dataset",
    "image_size", "global_batch_size", "epochs", "steps", "train_time_s", "throughput_img_s",
    "peak_allocated_gib", "peak_reserved_gib", "peak_nvml_gib", "gpu_util_mean", "gpu_util_peak",
    "train_loss", "test_accuracy", "test_samples", "status", "torch_version", "git_commit",
    # extras
    "run_name", "device_name", "num_devices", "train_accuracy", "timed_steps", "compile_time_s",
    "skipped_steps", "resumed", "tf32", "channels_last", "grad_checkpointing", "compile", "loader",
    "grad_accum", "optimizer", "lr", "seed", "pretrained", "error",
]
STATUSES = ("ok", "diverged", "oom", "failed", "timeout", "skipped")


def _lock(path: str) -> FileLock:
    return FileLock(path + ".lock", timeout=60)


def _check_existing(path: str, columns: list[str] = COLUMNS) -> bool:
    """True when the file exists with our header and ends cleanly; raises UsageError otherwise."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return False
    try:
        with open(path, "rb") as fh:
            first = fh.readline().decode("utf-8").rstrip("\r\n")
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"results file {path} cannot be read ({type(exc).__name__}); it was left as is") from None
    if first != ",".join(columns):
        raise UsageError(f"results file {path} has another header (not written by this project, or an older "
                         f"schema); it was left as is: pass --results NEW.csv or move it away")
    if last != b"\n":
        raise UsageError(f"results file {path} ends in a cut-off line; it was left as is: repair or move it")
    return True


def check_results_path(path: str, columns: list[str] = COLUMNS) -> None:
    """Fails early (before training) when the results file could not take a row."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"results folder {folder} cannot be created ({exc.strerror})") from None
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"results file {path} is not writable")
    _check_existing(path, columns)


def format_row(row: dict, columns: list[str] = COLUMNS) -> str:
    unknown = set(row) - set(columns)
    if unknown:
        raise ValueError(f"unknown result columns: {sorted(unknown)}")
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(["" if row.get(c) is None else row.get(c) for c in columns])
    return buf.getvalue()


def append_row(path: str, row: dict, columns: list[str] = COLUMNS) -> None:
    check_results_path(path, columns)
    line = format_row(row, columns)
    try:
        with _lock(path):
            has_header = _check_existing(path, columns)
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(line if has_header else ",".join(columns) + "\n" + line)
                fh.flush()
                os.fsync(fh.fileno())
    except Timeout:
        raise UsageError(f"results file {path} stayed locked for 60 s ({path}.lock); is another run stuck?") from None
    except PermissionError:
        raise UsageError(f"results file {path} is not writable") from None


def read_rows(path: str, columns: list[str] = COLUMNS) -> list[dict]:
    if not _check_existing(path, columns):
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))
