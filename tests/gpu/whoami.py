"""Prints which physical GPU a launched process sees as cuda:0 (its UUID), then exits.
Accepts and ignores the launchers' own arguments (--local_rank=N from deepspeed)."""
import os

import torch

print(f"WHOAMI rank={os.environ.get('RANK', '0')} uuid={torch.cuda.get_device_properties(0).uuid}", flush=True)
