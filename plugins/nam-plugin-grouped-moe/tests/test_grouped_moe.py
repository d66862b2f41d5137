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


# --- compile_glue: the row steps as compiled regions (nam56r/regions.py) ---------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_row_steps_match_the_eager_ones_in_output_and_every_gradient(dtype):
    """The combine's gather-sum, the dispatch's backward gather-sum and the gated SwiGLU under inductor, against
    the eager functions on the same inputs: fp32 within 1e-5 (max error over max value), bf16 within 2**-7
    (relative L2: eager rounds the SwiGLU's intermediates to bf16, inductor once)."""
    from nam_core.testing import max_rel_error, rel_norm_error

    seed = new_seed()
    inputs = _inputs(seed, t=40, d=32, e=4, k=2, f=16)
    y0, g0 = run_experts(GroupedExperts(loop_grouped_mm), inputs, dtype)
    y1, g1 = run_experts(GroupedExperts(loop_grouped_mm, compile_glue=True), inputs, dtype)
    for name, got, want in zip(("out", "dx", "dgates", "dw_gate_up", "dw_down"), [y1, *g1], [y0, *g0]):
        err = max_rel_error(got, want) if dtype == torch.float32 else rel_norm_error(got, want)
        assert err < (1e-5 if dtype == torch.float32 else 2**-7), (name, err, seed)


def test_compiled_row_steps_replay_bit_exact_under_recompute():
    """``train.recompute=moe`` replays the layer's forward inside backward: with the compiled regions the loss's
    gradients equal the run without recompute bit for bit (tolerance 0), as the eager ones do."""
    import copy

    from nam56r.blocks.moe import MoE
    from nam56r.recipes import get_recipe
    from nam56r.recompute import checkpointed
    from nam56r.state import ForwardState

    seed = new_seed()
    torch.manual_seed(seed)
    cfg = get_recipe("nam56r-tiny").model.replace(compile_glue=True)
    plain = MoE(cfg, GroupedExperts(loop_grouped_mm, compile_glue=True))
    replayed = copy.deepcopy(plain)
    x = torch.randn(2, 12, cfg.hidden)

    def loss_and_grads(block, recompute):
        xx = x.clone().requires_grad_()
        state = ForwardState(seq_layout=(2, 12))
        y = checkpointed(block, state, xx) if recompute else block(xx, state)
        (y.square().mean() + sum(torch.stack(v).sum() for v in state.aux_losses.values())).backward()
        return [xx.grad, *(p.grad for p in block.parameters())]

    for got, want in zip(loss_and_grads(replayed, True), loss_and_grads(plain, False), strict=True):
        assert torch.equal(got, want), seed


def test_the_run_builds_the_rows_the_model_asks_for():
    from nam56r.backends import BackendContext
    from nam56r.experts import COMPILED_ROWS, EAGER_ROWS
    from nam56r.recipes import get_recipe

    cfg = get_recipe("nam56r").model
    assert GroupedExperts.build(BackendContext(model=cfg)).rows is EAGER_ROWS  # off until measured
    assert GroupedExperts.build(BackendContext(model=cfg.replace(compile_glue=True))).rows is COMPILED_ROWS
