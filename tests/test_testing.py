"""nam_core.testing: the parity harness the kernel plugins share (it must be able to fail, and it must compare
kernel and reference on the same rounded values), and the fixtures its pytest plugin hands every test suite."""

from __future__ import annotations

import math

import pytest
import torch

from nam_core.requirements import Requirement
from nam_core.testing import fake_device, model_parity, worst

BF16_ROUNDING = 2**-8  # bf16 keeps 8 mantissa bits: one rounding is at most 2^-9 relative, half this


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(4, 8, generator=g), "w": torch.randn(8, generator=g)}


def scaled(x, w):  # [4, 8] * [8] -> [4, 8]
    return x * w


def test_a_function_against_itself_has_zero_error_on_the_output_and_every_gradient():
    errors = model_parity(scaled, scaled, inputs(), dout=torch.randn(4, 8), seed=7, dtype=torch.float32)
    assert errors == {"out": 0.0, "dx": 0.0, "dw": 0.0, "seed": 7}
    assert worst(errors) == 0.0


def test_activations_reach_the_reference_rounded_as_the_kernel_reads_them():
    x = inputs()["x"]
    identity = {"x": x}
    errors = model_parity(lambda x: x, lambda x: x, identity, activations=("x",), dout=torch.ones(4, 8), seed=0)
    assert errors["out"] == 0.0  # the reference computed on the bf16 values, not on the fp32 draw
    rounding = (x.to(torch.bfloat16).float() - x).abs().max() / x.abs().max()
    assert 0 < rounding <= BF16_ROUNDING  # so the draw itself would have shown an error


def test_a_wrong_gradient_is_named():
    class Scaled(torch.autograd.Function):  # right forward, dL/dw 10% large
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g * w, 1.1 * (g * x).sum(0)

    errors = model_parity(lambda x, w: Scaled.apply(x, w), scaled, inputs(), dout=torch.randn(4, 8), seed=1,
                          dtype=torch.float32)
    assert errors["out"] == 0.0 and errors["dx"] == 0.0
    assert errors["dw"] == pytest.approx(0.1, rel=1e-5) and worst(errors) == errors["dw"]


def test_a_dropped_gradient_is_infinitely_bad():
    errors = model_parity(lambda x, w: x * w.detach(), scaled, inputs(), dout=torch.randn(4, 8), seed=2,
                          dtype=torch.float32)
    assert errors["dw"] == math.inf and worst(errors) == math.inf


def test_integer_inputs_pass_through_without_a_gradient():
    def gather(x, index):  # [4, 8] -> [4, 3]
        return x.gather(1, index)

    index = torch.tensor([[0, 2, 7]] * 4)
    errors = model_parity(gather, gather, {"x": inputs()["x"], "index": index}, activations=("x",),
                          dout=torch.randn(4, 3), seed=3)
    assert set(errors) == {"out", "dx", "seed"} and worst(errors) == 0.0


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="reference gives no gradient for 'w'"):
        model_parity(scaled, lambda x, w: x * 2, inputs(), dout=torch.randn(4, 8), seed=4, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"activations \['y'\] are not among the inputs"):
        model_parity(scaled, scaled, inputs(), activations=("y",), dout=torch.randn(4, 8), seed=4)


def test_worst_counts_nan_as_infinite_and_skips_the_seed_and_the_norms():
    assert worst({"out": 1e-3, "dq": float("nan"), "seed": 12345}) == math.inf
    assert worst({"out": 1e-3, "dq": 2e-3, "seed": 12345, "norm": {"out": 9.0}}) == 2e-3


def test_the_caller_keeps_its_inputs_untouched():
    x = inputs()
    model_parity(scaled, scaled, x, activations=("x",), dout=torch.randn(4, 8), seed=5)
    assert not x["x"].requires_grad and x["x"].grad is None and x["x"].dtype == torch.float32


# --- the fixtures (nam_core.pytest_plugin) --------------------------------------------------
def test_fake_devices_are_fake_and_differ_where_requirements_look(fake_cpu, fake_h100, fake_gb10, fake_a100):
    assert all(d.is_fake for d in (fake_cpu, fake_h100, fake_gb10, fake_a100))
    hopper, smem = Requirement.cuda_capability((9, 0)), Requirement.shared_memory_per_block(200_000)
    assert [hopper.check("p", d).ok for d in (fake_cpu, fake_h100, fake_gb10, fake_a100)] == [False, True, True, False]
    assert [smem.check("p", d).ok for d in (fake_h100, fake_gb10, fake_a100)] == [True, False, False]
    assert hopper.check("p", fake_a100).found == "sm_80"
    assert not fake_device("h100", profile_name=None).is_fake  # what a launch check takes for a real H100


def test_fake_versions_report_the_release_or_its_absence(fake_versions):
    triton = Requirement.package("triton>=3.5")
    fake_versions(triton="3.4.0")
    assert not triton.check("p", fake_device("h100")).ok and triton.check("p", fake_device("h100")).found == "3.4.0"
    fake_versions(triton=None)
    assert triton.check("p", fake_device("h100")).found == "not installed"
    fake_versions(triton="3.6.0")
    assert triton.check("p", fake_device("h100")).ok


# --- nam56r.testing: the SSM scan's inputs -----------------------------------------------------------
def test_scan_inputs_have_the_protocols_shapes_and_are_rounded_like_the_kernels_read_them():
    from nam56r.reference.mamba3 import ReferenceSSMScan
    from nam56r.testing import SCAN_INPUTS, random_scan_inputs

    b, l, h, g, n, p, r = 2, 8, 4, 2, 16, 8, 4
    x = random_scan_inputs(b, l, h, g, n, p, r, device="cpu", seed=3)
    shapes = {k: tuple(t.shape) for k, t in x.items()}
    assert list(x) == list(SCAN_INPUTS)
    assert shapes == {"q": (b, l, r, g, n), "k": (b, l, r, g, n), "v": (b, l, h, p), "adt": (b, h, l),
                      "dt": (b, h, l), "trap": (b, h, l), "q_bias": (h, r, n), "k_bias": (h, r, n),
                      "angles": (b, l, h, n // 4), "d": (h,), "z": (b, l, h, p), "mimo_x": (h, r, p),
                      "mimo_z": (h, r, p), "mimo_o": (h, r, p)}
    for k in ("q", "k", "v", "z", "trap", "angles"):
        assert torch.equal(x[k], x[k].to(torch.bfloat16).float()), k
    assert (x["dt"] >= 1e-3).all() and (x["dt"] <= 1e-1).all() and (x["adt"] < 0).all()
    assert ReferenceSSMScan()(*x.values(), chunk_size=4).shape == (b, l, h, p)
    shared = random_scan_inputs(b, l, h, g, n, p, 1, device="cpu", seed=3, shared_angles=True)
    assert shared["angles"].shape == (b, l, 1, n // 4) and shared["mimo_x"] is None
    assert not torch.equal(random_scan_inputs(b, l, h, g, n, p, r, device="cpu", seed=4)["q"], x["q"])


def test_preflight_can_import_the_harness_where_pytest_is_not_installed():
    import subprocess
    import sys

    code = ("import sys; sys.modules['pytest'] = None; import nam_core.testing as t; "  # None: import fails
            "print(t.fake_device('h100').label, callable(t.model_parity))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "NVIDIA H100 80GB HBM3 sm_90 (profile h100) True"
