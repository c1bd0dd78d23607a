"""Resumable training state, written after every epoch into <save_dir>/<script>/resume/.

Layout: resume/epoch<N>/ holds one epoch's state; resume/latest names the newest complete one.
A new epoch is written into epoch<N>.tmp/, renamed when every rank has finished, and only then
does `latest` (replaced atomically) point at it: a kill at any moment leaves the previous state
intact. What goes in: model and optimizer in the strategy's native form (plain state_dicts; the
consolidated ZeRO optimizer; torch.distributed.checkpoint shards for FSDP; DeepSpeed's own
save_checkpoint; accelerate's save_state), the scheduler, the GradScaler, every rank's RNG states
(torch, CUDA, numpy, random, the DataLoader generator) and the run's counters. The sampler needs no
state: DistributedSampler.set_epoch(epoch) makes each epoch's order a function of the epoch alone.
"""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from .config import TrainConfig, UsageError
from .distributed import all_gather_object, barrier, global_rank, grouped
from .launching import local_world_size


def check_shared_dir(folder: str, environ=os.environ, flag: str = "--save-dir") -> None:
    """Refuses, on every rank and before training, a folder (--save-dir's, by default) that not every rank sees
    as one folder.
    Rank 0 creates each epoch's folder and every rank writes into it (Checkpointer.save), and DeepSpeed's
    consolidation on rank 0 reads every rank's shards: on a node-local path (/tmp, /local/scratch) the
    second node's ranks would fail at the first epoch's end, after an epoch of training. Rank 0 writes a
    token there; each rank reads it after a collective; all learn who could not. Skipped on one node
    (the launcher's local world is the whole world: one filesystem). `flag` names the folder's flag in the
    refusal: the folders of --results and --figures are checked too (a failed run's row is written by the
    rank that failed first, on whichever node: common/distributed.py claim_failure_row)."""
    local = local_world_size(environ)
    if not grouped() or dist.get_world_size() == 1 or local == dist.get_world_size():
        return
    import secrets
    import socket

    token, problem = secrets.token_hex(8), ""
    path = os.path.join(folder, f".shared-check-{token}")
    if global_rank() == 0:
        try:
            os.makedirs(folder, exist_ok=True)
            with open(path, "w") as fh:
                fh.write(token)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            problem = f"{flag} {folder} cannot be written on rank 0 ({exc.strerror})"
    token, problem = all_gather_object((token, problem))[0]  # rank 0's, after its write: a collective
    path = os.path.join(folder, f".shared-check-{token}")
    try:
        with open(path) as fh:
            seen = fh.read() == token
    except OSError:
        seen = False
    verdicts = all_gather_object((seen, socket.gethostname()))
    if global_rank() == 0 and not problem:
        os.remove(path)
    blind = [(rank, host) for rank, (ok, host) in enumerate(verdicts) if not ok]
    if problem or blind:
        raise UsageError(problem or f"{flag} {folder} is not one folder for every rank: rank"
                         f"{'s' if len(blind) > 1 else ''} {', '.join(f'{r} ({h})' for r, h in blind)} cannot see "
                         f"what rank 0 ({verdicts[0][1]}) writes there; give a directory on a filesystem every "
                         f"node shares, not a node-local one")


def rng_state(loader) -> dict:
    """This process's random state: Python, NumPy, torch (CPU and CUDA) and the DataLoader's generator."""
    gen = getattr(loader, "generator", None)
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "cuda_device": torch.cuda.current_device() if torch.cuda.is_available() else None,
            "loader": gen.get_state() if isinstance(gen, torch.Generator) else None}


def set_rng_state(state: dict, loader) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["random"])
    cuda = state["cuda"]
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        elif state.get("cuda_device") is not None and state["cuda_device"] < len(cuda):
            # another GPU layout at the same world (1 node x 8 -> 2 x 4, or one GPU visible per process):
            # set_rng_state_all would index past this process's devices (torch/cuda/random.py, IndexError);
            # this rank's own device takes the state it had, the others keep theirs
            torch.cuda.set_rng_state(cuda[state["cuda_device"]])
    gen = getattr(loader, "generator", None)
    if state["loader"] is not None and isinstance(gen, torch.Generator):
        gen.set_state(state["loader"])


def load_optimizer(optimizer, state: dict) -> None:
    """optimizer.load_state_dict, keeping this run's kernels. A saved param_group carries its "fused" and
    "foreach" flags, and load_state_dict puts them back (torch/optim/optimizer.py update_group): a state
    written by a foreach optimizer would turn a fused one foreach while GradScaler, seeing
    _step_supports_amp_scaling, still hands it grad_scale, and SGD's foreach path raises "Expected
    grad_scale and found_inf to be None" (torch/optim/sgd.py)."""
    kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, kept in zip(optimizer.param_groups, kernels):
        group.update(kept)
    # the saved groups replace this optimizer's (torch/optim/optimizer.py update_group): AdamW's groups in an SGD
    # failed at its first step with KeyError 'momentum'. A key a newer torch added is back: __setstate__ sets it
    missing = sorted({k for g in optimizer.param_groups for k in getattr(optimizer, "defaults", {}) if k not in g})
    if missing:
        raise ValueError(f"its optimizer state has no {', '.join(missing)}: it was written by another optimizer "
                         "(--optimizer)")


def _load(path: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise UsageError(f"resume checkpoint is incomplete: {path} is missing") from None
    except Exception as exc:
        raise UsageError(f"resume checkpoint {path} is corrupt ({type(exc).__name__}); "
                         f"delete it or start without --resume") from None


class Checkpointer:
    """Plain model/optimizer state_dicts written by rank 0 (single device, DataParallel, DDP)."""

    final_reads_every_rank = False  # the final weights need the shards every rank wrote (fit checks --save-dir)

    def __init__(self, cfg: TrainConfig, script: str, model, optimizer, scheduler=None, scaler=None,
                 train_loader=None):
        self.root = os.path.join(cfg.save_dir, os.path.splitext(os.path.basename(script))[0], "resume")
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.loader = train_loader
        self.loaded_from = None
        # what a checkpoint must have been trained with to be resumed here: its weights' and optimizer state's
        # shapes (a precision may change: the scaler's state is loaded only where both runs have one)
        self.fits = {"model": cfg.model, "optimizer": cfg.optimizer}

    # --- the strategy-specific part: override these two ---
    def save_native(self, folder: str) -> None:
        module = getattr(self.model, "module", self.model)
        optimizer_state = self.optimizer.state_dict()
        if global_rank() == 0:
            torch.save({"model": module.state_dict(), "optimizer": optimizer_state}, os.path.join(folder, "native.pt"))

    def load_native(self, folder: str) -> None:
        state = _load(os.path.join(folder, "native.pt"))
        getattr(self.model, "module", self.model).load_state_dict(state["model"])
        load_optimizer(self.optimizer, state["optimizer"])

    # --- shared ---
    def describe(self) -> str:
        return self.loaded_from or self.root

    def save(self, epoch: int, meta: dict) -> None:
        final = os.path.join(self.root, f"epoch{epoch}")
        tmp = final + ".tmp"
        if global_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier()
        self.save_native(tmp)
        torch.save(rng_state(self.loader), os.path.join(tmp, f"rng_rank{global_rank()}.pt"))
        if global_rank() == 0:
            torch.save({"meta": meta, "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                        "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                        "world_size": dist.get_world_size() if dist.is_initialized() else 1, "fits": self.fits},
                       os.path.join(tmp, "run.pt"))
        barrier()
        if global_rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            with open(os.path.join(self.root, "latest.tmp"), "w") as fh:
                fh.write(f"epoch{epoch}\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(os.path.join(self.root, "latest.tmp"), os.path.join(self.root, "latest"))
            for name in os.listdir(self.root):  # keep only the newest complete epoch
                if name.startswith("epoch") and name != f"epoch{epoch}":
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        barrier()

    def _folder(self, resume: str) -> str | None:
        if resume == "auto":
            pointer = os.path.join(self.root, "latest")
            if not os.path.exists(pointer):
                return None
            with open(pointer) as fh:
                return os.path.join(self.root, fh.read().strip())
        folder = resume
        if os.path.isfile(os.path.join(folder, "latest")):
            with open(os.path.join(folder, "latest")) as fh:
                folder = os.path.join(folder, fh.read().strip())
        if not os.path.isfile(os.path.join(folder, "run.pt")):
            raise UsageError(f"--resume {resume}: no checkpoint there (expected a resume/ folder or one of its "
                             f"epoch<N>/ folders)")
        return folder

    def load(self, resume: str) -> dict | None:
        folder = self._folder(resume)
        if folder is None:
            if global_rank() == 0:
                print(f"--resume auto: no checkpoint in {self.root}, starting from scratch", flush=True)
            return None
        run = _load(os.path.join(folder, "run.pt"))
        world = dist.get_world_size() if dist.is_initialized() else 1
        if run["world_size"] != world:
            raise UsageError(f"checkpoint {folder} was written by {run['world_size']} processes, this run has "
                             f"{world}: resume with the same world size")
        self._check_fits(folder, run.get("fits", {}))  # earlier versions' checkpoints have none
        try:
            self.load_native(folder)
        except (torch.OutOfMemoryError, dist.DistError):  # the run's own failure (an oom row, exit 4), not the file's
            raise
        except (RuntimeError, KeyError, ValueError) as exc:  # a state_dict of another shape, optimizer, ...
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            raise UsageError(f"checkpoint {folder} does not fit this run ({why}): resume with the flags it was "
                             "trained with, or start without --resume") from None
        if self.scheduler is not None and run["scheduler"] is not None:
            self.scheduler.load_state_dict(run["scheduler"])
        if self.scaler is not None and run["scaler"] is not None:
            self.scaler.load_state_dict(run["scaler"])
        set_rng_state(_load(os.path.join(folder, f"rng_rank{global_rank()}.pt")), self.loader)
        self.loaded_from = folder
        return run["meta"]


    def _check_fits(self, folder: str, saved: dict) -> None:
        diff = [f"--{k.replace('_', '-')} {saved[k]}" for k in self.fits if k in saved and saved[k] != self.fits[k]]
        if diff:
            raise UsageError(f"checkpoint {folder} was trained with {', '.join(diff)}: resume with the same flags, "
                             "or start without --resume")


class ZeroCheckpointer(Checkpointer):
    """ZeroRedundancyOptimizer: each rank holds a shard; consolidated onto rank 0 before saving."""

    def save_native(self, folder: str) -> None:
        self.optimizer.consolidate_state_dict(to=0)
        if global_rank() == 0:
            torch.save({"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict()},
                       os.path.join(folder, "native.pt"))


class RankCheckpointer(Checkpointer):
    """Pipeline stages: each rank holds other weights and optimizer state, and writes its own file."""

    def save_native(self, folder: str) -> None:
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                   os.path.join(folder, f"native_rank{global_rank()}.pt"))

    def load_native(self, folder: str) -> None:
        state = _load(os.path.join(folder, f"native_rank{global_rank()}.pt"))
        self.model.load_state_dict(state["model"])
        load_optimizer(self.optimizer, state["optimizer"])


class DCPCheckpointer(Checkpointer):
    """FSDP2: every rank writes its own shards with torch.distributed.checkpoint."""

    def save_native(self, folder: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(folder, "dcp"))

    def load_native(self, folder: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        try:
            dcp.load(state, checkpoint_id=os.path.join(folder, "dcp"))
        except Exception as exc:
            raise UsageError(f"FSDP checkpoint {folder}/dcp cannot be read ({type(exc).__name__})") from None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


class DeepSpeedCheckpointer(Checkpointer):
    """DeepSpeed's own save_checkpoint/load_checkpoint (engine, ZeRO shards, its loss scaler, the scheduler)."""

    final_reads_every_rank = True  # pytorch_DeepSpeed.py: rank 0 consolidates every rank's ZeRO shards

    def save_native(self, folder: str) -> None:
        self.model.save_checkpoint(folder, tag="state")

    def load_native(self, folder: str) -> None:
        path, _ = self.model.load_checkpoint(folder, tag="state")
        if path is None:
            raise UsageError(f"DeepSpeed checkpoint {folder} cannot be read")


class AccelerateCheckpointer(Checkpointer):
    """accelerate's save_state/load_state (model, optimizer, scaler, RNG of the prepared objects)."""

    def __init__(self, *args, accelerator, **kwargs):
        super().__init__(*args, **kwargs)
        self.accelerator = accelerator

    def save_native(self, folder: str) -> None:
        self.accelerator.save_state(os.path.join(folder, "accelerate"))

    def load_native(self, folder: str) -> None:
        self.accelerator.load_state(os.path.join(folder, "accelerate"))


# --- the final weights every script writes ---

def strip_prefixes(state_dict: dict) -> dict:
    """Plain torchvision keys: no 'module.' (DDP/DP), '_orig_mod.' (torch.compile) prefixes."""
    out = {}
    for k, v in state_dict.items():
        for p in ("module.", "_orig_mod."):
            while k.startswith(p):
                k = k[len(p):]
        out[k] = v.detach().cpu() if isinstance(v, torch.Tensor) else v
    return out


def final_path(cfg: TrainConfig, script: str) -> str:
    return os.path.join(cfg.save_dir, os.path.splitext(os.path.basename(script))[0], "model_final.pt")


def save_final(state_dict: dict, cfg: TrainConfig, script: str) -> str:
    """Global rank 0 writes the bare model's fp32 state_dict atomically (temporary file, then rename)."""
    path = final_path(cfg, script)
    if global_rank() != 0:
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sd = {k: (v.float() if torch.is_floating_point(v) else v) for k, v in strip_prefixes(state_dict).items()}
    tmp = path + ".tmp"
    torch.save(sd, tmp)
    os.replace(tmp, path)
    return path
