"""What happens around every script's main(): parse the config, run, write the CSV row, tear down.

Exit codes: 0 ok; 2 bad input (one line on stderr, no row, results untouched); 3 diverged and
4 out of memory (a row with that status); 1 any other failure (a row with status failed).
"""
from __future__ import annotations

import datetime as _dt
import os
import subprocess
import sys
import traceback
import warnings

import torch

from .config import PROJECT_ROOT, TrainConfig, UsageError, parse_config
from .distributed import (
    claim_failure_row,
    cleanup,
    global_rank,
    grouped,
    launched_world_size,
    pick_device,
    restart_pending,
    restarts,
    world_size,
)
from .fastexit import freeze_imports
from .measure.fingerprint import device_name, fingerprint
from .registry import script as registry_entry
from .results import append_row, check_results_path, write_figures
from .train import Diverged


def git_commit() -> str:
    """HEAD (+dirty), or where git cannot tell (a copy of the tree without .git, as a GPU lease runs it) the
    GIT_COMMIT the caller names (.gpu/run.sh; CI servers such as Jenkins set it too)."""
    return _git_head() or os.environ.get("GIT_COMMIT", "").strip()


def _git_head() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=PROJECT_ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if head and dirty else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def base_row(cfg: TrainConfig, script: str, strategy: str, libraries: tuple[str, ...] = ()) -> dict:
    try:
        device = pick_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    except UsageError:
        device = torch.device("cpu")
    # a run whose group never formed (a peer lost during init_process_group) was still launched as a
    # world of WORLD_SIZE: its failed row says so rather than 1
    world = world_size() if grouped() else launched_world_size()
    return {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "script": script, "strategy": strategy, "precision": cfg.precision, "world_size": world,
        "device": device.type, "device_name": device_name(device), "num_devices": world,
        "model": cfg.model, "dataset": cfg.dataset, "image_size": cfg.image_size,
        "global_batch_size": cfg.batch_size, "epochs": cfg.epochs, "status": "ok",
        "torch_version": torch.__version__, "git_commit": git_commit(), "run_name": cfg.run_name,
        "tf32": cfg.tf32, "channels_last": cfg.channels_last, "grad_checkpointing": cfg.grad_checkpointing,
        "compile": cfg.compile, "loader": cfg.loader, "grad_accum": cfg.grad_accum, "optimizer": cfg.optimizer,
        "lr": cfg.lr, "seed": cfg.seed, "pretrained": cfg.pretrained, "resumed": False,
        "restarts": restarts(), "repeat": cfg.repeat or None, "scaling": cfg.scaling or None,
        "target_accuracy": cfg.target_accuracy or None, "cpu_threads": torch.get_num_threads(),
        "workers": cfg.workers, "dist_timeout_s": getattr(cfg, "dist_timeout_s", None),  # the distributed scripts'
        **fingerprint(device, libraries),
    }


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:300]


def launch(main, script_file: str, cfg_cls=TrainConfig, **defaults) -> None:
    """Runs main(cfg) -> Metrics | (Metrics, dict of row overrides) and records the run: one row,
    written by global rank 0 on success; on failure by the first rank that failed (see
    distributed.claim_failure_row), and by no one while torchrun will still restart the group."""
    entry = registry_entry(script_file)
    script, strategy = entry.file, entry.strategy
    doc = sys.modules["__main__"].__doc__ or ""
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    code, cfg, row_extra = 0, None, {}
    try:
        cfg = parse_config(cfg_cls, doc, entry.precisions, **defaults)
        if cfg.channels_last and entry.no_channels_last:  # before any process group: every rank says it alone
            raise UsageError(f"--channels-last: {entry.no_channels_last}; run without it (DDP keeps NHWC weights)")
        if global_rank() == 0:
            check_results_path(cfg.results)
        if cfg.save_dir and os.path.exists(cfg.save_dir) and not os.path.isdir(cfg.save_dir):
            raise UsageError(f"--save-dir {cfg.save_dir}: a file, not a folder (weights go in <save-dir>/<script>/)")
        from . import models  # noqa: F401  torchvision and torch._dynamo, which every run imports: frozen with the rest

        freeze_imports()
        out = main(cfg)
        metrics, overrides = out if isinstance(out, tuple) else (out, {})
        row_extra = {**metrics.row(), **overrides}
    except UsageError as exc:
        print(f"{script}: error: {exc}", file=sys.stderr)
        cleanup()
        sys.exit(2)
    except Diverged as exc:
        code, row_extra = 3, {"status": "diverged", "error": str(exc)}
        print(f"{script}: diverged: {exc}", file=sys.stderr)
    except torch.OutOfMemoryError as exc:
        code, row_extra = 4, {"status": "oom", "error": _one_line(exc)}
        print(f"{script}: out of memory on rank {global_rank()} at global batch {cfg.batch_size}: lower "
              f"--batch-size, or try --grad-accum, --grad-checkpointing or a sharded strategy", file=sys.stderr)
    except KeyboardInterrupt:
        cleanup()
        raise
    except Exception as exc:  # a bug or an environment failure: keep the traceback, still record the run
        traceback.print_exc()
        code, row_extra = 1, {"status": "failed", "error": _one_line(exc)}
    try:
        if cfg is not None and write_row(code):
            row = {**base_row(cfg, script, strategy, entry.libraries), **row_extra}
            row["precision"] = entry.labelled(str(row["precision"]))  # the registry's label, one place for all
            row.update(predicted(entry, cfg, row, ok=code == 0))
            append_row(cfg.results, row)
            if getattr(cfg, "figures", ""):
                _figures(cfg.figures, row)
    except UsageError as exc:
        print(f"{script}: error: {exc}", file=sys.stderr)
        code = code or 2
    finally:
        cleanup(wait_for_all=code == 0)
    if code:
        sys.exit(code)


def predicted(entry, cfg, row: dict, ok: bool = True) -> dict:
    """The run's setup columns (common/runsetup.py) and, for a run that ended well, what the memory and step
    models predict of it (common/predict/), from its row: once training has ended, on the rank that writes
    the row, outside every timed window. The step model reads the calibration beside the results file."""
    from .predict import memory, timepred
    from .predict.calibration import beside
    from .runsetup import columns, resolve

    try:
        run = resolve(entry, cfg, row)
    except (OSError, ValueError) as exc:  # a failed run's JSON may be what failed: its row still gets written
        return {} if not ok else {"notes": _joined(row.get("notes"), f"setup: {_one_line(exc)}")}
    out = columns(run)
    if not ok:
        return out
    try:
        out.update(memory.columns(run, row.get("peak_allocated_gib")))
    except Exception as exc:  # a prediction must never cost the run its row
        out["notes"] = f"pred_peak_gib: {_one_line(exc)}"
    time = timepred.columns(run, beside(cfg.results), row.get("loader_img_s"), row.get("step_ms_p50"))
    notes = _joined(row.get("notes"), out.pop("notes", None), time.pop("notes", None))
    return {**out, **time, "notes": notes}


def _figures(path: str, row: dict) -> None:
    """The row again as JSON for benchmark.py (--figures): once the row is in the CSV, a failure here costs the run
    nothing but this file (the matrix then reads the run's status from its exit code alone)."""
    try:
        write_figures(path, row)
    except (OSError, TypeError, ValueError) as exc:
        print(f"warning: --figures {path}: {_one_line(exc)}", file=sys.stderr, flush=True)


def _joined(*notes) -> str | None:
    return "; ".join(n for n in notes if n) or None


def write_row(code: int) -> bool:
    if code == 0:
        return global_rank() == 0
    if restart_pending():
        if global_rank() == 0:
            print(f"attempt {restarts()} failed; torchrun restarts the group (--max-restarts): no row for this "
                  f"attempt", file=sys.stderr)
        return False
    return claim_failure_row()


def launch_tool(main, script_file: str, cfg_cls, precisions=("fp32",), **defaults) -> None:
    """For scripts that are not training runs (model_inference.py): same config and error handling,
    main() writes its own rows."""
    script = os.path.basename(script_file)
    try:
        cfg = parse_config(cfg_cls, sys.modules["__main__"].__doc__ or "", precisions, **defaults)
        main(cfg)
    except UsageError as exc:
        print(f"{script}: error: {exc}", file=sys.stderr)
        sys.exit(2)
