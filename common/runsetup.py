"""What a run is, decided once: the typed record every model and report reads.

A run's setup is resolved by the runner when the script's main() has returned, from the registry
entry, the config and what the script reported of its library (the row's strategy and precision
label: DeepSpeed's stage from the JSON it ran, accelerate's mixed precision from its config), plus
the DeepSpeed JSON's zero_optimization section and the launcher's local world. It is written to the
row as explicit columns (`columns`), and read back from a row by the report, `benchmark.py predict`
and `advise` (`from_row`): no model works the run out again from labels, and none reads the
environment.

    setup = from_row(row)          # a RunSetup, or None for a row that names no run
    common.predict.memory.setup_of(setup)   # the memory and step models' Setup
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from .config import PROJECT_ROOT
from .launching import local_world_size
from .strategies import of

# the row's explicit setup columns beyond the contract's (common/results.py COLUMNS, group "run")
COLUMNS = ("local_world_size", "zero_stage", "offload", "zero_config", "split")


@dataclass(frozen=True)
class RunSetup:
    script: str  # the top-level script (registry file)
    strategy: str  # the row's: ddp, fsdp_full-shard, deepspeed_zero2_offload, pp_1f1b, tp_fsdp, single, ...
    precision: str  # the row's label as run: fp32, amp_bf16, pure_fp16+bn32, mp_bf16, ds_fp16, bf16 (accelerate)
    model: str = "resnet50"
    image_size: int = 224
    batch_size: int = 128  # global, per optimizer step
    world_size: int = 1  # processes (DataParallel: the GPUs its one process drove)
    local_world_size: int = 0  # processes on one node, as the launcher said; 0: not launched by one
    optimizer: str = "sgd"
    momentum: float = 0.9
    grad_accum: int = 1
    grad_checkpointing: bool = False
    channels_last: bool = False
    tf32: bool = False
    loader: str = "torch"
    workers: int = 0
    tp: int = 1
    microbatches: int = 1
    split: str = ""
    zero_stage: int | None = None  # DeepSpeed's stage, from the JSON the run used
    offload: bool = False
    zero: dict = field(default_factory=dict)  # that JSON's zero_optimization section
    device: str = "cpu"
    device_name: str = ""
    threads: int = 0  # CPU threads per process

    @property
    def half(self) -> str:
        """The half type the run trains in (fp16, bf16), else fp32."""
        kind = self.precision.rsplit("_", 1)[-1].split("+")[0]
        return kind if kind in ("fp16", "bf16") else "fp32"

    @property
    def bn_fp32(self) -> bool:
        return "+bn32" in self.precision  # pytorch_half_precision.py --bn-fp32

    @property
    def pipeline(self) -> bool:
        info = of(self.strategy)
        return info is not None and info.family == "pp"


def _zero_of(path: str) -> dict:
    from .deepspeed_config import resolve_path

    with open(resolve_path(path)) as fh:
        return json.load(fh).get("zero_optimization", {})


def resolve(entry, cfg, row: dict, environ=os.environ) -> RunSetup:
    """The setup of the run that wrote `row` (its base columns and the script's overrides), with the config
    and, for DeepSpeed, the JSON it ran: accelerate's names it in ACCELERATE_DEEPSPEED_CONFIG_FILE
    (accelerate/commands/launch.py sets it from the YAML's deepspeed_config_file), the script's own is
    --deepspeed_config."""
    zero, stage = {}, None
    if entry.deepspeed_config:
        zero = _zero_of(environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or getattr(cfg, "deepspeed_config", ""))
        stage = int(zero.get("stage", 0))
    local = local_world_size(environ)
    return RunSetup(
        script=entry.file, strategy=str(row["strategy"]), precision=str(row["precision"]), model=cfg.model,
        image_size=cfg.image_size, batch_size=cfg.batch_size, world_size=int(row["world_size"]),
        local_world_size=local or 0, optimizer=cfg.optimizer, momentum=cfg.momentum,
        grad_accum=cfg.grad_accum, grad_checkpointing=cfg.grad_checkpointing, channels_last=cfg.channels_last,
        tf32=bool(cfg.tf32), loader=cfg.loader, workers=cfg.workers, tp=int(row.get("tp_size") or 1),
        microbatches=int(row.get("microbatches") or 1), split=str(getattr(cfg, "split", "") or ""),
        zero_stage=stage, offload=bool(getattr(cfg, "offload", False) or getattr(cfg, "cpu_offload", False)),
        zero=zero, device=str(row.get("device") or "cpu"), device_name=str(row.get("device_name") or ""),
        threads=int(row.get("cpu_threads") or 0))


def columns(s: RunSetup) -> dict:
    """The row's explicit setup columns (COLUMNS)."""
    return {"local_world_size": s.local_world_size or None, "zero_stage": s.zero_stage, "offload": s.offload,
            "zero_config": json.dumps(s.zero, sort_keys=True, separators=(",", ":")) if s.zero else None,
            "split": s.split or None}


def _num(value, default=None):
    try:
        x = float(value)
    except (TypeError, ValueError):
        return default
    return default if math.isnan(x) else x


def _flag(value) -> bool:
    return str(value) in ("True", "true", "1", "1.0")


def _shipped_zero(strategy: str) -> dict:
    """Rows written before the zero_config column: the shipped JSON of the row's stage (config/zero_stage<N>_
    config.json), the one the scripts run by default."""
    import re

    stage = re.fullmatch(r"(?:accelerate_)?deepspeed_zero(\d)(?:_offload)?", strategy)
    path = os.path.join(PROJECT_ROOT, "config", f"zero_stage{stage.group(1) if stage else ''}_config.json")
    return _zero_of(path) if stage is not None and os.path.exists(path) else {}  # no shipped JSON for ZeRO-0


def _zero_of_row(get, strategy: str) -> dict:
    text = get("zero_config")
    if isinstance(text, str) and text.strip():
        return json.loads(text)
    return _shipped_zero(strategy)


def from_row(row) -> RunSetup | None:
    """A row's setup (a dict or a pandas row); None where it names no strategy or world size."""
    get = row.get
    strategy, world = str(get("strategy") or ""), _num(get("world_size"))
    if not strategy or strategy == "nan" or world is None:
        return None
    zero = _zero_of_row(get, strategy)
    stage = _num(get("zero_stage"), zero.get("stage"))
    return RunSetup(
        script=str(get("script") or ""), strategy=strategy, precision=str(get("precision") or "fp32"),
        model=str(get("model")), image_size=int(_num(get("image_size"), 224)),
        batch_size=int(_num(get("global_batch_size"), 128)), world_size=int(world),
        local_world_size=int(_num(get("local_world_size"), 0)), optimizer=str(get("optimizer") or "sgd"),
        grad_accum=int(_num(get("grad_accum"), 1)), grad_checkpointing=_flag(get("grad_checkpointing")),
        channels_last=_flag(get("channels_last")), tf32=_flag(get("tf32")),
        loader=str(get("loader") or "torch") if str(get("loader")) != "nan" else "torch",
        workers=int(_num(get("workers"), -1)), tp=int(_num(get("tp_size"), 1)),
        microbatches=int(_num(get("microbatches"), 1)),
        split="" if str(get("split") or "") == "nan" else str(get("split") or ""),
        zero_stage=None if stage is None else int(stage),
        offload=_flag(get("offload")) or strategy.endswith("_offload"),
        zero=zero, device=str(get("device") or "cpu"), device_name=str(get("device_name") or ""),
        threads=int(_num(get("cpu_threads"), 0)))
