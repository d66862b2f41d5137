"""Repository-wide pytest hooks: GPU-marked tests (in tests/ and every plugin) skip without CUDA, with a reason."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu); runs on the GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
