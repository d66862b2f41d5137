"""grouped-moe on the GPU host: parity with the fp32 reference at a small size and at NAM56R's expert shapes,
the preflight row, and no host sync in a MoE block's forward and backward (with a control that shows the
check catches one). Marked gpu: skipped with a reason where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("t, d, e, k, f", [(512, 256, 8, 2, 64), (4096, 4096, 16, 4, 160)])
def test_grouped_experts_match_the_reference(t, d, e, k, f):
    from nam56r.testing import compare_experts, worst_error
    from nam_plugin_grouped_moe.experts import GroupedExperts
    from nam_plugin_grouped_moe.plugin import TOLERANCE

    r = compare_experts(GroupedExperts(), t=t, d=d, num_experts=e, k=k, f=f)
    print(t, d, e, k, f, r)
    assert worst_error(r) <= TOLERANCE, r


def test_preflight_row_passes():
    import nam_plugin_grouped_moe.plugin as plugin

    [row] = plugin.nam_preflight(device=None, config=None)
    print(row.found)
    assert row.status == "pass", row


class _SyncingExperts:
    """The grouped experts plus one host read of the counts: what a per-expert loop does."""

    def __init__(self):
        from nam_plugin_grouped_moe.experts import GroupedExperts

        self.inner = GroupedExperts()

    def layer_state(self, cfg):
        return None

    def __call__(self, x, chosen, gates, w1, w2, state=None):
        from nam56r.experts import sort_by_expert

        sort_by_expert(chosen, w1.shape[0]).counts.tolist()
        return self.inner(x, chosen, gates, w1, w2, state)


def _moe_step(experts):
    from nam56r.blocks.moe import MoE
    from nam56r.config import NAM56RConfig

    cfg = NAM56RConfig(hidden=512, moe_ffn_hidden=160, moe_shared_ffn_hidden=320, num_experts=16, moe_topk=4)
    moe = MoE(cfg, experts).to("cuda", torch.bfloat16)
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).float().square().mean().backward()  # warm-up: allocator, cuBLAS handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x).float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_moe_block_with_grouped_experts_makes_no_host_sync():
    from nam_plugin_grouped_moe.experts import GroupedExperts

    _moe_step(GroupedExperts())


def test_the_sync_check_catches_a_host_read():
    with pytest.raises(RuntimeError, match="synchroniz"):
        _moe_step(_SyncingExperts())
