"""The memory model (common/predict/memory.py) against what runs really hold, and `benchmark.py advise`.

Model state: each run's row carries model_state_gib (unique storages of the model, optimizer and
engine, walked after the first update) beside pred_model_state_gib. The shared runs of every script
are checked in test_scripts.py (check_row: fp32 at 3 ranks, half precision at 2); here more at 3 ranks:
AdamW, shard-grad-op, DeepSpeed ZeRO-1 and ZeRO-2, accelerate's DeepSpeed.
Activations: the saved-tensor prediction on the meta device against the storages a real CPU forward
leaves alive (a TorchDispatchMode that records every op's output storage), an independent count.
"""
import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, check_ok, clean_env
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common.models import build_model
from common.predict.memory import GIB, STRATEGIES, Setup, predict, saved_activation_bytes


def pred_tolerance(script: str, strategy: str) -> float:
    """1% where the library's layout is reproduced exactly (DDP, ZeRO-1 of torch, FSDP2, one device),
    5% for DeepSpeed and accelerate."""
    return 0.05 if "deepspeed" in strategy or script.startswith("accelerate_") else 0.01


def check_model_state(row: dict) -> None:
    if row["strategy"] == "mp" or row["strategy"].startswith("pp_"):  # a split model: measured, not predicted
        assert float(row["model_state_gib"]) > 0 and row["pred_peak_gib"] == "", row
        return
    assert row["model_state_gib"] != "", row  # no update after the warm-up (an fp16 scaler's skips: FP16_STEPS)
    measured, pred = float(row["model_state_gib"]), float(row["pred_model_state_gib"])
    tol = pred_tolerance(row["script"], row["strategy"])
    assert abs(pred / measured - 1) <= tol, (row["strategy"], measured, pred)
    assert float(row["pred_activation_gib"]) > 0 and float(row["pred_peak_gib"]) >= pred
    if row["device"] == "cpu":
        assert row["pred_error_pct"] == ""  # no peak_allocated_gib to compare with
    else:  # the prediction leaves out workspaces and allocator rounding: close, not exact (docs/memory.md)
        assert abs(float(row["pred_error_pct"])) < 50, row["pred_error_pct"]


def test_model_state_of_a_process_on_two_gpus_is_its_busiest_gpus():
    """pytorch_MP.py drives two GPUs from one process: its model state, as its memory peaks, is the busiest
    device's, not the two halves summed. CPU twin: the walk's storages keyed by device as CUDA tensors give them;
    views into one storage count once."""
    from common.measure.model_state import StorageWalk

    walk = StorageWalk("cpu")
    flat = torch.zeros(10)
    for t in (flat, flat[:5], torch.zeros(3)):  # one device's: 40 + 12 bytes
        walk.add(t)
    assert walk.total == 52
    walk.sizes[("cuda:1", 1)] = 60  # the other half, on the other GPU
    assert walk.total == 60


# one run each at 3 ranks (tests/launches.py MODEL_STATE_AT_3), beside test_scripts.py's (check_row): its fp32
# runs of DDP, DDP+ZeRO, FSDP full shard, DeepSpeed ZeRO-3 and accelerate DDP are at 3 ranks, its
# half-precision runs at 2 (ZeRO-1 through pytorch_DeepSpeed.py fp16 and accelerate_DeepSpeed.py bf16, ZeRO-2
# through accelerate's fp16). ZeRO-1 and ZeRO-2 share DeepSpeed's flat partition (stage_1_and_2.py): the ZeRO-2
# case here checks its padding at 3 ranks; ZeRO-1's gradients (whole, not partitioned) are checked at 2 ranks only
@pytest.mark.slow
@pytest.mark.parametrize("name", ["pytorch_DDP_ZeRO-adamw-at3", "pytorch_FSDP-shard-grad-op-adamw-at3",
                                  "pytorch_DeepSpeed-zero2-adamw-at3"])
@pytest.mark.launches("{name}")
def test_model_state_at_3_ranks(runs, name):
    (r,) = runs
    check_ok(r.proc)
    check_model_state(r.row)


class LiveStorages(TorchDispatchMode):
    """Every storage an op returns, held weakly: what is still alive at the end of the forward is what
    autograd keeps (plus the logits and the loss)."""

    def __init__(self):
        super().__init__()
        self.refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.refs.setdefault(s._cdata, (StorageWeakRef(s), s.nbytes()))
        return out

    def live_bytes(self, model: torch.nn.Module) -> int:
        """Leaving out the model's own storages, which a view op returns (a Linear's weight.t())."""
        owned = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        return sum(n for key, (ref, n) in self.refs.items() if not ref.expired() and key not in owned)


HEAVY = [pytest.mark.slow, pytest.mark.beside]  # a real forward of a full-size ViT, ConvNeXt or ResNet50: 0.7-2 s


@pytest.mark.parametrize("model, size, checkpointing", [
    ("resnet18", 32, False), ("resnet18", 64, False),
    *(pytest.param("resnet50", size, False, marks=HEAVY) for size in (32, 64)),
    # --grad-checkpointing: what stays saved is what outside the blocks saves and each block's input
    ("resnet18", 64, True),
    *(pytest.param(m, 32, ck, marks=HEAVY) for m in ("vit_b_16", "convnext_tiny") for ck in (False, True)),
    # 197 tokens: the attention a fused kernel runs saves no 197 x 197 weights (memory._fused_attention)
    pytest.param("vit_b_16", 224, False, marks=HEAVY)])
def test_activation_prediction_against_a_real_forward(model, size, checkpointing):
    class Cfg:
        pretrained, channels_last = False, False

    Cfg.model, Cfg.image_size, Cfg.grad_checkpointing = model, size, checkpointing
    net = build_model(Cfg).train()
    x, y = torch.randn(2, 3, size, size), torch.zeros(2, dtype=torch.long)
    mode = LiveStorages()
    with mode:
        loss = F.cross_entropy(net(x), y)
    measured = mode.live_bytes(net) + x.untyped_storage().nbytes()  # the input was made outside the mode
    predicted, _ = saved_activation_bytes(model, size, 2, grad_checkpointing=checkpointing)
    assert abs(predicted / measured - 1) <= 0.15, (predicted, measured)
    del loss


@pytest.mark.beside
@pytest.mark.slow  # vit_b_16 walked with and without checkpointing: ~0.8 s
def test_checkpointing_keeps_the_inputs_and_recomputes_the_largest_block():
    """activation_bytes with --grad-checkpointing: the checkpointed walk plus the largest block's own
    activations (one block recomputed at a time), far below the plain walk for a deep model."""
    from common.predict.memory import activation_bytes

    base = dict(model="vit_b_16", image_size=32, batch_size=8)
    plain, per_block = saved_activation_bytes("vit_b_16", 32, 8)
    kept, _ = saved_activation_bytes("vit_b_16", 32, 8, grad_checkpointing=True)
    inside = [v for k, v in per_block.items() if k is not None]
    assert len(inside) == 12 and kept < plain / 5
    assert activation_bytes(Setup(**base, grad_checkpointing=True)) == kept + max(inside)
    assert activation_bytes(Setup(**base)) == plain


@pytest.mark.beside
@pytest.mark.slow  # ResNet50 at 224 px walked twice: ~1.2 s
def test_prediction_without_allocating():
    """ResNet50/224 at batch 128 on the meta device: the articles' single-GPU setup, no memory used."""
    p = predict(Setup(model="resnet50", image_size=224, batch_size=128))
    gib = p.gib()
    assert 8 < gib["activations"] < 14  # the articles measured an 11.24 GB peak on a P40
    assert abs(gib["params"] - 23.5e6 * 4 / 2 ** 30) < 0.01  # resnet50 with a 10-class head
    checkpointed = predict(Setup(model="resnet50", image_size=224, batch_size=128, grad_checkpointing=True))
    # each of the 16 Bottlenecks keeps its input (52% of the plain walk; the 4 stages' inputs alone were 40%)
    assert checkpointed.activations < 0.55 * p.activations


def test_sharding_divides_what_it_should():
    base = dict(model="resnet18", image_size=32, batch_size=8, world_size=4, optimizer="adamw")
    ddp, zero, fsdp = (predict(Setup(**base, strategy=s)) for s in ("ddp", "ddp_zero", "fsdp_full-shard"))
    assert ddp.params == zero.params and ddp.grads == zero.grads
    assert zero.optimizer < 0.3 * ddp.optimizer and fsdp.model_state < 0.3 * ddp.model_state
    assert fsdp.activations == ddp.activations and ddp.activations < predict(Setup(**base)).activations


def test_pure_half_keeps_batchnorm_in_fp32_when_asked():
    """pytorch_half_precision.py --bn-fp32: BatchNorm's weights (and so their gradients and momentum)
    stay fp32, 6 more bytes per BatchNorm parameter under SGD; the report reads it from the label."""
    import pandas as pd
    import torchvision

    from common.models import norm_numel
    from common.report import _memory_setup

    model = torchvision.models.shufflenet_v2_x0_5(num_classes=10)
    n = sum(p.numel() for p in model.parameters())
    bn = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters())
    assert norm_numel("shufflenet_v2_x0_5") == bn > 0
    base = dict(model="shufflenet_v2_x0_5", image_size=32, batch_size=16, precision="bf16", strategy="half")
    plain, kept = predict(Setup(**base)), predict(Setup(**base, bn_fp32=True))
    assert plain.params == 2 * n and kept.params == kept.grads == 2 * (n - bn) + 4 * bn
    assert kept.model_state - plain.model_state == 6 * bn
    row = pd.Series({"script": "pytorch_half_precision.py", "strategy": "single", "world_size": 1.0,
                     "precision": "pure_bf16+bn32+ls128", "model": "shufflenet_v2_x0_5", "image_size": 32,
                     "global_batch_size": 16, "optimizer": "sgd", "grad_accum": 1, "grad_checkpointing": False})
    assert _memory_setup(row) == Setup(**base, bn_fp32=True, zero=_memory_setup(row).zero)


def advise(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmark.py", "advise", *args], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.beside
@pytest.mark.slow  # launches processes
def test_advise_articles_setup():
    proc = advise("--model", "resnet50", "--image-size", "224", "--batch-size", "128", "--gpus", "4",
                  "--gpu-memory-gib", "24")
    check_ok(proc)
    lines = proc.stdout.splitlines()
    shown = {ln.split()[0] for ln in lines[2:-1]}
    # every strategy but accelerate's (the same engines), hybrid (full shard on one node) and tensor
    # parallelism, which splits attention heads: ResNet50 has none (test_tp for a ViT's rows)
    assert shown == {s for s in STRATEGIES if not s.startswith(("accelerate_", "tp")) and s != "fsdp_hybrid"}
    assert all(ln.split()[-1] in ("yes", "tight", "no") for ln in lines[2:-1])
    assert lines[-1].startswith("recommendation: ddp:"), lines[-1]  # activations dominate ResNet50


ADVISE_BAD = [
    (["advise", "--gpu-memory-gib", "0"], "--gpu-memory-gib must be > 0"),
    (["advise", "--gpu-memory-gib", "24", "--gpus", "3"], "does not divide by --gpus 3"),
    (["advise", "--gpu-memory-gib", "24", "--model", "nonet"], "unknown model 'nonet'"),
    (["advise", "--gpu", "NVIDIA H100 80GB HBM3", "--gpus", "8", "--gpus-per-node", "3", "--batch-size", "96"],
     "--gpus 8 spans nodes of --gpus-per-node 3: a whole number of them"),
    (["advise", "--gpu", "NVIDIA H100 80GB HBM3", "--interconnect", "nvlink4", "--busbw-gbps", "100"],
     "--interconnect and --busbw-gbps both name the link"),
    # refused before the memory table is printed, not after it
    (["advise", "--gpu-memory-gib", "24", "--calibration", "no_such_calibration.json"], "no calibration there"),
    # ... refused after the set-ups are priced (ResNet50's layers traced for the roofline): about a second
    pytest.param(["advise", "--gpu", "NVIDIA H100 80GB HBM3", "--gpus", "8"], "give --interconnect or --busbw-gbps",
                 marks=(pytest.mark.slow, pytest.mark.beside)),
    # refused before the compute entries' minutes, not after them
    (["calibrate", "--preset", "smoke", "--link-max-bytes", "64Q"], "--link-max-bytes '64Q': a size of at least 16K"),
    (["calibrate", "--preset", "smoke", "--link-min-bytes", "1G"], "--link-min-bytes '1G': a size from 256 up to"),
    (["calibrate", "--preset", "smoke", "--device", "cpu", "--modes", "fp32,tf32"], "--modes tf32: TF32 is a CUDA"),
    (["calibrate", "--preset", "smoke", "--relaunch-busy", "-1"], "--relaunch-busy -1: 0 or more"),
    (["calibrate", "--preset", "smoke", "--workers", "-1"], "--workers -1: 0 or more"),
    (["calibrate", "--preset", "smoke", "--microbatches", "-1"], "--microbatches -1: 0 (no pipeline) or more"),
    (["calibrate", "--preset", "smoke", "--modes", ","], "--modes ',': at least one of fp32"),
    (["calibrate", "--preset", "smoke", "--world-sizes", "2", "--batch-size", "33"],
     "--batch-size 33 does not divide by --world-sizes 2"),
    (["calibrate", "--preset", "smoke", "--world-sizes", "1,4096"], "--world-sizes 4096: this machine has"),
]


@pytest.mark.parametrize("args, why", ADVISE_BAD, ids=[getattr(c, "values", c)[1] for c in ADVISE_BAD])
def test_advise_bad_input(args, why, capsys):
    """Refused in one line, exit 2, before any answer: benchmark.py's main() in this process, as its own process
    runs it (test_bad_input.py runs a subcommand's refusal end to end, through the interpreter's exit)."""
    from test_bad_input import refused

    assert why in refused(capsys, list(args), quiet=args[0] == "advise")  # nothing of an answer before it


def tracked_peak_gib(model: str, batch: int, size: int = 224) -> float:
    """An independent measurement: torch's MemTracker (torch.distributed._tools.mem_tracker) over one
    real CPU training step after the first (momentum exists), set_to_none between steps."""
    import torchvision
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    net = torchvision.models.get_model(model, num_classes=10)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    for tracked in (False, True):
        tracker = MemTracker()
        if tracked:
            tracker.track_external(net, opt)
        with tracker if tracked else contextlib.nullcontext():
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] / GIB


@pytest.mark.slow
@pytest.mark.parametrize("model, batch", [("resnet18", 1), ("resnet18", 8), ("resnet18", 32), ("resnet50", 1)])
def test_predicted_peak_at_small_batches(model, batch):
    """At batch 1 layer4's and fc's gradients (most of ResNet's parameters) appear while layer1-3's
    activations are still saved, so max(activations, gradients) would be low; the backward walk is
    within 3% here (measured: resnet18 0.141/0.273/0.749 GiB at 1/8/32, resnet50 0.322 at 1; at 64,
    1.384, 1.9% off, in 11 s of CPU steps where 32 takes 5)."""
    predicted = predict(Setup(model=model, image_size=224, batch_size=batch, strategy="single")).peak / GIB
    assert predicted == pytest.approx(tracked_peak_gib(model, batch), rel=0.10)


def test_accumulated_gradients_are_there_from_the_second_micro_batch_on():
    one = predict(Setup(model="resnet18", image_size=64, batch_size=8, strategy="ddp", world_size=2, grad_accum=1))
    two = predict(Setup(model="resnet18", image_size=64, batch_size=16, strategy="ddp", world_size=2, grad_accum=2))
    assert two.activations == one.activations  # the same micro-batch
    assert two.backward_peak >= two.activations + two.grads > one.backward_peak


# what docs/memory.md calls each recommendation of advise
SAID = {"ddp": "DDP", "deepspeed_zero1": "DeepSpeed ZeRO-1", "deepspeed_zero3_offload": "ZeRO-3 with offload"}


@pytest.mark.beside
@pytest.mark.slow  # every strategy predicted at 12 setups of models up to vit_h_14 at 224 px: ~14 s of meta walks
def test_the_readme_sharding_table_is_the_memory_model():
    """docs/memory.md "When does sharding pay?": every DDP / FSDP cell is predict()'s peak at its setup, each
    cell's recommendation on 24 and 80 GiB cards is advise's, and so are the checkpointed figures below it."""
    import re

    from common.bench.advise import recommend

    def said(preds, gib):
        opts = type("Opts", (), {"gpu_memory_gib": gib, "gpus": 8, "grad_checkpointing": False, "precision": "bf16"})
        rec = recommend(preds, opts)
        return "nothing fits" if rec.startswith("nothing fits") else SAID[rec.split(":")[0]]

    def predicted(model, batch, strategy, gc=False):  # the section's setup: 8 GPUs, 224 px, bf16, AdamW
        return predict(Setup(model=model, image_size=224, batch_size=batch, world_size=8, precision="bf16",
                             optimizer="adamw", strategy=strategy, grad_checkpointing=gc))

    text = open(os.path.join(ROOT, "docs", "memory.md")).read()
    table = text[text.index("## When does sharding pay?"):]
    for model in ("resnet50", "vit_b_16", "vit_l_16", "vit_h_14"):
        cells = re.search(rf"^\| {model} \(.*$", table, re.M).group(0).split("|")[2:5]
        for batch, cell in zip((128, 512, 1024), cells):
            preds = {s: predicted(model, batch, s) for s in STRATEGIES if not s.startswith("accelerate_")}
            ddp, fsdp = (preds[s].peak / GIB for s in ("ddp", "fsdp_full-shard"))
            small, large = said(preds, 24.0), said(preds, 80.0)
            want = small if small == large else f"24 GiB {small}; 80 GiB {large}"
            assert cell.strip() == f"{ddp:.1f} / {fsdp:.1f}: {want}", (model, batch, cell)
    shown = " ".join(table.split("```")[0].split())  # the paragraph below the table, lines joined
    ddp, zero, fsdp = (predicted("vit_h_14", 1024, s, gc=True).peak / GIB
                       for s in ("ddp", "ddp_zero", "fsdp_full-shard"))
    for phrase in (f"needs {ddp:.1f} GiB under DDP and {fsdp:.1f} under FSDP",
                   f"(DeepSpeed ZeRO-1, {predicted('vit_l_16', 1024, 'deepspeed_zero1').peak / GIB:.1f} GiB)",
                   f"(ZeRO-3 with offload, {predicted('vit_h_14', 512, 'deepspeed_zero3_offload').peak / GIB:.1f})",
                   f"(DDP {ddp:.1f} GiB is too tight: DDP+ZeRO {zero:.1f}, FSDP {fsdp:.1f})"):
        assert phrase in shown, phrase


@pytest.mark.beside
@pytest.mark.slow  # every strategy predicted, three times over: ~1.6 s
def test_advise_when_nothing_fits_suggests_only_what_was_not_tried():
    from argparse import Namespace

    from common.bench.advise import recommend, setups

    for precision, grad_checkpointing, want, not_want in [
        ("fp32", False, ("--grad-checkpointing", "mixed precision"), ()),
        ("bf16", False, ("--grad-checkpointing",), ("mixed precision",)),
        ("bf16", True, (), ("--grad-checkpointing", "mixed precision")),
    ]:
        opts = Namespace(model="resnet18", image_size=32, batch_size=64, gpus=2, precision=precision, optimizer="sgd",
                         grad_checkpointing=grad_checkpointing, tp=2, gpu_memory_gib=0.001)
        text = recommend({s.strategy: predict(s) for s in setups(opts)}, opts)
        assert text.startswith("nothing fits") and "more GPUs" in text
        assert all(w in text for w in want) and not any(w in text for w in not_want), text


def test_walks_on_two_threads_leave_attention_as_it_was():
    """memory._fused_attention swaps torch.nn.functional.scaled_dot_product_attention for a walk. Two
    threads walking at once, the second ending after the first, must not restore each other's swap: the
    second waits for the first, and after both the function is torch's own again."""
    import threading

    from common.predict.memory import _fused_attention

    own = F.scaled_dot_product_attention
    in_a, in_b, end_a, end_b = (threading.Event() for _ in range(4))

    def walk(inside, end):
        with _fused_attention():
            inside.set()
            end.wait(5)

    a = threading.Thread(target=walk, args=(in_a, end_a))
    a.start()
    assert in_a.wait(5)
    b = threading.Thread(target=walk, args=(in_b, end_b))
    b.start()
    try:
        # without the lock the second walk is inside by now; with it, it waits for the first
        assert not in_b.wait(0.5)
        end_a.set()
        a.join(5)
        assert in_b.wait(5)
        end_b.set()
        b.join(5)
        assert F.scaled_dot_product_attention is own
    finally:
        end_a.set()
        end_b.set()
        a.join(5)
        b.join(5)
        F.scaled_dot_product_attention = own  # a failure must not leave it swapped for the tests after
