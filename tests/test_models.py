import pytest
import torch
import torch.nn as nn
import torchvision

from common.config import TrainConfig, UsageError
from common.models import build_model


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "vit_b_16", "convnext_tiny"])
def test_head_has_ten_classes(name):
    with torch.device("meta"):  # the head's shape is what is checked: no weights to initialise
        model = build_model(TrainConfig(model=name, pretrained=False))
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    assert last.out_features == 10


# the full-size ViT and ConvNeXt take seconds each: the slow tier, beside a launch (CONTRIBUTING.md)
@pytest.mark.parametrize("name", ["resnet18", *(pytest.param(n, marks=[pytest.mark.slow, pytest.mark.beside])
                                              for n in ("vit_b_16", "convnext_tiny"))])
def test_grad_checkpointing_same_result_same_keys(name):
    """Each block recomputed in backward (common/models.py checkpointed): the same gradients, the same
    state_dict keys, the weights loading into the bare torchvision model. convnext's stochastic depth draws
    again in the recomputation: checkpoint restores the RNG state (preserve_rng_state)."""
    from common.models import blocks

    torch.manual_seed(0)
    plain = build_model(TrainConfig(model=name, pretrained=False, image_size=32))
    ckpt = build_model(TrainConfig(model=name, pretrained=False, image_size=32, grad_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    assert list(plain.state_dict()) == list(ckpt.state_dict())
    assert all(b.checkpointed for _, b in blocks(ckpt)) and not any(getattr(b, "checkpointed", False)
                                                                   for _, b in blocks(plain))
    assert [n for n, _ in blocks(ckpt)] == [n for n, _ in blocks(plain)]  # the swap keeps the blocks found
    x = torch.randn(4, 3, 32, 32)
    for m in (plain, ckpt):
        m.train()
        torch.manual_seed(1)
        m(x).square().mean().backward()
    for (n, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5), n
    with torch.device("meta"):  # its keys and shapes are what is checked: no weights to initialise (86M for a ViT)
        bare = torchvision.models.get_model(name, num_classes=10, **({"image_size": 32} if name.startswith("vit")
                                                                      else {}))
    bare.load_state_dict(ckpt.state_dict(), assign=True)  # strict: raises on a missing or unexpected key
    import pickle  # the swapped-in class pickles (spawned workers, torch.save of a whole model)

    again = pickle.loads(pickle.dumps(ckpt))
    assert type(blocks(again)[0][1]) is type(blocks(ckpt)[0][1])


def test_pretrained_offline_names_the_way_out(monkeypatch):
    def offline(*a, **k):
        raise OSError("no network")
    monkeypatch.setattr(torchvision.models, "get_model", offline)
    with pytest.raises(UsageError) as exc:
        build_model(TrainConfig(model="resnet18", pretrained=True))
    assert "--no-pretrained" in str(exc.value) and "checkpoints" in str(exc.value)


def test_unknown_model():
    with pytest.raises(UsageError, match="unknown model"):
        build_model(TrainConfig(model="resnet5000", pretrained=False))


def test_probes_empty_on_cpu():
    from common.measure.probes import Probes
    probes = Probes([torch.device("cpu")], torch.device("cpu"))
    probes.start()
    probes.stop()
    values = probes.row()
    assert set(values) == {"peak_allocated_gib", "peak_reserved_gib", "peak_nvml_gib", "gpu_util_mean",
                           "gpu_util_peak"}
    assert all(v is None for v in values.values())
