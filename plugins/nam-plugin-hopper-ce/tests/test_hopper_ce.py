"""nam-plugin-hopper-ce on CPU: the row kernels under Triton's interpreter against torch, the whole head (row
kernels interpreted, fp32 CPU products in place of the CUDA-only cuBLAS calls) through the activation
self-test against the reference head, declaration, selection and refusals. GPU parity at NAM56R's head and
the benchmark against Liger are in test_hopper_ce_gpu.py and bench/hopper_ce.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nam56r.recipes import apply_overrides, get_recipe
from nam_core.device import DeviceInfo
from nam_core.errors import NamError, PluginActivationError
from nam_core.host import PluginHost
from nam_core.requirements import FAIL, PASS, SKIP

CPU = DeviceInfo.profile("cpu")
H100 = DeviceInfo.profile("h100")

INTERPRETED = """
import json, torch
from nam_plugin_hopper_ce import kernel, selftest
from nam_plugin_hopper_ce.head import HopperCEHead, Matmuls

out = {}
g = torch.Generator().manual_seed(7)
c, v = 5, 300  # v not a multiple of the 128-wide block
logits = torch.randn(c, v, generator=g) * 4
target = torch.randint(0, v, (c,), generator=g)
mask = torch.tensor([1.0, 0.0, 1.0, 0.5, 1.0])
target[1] = -100  # masked: never read
target[0] = 170  # inside the slice tested below
lse, loss = torch.empty(c), torch.empty(c)
kernel.row_lse_loss(logits, target, mask, lse, loss, block=128)
ref_lse = logits.logsumexp(-1)
safe = torch.where(mask != 0, target, 0)
ref_loss = (ref_lse - logits.gather(1, safe[:, None])[:, 0]) * mask
out["lse"] = (lse - ref_lse).abs().max().item()
out["loss"] = (loss - ref_loss).abs().max().item()
w = mask * 0.37
grad = torch.empty(c, v, dtype=torch.float16)
kernel.row_grad(logits, lse, target, w, grad, block=128)
ref_grad = (logits.softmax(-1) - torch.nn.functional.one_hot(safe, v)) * w[:, None]
out["grad"] = (grad.float() - ref_grad).abs().max().item()
part = torch.empty(c, 100, dtype=torch.float16)  # one vocabulary slice, columns 150..249
kernel.row_grad(logits[:, 150:250], lse, target, w, part, col0=150, block=64)
out["slice_grad"] = (part.float() - ref_grad[:, 150:250]).abs().max().item()
out["masked_row_zero"] = bool((grad[1] == 0).all())

cpu = Matmuls(lambda h, w: h.float() @ w.float().t(), lambda acc, a, b: acc.add_(a.float() @ b.float()))
head = HopperCEHead(chunk_tokens=48, vocab_slice=64, matmuls=cpu, gradients="backward")  # 3 ragged chunks, 4 slices
out["head"] = selftest.compare(head, tokens=130, hidden=32, vocab=200, device="cpu", dtype=torch.float16)
eager = HopperCEHead(chunk_tokens=48, matmuls=cpu, gradients="forward")
out["head_forward"] = selftest.compare(eager, tokens=130, hidden=32, vocab=200, device="cpu", dtype=torch.float16)

# both paths on the same fp16 values with a fractional mask and an upstream gradient other than 1
g = torch.Generator().manual_seed(11)
w0 = (torch.randn(200, 32, generator=g) * 0.2).half()
h0 = torch.randn(130, 32, generator=g).half()
y = torch.randint(0, 200, (130,), generator=g)
m = torch.rand(130, generator=g)
m[::7] = 0.0
y[::7] = -100
from nam_plugin_hopper_ce import head as head_module
called = []  # which autograd Function each head's call went through
for fn in (head_module.HopperLinearCE, head_module.HopperLinearCEGradsInForward):
    fn.apply = (lambda real, name: lambda *a: (called.append(name), real(*a))[1])(fn.apply, fn.__name__)
grads, out["paths_used"] = {}, {}
for name, ce in (("backward", head), ("forward", eager)):
    w, h = w0.clone().requires_grad_(), h0.clone().requires_grad_()
    called.clear()
    loss = ce(h, w, y, m)
    (loss * 0.37).backward()
    out["paths_used"][name] = sorted(set(called))
    grads[name] = (loss.detach(), h.grad.float(), w.grad.float())
(lb, hb, wb), (lf, hf, wf) = grads["backward"], grads["forward"]
out["paths_loss"] = abs(lb.item() - lf.item()) / abs(lb.item())
out["paths_dh"] = ((hb - hf).abs().max() / hb.abs().max()).item()
out["paths_dw"] = ((wb - wf).abs().max() / wb.abs().max()).item()
with torch.no_grad():
    out["no_grad_loss"] = abs(eager(h0, w0, y, m).item() - lb.item()) / abs(lb.item())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton", reason="the test extra installs Triton: "
                                         "pip install -e './plugins/nam-plugin-hopper-ce[test]'")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_row_kernels_match_torch_under_the_interpreter(interpreted):
    assert interpreted["lse"] < 1e-5 and interpreted["loss"] < 1e-5, interpreted
    assert interpreted["grad"] < 1e-3, interpreted  # fp16 storage of values within [-1, 1]
    assert interpreted["slice_grad"] < 1e-3, interpreted  # a slice finds its targets by the column offset
    assert interpreted["masked_row_zero"] is True


def test_the_head_passes_the_activation_self_test_on_cpu(interpreted):
    """Three calls sharing one weight, masked tokens with placeholder targets, fp16, against fp32 reference."""
    from nam_plugin_hopper_ce import selftest

    r = dict(interpreted["head"])
    print(r)
    assert selftest.passed(r), r
    assert r["masked_dh"] == 0.0


def test_gradients_in_forward_pass_the_self_test_and_agree_with_the_backward_path(interpreted):
    """``gradients="forward"`` (three products, dh and dW rounded to fp16 before the upstream gradient scales
    them) against the reference, and against the default path on the same values: a fractional mask, masked
    placeholder targets, an upstream gradient of 0.37; under no_grad it gives the same loss."""
    from nam_plugin_hopper_ce import selftest

    r = dict(interpreted["head_forward"])
    assert selftest.passed(r), r
    assert r["masked_dh"] == 0.0
    assert interpreted["paths_loss"] < 1e-6, interpreted  # the same fp32 row kernel on the same logits
    assert interpreted["paths_used"] == {"backward": ["HopperLinearCE"], "forward": ["HopperLinearCEGradsInForward"]}
    # the two paths differ by where dh and dW are rounded to fp16 (2^-11 relative) and by fp32 summation order:
    # close, and not equal (equal would mean one path ran twice)
    assert 0 < interpreted["paths_dh"] < 2e-3 and 0 < interpreted["paths_dw"] < 2e-3, interpreted
    assert interpreted["no_grad_loss"] < 1e-6, interpreted


def test_the_gradients_option_reaches_the_head_and_refuses_other_values():
    from nam56r.backends import BackendContext, build_backend
    from nam_plugin_hopper_ce.head import HopperCEHead

    from nam_plugin_hopper_ce.plugin import PLUGIN

    recipe = apply_overrides(get_recipe("nam56r"), ["hopper-ce.gradients=backward"], plugin_names=["hopper-ce"])
    assert recipe.train.plugin_options == {"hopper-ce.gradients": "backward"}
    options = {"hopper-ce": PLUGIN.parse_options("hopper-ce", recipe.train.plugin_options)}  # as the run does
    assert build_backend(HopperCEHead, BackendContext(model=recipe.model, options=options)).gradients == "backward"
    assert build_backend(HopperCEHead, BackendContext(model=recipe.model)).gradients == "forward"  # the default
    with pytest.raises(NamError, match="gradients"):
        PLUGIN.parse_options("hopper-ce", {"hopper-ce.gradients": "sideways"})


def test_the_self_test_fails_a_head_that_drops_the_mask():
    """The activation gate can refuse: a head that ignores the mask (every token counted) fails it."""
    import torch

    from nam56r.reference.ce import ReferenceCEHead
    from nam_plugin_hopper_ce import selftest

    ref = ReferenceCEHead()

    def unmasked(h, w, y, m):
        return ref(h, w, torch.where(y < 0, 0, y), torch.ones_like(m))

    r = selftest.compare(unmasked, tokens=64, hidden=16, vocab=50, device="cpu", dtype=torch.float32)
    assert not selftest.passed(r) and r["masked_dh"] > 0


def test_the_head_refuses_cpu_tensors_and_fp32():
    import torch

    from nam_plugin_hopper_ce.head import HopperCEHead

    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(NamError, match="CUDA tensors"):
        HopperCEHead()(h, w, torch.zeros(4, dtype=torch.long), torch.ones(4))
    from nam_plugin_hopper_ce.head import Matmuls

    cpu = Matmuls(lambda a, b: a, lambda *a: None)
    with pytest.raises(NamError, match="bf16 or fp16"):
        HopperCEHead(matmuls=cpu)(h, w, torch.zeros(4, dtype=torch.long), torch.ones(4))


# --- declaration, selection, refusals -------------------------------------------------------------------
def spec(*overrides, device="cuda"):
    """`--plugins hopper-ce` on the tiny recipe on an H100 (fake), bf16, the reference DSA chosen by name."""
    from nam56r.run import spec_for

    return spec_for("nam56r-tiny", "attention_backend=reference", "train.dtype=bfloat16", *overrides,
                    plugins=["hopper-ce"], device=device)


def rows(s, device=H100):
    return {c.name: c for c in PluginHost().evaluate(s.plugins, device, s).checks if c.plugin == "hopper-ce"}


def test_requesting_the_plugin_selects_the_head_and_an_explicit_choice_wins():
    assert spec().model.ce_backend == "hopper-ce" and rows(spec())["selected"].status == PASS
    check = rows(spec("ce_backend=reference"))["selected"]
    assert check.status == SKIP and "active but unused" in check.found


def test_the_host_wants_cuda_and_16_bit_from_the_declaration():
    checks = rows(spec("train.dtype=float32", device="cpu"), CPU)
    assert checks["train.device"].status == FAIL and checks["train.dtype"].status == FAIL
    assert "ce_backend=reference" in checks["train.dtype"].hint
    assert {n for n, c in rows(spec()).items() if c.status == FAIL} == set()


def test_activation_is_refused_on_cpu_and_before_hopper(fake_cpu, fake_a100):
    with pytest.raises(PluginActivationError, match="hopper-ce: CUDA capability"):
        PluginHost().activate(["hopper-ce"], fake_cpu)
    ev = PluginHost().evaluate(["hopper-ce"], fake_a100)
    assert [c.found for c in ev.failures] == ["sm_80"]


@pytest.mark.parametrize("triton, found", [(None, "not installed"), ("3.2.0", "3.2.0")])
def test_activation_without_a_triton_it_can_run_names_the_gpu_extra(fake_versions, fake_h100, triton, found):
    fake_versions(triton=triton)
    [bad] = PluginHost().evaluate(["hopper-ce"], fake_h100).failures
    assert (bad.name, bad.found, bad.hint) == ("package triton", found, "pip install 'nam-plugin-hopper-ce[gpu]'")
    fake_versions(triton="3.3.0")  # the floor
    assert PluginHost().evaluate(["hopper-ce"], fake_h100).ok


def test_activates_on_an_h100_profile_without_launching():
    from nam_plugin_hopper_ce.head import HopperCEHead

    host = PluginHost()
    ev = host.activate(spec().plugins, H100, spec())
    assert host.registry("ce").get("hopper-ce") is HopperCEHead
    assert [c.status for c in ev.checks if c.plugin == "hopper-ce" and c.name == "launch checks"] == [SKIP]
