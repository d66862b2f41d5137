"""The grouped experts' logic on the CPU: sorting, group ends, the gate, the scatter back and the sorted
(Megatron) entry, against the reference experts in float64 on fresh random inputs.

torch's grouped GEMM has no backward on the CPU, so these tests hand the backend a per-group loop with the
same contract (``loop_grouped_mm``); the product never takes another GEMM than torch's (GPU parity:
test_grouped_moe_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from nam56r.experts import expert_of_rows, group_ends, sort_by_expert
from nam56r.reference.moe import ReferenceExperts
from nam56r.testing import random_expert_inputs, run_experts
from nam_core.testing import max_rel_error, new_seed
from nam_plugin_grouped_moe.experts import GroupedExperts


def loop_grouped_mm(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``[offs[e-1], offs[e])`` of ``a`` times ``b[e]``; reads ``offs`` on the host (tests only)."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(zip(starts, ends))])


def _inputs(seed, t=96, d=32, e=8, k=3, f=16, **kw):
    return random_expert_inputs(t, d, e, k, f, device="cpu", seed=seed, **kw)


@pytest.mark.parametrize("balanced", [False, True])
def test_grouped_matches_the_reference_in_output_and_every_gradient(balanced):
    seed = new_seed()
    inputs = _inputs(seed, balanced=balanced)
    ref_y, ref_g = run_experts(ReferenceExperts(), inputs, torch.float64)
    y, g = run_experts(GroupedExperts(loop_grouped_mm), inputs, torch.float64)
    for name, a, r in zip(("out", "dx", "dgates", "dw_gate_up", "dw_down"), [y, *g], [ref_y, *ref_g]):
        assert max_rel_error(a, r) < 1e-12, (name, seed)


def test_an_expert_with_no_row_is_an_empty_group():
    seed = new_seed()
    inputs = _inputs(seed, e=8, k=2)
    g = torch.Generator().manual_seed(seed)
    inputs["chosen"] = torch.randn(96, 4, generator=g).topk(2).indices  # experts 4..7 get no row
    ref_y, ref_g = run_experts(ReferenceExperts(), inputs, torch.float64)
    y, g = run_experts(GroupedExperts(loop_grouped_mm), inputs, torch.float64)
    assert max_rel_error(y, ref_y) < 1e-12, seed
    assert torch.equal(g[2][4:], torch.zeros_like(g[2][4:]))  # no row, no weight gradient
    assert max_rel_error(g[2], ref_g[2]) < 1e-12, seed


def test_sorted_entry_matches_the_reference_sorted_entry():
    """Megatron's experts slot calls ``sorted`` with rows already sorted by expert and one gate per row."""
    seed = new_seed()
    inputs = _inputs(seed)
    by = sort_by_expert(inputs["chosen"], 8)
    x = inputs["x"].double().index_select(0, by.tokens)
    probs = inputs["gates"].double().flatten().index_select(0, by.order)
    w1, w2 = inputs["w_gate_up"].double(), inputs["w_down"].double()
    ours = GroupedExperts(loop_grouped_mm).sorted(x, by.counts, probs, w1, w2)
    ref = ReferenceExperts().sorted(x, by.counts, probs, w1, w2)
    assert max_rel_error(ours, ref) < 1e-12, seed


def test_sort_by_expert_groups_rows_stably_and_counts_them():
    chosen = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    by = sort_by_expert(chosen, 4)
    assert by.counts.tolist() == [3, 2, 3, 0]
    assert by.order.tolist() == [1, 2, 6, 3, 5, 0, 4, 7]  # slots of expert 0, then 1, then 2; in slot order
    assert by.tokens.tolist() == [0, 1, 3, 1, 2, 0, 2, 3]
    assert group_ends(by.counts).tolist() == [3, 5, 8, 8] and group_ends(by.counts).dtype == torch.int32
    assert expert_of_rows(by.counts, 8).tolist() == [0, 0, 0, 1, 1, 2, 2, 2]


def test_unaligned_expert_widths_are_refused_before_a_run():
    from types import SimpleNamespace

    import nam_plugin_grouped_moe.plugin as plugin

    model = SimpleNamespace(moe_backend="grouped", hidden=4096, moe_ffn_hidden=150)
    [row] = plugin.nam_check_config(config=SimpleNamespace(model=model), device=None)
    assert row.status == "fail" and "moe_ffn_hidden=150" in row.found, row
    model.moe_ffn_hidden = 160
    [row] = plugin.nam_check_config(config=SimpleNamespace(model=model), device=None)
    assert row.status == "pass", row
