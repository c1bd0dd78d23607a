"""DDP (3 ranks x B/3), DDP+ZeRO, FSDP, DeepSpeed and the same through accelerate must train exactly like
one process with batch B. The runs are the shared fp32 launches of tests/launches.py.

BatchNorm: with --freeze-bn every BN layer runs in eval mode (fixed running statistics), so the
loss of a batch no longer depends on how it is split over ranks; augmentation is off so both
runs see the same pixels. DistributedSampler with one permutation per seed gives rank r the
samples P[r::3]: the union of the three ranks' micro-batches at step k is the single process's batch k.
What remains is float summation order (one sum over B vs an all-reduce of three sums over B/3):
about 1e-7 relative per operation. TOLERANCE allows 1e-4 absolute on weights after 4 SGD steps
at lr 0.05; a wrong gradient average (sum instead of mean, a missed all-reduce) moves weights by
about lr x |grad| ~ 1e-2, a hundred times more, so the test still catches it.

Model and pipeline parallelism split the model instead of the batch. pytorch_MP.py runs the same
batches through two halves: the same arithmetic, weights equal to pytorch_SingleGPU.py's. The
pipeline (2 ranks, one stage each) cuts every batch of 12 into 4 micro-batches of 3: BatchNorm in
train mode would normalize each micro-batch by its own mean and variance, a different function
than one batch of 12 (and update the running statistics 4 times a step), so only --freeze-bn makes
the pipeline equal to one process. The schedule divides the sum of the micro-batch mean-loss
gradients by 4: the gradient of the batch mean, up to summation order.
"""
import pytest
import torch
from helpers import check_ok

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4

# the shared fp32 runs (tests/launches.py: no augmentation, --freeze-bn, no warm-up), and two variants
SAME = ["pytorch_DDP-fp32", "pytorch_DDP_ZeRO-fp32", "pytorch_FSDP-fp32", "pytorch_DeepSpeed-fp32",
        "pytorch_DDP-fp32-accum2", "pytorch_PP-fp32", "pytorch_PP-fp32-1f1b", "pytorch_MP-fp32",
        "accelerate_DDP-fp32", "accelerate_DeepSpeed-fp32"]
# the same runs with their state in host memory, through the CPU twin of the CUDA-only flags
# (tests/twins/cuda_flags_on_cpu.py): FSDP2's CPUOffloadPolicy, DeepSpeed's ZeRO-3 offload of parameters and
# optimizer state
OFFLOADED = {"pytorch_FSDP-cpu-offload-twin": "fsdp_full-shard_offload",
             "pytorch_DeepSpeed-offload-twin": "deepspeed_zero3_offload"}


def final(result):
    check_ok(result.proc)
    return torch.load(result.final(), map_location="cpu", weights_only=True)


@pytest.mark.parametrize("name", SAME + list(OFFLOADED))
@pytest.mark.launches("pytorch_SingleGPU-fp32", "{name}")
def test_same_weights_as_one_process(runs, name):
    """DeepSpeed and accelerate's DeepSpeed run ZeRO-3 (their fp32 JSON); the pipelines cut each batch
    into 4 micro-batches (GPipe; 1F1B with ResNet's stages split 2,2); grad-accum: 2 ranks x 2
    accumulated micro-batches of 3, each micro-batch's loss divided by 2 before backward (else the
    summed gradient is twice the one-process gradient)."""
    one, r = runs
    ref_sd, ref_loss = final(one), float(one.row["train_loss"])
    sd = final(r)
    diff = max((sd[k].float() - ref_sd[k].float()).abs().max().item() for k in ref_sd)
    moved = max((ref_sd[k].float() - final_init(k, ref_sd)).abs().max().item() for k in ("fc.weight",))
    loss = float(r.row["train_loss"])
    print(f"{name}: max |w - w_single| = {diff:.2e}, |loss - loss_single| = {abs(loss - ref_loss):.2e}")
    assert moved > 100 * TOLERANCE  # training really changed the weights
    assert diff < TOLERANCE
    assert abs(loss - ref_loss) < 1e-4
    if name in OFFLOADED:
        assert (r.row["strategy"], r.row["offload"]) == (OFFLOADED[name], "True"), r.row


@pytest.mark.launches("pytorch_SingleGPU-bn-train", "pytorch_DDP-sync-bn-twin")
def test_sync_bn_normalizes_each_rank_by_the_global_batch(runs):
    """--sync-bn (through its CPU twin) with BatchNorm in train mode: each rank's 4 images are normalized by
    the mean and variance of all 12, so one step at 3 ranks is one process's step of 12, its weights and its
    running statistics (one step: later steps amplify float32 rounding through BatchNorm's backward, to 1e-3
    after four). Without SyncBatchNorm each rank normalizes by its own 4 images: the running variances end
    about 1 apart."""
    one, r = runs
    ref_sd, sd = final(one), final(r)
    assert any(k.endswith("running_var") for k in ref_sd)
    diff = max((sd[k].float() - ref_sd[k].float()).abs().max().item() for k in ref_sd)
    moved = max((ref_sd[k] - 1).abs().max().item() for k in ref_sd if k.endswith("running_var"))  # from 1 at init
    print(f"sync-bn: max |w - w_single| = {diff:.2e} (running statistics included), statistics moved {moved:.2f}")
    assert moved > 100 * TOLERANCE and diff < TOLERANCE
    assert abs(float(r.row["train_loss"]) - float(one.row["train_loss"])) < 1e-4


def final_init(key, ref_sd):
    """The head's initial weights (seed 0), to check that the runs moved far more than the tolerance."""
    from common.config import TrainConfig
    from common.models import build_model
    from common.precision import seed_everything

    seed_everything(0)
    return build_model(TrainConfig(model="resnet18", pretrained=False)).state_dict()[key]
