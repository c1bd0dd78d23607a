"""loader_img_s: what the input pipeline alone delivers, measured before training.

The logic of benchmarks/loader_throughput.py inside the run: `loader_probe_batches` batches are
drawn from the run's own training loader and moved to the device (synchronized), the first one
(worker start-up) untimed. The figure is summed over ranks, since every rank's pipeline feeds its
own share of the global batch, and compared with the training throughput at the end: a pipeline
that is not clearly faster than training caps it (the warning says so). The probe leaves the
training untouched: the loader's random state is restored, and the sampler's order depends on
the epoch alone.
"""
from __future__ import annotations

import time

from ..distributed import reduce_metrics, synchronize


def probe_loader(loader, cfg, hooks) -> float | None:
    """Images per second of the pipeline over all ranks, or None when switched off."""
    batches = min(cfg.loader_probe_batches, len(loader) - 1)
    if batches < 1:
        return None
    from ..checkpoint import rng_state, set_rng_state

    state = rng_state(loader)
    images, start = 0, None
    for i, (x, _) in enumerate(loader):
        x = x.to(hooks.device, non_blocking=True)
        if i == 0:
            synchronize(hooks.device)
            start = time.perf_counter()
            continue
        images += x.shape[0]
        if i == batches:
            break
    synchronize(hooks.device)
    elapsed = time.perf_counter() - start
    set_rng_state(state, loader)
    return reduce_metrics({"loader_img_s": images / elapsed if elapsed > 0 else None}, hooks.device, "sum")[
        "loader_img_s"]
