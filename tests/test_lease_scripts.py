"""The lease's prepared scripts (.gpu/): what can be checked without a GPU. The shell scripts parse; the DALI
stand-in that lets NVIDIA's ConvNets trainer import (its dataloaders define DALI pipelines at module level) can be
subclassed, fails when used, and leaves the `nvidia` namespace to torch's CUDA wheels."""
import ast
import os
import subprocess
import sys

import pytest
from helpers import ROOT

GPU_DIR = os.path.join(ROOT, ".gpu")


@pytest.mark.parametrize("script", ["run.sh", "peer.sh", "fetch_peer.sh"])
def test_the_lease_scripts_parse(script):
    assert subprocess.run(["bash", "-n", os.path.join(GPU_DIR, script)]).returncode == 0


def test_the_dali_stand_in_imports_as_the_trainer_imports_it():
    code = """
from nvidia.dali.plugin.pytorch import DALIClassificationIterator
from nvidia.dali.pipeline import Pipeline
import nvidia.dali.ops as ops
import nvidia.dali.types as types
import nvidia
class HybridTrainPipe(Pipeline):  # what image_classification/dataloaders.py does at import
    pass
for make in (HybridTrainPipe, DALIClassificationIterator, lambda: ops.FileReader, lambda: types.FLOAT):
    try:
        make()
        raise SystemExit("the stand-in ran")
    except RuntimeError as e:
        assert "DALI is not installed" in str(e), e
print(sorted(p for p in nvidia.__path__))
"""
    env = {**os.environ, "PYTHONPATH": os.path.join(GPU_DIR, "peer_stubs")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    paths = ast.literal_eval(proc.stdout.strip())
    assert any("peer_stubs" in p for p in paths), paths
    # a namespace package: torch's nvidia.* CUDA wheels, where this venv has them, are still found beside it
    site = subprocess.run([sys.executable, "-c", "import nvidia; print(list(nvidia.__path__))"], capture_output=True,
                          text=True, cwd=ROOT)
    wheels = ast.literal_eval(site.stdout.strip()) if site.returncode == 0 else []
    if any(os.path.isdir(os.path.join(p, "cudnn")) for p in wheels):
        proc = subprocess.run([sys.executable, "-c", "import nvidia.cudnn, nvidia.dali"], env=env,
                              capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
