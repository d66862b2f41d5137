"""Fused kernel vs reference on fresh random inputs: used by preflight, the GPU tests and the benchmark.

Inputs are drawn from a fresh seed each call (printed with any failure) at small magnitudes a trained model
would see; never zeros. The reference gets the *same* low-precision values upcast to fp32, so the
comparison measures the kernel's arithmetic, not the inputs' rounding. Error is per tensor, relative to
that tensor's largest reference magnitude; ``parity`` returns the worst over the forward outputs and every
gradient.
"""

from __future__ import annotations

import os

import torch

from nam_core.checks import Measured
from nam_core.testing import max_rel_error, worst

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
"""Max |fused - reference| / max |reference| per tensor: bf16 keeps 8 mantissa bits (~4e-3 per rounding)
and the backward rounds probabilities and score gradients to the input dtype before its dot products."""


def random_inputs(b: int, s: int, h: int, dk: int, H: int, di: int, *, dtype, device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    # The indexer's head weights carry H^-0.5 * d^-0.5 in the model; keep the scores O(1) the same way.
    return (rnd(b, s, h, dk), rnd(b, s, dk), rnd(b, s, H, di), rnd(b, s, di),
            rnd(b, s, H, scale=(H * di) ** -0.5 * 4, dt=torch.float32))


def compare(b=2, s=80, h=4, dk=128, dv=64, H=4, di=64, *, dtype=torch.bfloat16, device="cuda",
            block=None, seed: int | None = None) -> dict[str, float]:
    """Relative error of o, kl and the grads of q, kv, iq, ik, w: ``{name: error}`` plus ``seed``."""
    from nam_plugin_lemyx.kernel import BLOCK, fused_warmup
    from nam_plugin_lemyx.reference import warmup_reference

    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    inputs = random_inputs(b, s, h, dk, H, di, dtype=dtype, device=device, seed=seed)
    scale = dk**-0.5
    fused_in = [t.clone().requires_grad_() for t in inputs]
    o, kl = fused_warmup(*fused_in, scale=scale, d_v=dv, block=block or BLOCK)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    do = torch.randn(o.shape, generator=g).to(device=device, dtype=o.dtype)
    # A real run's upstream gradient of each row's KL: the loss coefficient (0.01) / (b * s), i.e. tiny; at
    # O(1) a kernel that flushes small gradients to zero in half precision would pass unnoticed.
    dkl = (torch.rand(kl.shape, generator=g).to(device) + 0.5) * (0.01 / kl.numel())
    ((o.float() * do.float()).sum() + (kl * dkl).sum()).backward()

    ref_in = [t.detach().float().requires_grad_() for t in inputs]
    ro, rkl = warmup_reference(*ref_in, scale=scale, d_v=dv)
    ((ro * do.float()).sum() + (rkl * dkl).sum()).backward()

    errors = {"o": max_rel_error(o, ro), "kl": max_rel_error(kl, rkl)}  # inf where the kernel's is not finite
    for name, a, r in zip(("dq", "dkv", "diq", "dik", "dw"), fused_in, ref_in):
        errors[name] = max_rel_error(a.grad, r.grad)
    errors["seed"] = seed
    return errors


def parity(device="cuda", seq=80, block=None, dtype=torch.bfloat16) -> tuple[float, float]:
    """``(worst relative error, tolerance)`` of ``compare`` at a small NAM56R-width shape."""
    errors = compare(s=seq, device=device, block=block, dtype=dtype)
    return worst(errors), TOLERANCE[dtype]


def launch(spec) -> Measured | None:
    """Preflight's row on a real device (``PLUGIN.checks``, asked when the run takes the fused kernel): a tiny
    fused-vs-reference parity launch. Without a run: on a CUDA device only (where the kernel is the default)."""
    if spec is None and not torch.cuda.is_available():
        return None
    worst, tolerance = parity(device="cuda", seq=80, block=(16, 16))
    return Measured(worst <= tolerance, f"worst relative error {worst:.2e} (forward and every gradient, b=2 s=80)",
                    f"fused == reference within {tolerance:g}")
