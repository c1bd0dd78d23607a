"""CIFAR10 and a learnable synthetic twin, both held as uint8 arrays [N, 32, 32, 3].

Two input pipelines over the same arrays:
  torch: DataLoader + DistributedSampler, transforms on CPU workers (the classic pipeline);
  gpu:   the whole uint8 array on the device, crop/flip/resize/normalize per batch on the device.
Evaluation shards the test set over ranks without dropping or duplicating a sample: every rank
gets the same number of batches (FSDP/DeepSpeed need that), padded entries carry valid=False.
"""
from __future__ import annotations

import math
import os
import pickle

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision.transforms import v2

from .config import TrainConfig, UsageError
from .launching import local_world_size
from .names import NUM_CLASSES

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_FILES = {True: [f"data_batch_{i}" for i in range(1, 6)], False: ["test_batch"]}
CIFAR_SIZES = {True: 50_000, False: 10_000}
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def _download_cifar10(root: str) -> None:
    import torchvision

    folder = os.path.join(root, CIFAR_FOLDER)
    try:
        torchvision.datasets.CIFAR10(root, train=True, download=True)
    except Exception as exc:  # offline, DNS, disk full: all end the same way for the user
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"CIFAR10 not found in {folder} and could not be downloaded ({reason}); "
                         f"put the python version of CIFAR10 there, or use --dataset synthetic") from None


def load_cifar10(root: str, train: bool, download: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Reads the python-pickle release of CIFAR10; downloads it (torchvision, md5-checked) when missing."""
    folder = os.path.join(root, CIFAR_FOLDER)
    paths = [os.path.join(folder, name) for name in CIFAR_FILES[train]]
    if not all(os.path.isfile(p) for p in paths):
        if not download:
            raise UsageError(f"CIFAR10 not found in {folder}; use --dataset synthetic to run without it")
        _download_cifar10(root)
    images, labels = [], []
    for path in paths:
        try:
            with open(path, "rb") as fh:
                batch = pickle.load(fh, encoding="bytes")
            data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
            lab = np.asarray(batch[b"labels"], dtype=np.int64)
            if len(data) != len(lab) or lab.min() < 0 or lab.max() >= NUM_CLASSES:
                raise ValueError("images and labels disagree")
        except Exception as exc:
            raise UsageError(f"CIFAR10 file {path} is corrupt ({type(exc).__name__}); "
                             f"delete {folder} to download it again, or use --dataset synthetic") from None
        images.append(data)
        labels.append(lab)
    return np.ascontiguousarray(np.concatenate(images)), np.concatenate(labels)


def make_synthetic(n: int, seed: int, train: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each class a smooth, mirror-symmetric colour pattern (so flips and small crops keep it) plus
    strong per-pixel noise. Deterministic per seed; train and test share the class patterns."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(NUM_CLASSES, 3, 4, 4, generator=g)
    coarse = (coarse + coarse.flip(-1)) / 2
    patterns = F.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)
    patterns = patterns / patterns.std(dim=(1, 2, 3), keepdim=True)
    gs = torch.Generator().manual_seed(seed * 2 + (1 if train else 2))
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=gs)
    images = torch.empty(n, 32, 32, 3, dtype=torch.uint8)
    for start in range(0, n, 4096):
        lab = labels[start:start + 4096]
        noise = torch.randn(len(lab), 3, 32, 32, generator=gs)
        x = 128 + 24 * patterns[lab] + 64 * noise
        images[start:start + 4096] = x.clamp(0, 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    return images.numpy(), labels.numpy()


def load_arrays(cfg, train: bool) -> tuple[np.ndarray, np.ndarray]:
    limit = cfg.train_samples if train else cfg.test_samples
    if cfg.dataset == "synthetic":
        return make_synthetic(limit or CIFAR_SIZES[train], cfg.seed, train)
    images, labels = _load_node_by_node(cfg.data_dir, train) if dist.is_initialized() else \
        load_cifar10(cfg.data_dir, train)
    if limit:
        images, labels = images[:limit], labels[:limit]
    return images, labels


def _load_node_by_node(data_dir: str, train: bool) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR10 in a process group: each node's local rank 0 in turn (it downloads what is missing), then the
    other ranks. A --data-dir the nodes share is then complete before the next node looks: torchvision writes
    the archive straight to its final name and extracts it in place (datasets/utils.py download_url,
    cifar.py), so two nodes downloading into one folder at once corrupt it. The node is torchrun's GROUP_RANK
    and the turns are agreed over the group, so nodes of different sizes take the same barriers; a failure
    anywhere is raised on every rank after the turns, before any other rank tries the folder."""
    from .distributed import all_gather_object
    from .distributed import local_rank as node_index

    per_node = local_world_size() or dist.get_world_size()
    node = int(os.environ.get("GROUP_RANK", dist.get_rank() // per_node))
    out, error = None, None
    for turn in range(max(all_gather_object(node)) + 1):
        if node_index() == 0 and node == turn:
            try:
                out = load_cifar10(data_dir, train)
            except Exception as e:  # noqa: BLE001  (raised below, once every node has had its turn)
                error = e
        dist.barrier()
    if any(all_gather_object(error is not None)):
        raise error or UsageError("CIFAR10 could not be loaded on another node (its log says why)")
    return out if out is not None else load_cifar10(data_dir, train)


def transforms(image_size: int, train: bool) -> v2.Compose:
    """train=True adds the random crop and flip."""
    steps = [v2.ToImage()]
    if image_size != 32:
        steps.append(v2.Resize((image_size, image_size), antialias=True))
    if train:
        steps += [v2.RandomCrop(image_size, padding=image_size // 8), v2.RandomHorizontalFlip()]
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    return v2.Compose(steps)


# what a loader without inputs yields for an image: 3 channels of no pixels, so that a batch of them still
# moves to the device and takes channels-last like a batch of images (common/train.py _to_device)
NO_IMAGE = (3, 0, 0)


class ArrayDataset(Dataset):
    """(image, label); transform None: the labels alone, each with an image of no pixels."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform):
        self.images, self.labels, self.transform = images, labels, transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.transform(self.images[i]) if self.transform is not None else torch.empty(NO_IMAGE)
        return x, int(self.labels[i])


def eval_indices(n: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r takes samples r, r+W, r+2W, ...; shards are padded to equal length, padding marked invalid."""
    per_rank = math.ceil(n / world_size)
    idx = rank + world_size * torch.arange(per_rank)
    valid = idx < n
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


class EvalShard(Dataset):
    def __init__(self, base: Dataset, rank: int, world_size: int):
        self.base = base
        self.idx, self.valid = eval_indices(len(base), rank, world_size)

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        x, y = self.base[int(self.idx[i])]
        return x, y, bool(self.valid[i])


def per_rank_batch(cfg: TrainConfig, world_size: int) -> int:
    parts = world_size * cfg.grad_accum
    if cfg.batch_size % parts:
        raise UsageError(f"--batch-size {cfg.batch_size} (global) does not divide by world size {world_size} "
                         f"x grad-accum {cfg.grad_accum}; use a multiple of {parts}")
    return cfg.batch_size // parts


def augmentation_seed(seed: int, epoch: int, rank: int) -> int:
    """A seed per (run seed, epoch, rank), independent of the shuffling seed."""
    return int(np.random.SeedSequence([seed, epoch, rank, 1]).generate_state(1)[0])


class GpuLoader:
    """Device-resident batches; same sharding, shuffling per epoch and drop_last as DistributedSampler.
    inputs=False: the labels alone, each batch's images of no pixels (NO_IMAGE), none held on the device."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, batch: int, rank: int, world_size: int,
                 seed: int, train: bool, image_size: int, device: torch.device, augment: bool = True,
                 inputs: bool = True):
        # uint8 NHWC: 150 MB for CIFAR10's train set
        self.images = torch.from_numpy(images).to(device) if inputs else None
        self.labels = torch.from_numpy(labels).to(device)
        self.batch, self.rank, self.world_size = batch, rank, world_size
        self.seed, self.train, self.size, self.device = seed, train, image_size, device
        self.augment = augment and train
        self.epoch = 0
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
        n = len(labels)
        if train:
            self.num_samples = n // world_size
            self.idx = self.valid = None
        else:
            idx, valid = eval_indices(n, rank, world_size)
            self.idx, self.valid = idx.to(device), valid.to(device)
            self.num_samples = len(idx)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return self.num_samples // self.batch if self.train else math.ceil(self.num_samples / self.batch)

    def _transform(self, x: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        x = x.permute(0, 3, 1, 2).float().div_(255)
        if self.size != x.shape[-1]:
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False)
        if self.augment:
            b, pad, s = x.shape[0], self.size // 8, self.size
            x = F.pad(x, (pad, pad, pad, pad))
            off = torch.randint(0, 2 * pad + 1, (2, b), generator=gen).to(self.device, non_blocking=True)
            ar = torch.arange(s, device=self.device)
            rows, cols = (off[0][:, None] + ar)[:, None, :, None], (off[1][:, None] + ar)[:, None, None, :]
            x = x[torch.arange(b, device=self.device)[:, None, None, None],
                  torch.arange(3, device=self.device)[None, :, None, None], rows, cols]
            flip = (torch.rand(b, generator=gen) < 0.5).to(self.device, non_blocking=True)
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        return (x - self.mean) / self.std

    def __iter__(self):
        if self.train:
            # one permutation for all ranks (each takes its shard of it), but each rank its own crops
            # and flips: augmentation drawn from the shared generator would repeat across ranks
            perm = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            shard = perm[: self.num_samples * self.world_size][self.rank::self.world_size].to(self.device)
            aug = torch.Generator().manual_seed(augmentation_seed(self.seed, self.epoch, self.rank))
            for start in range(0, len(self) * self.batch, self.batch):
                sel = shard[start:start + self.batch]
                x = (self._transform(self.images[sel], aug) if self.images is not None
                     else torch.empty((len(sel), *NO_IMAGE), device=self.device))
                yield x, self.labels[sel]
        else:
            for start in range(0, self.num_samples, self.batch):
                sel, ok = self.idx[start:start + self.batch], self.valid[start:start + self.batch]
                yield self._transform(self.images[sel], None), self.labels[sel], ok


def node_cpus(environ=os.environ) -> tuple[int, int]:
    """(CPUs this process may run on, processes its launcher started on this node): torchrun's
    LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE, else 1. The node's ranks inherit one affinity
    (a Slurm step's CPUs, a container's cpuset), so each rank's share is the first over the second."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        cpus = os.cpu_count() or 1
    return cpus, max(1, local_world_size(environ) or 1)


_SIZED: list[str] = []  # the line size_workers printed (once per process)


def size_workers(cfg: TrainConfig, environ=os.environ) -> int:
    """--workers, capped at this rank's share of the node's CPUs (at least 1 where any was asked), and
    stored back in cfg.workers, so that the row's `workers` says what ran. 8 ranks of 4 workers each on
    a 16-core node would be 40 processes resizing images on 16 cores: the loader then bounds the step,
    and the only sign was the warning after the run. Rank 0 says once what it found."""
    cpus, local = node_cpus(environ)
    asked, share = cfg.workers, max(1, cpus // local)
    cfg.workers = min(asked, share)
    if not _SIZED and int(environ.get("RANK", "0")) == 0:
        capped = f" (--workers {asked} capped at the rank's share)" if cfg.workers < asked else ""
        _SIZED.append(f"rank 0: {cpus} CPUs for {local} processes on its node; {cfg.workers} DataLoader "
                      f"workers per rank{capped}")
        print(_SIZED[0], flush=True)
    return cfg.workers


def build_loaders(cfg: TrainConfig, rank: int, world_size: int, device: torch.device, inputs: bool = True):
    """Returns (train_loader, test_loader). Train batches are per-rank micro-batches; the test loader
    yields (images, labels, valid) with every test sample valid on exactly one rank. inputs=False: train
    batches of the same labels in the same order without their images (no pixels, no workers, no training
    image kept): a pipeline's later stages, which read only the labels (pytorch_PP.py)."""
    if cfg.loader == "torch":
        size_workers(cfg)
    batch = per_rank_batch(cfg, world_size)
    images, labels = load_arrays(cfg, True)
    if len(labels) < batch * world_size * cfg.grad_accum:
        raise UsageError(f"{len(labels)} training samples are fewer than one global batch "
                         f"({cfg.batch_size}); raise --train-samples or lower --batch-size")
    test = build_test_loader(cfg, rank, world_size, device, max(1, cfg.batch_size // world_size))
    if cfg.loader == "gpu":
        return GpuLoader(images, labels, batch, rank, world_size, cfg.seed, True, cfg.image_size, device,
                         cfg.augment, inputs), test
    train_ds = (ArrayDataset(images, labels, transforms(cfg.image_size, cfg.augment)) if inputs
                else ArrayDataset(None, labels, None))  # the images let go: 150 MB of CIFAR10's a rank
    # the order is the sampler's (seed and epoch), not the transforms' random state: the same without images
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=cfg.seed, drop_last=True)
    kwargs = _loader_kwargs(cfg, rank, device)
    if not inputs:  # labels are read from an array in the rank's own process
        kwargs.update(num_workers=0, persistent_workers=False, pin_memory=False)
    return DataLoader(train_ds, batch_size=batch, sampler=sampler, drop_last=True, **kwargs), test


def build_test_loader(cfg, rank: int, world_size: int, device: torch.device, batch: int):
    """Every test sample on exactly one rank, batches of (images, labels, valid)."""
    images, labels = load_arrays(cfg, False)
    if cfg.loader == "gpu":
        return GpuLoader(images, labels, batch, rank, world_size, cfg.seed, False, cfg.image_size, device)
    test_ds = EvalShard(ArrayDataset(images, labels, transforms(cfg.image_size, False)), rank, world_size)
    return DataLoader(test_ds, batch_size=batch, shuffle=False, **_loader_kwargs(cfg, rank, device))


def _loader_kwargs(cfg, rank: int, device: torch.device) -> dict:
    return dict(num_workers=cfg.workers, pin_memory=device.type == "cuda", persistent_workers=cfg.workers > 0,
                generator=torch.Generator().manual_seed(cfg.seed + rank))
