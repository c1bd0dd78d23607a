"""model_inference.py on checkpoints the training scripts wrote: same accuracy, ONNX parity, clear errors.

ONNX tolerance: both sides run fp32; onnxruntime folds BatchNorm into the convolutions and uses
other kernels, which changes rounding at ~1e-6 relative per op. Through ResNet18's 20 layers the
logits (magnitude ~1-10) move by ~1e-5; MAX_DIFF = 1e-3 leaves two orders of margin while a
wrong export (missing normalization, wrong layout, dropped layer) moves them by > 0.1.
"""
import types

import pytest
import torch
import torchvision
from helpers import check_ok, half_size, one_line_error, rows, run

MAX_DIFF = 1e-3
INFER = ["--device", "cpu", "--dataset", "synthetic", "--model", "resnet18", "--image-size", "32",
         "--test-samples", "37", "--workers", "0", "--latency-iters", "3", "--throughput-iters", "2",
         "--batch-size", "16", "--warmup-iters", "1"]


# the shared fp32 runs; the DeepSpeed (ZeRO-2, deepspeed launcher) and accelerate FSDP ones train BatchNorm
# in train mode, so their checkpoints carry running statistics of their own (the others run --freeze-bn)
TRAINED = ["pytorch_SingleGPU-fp32", "pytorch_DDP-fp32", "pytorch_FSDP-fp32", "pytorch_DeepSpeed-launcher",
           "accelerate_FSDP-twin-fp32"]


@pytest.fixture(scope="module")
def trained(launched, tmp_path_factory):
    """The shared fp32 runs of one process, DDP, FSDP, DeepSpeed and accelerate FSDP: their model_final.pt linked
    under one folder, as checkpoints/ holds them, and each run's accuracy."""
    tmp = tmp_path_factory.mktemp("trained")
    accuracy = {}
    for name in TRAINED:
        r = launched(name)
        check_ok(r.proc)
        (tmp / "ckpt" / r.launch.script[:-3]).mkdir(parents=True)
        (tmp / "ckpt" / r.launch.script[:-3] / "model_final.pt").symlink_to(r.final())
        accuracy[r.launch.script] = float(r.row["test_accuracy"])
    return tmp, accuracy


@pytest.mark.slow
@pytest.mark.launches(*TRAINED)
def test_every_checkpoint_gives_the_training_runs_accuracy(trained, tmp_path):
    tmp, accuracy = trained
    out = tmp_path / "inference.csv"
    check_ok(run("model_inference.py", ["--checkpoint", str(tmp / "ckpt"), "--results", str(out)] + INFER))
    got = {r["script"]: r for r in rows(out)}
    assert sorted(got) == sorted(accuracy)
    for script, r in got.items():
        assert float(r["test_accuracy"]) == pytest.approx(accuracy[script], abs=1e-6), script
        assert r["backend"] == "torch" and int(r["test_samples"]) == 37
        assert 0 < float(r["latency_ms_p50"]) <= float(r["latency_ms_p90"]) and float(r["throughput_img_s"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("precision, loader", [("fp32", "torch"), ("bf16", "gpu")])
@pytest.mark.launches(*TRAINED)
def test_onnx_parity(trained, tmp_path, precision, loader):
    """fp32: parity within MAX_DIFF. bf16: the export works from a bf16 model (the export is of an
    fp32 copy; the measured model keeps its dtype) and parity is against that bf16 model, so the
    difference is bf16's rounding (~1e-2 on these logits), not an export error. --loader gpu runs
    the device-side pipeline (here on the CPU): its validity mask lives with its tensors."""
    tmp, accuracy = trained
    out = tmp_path / "inference.csv"
    ckpt = tmp / "ckpt" / "pytorch_DDP" / "model_final.pt"
    # 16 px where bf16 runs torch's reference kernels (helpers.half_size): resnet18 pools to any size
    flags = INFER + ["--image-size", str(half_size(precision).get("image_size", 32))]
    check_ok(run("model_inference.py", ["--checkpoint", str(ckpt), "--results", str(out), "--onnx",
                                        "--precision", precision, "--loader", loader] + flags))
    torch_row, ort_row = rows(out)
    assert torch_row["precision"] == precision and int(torch_row["test_samples"]) == 37
    assert ort_row["backend"] == "onnxruntime:CPUExecutionProvider" and ort_row["onnx_opset"] == "18"
    assert float(ort_row["max_abs_diff"]) < (MAX_DIFF if precision == "fp32" else 0.25)
    assert float(ort_row["top1_agreement"]) >= (0.99 if precision == "fp32" else 0.9)
    assert float(ort_row["test_accuracy"]) == pytest.approx(float(torch_row["test_accuracy"]), abs=1 / 37 + 1e-9)
    import onnx
    model = onnx.load(str(ckpt).replace(".pt", ".onnx"))
    assert model.graph.input[0].name == "images" and model.graph.output[0].name == "logits"
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # dynamic batch axis


@pytest.mark.slow
@pytest.mark.beside
def test_onnx_export_leaves_the_measured_model_as_it_was(tmp_path):
    """The export is of an fp32 CPU copy: exporting in place would turn the bf16 (or CUDA) model being
    measured into fp32 on the CPU, and its reference logits would then mix dtypes and devices."""
    import model_inference

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, 10)

        def forward(self, x):
            return self.fc(self.conv(x).mean((2, 3)))

    model = Tiny().to(torch.bfloat16)
    model_inference.export_onnx(model, types.SimpleNamespace(image_size=8, onnx_opset=18), str(tmp_path / "m.onnx"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_onnx_runtime_reads_a_device_input_only_once_torch_has_written_it(monkeypatch, device):
    """CPU twin of the CUDA line in ort_runner: ONNX Runtime runs on a stream of its own and reads the bound
    pointer in no order with torch's stream (onnxruntime issues 10299, 26609), so torch's stream is waited for
    before the input is bound; on the CPU nothing is queued."""
    import model_inference

    calls = []

    class Binding:
        def bind_input(self, *args):
            calls.append("bind_input")

        def bind_output(self, *args):
            calls.append("bind_output")

        def synchronize_outputs(self):
            calls.append("synchronize_outputs")

        def get_outputs(self):
            return ["logits"]

    session = types.SimpleNamespace(io_binding=Binding, run_with_iobinding=lambda io: calls.append("run"))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda d=None: types.SimpleNamespace(synchronize=lambda: calls.append("torch's stream")))
    run_once, _ = model_inference.ort_runner(session, torch.device(device, 0) if device == "cuda" else
                                             torch.device("cpu"))
    run_once(torch.zeros(2, 3, 8, 8))
    waited = ["torch's stream"] if device == "cuda" else []
    assert calls == [*waited, "bind_input", "bind_output", "run", "synchronize_outputs"]


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_bytes(b"garbage bytes"), "is not a PyTorch checkpoint"),
    (lambda p: torch.save({"epoch": 3}, p), "is not a plain state_dict"),
    (lambda p: torch.save(torchvision.models.resnet34(num_classes=10).state_dict(), p),
     "does not fit --model resnet18"),
    (lambda p: torch.save(torchvision.models.resnet18().state_dict(), p), "another class count"),
])
def test_bad_checkpoints(tmp_path, make, words):
    from common.config import UsageError
    from model_inference import InferenceConfig, load_checkpoint

    path = tmp_path / "model_final.pt"
    make(path)
    with pytest.raises(UsageError, match=words):
        load_checkpoint(str(path), InferenceConfig(model="resnet18"))


def test_loading_a_checkpoint_never_fetches_pretrained_weights(tmp_path, monkeypatch):
    from model_inference import InferenceConfig, load_checkpoint

    def no_network(*a, **k):
        raise AssertionError("tried to fetch ImageNet weights")
    monkeypatch.setattr(torchvision.models, "get_model_weights", no_network)
    path = tmp_path / "model_final.pt"
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), path)
    model, _ = load_checkpoint(str(path), InferenceConfig(model="resnet18"))
    assert sum(p.numel() for p in model.parameters()) == 11_181_642


@pytest.mark.parametrize("make, words", [
    (lambda p: p.write_bytes(b"garbage bytes"), "is not a PyTorch checkpoint"),
    (None, "checkpoint not found"),
])
@pytest.mark.beside
@pytest.mark.slow
def test_bad_checkpoint_one_line_no_row(tmp_path, make, words):
    path = tmp_path / "model_final.pt"
    if make:
        make(path)
    proc = run("model_inference.py", ["--checkpoint", str(path), "--results", str(tmp_path / "i.csv")] + INFER)
    assert words in one_line_error(proc)
    assert not (tmp_path / "i.csv").exists()
