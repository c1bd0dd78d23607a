import os
import pickle

import numpy as np
import pytest
import torch

from common import data
from common.config import TrainConfig, UsageError


def fake_cifar(root, n_train=20, n_test=7, seed=0):
    """Writes the python-pickle layout of CIFAR10 (5 train batches + test batch) with random pixels."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, data.CIFAR_FOLDER)
    os.makedirs(folder)
    for name in data.CIFAR_FILES[True] + data.CIFAR_FILES[False]:
        n = n_test if name == "test_batch" else n_train
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, n).tolist(), b"batch_label": name.encode()}
        with open(os.path.join(folder, name), "wb") as fh:
            pickle.dump(batch, fh)
    return folder


def test_cifar_reader_layout(tmp_path):
    folder = fake_cifar(tmp_path)
    x, y = data.load_cifar10(str(tmp_path), train=True)
    assert x.shape == (100, 32, 32, 3) and x.dtype == np.uint8 and y.shape == (100,)
    with open(os.path.join(folder, "data_batch_1"), "rb") as fh:
        raw = pickle.load(fh, encoding="bytes")[b"data"][0]
    # channel-major rows in the file -> HWC image: red plane first
    assert np.array_equal(x[0, :, :, 0].ravel(), raw[:1024]) and np.array_equal(x[0, :, :, 2].ravel(), raw[2048:])
    xt, yt = data.load_cifar10(str(tmp_path), train=False)
    assert xt.shape == (7, 32, 32, 3)


def test_cifar_missing_offline_gives_clear_error(tmp_path, monkeypatch):
    import torchvision

    def offline(*a, **k):
        raise OSError("[Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(torchvision.datasets, "CIFAR10", offline)
    with pytest.raises(UsageError) as exc:
        data.load_cifar10(str(tmp_path), train=True)
    msg = str(exc.value)
    assert "cifar-10-batches-py" in msg and "--dataset synthetic" in msg and "\n" not in msg


def test_cifar_corrupt_file(tmp_path):
    folder = fake_cifar(tmp_path)
    with open(os.path.join(folder, "data_batch_3"), "wb") as fh:
        fh.write(b"not a pickle at all")
    with pytest.raises(UsageError, match="data_batch_3 is corrupt"):
        data.load_cifar10(str(tmp_path), train=True)


def test_cifar_through_loaders(tmp_path):
    fake_cifar(tmp_path)
    cfg = TrainConfig(data_dir=str(tmp_path), image_size=40, batch_size=10, workers=0, train_samples=50,
                      test_samples=0)
    train, test = data.build_loaders(cfg, 0, 1, torch.device("cpu"))
    x, y = next(iter(train))
    assert x.shape == (10, 3, 40, 40) and x.dtype == torch.float32
    assert sum(len(b[0]) for b in train) == 50 and sum(int(b[2].sum()) for b in test) == 7


def test_synthetic_is_deterministic_and_balanced():
    a, la = data.make_synthetic(500, seed=3, train=True)
    b, lb = data.make_synthetic(500, seed=3, train=True)
    c, _ = data.make_synthetic(500, seed=4, train=True)
    assert np.array_equal(a, b) and np.array_equal(la, lb) and not np.array_equal(a, c)
    assert a.shape == (500, 32, 32, 3) and a.dtype == np.uint8
    assert set(np.unique(la)) == set(range(10))


def test_synthetic_classes_are_separable_but_noisy():
    """Separable: a nearest-class-mean classifier on raw pixels is well above chance. Noisy: each pixel's noise
    within a class is over twice its spread between the class patterns, so no single pixel tells the class (a
    model has to pool over the image)."""
    x, y = data.make_synthetic(2000, seed=0, train=True)
    xt, yt = data.make_synthetic(1000, seed=0, train=False)
    x, xt = x.reshape(len(x), -1).astype(np.float32), xt.reshape(len(xt), -1).astype(np.float32)
    means = np.stack([x[y == k].mean(0) for k in range(10)])
    pred = ((xt[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    assert (pred == yt).mean() > 0.3
    within = np.mean([x[y == k].std(0).mean() for k in range(10)])
    assert within > 2 * means.std(0).mean(), (within, means.std(0).mean())


@pytest.mark.parametrize("n, world", [(37, 1), (37, 2), (37, 4), (10, 3), (3, 4)])
def test_eval_shards_count_every_sample_once(n, world):
    seen = []
    lengths = set()
    for r in range(world):
        idx, valid = data.eval_indices(n, r, world)
        lengths.add(len(idx))
        seen += idx[valid].tolist()
    assert sorted(seen) == list(range(n)) and len(lengths) == 1


def test_train_shards_disjoint_like_distributed_sampler():
    cfg = TrainConfig(dataset="synthetic", image_size=32, batch_size=8, workers=0, train_samples=64, test_samples=8)
    labels_by_rank = []
    for r in range(2):
        train, _ = data.build_loaders(cfg, r, 2, torch.device("cpu"))
        train.sampler.set_epoch(0)
        labels_by_rank.append(list(train.sampler))
    assert not set(labels_by_rank[0]) & set(labels_by_rank[1])
    assert len(labels_by_rank[0]) + len(labels_by_rank[1]) == 64


@pytest.mark.parametrize("loader", ["torch", "gpu"])
def test_a_loader_without_inputs_walks_the_same_labels(loader):
    """A pipeline's later stages (pytorch_PP.py) read only the labels: their loader yields the batches' labels
    in the order the first stage's yields them, epoch after epoch, with images of no pixels that still move to
    the device in channels-last, and starts no worker process."""
    from common.train import _to_device

    kw = dict(dataset="synthetic", image_size=24, batch_size=8, workers=0, train_samples=40, test_samples=4,
              loader=loader)
    full, _ = data.build_loaders(TrainConfig(**kw), 0, 1, torch.device("cpu"))
    bare, _ = data.build_loaders(TrainConfig(**kw), 0, 1, torch.device("cpu"), inputs=False)
    for epoch in (0, 1):
        for ld in (full, bare):
            (ld.sampler if loader == "torch" else ld).set_epoch(epoch)
        got = [(x, y) for x, y in bare]
        assert [y.tolist() for _, y in got] == [y.tolist() for _, y in full]
        assert all(x.shape == (8, 3, 0, 0) for x, _ in got)
    x, _ = _to_device(*got[0], torch.device("cpu"), torch.float32, channels_last=True)
    assert x.is_contiguous(memory_format=torch.channels_last)
    if loader == "gpu":
        assert bare.images is None  # nothing of the training images held on the device
    if loader == "torch":
        assert bare.dataset.images is None
        workers, _ = data.build_loaders(TrainConfig(**{**kw, "workers": 2}), 0, 1, torch.device("cpu"), inputs=False)
        assert workers.num_workers == 0


def test_batch_must_divide_world():
    cfg = TrainConfig(batch_size=10, grad_accum=2)
    with pytest.raises(UsageError, match="multiple of 4"):
        data.per_rank_batch(cfg, 2)


@pytest.mark.parametrize("augment", [True, False])
def test_gpu_loader_matches_classic_pipeline(augment):
    """The device-resident pipeline (run here on CPU) against the DataLoader: shapes, dtypes, labels,
    sample counts and per-epoch reshuffling; value statistics close (same normalization)."""
    kw = dict(dataset="synthetic", image_size=48, batch_size=16, workers=0, train_samples=100, test_samples=21,
              augment=augment)
    for world in (1, 2):
        classic = [data.build_loaders(TrainConfig(**kw), r, world, torch.device("cpu")) for r in range(world)]
        gpu = [data.build_loaders(TrainConfig(**kw, loader="gpu"), r, world, torch.device("cpu"))
               for r in range(world)]
        for (ct, ce), (gt, ge) in zip(classic, gpu):
            assert len(ct) == len(gt) and len(ce) == len(ge)
            cx, cy = next(iter(ct))
            gx, gy = next(iter(gt))
            assert cx.shape == gx.shape and cx.dtype == gx.dtype and cy.dtype == gy.dtype
            assert abs(cx.mean() - gx.mean()) < 0.3 and abs(cx.std() - gx.std()) < 0.3
        test_labels = sorted(y for _, ge in gpu for _, yb, ok in ge for y in yb[ok].tolist())
        classic_labels = sorted(y for _, ce in classic for _, yb, ok in ce for y in yb[ok].tolist())
        assert test_labels == classic_labels and len(test_labels) == 21
        train_count = sum(len(yb) for gt, _ in gpu for _, yb in gt)
        assert train_count == sum(len(yb) for ct, _ in classic for _, yb in ct)
    gt, _ = data.build_loaders(TrainConfig(**kw, loader="gpu"), 0, 1, torch.device("cpu"))
    first = torch.cat([y for _, y in gt])
    gt.set_epoch(1)
    assert not torch.equal(first, torch.cat([y for _, y in gt]))


def test_gpu_loader_draws_augmentation_per_rank():
    """Every sample the same (asymmetric) image: two ranks' batches can then differ only through their
    crops and flips. One generator shared by all ranks (the defect) gives identical batches."""
    img = np.zeros((1, 32, 32, 3), dtype=np.uint8)
    img[0, :8, :20] = 255  # no symmetry: every crop offset and flip changes the pixels
    images, labels = np.repeat(img, 64, axis=0), np.zeros(64, dtype=np.int64)
    batches = []
    for rank in range(2):
        loader = data.GpuLoader(images, labels, 8, rank, 2, seed=0, train=True, image_size=32,
                                device=torch.device("cpu"), augment=True)
        batches.append(next(iter(loader))[0])
    assert not torch.equal(batches[0], batches[1])
    again = next(iter(data.GpuLoader(images, labels, 8, 1, 2, seed=0, train=True, image_size=32,
                                     device=torch.device("cpu"), augment=True)))[0]
    assert torch.equal(again, batches[1])  # still a function of (seed, epoch, rank)


@pytest.mark.parametrize("per_rank, accum, op, want", [(8, 1, "sum", 2 * 100.0), (16, 1, "max", 50.0),
                                                      (4, 2, "sum", 2 * 100.0), (8, 2, "max", 50.0)])
def test_loader_rate_over_ranks(monkeypatch, per_rank, accum, op, want):
    """Data parallel: each of 2 ranks reads 8 of the global 16, and the pipeline's rate is their sum.
    A pipeline's stages each read all 16 (pytorch_PP.py): the rate is the slowest rank's, not 2x. With
    --grad-accum 2 a batch is half a rank's share: 4 of 8 is still data parallel, and 8 of 16 (2 tensor-parallel
    ranks reading the same images) is not. The ranks
    start together (a barrier): one that probed while another built its model measured a sixth of the rate;
    and with no garbage left to collect: a full collection of the set-up's objects (155 ms in a DDP+ZeRO
    rank) fell in its probe of 10 batches at every launch."""
    from types import SimpleNamespace

    import common.measure.loader as loader_mod

    calls = []

    def fake_reduce(values, device, how):  # rank 0 measured 100 img/s, rank 1 50 (as if the group ran)
        calls.append(how)
        (k, v), = values.items()
        if k == "short":  # neither rank is short of batches
            return {k: v}
        return {k: 2 * v if how == "sum" else max(v, -50.0 if v < 0 else 50.0)}

    monkeypatch.setattr(loader_mod, "world_size", lambda: 2)
    monkeypatch.setattr(loader_mod, "reduce_metrics", fake_reduce)
    monkeypatch.setattr(loader_mod, "barrier", lambda: calls.append("barrier"))  # the ranks start together
    monkeypatch.setattr(loader_mod.gc, "collect", lambda: calls.append("gc"))
    clock = iter(range(100))
    monkeypatch.setattr(loader_mod.time, "perf_counter", lambda: next(clock) * per_rank / 100.0)
    batches = [(torch.zeros(per_rank, 3, 2, 2), torch.zeros(per_rank)) for _ in range(4)]
    cfg = SimpleNamespace(loader_probe_batches=1, batch_size=16, grad_accum=accum)
    hooks = SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setattr("common.checkpoint.rng_state", lambda loader: None)
    monkeypatch.setattr("common.checkpoint.set_rng_state", lambda state, loader: None)
    rate = loader_mod.probe_loader(batches, cfg, hooks)
    assert calls == ["max", "max", "gc", "barrier", op] and rate == pytest.approx(want)  # the batches agreed


def test_ranks_agree_to_skip_the_loader_probe(monkeypatch):
    """A rank whose loader is too short to probe (its workers sized from its node's cores) still takes part
    in the agreement, and a rank that could probe skips it with the others: no rank waits alone in a
    collective the others never enter."""
    from types import SimpleNamespace

    import common.measure.loader as loader_mod

    calls = []

    def other_rank_has(n, short=False):
        def fake_reduce(values, device, how):
            calls.append((how, values))
            return {k: max(v, float(short) if k == "short" else -float(n)) for k, v in values.items()}
        return fake_reduce

    class Workers(list):  # a loader of 16 workers: batches in rounds of 16
        num_workers = 16

    monkeypatch.setattr(loader_mod, "world_size", lambda: 2)
    monkeypatch.setattr(loader_mod, "barrier", lambda: calls.append("barrier"))
    cfg, hooks = SimpleNamespace(loader_probe_batches=4, batch_size=16), SimpleNamespace(device=torch.device("cpu"))
    batch = (torch.zeros(8, 3, 2, 2), torch.zeros(8))
    short = [batch]  # one batch: nothing to time after the first
    monkeypatch.setattr(loader_mod, "reduce_metrics", other_rank_has(4))
    assert loader_mod.probe_loader(short, cfg, hooks) is None
    assert calls == [("max", {"b": 0.0}), ("max", {"short": 1.0})]
    calls.clear()
    monkeypatch.setattr(loader_mod, "reduce_metrics", other_rank_has(0))
    assert loader_mod.probe_loader(short * 8, cfg, hooks) is None
    assert calls == [("max", {"b": -4.0}), ("max", {"short": 1.0})]
    # the other rank can draw 12: no whole round of this rank's 16 workers, which says so to the ranks
    # that could probe 12 (their workers 4 or fewer): none enters the probe's barrier alone
    calls.clear()
    monkeypatch.setattr(loader_mod, "reduce_metrics", other_rank_has(12))
    assert loader_mod.probe_loader(Workers([batch] * 40), cfg, hooks) is None
    assert calls == [("max", {"b": -16.0}), ("max", {"short": 1.0})]
    calls.clear()
    monkeypatch.setattr(loader_mod, "reduce_metrics", other_rank_has(12, short=True))  # seen from a 4-worker rank
    assert loader_mod.probe_loader([batch] * 40, cfg, hooks) is None and "barrier" not in calls


@pytest.mark.parametrize("rank, local, want", [
    (0, 0, ["load", "barrier", "barrier"]),  # node 0's first rank: its turn comes first
    (8, 0, ["barrier", "load", "barrier"]),  # node 1's: after node 0's has the files
    (9, 1, ["barrier", "barrier", "load"]),  # every other rank: once every node's first rank is done
])
def test_cifar10_is_fetched_one_node_at_a_time(monkeypatch, rank, local, want):
    """Two nodes sharing --data-dir: their first ranks must not download into it at the same time. The turns
    are agreed over the group (node 1 holds 4 ranks here, node 0 eight: both take 2 barriers)."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(data, "load_cifar10", lambda d, train: calls.append("load") or (np.zeros(1), np.zeros(1)))
    monkeypatch.setattr(data, "dist", SimpleNamespace(is_initialized=lambda: True, get_rank=lambda: rank,
                                                      get_world_size=lambda: 12,
                                                      barrier=lambda: calls.append("barrier")))
    monkeypatch.setattr("common.distributed.all_gather_object", lambda obj: [obj, 1 if not isinstance(obj, bool)
                                                                             else False])
    monkeypatch.delenv("BENCH_NODE_LOCAL_RANK", raising=False)  # distributed.py's copy of the launcher's index
    monkeypatch.setenv("LOCAL_RANK", str(local))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8" if rank < 8 else "4")
    monkeypatch.setenv("GROUP_RANK", "0" if rank < 8 else "1")
    cfg = SimpleNamespace(dataset="cifar10", data_dir="data", train_samples=0, test_samples=0)
    data.load_arrays(cfg, train=True)
    assert calls == want


def test_a_failed_download_is_raised_on_every_rank_after_the_turns(monkeypatch):
    """The failing rank raises its own error; a rank of another node raises too, without touching the folder."""
    from types import SimpleNamespace

    def fail(d, train):
        calls.append("load")
        raise UsageError("CIFAR10 download failed")

    for rank, local, failed_elsewhere, want in ((0, "0", False, "download failed"), (3, "1", True, "another node")):
        calls = []
        monkeypatch.setattr(data, "load_cifar10", fail)
        monkeypatch.setattr(data, "dist", SimpleNamespace(is_initialized=lambda: True, get_rank=lambda: rank,
                                                          get_world_size=lambda: 4,
                                                          barrier=lambda: calls.append("barrier")))
        monkeypatch.setattr("common.distributed.all_gather_object",
                            lambda obj: [obj, failed_elsewhere] if isinstance(obj, bool) else [obj, 1])
        monkeypatch.delenv("BENCH_NODE_LOCAL_RANK", raising=False)
        monkeypatch.delenv("GROUP_RANK", raising=False)
        monkeypatch.setenv("LOCAL_RANK", local)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        with pytest.raises(UsageError, match=want):
            data.load_arrays(SimpleNamespace(dataset="cifar10", data_dir="d", train_samples=0, test_samples=0), True)
        assert calls == (["load", "barrier", "barrier"] if rank == 0 else ["barrier", "barrier"])
