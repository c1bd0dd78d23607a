"""The what-if check table (issue 60): what `advise --gpu` predicts from the datasheet alone, beside measured and
published figures, with the constants each prediction rests on and whether any of them was fitted to it.
tests/test_whatif.py recomputes the table and compares it with whatif_checks.json, which `advise` reads for the
checked error of a prediction's class ("how far to trust it").

  h100, h200   the project's single-GPU rows, ResNet50/224, synthetic data (results/campaigns/*h100*, *h200*)
  a100         NVIDIA DeepLearningExamples, PyTorch ResNet50 v1.5 README, "Training performance: NVIDIA DGX A100
               (8x A100 80GB)" (pytorch-21.03 container, 256 images a GPU): TF32 in NCHW, AMP fp16 in NHWC
               (configs.yml), optimizer batch 2048 (one GPU accumulates 8 batches), the batch copied on a side
               stream (PrefetchedWrapper), torch.optim.SGD as torch 1.9 ran it (a for-loop). Their benchmark
               read real ImageNet JPEGs: configs.yml as it stood when the table was published gives
               data_backend pytorch (PIL decoding in DataLoader workers, 16 a GPU on DGXA100) and mixup 0.2,
               and the README's benchmark_training commands name an ImageNet path: the 8-GPU AMP run needed
               16,600 decoded images/s from the host, which no datasheet gives (advise --loader-img-s takes it)
  p40          the articles' 4x Tesla P40 (../shared/seeds/README.md): ResNet50/224 on CIFAR10, global batch 128,
               5 epochs of 50,000 images, each with an evaluation of 10,000 (their times include it). Their
               repository as it was measured (github.com/xxcheng0708/pytorch-model-train-template, its first version,
               whose results/*.jpg print the durations: DataParallel 742 s, though pytorch_DP.py's docstring
               says 942): training loaders with drop_last=True (390 steps an epoch), 8 workers a process, no
               pinned memory, the test set split by DistributedSampler under DDP and FSDP (79 steps of 32 a
               rank), DataParallel fed its 128 images through GPU 0, FSDP1 wrapping every Conv2d and Linear
               (55 units), no checkpoint saved (a later version added it)
  transfer     the H200 rows from the H100 campaign's calibration, carried by the roofline's ratio
"""
from __future__ import annotations

import json
import os

from .memory import Setup
from .timemodel import Link, predict_step

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
A100, P40 = "NVIDIA A100-SXM4-80GB", "Tesla P40"
CHECKS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "whatif_checks.json")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H100_CALIBRATION = "results/campaigns/2026-11-26_h100_throughput/calibration.json"
# (run, precision, tf32, channels_last, batch, loader) of the throughput preset's single-GPU rows
SINGLE = {"fp32": ("fp32", False, False, 128, "torch"), "tf32": ("fp32", True, False, 128, "torch"),
          "amp_bf16": ("bf16", False, False, 128, "torch"), "amp_bf16_cl": ("bf16", False, True, 256, "gpu")}
SMALL = {"fp32_b32": ("fp32", False, False, 32, "torch")}  # an H100 row no rate was solved from
RATE_OF = {"fp32": "fp32", "tf32": "tf32", "amp_bf16": "half_nchw", "amp_bf16_cl": "half"}
H100_COMMON = ["HBM_SHARE (STREAM, H100)", "COPY_SHARE (H100 DDP row)", "OPT_HOST_MS (H100 accelerate_DDP row)"]


def _row(id_, cls, what, target, unit, bound, fitted, constants) -> dict:
    return {"id": id_, "class": cls, "what": what, "target": target, "unit": unit, "bound": bound,
            "fitted": fitted, "constants": constants}


def rows() -> list[dict]:
    """Every check: its target, bound (a relative error, or points for a scaling), and what it rests on."""
    out = []
    for gpu, tag, targets in ((H100, "h100", (931, 1758, 2070, 3816)), (H200, "h200", (997, 2073, 2275, 4506))):
        for (run, (_, _, _, batch, loader)), target in zip(SINGLE.items(), targets):
            rate = RATE_OF[run]
            extra = ["GPU_LOADER_MS_PER_IMAGE (H100 amp_bf16_fast row)"] if loader == "gpu" else []
            out.append(_row(f"{tag}_{run}", "1 GPU", f"{gpu}, {run}, batch {batch}", target, "img/s", 0.15,
                            gpu == H100, [f"rate {rate} (H100 {run} row)", *H100_COMMON, *extra]))
    # not a row the rates were solved from: the small batch's wave quantization and launches, predicted
    out.append(_row("h100_fp32_b32", "1 GPU", f"{H100}, fp32, batch 32 (2026-11-27_h100_throughput_b rows.csv)",
                    round(32 / 40.14e-3, 1), "img/s", 0.15, False,
                    ["rate fp32 (H100 fp32 row)", "TILE (CUTLASS)", "host_us (H100 AMP batch-32 row)", *H100_COMMON]))
    dle = ["rate tf32 (H100 tf32 row)", "rate half (H100 amp_bf16_cl row)", "HBM_SHARE (STREAM, H100)",
           "LOOP_PER_TENSOR_MS (pytorch PR 45299)"]
    links = ["nvlink3 busbw and latency (nccl-tests issues 149, 178)", "NCCL channels (nccl-tests issue 100)",
             "STEP_CV (H100 DDP row)"]
    out += [_row("a100_tf32_1", "1 GPU", "A100 80GB, TF32, 256", 938, "img/s", 0.10, False, dle[::2] + dle[3:]),
            _row("a100_amp_1", "1 GPU", "A100 80GB, AMP fp16 NHWC, 256", 2470, "img/s", 0.10, False, dle[1:]),
            _row("a100_tf32_8", "8 GPUs NVLink", "8x A100 80GB DDP, TF32", 7248, "img/s", 0.10, False, dle + links),
            _row("a100_amp_8", "8 GPUs NVLink", "8x A100 80GB DDP, AMP", 16621, "img/s", 0.10, False, dle + links),
            _row("a100_tf32_scaling", "8 GPUs NVLink", "8-GPU scaling, TF32", 96.6, "%", 5.0, False, dle + links),
            _row("a100_amp_scaling", "8 GPUs NVLink", "8-GPU scaling, AMP", 84.1, "%", 5.0, False, dle + links)]
    p40 = ["rate fp32 (H100 fp32 row)", "HBM_SHARE (STREAM, H100)", "COPY_SHARE (H100 DDP row)",
           "OPT_HOST_MS (H100 accelerate_DDP row)"]
    pcie = ["pcie3 busbw (bam issue 54), latency (rccl issue 362)", "NCCL channels over PCIe (tinygrad issue 17)",
            "STEP_CV (H100 DDP row)"]
    for name, target in (("single", 1979), ("amp", 1546), ("dp", 742), ("ddp", 560), ("fsdp_full-shard", 581),
                         ("ddp_zero", 596)):
        extra = ["host_us (H100 AMP batch-32 row)"] if name == "dp" else []
        out.append(_row(f"p40_{name}", "1 GPU" if name in ("single", "amp") else "4 GPUs PCIe",
                        f"4x Tesla P40 articles, {name}, 5 epochs + evaluation", target, "s", 0.20, False,
                        p40 + ([] if name in ("single", "amp") else pcie) + extra))
    for run, target in zip(SINGLE, (997, 2073, 2275, 4506)):
        out.append(_row(f"transfer_{run}", "1 GPU, calibrated", f"H200 {run} from the H100 calibration", target,
                        "img/s", 0.10, False, [H100_CALIBRATION, "the roofline's H200/H100 ratio"]))
    return out


def single_img_s(gpu: str, run: str) -> float:
    """A throughput preset's single-GPU row on `gpu`, from the datasheet."""
    from .timespec import gpu_compute

    prec, tf32, cl, batch, loader = {**SINGLE, **SMALL}[run]
    st = Setup(batch_size=batch, precision=prec, strategy="single" if prec == "fp32" else "amp", channels_last=cl)
    return batch / predict_step(st, gpu_compute(gpu, st, tf32, loader), Link(), True).step_ms * 1e3


def dle_img_s(world: int, amp: bool) -> float:
    """NVIDIA's ResNet50 v1.5 benchmark on `world` A100s: 256 a GPU, optimizer batch 2048."""
    from .timespec import gpu_compute, link_for

    st = Setup(batch_size=2048, world_size=world, grad_accum=2048 // (256 * world), precision="fp16" if amp else "fp32",
               strategy="ddp" if world > 1 else "amp" if amp else "single", channels_last=amp)
    c = gpu_compute(A100, st, tf32=not amp, loader="prefetch", loop_optimizer=True)
    link = link_for("nvlink3", gpu=A100) if world > 1 else Link()
    return 2048 / predict_step(st, c, link, True).step_ms * 1e3


def articles_s(strategy: str) -> float:
    """The articles' run of `strategy` on Tesla P40s: 5 epochs with their evaluations, seconds."""
    from .timespec import epoch_s, eval_ms, gpu_compute, link_for

    world = 1 if strategy in ("single", "amp") else 4
    st = Setup(batch_size=128, world_size=world, precision="fp16" if strategy == "amp" else "fp32",
               optimizer="adamw" if strategy == "ddp_zero" else "sgd", strategy=strategy)
    link = link_for("pcie3", gpu=P40) if world > 1 else Link()
    step = predict_step(st, gpu_compute(P40, st), link, True).step_ms
    train, evaluation = epoch_s(step, eval_ms(P40, st, link=link), st, 50_000, 10_000, drop_last=True)
    return 5 * (train + evaluation)


def transferred_img_s(run: str, calibration: str = H100_CALIBRATION) -> float:
    """An H200 row predicted from the H100's calibration entry of its setup, carried by the roofline."""
    from .calibration import compute_mode, compute_of, key, load
    from .timespec import transfer

    prec, tf32, cl, batch, loader = SINGLE[run]
    st = Setup(batch_size=batch, precision=prec, strategy="single" if prec == "fp32" else "amp", channels_last=cl)
    data = load(os.path.join(ROOT, calibration))
    entry = data["compute"][key("resnet50", 224, batch, compute_mode(st.strategy, prec, tf32), "sgd", 1, 1, cl)]
    c = transfer(compute_of(entry, 0.0, calibration), st, data["device_name"], H200, tf32, loader)
    return batch / predict_step(st, c, Link(), True).step_ms * 1e3


def predict(row: dict) -> float:
    id_ = row["id"]
    tag, _, run = id_.partition("_")
    if tag in ("h100", "h200"):
        return single_img_s(H100 if tag == "h100" else H200, run)
    if tag == "transfer":
        return transferred_img_s(run)
    if tag == "p40":
        return articles_s(run)
    if id_.endswith("_scaling"):
        amp = "amp" in id_
        return 100 * dle_img_s(8, amp) / (8 * dle_img_s(1, amp))
    return dle_img_s(int(id_[-1]), "amp" in id_)


def error(row: dict, predicted: float) -> float:
    """Points for a scaling, else the relative error."""
    if row["unit"] == "%":
        return predicted - row["target"]
    return predicted / row["target"] - 1


def table() -> list[dict]:
    """Every row with its prediction, error and whether it is within its bound (rounded as stored)."""
    out = []
    for row in rows():
        got = predict(row)
        err = error(row, got)
        out.append({**row, "predicted": round(got, 1), "error": round(err, 4), "within": abs(err) <= row["bound"]})
    return out


def order_kept(rows_: list[dict]) -> bool:
    """The articles' runs in the order of their times, as predicted."""
    p40 = [r for r in rows_ if r["id"].startswith("p40_")]
    return [r["id"] for r in sorted(p40, key=lambda r: r["target"])] == \
        [r["id"] for r in sorted(p40, key=lambda r: r["predicted"])]


def class_errors(rows_: list[dict]) -> dict:
    """Per class, the largest absolute error of its predictions (fitted rows and scalings left out): what advise
    prints beside a prediction of that class."""
    out: dict = {}
    for r in rows_:
        if r["fitted"] or r["unit"] == "%":
            continue
        out[r["class"]] = max(out.get(r["class"], 0.0), abs(r["error"]))
    return {k: round(v, 4) for k, v in out.items()}


def write(path: str = CHECKS_FILE) -> dict:
    rows_ = table()
    doc = {"rows": rows_, "order_kept": order_kept(rows_), "class_errors": class_errors(rows_)}
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    return doc


def stored(path: str = CHECKS_FILE) -> dict:
    with open(path) as fh:
        return json.load(fh)
