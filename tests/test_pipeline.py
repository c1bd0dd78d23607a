"""Model and pipeline parallelism: the split (common/pipeline.py), the bubble instrument, the
interleaved schedule end to end with resume, and the refusals. The weights' equivalence with one
process is in test_equivalence.py; the default runs of pytorch_MP.py/pytorch_PP.py in test_scripts.py."""
import pytest
import torch
from helpers import check_ok, one_line_error, pp_bytes_per_step, rows, run, run_at_once, tiny_args
from test_scripts import load_bare
from test_window import FakeClock

from common.config import TrainConfig, UsageError
from common.measure.bubble import Bubble, Lane
from common.models import build_model
from common.pipeline import plan, split


def resnet18():
    return build_model(TrainConfig(model="resnet18", pretrained=False))


def test_pieces_are_the_model():
    model = resnet18().eval()
    assert plan(model, 2) == [3, 1]  # layer4 holds most of resnet18's parameters
    assert plan(model, 4) == [1, 1, 1, 1] and plan(model, 2, "2,2") == [2, 2]
    pieces = split(model, [1, 2, 1])
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        y = x
        for p in pieces:
            y = p(y)
        assert torch.equal(y, model(x))
    keys = [k for p in pieces for k in p.state_dict()]
    assert keys == list(model.state_dict())  # torchvision's keys, each once, in order


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")
def test_evaluation_leaves_the_stage_s_model_where_it_was():
    """Evaluation gathers the whole model onto a rank's device as a copy: the model, whose modules this rank's
    stage shares, stays on the host (moved, every other stage's weights stayed resident on the GPU and in the
    next epoch's peak memory), and its pieces keep their training mode."""
    from common.pipeline import evaluate_whole

    model = resnet18()
    pieces = split(model, [2, 2])
    seen = {}

    def evaluate(whole, loader, **kwargs):  # as common/train.py's evaluate: the model it is given in eval mode
        whole.eval()
        seen["device"] = next(whole.parameters()).device.type
        return {"acc": 1.0}

    assert evaluate_whole(model, pieces, torch.device("meta"), evaluate, None) == {"acc": 1.0}
    assert seen["device"] == "meta"  # the copy went to the device
    assert {p.device.type for p in model.parameters()} == {"cpu"} and model.training and pieces[0].training


@pytest.mark.parametrize("pieces, text, words", [
    (5, "", "has only 4 ResNet stages"), (2, "3,3", "summing to 4"), (2, "2,x", "as integers"),
])
def test_bad_splits(pieces, text, words):
    with pytest.raises(UsageError, match=words):
        plan(resnet18(), pieces, text)


def test_batchnorm_models_split_only_at_resnet_stages():
    """Other families are traced (their blocks: test_blocks), which would fix BatchNorm's mode."""
    model = build_model(TrainConfig(model="mobilenet_v3_small", pretrained=False, image_size=32))
    with pytest.raises(UsageError, match="has BatchNorm"):
        split(model, plan(model, 2), torch.zeros(2, 3, 32, 32))


def test_bubble_is_the_idle_share(monkeypatch):
    """Two lanes over a window of 300 ms in two segments (the paused time out): one busy 100 ms of it, the
    other 150; the column is the idler lane's idle share, 2/3."""
    from common.measure import bubble as bubble_mod
    from common.measure import steptime

    clock = FakeClock().install(monkeypatch, bubble_mod, steptime)
    lane, other = Lane(torch.device("cpu")), Lane(torch.device("cpu"))
    bubble = Bubble([lane, other], torch.device("cpu"))
    lane.timed(clock.sleep)(0.05)  # before the window: not counted
    bubble.start()
    lane.timed(clock.sleep)(0.1)
    other.timed(clock.sleep)(0.05)
    clock.sleep(0.05)  # idle
    bubble.pause()
    lane.timed(clock.sleep)(0.1)  # paused: not counted
    clock.sleep(0.3)
    bubble.resume()
    other.timed(clock.sleep)(0.1)
    bubble.stop()
    assert (lane.busy_s, other.busy_s, bubble.window_s) == pytest.approx((0.1, 0.15, 0.3), abs=1e-12)
    assert bubble.row()["pipeline_bubble_pct"] == pytest.approx(100 * (1 - 0.1 / 0.3), abs=0.005)


@pytest.mark.slow
def test_interleaved_pipeline_and_resume(tmp_path):
    """2 ranks x 2 stages (one ResNet stage each), then the same run resumed after its last epoch:
    every rank reloads its own stages, nothing is trained, the weights are unchanged."""
    args = tiny_args(tmp_path, schedule="interleaved-1f1b", microbatches=4)
    check_ok(run("pytorch_PP.py", args, nproc=2, launcher="torchrun"))
    first = load_bare(tmp_path / "ckpt" / "pytorch_PP" / "model_final.pt")
    check_ok(run("pytorch_PP.py", args + ["--resume", "auto"], nproc=2, launcher="torchrun"))
    a, b = rows(tmp_path / "summary.csv")
    assert a["strategy"] == b["strategy"] == "pp_interleaved_1f1b" and a["microbatches"] == "4"
    assert a["resumed"] == "False" and b["resumed"] == "True" and a["train_loss"] == b["train_loss"]
    assert int(b["test_samples"]) == 37 and a["test_accuracy"] == b["test_accuracy"]
    assert 0 <= float(a["pipeline_bubble_pct"]) <= 100
    again = load_bare(tmp_path / "ckpt" / "pytorch_PP" / "model_final.pt")
    assert all(torch.equal(first[k], again[k]) for k in first)


REFUSALS = [
    ("pytorch_PP.py", {"microbatches": 3}, "does not split into 3 micro-batches"),
    ("pytorch_PP.py", {"split": "1,1"}, "summing to 4"),
    ("pytorch_MP.py", {"model": "mobilenet_v3_small"}, "has BatchNorm: the traced split would fix"),
]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """REFUSALS' runs (PP alone: a pipeline of one) and 1F1B with too few micro-batches on 2 ranks, started
    together: {key: (its folder, its process)}."""
    root = tmp_path_factory.mktemp("refused")
    jobs = {i: (script, tiny_args(root / str(i), **extra)) for i, (script, extra, _) in enumerate(REFUSALS)}
    jobs["1f1b"] = ("pytorch_PP.py", tiny_args(root / "1f1b", schedule="1f1b", microbatches=1),
                    {"launcher": "torchrun", "nproc": 2})
    got = run_at_once(jobs)
    return {i: (root / str(i), proc) for i, proc in got.items()}


@pytest.mark.slow  # launches processes
@pytest.mark.parametrize("i", range(len(REFUSALS)), ids=[f"{s[:-3]}-{w}" for s, _, w in REFUSALS])
def test_refusals_are_one_line(refused, i):
    folder, proc = refused[i]
    assert REFUSALS[i][2] in one_line_error(proc)
    assert rows(folder / "summary.csv") == []


@pytest.mark.slow  # launches processes
def test_1f1b_needs_a_microbatch_per_stage(refused):
    folder, proc = refused["1f1b"]
    assert proc.returncode != 0 and "at least as many micro-batches as stages (2)" in proc.stderr
    assert rows(folder / "summary.csv") == []


def test_a_pipeline_uses_at_most_four_processes():
    from common.bench import matrix

    assert matrix.processes("pytorch_PP.py", 8) == 4 and matrix.processes("pytorch_PP.py", 2) == 2
    assert matrix.processes("pytorch_DDP.py", 8) == 8


def test_report_sets_the_bubble_beside_the_textbook(tmp_path):
    from common.report import textbook_bubble, write_report
    from common.results import append_row

    assert textbook_bubble("pp_gpipe", 2, 2, 4) == 20.0 and textbook_bubble("mp", 1, 2, float("nan")) == 50.0
    assert textbook_bubble("pp_interleaved_1f1b", 2, 2, 4) == 100 / 9 and textbook_bubble("ddp", 2, 2, 4) is None
    csv = str(tmp_path / "s.csv")
    common = dict(device_name="cpu", model="resnet18", image_size=32, dataset="synthetic", global_batch_size=16,
                  status="ok", world_size=2, num_devices=2, precision="fp32")
    append_row(csv, {**common, "script": "pytorch_PP.py", "strategy": "pp_1f1b", "microbatches": 4,
                     "pipeline_bubble_pct": 31.5})
    append_row(csv, {**common, "script": "pytorch_DDP.py", "strategy": "ddp"})
    report = open(write_report(csv, str(tmp_path / "R.md"))).read()
    assert "| pytorch_PP fp32 x2 | pp_1f1b | 2 | 4 | 31.5 | 20.0 |" in report and "| ddp | 2 | 4 |" not in report


def test_pipeline_bytes_of_resnet18():
    assert pp_bytes_per_step("resnet18", 32, 16) == 2 * 16 * 256 * 2 * 2 * 4  # layer3's output, fp32


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pytorch_PP-fp32", "pytorch_PP-fp32-1f1b"])
@pytest.mark.launches("{name}")
def test_a_pipeline_rank_has_exposed_communication_and_a_bubble(runs, name):
    """A pipeline rank's wait for its peer is exposed communication, and its idle share is measured. Whether
    the exposed time fits in the idle share compares the profiled steps with the window's, two stretches a
    busy host loads differently: that is a figure for the report, not an assertion here. The attribution it
    guarded (gloo records a send on the issuing thread, over the stage's next forwards, which once counted
    GPipe's forwards as exposed) is held exactly, on recorded events, by
    tests/test_time.py::test_a_pipelines_send_on_the_training_thread_leaves_its_compute_compute."""
    row = runs[0].row
    assert float(row["step_comm_exposed_ms"]) > 0 and 0 < float(row["pipeline_bubble_pct"]) < 100, row
