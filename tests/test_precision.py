"""common/precision.py's CPU guards. The oneDNN bf16 check: which convolutions it flags, that it refuses
only where the bad kernel runs, and that what it lets through computes the right weight gradients. The
allocator: a CPU run keeps the memory its steps free (steady_host_allocator)."""
import platform
import resource
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, check_ok, one_line_error, rows, run, tiny_args

from common import precision
from common.config import TrainConfig, UsageError
from common.precision import check_cpu_bf16_convolutions, onednn_bf16_kernels, strided_past_input


def test_the_convolutions_flagged_are_those_whose_input_is_smaller_than_their_stride():
    assert strided_past_input("resnet18", 16) == ["layer4.0.conv1"]  # 3x3 stride 2 on a 1x1 map
    assert strided_past_input("resnet50", 16) == ["layer4.0.conv2"]  # the bottleneck strides in its 3x3
    assert strided_past_input("resnet18", 24) == [] == strided_past_input("resnet18", 32)  # 2x2 maps: fine


@pytest.mark.parametrize("kernels, prec, size, refused", [
    (True, "bf16", 16, True), (True, "bf16", 32, False), (True, "fp32", 16, False), (True, "fp16", 16, False),
    (False, "bf16", 16, False),  # the reference kernels are right (and what ONEDNN_MAX_CPU_ISA=AVX2 gives)
])
def test_refused_only_where_the_bad_kernel_would_run(monkeypatch, kernels, prec, size, refused):
    monkeypatch.setattr(precision, "onednn_bf16_kernels", lambda: kernels)
    cfg = TrainConfig(model="resnet18", image_size=size)
    if refused:
        with pytest.raises(UsageError, match=r"layer4\.0\.conv1 .*ONEDNN_MAX_CPU_ISA=AVX2"):
            check_cpu_bf16_convolutions(cfg, prec, torch.device("cpu"))
    else:
        check_cpu_bf16_convolutions(cfg, prec, torch.device("cpu"))
    check_cpu_bf16_convolutions(cfg, prec, torch.device("meta"))  # not a CPU: never refused here


@pytest.mark.parametrize("size, stride", [(2, 2), (4, 2), (3, 3), (1, 1)])
def test_the_shapes_let_through_give_right_bf16_weight_gradients(size, stride):
    """Input at least the stride: bf16 weight gradients agree with fp32 ones on the same bf16 values,
    five times over (the bad shapes gave 1e34 or inf in some repetitions and not others)."""
    torch.manual_seed(0)
    for _ in range(5):
        x = torch.randn(4, 64, size, size).bfloat16()
        w = (torch.randn(128, 64, 3, 3) * 0.05).bfloat16().requires_grad_()
        out = F.conv2d(x, w, stride=stride, padding=1)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        w32 = w.detach().float().requires_grad_()
        F.conv2d(x.float(), w32, stride=stride, padding=1).backward(grad_out.float())
        assert torch.isfinite(w.grad).all()
        assert (w.grad.float() - w32.grad).abs().max() <= 0.02 * w32.grad.abs().max()


@pytest.mark.beside
@pytest.mark.slow
@pytest.mark.skipif(not onednn_bf16_kernels(), reason="this CPU runs the reference bf16 kernels: nothing to refuse")
def test_a_script_refuses_the_bad_shape_in_one_line(tmp_path):
    proc = run("pytorch_auto_mixed_precision.py", tiny_args(tmp_path, precision="bf16", image_size=16))
    assert "oneDNN bf16 kernels return garbage weight gradients" in one_line_error(proc)
    assert rows(tmp_path / "summary.csv") == []
    # the same flags on the reference kernels (1.6 s a step here): accepted; 2 steps of 8
    check_ok(run("pytorch_auto_mixed_precision.py", tiny_args(tmp_path, precision="bf16", image_size=16, batch_size=8,
                                                              train_samples=16, test_samples=8),
                 env={"ONEDNN_MAX_CPU_ISA": "AVX2"}))


# 4 x 30 MiB allocated, written and freed: whatever glibc's adaptive thresholds made of the imports (the mmap
# threshold at most 32 MiB, the trim threshold twice it), at least one chunk goes back to the OS (unmapped, or
# trimmed off the top of the heap) and the next cycle faults its pages in again (1 to 4 chunks' worth, from
# one process to the next); with the thresholds fixed the memory stays. A 40 MiB chunk, above glibc's ceiling for
# the mmap threshold, is unmapped at every free whatever the thresholds, unless mmap is off (M_MMAP_MAX 0)
CYCLES = """
import resource, sys, types
import torch
from common.precision import configure_backends

def faults_per_cycle():
    def cycle():
        xs = [torch.ones(30 << 18) for _ in range(4)] + [torch.ones(40 << 18)]
        del xs
    cycle()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        cycle()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5

adaptive = faults_per_cycle()
configure_backends(types.SimpleNamespace(seed=0), torch.device(sys.argv[1]))
faults_per_cycle()  # the heap grows to hold a cycle: a few cycles where little was imported (no torchvision)
print(adaptive, faults_per_cycle())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt (musl's is a stub; none off Linux)")
@pytest.mark.slow
@pytest.mark.beside
def test_a_cpu_run_keeps_the_memory_its_steps_free():
    """configure_backends on a CPU fixes glibc's thresholds (steady_host_allocator): a step's activations
    are not faulted in again every step, in some processes and not others
    (results/campaigns/2026-11-25_epyc_grids_c/notes.md)."""
    pages = (4 * 30 + 40 << 20) // resource.getpagesize()
    out = subprocess.run([sys.executable, "-c", CYCLES, "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    adaptive, steady = map(float, out.stdout.split())
    assert adaptive > 0.2 * pages, (adaptive, pages)  # the test sees the fault it guards against
    assert steady < 0.02 * pages, (steady, pages)


@pytest.mark.parametrize("native", [True, False])
def test_a_half_row_says_when_it_ran_reference_kernels(monkeypatch, native):
    """Where this CPU has no native oneDNN kernels for the run's half precision, the row's notes say so (the
    report names such runs: common/report.py _reference_kernels); fp32 rows never carry it."""
    from common.measure import flops

    monkeypatch.setattr(flops, "native_half_kernels", lambda p: native or p == "fp32")
    monkeypatch.setattr(flops, "cpu_gemm_tflops", lambda *a, **k: 1.0)
    monkeypatch.setattr(flops, "train_flops_per_image", lambda *a: 1e9)
    cpu = torch.device("cpu")
    for prec in ("bf16", "fp16", "fp32"):
        notes = flops.Flops("resnet18", 32, prec, [cpu], cpu, throughput=lambda: 1.0).row().get("notes") or ""
        assert (flops.REFERENCE_KERNELS in notes) == (not native and prec != "fp32"), (prec, notes)
        assert not notes or notes.startswith(f"{prec} ran torch's reference kernels")


class _Scaler:
    """A GradScaler's face as ScaledStep sees it, with the overflow flags of each step given."""

    def __init__(self, flags):
        self.flags = flags

    def scale(self, loss):
        return loss

    def step(self, optimizer):
        pass

    def update(self):
        pass

    def is_enabled(self):
        return True

    def _found_inf_per_device(self, optimizer):
        return {f"device{i}": torch.tensor(f) for i, f in enumerate(self.flags)}


@pytest.mark.parametrize("flags, skipped", [
    ([0.0], 0), ([1.0], 1),
    ([2.0], 1),  # ShardedGradScaler at 2 ranks, both overflowed: its all-reduce sums the flags
    ([0.0, 1.0], 1),  # a model over two devices, one device's gradients overflowed
    ([1.0, 1.0], 1),
])
def test_a_skipped_step_counts_once_whatever_found_it(flags, skipped):
    optimizer, scheduler = SimpleNamespace(zero_grad=lambda set_to_none: None), SimpleNamespace(step=lambda: None)
    step = precision.ScaledStep(SimpleNamespace(clip_grad_norm=0), None, optimizer, scheduler, _Scaler(flags))
    for _ in range(3):
        step.step()
    assert step.skipped_steps() == 3 * skipped
