"""Repository-wide pytest hooks: GPU-marked tests (in tests/ and every plugin) skip without CUDA, with a reason;
the ``load_bench`` fixture."""

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent / "bench"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu); runs on the GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def load_bench():
    """``load_bench("production")``: the module of ``bench/production.py``, imported once per session (the
    benchmarks are scripts, not a package)."""
    modules = {}

    def load(name: str):
        if name not in modules:
            spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
            modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[name])
        return modules[name]

    return load
