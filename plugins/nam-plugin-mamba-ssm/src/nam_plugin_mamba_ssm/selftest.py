"""The mamba-ssm scan against nam's pure-PyTorch scan on fresh random inputs: preflight, GPU tests, patches.

Inputs are drawn the way the Mamba-3 mixer makes them (``nam56r/blocks/mamba3.py``): B/C after RMSNorm
(unit RMS), dt log-uniform over the init range [1e-3, 1e-1], A = -softplus(N(0, 1)), biases and projections
near their init values, raw angles N(0, 1). Low-precision inputs are rounded once (angles too: the SISO kernel
reads them in bf16) and the reference gets those same values in fp32, so the comparison measures the
kernels' arithmetic, not the inputs' rounding. Error per tensor: ``max |kernel - reference| / max |reference|``
over the output and the gradient of every input.
"""

from __future__ import annotations

import math

import torch

from nam_core.testing import max_rel_error, new_seed

TOLERANCE = 5e-2
"""Max relative-to-max error per tensor in bf16. The kernels keep bf16 operands in their matmuls, store the
chunk states and the per-head dQ/dK in bf16 and accumulate in fp32; one bf16 rounding is ~4e-3 relative, and a
gradient passes through several. Upstream's own MIMO tests accept 0.10."""

INPUT_NAMES = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "d", "z", "mimo_x", "mimo_z",
               "mimo_o")



def random_inputs(b: int, l: int, h: int, g: int, n: int, p: int, r: int, *, device, seed: int,
                  dtype=torch.bfloat16, rope_fraction: float = 0.5) -> dict[str, torch.Tensor | None]:
    """The ``SSMScan`` arguments by name (``INPUT_NAMES``), already rounded to what the kernels read."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def low(t):  # one rounding to the activation dtype, kept in fp32 storage
        return t.to(dtype).float()

    s = int(n * rope_fraction) // 2
    lo, hi = math.log(1e-3), math.log(1e-1)
    dt = torch.exp(torch.rand(b, h, l, generator=gen) * (hi - lo) + lo)
    adt = -torch.nn.functional.softplus(randn(b, h, l)) * dt
    x = {
        "q": low(randn(b, l, r, g, n)), "k": low(randn(b, l, r, g, n)), "v": low(randn(b, l, h, p)),
        "adt": adt, "dt": dt, "trap": low(randn(b, h, l)),
        "q_bias": 1 + 0.1 * randn(h, r, n), "k_bias": 1 + 0.1 * randn(h, r, n),
        "angles": low(randn(b, l, h, s)), "d": 1 + 0.1 * randn(h), "z": low(randn(b, l, h, p)),
        "mimo_x": 1 / r + 0.1 * randn(h, r, p) if r > 1 else None,
        "mimo_z": 1 + 0.1 * randn(h, r, p) if r > 1 else None,
        "mimo_o": 1 / r + 0.1 * randn(h, r, p) if r > 1 else None,
    }
    return {k: None if t is None else t.to(device) for k, t in x.items()}



def compare(scan, b: int, l: int, h: int, g: int, n: int, p: int, r: int, *, chunk_size: int, device="cuda",
            seed: int | None = None, dtype=torch.bfloat16) -> dict[str, float]:
    """Relative error of ``scan``'s output and every input gradient against ``ReferenceSSMScan`` (fp32), plus
    the ``seed``. ``scan`` gets the activations in ``dtype`` and the fp32 inputs as fp32."""
    from nam56r.reference.mamba3 import ReferenceSSMScan

    seed = new_seed() if seed is None else seed
    x = random_inputs(b, l, h, g, n, p, r, device=device, seed=seed, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    dout = torch.randn(b, l, h, p, generator=gen).to(device=device, dtype=dtype)
    activations = {"q", "k", "v", "z", "trap"}

    ours = {k: None if t is None else t.to(dtype if k in activations else t.dtype, copy=True).requires_grad_()
            for k, t in x.items()}
    out = scan(*(ours[k] for k in INPUT_NAMES), chunk_size=chunk_size)
    out.backward(dout)

    ref_in = {k: None if t is None else t.clone().requires_grad_() for k, t in x.items()}
    ref = ReferenceSSMScan()(*(ref_in[k] for k in INPUT_NAMES), chunk_size=chunk_size)
    ref.backward(dout.float())

    errors = {"out": max_rel_error(out, ref)}
    for k in INPUT_NAMES:
        if ours[k] is None:
            continue
        if ours[k].grad is None:
            errors[f"d{k}"] = math.inf  # the kernel path dropped a gradient the reference has
            continue
        errors[f"d{k}"] = max_rel_error(ours[k].grad, ref_in[k].grad)
    errors["seed"] = seed
    return errors


def worst(errors: dict[str, float]) -> float:
    """Largest error of a ``compare`` result; NaN counts as infinitely bad."""
    return max((v if not math.isnan(v) else math.inf) for k, v in errors.items() if k != "seed")


def parity(*, n: int = 128, p: int = 64, r: int = 4, chunk_size: int = 16, device="cuda") -> tuple[float, dict]:
    """Preflight's launch at the model's static widths (which share the compiled kernels with a real run) and a
    small batch, length and head count: ``(worst error, details)``. Two groups of two heads: the grouped
    backward is exercised."""
    from nam_plugin_mamba_ssm.scan import MambaSSMScan

    details = compare(MambaSSMScan(), 1, 4 * chunk_size, 4, 2, n, p, r, chunk_size=chunk_size, device=device)
    return worst(details), details
