"""loader_img_s: what the input pipeline alone delivers, measured before training.

The logic of benchmarks/loader_throughput.py inside the run: `loader_probe_batches` batches are
drawn from the run's own training loader and moved to the device (synchronized), the first one
(worker start-up) untimed, or with W workers their first round, the count rounded up to whole rounds,
every rank starting after a garbage collection and a barrier. Where every rank's pipeline feeds its
own share of the global batch (data parallel) the figure is summed over ranks; where each rank walks
the whole global batch (a pipeline's stages, pytorch_PP.py: the first loads its images, the others
its labels alone) it is the slowest rank's. It is compared with the training throughput at the end:
a pipeline that is not clearly faster than training caps it (the warning says so). The probe leaves
the training untouched: the loader's random state is restored, and the sampler's order depends on the
epoch alone.
"""
from __future__ import annotations

import gc
import time

from ..distributed import barrier, reduce_metrics, synchronize, world_size


def _agreed(batches: int, workers: int, device) -> int:
    """The batches this rank probes, 0 on every rank where any rank has none: workers are sized from each
    node's own cores, and a rank that skipped the probe's collectives while the others entered them would
    hang them."""
    fewest = reduce_metrics({"b": -float(batches)}, device, "max")["b"]  # the fewest any rank can draw
    batches = batches if fewest is None else int(-fewest)  # None: unreadable (meta)
    if workers > 1:
        batches -= batches % workers  # whole rounds of this rank's workers again
    # and agree again: 12 agreed batches are no round of a rank's 16 workers, which would skip alone
    short = reduce_metrics({"short": float(batches < 1)}, device, "max")["short"]
    return 0 if short else batches


def probe_loader(loader, cfg, hooks) -> float | None:
    """Images per second of the pipeline over all ranks, or None when switched off."""
    batches = cfg.loader_probe_batches
    if batches < 1:
        return None
    # W workers each build whole batches, so they arrive in rounds of W, round r at about (r + 1) x T. The
    # clock runs from the first batch of round 1 to the first of round k + 1: k x W batches in k x T. Round
    # 0 is the workers' start (3 sleeping workers: rounds 60-150 ms apart where 40 was due); 10 batches
    # of 8 workers from the first one would take 1 round with 7 ready beside it: 1.25x the rate
    workers = getattr(loader, "num_workers", 0)
    first = workers if workers > 1 else 0
    if workers > 1:
        batches = -(-batches // workers) * workers
    batches = min(batches, len(loader) - 1 - first)
    if workers > 1:  # a short loader's cap keeps whole rounds too (8 batches of 2 workers: 4, not 5)
        batches -= batches % workers
    if world_size() > 1:
        batches = _agreed(batches, workers, hooks.device)
    if batches < 1:
        return None
    from ..checkpoint import rng_state, set_rng_state

    # the garbage the set-up left: Python's full collection of a DDP+ZeRO rank's 345,000 tracked objects
    # paused it 155 ms in the 8th of 10 batches, every launch (1,650-1,860 img/s, DDP's 10,500-11,600)
    gc.collect()
    if world_size() > 1:
        # the ranks probe together, as they load together in training: a rank that probed while another was
        # still building its model shared the cores with it (DDP+ZeRO's launches: 1,757 img/s, DDP's 11,282)
        barrier()
    state = rng_state(loader)
    images, start, per_batch = 0, None, 0
    # held until the clock stops: an iterator without persistent workers joins them when let go (a batch long)
    batches_it = iter(loader)
    for i, (x, _) in enumerate(batches_it):
        per_batch = x.shape[0]
        x = x.to(hooks.device, non_blocking=True)
        if i <= first:
            synchronize(hooks.device)
            start = time.perf_counter()
            continue
        images += x.shape[0]
        if i == first + batches:
            break
    synchronize(hooks.device)
    elapsed = time.perf_counter() - start
    del batches_it
    set_rng_state(state, loader)
    rate = images / elapsed if elapsed > 0 else None
    # ranks that load each image: a loader's batch is a micro-batch, the global batch over ranks and accumulation
    copies = per_batch * getattr(cfg, "grad_accum", 1) * world_size() / cfg.batch_size
    if copies <= 1:  # each rank its share (a last short batch too)
        return reduce_metrics({"r": rate}, hooks.device, "sum")["r"]
    if copies < world_size():  # tensor parallelism over dp groups: the tp ranks of a group load the same images
        total = reduce_metrics({"r": rate}, hooks.device, "sum")["r"]
        return None if total is None else total / copies
    slowest = reduce_metrics({"r": None if rate is None else -rate}, hooks.device, "max")["r"]  # the min
    return None if slowest is None else -slowest
