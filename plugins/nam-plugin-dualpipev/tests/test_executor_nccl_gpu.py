"""DualPipeV on 2 GPUs over NCCL equals the same 4 stages in sequence on one GPU (fp32, rtol 1e-5 / atol
1e-6): the NCCL side of the executor, which matches sends to receives by order alone. Marked gpu: skipped with
a reason where CUDA is absent; needs 2 GPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import dualpipev_toy as toy  # noqa: E402

pytestmark = pytest.mark.gpu

SCENARIOS = [
    {"name": "even", "microbatches": 4, "seed": 1},
    {"name": "odd", "microbatches": 9, "seed": 2},
    {"name": "adapter", "via": "adapter", "microbatches": 6, "seed": 4},
    {"name": "eval", "microbatches": 4, "seed": 5, "train": False},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in fp32, as the ranks compute
    return toy.spawn(tmp_path_factory.mktemp("nccl"), 2, SCENARIOS, backend="nccl")


@pytest.mark.parametrize("name", ["even", "odd"])
def test_losses_and_gradients_equal_one_gpu(results, name):
    s = next(s for s in SCENARIOS if s["name"] == name)
    toy.assert_matches(results[name], toy.reference(2, s["microbatches"], s["seed"], device="cuda"))


def test_the_engine_adapter_over_nccl(results):
    toy.assert_matches(results["adapter"], toy.reference(2, 6, seed=4, scale=2.0 / 6, device="cuda"))
    assert results["adapter"]["finalized"] == [1, 1]


def test_forward_only_over_nccl(results):
    ref = toy.reference(2, 4, seed=5, device="cuda")
    for got, want in zip(results["eval"]["losses"], ref["losses"], strict=True):
        torch.testing.assert_close(got, want, rtol=toy.RTOL, atol=toy.ATOL)
    assert all(g is None for g in results["eval"]["grads"].values())
