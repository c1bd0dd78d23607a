"""results/summary.csv: one row per run, appended under a file lock by global rank 0.

Schema growth never strands results: a file written by an earlier version of this project (its
header is one of HISTORY's) is upgraded in place before the next row is appended, its rows
re-keyed by column name under the new header and the original kept beside it as `<file>.bak`.
A file whose first line is no header of ours (another tool's CSV, garbage) or whose last line is
cut short is never written to: the run stops with a one-line error and the file is kept as is.
"""
from __future__ import annotations

import csv
import io
import os
import shutil

from filelock import FileLock, Timeout

from .config import UsageError

# The contract other tools rely on, in this order; extra columns follow.
CONTRACT = [
    "timestamp", "script", "strategy", "precision", "world_size", "device", "model", "dataset",
    "image_size", "global_batch_size", "epochs", "steps", "train_time_s", "throughput_img_s",
    "peak_allocated_gib", "peak_reserved_gib", "peak_nvml_gib", "gpu_util_mean", "gpu_util_peak",
    "train_loss", "test_accuracy", "test_samples", "status", "torch_version", "git_commit",
]
# The columns after the contract, by group (docs/results.md names each group's columns)
GROUPS = {
    # what the run was and what makes it reproducible: its setup as decided once (common/runsetup.py), its
    # outcome beyond the contract's, the software fingerprint
    "run": ["run_name", "device_name", "num_devices", "local_world_size", "train_accuracy", "skipped_steps",
            "resumed", "restarts", "repeat", "scaling", "tf32", "channels_last", "grad_checkpointing", "compile",
            "loader", "workers", "grad_accum", "microbatches", "split", "tp_size", "zero_stage", "offload",
            "zero_config", "optimizer", "lr", "seed", "pretrained", "cpu_threads", "dist_timeout_s",
            "target_accuracy", "cuda_version", "cudnn_version", "nccl_version", "driver_version",
            "deepspeed_version", "accelerate_version"],
    # the timed window: its steps, where a step's time went, the input pipeline, compute efficiency, energy
    "time": ["timed_steps", "compile_time_s", "time_to_target_s", "loader_img_s", "step_ms_p50", "step_ms_p90",
             "step_ms_mean", "step_data_ms", "step_compute_ms", "step_comm_exposed_ms", "step_optimizer_ms",
             "step_other_ms", "pipeline_bubble_pct", "train_gflop_per_img", "achieved_tflops", "peak_tflops", "mfu",
             "energy_j", "img_per_j"],
    "memory": ["model_state_gib"],  # beside the contract's peaks
    "communication": ["comm_bytes_per_step", "comm_calls_per_step", "comm_ms_per_step", "busbw_gbps",
                      "comm_overlap_pct"],
    # whether the run had its CPUs to itself in the window (common/measure/host.py)
    "host": ["host_other_pct", "host_steal_pct", "cpu_wait_pct"],
    # what the memory and step models predict of the run (common/predict/), computed from the row once
    # training has ended, each beside what it predicts
    "model": ["pred_model_state_gib", "pred_activation_gib", "pred_peak_gib", "pred_error_pct", "pred_params_gib",
              "pred_grads_gib", "pred_optimizer_gib", "pred_master_gib", "pred_comm_gib", "pred_step_ms",
              "pred_img_s", "pred_time_error_pct", "pred_data_ms", "pred_compute_ms", "pred_comm_exposed_ms",
              "pred_optimizer_ms"],
}
# last: why a column that should hold a figure is empty (an instrument that had nothing to measure), and a
# failure's line
COLUMNS = CONTRACT + [c for group in GROUPS.values() for c in group] + ["notes", "error"]
# COLUMNS is this release's header; pyproject.toml's version says the same (tests/test_results.py)
SCHEMA_VERSION = "0.8.0"


def _released() -> dict[str, list[str]]:
    """{version: header} of every release (common/released_headers.txt, oldest first)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "released_headers.txt")) as fh:
        lines = [ln.split(" ", 1) for ln in fh.read().splitlines() if ln.strip() and not ln.startswith("#")]
    return {version: header.split(",") for version, header in lines}


RELEASED = _released()
# the headers of earlier releases, oldest first: a file with one of them is upgraded, never refused
HISTORY = [header for version, header in RELEASED.items() if version != SCHEMA_VERSION]


def _lock(path: str) -> FileLock:
    return FileLock(path + ".lock", timeout=60)


def _header(path: str) -> str:
    with open(path, "rb") as fh:
        return fh.readline().decode("utf-8").rstrip("\r\n")


def _check_existing(path: str, columns: list[str] = COLUMNS, history: list[list[str]] = ()) -> bool:
    """True when the file exists with our header (or an older one of `history`) and ends cleanly;
    raises UsageError otherwise."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return False
    try:
        with open(path, "rb") as fh:
            first = fh.readline().decode("utf-8").rstrip("\r\n")
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"results file {path} cannot be read ({type(exc).__name__}); it was left as is") from None
    if first != ",".join(columns) and first not in {",".join(h) for h in history}:
        raise UsageError(f"results file {path} has another header (not written by this project, or an older "
                         f"schema); it was left as is: pass --results NEW.csv or move it away")
    if last != b"\n":
        raise UsageError(f"results file {path} ends in a cut-off line; it was left as is: repair or move it")
    return True


def upgrade(path: str, columns: list[str] = COLUMNS, history: list[list[str]] = HISTORY) -> bool:
    """Rewrites a file with an older header of ours under `columns` (a copy stays as <path>.bak);
    True when it did. Call under the file lock."""
    if not _check_existing(path, columns, history) or _header(path) == ",".join(columns):
        return False
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    gone = set(rows[0]) - set(columns) if rows else set()
    if gone:  # a column was dropped: that is a new file, not an upgrade
        raise UsageError(f"results file {path} has columns this version no longer writes ({sorted(gone)}); "
                         f"it was left as is: pass --results NEW.csv")
    backup = path + ".bak"
    n = 1
    while os.path.exists(backup):
        backup, n = f"{path}.bak{n}", n + 1
    shutil.copy2(path, backup)
    tmp = path + ".upgrade.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(",".join(columns) + "\n")
        for row in rows:
            fh.write(format_row({k: v for k, v in row.items() if v != ""}, columns))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    print(f"note: {path} was written by an earlier version of this project; upgraded to the current columns "
          f"(original kept as {backup})", flush=True)
    return True


def check_results_path(path: str, columns: list[str] = COLUMNS, history: list[list[str]] = HISTORY) -> None:
    """Fails early (before training) when the results file could not take a row."""
    if not path or os.path.isdir(path):
        raise UsageError(f"--results {path!r}: a CSV file path is needed")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"results folder {folder} cannot be created ({exc.strerror})") from None
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"results file {path} is not writable")
    _check_existing(path, columns, history)


def format_row(row: dict, columns: list[str] = COLUMNS) -> str:
    unknown = set(row) - set(columns)
    if unknown:
        raise ValueError(f"unknown result columns: {sorted(unknown)}")
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(["" if row.get(c) is None else row.get(c) for c in columns])
    return buf.getvalue()


def append_row(path: str, row: dict, columns: list[str] = COLUMNS, history: list[list[str]] = HISTORY) -> None:
    check_results_path(path, columns, history)
    line = format_row(row, columns)
    try:
        with _lock(path):
            upgrade(path, columns, history)
            has_header = _check_existing(path, columns)
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(line if has_header else ",".join(columns) + "\n" + line)
                fh.flush()
                os.fsync(fh.fileno())
    except Timeout:
        raise UsageError(f"results file {path} stayed locked for 60 s ({path}.lock); is another run stuck?") from None
    except PermissionError:
        raise UsageError(f"results file {path} is not writable") from None


def write_figures(path: str, row: dict) -> None:
    """A run's row as JSON at `path` (benchmark.py's --figures): what the process that started the run reads of
    it, whole and typed, where the CSV holds every run's rows as text. Written whole or not at all."""
    import json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"row": {c: row.get(c) for c in COLUMNS if row.get(c) is not None}}, fh)
    os.replace(tmp, path)


def read_figures(path: str) -> dict | None:
    """The row a run wrote with write_figures, or None where it wrote none."""
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)["row"]
    except (OSError, ValueError, KeyError):
        return None


def read_rows(path: str, columns: list[str] = COLUMNS, history: list[list[str]] = HISTORY) -> list[dict]:
    """Every row as {column: text}, under the current columns (an older file's new columns read as "")."""
    if not _check_existing(path, columns, history):
        return []
    with open(path, newline="", encoding="utf-8") as fh:
        return [{c: row.get(c) or "" for c in columns} for row in csv.DictReader(fh)]
