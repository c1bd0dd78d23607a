"""DataParallel's replicate() without its broadcast: the Python loop that copies every module and sets its
parameters and buffers for each device (torch/nn/parallel/replicate.py), on ResNet50, timed on this CPU. The
broadcast (_broadcast_coalesced_reshape) is replaced by views, so only the host's loop is timed.
Run from the repository root: python results/campaigns/2026-11-28_xeon-amx_checks/replicate.py"""
import importlib
import statistics
import time

import torch
import torchvision

R = importlib.import_module("torch.nn.parallel.replicate")
R._broadcast_coalesced_reshape = lambda tensors, devices, detach=False: (
    [[t.detach().view_as(t) if detach else t.view_as(t) for t in tensors] for _ in devices] if tensors else [])
R._replicatable_module = lambda *a, **k: True
model = torchvision.models.resnet50()
print(f"torch {torch.__version__}; resnet50: {sum(1 for _ in model.modules())} modules, "
      f"{sum(1 for _ in model.parameters())} parameters, {sum(1 for _ in model.buffers())} buffers")
for n in (2, 4):
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        R.replicate(model, list(range(n)))
        times.append((time.perf_counter() - t0) * 1e3)
    print(f"{n} devices: median {statistics.median(times):.2f} ms over 30 (min {min(times):.2f}, max {max(times):.2f})")
