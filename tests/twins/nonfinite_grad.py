"""CPU twin for a library's skipped optimizer step: the unchanged script, with the gradient of the
model's last Linear weight made inf on chosen backward passes (every rank), so that the strategy's
own non-finite check (DeepSpeed's engine in any precision, GradScaler in fp16) skips those steps:

    NONFINITE_AT=3 torchrun --nproc_per_node 2 tests/twins/nonfinite_grad.py pytorch_DeepSpeed.py --precision bf16 ...

NONFINITE_AT: comma-separated backward passes, counted from 1.
"""
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.chdir(ROOT)

import torch  # noqa: E402

import common  # noqa: E402

_build = common.build_model


def build_model(*args, **kwargs):
    model = _build(*args, **kwargs)
    at = {int(n) for n in os.environ["NONFINITE_AT"].split(",")}
    seen = [0]

    def poison(grad):
        seen[0] += 1
        return torch.full_like(grad, float("inf")) if seen[0] in at else grad

    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    last.weight.register_hook(poison)  # the Parameter object survives the engine's cast to bf16
    return model


common.build_model = build_model  # the scripts import it from common when runpy runs them
if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    sys.argv[0] = os.path.join(ROOT, sys.argv[0])
    runpy.run_path(sys.argv[0], run_name="__main__")
