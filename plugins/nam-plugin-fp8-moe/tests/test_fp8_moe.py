"""nam-plugin-fp8-moe on CPU (``torch._scaled_mm`` runs on CPU too): the grouped dispatch in bf16 and FP8
against the reference experts, the quantiser's history, first call and saturation, the self-test's power to
fail a broken backend, model integration, declaration, options and refusals. GPU parity at NAM56R's expert
shapes and the Triton cast are in test_fp8_moe_gpu.py; the benchmark is bench/fp8_moe.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import nam_plugin_fp8_moe.plugin as plugin
from nam56r.model import Backends, build_model
from nam56r.recipes import apply_overrides, get_recipe
from nam_core.device import DeviceInfo
from nam_core.errors import PluginActivationError
from nam_core.host import PluginHost
from nam_core.requirements import FAIL, PASS, SKIP
from nam_plugin_fp8_moe import experts as ex
from nam_core.testing import fake_device, rel_norm_error
from nam_plugin_fp8_moe import quant, selftest
from nam56r.run import spec_for
from nam_core.errors import ConfigError

CPU = DeviceInfo.profile("cpu")
H100 = DeviceInfo.profile("h100")


# --- numerics ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_grouped_experts_match_the_reference(precision):
    r = selftest.compare(ex.FP8Experts(precision=precision), device="cpu", calls=3)
    assert selftest.worst(r) <= selftest.TOLERANCE[precision], r


def test_an_expert_with_no_tokens_gets_zero_weight_gradients():
    inputs = selftest.random_inputs(64, 32, 4, 2, 16, device="cpu", seed=11)
    inputs["chosen"] = torch.stack([torch.zeros(64, dtype=torch.long), torch.full((64,), 2)], dim=1)  # 1, 3 idle
    backend = ex.FP8Experts(precision="bf16")
    from nam56r.reference.moe import ReferenceExperts

    y, grads = selftest._run(backend, inputs, torch.bfloat16, backend.layer_state(None))
    ref_y, ref_grads = selftest._run(ReferenceExperts(), inputs, torch.float32, None)
    assert rel_norm_error(y, ref_y) < selftest.TOLERANCE["bf16"]
    dw_gate_up, dw_down = grads[2], grads[3]
    assert dw_gate_up[[1, 3]].abs().max() == 0 and dw_down[[1, 3]].abs().max() == 0
    assert dw_gate_up[0].abs().max() > 0 and dw_gate_up[2].abs().max() > 0  # the busy experts do get gradients


def test_the_self_test_fails_a_backend_that_drops_an_expert(monkeypatch):
    spans = ex._spans
    monkeypatch.setattr(ex, "_spans", lambda counts: [s for s in spans(counts) if s[0] != 3])
    r = selftest.compare(ex.FP8Experts(), device="cpu", seed=5)
    assert selftest.worst(r) > 2 * selftest.TOLERANCE["fp8"], r


def test_first_call_scales_from_its_own_amax_then_from_the_history():
    hist = quant.AmaxHistory(4)
    x = torch.tensor([[1.0, -100.0, 3.0, 0.5]])
    q, s = quant.quantize(x, hist, "x", 0)
    assert s.item() == pytest.approx(100.0 / 448.0)  # first call: its own amax, nothing clipped
    assert (q.float() * s).sub(x).abs().max() <= 100.0 / 16
    assert hist.row("x")[0].item() == 100.0
    # Next call: the history's max (100) sets the scale although this tensor's amax is 2.
    q2, s2 = quant.quantize(torch.tensor([[2.0, -1.0]]), hist, "x", 1)
    assert s2.item() == pytest.approx(100.0 / 448.0) and hist.row("x")[1].item() == 2.0
    # A value beyond the history saturates at the format's max (delayed scaling) and is recorded.
    q3, s3 = quant.quantize(torch.tensor([[1000.0, 1.0]]), hist, "x", 2)
    assert q3.float()[0, 0].item() == 448.0 and hist.row("x")[2].item() == 1000.0
    _, s4 = quant.quantize(torch.tensor([[1.0]]), hist, "x", 3)
    assert s4.item() == pytest.approx(1000.0 / 448.0)


def test_gradients_are_e5m2_and_each_role_has_its_own_first_call():
    hist = quant.AmaxHistory(2)
    quant.quantize(torch.full((2, 2), 50.0), hist, "x", 0)
    q, s = quant.quantize(torch.full((2, 2), 1e-3), hist, "dy", 0)  # dy's first call: not x's history
    assert q.dtype == quant.E5M2 and s.item() == pytest.approx(1e-3 / 57344.0)


def test_weights_take_one_scale_per_expert():
    w = torch.randn(3, 4, 8)
    w[1] *= 1000
    q, s = quant.weight_fp8(w)
    assert q.dtype == quant.E4M3 and s.shape == (3,) and s.stride() == (quant.SCALE_STRIDE,)
    torch.testing.assert_close(s, w.abs().amax(dim=(1, 2)) / 448.0)


def test_history_length_must_be_positive():
    with pytest.raises(ValueError, match="amax history length must be >= 1, found 0"):
        quant.AmaxHistory(0)


def test_fp32_tokens_are_refused():
    inputs = selftest.random_inputs(16, 32, 4, 2, 16, device="cpu", seed=1)
    with pytest.raises(TypeError, match="bf16 or fp16 tokens, found torch.float32"):
        ex.FP8Experts()(inputs["x"].float(), inputs["chosen"], inputs["gates"], inputs["w_gate_up"],
                        inputs["w_down"], quant.AmaxHistory(2))


def test_model_runs_with_fp8_experts_and_keeps_its_checkpoint_keys():
    cfg = get_recipe("nam56r-tiny").model
    ref = Backends.reference()
    fp8 = dataclasses.replace(ref, moe=ex.FP8Experts(amax_history=3))
    model = build_model(cfg, fp8).to(torch.bfloat16)
    assert set(model.state_dict()) == set(build_model(cfg, ref).state_dict())
    histories = [m for m in model.modules() if isinstance(m, quant.AmaxHistory)]
    assert histories and all(h.length == 3 for h in histories)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
    out = model(tokens, torch.roll(tokens, -1, 1), torch.ones(2, 32))
    out["loss"].backward()
    assert torch.isfinite(out["loss"])
    # x, a, dy and dh recorded in slot 0, the other slots untouched
    assert all(h.calls == 1 and h.amax[:, 0].min() > 0 and h.amax[:, 1:].max() == 0 for h in histories)
    moe_grads = [p.grad for n, p in model.named_parameters() if "w_gate_up" in n and "shared" not in n]
    assert moe_grads and all(g is not None and g.abs().max() > 0 for g in moe_grads)


# --- declaration, options, refusals -----------------------------------------------------------------------
def spec(*overrides, device="cuda"):
    """The run a user gets from `--plugins fp8-moe` on the tiny recipe on an H100 (fake), bf16, reference DSA."""
    return spec_for("nam56r-tiny", "attention_backend=reference", "train.dtype=bfloat16", *overrides,
                    plugins=["fp8-moe"], device=device)


def rows(s, device=H100):
    return {c.name: c for c in PluginHost().evaluate(s.plugins, device, s).checks if c.plugin == "fp8-moe"}


def test_options_are_parsed_by_the_host_or_refused_with_their_doc():
    assert spec().options["fp8-moe"].amax_history == 16 and spec().options["fp8-moe"].backend == "torch"
    assert spec("fp8-moe.amax_history=4").options["fp8-moe"].amax_history == 4
    for raw, match in [("fp8-moe.backend=cublas", "expected one of torch, te"),
                       ("fp8-moe.amax_history=0", "expected an integer >= 1 .amax_history: calls of amax"),
                       ("fp8-moe.amax_history=x", "expected an integer >= 1"),
                       ("fp8-moe.scaling=tensor", "has no option 'scaling'")]:
        with pytest.raises(ConfigError, match=match) as e:
            spec(raw)
        assert e.value.exit_code == 2


def test_requesting_the_plugin_selects_fp8_and_an_explicit_choice_wins():
    assert spec().model.moe_backend == "fp8" and rows(spec())["selected"].status == PASS
    check = rows(spec("moe_backend=reference"))["selected"]
    assert check.status == SKIP and "active but unused" in check.found


def test_config_check_passes_on_cuda_bf16():
    checks = plugin.nam_check_config(config=spec(), device=H100)
    assert [(c.name, c.status) for c in checks] == [("backend", PASS), ("expert GEMM shapes", PASS)]


def test_host_wants_cuda_bf16_and_the_plugin_gemm_shapes():
    checks = rows(spec("train.dtype=float32", "moe_ffn_hidden=150", device="cpu"), CPU)
    assert checks["train.device"].status == FAIL and checks["train.dtype"].status == FAIL
    assert checks["expert GEMM shapes"].status == FAIL and checks["expert GEMM shapes"].found == "moe_ffn_hidden=150"


def test_te_backend_is_refused_with_the_reason():
    checks = {c.name: c for c in plugin.nam_check_config(config=spec("fp8-moe.backend=te"), device=H100)}
    assert checks["package transformer-engine"].status == FAIL
    assert checks["backend"].status == FAIL and "not built in this release" in checks["backend"].found
    assert checks["backend"].hint == "--set fp8-moe.backend=torch"


def test_activation_is_refused_on_cpu_and_before_ada(fake_cpu, fake_a100):
    with pytest.raises(PluginActivationError, match="fp8-moe: CUDA capability"):
        PluginHost().activate(["fp8-moe"], fake_cpu)
    ev = PluginHost().evaluate(["fp8-moe"], fake_a100)
    assert [c.found for c in ev.failures] == ["sm_80"]
    assert PluginHost().evaluate(["fp8-moe"], fake_device("a100", capability=(8, 9))).ok  # Ada's FP8 suffices


def test_activates_on_an_h100_profile_without_launching():
    host = PluginHost()
    ev = host.activate(spec().plugins, H100, spec())
    assert host.registry("moe").get("fp8") is ex.FP8Experts
    assert [c.status for c in ev.checks if c.plugin == "fp8-moe" and c.name == "launch checks"] == [SKIP]
