"""Repeated launches and their statistics: the stats functions on known data, the report's repeats
table, the regression gate (benchmark.py compare), and --repeats end to end."""
import csv
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, rows

import benchmark
from common.bench.matrix import done_rows, rounds
from common.predict import stats
from common.report import write_report
from common.results import append_row

# --- the functions, on data whose answers are known ---


def test_median_iqr_and_the_noise_flag():
    assert stats.median([5, 1, 100, 3, 4]) == 4  # one outlier does not move it
    assert stats.median([1, 2, 3, 4]) == 2.5
    assert stats.iqr([1, 2, 3, 4, 5]) == 2.0  # quartiles 2 and 4
    assert stats.iqr([7.0]) == 0.0
    assert not stats.noisy([100, 101, 102, 103, 104])  # IQR 2 = 2% of 102
    assert stats.noisy([90, 100, 110])  # IQR 10 = 10% of 100
    s = stats.summarize([3.0, 1.0, 2.0])
    assert (s.n, s.median, s.min, s.max) == (3, 2.0, 1.0, 3.0)


def test_bootstrap_interval_of_the_median():
    assert stats.median_ci([4.0] * 5) == (4.0, 4.0)  # no spread, no uncertainty
    xs = [98.0, 99.0, 100.0, 101.0, 102.0, 100.5, 99.5]
    lo, hi = stats.median_ci(xs)
    assert min(xs) <= lo < stats.median(xs) < hi <= max(xs)
    many = known_spread(100.0, n=40)
    # fixed seed: the same report twice, though another seed draws other resamples
    assert stats.median_ci(many) == stats.median_ci(many) != stats.median_ci(many, seed=1)
    wide = stats.median_ci([x * 10 - 900 for x in xs])  # ten times the spread, ten times the interval
    assert wide[1] - wide[0] == pytest.approx(10 * (hi - lo))


def known_spread(centre, n=10, cv=0.05, seed=1):
    """n launches around `centre` with a 5% coefficient of variation."""
    return list(centre * (1 + cv * np.random.default_rng(seed).standard_normal(n)))


def test_a_difference_inside_the_noise_is_the_same():
    base, new = known_spread(100.0, seed=1), known_spread(101.0, seed=2)  # 1% apart, 5% noise
    ratio, lo, hi = stats.ratio_ci(base, new)
    assert lo < 1 < hi and stats.verdict(lo, hi) == "same within noise"
    _, lo, hi = stats.ratio_ci(base, known_spread(75.0, seed=2))  # 25% slower: far outside the noise
    assert hi < 1 and stats.verdict(lo, hi) == "slower"
    _, lo, hi = stats.ratio_ci(base, known_spread(130.0, seed=2))
    assert lo > 1 and stats.verdict(lo, hi) == "faster"
    assert stats.ratio_ci(base, base)[0] == 1.0


# --- the report and the gate, on result files written here ---


def write_results(path, speeds: dict, device="GPU X", factor=1.0):
    """One ok row per launch: {run name: [throughput of launch 1, 2, ...]}."""
    for i in range(max(len(v) for v in speeds.values())):
        for name, values in speeds.items():
            if i < len(values):
                append_row(str(path), {"script": "pytorch_DDP.py", "precision": "fp32", "status": "ok",
                                       "device_name": device, "model": "resnet50", "image_size": 224,
                                       "run_name": name, "repeat": i + 1 if len(values) > 1 else None,
                                       "throughput_img_s": values[i] * factor, "train_time_s": 1000 / values[i]})


SPEEDS = {"t/ddp": [100.0, 102.0, 98.0, 101.0, 99.0], "t/fsdp": [80.0, 95.0, 70.0], "t/single": [50.0]}


def test_report_shows_median_spread_ci_and_flag_for_repeated_runs_only(tmp_path):
    write_results(tmp_path / "s.csv", SPEEDS)
    append_row(str(tmp_path / "s.csv"), {"script": "pytorch_DDP.py", "status": "failed", "device_name": "GPU X",
                                         "model": "resnet50", "image_size": 224, "run_name": "t/ddp", "repeat": 2,
                                         "throughput_img_s": 1.0})
    write_report(str(tmp_path / "s.csv"), str(tmp_path / "R.md"))
    lines = (tmp_path / "R.md").read_text().splitlines()
    # a --force rerun of launch 2 that failed leaves launch 2's ok figure in place
    ddp = next(ln for ln in lines if ln.startswith("| t/ddp | 5 |"))
    assert "| 100.0 | 2.0 | 98.0–102.0 |" in ddp and ddp.endswith("| 2.0% | – |  |")  # no host columns: –
    lo, hi = stats.median_ci(SPEEDS["t/ddp"])
    assert f"{lo:.1f}–{hi:.1f}" in ddp
    fsdp = next(ln for ln in lines if ln.startswith("| t/fsdp | 3 |"))
    assert fsdp.endswith("| noisy |")  # IQR 12.5 = 16% of 80
    assert not any(ln.startswith("| t/single | 1 |") for ln in lines)  # one launch: the usual table only


def test_single_launch_report_has_no_repeats_table(tmp_path):
    write_results(tmp_path / "s.csv", {"t/a": [10.0], "t/b": [20.0]})
    write_report(str(tmp_path / "s.csv"), str(tmp_path / "R.md"))
    assert "Repeated launches" not in (tmp_path / "R.md").read_text()


def test_compare_a_file_with_itself_is_the_same(tmp_path, capsys):
    write_results(tmp_path / "a.csv", SPEEDS)
    assert benchmark.main(["compare", str(tmp_path / "a.csv"), str(tmp_path / "a.csv")]) == 0
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| t/")]
    assert len(table) == 3 and all("| 1.000 |" in ln and ln.endswith("| same within noise |") for ln in table)


def test_compare_against_halved_throughput_fails_the_gate(tmp_path, capsys):
    write_results(tmp_path / "base.csv", SPEEDS)
    write_results(tmp_path / "new.csv", SPEEDS, factor=0.5)
    assert benchmark.main(["compare", str(tmp_path / "base.csv"), str(tmp_path / "new.csv")]) == 1
    out = capsys.readouterr().out
    assert out.count("slower (by more than 5%: gate fails)") == 3 and "| 0.500 |" in out and "FAIL" in out
    # the other way round it is faster, and a threshold above the drop lets it through
    assert benchmark.main(["compare", str(tmp_path / "new.csv"), str(tmp_path / "base.csv")]) == 0
    assert capsys.readouterr().out.count("| faster |") == 3
    assert benchmark.main(["compare", str(tmp_path / "base.csv"), str(tmp_path / "new.csv"),
                           "--threshold", "0.6"]) == 0


def test_compare_inside_the_noise_passes(tmp_path, capsys):
    write_results(tmp_path / "base.csv", {"t/ddp": known_spread(100.0, seed=1)})
    write_results(tmp_path / "new.csv", {"t/ddp": known_spread(98.0, seed=2)})  # 2% slower, 5% noise
    assert benchmark.main(["compare", str(tmp_path / "base.csv"), str(tmp_path / "new.csv")]) == 0
    assert "same within noise" in capsys.readouterr().out


def test_compare_matches_runs_by_name_and_device(tmp_path, capsys):
    write_results(tmp_path / "a.csv", {"t/ddp": [100.0]}, device="GPU X")
    write_results(tmp_path / "b.csv", {"t/ddp": [50.0]}, device="GPU Y")
    assert benchmark.main(["compare", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")]) == 2
    assert "no run with an ok throughput in both" in capsys.readouterr().err


def test_compare_bad_input_one_line(tmp_path, capsys):
    write_results(tmp_path / "a.csv", SPEEDS)
    (tmp_path / "foreign.csv").write_text("a,b\n1,2\n")
    (tmp_path / "cut.csv").write_bytes((tmp_path / "a.csv").read_bytes()[:-5])
    cases = [(tmp_path / "missing.csv", "results file not found"), (tmp_path / "foreign.csv", "has another header"),
             (tmp_path / "cut.csv", "ends in a cut-off line"), (tmp_path, "results file not found")]
    for path, words in cases:
        assert benchmark.main(["compare", str(tmp_path / "a.csv"), str(path)]) == 2
        out = capsys.readouterr()
        assert out.err.startswith("benchmark.py: error: ") and words in out.err and out.err.count("\n") == 1
        assert out.out == ""  # no half-written table
    assert benchmark.main(["compare", str(tmp_path / "a.csv"), str(tmp_path / "a.csv"), "--threshold", "1.5"]) == 2
    assert "--threshold must be a fraction" in capsys.readouterr().err


def test_rounds_interleave_the_runs():
    runs = [{"name": "a", "args": {}, "gpu_only": False}, {"name": "b", "args": {}, "gpu_only": True}]
    order = [(r["name"], r["args"]["repeat"]) for r in rounds(runs, 3, gpus=1)]
    assert order == [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 3), ("b", 3)]
    # without GPUs the GPU-only run is recorded as skipped once, not three times
    order = [(r["name"], r["args"]["repeat"]) for r in rounds(runs, 3, gpus=0)]
    assert order == [("a", 1), ("b", 1), ("a", 2), ("a", 3)]


def test_a_launch_is_done_only_when_its_own_repeat_is_in_the_csv(tmp_path):
    path = str(tmp_path / "s.csv")
    for repeat in (None, 3):  # a row from before --repeats counts as the first launch
        append_row(path, {"script": "pytorch_SingleGPU.py", "status": "ok", "run_name": "t/a", "device_name": "X",
                          "repeat": repeat})
    found = {r: len(done_rows(path, {"name": "t/a", "args": {"repeat": r}}, "X")) for r in (1, 2, 3)}
    assert found == {1: 1, 2: 0, 3: 1}
    assert done_rows(path, {"name": "t/a", "args": {"repeat": 1}}, "Y") == []  # another device


@pytest.mark.beside
@pytest.mark.slow
def test_repeats_end_to_end_and_resume(tmp_path):
    """--repeats 3 writes launches 1, 2, 3 and the report's statistics; with a launch lost, running
    the same command again launches that one only. The smoke preset, cut to 4 steps here."""
    matrix = tmp_path / "m.yaml"
    matrix.write_text("""presets:
  smoke:
    timeout_s: 300
    args: {dataset: synthetic, pretrained: false, model: resnet18, image_size: 32, epochs: 1, batch_size: 16,
           train_samples: 64, test_samples: 20, workers: 0, log_every: 0, timing_warmup_steps: 1,
           loader_probe_batches: 0, epoch_checkpoints: false, save_dir: "%s"}
    scripts: all
""" % (tmp_path / "ckpt"))
    csv_path, report = tmp_path / "summary.csv", tmp_path / "REPORT.md"

    def bench(*extra):
        proc = subprocess.run([sys.executable, "benchmark.py", "--preset", "smoke", "--only", "pytorch_SingleGPU.py",
                               "--repeats", "3", "--matrix", str(matrix), "--results", str(csv_path), "--report",
                               str(report), "--log-dir", str(tmp_path / "logs"), *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    bench()
    got = rows(csv_path)
    assert [(r["run_name"], r["repeat"], r["status"]) for r in got] == [("smoke/pytorch_SingleGPU", str(i), "ok")
                                                                       for i in (1, 2, 3)]
    line = next(ln for ln in report.read_text().splitlines() if ln.startswith("| smoke/pytorch_SingleGPU | 3 |"))
    speeds = [float(r["throughput_img_s"]) for r in got]
    lo, hi = stats.median_ci(speeds)
    assert f"| {stats.median(speeds):.1f} |" in line and f"{min(speeds):.1f}–{max(speeds):.1f}" in line
    assert f"{lo:.1f}–{hi:.1f}" in line
    # launch 2 lost (an interrupted matrix): only it runs again
    with open(csv_path, newline="") as fh:
        kept = [r for r in csv.DictReader(fh) if r["repeat"] != "2"]
    with open(csv_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(kept[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(kept)
    out = bench()
    assert out.count("already in") == 2 and "repeat 2/3 (python x1)" in out
    assert sorted(r["repeat"] for r in rows(csv_path)) == ["1", "2", "3"]
