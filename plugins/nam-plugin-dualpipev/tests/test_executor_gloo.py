"""DualPipeV on 2 gloo processes equals the same 4 stages run in sequence in one process: every
micro-batch's loss and every parameter gradient (the backward of the sum of the losses), fp32, rtol 1e-5 /
atol 1e-6. Negative controls show the comparison catches a dropped micro-batch and a mis-built V.

One spawn runs every 2-rank scenario (starting processes is most of the time on a 2-core machine); a
second one runs 3 ranks, where the middle rank talks to both neighbours."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import dualpipev_toy as toy  # noqa: E402  (a helper beside this file, importable by the spawned processes)

PP = 2
SCENARIOS = [
    {"name": "even", "microbatches": 4, "seed": 1},
    {"name": "odd", "microbatches": 7, "seed": 2},
    {"name": "dropped", "microbatches": 5, "seed": 3},  # compared with 6 micro-batches
    {"name": "misbuilt", "microbatches": 4, "seed": 1, "swap_chunks_on": 1},
    {"name": "adapter", "via": "adapter", "microbatches": 5, "seed": 4},
    {"name": "eval", "microbatches": 4, "seed": 5, "train": False},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return toy.spawn(tmp_path_factory.mktemp("gloo"), PP, SCENARIOS)


@pytest.mark.parametrize("name", ["even", "odd"])
def test_losses_and_gradients_equal_the_single_process_run(results, name):
    s = next(s for s in SCENARIOS if s["name"] == name)
    toy.assert_matches(results[name], toy.reference(PP, s["microbatches"], s["seed"]))
    assert results[name]["other_ranks_losses"] == [[]]  # the loss lives on rank 0 only


def test_the_comparison_catches_a_dropped_microbatch(results):
    run, ref = results["dropped"], toy.reference(PP, 6, seed=3)
    # Every loss the run computed is right (the first 5 micro-batches are the same draws) ...
    for got, want in zip(run["losses"], ref["losses"]):
        torch.testing.assert_close(got, want, rtol=toy.RTOL, atol=toy.ATOL)
    # ... and still the gradients give the missing micro-batch away.
    with pytest.raises(AssertionError, match="gradient of stage"):
        toy.assert_matches({**run, "losses": ref["losses"]}, ref)


def test_the_comparison_catches_a_misbuilt_v(results):
    with pytest.raises(AssertionError, match="loss of micro-batch 0"):
        toy.assert_matches(results["misbuilt"], toy.reference(PP, 4, seed=1))


def test_the_engine_adapter_scales_by_microbatches_and_the_loss_scale_then_finalizes(results):
    run = results["adapter"]
    ref = toy.reference(PP, 5, seed=4, scale=2.0 / 5)  # ToyConfig.grad_scale_func doubles; 5 micro-batches
    toy.assert_matches(run, ref)
    assert run["finalized"] == [1, 1]  # finalize_model_grads_func once per rank, after the last backward


def test_forward_only_gives_the_losses_and_no_gradient(results):
    run = results["eval"]
    ref = toy.reference(PP, 4, seed=5)
    for got, want in zip(run["losses"], ref["losses"], strict=True):
        torch.testing.assert_close(got, want, rtol=toy.RTOL, atol=toy.ATOL)
    assert all(g is None for g in run["grads"].values())


def test_three_ranks_middle_rank_with_two_neighbours(tmp_path_factory):
    """pp=3: rank 1 exchanges with both neighbours, some batches hold three receives."""
    run = toy.spawn(tmp_path_factory.mktemp("gloo3"), 3, [{"name": "pp3", "microbatches": 7, "seed": 6}])["pp3"]
    toy.assert_matches(run, toy.reference(3, 7, seed=6))
    assert run["other_ranks_losses"] == [[], []]
