"""DDP (2 ranks x B/2), DDP+ZeRO and FSDP must train exactly like one process with batch B.

BatchNorm: with --freeze-bn every BN layer runs in eval mode (fixed running statistics), so the
loss of a batch no longer depends on how it is split over ranks; augmentation is off so both
runs see the same pixels. DistributedSampler with one permutation per seed gives rank r the
samples P[r::2]: the union of the two ranks' micro-batches at step k is the single process's batch k.
What remains is float summation order (one sum over B vs an all-reduce of two sums over B/2):
about 1e-7 relative per operation. TOLERANCE allows 1e-4 absolute on weights after 6 SGD steps
at lr 0.05; a wrong gradient average (sum instead of mean, a missed all-reduce) moves weights by
about lr x |grad| ~ 1e-2, a hundred times more, so the test still catches it.

Model and pipeline parallelism split the model instead of the batch. pytorch_MP.py runs the same
batches through two halves: the same arithmetic, weights equal to pytorch_SingleGPU.py's. The
pipeline (2 ranks, one stage each) cuts every batch of 16 into 4 micro-batches of 4: BatchNorm in
train mode would normalize each micro-batch by its own mean and variance, a different function
than one batch of 16 (and update the running statistics 4 times a step), so only --freeze-bn makes
the pipeline equal to one process. The schedule divides the sum of the micro-batch mean-loss
gradients by 4: the gradient of the batch mean, up to summation order.
"""
import pytest
import torch
from helpers import check_ok, rows, run, tiny_args

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4


def final(tmp_path, script):
    return torch.load(tmp_path / "ckpt" / script[:-3] / "model_final.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("single")
    check_ok(run("pytorch_SingleGPU.py", args(tmp_path)))
    return final(tmp_path, "pytorch_SingleGPU.py"), float(rows(tmp_path / "summary.csv")[0]["train_loss"])


def args(tmp_path):
    return tiny_args(tmp_path, train_samples=96, batch_size=16, augment=False, freeze_bn=True, warmup_steps=0)


PP = ["--microbatches", "4"]


@pytest.mark.parametrize("script, extra", [
    ("pytorch_DDP.py", []), ("pytorch_DDP_ZeRO.py", []), ("pytorch_FSDP.py", []), ("pytorch_DeepSpeed.py", []),
    # 2 ranks x 2 accumulated micro-batches of 4: the loss of each micro-batch must be divided by 2
    # before backward, else the summed gradient is twice the one-process gradient
    ("pytorch_DDP.py", ["--grad-accum", "2"]),
    ("pytorch_PP.py", PP + ["--schedule", "gpipe"]), ("pytorch_PP.py", PP + ["--schedule", "1f1b", "--split", "2,2"]),
    ("pytorch_MP.py", []),
], ids=["ddp", "ddp_zero", "fsdp", "deepspeed", "ddp_grad_accum", "pp_gpipe", "pp_1f1b", "mp"])
def test_same_weights_as_one_process(tmp_path, reference, script, extra):
    ref_sd, ref_loss = reference
    nproc = 1 if script == "pytorch_MP.py" else 2
    check_ok(run(script, args(tmp_path) + extra, nproc=nproc, launcher="python" if nproc == 1 else "torchrun"))
    sd = final(tmp_path, script)
    diff = max((sd[k].float() - ref_sd[k].float()).abs().max().item() for k in ref_sd)
    moved = max((ref_sd[k].float() - final_init(k, ref_sd)).abs().max().item() for k in ("fc.weight",))
    loss = float(rows(tmp_path / "summary.csv")[0]["train_loss"])
    print(f"{script}: max |w - w_single| = {diff:.2e}, |loss - loss_single| = {abs(loss - ref_loss):.2e}")
    assert moved > 100 * TOLERANCE  # training really changed the weights
    assert diff < TOLERANCE
    assert abs(loss - ref_loss) < 1e-4


def final_init(key, ref_sd):
    """The head's initial weights (seed 0), to check that the runs moved far more than the tolerance."""
    from common.config import TrainConfig
    from common.models import build_model
    from common.precision import seed_everything

    seed_everything(0)
    return build_model(TrainConfig(model="resnet18", pretrained=False)).state_dict()[key]
