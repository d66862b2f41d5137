"""Inputs shaped and scaled like NAM56R's own, for the parity checks of the plugins that implement its kinds.

``random_scan_inputs`` draws the arguments of an ``SSMScan`` (``nam56r.backends``) the way the Mamba-3 mixer
makes them (``nam56r/blocks/mamba3.py``), so the scan plugins and the benchmarks test their scans on one
distribution. It lives with the model, not in ``nam_core.testing``: the core knows no Mamba-3.
"""

from __future__ import annotations

import math

import torch

SCAN_INPUTS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "d", "z", "mimo_x", "mimo_z",
               "mimo_o")
"""The ``SSMScan`` arguments, in the protocol's order."""


def random_scan_inputs(b: int, l: int, h: int, g: int, n: int, p: int, r: int, *, device, seed: int,
                       dtype: torch.dtype = torch.bfloat16, rope_fraction: float = 0.5,
                       shared_angles: bool = False) -> dict[str, torch.Tensor | None]:
    """The ``SSMScan`` arguments by name (``SCAN_INPUTS``), fp32, on ``device``; ``None`` for the MIMO
    projections when ``r == 1`` (SISO).

    B/C (``k``, ``q``) after RMSNorm (unit RMS), x and the gate N(0, 1); dt log-uniform over the init range
    [1e-3, 1e-1]; adt = -softplus(N(0, 1)) dt (negative); trap and the raw angles N(0, 1); biases and the MIMO
    projections near their init values (1, or 1/r for the rank sums) plus noise, D near 1. What a kernel reads
    in low precision (q, k, v, z, trap, angles) is rounded once to ``dtype`` and kept in fp32, so a reference
    given these values computes on exactly what the kernel reads. ``shared_angles``: one set of angles for every
    head, ``[b, l, 1, s]``, as the mixer makes them (the caller expands it to ``[b, l, h, s]``); else one set
    per head.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    def low(t):  # one rounding to the activation dtype, kept in fp32 storage
        return t.to(dtype).float()

    s = int(n * rope_fraction) // 2  # one angle per rotated pair
    lo, hi = math.log(1e-3), math.log(1e-1)
    dt = torch.exp(torch.rand(b, h, l, generator=gen) * (hi - lo) + lo)  # [b, h, l]
    x = {
        "q": low(randn(b, l, r, g, n)), "k": low(randn(b, l, r, g, n)), "v": low(randn(b, l, h, p)),
        "adt": -torch.nn.functional.softplus(randn(b, h, l)) * dt, "dt": dt, "trap": low(randn(b, h, l)),
        "q_bias": 1 + 0.1 * randn(h, r, n), "k_bias": 1 + 0.1 * randn(h, r, n),
        "angles": low(randn(b, l, 1 if shared_angles else h, s)), "d": 1 + 0.1 * randn(h),
        "z": low(randn(b, l, h, p)),
        "mimo_x": 1 / r + 0.1 * randn(h, r, p) if r > 1 else None,
        "mimo_z": 1 + 0.1 * randn(h, r, p) if r > 1 else None,
        "mimo_o": 1 / r + 0.1 * randn(h, r, p) if r > 1 else None,
    }
    return {k: None if t is None else t.to(device) for k, t in x.items()}
