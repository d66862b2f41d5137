"""mimo-scan against nam's pure-PyTorch scan on fresh random inputs: preflight, the tests, the benchmark.

Inputs are drawn the way the Mamba-3 mixer makes them (``nam56r/blocks/mamba3.py``): B/C after RMSNorm (unit
RMS), dt log-uniform over the init range [1e-3, 1e-1], adt = -softplus(N(0, 1)) dt (negative), trap and raw
angles N(0, 1), biases and MIMO projections near their init values plus noise, D near 1. Activations are
rounded once to ``dtype`` and the reference gets those same values in fp32, so the comparison measures the
kernels' arithmetic, not the inputs' rounding. Angles arrive as the mixer passes them: one ``[b, l, 1, s]``
tensor expanded over the heads (stride 0). Error per tensor: ``max |kernel - reference| / max |reference|``
over the output and the gradient of every input.
"""

from __future__ import annotations

import math

import torch

from nam_core.testing import max_rel_error, new_seed, rel_norm_error

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
"""Max relative-to-max error per tensor. bf16: the kernels' dot operands (rotated q/k, v, the weighted score
tile, the carried states S_in and dS_out) are each rounded to bf16 once (~4e-3 relative per rounding, 8
mantissa bits) and a gradient passes through two or three such products; fp32 accumulation everywhere else.
fp32 (the CPU interpreter): only summation order differs, measured ~1e-6; 1e-4 leaves room."""

INPUT_NAMES = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "d", "z", "mimo_x", "mimo_z",
               "mimo_o")


def random_inputs(b: int, l: int, h: int, g: int, n: int, p: int, r: int, *, device, seed: int,
                  dtype=torch.bfloat16, rope_fraction: float = 0.5) -> dict[str, torch.Tensor]:
    """The ``SSMScan`` arguments by name (``INPUT_NAMES``), fp32, activations already rounded to ``dtype``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def low(t):
        return t.to(dtype).float()

    s = int(n * rope_fraction) // 2
    lo, hi = math.log(1e-3), math.log(1e-1)
    dt = torch.exp(torch.rand(b, h, l, generator=gen) * (hi - lo) + lo)
    x = {
        "q": low(randn(b, l, r, g, n)), "k": low(randn(b, l, r, g, n)), "v": low(randn(b, l, h, p)),
        "adt": -torch.nn.functional.softplus(randn(b, h, l)) * dt, "dt": dt, "trap": low(randn(b, h, l)),
        "q_bias": 1 + 0.1 * randn(h, r, n), "k_bias": 1 + 0.1 * randn(h, r, n),
        "angles": randn(b, l, 1, s), "d": 1 + 0.1 * randn(h), "z": low(randn(b, l, h, p)),
        "mimo_x": 1 / r + 0.1 * randn(h, r, p), "mimo_z": 1 + 0.1 * randn(h, r, p),
        "mimo_o": 1 / r + 0.1 * randn(h, r, p),
    }
    return {k: t.to(device) for k, t in x.items()}


ACTIVATIONS = ("q", "k", "v", "z")
"""Passed to the kernels in the low-precision dtype; the rest stay fp32 as the mixer hands them."""


def compare(b: int, l: int, h: int, g: int, n: int, p: int, r: int, *, device="cuda", seed: int | None = None,
            dtype=torch.bfloat16, block_t: int | None = None, reference_chunk: int = 64,
            norms: bool = False) -> dict:
    """Relative error of the output and every input gradient against ``ReferenceSSMScan`` (fp32) on the same
    values, plus ``seed``. A gradient the kernel path does not produce counts as ``inf``. ``norms``: also
    ``norm``, the same tensors' ``||a - ref|| / ||ref||``."""
    from nam56r.reference.mamba3 import ReferenceSSMScan
    from nam_plugin_mimo_scan.scan import mimo_scan

    seed = new_seed() if seed is None else seed
    x = random_inputs(b, l, h, g, n, p, r, device=device, seed=seed, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    dout = torch.randn(b, l, h, p, generator=gen).to(device=device, dtype=dtype)

    def leaves(cast):
        out = {k: (t.to(dtype) if cast and k in ACTIVATIONS else t).clone().requires_grad_() for k, t in x.items()}
        return out, {**out, "angles": out["angles"].expand(b, l, h, -1)}

    ours, ours_in = leaves(True)
    out = mimo_scan(*(ours_in[k] for k in INPUT_NAMES), block_t=block_t)
    out.backward(dout)
    theirs, theirs_in = leaves(False)
    ref = ReferenceSSMScan()(*(theirs_in[k] for k in INPUT_NAMES), chunk_size=reference_chunk)
    ref.backward(dout.float())

    pairs = {"out": (out, ref), **{f"d{k}": (ours[k].grad, theirs[k].grad) for k in INPUT_NAMES}}
    errors = {k: math.inf if a is None else max_rel_error(a, r) for k, (a, r) in pairs.items()}
    if norms:
        errors["norm"] = {k: math.inf if a is None else rel_norm_error(a, r) for k, (a, r) in pairs.items()}
    errors["seed"] = seed
    return errors


def worst(errors: dict[str, float]) -> float:
    """Largest error of a ``compare`` result; NaN counts as infinitely bad."""
    return max((v if not math.isnan(v) else math.inf) for k, v in errors.items() if k not in ("seed", "norm"))


def parity(*, n: int = 128, p: int = 64, r: int = 4, device="cuda") -> tuple[float, dict]:
    """Preflight's launch at the model's widths with a small batch, length and head count: ``(worst error,
    details)``. b=1, l=100 (ragged: 6 tiles of 16 tokens and one of 4 at rank 4), 4 heads in 2 groups (the dq/dk
    head loop sums 2 heads)."""
    details = compare(1, 100, 4, 2, n, p, r, device=device)
    return worst(details), details
