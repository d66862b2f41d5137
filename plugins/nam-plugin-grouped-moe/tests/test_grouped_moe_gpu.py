"""grouped-moe on the GPU host: parity with the fp32 reference at a small size and at NAM56R's expert shapes,
the preflight row, and no host sync in a MoE block's forward and backward (with a control that shows the
check catches one). Marked gpu: skipped with a reason where CUDA is absent."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compile_glue", [False, True])
@pytest.mark.parametrize("t, d, e, k, f", [(512, 256, 8, 2, 64), (4096, 4096, 16, 4, 160)])
def test_grouped_experts_match_the_reference(t, d, e, k, f, compile_glue):
    """Eager and with ``compile_glue`` (the row steps as inductor regions, built here for the GPU)."""
    from nam56r.testing import compare_experts, worst_error
    from nam_plugin_grouped_moe.experts import GroupedExperts
    from nam_plugin_grouped_moe.plugin import TOLERANCE

    r = compare_experts(GroupedExperts(compile_glue=compile_glue), t=t, d=d, num_experts=e, k=k, f=f)
    print(t, d, e, k, f, compile_glue, r)
    assert worst_error(r) <= TOLERANCE, r


def test_preflight_row_passes():
    import nam_plugin_grouped_moe.plugin as plugin
    from nam_core.checks import launch_rows

    [row] = launch_rows(plugin.NAME, plugin.PLUGIN, None)
    print(row.found)
    assert row.status == "pass", row


@pytest.mark.parametrize("compile_glue", [False, True])
def test_moe_block_with_grouped_experts_makes_no_host_sync(compile_glue):
    from nam56r.testing import moe_step_without_host_sync
    from nam_plugin_grouped_moe.experts import GroupedExperts

    moe_step_without_host_sync(GroupedExperts(compile_glue=compile_glue))


def test_the_sync_check_catches_a_host_read():
    from nam56r.testing import HostReadingExperts, moe_step_without_host_sync
    from nam_plugin_grouped_moe.experts import GroupedExperts

    with pytest.raises(RuntimeError, match="synchroniz"):
        moe_step_without_host_sync(HostReadingExperts(GroupedExperts()))
