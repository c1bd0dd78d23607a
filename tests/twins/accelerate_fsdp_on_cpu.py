"""CPU twin of accelerate_FSDP.py: the script's own main() with accelerate's FSDP2 path forced on.

On CPU accelerate never picks FSDP (state.py only does for GPU-like devices), so a CPU test would
otherwise never reach accelerate's FSDP2 code: Accelerator.prepare -> _prepare_fsdp2 ->
fsdp2_prepare_model (the wrap policy from our plugin, fully_shard per block with the
MixedPrecisionPolicy), fsdp2_switch_optimizer_parameters, accelerator.backward, clip_grad_norm_
and get_state_dict. This wrapper sets the state accelerate would have set on GPUs (distributed
type FSDP, our plugin with its mixed precision) and runs the unchanged script over gloo:

    torchrun --nproc_per_node 2 tests/twins/accelerate_fsdp_on_cpu.py --device cpu ...
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.chdir(ROOT)

import accelerate  # noqa: E402
from accelerate import DistributedType  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

import accelerate_FSDP  # noqa: E402
from common import launch  # noqa: E402

_Accelerator = accelerate.Accelerator


def forced_fsdp(*args, fsdp_plugin=None, **kwargs):
    accelerator = _Accelerator(*args, **kwargs)
    # a data descriptor on the class wins over the shared instance dict, which accelerate rewrites
    # with DistributedType.NO whenever its state is re-read on CPU
    AcceleratorState.distributed_type = property(lambda self: DistributedType.FSDP, lambda self, value: None)
    accelerator.state.fsdp_plugin = fsdp_plugin
    if accelerator.mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(accelerator.mixed_precision)
    return accelerator


accelerate_FSDP.Accelerator = forced_fsdp
accelerate_FSDP.require_cuda = lambda device, what: None
if __name__ == "__main__":
    sys.modules["__main__"].__doc__ = accelerate_FSDP.__doc__
    launch(accelerate_FSDP.main, "accelerate_FSDP.py", cfg_cls=accelerate_FSDP.DistributedConfig)
