"""FLOPs per training image, the peak table, MFU and the step-time distribution (issue 14)."""
import pytest
import torch
import torchvision
from test_window import FakeClock

from common.measure import flops as flops_mod
from common.measure.energy import rapl_zones
from common.measure.flops import Flops, gpu_peak_tflops, train_flops_per_image
from common.measure.steptime import StepTimes


def published_train_gflop(model: str) -> float:
    """torchvision's published forward cost (its `_ops` are GMACs at 224 px) x 2 FLOP/MAC x 3
    (forward, input gradient, weight gradient)."""
    return torchvision.models.get_model_weights(model).DEFAULT.meta["_ops"] * 2 * 3


@pytest.mark.beside
@pytest.mark.slow  # ResNet50's FLOPs counted at 224 and 448 px: ~2 s
def test_resnet50_training_flops_match_the_published_count_and_scale_with_image_area():
    at_224 = train_flops_per_image("resnet50", 224) / 1e9
    assert at_224 == pytest.approx(published_train_gflop("resnet50"), rel=0.05)  # ~4.1 GMAC forward
    # 448 px keeps every stage's side even (at 112 the last stage rounds 3.5 up to 4)
    assert train_flops_per_image("resnet50", 448) / 1e9 / at_224 == pytest.approx(4.0, rel=0.01)


@pytest.mark.beside
@pytest.mark.slow  # MobileNet's FLOPs counted at 224 px: ~1.5 s
def test_depthwise_convolutions_are_counted_once_per_gradient():
    """torch's conv backward formula ignores groups: MobileNet would come out ~10x too high."""
    got = train_flops_per_image("mobilenet_v3_small", 224) / 1e9
    assert got == pytest.approx(published_train_gflop("mobilenet_v3_small"), rel=0.1)


def test_peak_table_is_keyed_by_exact_name_and_math():
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.5  # dense: half the sparse 1979
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert gpu_peak_tflops("Tesla V100-SXM2-32GB", "tf32") == 15.7  # no TF32 before Ampere: fp32 math
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "bf16") is None  # a slice is not the board
    assert gpu_peak_tflops("NVIDIA A100", "fp32") is None  # no prefix matching


# DataParallel: one process, every GPU; pytorch_MP.py on one GPU: both halves on cuda:0, one peak (counted twice,
# a one-GPU row once read twice the card's peak)
@pytest.mark.parametrize("name, gpus, peak", [("NVIDIA Imaginary 9000", [0], None),
                                              ("NVIDIA A100-SXM4-80GB", [0, 1], 624.0), ("NVIDIA H200", [0, 0], 989.5)])
def test_mfu_only_for_a_device_in_the_table(monkeypatch, name, gpus, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    devices = [torch.device("cuda", i) for i in gpus]
    row = Flops("resnet18", 32, "bf16", devices, torch.device("cpu"), throughput=lambda: 1000.0).row()
    assert row["achieved_tflops"] == pytest.approx(row["train_gflop_per_img"] * 1000.0 / 1000, rel=1e-3)
    assert row["peak_tflops"] == peak
    assert row["mfu"] == (None if peak is None else pytest.approx(row["achieved_tflops"] / peak, rel=1e-3))


def test_step_times_leave_paused_time_out(monkeypatch):
    from common.measure import steptime

    clock = FakeClock().install(monkeypatch, steptime)
    st = StepTimes(torch.device("cpu"))
    st.start()
    for s in (0.010, 0.020, 0.030):
        clock.sleep(s)
        st.step()
    st.pause()
    clock.sleep(0.3)  # epoch-end work
    st.resume()
    clock.sleep(0.040)
    st.step()
    st.stop()
    assert st.ms == pytest.approx([10.0, 20.0, 30.0, 40.0], abs=1e-9)
    assert st.row() == {"step_ms_p50": 25.0, "step_ms_p90": 37.0}  # numpy's linear percentiles of the four


def test_flop_count_leaves_the_rng_alone():
    before = torch.random.get_rng_state()
    flops_mod.cpu_gemm_tflops(budget_s=0.01)
    train_flops_per_image("resnet18", 32)
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.mark.slow
@pytest.mark.launches("pytorch_SingleGPU-fp32")
def test_cpu_row_has_mfu_step_times_and_energy_where_readable(runs):
    row = runs[0].row
    f = {k: float(row[k]) for k in ("train_gflop_per_img", "achieved_tflops", "peak_tflops", "mfu",
                                    "throughput_img_s", "step_ms_p50", "step_ms_p90")}
    assert f["train_gflop_per_img"] == pytest.approx(train_flops_per_image("resnet18", 32) / 1e9, rel=1e-3)
    assert f["achieved_tflops"] == pytest.approx(f["train_gflop_per_img"] * f["throughput_img_s"] / 1000, rel=1e-2)
    assert f["mfu"] > 0 and f["mfu"] == pytest.approx(f["achieved_tflops"] / f["peak_tflops"], rel=1e-2)
    # the peak is this host's GEMM probe, timed at another moment than the window: above 1 the row says why
    assert f["mfu"] <= 1 or "mfu above 1" in row["notes"], row["notes"]
    assert 0 < f["step_ms_p50"] <= f["step_ms_p90"]
    # 3 timed steps: the median step cannot be longer than the whole window
    assert f["step_ms_p50"] <= 3 * int(row["global_batch_size"]) / f["throughput_img_s"] * 1000
    if rapl_zones():
        assert float(row["energy_j"]) > 0 and float(row["img_per_j"]) > 0
    else:  # RAPL unreadable (root-only since Linux 5.10): empty, never 0
        assert row["energy_j"] == "" and row["img_per_j"] == ""


def test_cpu_peak_is_the_best_gemm_size(monkeypatch):
    """A clock where a 512 GEMM runs at 0.2 TFLOP/s and every other size at 0.1: the peak is 0.2, not
    whichever single size a one-size probe happened to pick (1024 at 2 threads, which gave an MFU of 1.27)."""
    now = [0.0]

    def mm(a, b):
        n = a.shape[0]
        now[0] += 2 * n ** 3 / ((0.2 if n == 512 else 0.1) * 1e12)

    monkeypatch.setattr(flops_mod.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(flops_mod.torch, "mm", mm)
    assert flops_mod.cpu_gemm_tflops(budget_s=10.0) == pytest.approx(0.2)


def test_cpu_peak_probe_starts_no_size_that_would_end_past_its_budget(monkeypatch):
    """Every launch pays for the probe: at 0.186 TFLOP/s (2 EPYC cores) a 2048 GEMM's 4 calls take 0.37 s,
    past the 0.2 s budget, and were started anyway (0.4-0.6 s a launch). At 3 TFLOP/s (a large CPU) they
    fit and run: the peak of big CPUs still needs the big sizes."""
    for rate, sizes in ((0.186, [256, 512, 1024]), (3.0, [256, 512, 1024, 2048])):
        now, seen = [0.0], []

        def mm(a, b, rate=rate):
            n = a.shape[0]
            seen.append(n)
            now[0] += 2 * n ** 3 / (rate * 1e12)

        monkeypatch.setattr(flops_mod.time, "perf_counter", lambda now=now: now[0])
        monkeypatch.setattr(flops_mod.torch, "mm", mm)
        assert flops_mod.cpu_gemm_tflops(budget_s=0.2) == pytest.approx(rate)
        assert sorted(set(seen)) == sizes, rate


def test_an_mfu_above_one_says_why():
    row = Flops.__new__(Flops)
    row.run_device, row.throughput, row.flops_per_img, row.peak = torch.device("cpu"), lambda: 100.0, 2e9, 0.1
    row.precision, row.reference_kernels = "fp32", False  # what __init__ sets for an fp32 run
    out = row.row()
    assert out["mfu"] == 2.0 and "Winograd" in out["notes"]
    row.peak = 1.0
    assert "notes" not in row.row()


def test_a_gpu_named_twice_counts_its_energy_once(monkeypatch):
    """pytorch_MP.py on one GPU passes cuda:0 for both halves: one NVML counter, not the same joules twice."""
    from common.measure import energy

    class Lib:
        class NVMLError(Exception):
            pass

        def nvmlDeviceGetTotalEnergyConsumption(self, h):  # mJ, 1 J more at each read
            self.reads = getattr(self, "reads", 0) + 1
            return 1000 * self.reads

    lib = Lib()
    monkeypatch.setattr(energy, "nvml_handle", lambda d: (lib, f"handle {d}"))
    counter = energy.Energy([torch.device("cuda", 0)] * 2, torch.device("cpu"), 32).counter
    counter.start()
    counter.poll()
    assert counter.handles == ["handle cuda:0"] and counter.joules == 1.0
