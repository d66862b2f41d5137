"""fp8-moe on the GPU host: the Triton cast against its torch reference (bit for bit), parity of the FP8
experts against the fp32 reference at a small size and at NAM56R's expert widths, the bf16 dispatch, and the
preflight row. Marked gpu: skipped with a reason where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt_name", ["E4M3", "E5M2"])
@pytest.mark.parametrize("n", [1, 8191, 8192 * 3 + 5])
def test_triton_cast_equals_the_torch_cast(fmt_name, n):
    from nam_plugin_fp8_moe import quant
    from nam_plugin_fp8_moe.kernel import triton_cast

    fmt = getattr(quant, fmt_name)
    x = (torch.randn(n, device="cuda") * 30).bfloat16()
    inv = torch.tensor(quant.FP8_MAX[fmt] / 40.0, device="cuda")  # some values saturate
    amax_t, amax_r = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    q = triton_cast(x, inv, amax_t, fmt)
    r = quant.torch_cast(x, inv, amax_r, fmt)
    assert torch.equal(q.view(torch.uint8), r.view(torch.uint8))
    assert amax_t.item() == amax_r.item() == x.float().abs().max().item()


@pytest.mark.parametrize("t, d, e, k, f", [(512, 256, 8, 2, 64), (4096, 4096, 16, 4, 160)])
def test_fp8_experts_match_the_reference(t, d, e, k, f):
    from nam_plugin_fp8_moe import selftest
    from nam_plugin_fp8_moe.experts import FP8Experts
    from nam_plugin_fp8_moe.kernel import triton_cast

    r = selftest.compare(FP8Experts(cast=triton_cast), t=t, d=d, num_experts=e, k=k, f=f, calls=3)
    print(t, d, e, k, f, r)
    assert selftest.worst(r) <= selftest.TOLERANCE["fp8"], r
    b = selftest.compare(FP8Experts(precision="bf16"), t=t, d=d, num_experts=e, k=k, f=f)
    print("bf16", b)
    assert selftest.worst(b) <= selftest.TOLERANCE["bf16"], b


def test_preflight_row_passes():
    import nam_plugin_fp8_moe.plugin as plugin

    [row] = plugin.nam_preflight(device=None, config=None)
    print(row.found)
    assert row.status == "pass", row
