"""How close the step model comes to a loader-bound run with real DataLoader workers on this host:

    python benchmarks/loader_bound.py                      # 3 workers, 50 ms a sample, batch 4, 27 batches
    python benchmarks/loader_bound.py --workers 2 --wait-ms 20 --rounds 5

The CPU twin of a small batch on a fast GPU (ResNet50 AMP at 32 images on an H100 with 2 workers: 32.6 ms
a step against 25.2 ms of work): workers that sleep `--wait-ms` per sample, so a batch takes batch x wait
in a worker and the pipeline's nominal rate is workers / wait, and a one-layer model whose step takes a
millisecond or two. fit() (common/train.py) probes the loader (common/measure/loader.py) and times the
window; the prediction (common/predict/timepred.py) is step = max(work, batch / probed rate), its work
taken from the run's own measured compute and optimizer phases (a calibration written for this run, so
that only the loader's part is predicted). Printed per round: the probed and nominal rates, the measured
mean and median step, the prediction and its error against the mean (a round of sleeping workers lands
at once, so most steps find their batch ready and the median is one of those).

A figure, not a check: the probe's rate and the one the window meets differ by what the workers' start-up
and dispatch cost on the host and by the batches they have queued when the window opens (the prediction
came out 12 ms above a measured mean of 68 ms on a 2-core AMD EPYC, 19-24% above on a 2-core VM). The
arithmetic is tests/test_time.py::test_a_loader_bound_run_is_predicted_from_its_probed_rate, on a clock the
test moves.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common.train as train  # noqa: E402
from common.config import TrainConfig  # noqa: E402
from common.measure.fingerprint import device_name  # noqa: E402
from common.measure.stepparts import StepParts  # noqa: E402
from common.measure.steptime import StepTimes  # noqa: E402
from common.predict import timepred  # noqa: E402
from common.predict.calibration import (
    key,  # noqa: E402
    load,  # noqa: E402
)
from common.runsetup import RunSetup  # noqa: E402


class SleepySamples(torch.utils.data.Dataset):
    """Each sample takes `wait_s` to build, in a worker that sleeps rather than computes."""

    def __init__(self, n, wait_s):
        self.n, self.wait_s = n, wait_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.wait_s)
        return torch.randn(3, 2, 2), i % 10


def run(a) -> dict:
    """One fit() over the sleeping loader: its row and the probed rate."""
    got = {}

    def instruments(cfg, model, hooks, m, *_):
        got.setdefault("parts", [StepTimes(hooks.device), StepParts(hooks.device)])
        return got["parts"]

    train.build_instruments = instruments  # the step components and times only: no probes, no FLOP count
    loader = torch.utils.data.DataLoader(SleepySamples(a.batch * a.batches, a.wait_ms / 1e3), batch_size=a.batch,
                                         num_workers=a.workers)
    cfg = TrainConfig(epochs=1, timing_warmup_steps=a.warmup, log_every=0, batch_size=a.batch,
                      loader_probe_batches=a.probe, workers=a.workers)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = train.TrainHooks(lambda loss: loss.backward(), lambda: (opt.step(), opt.zero_grad()),
                             torch.device("cpu"), ctx=nullcontext(), evaluate=lambda *_a, **_k: (0.5, 10))
    row = train.fit(cfg, model, loader, None, hooks).extra
    return {**row, "rate": row["loader_img_s"]}


def predict(a, row: dict, folder: str):
    """The step model's step for this run, from its probed rate and its own measured work."""
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    half = row["step_compute_ms"] / 2
    cal = os.path.join(folder, "calibration.json")
    with open(cal, "w") as fh:
        json.dump({"device_name": device_name(torch.device("cpu")), "links": {}, "compute": {
            key("resnet18", 32, a.batch, "fp32", "sgd", 1, torch.get_num_threads()):
                {"fwd_ms": half, "bwd_ms": half, "opt_ms": row["step_optimizer_ms"]}}}, fh)
    run = RunSetup(script="pytorch_SingleGPU.py", strategy="single", precision="fp32", model="resnet18",
                   image_size=32, batch_size=a.batch, world_size=1, workers=a.workers, device="cpu",
                   device_name=device_name(torch.device("cpu")), threads=torch.get_num_threads())
    pred, why = timepred.predict(run, load(cal), cal, row["rate"])
    if pred is None:
        sys.exit(f"loader_bound.py: no prediction: {why}")
    return pred


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--wait-ms", type=float, default=50.0, help="per sample, in a worker")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--batches", type=int, default=27)
    p.add_argument("--warmup", type=int, default=6, help="untimed steps before the window")
    p.add_argument("--probe", type=int, default=8, help="loader_probe_batches")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    if a.workers < 1 or a.wait_ms <= 0 or a.batches <= a.warmup + a.workers + 1 or a.rounds < 1:
        sys.exit("loader_bound.py: needs --workers >= 1, --wait-ms > 0, --rounds >= 1 and more --batches than "
                 "--warmup + --workers + 1")
    nominal = a.workers / (a.wait_ms / 1e3)
    errors = []
    with tempfile.TemporaryDirectory() as folder:
        for r in range(a.rounds):
            row = run(a)
            pred = predict(a, row, folder)
            errors.append(100 * (pred.step_ms - row["step_ms_mean"]) / row["step_ms_mean"])
            print(f"round {r + 1}: probed {row['rate']:.1f} img/s (nominal {nominal:.1f}); step mean "
                  f"{row['step_ms_mean']:.2f} ms, p50 {row['step_ms_p50']:.2f} ms (data "
                  f"{row['step_data_ms']:.2f}, compute {row['step_compute_ms']:.2f}); predicted {pred.step_ms:.2f} ms, "
                  f"error {errors[-1]:+.1f}% of the mean", flush=True)
    print(f"{a.workers} workers x {a.wait_ms:g} ms a sample, batch {a.batch}, on CPU x{os.cpu_count()}, torch "
          f"{torch.__version__}: prediction error against the mean step, median of {a.rounds} rounds, "
          f"{statistics.median(errors):+.1f}%")


if __name__ == "__main__":
    main()
