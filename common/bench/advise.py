"""`benchmark.py advise`: the memory model's prediction for every strategy, and which one to use.

    python benchmark.py advise --model resnet50 --image-size 224 --batch-size 128 --gpus 4 --gpu-memory-gib 24

One line per strategy: predicted GiB per GPU by component (common/predict/memory.py), the total at the
peak, and whether it fits. Then a recommendation with its reason, the advice of the articles (DDP over
DataParallel; mixed precision halves activations; shard only when the model state matters) and of
FairScale's "which component should I use" flowchart (DDP while the model fits; then shard the
optimizer state (OSS, ZeRO-1), then gradients (ShardedDDP, ZeRO-2), then parameters (FSDP, ZeRO-3);
activation checkpointing when activations dominate; offload last), made quantitative: the first
strategy in that order whose predicted peak fits with headroom.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import replace

from ..config import UsageError
from ..names import classification_models
from ..predict.links import LINKS
from ..predict.memory import GIB, STRATEGIES, Setup, predict
from ..strategies import of

HEADROOM = 0.9  # the prediction leaves out the allocator's cache, workspaces and the CUDA context
# communication per step, least first: FairScale's order (DDP, then shard optimizer state, gradients,
# parameters, then offload), with tensor parallelism after full sharding: it all-reduces activations in
# every block, on the critical path (Megatron-LM keeps it inside a node for that reason); DataParallel
# and the single-device runs are never preferred
ORDER = ("ddp", "ddp_zero", "deepspeed_zero1", "deepspeed_zero2", "fsdp_shard-grad-op", "fsdp_full-shard",
         "deepspeed_zero3", "tp_fsdp", "tp", "fsdp_full-shard_offload", "deepspeed_zero2_offload",
         "deepspeed_zero3_offload")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="resnet50", help="torchvision classification model")
    p.add_argument("--image-size", type=int, default=224, help="side of the square image, pixels")
    p.add_argument("--batch-size", type=int, default=128, help="GLOBAL batch per optimizer step")
    p.add_argument("--gpus", default="1", help="GPUs (ranks) to spread it over; a list (1,2,4,8) adds the predicted "
                   "scaling curve of every strategy (the tables are for the last)")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="memory of one GPU, GiB (default: --gpu's)")
    t = p.add_argument_group("time (common/predict/timemodel.py): give --calibration, or --gpu with "
                             "--interconnect or --busbw-gbps")
    t.add_argument("--calibration", default="", help="benchmark.py calibrate's file: this machine's measured inputs")
    t.add_argument("--gpu", default="", help="a GPU by its datasheet name (as torch names it), e.g. 'Tesla P40', "
                   "'NVIDIA A100-SXM4-80GB': compute by roofline from its datasheet (with --calibration: the "
                   "calibrated GPU's compute carried to this one)")
    t.add_argument("--interconnect", default="", help="named link between the GPUs: " + ", ".join(LINKS))
    t.add_argument("--busbw-gbps", type=float, default=0.0, help="bus bandwidth of the collectives, GB/s")
    t.add_argument("--gpus-per-node", type=int, default=0, help="GPUs a node holds when --gpus spans nodes (joined "
                   "by --inter-node, a hierarchical all-reduce); default: one node")
    t.add_argument("--inter-node", default="ib200", help="link between nodes: ib200 or ib400 (one NIC per GPU)")
    t.add_argument("--channels-last", action="store_true", help="NHWC model and inputs, as the scripts' flag")
    t.add_argument("--dataset-images", type=int, default=50_000, help="images per epoch (CIFAR10's 50,000)")
    t.add_argument("--eval-images", type=int, default=10_000, help="images of the evaluation pass each epoch s "
                   "includes (CIFAR10's test set, 10,000; 0: none)")
    t.add_argument("--loader-img-s", type=float, default=0.0, help="the loader's rate, images/s, summed over ranks: "
                   "a step is never faster than global batch / it")
    p.add_argument("--precision", default="fp32", help="fp32 (strict, as the scripts run it), tf32 (fp32 with "
                   "--tf32), or fp16/bf16 mixed precision")
    p.add_argument("--optimizer", default="sgd", help="sgd (momentum) or adamw")
    p.add_argument("--grad-checkpointing", action="store_true", help="predict with activation checkpointing")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree of the tp_fsdp row (pytorch_TP.py on a "
                   "ViT: tp ranks split each block, FSDP over the rest); the tp row splits over every GPU")


def check(opts) -> None:
    from ..predict.timespec import GPU_MEMORY_GIB, gpu_names

    try:
        opts.gpu_counts = [int(g) for g in str(opts.gpus).split(",") if g.strip()]
    except ValueError:
        raise UsageError(f"--gpus {opts.gpus!r}: an integer or a comma-separated list, e.g. 1,2,4,8") from None
    if not opts.gpu_counts or min(opts.gpu_counts) < 1:
        raise UsageError(f"--gpus must be >= 1; got {opts.gpus}")
    opts.gpus = opts.gpu_counts[-1]
    if opts.gpu and opts.gpu not in gpu_names():
        raise UsageError(f"--gpu {opts.gpu!r} is not in the datasheet table; one of: {', '.join(gpu_names())}")
    if opts.interconnect and getattr(opts, "busbw_gbps", 0):  # one link or the other (link_for prices one)
        raise UsageError("--interconnect and --busbw-gbps both name the link: give one")
    if opts.interconnect and opts.interconnect not in LINKS:
        raise UsageError(f"--interconnect {opts.interconnect!r} unknown; one of: {', '.join(LINKS)}")
    if opts.inter_node not in ("ib200", "ib400"):
        raise UsageError(f"--inter-node {opts.inter_node!r}: ib200 or ib400")
    for name in ("gpus_per_node", "eval_images", "loader_img_s", "busbw_gbps", "gpu_memory_gib"):
        value = getattr(opts, name, 0)
        if value is not None and not (0 <= value < math.inf):  # nan and inf fail this too
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number >= 0; got {value}")
    if getattr(opts, "dataset_images", 1) < 1:
        raise UsageError(f"--dataset-images must be >= 1; got {opts.dataset_images}")
    if getattr(opts, "tp", 2) < 2:
        raise UsageError(f"--tp must be >= 2 (the tp_fsdp row's tensor-parallel degree); got {opts.tp}")
    if opts.gpu_memory_gib is None and opts.gpu:
        opts.gpu_memory_gib = GPU_MEMORY_GIB[opts.gpu]
    if opts.gpu_memory_gib is None:
        raise UsageError("give --gpu-memory-gib (or --gpu NAME, whose memory the datasheet table knows)")
    if opts.model not in classification_models():
        raise UsageError(f"unknown model '{opts.model}'; any torchvision classification model, e.g. resnet50")
    for name in ("image_size", "batch_size"):
        if getattr(opts, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(opts, name)}")
    if opts.gpu_memory_gib <= 0:
        raise UsageError(f"--gpu-memory-gib must be > 0; got {opts.gpu_memory_gib}")
    if opts.precision not in ("fp32", "tf32", "fp16", "bf16"):
        raise UsageError(f"--precision must be fp32, tf32, fp16 or bf16; got {opts.precision!r}")
    # tf32 is fp32 storage with TF32 math (the scripts' --tf32): the memory model's fp32
    opts.tf32, opts.math = opts.precision == "tf32", opts.precision
    opts.precision = "fp32" if opts.tf32 else opts.precision
    if opts.optimizer not in ("sgd", "adamw"):
        raise UsageError(f"--optimizer must be sgd or adamw; got {opts.optimizer!r}")
    per_node = getattr(opts, "gpus_per_node", 0)
    for g in opts.gpu_counts:
        if opts.batch_size % g:
            raise UsageError(f"--batch-size {opts.batch_size} does not divide by --gpus {g}")
        if per_node and g > per_node and g % per_node:
            raise UsageError(f"--gpus {g} spans nodes of --gpus-per-node {per_node}: a whole number of them")


def setups(opts) -> list[Setup]:
    base = Setup(model=opts.model, image_size=opts.image_size, batch_size=opts.batch_size, world_size=opts.gpus,
                 precision=opts.precision, optimizer=opts.optimizer, grad_checkpointing=opts.grad_checkpointing,
                 channels_last=getattr(opts, "channels_last", False),
                 zero={"reduce_bucket_size": 50_000_000, "overlap_comm": True, "contiguous_gradients": True,
                       "stage3_param_persistence_threshold": 100_000})  # config/zero_stage*_config.json
    half = opts.precision if opts.precision != "fp32" else "fp16"
    out = []
    for st in STRATEGIES:
        info = of(st)
        if info.library == "accelerate" or info.sharding == "hybrid":
            continue  # accelerate runs the same engines; hybrid equals full-shard on one node
        if info.family in ("tp", "tp_fsdp"):
            out += _tp_setups(base, st, opts)
            continue
        precision = {"single": "fp32", "dp": "fp32", "half": half, "amp": half}.get(st, opts.precision)
        world = opts.gpus if info.data_parallel else 1
        zero = _zero_json(info.zero_stage) if info.deepspeed else base.zero
        out.append(replace(base, strategy=st, precision=precision, world_size=world, zero=zero))
    # FSDP2 and DeepSpeed take no channels-last weight: their scripts refuse the flag, so they are priced as they
    # can run, in NCHW (advise() says so)
    return [replace(s, channels_last=False) if of(s.strategy).no_channels_last else s for s in out]


def _zero_json(stage: int) -> dict:
    """The zero_optimization section pytorch_DeepSpeed.py trains with at that stage
    (config/zero_stage<k>_config.json): ZeRO-1's sets no overlap_comm, ZeRO-2's does."""
    import json
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "config", f"zero_stage{stage}_config.json")) as fh:
        return json.load(fh).get("zero_optimization", {})


def _tp_setups(base: Setup, strategy: str, opts) -> list[Setup]:
    """pytorch_TP.py's layouts for a model it splits (a ViT): tp over every GPU; and --tp with FSDP over the
    GPUs left (the 2-D mesh) when there are some. None where _tp_left_out gives a reason."""
    if _tp_left_out(strategy, opts) is not None:
        return []
    tp = opts.gpus if strategy == "tp" else opts.tp
    return [replace(base, strategy=strategy, world_size=opts.gpus, tp=tp)]


def _tp_left_out(strategy: str, opts) -> str | None:
    """Why pytorch_TP.py cannot run `strategy` (tp or tp_fsdp) as advised, or None: "" where the reason goes
    without saying (one GPU, not a ViT), else a line for the user: tp must divide the GPUs and the heads,
    pytorch_TP.py trains in fp32 or bf16 autocast and has no gradient checkpointing."""
    from ..models import meta_model
    from ..tensor_parallel import check_degree, tp_able

    tp = opts.gpus if strategy == "tp" else opts.tp
    if opts.gpus < 2 or not tp_able(meta_model(opts.model, image_size=opts.image_size)):
        return ""
    if strategy == "tp_fsdp" and opts.gpus == tp:
        return ""  # no dp ranks left: that is the tp row
    if opts.precision == "fp16" or opts.grad_checkpointing:
        return "pytorch_TP.py trains in fp32 or bf16 autocast, without gradient checkpointing"
    if opts.gpus % tp:
        return f"--tp {tp} does not divide --gpus {opts.gpus}"
    try:
        check_degree(meta_model(opts.model, image_size=opts.image_size), tp)
    except UsageError as e:
        return str(e).replace(f"--tp {tp}", f"tp {tp}")
    return None


def recommend(preds: dict, opts) -> str:
    g = opts.gpu_memory_gib
    fits = [st for st in ORDER if st in preds and preds[st].peak / GIB <= HEADROOM * g]
    ddp = preds["ddp"]
    act_share = ddp.activations / max(ddp.peak, 1)
    if not fits:
        tries = [t for t, off in ((" --grad-checkpointing", opts.grad_checkpointing),
                                  (" mixed precision (--precision bf16/fp16)", opts.precision != "fp32")) if not off]
        return (f"nothing fits in {HEADROOM:.0%} of {g:g} GiB: lower the batch, or try{','.join(tries)} or more GPUs; "
                f"smallest predicted peak: "
                f"{min(preds, key=lambda s: preds[s].peak)} at {min(p.peak for p in preds.values()) / GIB:.2f} GiB")
    best = fits[0]
    p = preds[best]
    reason = [f"{best}: predicted peak {p.peak / GIB:.2f} GiB of {g:g} GiB, the least communication of those "
              f"that fit"]
    if best == "ddp":
        saved = (ddp.peak - min(preds[s].peak for s in ORDER if s in preds)) / GIB
        reason.append(f"activations are {act_share:.0%} of DDP's peak, so sharding model state saves at most "
                      f"{saved:.2f} GiB per GPU for more communication")
    else:
        reason.append(f"DDP needs {ddp.peak / GIB:.2f} GiB; {best} shards what DDP replicates "
                      f"(model state {p.model_state / GIB:.2f} vs {ddp.model_state / GIB:.2f} GiB)")
    if opts.precision == "fp32" and act_share > 0.5:
        amp = predict(replace(ddp.setup, precision="fp16"))
        reason.append(f"--precision bf16/fp16 (AMP) would cut DDP's peak to {amp.peak / GIB:.2f} GiB")
    if preds["dp"].peak > ddp.peak and opts.gpus > 1:
        reason.append(f"not DataParallel: GPU 0 carries {(preds['dp'].peak - ddp.peak) / GIB:.2f} GiB more "
                      f"and one process feeds every GPU")
    return "; ".join(reason)


def advise(opts) -> int:
    check(opts)
    if opts.calibration or opts.gpu:
        from .advise_time import refusal_first

        refusal_first(opts, setups(opts))
    g = opts.gpu_memory_gib
    print(f"{opts.model} {opts.image_size}px, global batch {opts.batch_size}, {opts.gpus} GPU(s) of {g:g} GiB, "
          f"{opts.math}, {opts.optimizer}{', grad checkpointing' if opts.grad_checkpointing else ''}: "
          f"predicted GiB per GPU (busiest rank)")
    cols = ("params", "grads", "optimizer", "master", "activations", "comm")
    print(f"{'strategy':<24}{'gpus':>5}{'prec':>6}" + "".join(f"{c[:6]:>8}" for c in cols)
          + f"{'peak':>8}  fits")
    preds = {}
    for s in setups(opts):
        p = predict(s)
        preds[s.strategy] = p
        gib = p.gib()
        fits = "yes" if gib["peak"] <= HEADROOM * g else ("tight" if gib["peak"] <= g else "no")
        label = f"{s.strategy} (tp {s.tp})" if of(s.strategy).family in ("tp", "tp_fsdp") else s.strategy
        print(f"{label:<24}{s.world_size:>5}{s.precision:>6}" + "".join(f"{gib[c]:>8.2f}" for c in cols)
              + f"{gib['peak']:>8.2f}  {fits}")
    for st in ("tp", "tp_fsdp"):
        why = _tp_left_out(st, opts)
        if why:
            print(f"not predicted: {st}: {why}")
    if getattr(opts, "channels_last", False):
        nchw = [st for st in preds if of(st).no_channels_last]
        print(f"in NCHW, as their scripts run (they refuse --channels-last: FSDP2 and DeepSpeed take no channels-last "
              f"weight): {', '.join(nchw)}")
    print("recommendation: " + recommend(preds, opts))
    if opts.calibration or opts.gpu:
        from .advise_time import time_tables

        time_tables(opts, preds)
    return 0
