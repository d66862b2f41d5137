"""The grouped experts' logic on the CPU: sorting, group ends, the gate, the scatter back and the sorted
(Megatron) entry, against the reference experts in float64 on fresh random inputs.

torch's grouped GEMM has no backward on the CPU, so these tests hand the backend a per-group loop with the
same contract (``loop_grouped_mm``); the product never takes another GEMM than torch's (GPU parity:
test_grouped_moe_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from nam56r.experts import expert_of_rows, group_ends, sort_by_expert
from nam56r.testing import expert_errors, idle_expert_inputs, random_expert_inputs, run_experts, sorted_entry_error
from nam_core.testing import new_seed
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
    errors = expert_errors(GroupedExperts(loop_grouped_mm), _inputs(seed, balanced=balanced))
    assert max(errors.values()) < 1e-12, (errors, seed)


def test_an_expert_with_no_row_is_an_empty_group():
    seed = new_seed()
    inputs = idle_expert_inputs(96, 32, 8, 2, 16, busy=4, seed=seed)
    errors = expert_errors(GroupedExperts(loop_grouped_mm), inputs)
    assert max(errors.values()) < 1e-12, (errors, seed)
    _, grads = run_experts(GroupedExperts(loop_grouped_mm), inputs, torch.float64)
    assert torch.equal(grads[2][4:], torch.zeros_like(grads[2][4:]))  # no row, no weight gradient


def test_sorted_entry_matches_the_reference_sorted_entry():
    """Megatron's experts slot calls ``sorted`` with rows already sorted by expert and one gate per row."""
    seed = new_seed()
    assert sorted_entry_error(GroupedExperts(loop_grouped_mm), _inputs(seed)) < 1e-12, seed


def test_sort_by_expert_groups_rows_stably_and_counts_them():
    chosen = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    by = sort_by_expert(chosen, 4)
    assert by.counts.tolist() == [3, 2, 3, 0]
    assert by.order.tolist() == [1, 2, 6, 3, 5, 0, 4, 7]  # slots of expert 0, then 1, then 2; in slot order
    assert by.tokens.tolist() == [0, 1, 3, 1, 2, 0, 2, 3]
    assert group_ends(by.counts).tolist() == [3, 5, 8, 8] and group_ends(by.counts).dtype == torch.int32
    assert expert_of_rows(by.counts, 8).tolist() == [0, 0, 0, 1, 1, 2, 2, 2]


def test_unaligned_expert_widths_are_refused_before_a_run():
    import nam_plugin_grouped_moe.plugin as plugin
    from nam56r.run import spec_for
    from nam_core.checks import config_rows

    def rows(*overrides):
        spec = spec_for("nam56r-tiny", "hidden=4096", *overrides, plugins=["grouped-moe"], device="cuda")
        return config_rows(plugin.NAME, plugin.PLUGIN, spec)

    [row] = rows("moe_ffn_hidden=150")
    assert row.status == "fail" and row.found == "moe_ffn_hidden=150" and "moe_backend=reference" in row.hint, row
    [row] = rows("moe_ffn_hidden=160")
    assert row.status == "pass" and row.found == "hidden=4096, moe_ffn_hidden=160" and row.hint is None, row
    assert rows("moe_ffn_hidden=150", "moe_backend=reference") == []  # not used by the run: not asked
