"""`advise`'s time tables: every strategy's predicted step (common/predict/timemodel.py), img/s and
time per epoch (training and one evaluation pass), the fastest that fits, the checked error of each
prediction's class (common/predict/whatif_checks.json), and with several --gpus the predicted strong-scaling
curve."""
from __future__ import annotations

import functools
from dataclasses import replace

from ..config import UsageError
from ..predict.calibration import compute_mode, compute_of, find_link, load
from ..predict.memory import GIB
from ..predict.timemodel import Compute, predict_step
from ..predict.timespec import epoch_s, eval_ms, gpu_compute, link_for, transfer
from ..strategies import of

# the step model's median absolute error where it was checked on CPUs (docs/time.md, "How well it predicts"): 12
# strategies on 2 CPU cores, resnet18, 3 launches each, 3.2-10.7% over the stored Xeon grids
# (results/campaigns/); a value near their upper half is kept. GPUs: whatif_checks.json, per class
MODEL_ERROR = 0.085
CURVE = ("ddp", "ddp_zero", "fsdp_shard-grad-op", "fsdp_full-shard", "deepspeed_zero2", "deepspeed_zero3")


def _calibrated(data: dict, model, image, batch, mode, optimizer, procs, channels_last=False) -> dict | None:
    """An entry of the file for these fields at any thread count (the most threads: a whole machine)."""
    best = None
    for k, v in data["compute"].items():
        m, i, b, md, opt, p, t, cl = k.split("|")
        if (m, int(i), int(b), md, opt, int(p[1:]), cl) == (model, image, batch, mode, optimizer, procs,
                                                              f"cl{int(channels_last)}"):
            if best is None or int(t[1:]) > best[0]:
                best = (int(t[1:]), v)
    return None if best is None else best[1]


def _tf32(opts, setup) -> bool:
    return bool(getattr(opts, "tf32", False)) and setup.precision == "fp32"


def _from_calibration(opts, setup):
    """(Compute, overlap, the file) of --calibration, carried to --gpu where one is named; None if not there."""
    data = load(opts.calibration)
    if data is None:
        raise UsageError(f"--calibration {opts.calibration}: no calibration there (run benchmark.py calibrate)")
    cuda = data.get("device_type") == "cuda"
    procs = 1 if cuda else setup.world_size
    mode = compute_mode(setup.strategy, setup.precision, _tf32(opts, setup))
    # the strategy's own one-process run where calibrate made one (timepred.py reads it so too)
    fields = (data, setup.model, setup.image_size, setup.micro_batch)
    got = _calibrated(*fields, f"{mode}@{setup.strategy}", setup.optimizer, procs, setup.channels_last) or \
        _calibrated(*fields, mode, setup.optimizer, procs, setup.channels_last)
    if got is None:
        return None
    compute = compute_of(got, 0.0, f"calibrated on {data['device_name']}")
    if opts.gpu and opts.gpu != data["device_name"]:
        from ..predict.timespec import gpu_names

        if not cuda or data["device_name"] not in gpu_names():
            raise UsageError(f"--calibration {opts.calibration}: its device {data['device_name']!r} is not a GPU of "
                             f"the datasheet table, so it cannot be carried to --gpu {opts.gpu}")
        compute = transfer(compute, setup, data["device_name"], opts.gpu, _tf32(opts, setup))
    return compute, cuda, data


def inputs(opts, setup):
    """(Compute, Link, overlap) for a setup, from --calibration and/or --gpu with the link options."""
    data = None
    if opts.calibration:
        got = _from_calibration(opts, setup)
        if got is None:
            return None
        compute, overlap, data = got
    else:
        compute, overlap = gpu_compute(opts.gpu, setup, _tf32(opts, setup)), True
    if setup.world_size <= 1:
        from ..predict.timemodel import Link

        return compute, Link(), overlap
    if opts.interconnect or opts.busbw_gbps:
        nodes = getattr(opts, "gpus_per_node", 0)
        split = nodes if nodes and nodes < setup.world_size else 0
        link = link_for(opts.interconnect, opts.busbw_gbps, opts.gpu, split, getattr(opts, "inter_node", "ib200"))
    else:
        link = find_link(data, setup.world_size) if data is not None else None
        if link is None:
            raise UsageError("give --interconnect or --busbw-gbps (or a --calibration with collectives at "
                             f"{setup.world_size} ranks)")
    return compute, link, overlap


@functools.lru_cache(maxsize=1)
def _class_errors() -> dict:
    from ..predict.whatif import stored

    try:
        return stored().get("class_errors", {})
    except (OSError, ValueError):
        return {}


def trust(opts, setup) -> tuple[float | None, str]:
    """(error, label): the largest checked error of this prediction's class (whatif_checks.json: one GPU, GPUs over
    NVLink or PCIe), a CPU calibration's median error, or None where no check covers it."""
    if opts.calibration and not opts.gpu:
        return MODEL_ERROR, f"~{MODEL_ERROR:.1%} (calibrated: the CPU grids' median)"
    n = setup.world_size if of(setup.strategy).data_parallel else 1
    link = opts.interconnect or ""
    cls = ("1 GPU, calibrated" if opts.calibration else "1 GPU") if n == 1 else \
        "8 GPUs NVLink" if link.startswith("nvlink") else "4 GPUs PCIe" if link.startswith("pcie") else ""
    err = _class_errors().get(cls)
    return (err, f"<={err:.0%} ({cls})") if err is not None else (None, "unchecked")


def _epoch(opts, setup, p, compute: Compute, link) -> float:
    """Seconds of one epoch: its training steps and one evaluation pass (an evaluation step from the roofline
    with --gpu alone, else the calibrated forward and the batch's arrival)."""
    if opts.gpu and not opts.calibration:
        ev = eval_ms(opts.gpu, setup, _tf32(opts, setup), link=link)
    else:
        ev = compute.fwd_ms + compute.data_ms
    train, evaluation = epoch_s(p.step_ms, ev, setup, opts.dataset_images, getattr(opts, "eval_images", 0),
                                getattr(opts, "loader_img_s", 0.0))
    return train + evaluation


def refusal_first(opts, setups) -> None:
    """Raises what time_tables would refuse (no calibration there, no link for several GPUs), before the memory
    table is printed: a refusal is one line, not the end of a half-printed answer."""
    for setup in setups:
        if setup.strategy.endswith("_offload"):
            continue
        curve = [n for n in getattr(opts, "gpu_counts", []) if n > 1] if setup.strategy in CURVE else []
        for n in {setup.world_size, *curve}:  # the scaling curve's counts too (curve)
            try:
                inputs(opts, replace(setup, world_size=n))
            except (ValueError, KeyError):  # a figure missing for one row: time_tables says so in that row
                pass


def time_tables(opts, preds: dict) -> None:
    g = opts.gpu_memory_gib
    rows = {}
    print(f"\npredicted time per optimizer step (global batch {opts.batch_size}; "
          f"{'--gpu ' + opts.gpu if opts.gpu else 'calibration ' + opts.calibration}"
          + (f", {opts.interconnect or str(opts.busbw_gbps) + ' GB/s'}" if opts.interconnect or opts.busbw_gbps else "")
          + f"), ms; epoch s: {opts.dataset_images} images and an evaluation of {getattr(opts, 'eval_images', 0)}:")
    print(f"{'strategy':<24}{'gpus':>5}{'compute':>9}{'comm':>8}{'optim':>8}{'step':>9}{'img/s':>9}"
          f"{'epoch s':>9}  fits  checked error")
    for st, mem in preds.items():
        if st.endswith("_offload"):
            print(f"{st:<24}{mem.setup.world_size:>5}  (offload: host transfers and the CPU optimizer not modelled)")
            continue
        try:
            got = inputs(opts, mem.setup)
        except (ValueError, KeyError) as exc:  # no datasheet figure for this math on that GPU
            print(f"{st:<24}{mem.setup.world_size:>5}  ({exc})")
            continue
        if got is None:
            print(f"{st:<24}{mem.setup.world_size:>5}  (not calibrated at micro-batch {mem.setup.micro_batch})")
            continue
        p = predict_step(mem.setup, *got)
        epoch = _epoch(opts, mem.setup, p, got[0], got[1])
        loader = getattr(opts, "loader_img_s", 0.0)  # the workers build the next batches while the step runs
        img_s = opts.batch_size / max(p.step_ms, opts.batch_size / loader * 1e3 if loader else 0.0) * 1e3
        fits = mem.peak / GIB <= 0.9 * g
        rows[st] = (p, img_s, fits)
        print(f"{st:<24}{mem.setup.world_size:>5}{p.compute_ms:>9.1f}{p.comm_exposed_ms:>8.1f}{p.optimizer_ms:>8.1f}"
              f"{p.step_ms:>9.1f}{img_s:>9.0f}{epoch:>9.0f}  {'yes' if fits else 'no ':<4}  "
              f"{trust(opts, mem.setup)[1]}")
    _fastest(opts, preds, rows)
    if len(opts.gpu_counts) > 1:
        curve(opts, preds)


def _fastest(opts, preds: dict, rows: dict) -> None:
    """The fastest strategy that fits, and those whose prediction lies within its class's checked error of it."""
    fitting = {st: r for st, r in rows.items() if r[2] and (preds[st].setup.world_size > 1 or opts.gpus == 1)}
    if not fitting:
        return
    best = max(fitting, key=lambda st: fitting[st][1])
    err, label = trust(opts, preds[best].setup)
    close = [st for st, r in fitting.items() if st != best and r[1] >= fitting[best][1] * (1 - (err or MODEL_ERROR))]
    label = label if err is not None else f"unchecked: the CPU grids' {MODEL_ERROR:.1%}"
    print(f"fastest that fits: {best} at {fitting[best][1]:.0f} img/s"
          + (f"; within the checked error of its class ({label}, docs/time.md) of it: {', '.join(close)}"
             if close else ""))


def curve(opts, preds: dict) -> None:
    """Strong scaling: the global batch fixed, efficiency = one GPU's step / (n x n GPUs' step)."""
    base = preds["ddp"].setup
    try:
        one = inputs(opts, replace(base, strategy="single", world_size=1))
    except (ValueError, KeyError) as exc:  # no datasheet figure for this math on that GPU
        print(f"scaling: {exc}")
        return
    if one is None:
        print("scaling: one GPU's step is not calibrated at this batch")
        return
    t1 = predict_step(replace(base, strategy="single", world_size=1), *one).step_ms
    print(f"\npredicted strong scaling (global batch {opts.batch_size}): img/s (efficiency vs 1 GPU)")
    print(f"{'strategy':<24}" + "".join(f"{n:>16}" for n in opts.gpu_counts))
    for st in CURVE:
        if st not in preds:
            continue
        cells = []
        for n in opts.gpu_counts:
            s = replace(preds[st].setup, world_size=n)
            try:
                got = inputs(opts, s) if n > 1 else one
            except (ValueError, KeyError):
                got = None
            if got is None:
                cells.append(f"{'-':>16}")
                continue
            tn = predict_step(s if n > 1 else replace(s, strategy="single"), *got).step_ms
            cells.append(f"{opts.batch_size / tn * 1e3:>9.0f} ({t1 / (n * tn):>4.0%})")
        print(f"{st:<24}" + "".join(cells))
