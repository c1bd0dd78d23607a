"""Known inputs with known answers for the places where a planted bug once survived the suite
(issue 27): each test here goes red on its bug every time, without a launch or a race."""

import pytest
import torch
from helpers import spawn_ranks

from common.measure.steptime import StepTimes
from common.predict import stats
from common.results import read_figures, read_rows

SKEWED = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 100.0]


def test_the_bootstrap_interval_is_of_the_median():
    """Six launches at 1 and one at 100: a resample's median is 100 only when 4 of its 7 draws are
    the outlier (p = 0.6%, under the 2.5% tail), so the median's 95% interval is exactly (1, 1); the
    mean's would reach ~43."""
    assert stats.median_ci(SKEWED) == (1.0, 1.0)
    ratio, lo, hi = stats.ratio_ci(SKEWED, [2.0 * x for x in SKEWED])
    assert (ratio, lo, hi) == (2.0, 2.0, 2.0)
    summary = stats.summarize(SKEWED)
    assert summary.median == 1.0 and (summary.ci_low, summary.ci_high) == (1.0, 1.0)
    assert summary.max == 100.0 and summary.iqr == 0.0


def test_step_percentiles_of_known_steps():
    """1..10 ms: numpy's linear interpolation gives p50 5.5 and p90 9.1."""
    times = StepTimes(torch.device("cpu"))
    times.ms = [float(i) for i in range(10, 0, -1)]
    assert times.row() == {"step_ms_p50": 5.5, "step_ms_p90": 9.1}


def _rank(rank, world, port, queue):
    import torch.distributed as dist

    from common.measure.model_state import ModelState

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                store=dist.TCPStore("127.0.0.1", port, world, rank == 0))
        state = ModelState(torch.nn.Linear(2, 2), None, torch.device("cpu"))
        state.measured = (1 + 2 * rank) * 2**30  # rank 1 holds 3 GiB, rank 0 (which writes the row) 1 GiB
        times = StepTimes(torch.device("cpu"))
        times.ms = [10.0 * (rank + 1)] * 4  # and rank 1 is the slower one
        queue.put((rank, {**state.row(), **times.row()}))
        dist.destroy_process_group()
    except Exception as exc:
        queue.put((rank, {"error": repr(exc)}))


@pytest.mark.slow  # spawns a gloo group of 2 processes (helpers.spawn_ranks)
def test_per_rank_figures_are_the_max_over_ranks():
    """Ranks holding different amounts (a pipeline's stages do): every rank's row, rank 0's that is
    written included, takes the largest, which here is rank 1's."""
    for row in spawn_ranks(_rank).values():
        assert "error" not in row, row
        assert row["model_state_gib"] == 3.0
        assert row["step_ms_p50"] == 20.0 == row["step_ms_p90"]


@pytest.mark.parametrize("attempt, max_restarts, writes", [("0", "1", False), ("1", "1", True), ("0", "0", True)])
def test_a_failing_worker_writes_no_row_while_torchrun_will_restart_it(monkeypatch, attempt, max_restarts, writes):
    from common.runner import write_row

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", max_restarts)
    monkeypatch.delenv("RANK", raising=False)
    assert write_row(1) is writes  # a failure: the last attempt (or a run without restarts) writes it
    assert write_row(0) is True  # success always writes, from rank 0


@pytest.mark.parametrize("content, words", [
    ('{"train_micro_batch_size_per_gpu": 3}', "train_micro_batch_size_per_gpu is 3 but the flags give 8"),
    ('{"train_batch_size": 64}', "train_batch_size is 64 but the flags give 16"),
])
def test_deepspeed_json_batch_keys_alone(tmp_path, content, words):
    from common.config import TrainConfig, UsageError
    from common.deepspeed_config import resolve_ds_config

    path = tmp_path / "ds.json"
    path.write_text(content)
    with pytest.raises(UsageError, match=words):
        resolve_ds_config(TrainConfig(batch_size=16), str(path), world_size=2, micro_batch=8)


def ddp_buckets(model: torch.nn.Module) -> int:
    """The all-reduces DDP issues per step once it has rebuilt its buckets after the first step:
    gradients in ready order (about the reverse of definition order) cut at 1 MiB for the first
    bucket, 25 MiB after (torch/nn/parallel/distributed.py, dist._DEFAULT_FIRST_BUCKET_BYTES)."""
    import torch.distributed as dist

    params = list(reversed(list(model.parameters())))
    buckets, _ = dist._compute_bucket_assignment_by_size(params, [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20],
                                                          [False] * len(params))
    return len(buckets)


def test_ddp_buckets_of_resnet18():
    import torchvision

    assert ddp_buckets(torchvision.models.resnet18(num_classes=10)) == 3




def test_only_global_rank_0_counts_and_predicts_what_only_its_row_shows(monkeypatch, tmp_path):
    """The FLOP count, the memory walk and the step prediction are the row's, which global rank 0 writes:
    any other rank skips them (their time of a CPU the ranks may share, every launch). The count is an
    instrument's, the predictions the runner's once training has ended."""
    import sys

    from common import runner
    from common.measure import flops
    from common.train import Metrics

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")  # no CPU probe
    cpu, seen = torch.device("cpu"), {}
    results = tmp_path / "summary.csv"
    figures = tmp_path / "run.json"  # benchmark.py's --figures: the row again, for the matrix
    monkeypatch.setattr(sys, "argv", ["pytorch_SingleGPU.py", "--device", "cpu", "--model", "resnet18",
                                      "--image-size", "32", "--results", str(results), "--figures", str(figures)])
    monkeypatch.setattr(runner, "predicted", lambda *a, **k: seen.setdefault("predicted", []).append(rank) or {})
    for rank in (1, 0):
        monkeypatch.setattr(flops, "global_rank", lambda rank=rank: rank)
        monkeypatch.setattr(runner, "global_rank", lambda rank=rank: rank)
        count = flops.Flops("resnet18", 32, "fp32", [torch.device("cuda", 0)], cpu, lambda: 100.0)
        seen[rank] = count.flops_per_img
        runner.launch(lambda cfg: Metrics(), "pytorch_SingleGPU.py")
        seen[f"figures{rank}"] = read_figures(str(figures))
    assert seen[1] is None and seen[0] > 1e8
    assert seen["figures1"] is None and seen["figures0"] == {k: v for k, v in seen["figures0"].items() if v is not None}
    assert seen["figures0"]["script"] == "pytorch_SingleGPU.py" and seen["figures0"]["status"] == "ok"
    assert seen["predicted"] == [0] and len(read_rows(str(results))) == 1


def test_a_run_freezes_its_imports_before_its_set_up_and_after_its_flags(monkeypatch, tmp_path):
    """common/fastexit.py: the objects the imports made leave the collector's walks before main() builds
    anything (what is frozen is never freed); bad flags exit before any of it."""
    import sys

    from common import runner
    from common.train import Metrics

    order = []
    monkeypatch.setattr(runner, "freeze_imports", lambda: order.append("freeze"))
    argv = ["pytorch_SingleGPU.py", "--device", "cpu", "--model", "resnet18", "--results", str(tmp_path / "s.csv")]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(runner, "predicted", lambda *a, **k: {})
    runner.launch(lambda cfg: order.append("main") or Metrics(), "pytorch_SingleGPU.py")
    assert order == ["freeze", "main"]
    monkeypatch.setattr(sys, "argv", [*argv, "--epochs", "0"])
    with pytest.raises(SystemExit):
        runner.launch(lambda cfg: order.append("main") or Metrics(), "pytorch_SingleGPU.py")
    assert order == ["freeze", "main"]
