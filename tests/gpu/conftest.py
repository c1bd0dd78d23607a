"""The GPU tier: `python -m pytest -m gpu tests` on a machine with CUDA. Every test here carries the
`gpu` marker and is skipped, with its reason, where CUDA (or enough GPUs) is missing."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            item.add_marker(pytest.mark.slow)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device (none visible)"))
