"""pytorch_PP.py as it is, with each rank's lanes printed when the bubble instrument writes its column:
    torchrun --nproc_per_node 2 bubble_lanes.py --split 2,2 --microbatches M --schedule gpipe ...
(the column, pipeline_bubble_pct, is the largest idle share over lanes and ranks; this prints each one)."""
import os
import runpy
import sys

ROOT = os.environ.get("ROOT", "/work/main")
sys.path.insert(0, ROOT)
os.chdir(ROOT)

from common.measure import bubble  # noqa: E402

real_row = bubble.Bubble.row


def row(self):
    rank = int(os.environ.get("RANK", 0))
    lanes = ", ".join(f"{lane.device} busy {lane.busy_s:.2f} s (idle {100 * (1 - lane.busy_s / self.window_s):.1f}%)"
                      for lane in self.lanes)
    print(f"LANES rank {rank}: window {self.window_s:.2f} s; {lanes}", flush=True)
    return real_row(self)


bubble.Bubble.row = row
sys.argv = ["pytorch_PP.py"] + sys.argv[1:]
runpy.run_path(os.path.join(ROOT, "pytorch_PP.py"), run_name="__main__")
