"""The mamba-ssm scan against nam's pure-PyTorch scan on fresh random inputs: preflight, GPU tests, patches.

Inputs are drawn the way the Mamba-3 mixer makes them (``nam56r.testing.random_scan_inputs``), one set of
angles per head, rounded once where the kernels read bf16 (angles too: the SISO kernel reads them in bf16).
``nam_core.testing.model_parity`` runs the scan and ``ReferenceSSMScan`` (fp32) on the same values and reports
``max |kernel - reference| / max |reference|`` over the output and the gradient of every input.
"""

from __future__ import annotations

import torch

from nam56r.testing import SCAN_INPUTS, random_scan_inputs
from nam_core.testing import model_parity, new_seed, worst

TOLERANCE = 5e-2
"""Max relative-to-max error per tensor in bf16. The kernels keep bf16 operands in their matmuls, store the
chunk states and the per-head dQ/dK in bf16 and accumulate in fp32; one bf16 rounding is ~4e-3 relative, and a
gradient passes through several. Upstream's own MIMO tests accept 0.10."""

INPUT_NAMES = SCAN_INPUTS

ACTIVATIONS = ("q", "k", "v", "z", "trap")
"""Handed to the kernels in the low-precision dtype; the rest stay fp32."""


def random_inputs(b: int, l: int, h: int, g: int, n: int, p: int, r: int, *, device, seed: int,
                  dtype=torch.bfloat16, rope_fraction: float = 0.5) -> dict[str, torch.Tensor | None]:
    """The ``SSMScan`` arguments by name (``INPUT_NAMES``), already rounded to what the kernels read."""
    return random_scan_inputs(b, l, h, g, n, p, r, device=device, seed=seed, dtype=dtype,
                              rope_fraction=rope_fraction)


def compare(scan, b: int, l: int, h: int, g: int, n: int, p: int, r: int, *, chunk_size: int, device="cuda",
            seed: int | None = None, dtype=torch.bfloat16) -> dict[str, float]:
    """Relative error of ``scan``'s output and every input gradient against ``ReferenceSSMScan`` (fp32), plus
    the ``seed``. ``scan`` gets the activations in ``dtype`` and the fp32 inputs as fp32."""
    from nam56r.reference.mamba3 import ReferenceSSMScan

    seed = new_seed() if seed is None else seed
    x = random_inputs(b, l, h, g, n, p, r, device=device, seed=seed, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    dout = torch.randn(b, l, h, p, generator=gen).to(device)

    def call(fn):
        return lambda **a: fn(*(a[k] for k in INPUT_NAMES), chunk_size=chunk_size)

    return model_parity(call(scan), call(ReferenceSSMScan()), x, activations=ACTIVATIONS, dtype=dtype,
                        dout=dout, seed=seed)


def parity(scan, *, n: int = 128, p: int = 64, r: int = 4, chunk_size: int = 16, device="cuda") -> tuple[float, dict]:
    """Preflight's launch of ``scan`` (a ``MambaSSMScan``) at the model's static widths (which share the compiled
    kernels with a real run) and a small batch, length and head count: ``(worst error, details)``. Two groups of
    two heads: the grouped backward is exercised."""
    details = compare(scan, 1, 4 * chunk_size, 4, 2, n, p, r, chunk_size=chunk_size, device=device)
    return worst(details), details
