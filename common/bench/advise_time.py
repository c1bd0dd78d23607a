"""`advise`'s time tables: every strategy's predicted step (common/predict/timemodel.py), img/s and
time per epoch, the fastest that fits, and with several --gpus the predicted strong-scaling curve."""
from __future__ import annotations

from dataclasses import replace

from ..config import UsageError
from ..predict.calibration import compute_mode, compute_of, find_link, load
from ..predict.memory import GIB
from ..predict.timemodel import Compute, predict_step
from ..predict.timespec import gpu_compute_ms, link_for

# the step model's median absolute error where it was checked (docs/time.md, "How well it predicts"): 12
# strategies on 2 CPU cores, resnet18, 3 launches each, 3.2-10.7% over the stored Xeon grids
# (results/campaigns/); a value near their upper half is kept. Unchecked on GPUs
MODEL_ERROR = 0.085
CURVE = ("ddp", "ddp_zero", "fsdp_shard-grad-op", "fsdp_full-shard", "deepspeed_zero2", "deepspeed_zero3")


def _calibrated(data: dict, model, image, batch, mode, optimizer, procs) -> dict | None:
    """An entry of the file for these fields at any thread count (the most threads: a whole machine)."""
    best = None
    for k, v in data["compute"].items():
        m, i, b, md, opt, p, t, _ = k.split("|")
        if (m, int(i), int(b), md, opt, int(p[1:])) == (model, image, batch, mode, optimizer, procs):
            if best is None or int(t[1:]) > best[0]:
                best = (int(t[1:]), v)
    return None if best is None else best[1]


def inputs(opts, setup):
    """(Compute, Link, overlap) for a setup, from --calibration or --gpu with the link options."""
    micro = setup.micro_batch
    mode = compute_mode(setup.strategy, setup.precision)
    if opts.gpu:
        fwd, bwd, source = gpu_compute_ms(opts.gpu, setup.precision, setup.model, setup.image_size, micro)
        compute, overlap, data = Compute(fwd, bwd, 0.0, 0.0, source), True, None
    else:
        data = load(opts.calibration)
        if data is None:
            raise UsageError(f"--calibration {opts.calibration}: no calibration there (run benchmark.py calibrate)")
        cuda = data.get("device_type") == "cuda"
        procs = 1 if cuda else setup.world_size
        # the strategy's own one-process run where calibrate made one (timepred.py reads it so too)
        fields = (data, setup.model, setup.image_size, micro)
        got = _calibrated(*fields, f"{mode}@{setup.strategy}", setup.optimizer, procs) or \
            _calibrated(*fields, mode, setup.optimizer, procs)
        if got is None:
            return None
        compute = compute_of(got, 0.0, f"calibrated on {data['device_name']}")
        overlap = cuda
    if setup.world_size <= 1:
        from ..predict.timemodel import Link

        return compute, Link(), overlap
    if opts.interconnect or opts.busbw_gbps:
        link = link_for(opts.interconnect, opts.busbw_gbps)
    else:
        link = find_link(data, setup.world_size) if data is not None else None
        if link is None:
            raise UsageError("give --interconnect or --busbw-gbps (or a --calibration with collectives at "
                             f"{setup.world_size} ranks)")
    return compute, link, overlap


def time_tables(opts, preds: dict) -> None:
    g = opts.gpu_memory_gib
    rows = {}
    print(f"\npredicted time per optimizer step (global batch {opts.batch_size}; "
          f"{'--gpu ' + opts.gpu if opts.gpu else 'calibration ' + opts.calibration}"
          + (f", {opts.interconnect or str(opts.busbw_gbps) + ' GB/s'}" if opts.interconnect or opts.busbw_gbps else "")
          + "), ms:")
    print(f"{'strategy':<24}{'gpus':>5}{'compute':>9}{'comm':>8}{'optim':>8}{'step':>9}{'img/s':>9}"
          f"{'epoch s':>9}  fits")
    for st, mem in preds.items():
        if st.endswith("_offload"):
            print(f"{st:<24}{mem.setup.world_size:>5}  (offload: host transfers and the CPU optimizer not modelled)")
            continue
        try:
            got = inputs(opts, mem.setup)
        except ValueError as exc:  # no datasheet figure for this math on that GPU
            print(f"{st:<24}{mem.setup.world_size:>5}  ({exc})")
            continue
        if got is None:
            print(f"{st:<24}{mem.setup.world_size:>5}  (not calibrated at micro-batch {mem.setup.micro_batch})")
            continue
        p = predict_step(mem.setup, *got)
        img_s = opts.batch_size / p.step_ms * 1e3
        fits = mem.peak / GIB <= 0.9 * g
        rows[st] = (p, img_s, fits)
        print(f"{st:<24}{mem.setup.world_size:>5}{p.compute_ms:>9.1f}{p.comm_exposed_ms:>8.1f}{p.optimizer_ms:>8.1f}"
              f"{p.step_ms:>9.1f}{img_s:>9.0f}{opts.dataset_images / img_s:>9.0f}  {'yes' if fits else 'no'}")
    fitting = {st: r for st, r in rows.items() if r[2] and (preds[st].setup.world_size > 1 or opts.gpus == 1)}
    if fitting:
        best = max(fitting, key=lambda st: fitting[st][1])
        close = [st for st, r in fitting.items() if st != best and r[1] >= fitting[best][1] * (1 - MODEL_ERROR)]
        print(f"fastest that fits: {best} at {fitting[best][1]:.0f} img/s"
              + (f"; within the model's checked error ({MODEL_ERROR:.0%} median on a CPU, unchecked on GPUs: "
                 f"docs/time.md) of it: {', '.join(close)}" if close else ""))
    if len(opts.gpu_counts) > 1:
        curve(opts, preds)


def curve(opts, preds: dict) -> None:
    """Strong scaling: the global batch fixed, efficiency = one GPU's step / (n x n GPUs' step)."""
    base = preds["ddp"].setup
    try:
        one = inputs(opts, replace(base, strategy="single", world_size=1))
    except ValueError as exc:  # no datasheet figure for this math on that GPU
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
            except ValueError:
                got = None
            if got is None:
                cells.append(f"{'-':>16}")
                continue
            tn = predict_step(s if n > 1 else replace(s, strategy="single"), *got).step_ms
            cells.append(f"{opts.batch_size / tn * 1e3:>9.0f} ({t1 / (n * tn):>4.0%})")
        print(f"{st:<24}" + "".join(cells))
