"""The one table of training scripts. benchmark.py (launchers, presets), the runner (strategy,
precisions), the tests' parametrization and the README's script table all read it: adding a
strategy is its script plus one line here.

Fields:
  file         the top-level script (also the CSV's `script` value and the checkpoint folder name)
  strategy     the CSV's `strategy` (a script may refine it per run: fsdp_full-shard, deepspeed_zero3)
  launcher     how it starts on GPUs: python (one process), torchrun, deepspeed, accelerate
  precisions   --precision values it accepts, its default first
  shows        one line for the README: what the run demonstrates
  accelerate_config / deepspeed_config   the launcher config it is started with (accelerate launch
               --config_file) / the DeepSpeed JSON it uses by default
  needs_cuda   True when it cannot run on CPU at all (it refuses in one line there)
  one_process_gpus  True when one process drives every visible GPU (DataParallel): world_size is
               the GPUs it used, and benchmark.py starts it with plain python
  max_processes  the most processes benchmark.py starts for it (a pipeline: 4, one per ResNet stage;
               pytorch_PP.py itself cuts other families between their blocks, up to one per block)
  preset_args / cpu_preset_args  flags every preset adds for this script (all hardware / CPU only)
  no_channels_last  why it refuses --channels-last: its engine cannot train channels-last weights
               (common/strategies.py cites the library's call); empty: it trains them
  label        prefix of the CSV's `precision` for a run that is not fp32: how the half precision is
               applied (amp_ autocast, pure_ the whole model cast, mp_ FSDP's MixedPrecisionPolicy,
               ds_ DeepSpeed's own fp16/bf16 engine); empty: the precision as given. The scripts report the
               precision they ran (fp16, bf16, DeepSpeed's from its JSON); the runner labels every row with it
               (Script.labelled), a failed run's too
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .config import PROJECT_ROOT
from .strategies import DEEPSPEED_NO_CHANNELS_LAST, FSDP2_NO_CHANNELS_LAST

ALL_PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class Script:
    file: str
    strategy: str
    launcher: str
    precisions: tuple[str, ...]
    shows: str
    accelerate_config: str | None = None
    deepspeed_config: str | None = None
    needs_cuda: bool = False
    one_process_gpus: bool = False
    max_processes: int | None = None
    preset_args: dict = field(default_factory=dict)
    cpu_preset_args: dict = field(default_factory=dict)
    label: str = ""
    no_channels_last: str = ""

    @property
    def distributed(self) -> bool:
        """Started as one process per GPU by a launcher (else plain python, one process)."""
        return self.launcher != "python"

    @property
    def libraries(self) -> tuple[str, ...]:
        """The training libraries beside torch it runs on (their versions go into the row)."""
        return (("deepspeed",) if self.deepspeed_config else ()) + (("accelerate",) if self.launcher == "accelerate"
                                                                     else ())

    @property
    def name(self) -> str:
        return self.file[:-3]

    def labelled(self, precision: str) -> str:
        """The CSV's `precision` of a run of this script that ran in `precision` (fp32, fp16, bf16, with the
        half script's +bn32/+ls suffixes): the label before it, fp32 as it is."""
        return precision if precision == "fp32" or not self.label else self.label + precision


_HALF = dict(preset_args={"precision": "fp16"}, cpu_preset_args={"precision": "bf16"})  # fp16 is emulated on CPU

SCRIPTS = [
    Script("pytorch_SingleGPU.py", "single", "python", ("fp32",),
           "one device, fp32 (`--tf32` for TF32 math): the baseline"),
    Script("pytorch_half_precision.py", "single", "python", ("fp16", "bf16"),
           "whole model in fp16/bf16 (`--bn-fp32`, `--loss-scale S`): why pure half loses accuracy", **_HALF,
           label="pure_"),
    Script("pytorch_auto_mixed_precision.py", "single", "python", ("fp16", "bf16"),
           "autocast + GradScaler (fp16) / autocast (bf16): the fix for pure half", **_HALF, label="amp_"),
    Script("pytorch_DP.py", "dp", "python", ("fp32",),
           "`nn.DataParallel` over every visible GPU from one process", one_process_gpus=True),
    Script("pytorch_MP.py", "mp", "python", ("fp32",),
           "naive model parallelism: two halves (ResNet stages, a ViT's blocks) on `cuda:0`/`cuda:1` (one device: both "
           "there)"),
    Script("pytorch_PP.py", "pp_gpipe", "torchrun", ("fp32",),
           "pipeline parallelism, `torch.distributed.pipelining`, cut between ResNet stages or a ViT's blocks "
           "(`--schedule gpipe/1f1b/interleaved-1f1b`, `--microbatches M`, `--split`)", max_processes=4),
    Script("pytorch_TP.py", "tp", "torchrun", ("fp32", "bf16"),
           "tensor parallelism on a ViT (`--tp N`: heads and MLP split, Megatron-style); the other ranks FSDP2 "
           "on a 2-D mesh; `--precision` as autocast", preset_args={"model": "vit_b_16"}, label="amp_"),
    Script("pytorch_DDP.py", "ddp", "torchrun", ALL_PRECISIONS,
           "DDP (`--sync-bn`, `--grad-accum N` with `no_sync`, `--precision` as autocast)", label="amp_"),
    Script("pytorch_DDP_ZeRO.py", "ddp_zero", "torchrun", ALL_PRECISIONS,
           "DDP + `ZeroRedundancyOptimizer` (optimizer state sharded)", label="amp_"),
    Script("pytorch_FSDP.py", "fsdp", "torchrun", ALL_PRECISIONS,
           "FSDP2 `fully_shard` per block (ResNet's, ViT's EncoderBlock; `--sharding`, `--cpu-offload`)", label="mp_",
           no_channels_last=FSDP2_NO_CHANNELS_LAST),
    Script("pytorch_DeepSpeed.py", "deepspeed", "deepspeed", ALL_PRECISIONS,
           "DeepSpeed ZeRO 1/2/3 from the JSON (`--deepspeed_config`, `--offload`)",
           deepspeed_config="config/zero_stage2_config.json", label="ds_", no_channels_last=DEEPSPEED_NO_CHANNELS_LAST),
    Script("accelerate_DDP.py", "accelerate_ddp", "accelerate", ALL_PRECISIONS,
           "accelerate, DDP underneath", accelerate_config="config/default_DDP.yml"),
    Script("accelerate_FSDP.py", "accelerate_fsdp", "accelerate", ALL_PRECISIONS,
           "accelerate FSDP2, wrap classes derived from the model", accelerate_config="config/default_FSDP.yml",
           needs_cuda=True, no_channels_last=FSDP2_NO_CHANNELS_LAST),
    Script("accelerate_DeepSpeed.py", "accelerate_deepspeed", "accelerate", ALL_PRECISIONS,
           "accelerate + DeepSpeed ZeRO from the JSON the YAML names", accelerate_config="config/default_DeepSpeed.yml",
           deepspeed_config="config/zero_stage2_config.json", label="ds_", no_channels_last=DEEPSPEED_NO_CHANNELS_LAST),
]
BY_FILE = {s.file: s for s in SCRIPTS}


def script(file: str) -> Script:
    """The entry of a script path or name (pytorch_DDP.py, ./pytorch_DDP.py, pytorch_DDP)."""
    base = os.path.basename(file)
    return BY_FILE[base if base.endswith(".py") else base + ".py"]


def top_level_scripts() -> list[str]:
    """The training scripts on disk: what the registry must list."""
    return sorted(f for f in os.listdir(PROJECT_ROOT)
                  if f.endswith(".py") and f.startswith(("pytorch_", "accelerate_")))


def _model_flag(s: Script) -> str:
    """A script for one family (pytorch_TP.py) names its model: the config's ResNet50 would be refused."""
    return f" --model {s.preset_args['model']}" if "model" in s.preset_args else ""


def gpu_command(s: Script, gpus: int = 4) -> str:
    return {"python": f"python {s.file}",
            "torchrun": f"torchrun --nproc_per_node {gpus} {s.file}",
            "deepspeed": f"deepspeed --num_gpus {gpus} {s.file}",
            "accelerate": f"accelerate launch --config_file {s.accelerate_config} --num_processes {gpus} {s.file}",
            }[s.launcher] + _model_flag(s)


def cpu_command(s: Script) -> str:
    if s.needs_cuda:
        return "refuses: needs CUDA"
    flags = _model_flag(s).lstrip() + (" " if _model_flag(s) else "") + "--device cpu ..." + (
        " --precision bf16" if "fp32" not in s.precisions else "")
    if not s.distributed:
        return f"python {s.file} {flags}"
    launcher = "deepspeed --num_gpus 2" if s.launcher == "deepspeed" else "torchrun --nproc_per_node 2"
    return f"{launcher} {s.file} {flags}"


def readme_table() -> str:
    """The README's script table (between its `scripts` markers), written by `benchmark.py report`."""
    lines = ["| script | strategy | precisions | GPU launch | CPU launch (CI) |", "|---|---|---|---|---|"]
    for s in SCRIPTS:
        lines.append(f"| `{s.file}` | {s.shows} | {', '.join(s.precisions)} | `{gpu_command(s)}` | "
                     + (cpu_command(s) if s.needs_cuda else f"`{cpu_command(s)}`") + " |")
    return "\n".join(lines)
