"""Repository-wide pytest hooks: GPU-marked tests (in tests/ and every plugin) skip without CUDA, with a reason;
the ``load_bench`` and ``small_disk`` fixtures."""

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
import torch

# One intra-op thread per test process unless the caller says otherwise: the tests' tensors are tiny, and on the
# 2-core CI machine torch's default (a thread per core) spent more CPU on hand-offs than it saved
# (tests/test_train.py: 146 -> 126 s wall, 192 -> 114 s of CPU), and left none for the second pytest-xdist worker.
# Subprocesses (nam train, torchrun's ranks) inherit the variable.
if os.environ.setdefault("OMP_NUM_THREADS", "1").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size_mb, read_only=False) -> Path``: a real filesystem of that size (tmpfs), so a full disk
    is the kernel's own short write and ENOSPC, not a fake. Mounting needs root (CAP_SYS_ADMIN): elsewhere the
    test skips, saying so. Unmounted afterwards."""
    mounted = []

    def mount(size_mb: float, *, read_only: bool = False) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        options = f"size={int(size_mb * 1024)}k" + (",ro" if read_only else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"a real small filesystem needs `mount -t tmpfs` (root): {done.stderr.strip() or done.returncode}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)
