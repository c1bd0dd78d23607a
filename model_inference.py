"""Evaluates and times the model_final.pt of any training script; optional ONNX export and onnxruntime parity.

    python model_inference.py --checkpoint checkpoints/pytorch_DDP/model_final.pt
    python model_inference.py --checkpoint checkpoints --precision bf16 --channels-last   # every model_final.pt below
    python model_inference.py --checkpoint checkpoints/pytorch_FSDP/model_final.pt --onnx --compile
    python model_inference.py --checkpoint ckpt --device cpu --dataset synthetic \\
        --model resnet18 --image-size 32                     # the training run's data and model flags

Shows what a trained model costs to serve: test accuracy (the same number the training run printed
for these weights), latency at batch 1 (p50, p90) and throughput at --batch-size, each after
warm-up with the device synchronized, in PyTorch and, with --onnx, in onnxruntime (CUDA execution
provider when onnxruntime-gpu and a GPU are there, else CPU), with the largest logit difference and
top-1 agreement between the two on the test set. One row per backend in results/inference.csv.
"""
from __future__ import annotations

import copy
import glob
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from common import DTYPES, EvalConfig, UsageError, build_model, configure_backends, opt, pick_device
from common.data import build_test_loader
from common.distributed import require_single_process, synchronize
from common.results import append_row, check_results_path
from common.runner import device_name, git_commit, launch_tool

COLUMNS = ["timestamp", "checkpoint", "script", "backend", "precision", "batch_size", "latency_ms_p50",
           "latency_ms_p90", "throughput_img_s", "test_accuracy", "max_abs_diff", "top1_agreement", "device",
           # extras
           "device_name", "model", "image_size", "test_samples", "onnx_opset", "compile", "channels_last",
           "torch_version", "git_commit"]
HISTORY: list[list[str]] = []  # earlier headers of inference.csv (none yet): upgraded in place if ever changed


@dataclass
class InferenceConfig(EvalConfig):
    """inference"""
    checkpoint: str = opt("checkpoints", "a model_final.pt, or a folder searched for them")
    batch_size: int = opt(256, "batch for the throughput measurement and for evaluation, images", min=1)
    onnx: bool = opt(False, "also export to ONNX, check it, and time onnxruntime with parity against PyTorch")
    onnx_opset: int = opt(18, "ONNX opset of the export", min=13)
    latency_iters: int = opt(50, "timed batch-1 calls for the latency percentiles", min=1)
    throughput_iters: int = opt(20, "timed calls at --batch-size for throughput", min=1)
    warmup_iters: int = opt(5, "untimed calls before each measurement", min=0)


def find_checkpoints(path: str) -> list[str]:
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "model_final.pt"), recursive=True))
        if not found:
            raise UsageError(f"no model_final.pt under {path}")
        return found
    if not os.path.isfile(path):
        raise UsageError(f"checkpoint not found: {path}")
    return [path]


def load_checkpoint(path: str, cfg) -> tuple[torch.nn.Module, str]:
    """A plain state_dict for cfg.model with a 10-class head, else a one-line error saying what it is."""
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UsageError(f"{path} is not a PyTorch checkpoint ({type(exc).__name__})") from None
    if not isinstance(sd, dict) or not sd or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise UsageError(f"{path} is not a plain state_dict (model_final.pt holds name -> tensor)")
    model = build_model(cfg, pretrained=False)  # the weights come from the checkpoint, never from the internet
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    if missing or extra:
        raise UsageError(f"{path} does not fit --model {cfg.model}: {len(missing)} keys missing "
                         f"(e.g. {missing[:2]}), {len(extra)} unexpected (e.g. {extra[:2]})")
    for k, v in expected.items():
        if sd[k].shape != v.shape:
            raise UsageError(f"{path}: {k} has shape {tuple(sd[k].shape)}, --model {cfg.model} with 10 classes "
                             f"expects {tuple(v.shape)} (another class count or model width; a ViT trained at another "
                             f"--image-size)")
    model.load_state_dict(sd)
    script = os.path.basename(os.path.dirname(os.path.abspath(path))) + ".py"
    n = sum(v.numel() for v in sd.values())
    print(f"loaded {path}: {cfg.model}, 10 classes, {len(sd)} tensors, {n / 1e6:.2f} M values, from {script}")
    return model, script


def time_calls(fn, x, iters: int, warmup: int, device) -> list[float]:
    for _ in range(warmup):
        fn(x)
    synchronize(device)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(x)
        synchronize(device)
        times.append(time.perf_counter() - t)
    return times


def measure(fn, cfg, device, dtype) -> dict:
    """Batch-1 latency percentiles and --batch-size throughput on random inputs of the real shape."""
    shape = (3, cfg.image_size, cfg.image_size)
    one = torch.randn(1, *shape, device=device, dtype=dtype)
    lat = np.array(time_calls(fn, one, cfg.latency_iters, cfg.warmup_iters, device)) * 1000
    big = torch.randn(cfg.batch_size, *shape, device=device, dtype=dtype)
    thr = time_calls(fn, big, cfg.throughput_iters, cfg.warmup_iters, device)
    return {"latency_ms_p50": round(float(np.percentile(lat, 50)), 4),
            "latency_ms_p90": round(float(np.percentile(lat, 90)), 4),
            "throughput_img_s": round(cfg.batch_size * len(thr) / sum(thr), 2)}


def predict(fn, loader, device, dtype, channels_last) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 CPU logits and labels of the valid test samples (the GPU loader's tensors, mask included,
    live on the device: everything is brought to the CPU before indexing)."""
    logits, labels = [], []
    for x, y, valid in loader:
        x = x.to(device, dtype=dtype)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        valid = torch.as_tensor(valid).cpu()
        logits.append(torch.as_tensor(fn(x)).float().cpu()[valid])
        labels.append(torch.as_tensor(y).cpu()[valid])
    return torch.cat(logits), torch.cat(labels)


def export_onnx(model, cfg, path: str):
    """Exports an fp32 CPU copy: the model being measured keeps its device and dtype."""
    import onnx

    x = torch.randn(2, 3, cfg.image_size, cfg.image_size)
    batch = torch.export.Dim("batch", min=1, max=65536)
    export = copy.deepcopy(model).float().cpu().eval()
    torch.onnx.export(export, (x,), path, input_names=["images"], output_names=["logits"],
                      dynamic_shapes={"x": {0: batch}}, opset_version=cfg.onnx_opset, dynamo=True)
    onnx.checker.check_model(path)
    return path


def ort_session(path: str, device):
    """(session, provider, torch device its inputs and outputs live on)."""
    import onnxruntime as ort

    providers = ["CPUExecutionProvider"]
    if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    session = ort.InferenceSession(path, providers=providers)
    provider = session.get_providers()[0]
    return session, provider, device if provider == "CUDAExecutionProvider" else torch.device("cpu")


def ort_runner(session, device: torch.device):
    """A call of the session on a torch tensor that already lives on `device`, through IOBinding:
    input and output stay in device memory, so the CUDA latency has no host copies in it (plain
    session.run takes and returns numpy arrays, copying both ways). The outputs are synchronized
    before the call returns, so the timer reads a finished inference. On CUDA the input is waited for
    first: ONNX Runtime reads the bound pointer on a stream of its own, ordered after nothing torch
    queued (onnxruntime issues 10299, 26609)."""
    io = session.io_binding()
    kind = "cuda" if device.type == "cuda" else "cpu"
    index = device.index or 0

    def run(x: torch.Tensor):
        x = x.float().contiguous()
        if kind == "cuda":  # the loader's copy and the cast above may still be queued on torch's stream
            torch.cuda.current_stream(x.device).synchronize()
        io.bind_input("images", kind, index, np.float32, tuple(x.shape), x.data_ptr())
        io.bind_output("logits", kind, index)
        session.run_with_iobinding(io)
        io.synchronize_outputs()
        return io.get_outputs()[0]

    def logits(x: torch.Tensor) -> np.ndarray:
        run(x)
        return io.copy_outputs_to_cpu()[0]

    return run, logits


def main(cfg):
    require_single_process(__file__, "one per GPU, each with its own CUDA_VISIBLE_DEVICES and --results")
    check_results_path(cfg.results, COLUMNS, HISTORY)  # before any checkpoint is read
    device = pick_device(cfg)
    configure_backends(cfg, device)
    dtype = DTYPES[cfg.precision]
    test_loader = build_test_loader(cfg, 0, 1, device, cfg.batch_size)
    base = {"device": device.type, "device_name": device_name(device), "model": cfg.model,
            "image_size": cfg.image_size, "compile": cfg.compile, "channels_last": cfg.channels_last,
            "torch_version": torch.__version__, "git_commit": git_commit()}
    for path in find_checkpoints(cfg.checkpoint):
        model, script = load_checkpoint(path, cfg)
        model = model.to(device, dtype=dtype).eval()
        fn = torch.compile(model) if cfg.compile else model

        @torch.no_grad()
        def torch_fn(x):
            return fn(x.contiguous(memory_format=torch.channels_last) if cfg.channels_last else x)

        logits, labels = predict(torch_fn, test_loader, device, dtype, cfg.channels_last)
        acc = (logits.argmax(1) == labels).float().mean().item()
        row = {**base, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "checkpoint": path,
               "script": script, "backend": "torch", "precision": cfg.precision, "batch_size": cfg.batch_size,
               "test_accuracy": round(acc, 6), "test_samples": len(labels), **measure(torch_fn, cfg, device, dtype)}
        append_row(cfg.results, row, COLUMNS, HISTORY)
        print(f"  torch {cfg.precision}: accuracy {acc:.4f} on {len(labels)}, p50 {row['latency_ms_p50']:.2f} ms, "
              f"{row['throughput_img_s']:.1f} img/s at batch {cfg.batch_size}")
        if not cfg.onnx:
            continue
        onnx_path = export_onnx(model, cfg, os.path.splitext(path)[0] + ".onnx")
        session, provider, ort_device = ort_session(onnx_path, device)
        ort_run, ort_logits_fn = ort_runner(session, ort_device)
        ref = logits  # parity against the PyTorch model as measured (its precision, its device)
        ort_logits, _ = predict(ort_logits_fn, test_loader, ort_device, torch.float32, False)
        ort_acc = (ort_logits.argmax(1) == labels).float().mean().item()
        row = {**row, "backend": f"onnxruntime:{provider}", "precision": "fp32", "onnx_opset": cfg.onnx_opset,
               "test_accuracy": round(ort_acc, 6),
               "max_abs_diff": float((ort_logits - ref).abs().max()),
               "top1_agreement": round((ort_logits.argmax(1) == ref.argmax(1)).float().mean().item(), 6),
               **measure(ort_run, cfg, ort_device, torch.float32)}
        append_row(cfg.results, row, COLUMNS, HISTORY)
        print(f"  onnxruntime ({provider}): accuracy {ort_acc:.4f}, max |logit diff| {row['max_abs_diff']:.2e}, "
              f"top-1 agreement {row['top1_agreement']:.4f}, p50 {row['latency_ms_p50']:.2f} ms, "
              f"{row['throughput_img_s']:.1f} img/s")


if __name__ == "__main__":
    launch_tool(main, __file__, InferenceConfig, precisions=("fp32", "fp16", "bf16"),
                results="results/inference.csv")
