"""Every torchvision family through the block-wise strategies: the repeated block found from the model
(common/models.py blocks), the families that fix their input size built for the run's, and FSDP on a
vision transformer wrapping each EncoderBlock."""
import math

import pytest
import torch
import torchvision

from common.config import UsageError
from common.models import block_classes, blocks, build_model, check_image_size, size_kwargs


def meta(name, **kw):
    with torch.device("meta"):
        return torchvision.models.get_model(name, **kw)


@pytest.mark.parametrize("name, classes, count", [
    ("resnet18", ["BasicBlock"], 8),
    ("resnet50", ["Bottleneck"], 16),
    ("vit_b_16", ["EncoderBlock"], 12),
    ("swin_t", ["SwinTransformerBlock", "PatchMerging"], 15),
    ("convnext_tiny", ["CNBlock"], 18),
    ("efficientnet_b0", ["MBConv"], 16),
    ("efficientnet_v2_s", ["FusedMBConv", "MBConv"], 40),
    ("vgg11", [], 0),  # no repeated block: one FSDP unit
])
def test_the_block_is_found_from_the_model(name, classes, count):
    model = meta(name)
    found = blocks(model)
    assert block_classes(model) == classes and len(found) == count
    if name == "resnet18":
        assert [n for n, _ in found] == [f"layer{s}.{b}" for s in range(1, 5) for b in range(2)]
    if name == "vit_b_16":
        assert [n for n, _ in found] == [f"encoder.layers.encoder_layer_{i}" for i in range(12)]
    names = [n for n, _ in found]
    assert not any(a.startswith(b + ".") for a in names for b in names)  # outermost only, none inside another
    order = [n for n, _ in model.named_modules()]
    assert names == sorted(names, key=order.index)  # registration (forward) order


def test_a_vision_transformer_is_built_for_the_run_size():
    assert size_kwargs("vit_b_16", 32) == (("image_size", 32),) and size_kwargs("resnet18", 32) == ()
    cfg = type("Cfg", (), {"model": "vit_b_16", "pretrained": False, "channels_last": False, "image_size": 32})
    with torch.device("meta"):
        net = build_model(cfg)
        assert net(torch.empty(2, 3, 32, 32)).shape == (2, 10)
    assert net.encoder.pos_embedding.shape == (1, (32 // 16) ** 2 + 1, 768)  # 4 patches and the class token


def test_a_model_the_meta_device_cannot_build_still_builds():
    """RegNet's constructor reads tensor values (.tolist()): no size check on the meta device, and the run
    builds it as before."""
    cfg = type("Cfg", (), {"model": "regnet_y_400mf", "pretrained": False, "channels_last": False,
                           "image_size": 32})
    check_image_size("regnet_y_400mf", 32)
    assert build_model(cfg)(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("name, size, words", [
    ("vit_b_16", 40, "indivisible by patch size"),
    ("alexnet", 32, "Output size is too small"),
    ("maxvit_t", 64, "not divisible by partition size"),
])
def test_a_size_the_family_cannot_take_is_refused_in_one_line(name, size, words):
    with pytest.raises(UsageError, match=words) as err:
        check_image_size(name, size)
    assert str(err.value).startswith(f"--image-size {size}: {name} cannot take it") and "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.beside
def test_pretrained_vit_weights_go_to_the_run_size_with_the_embedding_interpolated(monkeypatch):
    """Offline here, so the 'ImageNet' weights are a seeded random vit_b_16 at 224 handed out by the same
    get_model call; what is checked is the glue: every weight moves over, the position embedding is
    torchvision's interpolate_embeddings of the 224 one (class token kept), and a size whose weights
    cannot move is refused in one line."""
    from torchvision.models.vision_transformer import interpolate_embeddings

    import common.models as models

    real = torchvision.models.get_model
    torch.manual_seed(0)
    source = real("vit_b_16")

    def fake(name, weights=None, **kw):
        return source if weights is not None else real(name, **kw)

    monkeypatch.setattr(torchvision.models, "get_model", fake)
    weights = torchvision.models.get_model_weights("vit_b_16").DEFAULT
    net = models._pretrained("vit_b_16", weights, 32)
    want = interpolate_embeddings(32, 16, source.state_dict())
    got = net.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert got["encoder.pos_embedding"].shape == (1, 5, 768)
    assert torch.equal(got["encoder.pos_embedding"][:, :1], source.state_dict()["encoder.pos_embedding"][:, :1])
    assert models._pretrained("vit_b_16", weights, 224) is source  # the weights' own size: as loaded


def test_fsdp_units_of_a_vision_transformer_are_its_encoder_blocks():
    """The memory model gathers one EncoderBlock at a time, not the 86M-parameter model."""
    from common.models import model_facts
    from common.predict.memory import Setup, predict

    shapes, units, _ = model_facts("vit_b_16", 32)
    block = sum(p.numel() for p in meta("vit_b_16", image_size=32).encoder.layers[0].parameters())
    sizes = [sum(math.prod(s) for s in u) for u in units]
    assert len(units) == 13 and sizes[:12] == [block] * 12  # 12 blocks, then the root (patch embedding, head)
    assert sum(sizes) == sum(math.prod(s) for s in shapes)
    p = predict(Setup(model="vit_b_16", image_size=32, strategy="fsdp_full-shard", precision="fp32", world_size=2,
                         batch_size=16))
    assert p.comm == 3 * 4 * block  # the unit in use, the prefetched one, the reduce-scatter input


@pytest.mark.slow
@pytest.mark.launches("pytorch_FSDP-vit_b_16")
def test_fsdp_on_vit_b_16_wraps_each_encoder_block(runs):
    """vit_b_16 at 32 px on 2 gloo ranks under torchrun: one ok row, model state as predicted, the bytes of
    3 passes over the parameters (2 all-gathers and a reduce-scatter), and one collective of each per unit
    and step: 12 EncoderBlocks and the root. The root is re-gathered for backward too, because
    pytorch_FSDP.py passes reshard_after_forward=True: FSDP2 keeps the root gathered only when the argument
    is left unset (torch/distributed/fsdp/_fully_shard/_fsdp_state.py _lazy_init, auto_reshard_after_forward).
    The final weights load strictly into a bare torchvision vit_b_16 of that size."""
    from helpers import check_ok
    from test_memory import check_model_state
    from test_scripts import load_bare

    (r,) = runs
    check_ok(r.proc)
    row = r.row
    assert row["status"] == "ok" and row["model"] == "vit_b_16" and row["strategy"] == "fsdp_full-shard"
    check_model_state(row)
    with torch.device("meta"):
        params = sum(p.numel() for p in torchvision.models.vit_b_16(num_classes=10, image_size=32).parameters())
    assert float(row["comm_bytes_per_step"]) == pytest.approx(3 * 4 * params, rel=0.10)
    units = 12 + 1  # a model-wide unit would be 3 calls a step
    assert float(row["comm_calls_per_step"]) == 3 * units, row["comm_calls_per_step"]
    load_bare(r.final(), "vit_b_16", image_size=32)


@pytest.mark.slow
@pytest.mark.beside
def test_a_vit_is_split_between_its_encoder_blocks():
    """Model and pipeline parallelism cut a non-ResNet model between its blocks (common/pipeline.py): two
    balanced pieces of 6 EncoderBlocks, traced by torch.distributed.pipelining, with torchvision's names
    and the model's own parameters, computing the model's function; BatchNorm models and models without
    blocks are refused in one line."""
    from common.config import UsageError
    from common.pipeline import plan, split

    torch.manual_seed(0)
    model = torchvision.models.vit_b_16(num_classes=10, image_size=32)
    assert plan(model, 2) == [6, 6] and plan(model, 3, "2,4,6") == [2, 4, 6]
    x = torch.randn(4, 3, 32, 32)
    first, second = split(model, plan(model, 2), x)
    assert "encoder.layers.encoder_layer_5.mlp.0.weight" in first.state_dict()
    assert "encoder.layers.encoder_layer_6.ln_1.weight" in second.state_dict()
    assert {**first.state_dict(), **second.state_dict()}.keys() == model.state_dict().keys()
    assert first.get_parameter("conv_proj.weight") is model.conv_proj.weight  # shared, not copied
    assert torch.allclose(second(first(x)), model(x), atol=1e-5)
    with pytest.raises(UsageError, match="has BatchNorm"):
        effnet = torchvision.models.efficientnet_b0(num_classes=10)
        split(effnet, plan(effnet, 2), x)
    with pytest.raises(UsageError, match="VGG has none"):
        with torch.device("meta"):  # its structure is what is refused: no 133M weights to initialise
            vgg = torchvision.models.vgg11(num_classes=10)
        plan(vgg, 2)
    with pytest.raises(UsageError, match="only 12 VisionTransformer blocks"):
        plan(model, 13)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pytorch_PP-vit_b_16", "pytorch_MP-vit_b_16"])
@pytest.mark.launches("pytorch_SingleGPU-vit_b_16", "{name}")
def test_pipeline_and_model_parallel_vit_train_like_one_process(runs, name):
    """vit_b_16 at 32 px cut between EncoderBlocks 5 and 6: the pipeline on 2 ranks (GPipe, 4 micro-batches
    of 4), and the two halves in one process, against pytorch_SingleGPU.py on the same 2 batches of 16: the
    same weights within test_equivalence's tolerance (no BatchNorm: micro-batches compute the same
    function). The pipeline sends the token activations at the cut forward and their gradient back:
    batch x 5 tokens x 768 fp32, twice."""
    from helpers import check_ok
    from test_scripts import load_bare

    one, r = runs
    check_ok(one.proc), check_ok(r.proc)
    row = r.row
    assert row["status"] == "ok" and row["model"] == "vit_b_16" and int(row["test_samples"]) == 37
    if name.startswith("pytorch_PP"):
        # (within 0.1%: a few hundred bytes more over the profiled steps than the activations alone)
        assert float(row["comm_bytes_per_step"]) == pytest.approx(2 * 16 * 5 * 768 * 4, rel=1e-3)
    ref, sd = load_bare(one.final(), "vit_b_16", 32), load_bare(r.final(), "vit_b_16", 32)
    diff = max((sd[k] - ref[k]).abs().max().item() for k in ref)
    print(f"{name}: max |w - w_single| = {diff:.2e}")
    assert diff < 1e-4
    assert abs(float(row["train_loss"]) - float(one.row["train_loss"])) < 1e-4
