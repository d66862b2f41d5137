"""liger on one GPU with real Liger-Kernel: parity with the reference head, the #968 reproducer, preflight.

Marked ``gpu``: the repository's conftest.py skips them without CUDA; run them on the GPU host with
``python -m pytest plugins/nam-plugin-liger -m gpu``. Without liger-kernel (the plugin installed without its
[gpu] extra) the module is skipped with the install command as the reason.
"""

import dataclasses

import pytest
import torch

import nam_plugin_liger.plugin as plugin
from nam56r.model import Backends, build_model
from nam56r.recipes import get_recipe
from nam56r.reference.ce import ReferenceCEHead
from nam_core.checks import launch_rows
from nam_core.device import DeviceInfo
from nam_core.host import PluginHost
from nam_core.patches import BUG_REPRODUCED, FIX_VALIDATED
from nam_core.requirements import PASS
from nam_plugin_liger import head, patch, smoke
from nam_plugin_liger.head import MEAN_TIMES_LIVE, NONE_TIMES_MASK, LigerCEHead

pytestmark = pytest.mark.gpu
if torch.cuda.is_available():  # without CUDA the conftest skips every test here, with that reason
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed: pip install nam-plugin-liger[gpu]")

BF16_LOSS_RTOL = 1e-4
BF16_GRAD_TOL = 2e-2
"""bf16 parity bounds, relative to the reference (loss) and to the largest reference gradient (grads).

Both heads see the same bf16 inputs; the reference does its math in fp32, Liger multiplies in bf16 (fp32
accumulate, bf16 logits) and stores gradients in bf16, so ~2^-8 relative per gradient element is expected.
Measured on an H100 with liger-kernel 0.8.5: loss 3e-6, dL/dhidden 5.1e-3, dL/dW 4.6e-3 (the same for both
formulations, and for mean*live on 0.8.1). A wrong kernel (zero or misplaced gradient rows) is off by order 1."""


@pytest.fixture(autouse=True)
def no_workaround():
    head.reset_workaround()
    yield
    head.reset_workaround()


def bf16_inputs(t, d, v, seed):
    """Fresh random bf16 hidden [t, d], weight [v, d]; target [t] with -1 placeholders where the 0/1 mask is 0."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, d, generator=g)
    weight = torch.randn(v, d, generator=g) * d**-0.5
    mask = (torch.rand(t, generator=g) > 0.25).float()
    mask[0] = 0.0  # token 0 masked: the case Liger issue #968 turns into all-zero gradients
    target = torch.where(mask != 0, torch.randint(0, v, (t,), generator=g), -1)
    return hidden.cuda().bfloat16(), weight.cuda().bfloat16(), target.cuda(), mask.cuda()


def relative_errors(ce, *inputs):
    """Loss and gradients of ``ce`` and of the reference head on the same inputs; relative errors."""
    results = []
    for head_ in (ce, ReferenceCEHead()):
        hidden, weight, target, mask = inputs
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        total = head_(h, w, target, mask)
        (total / mask.sum()).backward()  # the model's scaling: the upstream gradient is not 1
        results.append((total.detach().float(), h.grad.float(), w.grad.float()))
    (loss, dh, dw), (loss_ref, dh_ref, dw_ref) = results
    mask = inputs[3]
    return {
        "loss": float((loss - loss_ref).abs() / loss_ref.abs()),
        "dhidden": float((dh - dh_ref).abs().max() / dh_ref.abs().max()),
        "dweight": float((dw - dw_ref).abs().max() / dw_ref.abs().max()),
        "dhidden on masked tokens": float(dh[mask == 0].abs().max()),
    }, loss.dtype


# t = 1000: not a power of two (a partial last chunk); v = 40_000: more than one 32768-wide Triton block.
@pytest.mark.parametrize("formulation", [NONE_TIMES_MASK, MEAN_TIMES_LIVE])
@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_parity_with_the_reference_head(formulation, seed):
    errors, dtype = relative_errors(LigerCEHead(formulation), *bf16_inputs(1000, 256, 40_000, seed))
    print(formulation, seed, errors)
    assert dtype == torch.float32
    assert errors["loss"] <= BF16_LOSS_RTOL, errors
    assert errors["dhidden"] <= BF16_GRAD_TOL and errors["dweight"] <= BF16_GRAD_TOL, errors
    assert errors["dhidden on masked tokens"] == 0.0, errors


def test_registered_head_resolves_to_none_times_mask_on_a_fixed_release():
    version = head.installed_version()
    assert not head.has_none_reduction_bug(version), f"GPU tests expect liger-kernel >= 0.8.2, found {version}"
    assert LigerCEHead().formulation == NONE_TIMES_MASK


def test_reproducer_matches_the_patch_lanes_claim_for_the_installed_release():
    """The patch says: < 0.8.2 has the bug, >= 0.8.2 does not. The reproducer launches Liger to check it."""
    result = patch.run_reproducer()
    print(result.describe())
    affected = head.has_none_reduction_bug(head.installed_version())
    assert result.verdict == (BUG_REPRODUCED if affected else FIX_VALIDATED), result.describe()
    if not affected:
        assert max(result.errors.values()) < 1e-3, result.describe()  # fp32: the fix is exact, not merely close


def test_preflight_launch_check_passes_and_activation_succeeds_here():
    device = DeviceInfo.probe()
    [row] = launch_rows("liger", plugin.PLUGIN, None)
    print(row)
    assert row.status == PASS, row
    host = PluginHost()
    ev = host.activate(["liger"], device)
    assert [c.status for c in ev.checks if c.name == smoke.CHECK] == [PASS]
    assert host.registry("ce").get("liger") is LigerCEHead


def test_nam56r_tiny_losses_and_grads_match_the_reference_head_in_fp32():
    """The head inside the model (main LM head + 2 MTP heads, shared weight) on nam56r-tiny, fp32, no TF32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = get_recipe("nam56r-tiny").model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g).cuda()
    mask = torch.ones(2, cfg.seq_len, device="cuda")
    mask[:, :5] = 0.0
    batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask)
    results = []
    for ce in (ReferenceCEHead(), LigerCEHead()):
        torch.manual_seed(0)
        model = build_model(cfg, dataclasses.replace(Backends.reference(), ce=ce), device="cuda")
        out = model(**batch)
        out["loss"].backward()
        results.append((out, model.head_weight.grad.clone()))
    (ref, dw_ref), (got, dw) = results
    for key in ("lm_loss", "mtp_loss"):
        torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=0)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-4, atol=1e-6)
