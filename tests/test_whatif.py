"""The what-if model for GPUs (`benchmark.py advise --gpu ... --interconnect ...`, issue 60): the check table
recomputed from the datasheet alone (no calibration file, but the transfer rows'), held to what
common/predict/whatif_checks.json stores (advise reads its class errors) and to each row's bound. A row that
misses its bound is an xfail whose reason gives its error, strict: a change that mends it turns it red until the
entry goes."""
import ast
import os

import pytest
from helpers import ROOT

from common.predict import whatif

# the rows the model misses, and why (docs/time.md, "How well it predicts")
KNOWN_MISSES = {
    "a100_tf32_1": "+14.3% (bound 10%): the A100's TF32 step is 1.93x the H100's where SMs x clock and HBM give "
                   "1.6x; NVIDIA's 21.03 container (cuDNN 8.1) is not the H100 rows' cuDNN 9.19",
    "a100_tf32_8": "+16.7% (bound 10%): the one-GPU TF32 miss, scaled by 98.6% predicted (96.6% published)",
    "a100_amp_scaling": "97.1% against 84.1% (bound 5 points): NCCL's all-reduce of 102 MB over NVLink takes "
                        "0.9 ms of a 112 ms step; the 19.6 ms NVIDIA's 8 GPUs lose is nothing the model prices "
                        "(likely their input pipeline at 16,600 img/s)",
    "p40_dp": "-27.8% (bound 20%): DataParallel's 93 ms a step over DDP on the articles' P40s against 22 ms "
              "predicted: their PCIe topology and host (pageable copies, cross-socket paths) are not known",
}
ORDER_MISS = ("FSDP predicted 0.1% faster than DDP (the articles: 3.8% slower): FSDP's sharded optimizer step saves "
              "more than its collectives cost on the SMs; the articles ran FSDP1, whose host work is not modelled")


def _param(row):
    if row["id"] in KNOWN_MISSES:
        return pytest.param(row["id"], marks=pytest.mark.xfail(reason=KNOWN_MISSES[row["id"]], strict=True))
    return row["id"]


@pytest.fixture(scope="module")
def table():
    return whatif.table()


def _print(rows) -> None:
    print("\n| check | class | predicted | target | error | bound | within | rests on |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        err = f"{r['error']:+.1f} pt" if r["unit"] == "%" else f"{r['error']:+.1%}"
        bound = f"{r['bound']:g} pt" if r["unit"] == "%" else f"{r['bound']:.0%}"
        fitted = "fitted, not a prediction" if r["fitted"] else ("yes" if r["within"] else "MISS")
        print(f"| {r['id']} ({r['what']}) | {r['class']} | {r['predicted']:g} {r['unit']} | {r['target']:g} | {err} "
              f"| {bound} | {fitted} | {'; '.join(r['constants'])} |")


def test_the_check_table_is_what_advise_reads(table, capsys):
    with capsys.disabled():
        _print(table)
    stored = whatif.stored()
    assert [r["id"] for r in stored["rows"]] == [r["id"] for r in table]
    for got, was in zip(table, stored["rows"]):
        assert got["predicted"] == pytest.approx(was["predicted"], rel=2e-3), got["id"]
        assert (got["within"], got["fitted"], got["target"]) == (was["within"], was["fitted"], was["target"])
    assert stored["class_errors"] == pytest.approx(whatif.class_errors(table), abs=2e-3)
    assert stored["order_kept"] == whatif.order_kept(table)


@pytest.mark.parametrize("row_id", [_param(r) for r in whatif.rows()])
def test_each_check_is_within_its_bound(table, row_id):
    row = next(r for r in table if r["id"] == row_id)
    assert abs(row["error"]) <= row["bound"], f"{row_id}: {row['predicted']} against {row['target']}"


@pytest.mark.xfail(reason=ORDER_MISS, strict=True)
def test_the_articles_runs_keep_their_order(table):
    assert whatif.order_kept(table)


def test_only_the_rows_the_rates_were_solved_from_are_fitted(table):
    fitted = {r["id"] for r in table if r["fitted"]}
    assert fitted == {"h100_fp32", "h100_tf32", "h100_amp_bf16", "h100_amp_bf16_cl"}
    assert all(r["constants"] for r in table)
    for r in table:  # a row that is a prediction names no constant taken from itself
        assert r["fitted"] or not any(f"({r['id'].replace('h100_', 'H100 ')} row)" in c for c in r["constants"])
    # advise's trust column never quotes a fitted row
    assert set(whatif.class_errors(table)) == {"1 GPU", "8 GPUs NVLink", "4 GPUs PCIe", "1 GPU, calibrated"}


def test_every_datasheet_gpu_has_its_bandwidth_and_sms():
    from common.measure.flops import PEAK_TFLOPS
    from common.predict.datasheet import SPECS
    from common.predict.timespec import GPU_MEMORY_GIB

    assert set(PEAK_TFLOPS) == set(SPECS) == set(GPU_MEMORY_GIB)


def test_small_batches_become_launch_bound():
    """Below the batch where the GPU outruns the host, compute is the host's launches; above it the roofline."""
    from common.predict import roofline

    s = roofline.spec(whatif.H100, "bf16")
    host = roofline.launches("resnet50", 224, s) * roofline.host_us() / 1e3
    assert sum(roofline.compute_ms("resnet50", 224, whatif.H100, s, 4)) == pytest.approx(host)
    assert sum(roofline.compute_ms("resnet50", 224, whatif.H100, s, 128)) > 2 * host


def test_precision_as_run():
    """fp32 is strict unless --tf32; the P40 keeps half storage with fp32 math; NCHW half pays its own rate."""
    from common.predict import roofline

    h100, p40 = whatif.H100, whatif.P40
    assert roofline.spec(h100, "fp32").math == "fp32" and roofline.spec(h100, "fp32", tf32=True).math == "tf32"
    assert roofline.spec(p40, "fp32", tf32=True).math == "fp32" and roofline.spec(p40, "fp16").math == "fp32"
    assert roofline.spec(p40, "fp16").act == 2
    one = [sum(roofline.compute_ms("resnet50", 224, h100, roofline.spec(h100, "bf16", channels_last=cl), 128))
           for cl in (False, True)]
    assert one[0] > 1.5 * one[1]


def test_the_articles_epochs_are_priced_as_their_loaders_ran():
    """Their training loaders drop the last partial batch (390 steps of 128 an epoch, not 391); advise's default
    keeps it; the test set is split over DDP's ranks at their 32 a step (79 steps), DataParallel's runs 128 a
    step on one process (79 steps)."""
    from common.predict.memory import Setup
    from common.predict.timespec import epoch_s

    ddp = Setup(batch_size=128, world_size=4, strategy="ddp")
    assert epoch_s(1000.0, 1000.0, ddp, 50_000, 10_000, drop_last=True) == (390.0, 79.0)
    assert epoch_s(1000.0, 1000.0, ddp, 50_000, 10_000) == (391.0, 79.0)
    dp = Setup(batch_size=128, world_size=4, strategy="dp")
    assert epoch_s(1000.0, 1000.0, dp, 50_000, 10_000, drop_last=True) == (390.0, 79.0)


def test_the_cpu_path_ignores_what_gpus_add():
    """overlap=False (a CPU) returns what it returned before: the SMs' share and DataParallel's GPU terms are
    read only with overlap=True."""
    from dataclasses import replace

    from common.predict.memory import Setup
    from common.predict.timemodel import Compute, Link, predict_step

    c = Compute(10.0, 20.0, 1.0)
    gpu_c = replace(c, launch_fwd_ms=50.0, scatter_bytes=1e9)
    link = Link({"all_reduce": 1.0}, {"all_reduce": 20.0})
    for st in ("ddp", "dp", "fsdp_full-shard", "deepspeed_zero2"):
        s = Setup(model="resnet18", image_size=32, batch_size=32, world_size=2, strategy=st)
        cpu = predict_step(s, c, link, False)
        assert predict_step(s, gpu_c, replace(link, sm_share=0.5), False).parts() == cpu.parts()
        gpu = predict_step(s, c, replace(link, sm_share=0.5), True)
        assert gpu.compute_ms >= predict_step(s, c, link, True).compute_ms
    dp = Setup(model="resnet18", image_size=32, batch_size=32, world_size=2, strategy="dp")
    assert predict_step(dp, gpu_c, link, True).comm_exposed_ms > predict_step(dp, c, link, True).comm_exposed_ms + 40


def test_nodes_joined_by_infiniband_reduce_hierarchically():
    from common.predict.links import link

    one, ib = link("nvlink4"), link("ib400")
    two = link("nvlink4", gpus_per_node=8, inter="ib400")
    s = 100e6
    assert two.ms("all_reduce", s, 8) == one.ms("all_reduce", s, 8)
    assert two.ms("all_reduce", s, 16) == pytest.approx(one.ms("reduce_scatter", s, 8) + ib.ms("all_reduce", s / 8, 2)
                                                        + one.ms("all_gather", s, 8))
    assert two.ms("all_reduce", s, 16) > one.ms("all_reduce", s, 16)


def test_advise_takes_the_precision_and_says_how_far_to_trust_it(capsys):
    import benchmark

    code = benchmark.main(["advise", "--model", "resnet50", "--batch-size", "128", "--gpus", "1",
                           "--gpu", whatif.H100, "--precision", "tf32"])
    out = capsys.readouterr().out
    assert code == 0 and "checked error" in out
    single = next(ln for ln in out[out.index("predicted time"):].splitlines() if ln.startswith("single "))
    assert float(single.split()[6]) == pytest.approx(whatif.single_img_s(whatif.H100, "tf32"), rel=2e-3)
    assert f"({whatif.stored()['class_errors']['1 GPU']:.0%}" not in single and "(1 GPU)" in single
    assert benchmark.main(["advise", "--gpus", "1", "--gpu", whatif.H100, "--precision", "fp64"]) == 2
    assert "--precision must be fp32, tf32, fp16 or bf16" in capsys.readouterr().err


def test_advise_carries_a_calibration_to_another_gpu(capsys):
    import benchmark

    code = benchmark.main(["advise", "--model", "resnet50", "--batch-size", "128", "--gpus", "1", "--gpu",
                           whatif.H200, "--precision", "tf32", "--calibration", os.path.join(ROOT,
                                                                                            whatif.H100_CALIBRATION)])
    out = capsys.readouterr().out
    single = next(ln for ln in out[out.index("predicted time"):].splitlines() if ln.startswith("single "))
    assert code == 0 and "(1 GPU, calibrated)" in single
    assert float(single.split()[6]) == pytest.approx(whatif.transferred_img_s("tf32"), rel=2e-3)


def test_advise_prices_fsdp_and_deepspeed_in_nchw_under_channels_last(capsys):
    """Their scripts refuse --channels-last (FSDP2 and DeepSpeed take no channels-last weight): advise prices them as
    they can run, in NCHW, and says so; DDP keeps channels-last, which halves a half-precision step's compute at
    256 images a GPU (at 32 the launch floor hides the layout)."""
    import benchmark

    args = ["advise", "--model", "resnet18", "--batch-size", "2048", "--gpus", "8", "--gpu", whatif.H100,
            "--interconnect", "nvlink4", "--precision", "bf16", "--channels-last"]
    assert benchmark.main(args) == 0
    out = capsys.readouterr().out
    table = out[out.index("predicted time"):].splitlines()
    compute = {ln.split()[0]: float(ln.split()[2]) for ln in table if ln.split()[0] in ("ddp", "fsdp_full-shard",
                                                                                       "deepspeed_zero2")}
    assert compute["fsdp_full-shard"] > 1.5 * compute["ddp"] and compute["deepspeed_zero2"] > 1.5 * compute["ddp"]
    said = next(ln for ln in out.splitlines() if ln.startswith("in NCHW, as their scripts run"))
    assert "fsdp_full-shard" in said and "deepspeed_zero3" in said and "ddp" not in said.split(": ")[-1].split(", ")


NEW_MODULES = ("predict/roofline.py", "predict/links.py", "predict/datasheet.py", "predict/timespec.py",
               "predict/whatif.py", "bench/advise_time.py")


@pytest.mark.parametrize("path", NEW_MODULES)
def test_the_what_if_modules_keep_their_functions_short(path):
    tree = ast.parse(open(os.path.join(ROOT, "common", path)).read())
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long
