"""Tensor parallelism (pytorch_TP.py, common/tensor_parallel.py): the split attention is torchvision's
attention, one rank's model is what the memory model walks, and the script trains like one process, at
tp 2 on 2 ranks and at tp 2 x FSDP dp 2 on 4, sending what Megatron's scheme sends."""
import math
import os
from argparse import Namespace

import pytest
import torch
import torchvision
from helpers import ROOT, check_ok

from common.config import TrainConfig, UsageError
from common.models import build_model
from common.tensor_parallel import SplitAttention, check_degree, merge_attention, split_attention


def vit(**kw):
    torch.manual_seed(0)
    return build_model(TrainConfig(model="vit_b_16", pretrained=False, image_size=32, **kw))


@pytest.mark.slow
@pytest.mark.beside
def test_split_attention_is_torchvision_attention():
    """The same weights, the same forward and gradients, in training and eval mode (MultiheadAttention's
    fast path); the state_dict packs back into a bare torchvision ViT."""
    ref, model = vit(), split_attention(vit())
    assert isinstance(model.encoder.layers[0].self_attention, SplitAttention)
    x = torch.randn(3, 3, 32, 32)
    for train in (True, False):
        ref.train(train), model.train(train)
        assert torch.allclose(model(x), ref(x), atol=1e-5)
    ref.train(), model.train()
    ref(x).square().sum().backward()
    model(x).square().sum().backward()
    att, split = ref.encoder.layers[3].self_attention, model.encoder.layers[3].self_attention
    packed = torch.cat([split.q.weight.grad, split.k.weight.grad, split.v.weight.grad])
    assert torch.allclose(packed, att.in_proj_weight.grad, rtol=1e-4, atol=1e-6)
    with torch.device("meta"):  # the weights come from the state_dict: none to initialise
        bare = torchvision.models.vit_b_16(num_classes=10, image_size=32)
    bare.load_state_dict(merge_attention(model.state_dict()), assign=True)  # strict
    assert torch.equal(bare.encoder.layers[3].self_attention.in_proj_weight, att.in_proj_weight)


def test_one_rank_model_holds_its_shards():
    """The memory model's tp rank (memory.meta_model tp=2): q, k, v and mlp.0 keep half their rows,
    out_proj and mlp.3 half their columns (their biases whole: RowwiseParallel replicates them), the rest
    whole; its parameter count is what a rank of pytorch_TP.py holds."""
    from common.models import meta_model

    full, local = meta_model("vit_b_16", image_size=32), meta_model("vit_b_16", image_size=32, tp=2)
    b = local.encoder.layers[0]
    assert b.self_attention.q.weight.shape == (384, 768) and b.self_attention.out_proj.weight.shape == (768, 384)
    assert b.mlp[0].weight.shape == (1536, 768) and b.mlp[3].weight.shape == (768, 1536)
    layers = full.encoder.layers
    split = sum(blk.mlp[0].weight.numel() + blk.mlp[0].bias.numel() + blk.self_attention.in_proj_weight.numel()
                + blk.self_attention.in_proj_bias.numel() for blk in layers)
    halved_cols = sum(m.weight.numel() for blk in layers for m in (blk.self_attention.out_proj, blk.mlp[3]))
    n_full = sum(p.numel() for p in full.parameters())
    assert sum(p.numel() for p in local.parameters()) == n_full - split // 2 - halved_cols // 2


def test_degrees_and_families_refused():
    with pytest.raises(UsageError, match="does not divide the model's 12 attention heads"):
        check_degree(split_attention(vit()), 5)
    with pytest.raises(UsageError, match="no nn.MultiheadAttention blocks"):
        split_attention(torchvision.models.resnet18())


def test_channels_last_is_refused_where_dp_ranks_shard():
    """The ranks left over tp shard with FSDP2, which takes no channels-last weight; tp over every rank keeps them."""
    from common.tensor_parallel import check_layout

    with pytest.raises(UsageError, match=r"--channels-last with 2 data-parallel ranks \(--tp 2 of 4 processes\): "
                                         "FSDP2 shards contiguous parameters only"):
        check_layout(True, 4, 2)
    check_layout(True, 4, 4)
    check_layout(False, 4, 2)


def test_pytorch_tp_refuses_channels_last_before_it_builds_its_mesh(monkeypatch):
    """Through the script's main, with the group faked (4 processes, tp 2): refused before the device mesh and
    the loaders, where fully_shard would have raised."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("tp_script", os.path.join(ROOT, "pytorch_TP.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "init_distributed", lambda cfg, **kw: SimpleNamespace(
        rank=0, world_size=4, device=torch.device("cpu")))
    monkeypatch.setattr(script, "init_device_mesh", lambda *a, **kw: pytest.fail("built the mesh"))
    cfg = script.TPConfig(model="vit_b_16", image_size=32, pretrained=False, device="cpu", tp=2, channels_last=True)
    with pytest.raises(UsageError, match=r"--channels-last with 2 data-parallel ranks \(--tp 2 of 4 processes\)"):
        script.main(cfg)


def test_tp_ranks_compute_the_replicated_gradients_with_the_same_kernels(monkeypatch):
    """CPU twin of a CUDA line: cuDNN autotuning could pick another (or a non-deterministic) algorithm per rank
    for the patch embedding, and the replicated weights would drift apart; pytorch_TP.py turns it off on CUDA,
    and leaves a CPU run's flags as they were."""
    from common.tensor_parallel import same_kernels_on_every_rank

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    same_kernels_on_every_rank(torch.device("cpu"))
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (True, False)
    same_kernels_on_every_rank(torch.device("cuda", 1))
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic) == (False, True)


def test_the_default_degree_keeps_every_tp_group_on_one_node():
    """--tp 0 takes the largest degree dividing the heads and a node's processes (LOCAL_WORLD_SIZE): tp's
    per-block all-reduces never cross the network, whatever the world size."""
    from common.models import meta_model
    from common.tensor_parallel import default_degree

    b16, l16 = meta_model("vit_b_16", image_size=224), meta_model("vit_l_16", image_size=224)  # 12 and 16 heads
    assert default_degree(8, b16, {"LOCAL_WORLD_SIZE": "8"}) == 4
    assert default_degree(16, l16, {"LOCAL_WORLD_SIZE": "8"}) == 8  # two nodes of 8: not 16
    assert default_degree(4, b16, {"LOCAL_SIZE": "2"}) == 2  # the deepspeed launcher's name for it
    assert default_degree(2, b16, {"LOCAL_WORLD_SIZE": "1"}) == 1  # one GPU a node: FSDP across, no tp
    assert default_degree(4, b16, {}) == 4  # no launcher says: one node


@pytest.mark.beside
@pytest.mark.slow  # advise on vit_b_16 at 224 px: ~3 s
def test_advise_rows_for_a_vit():
    """advise on a ViT: tp over every GPU (when it divides the heads) and tp x FSDP on the 2-D mesh; the
    tp rank holds half of every split layer, so its model state is below DDP's and above full sharding's."""
    from common.bench.advise import setups
    from common.predict.memory import predict

    opts = Namespace(model="vit_b_16", image_size=224, batch_size=128, gpus=4, precision="bf16", optimizer="adamw",
                     grad_checkpointing=False, tp=2)
    got = {s.strategy: s for s in setups(opts)}
    assert (got["tp"].tp, got["tp"].dp, got["tp_fsdp"].tp, got["tp_fsdp"].dp) == (4, 1, 2, 2)
    state = {k: predict(got[k]).model_state for k in ("ddp", "tp", "tp_fsdp", "fsdp_full-shard")}
    assert state["fsdp_full-shard"] < state["tp"] < state["ddp"] / 3
    assert state["tp_fsdp"] == pytest.approx(state["tp"], rel=0.02)  # 1/2 x 1/2 vs 1/4: the same shard size
    opts.gpus = 8  # 8 does not divide 12 heads: no tp row; tp 2 x dp 4 stays
    assert {s.strategy for s in setups(opts)} & {"tp", "tp_fsdp"} == {"tp_fsdp"}
    opts.model = "resnet50"
    assert not {s.strategy for s in setups(opts)} & {"tp", "tp_fsdp"}


@pytest.mark.beside
@pytest.mark.slow  # advise on vit_b_16: ~1.5 s
def test_advise_says_why_a_tp_row_is_left_out(capsys):
    """A tp layout pytorch_TP.py cannot run is not a silent gap in advise's table: one line says why."""
    import argparse

    from common.bench.advise import _tp_left_out, add_args, advise, check

    p = argparse.ArgumentParser()
    add_args(p)
    advise(p.parse_args(["--model", "vit_b_16", "--gpus", "4", "--tp", "3", "--precision", "bf16",
                         "--gpu-memory-gib", "80"]))
    out = capsys.readouterr().out.splitlines()
    assert "not predicted: tp_fsdp: --tp 3 does not divide --gpus 4" in out
    assert any(line.startswith("tp (tp 4) ") for line in out)
    opts = p.parse_args(["--model", "vit_b_16", "--gpus", "8", "--precision", "bf16", "--gpu-memory-gib", "80"])
    check(opts)
    assert _tp_left_out("tp", opts).startswith("tp 8 does not divide the model's 12 attention heads")
    assert _tp_left_out("tp_fsdp", opts) is None
    opts.precision = "fp16"
    assert "bf16 autocast" in _tp_left_out("tp_fsdp", opts)
    opts.model = "resnet50"  # no tp layout to expect for a ResNet: nothing to say
    assert _tp_left_out("tp", opts) == _tp_left_out("tp_fsdp", opts) == ""


TOLERANCE = 1e-4  # test_equivalence's (4 SGD steps at lr 0.05; here 2)


@pytest.mark.slow
@pytest.mark.parametrize("name, world", [("pytorch_TP-fp32", 2), ("pytorch_TP-fp32-dp2", 4)])
@pytest.mark.launches("pytorch_SingleGPU-vit_b_16", "{name}")
def test_tp_trains_like_one_process(runs, name, world):
    """pytorch_TP.py on vit_b_16 at 32 px, tp 2 (2 ranks) and tp 2 x dp 2 (4 ranks, FSDP2 over dp), against
    pytorch_SingleGPU.py on the same 2 batches: the same weights within test_equivalence's tolerance; the
    model state each rank holds, as predicted; per step, 4 all-reduces per block (Megatron's f and g,
    forward and backward: q, k and v's input gradients reduced once, not three times) of micro-batch x
    5 tokens x 768, plus over dp FSDP's 2 gathers and a reduce-scatter of the rank's shards: within 10%.
    The final weights load strictly into a bare torchvision ViT."""
    from test_memory import check_model_state
    from test_scripts import load_bare

    from common.predict.volume import tp_expected_bytes

    one, r = runs
    check_ok(one.proc), check_ok(r.proc)
    row = r.row
    assert row["status"] == "ok" and int(row["world_size"]) == world and int(row["tp_size"]) == 2
    assert row["strategy"] == ("tp" if world == 2 else "tp_fsdp") and int(row["test_samples"]) == 37
    check_model_state(row)
    want = tp_expected_bytes("vit_b_16", 32, int(row["global_batch_size"]), world, 2)
    assert float(row["comm_bytes_per_step"]) == pytest.approx(want, rel=0.10), (row["comm_bytes_per_step"], want)
    if world == 2:  # every collective is a tp all-reduce
        assert float(row["comm_calls_per_step"]) == 4 * 12, row["comm_calls_per_step"]
    ref, sd = load_bare(one.final(), "vit_b_16", 32), load_bare(r.final(), "vit_b_16", 32)
    diff = max((sd[k] - ref[k]).abs().max().item() for k in ref)
    init = vit().state_dict()["heads.head.weight"]
    assert (ref["heads.head.weight"] - init).abs().max() > 100 * TOLERANCE  # training moved the weights
    print(f"{name}: max |w - w_single| = {diff:.2e}, bytes/step {row['comm_bytes_per_step']} (expected {want:.0f}), "
          f"model state {row['model_state_gib']} GiB (predicted {row['pred_model_state_gib']})")
    assert diff < TOLERANCE
    assert abs(float(row["train_loss"]) - float(one.row["train_loss"])) < 1e-4
    assert math.isclose(float(row["test_accuracy"]), float(one.row["test_accuracy"]))


@pytest.mark.beside
@pytest.mark.slow  # vit_b_16's step predicted per strategy: ~1.6 s
def test_the_step_model_of_tensor_parallelism():
    """A tp rank computes its share of the FLOPs (half of vit_b_16's, whose Linears are nearly all of them)
    and waits on 4 activation all-reduces per block even where collectives overlap compute (each one's
    result is the next op's input); the optimizer steps its shards. tp x FSDP over dp adds FSDP's
    collectives, and the dp ranks split the batch."""
    from common.predict.memory import Setup
    from common.predict.timemodel import Compute, Link, predict_step

    c, link = Compute(100.0, 200.0, 30.0), Link(busbw_gbps={"all_reduce": 1.0}, latency_us={"all_reduce": 100.0})
    base = Setup(model="vit_b_16", image_size=32, batch_size=16)
    one = predict_step(base, c, link, overlap=True)
    tp = predict_step(Setup(**{**base.__dict__, "strategy": "tp", "world_size": 2, "tp": 2}), c, link, overlap=True)
    assert tp.compute_ms == pytest.approx(0.5 * one.compute_ms, rel=0.02)
    reduce_ms = 0.1 + 16 * 5 * 768 * 4 * 1.0 / 1e9 * 1e3  # latency + S x (2(n-1)/n = 1 at n=2) / busbw
    assert tp.comm_exposed_ms == pytest.approx(4 * 12 * reduce_ms, rel=1e-6)
    assert tp.optimizer_ms == pytest.approx(0.5 * c.opt_ms, rel=0.02)
    both = predict_step(Setup(**{**base.__dict__, "strategy": "tp_fsdp", "world_size": 4, "tp": 2}), c, link,
                        overlap=False)
    assert both.comm_exposed_ms > tp.comm_exposed_ms and both.optimizer_ms == pytest.approx(tp.optimizer_ms / 2)


def test_split_and_replicated_parameters_step_in_separate_groups():
    """The CPU twin of a CUDA-only failure: CUDA optimizers default to the foreach step, which DTensor
    refuses on a list mixing split (DTensor) and replicated (plain) parameters; foreach=True forces that
    step here. pytorch_TP.py's param_groups keeps them apart (one foreach list per group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from common.tensor_parallel import param_groups

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
        parallelize_module(model, init_device_mesh("cpu", (1,)), {"1": ColwiseParallel()})

        def step(params):
            opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
            model(torch.randn(2, 8)).sum().backward()
            opt.step()

        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            step(model.parameters())
        step(param_groups(model))
    finally:
        dist.destroy_process_group()
