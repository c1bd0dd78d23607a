"""results/REPORT.md from results/summary.csv: the articles' tables, ratios, their figures beside ours, charts.

One section per (device, model, image size, dataset, global batch): only rows measured under the same
conditions are compared. Ratios are against pytorch_SingleGPU.py fp32 (no TF32) in the same section.
"""
from __future__ import annotations

import math
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .config import PROJECT_ROOT, UsageError  # noqa: E402
from .measure.host import BUSY_PCT, describe, is_busy  # noqa: E402
from .predict.stats import NOISY_IQR, median, summarize  # noqa: E402
from .results import COLUMNS, read_rows  # noqa: E402

NUMERIC = ["world_size", "image_size", "global_batch_size", "epochs", "steps", "train_time_s", "throughput_img_s",
           "peak_allocated_gib", "peak_reserved_gib", "peak_nvml_gib", "gpu_util_mean", "gpu_util_peak",
           "train_loss", "test_accuracy", "test_samples", "num_devices", "microbatches", "pipeline_bubble_pct",
           "model_state_gib", "pred_model_state_gib", "pred_activation_gib", "pred_peak_gib", "pred_error_pct",
           "comm_bytes_per_step", "comm_calls_per_step", "comm_ms_per_step", "busbw_gbps", "comm_overlap_pct",
           "step_ms_p50", "step_ms_mean", "step_data_ms", "step_compute_ms", "step_comm_exposed_ms",
           "step_optimizer_ms", "step_other_ms", "pred_step_ms", "pred_img_s", "pred_time_error_pct",
           "pred_data_ms", "pred_compute_ms", "pred_comm_exposed_ms", "pred_optimizer_ms",
           "host_other_pct", "host_steal_pct", "cpu_wait_pct"]
SECTION = ["device_name", "model", "image_size", "dataset", "global_batch_size"]


def _fmt(v, digits=2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)) or v == "":
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:60]


def _table(headers: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]
    return out


def load(results_csv: str) -> pd.DataFrame:
    rows = read_rows(results_csv)
    df = pd.DataFrame(rows, columns=COLUMNS)
    for c in NUMERIC:
        df[c] = pd.to_numeric(df[c], errors="coerce")
    df["label"] = df.apply(lambda r: r["run_name"] or f"{r['script'][:-3]} {r['precision']} x{_fmt(r['world_size'])}",
                           axis=1)
    return df


def _baseline(section: pd.DataFrame):
    ok = section[(section.script == "pytorch_SingleGPU.py") & (section.status == "ok")
                 & (section.precision == "fp32") & (section.tf32.astype(str) != "True")]
    return ok.iloc[-1] if len(ok) else None


def _charts(section: pd.DataFrame, out_dir: str, slug: str) -> list[str]:
    ok = section[section.status == "ok"]
    if ok.empty:
        return []
    paths = []
    for col, title, unit in [("throughput_img_s", "Training throughput", "images / s"),
                             ("peak_allocated_gib", "Peak GPU memory allocated (max over ranks)", "GiB"),
                             ("test_accuracy", "Test accuracy", "top-1")]:
        data = ok[["label", col]].dropna()
        if data.empty:
            continue
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(data) + 1.4))
        ax.barh(data["label"], data[col], color="#4C72B0")
        for y, v in enumerate(data[col]):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
        ax.set_xlim(0, 1.12 * max(data[col].max(), 1e-9))  # room for the longest bar's value label
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.set_title(title, fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{slug}_{col}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def replace_block(text: str, name: str, content: str) -> str:
    """Replaces what stands between <!-- name:start --> and <!-- name:end --> in text."""
    pattern = re.compile(rf"(<!-- {name}:start -->).*?(<!-- {name}:end -->)", re.S)
    if not pattern.search(text):
        raise UsageError(f"no <!-- {name}:start/end --> markers: not this project's README")
    return pattern.sub(lambda m: m.group(1) + "\n" + content.strip() + "\n" + m.group(2), text)


REFERENCE_SOURCE = "seed 000/001"  # results/reference.csv rows of the reference experiment (seeds README)
REFERENCE_SETUP = {"model": "resnet50", "image_size": 224.0, "global_batch_size": 128.0}
CAMPAIGNS = os.path.join(PROJECT_ROOT, "results", "campaigns")
# results/sample/REPORT.md, the committed sample, is this campaign's report (a test holds it to what `report`
# writes); results/REPORT.md is the user's own, which every matrix run rewrites
REPORT_SAMPLE = "results/campaigns/2026-11-26_h100_throughput/summary.csv"
SAMPLE_COMMAND = f"python benchmark.py report --results {REPORT_SAMPLE} --report results/sample/REPORT.md"
EPOCH_IMAGES = 5 * 50_000  # the articles' 5 epochs of CIFAR10's training set


def load_campaigns(campaigns_dir: str = CAMPAIGNS) -> pd.DataFrame:
    """Every row of the campaign folders (`summary.csv`, and `rows.csv` where the raw rows were not kept and
    the lease's notes were transcribed under the same column names: a transcribed row without a status is
    taken as ok), with its folder in `campaign`."""
    frames = []
    for name in sorted(os.listdir(campaigns_dir)) if os.path.isdir(campaigns_dir) else []:
        for file in ("summary.csv", "rows.csv"):
            path = os.path.join(campaigns_dir, name, file)
            if os.path.isfile(path):
                frames.append(pd.read_csv(path, dtype=str).assign(campaign=name))
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["campaign"])
    for c in COLUMNS:
        if c not in df:
            df[c] = None
    for c in NUMERIC:
        df[c] = pd.to_numeric(df[c], errors="coerce")
    return df


def _gpu_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The ok GPU rows at the articles' setup, oldest first by their timestamp (a row without one, first), of
    one GPU: the newest row's. Setting one GPU's step beside another's would compare the cards."""
    ok = df[(df.status.fillna("ok") == "ok") & (df.device == "cuda")]
    for key, value in REFERENCE_SETUP.items():
        ok = ok[ok[key] == value]
    ok = ok.assign(when=pd.to_datetime(ok.timestamp, utc=True, errors="coerce"))
    ok = ok.sort_values("when", kind="stable", na_position="first")
    return ok[ok.device_name == ok.device_name.iloc[-1]] if len(ok) else ok


def _campaign_row(rows: pd.DataFrame, script: str):
    """The newest campaign's row of `script` among the GPU rows, its default run first (a named run such as
    TF32 or a faster layout is not the articles' configuration)."""
    ok = rows[rows.script == script]
    if not len(ok):
        return None
    newest = ok[ok.campaign == ok.campaign.iloc[-1]]
    default = newest[newest.run_name.fillna("").str.endswith("/" + script[:-3]) & (newest.tf32.astype(str) != "True")]
    return (default if len(default) else newest).iloc[-1]


def _provenance(rows: list) -> list[str]:
    lines = []
    for name in dict.fromkeys(r.campaign for r in rows):
        r = next(r for r in rows if r.campaign == name)
        parts = [str(r.device_name)] + [f"{label} {r[c]}" for label, c in (("driver", "driver_version"), (
            "CUDA", "cuda_version"), ("torch", "torch_version")) if isinstance(r[c], str) and r[c]]
        lines.append(f"- [{name}](results/campaigns/{name}/): " + ", ".join(parts))
    return lines


def figures_table(campaigns_dir: str, reference_csv: str) -> str:
    """The articles' figures for the reference experiment beside the newest GPU campaign's row of the same
    script at the articles' setup (ResNet50, 224 px, global batch 128), one provenance line per campaign.
    CPU rows are never set beside them."""
    ref = pd.read_csv(reference_csv, dtype=str).fillna("")
    ref = ref[ref.source.str.startswith(REFERENCE_SOURCE) & ref.script.ne("") & ~ref.run.str.contains("batch 1")]
    gpu = _gpu_rows(load_campaigns(campaigns_dir))
    table, used = [], []
    for _, a in ref.iterrows():
        r = _campaign_row(gpu, a.script)
        rate = f"{EPOCH_IMAGES / float(a.time_s):.0f}" if a.time_s else "–"
        ours = ["not measured yet"] + ["–"] * 5 if r is None else [
            f"[{r.campaign}](results/campaigns/{r.campaign}/)", f"{_fmt(r.num_devices, 0)}x {r.device_name}",
            str(r.precision) + (" (TF32)" if str(r.tf32) == "True" else ""), _fmt(r.step_ms_p50, 1),
            _fmt(r.throughput_img_s, 0), _fmt(r.peak_allocated_gib)]
        used += [] if r is None else [r]
        table.append([a.run, a.script, f"{a.gpus}x {a.gpu_model}", a.peak_memory_gb or "–", a.time_s or "–", rate,
                      a.test_accuracy or "–"] + ours)
    head = ("Generated by `python benchmark.py report --readme` from `results/reference.csv` and "
            "`results/campaigns/`. The articles' img/s is 5 x 50,000 images over their time, which includes "
            "their evaluation; ours is the timed window's, training alone."
            + (" Every row of ours ran on one GPU: no multi-GPU campaign has been measured yet."
               if used and all(r.num_devices == 1 for r in used) else "") + "\n\n")
    return head + "\n".join(_table(
        ["articles' run", "script", "their GPUs", "peak GB", "time s", "img/s", "test acc", "campaign", "our GPUs",
         "precision", "step ms", "img/s", "peak alloc GiB"], table) + [""] + _provenance(used))


def update_readme(readme: str, campaigns_dir: str | None = None, reference_csv: str | None = None) -> str:
    """The README's generated tables: the script table from the registry and, given the campaigns folder and
    the articles' figures, the results table."""
    from .registry import readme_table

    with open(readme) as fh:
        text = fh.read()
    new = replace_block(text, "scripts", readme_table())
    if "<!-- sample:start -->" in new:
        new = replace_block(new, "sample", f"`{SAMPLE_COMMAND}`")
    if campaigns_dir and reference_csv:
        new = replace_block(new, "figures", figures_table(campaigns_dir, reference_csv))
    if new != text:
        with open(readme, "w") as fh:
            fh.write(new)
    return readme


def latest(rows: pd.DataFrame) -> pd.DataFrame:
    """The newest row of each run label."""
    return rows.groupby("label", dropna=False, sort=False).tail(1)


def _launch_index(rows: pd.DataFrame) -> pd.Series:
    """Each row's launch index of --repeats (matrix.repeat_of's), NaN for a row written without one."""
    return pd.to_numeric(rows["repeat"], errors="coerce")


def launches(rows: pd.DataFrame) -> pd.DataFrame:
    """The ok rows of each run's launches (benchmark.py --repeats): the newest ok row per run label,
    device and launch index (a row without one is the first launch), so a --force rerun replaces a
    launch instead of adding one."""
    ok = rows[rows.status == "ok"].copy()
    ok["launch"] = _launch_index(ok).fillna(1).astype(int)
    return ok.groupby(["label", "device_name", "launch"], dropna=False, sort=False).tail(1)


def _repeats_table(rows: pd.DataFrame, out_dir: str, slug: str) -> list[str]:
    table = []
    for label, runs in launches(rows).groupby("label", sort=False):
        speed = runs.throughput_img_s.dropna().tolist()
        if len(speed) < 2:
            continue
        s, times = summarize(speed), runs.train_time_s.dropna().tolist()
        busy = _busy(runs).max()
        table.append([label, s.n, _fmt(median(times) if times else None, 1), _fmt(s.median, 1), _fmt(s.iqr, 1),
                      f"{s.min:.1f}–{s.max:.1f}", f"{s.ci_low:.1f}–{s.ci_high:.1f}",
                      f"{100 * s.iqr / s.median:.1f}%" if s.median else "–", _fmt(busy, 1),
                      ", ".join(f for f in ("noisy" if s.noisy else "", "busy host" if is_busy(busy) else "") if f)])
    if not table:
        return []
    return [f"Repeated launches (`--repeats`): per run, over its ok launches, the median training time and "
            f"throughput, the throughput's interquartile range and min–max, the bootstrap 95% confidence interval "
            f"of its median, `noisy` where the IQR exceeds {NOISY_IQR:.0%} of the median, and the largest share of "
            f"the host's CPU time that went to other work or the hypervisor in a launch's window (`busy host` from "
            f"{BUSY_PCT:.0f}%: docs/time.md, A busy host).", ""] + \
        _table(["run", "launches", "time s (median)", "img/s (median)", "IQR img/s", "min–max img/s",
                "95% CI of median img/s", "IQR / median", "host busy % (max)", "flag"], table)


def _busy(rows: pd.DataFrame) -> pd.Series:
    """Each row's share of its host's CPU time that was not the run's: other work plus steal, %; NaN for a row
    that measured neither (written before the columns, or a host without Linux's /proc)."""
    return rows.host_other_pct.add(rows.host_steal_pct, fill_value=0)


def busy_launches(ok: pd.DataFrame, rows: pd.DataFrame | None = None) -> list[str]:
    """The launches read (`ok`: launches()) whose window found the host busy, and of `rows` the busy ones a
    later launch of the same index replaced (benchmark.py --relaunch-busy)."""
    def listed(frame):
        return "; ".join(f"{r.label} launch {_fmt(r.launch, 0)}: {_fmt(r.step_ms_p50, 1)} ms, "
                         + describe(r.host_other_pct, r.host_steal_pct) for _, r in frame.iterrows())

    out = []
    busy = ok[is_busy(_busy(ok))]
    if not busy.empty:
        out += ["", f"On a busy host ({BUSY_PCT:.0f}% or more of its CPU time to other work or the hypervisor in "
                    f"the window; their step times are slower than the host's own): {listed(busy)}."]
    if rows is not None:
        every = rows[rows.status == "ok"].copy()
        every["launch"] = _launch_index(every).fillna(1).astype(int)
        replaced = every[~every.index.isin(ok.index) & is_busy(_busy(every))]
        if not replaced.empty:
            out += ["", f"Launched again after a busy host (the newest launch is the one read): {listed(replaced)}."]
    return out


def _main_table(rows: pd.DataFrame, out_dir: str, slug: str) -> list[str]:
    section = latest(rows)
    base = _baseline(section)
    table = []
    for _, r in section.iterrows():
        speed = mem = "–"
        if base is not None and r.status == "ok":
            if base.throughput_img_s and not math.isnan(r.throughput_img_s):
                speed = f"{r.throughput_img_s / base.throughput_img_s:.2f}x"
            if base.peak_allocated_gib and not math.isnan(r.peak_allocated_gib):
                mem = f"{r.peak_allocated_gib / base.peak_allocated_gib:.2f}x"
        table.append([r.label, r.script, r.strategy, r.precision, _fmt(r.world_size, 0), r.status,
                      _fmt(r.peak_allocated_gib), _fmt(r.peak_nvml_gib), _fmt(r.gpu_util_mean, 0),
                      _fmt(r.gpu_util_peak, 0), _fmt(r.train_time_s, 1), _fmt(r.throughput_img_s, 1), speed, mem,
                      _fmt(r.train_loss, 3), _fmt(r.test_accuracy, 4), _fmt(r.test_samples, 0)])
    return _table(["run", "script", "strategy", "precision", "world", "status", "peak alloc GiB",
                   "peak NVML GiB", "util mean %", "util peak %", "time s", "img/s", "speed-up", "memory",
                   "train loss", "test acc", "test n"], table)


def _memory_setup(r):
    """The memory model's Setup of a row (None when the row names no strategy the model knows), from the
    row's setup columns (common/runsetup.py from_row)."""
    from .predict.memory import setup_of
    from .runsetup import from_row

    run = from_row(r)
    return None if run is None else setup_of(run)


def _tp_size(r) -> int:
    tp = pd.to_numeric(r.get("tp_size"), errors="coerce")
    return 1 if pd.isna(tp) else int(tp)


def _predicted_parts(r) -> dict | None:
    """The predicted components of a row in GiB, plus `backward` (the peak beyond them): the row's own
    pred_*_gib where it has them, else rebuilt from its columns (rows of 0.3.0 and earlier)."""
    from .predict.memory import COMPONENTS, GIB, predict

    cols = {c: pd.to_numeric(r.get(f"pred_{c}_gib"), errors="coerce") for c in COMPONENTS if c != "activations"}
    cols["activations"] = pd.to_numeric(r.get("pred_activation_gib"), errors="coerce")
    peak = pd.to_numeric(r.get("pred_peak_gib"), errors="coerce")
    if any(pd.isna(v) for v in cols.values()) or pd.isna(peak):
        setup = _memory_setup(r)
        if setup is None:
            return None
        pred = predict(setup)
        cols, peak = pred.gib(), pred.peak / GIB
    parts = {c: float(cols[c]) for c in COMPONENTS}
    parts["backward"] = max(0.0, float(peak) - sum(v for c, v in parts.items() if c != "grads"))
    return parts


def _memory(rows: pd.DataFrame, out_dir: str, slug: str) -> list[str]:
    """Predicted vs measured memory (common/predict/memory.py, model_state.py), and the predicted
    components per run as stacked bars with the measured peak marked."""
    from .predict.memory import COMPONENTS

    section = latest(rows)
    section = section[(section.status == "ok") & section.pred_peak_gib.notna()]
    if section.empty:
        return []
    table, bars = [], []
    for _, r in section.iterrows():
        table.append([r.label, r.strategy, _fmt(r.world_size, 0), _fmt(r.model_state_gib, 3),
                      _fmt(r.pred_model_state_gib, 3), _fmt(r.pred_activation_gib, 3), _fmt(r.pred_peak_gib, 3),
                      _fmt(r.peak_allocated_gib, 3), _fmt(r.pred_error_pct, 1)])
        parts = _predicted_parts(r)
        if parts is not None:
            bars.append((r.label, parts, r.peak_allocated_gib))
    lines = ["Memory per rank, predicted (`benchmark.py advise` model) vs measured, GiB:", ""]
    lines += _table(["run", "strategy", "world", "model state", "pred model state", "pred activations",
                     "pred peak", "peak alloc", "pred error %"], table)
    if bars:
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(bars) + 1.6))
        left = [0.0] * len(bars)
        # the bars add up to the predicted peak: at backward's peak some activations are freed and
        # gradients (and the gradient flowing back) have appeared: what that adds beyond the activations
        for comp in [c for c in COMPONENTS if c != "grads"] + ["backward"]:
            values = [b[1][comp] for b in bars]
            ax.barh([b[0] for b in bars], values, left=left,
                    label="backward beyond activations" if comp == "backward" else comp)
            left = [a + v for a, v in zip(left, values)]
        measured = [(i, b[2]) for i, b in enumerate(bars) if not math.isnan(b[2])]
        if measured:
            ax.scatter([m for _, m in measured], [i for i, _ in measured], marker="|", s=300, color="black",
                       zorder=3, label="measured peak")
        ax.invert_yaxis()
        ax.set_xlabel("GiB per rank")
        ax.set_title("Predicted peak by component (bars), measured peak allocated (|)", fontsize=10)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside the bars
        fig.tight_layout()
        path = os.path.join(out_dir, f"{slug}_memory_components.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        lines += ["", f"![{os.path.basename(path)}](charts/{os.path.basename(path)})"]
    return lines


TIME_PARTS = ("data", "compute", "comm_exposed", "optimizer", "other")
PRED_PARTS = TIME_PARTS[:-1]  # the step model's (pred_*_ms): no `other`


def _time(rows: pd.DataFrame, out_dir: str, slug: str) -> list[str]:
    """Where each run's step went (measured components, docs/time.md) and the step model's prediction:
    the median over the run's launches of each; stacked bars, measured beside predicted by component
    (rows from before the predicted components: the predicted step marked)."""
    ok = rows[(rows.status == "ok") & rows.step_ms_mean.notna()].copy()
    ok["launch"] = _launch_index(ok)
    # a launch of --repeats run again (--relaunch-busy, --force): its newest row; rows without a launch index
    # (a script run by hand, several times) all count
    ok = ok[ok.launch.isna() | ~ok.duplicated(["label", "device_name", "launch"], keep="last")]
    ok["launch"] = ok.launch.fillna(1)
    if ok.empty:
        return []
    cols = [f"step_{p}_ms" for p in TIME_PARTS] + ["step_ms_p50", "step_ms_mean", "pred_step_ms", "pred_time_error_pct"]
    med = ok.groupby("label", sort=False)[cols + [f"pred_{p}_ms" for p in PRED_PARTS]].median()
    # the bar and `benchmark.py predict`: the median prediction against the median step, not the
    # median of each launch's own error (each launch predicts with its own loader rate)
    med["pred_time_error_pct"] = 100 * (med.pred_step_ms - med.step_ms_p50) / med.step_ms_p50
    n = ok.groupby("label", sort=False).size()
    table = [[label, _fmt(n[label], 0), *(_fmt(r[f"step_{p}_ms"], 1) for p in TIME_PARTS), _fmt(r.step_ms_mean, 1),
              _fmt(r.step_ms_p50, 1), _fmt(r.pred_step_ms, 1), _fmt(r.pred_time_error_pct, 1)]
             for label, r in med.iterrows()]
    lines = ["Where a step's time went (ms per optimizer step, median over launches) and the step model's prediction "
             "(docs/time.md; error against the median step):", ""]
    lines += _table(["run", "launches", *TIME_PARTS, "step mean", "step p50", "predicted", "pred error %"], table)
    parts = med[[f"pred_{p}_ms" for p in PRED_PARTS]].notna().all(axis=1)
    if parts.any():
        # the median of each component over the launches: they need not add up to the median step
        lines += ["", "By component, measured / predicted (ms; the model has no `other`, the loop's bookkeeping):", ""]
        lines += _table(["run", *PRED_PARTS, "other", "sum"],
                        [[label, *(f"{_fmt(r[f'step_{p}_ms'], 1)} / {_fmt(r[f'pred_{p}_ms'], 1)}" for p in PRED_PARTS),
                          _fmt(r.step_other_ms, 1),
                          f"{_fmt(_nansum(r[f'step_{p}_ms'] for p in TIME_PARTS), 1)} / "
                          f"{_fmt(sum(r[f'pred_{p}_ms'] for p in PRED_PARTS), 1)}"]
                         for label, r in med[parts].iterrows()])
    errors = med.pred_time_error_pct.dropna().abs()
    if len(errors):
        lines += ["", f"Prediction error over {len(errors)} runs: median {errors.median():.1f}%, "
                      f"largest {errors.max():.1f}% ({errors.idxmax()}); {int((errors <= 15).sum())} of "
                      f"{len(errors)} within 15%."]
    lines += _time_order(ok, med)
    lines += busy_launches(ok, rows)
    path = _time_chart(med, parts, out_dir, slug)
    return lines + ["", f"![{os.path.basename(path)}](charts/{os.path.basename(path)})"]


def _nansum(values) -> float:
    """The sum of the figures there are (a run with --comm-steps 0 has no exposed communication column);
    NaN when there are none."""
    got = [v for v in values if not math.isnan(v)]
    return sum(got) if got else math.nan


def _time_chart(med: pd.DataFrame, parts: pd.Series, out_dir: str, slug: str) -> str:
    """Per run a bar of the measured components and, where the rows hold them, one of the predicted
    components below it (hatched, the same colours); a run with only a predicted total gets a tick."""
    pairs = bool(parts.any())
    fig, ax = plt.subplots(figsize=(8, (0.7 if pairs else 0.45) * len(med) + 1.6))
    colors = dict(zip(TIME_PARTS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    height, shift = (0.38, 0.2) if pairs else (0.8, 0.0)
    ends = []
    for i, (label, r) in enumerate(med.iterrows()):
        left = 0.0
        for p in TIME_PARTS:
            v = 0.0 if math.isnan(r[f"step_{p}_ms"]) else r[f"step_{p}_ms"]
            ax.barh(i - shift, v, left=left, height=height, color=colors[p])
            left += v
        ends.append(left)
        if parts[label]:
            left = 0.0
            for p in PRED_PARTS:
                v = r[f"pred_{p}_ms"]
                ax.barh(i + shift, v, left=left, height=height, color=colors[p], alpha=0.45, hatch="//",
                        edgecolor="black", linewidth=0.3)
                left += v
            ends.append(left)
        elif not math.isnan(r.pred_step_ms):
            ax.scatter([r.pred_step_ms], [i], marker="|", s=300, color="black", zorder=3)
            ends.append(r.pred_step_ms)
    handles = [Patch(color=colors[p], label=p) for p in TIME_PARTS]
    if pairs:
        handles.append(Patch(facecolor="white", hatch="//", edgecolor="black", linewidth=0.3, label="predicted"))
    ticks = bool((~parts & med.pred_step_ms.notna()).any())
    if ticks:
        handles.append(Line2D([], [], marker="|", markersize=14, linestyle="", color="black", label="predicted step"))
    ax.set_yticks(range(len(med)))
    ax.set_yticklabels(list(med.index))
    ax.invert_yaxis()
    ax.set_xlim(0, max(ends) * 1.08 or 1.0)  # rows with a step time but no component: an empty chart, not a warning
    ax.set_xlabel("ms per optimizer step")
    ax.set_title("Measured step by component" + (", predicted below it (hatched)" if pairs else "")
                 + (", predicted step (|)" if ticks else ""), fontsize=10)
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{slug}_step_components.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def time_pairs(ok: pd.DataFrame, med: pd.DataFrame) -> tuple[int, list[str]]:
    """Does the step model rank the runs as they measured? Only pairs the launches separate: each run's
    step p50 over its launches (at least 2) is a range, and two runs whose ranges do not overlap have a
    measured order; the predicted one is their median pred_step_ms's. (the pairs, those predicted out of
    order)."""
    spread = ok.groupby("label", sort=False).step_ms_p50.agg(["min", "max", "count"])
    runs = [label for label in med.index if spread["count"][label] >= 2 and not math.isnan(med.pred_step_ms[label])]
    pairs, wrong = 0, []
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            if spread["max"][a] < spread["min"][b]:
                fast, slow = a, b
            elif spread["max"][b] < spread["min"][a]:
                fast, slow = b, a
            else:
                continue
            pairs += 1
            if not med.pred_step_ms[fast] < med.pred_step_ms[slow]:
                wrong.append(f"{fast} {med.step_ms_p50[fast]:.1f} ms, predicted {med.pred_step_ms[fast]:.1f}, "
                             f"against {slow} {med.step_ms_p50[slow]:.1f}, predicted {med.pred_step_ms[slow]:.1f}")
    return pairs, wrong


def pairs_sentence(pairs: int, wrong: list[str]) -> str:
    return (f"{pairs - len(wrong)} of the {pairs} pairs of runs whose launches' step p50 ranges do not overlap are "
            "predicted in the measured order" + (f"; not: {'; '.join(wrong)}." if wrong else "."))


def _time_order(ok: pd.DataFrame, med: pd.DataFrame) -> list[str]:
    pairs, wrong = time_pairs(ok, med)
    return ["", "Order: " + pairs_sentence(pairs, wrong)] if pairs else []


def _not_ok(rows: pd.DataFrame, out_dir: str, slug: str) -> list[str]:
    bad = latest(rows)
    bad = bad[bad.status != "ok"]
    if not len(bad):
        return []
    return ["Not ok: " + "; ".join(f"{r.label}: {r.status} ({r.error or 'no message'})" for _, r in bad.iterrows())]


def _reference_kernels(rows: pd.DataFrame, out_dir: str, slug: str) -> list[str]:
    """Runs whose half precision ran torch's reference kernels (their notes say so: common/measure/flops.py):
    their time is this CPU's missing kernels, not the strategy's."""
    from .measure.flops import REFERENCE_KERNELS

    slow = latest(rows)
    slow = slow[slow.notes.fillna("").str.contains(REFERENCE_KERNELS, regex=False)]
    if slow.empty:
        return []
    return [f"Reference kernels: {', '.join(slow.label)} ran {', '.join(sorted(set(slow.precision)))} "
            "on torch's reference kernels (this CPU has no native oneDNN kernels for it, 16-34x fp32's time on a "
            "ResNet): their times are the CPU's, not the strategy's. The smoke preset trains such runs on a smaller "
            "model (`cpu_emulated_half_args` in config/benchmark.yaml), so they get a section of their own."]


def textbook_bubble(strategy: str, world: float, devices: float, microbatches: float) -> float | None:
    """Idle share in % of p equal stages, m micro-batches: (p-1)/(m+p-1); interleaved with v=2 stages
    per rank (p-1)/(v*m+p-1); naive model parallelism is one micro-batch on its devices."""
    from .strategies import of

    family = getattr(of(strategy), "family", None)
    if family == "mp":
        p, m, v = devices, 1, 1
    elif family == "pp":
        p, m, v = world, microbatches, 2 if "interleaved" in strategy else 1
    else:
        return None
    if math.isnan(p) or math.isnan(m) or p < 2:
        return None
    return 100 * (p - 1) / (v * m + p - 1)


def _pipeline(rows: pd.DataFrame, out_dir: str, slug: str) -> list[str]:
    """Model and pipeline parallelism: the measured bubble against the textbook's."""
    split = latest(rows)
    from .strategies import of

    family = split.strategy.map(lambda st: getattr(of(str(st)), "family", None))
    split = split[(split.status == "ok") & family.isin(("mp", "pp"))]
    if split.empty:
        return []
    table = []
    for _, r in split.iterrows():
        book = textbook_bubble(r.strategy, r.world_size, r.num_devices, r.microbatches)
        table.append([r.label, r.strategy, _fmt(r.world_size, 0), _fmt(r.microbatches, 0),
                      _fmt(r.pipeline_bubble_pct, 1), _fmt(book, 1),
                      _fmt(r.throughput_img_s, 1)])
    return ["Pipeline bubble: measured idle share of the busiest-idle device vs (p-1)/(m+p-1) for p equal "
            "stages (measured idle also counts loss, optimizer step and data loading: docs/parallelism.md).", ""] + \
        _table(["run", "strategy", "world", "micro-batches", "bubble %", "textbook %", "img/s"], table)


def _chart_links(rows: pd.DataFrame, out_dir: str, slug: str) -> list[str]:
    return [f"![{os.path.basename(p)}](charts/{os.path.basename(p)})" for p in _charts(latest(rows), out_dir, slug)]


def _published(df: pd.DataFrame, reference_csv: str | None, out_dir: str) -> list[str]:
    if not reference_csv or not os.path.exists(reference_csv):
        return []
    ref = pd.read_csv(reference_csv, dtype=str).fillna("")
    lines = ["## Published figures (the source articles)", "",
             "Transcribed from the articles this project started from (memory in GB as published, time in "
             "seconds). Compare shapes, not absolute values: other GPUs, other software.", ""]
    return lines + _table(["source", "setup", "run", "script", "GPUs", "GPU", "peak memory GB", "util peak %",
                           "time s", "test acc"], ref.values.tolist())


def parameter_count(model: str) -> int | None:
    """Parameters of a torchvision model with the 10-class head, counted on the meta device (no
    weights are built or loaded)."""
    import torch
    import torchvision

    from .models import NUM_CLASSES, replace_head

    try:
        with torch.device("meta"):
            net = replace_head(torchvision.models.get_model(model, weights=None), NUM_CLASSES)
    except Exception:
        return None
    return sum(p.numel() for p in net.parameters())


def _comm(rows: pd.DataFrame, out_dir: str, slug: str) -> list[str]:
    """Measured communication beside the volume the strategy should send (common/measure/comm.py)."""
    from .predict.volume import expected_bytes, tp_expected_bytes
    from .strategies import of

    ok = latest(rows)
    ok = ok[(ok.status == "ok") & (ok.world_size > 1)]
    if ok.empty:
        return []
    params = parameter_count(ok.iloc[0].model)
    table, bars = [], []
    for _, r in ok.iterrows():
        accum = pd.to_numeric(r.get("grad_accum"), errors="coerce")
        accum = 1 if pd.isna(accum) else int(accum)
        own = params if r.model == ok.iloc[0].model else parameter_count(r.model)  # a TP row's ViT beside ResNets
        want = expected_bytes(r.strategy, r.precision, own, accum) if own else None
        st = of(str(r.strategy))
        if st is not None and st.family in ("tp", "tp_fsdp") and _tp_size(r) > 0:
            want = tp_expected_bytes(r.model, int(r.image_size), int(r.global_batch_size), int(r.world_size),
                                     _tp_size(r), accum, r.precision)  # activations: from the row's shapes
        got = r.comm_bytes_per_step
        ratio = f"{got / want:.3f}" if want and not math.isnan(got) else "–"
        table.append([r.label, r.strategy, r.precision, _fmt(r.world_size, 0), _fmt(got / 1e6, 1),
                      _fmt(want / 1e6 if want else None, 1), ratio, _fmt(r.comm_calls_per_step, 1),
                      _fmt(r.comm_ms_per_step, 1), _fmt(r.busbw_gbps, 2), _fmt(r.comm_overlap_pct, 0)])
        bars.append((r.label, got, want))
    lines = ["Communication per optimizer step and rank (the --comm-steps steps after the warm-up, before the "
             "timed window; "
             f"expected from {params:,} parameters, docs/communication.md)." if params else
             "Communication per optimizer step and rank.", ""]
    lines += _table(["run", "strategy", "precision", "world", "MB/step", "expected MB", "measured/expected",
                     "calls/step", "comm ms/step", "busbw GB/s", "overlap %"], table)
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(bars) + 1.4))
    ys = range(len(bars))
    ax.barh([y - 0.2 for y in ys], [0 if math.isnan(b[1]) else b[1] / 1e6 for b in bars], height=0.4,
            label="measured", color="#4C72B0")
    ax.barh([y + 0.2 for y in ys], [(b[2] or 0) / 1e6 for b in bars], height=0.4, label="expected", color="#DD8452")
    ax.set_yticks(list(ys), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlabel("MB per optimizer step per rank (message size S)")
    ax.set_title("Communication volume per strategy", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{slug}_comm_bytes.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return lines + ["", f"![{os.path.basename(path)}](charts/{os.path.basename(path)})"]


def _scaling(df: pd.DataFrame, reference_csv: str | None, out_dir: str) -> list[str]:
    """Throughput against world size per strategy (benchmark.py --world-sizes), with the ideal line
    (the smallest world's throughput x w / w0) and the scaling efficiency (measured / ideal); beside
    them the step model's prediction (pred_img_s) and the efficiency it predicts, the same ratio of
    its own figures, where the rows have one (dotted in the chart)."""
    ok = df[(df.status == "ok") & df.scaling.isin(["strong", "weak"])]
    if ok.empty:
        return []
    lines = ["## Scaling (benchmark.py --world-sizes)", "",
             "Strong: the global batch is fixed; weak: the per-rank batch is fixed. Efficiency = throughput / "
             "(throughput at the smallest world size x w / w0); the bytes per step explain what it costs. "
             "Predicted: the step model's img/s (pred_img_s, docs/time.md) and the efficiency it gives.", ""]
    for key, part in ok.groupby(["device_name", "model", "image_size", "dataset", "scaling"], sort=False):
        device, model, size, dataset, scaling = key
        title = f"{device}: {model} at {_fmt(size, 0)} px, {dataset}, {scaling} scaling"
        table = []
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
        for (strategy, precision), runs in part.groupby(["strategy", "precision"], sort=False):
            runs = runs.groupby("world_size").tail(1).sort_values("world_size")
            w0, t0 = runs.world_size.iloc[0], runs.throughput_img_s.iloc[0]
            pred = pd.to_numeric(runs.get("pred_img_s", pd.Series(index=runs.index, dtype=float)), errors="coerce")
            p0 = pred.iloc[0]
            for (_, r), p in zip(runs.iterrows(), pred):
                ideal = t0 * r.world_size / w0
                p_eff = f"{100 * p / (p0 * r.world_size / w0):.0f}" if pd.notna(p) and pd.notna(p0) and p0 else "–"
                table.append([strategy, precision, _fmt(r.world_size, 0), _fmt(r.global_batch_size, 0),
                              _fmt(r.throughput_img_s, 1), _fmt(ideal, 1), f"{100 * r.throughput_img_s / ideal:.0f}",
                              _fmt(p, 1), p_eff, _fmt(r.comm_bytes_per_step / 1e6, 1)])
            line = ax.plot(runs.world_size, runs.throughput_img_s, "o-", label=f"{strategy} {precision}")[0]
            ax.plot(runs.world_size, t0 * runs.world_size / w0, "--", color=line.get_color(), alpha=0.5)
            if pred.notna().any():
                ax.plot(runs.world_size, pred, ":", marker="x", color=line.get_color())
            bx.plot(runs.world_size, runs.comm_bytes_per_step / 1e6, "o-", color=line.get_color(),
                    label=f"{strategy} {precision}")
        for axis in (ax, bx):
            axis.set_xticks(sorted(part.world_size.unique()))
        ax.set_ylim(bottom=0)
        bx.set_ylim(bottom=0)
        ax.set(xlabel="world size (processes)", ylabel="images / s",
               title="Throughput (dashed: ideal; dotted: predicted)")
        bx.set(xlabel="world size (processes)", ylabel="MB per step per rank", title="Communication volume")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, f"scaling_{_slug(title)}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        lines += [f"### {title}", ""]
        lines += _table(["strategy", "precision", "world", "global batch", "img/s", "ideal img/s", "efficiency %",
                         "predicted img/s", "predicted efficiency %", "comm MB/step"], table)
        lines += ["", f"![{os.path.basename(path)}](charts/{os.path.basename(path)})", ""]
    return lines


# The report's parts. Per setup (rows measured under the same conditions: every row of the setup,
# repeats included), each gets (rows, chart folder, slug) and returns Markdown lines; after the
# setups, each of GLOBAL_PARTS gets (all rows, reference CSV, chart folder).
SETUP_PARTS = [_main_table, _reference_kernels, _repeats_table, _pipeline, _not_ok, _chart_links, _memory, _comm,
               _time]
GLOBAL_PARTS = [_published, _scaling]


def write_report(results_csv: str, report_md: str, reference_csv: str | None = None) -> str:
    df = load(results_csv)
    out_dir = os.path.join(os.path.dirname(os.path.abspath(report_md)), "charts")
    os.makedirs(out_dir, exist_ok=True)
    lines = ["# Benchmark report", "",
             f"Generated by `python benchmark.py report` from `{os.path.basename(results_csv)}` ({len(df)} rows). "
             "Latest row per run; each section compares runs made under the same conditions. "
             "Time: train_time_s, all epochs, evaluation and saving excluded. Throughput: images/s over the timed "
             "window (after the timing warm-up steps). Memory: torch.cuda peak allocated over the timed window, "
             "max over ranks (NVML: the whole device). "
             "Speed-up and memory ratios are against pytorch_SingleGPU.py fp32 in the same section.", ""]
    if df.empty:
        lines.append("No runs yet.")
    for key, rows in df.groupby(SECTION, dropna=False, sort=False):
        device, model, size, dataset, batch = key
        title = f"{device}: {model} at {_fmt(size, 0)} px, {dataset}, global batch {_fmt(batch, 0)}"
        lines += [f"## {title}", ""]
        for part in SETUP_PARTS:
            got = part(rows, out_dir, _slug(title))
            lines += got + ([""] if got else [])
    for part in GLOBAL_PARTS:
        got = part(df, reference_csv, out_dir)
        lines += got + ([""] if got else [])
    with open(report_md, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return report_md
