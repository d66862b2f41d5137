"""mimo-scan against nam's pure-PyTorch scan on fresh random inputs: preflight, the tests, the benchmark.

Inputs are drawn the way the Mamba-3 mixer makes them (``nam56r.testing.random_scan_inputs``). Angles arrive as
the mixer passes them: one ``[b, l, 1, s]`` tensor expanded over the heads (stride 0), so ``dangles`` is the
sum over the heads. ``nam_core.testing.model_parity`` runs the kernels and ``ReferenceSSMScan`` (fp32) on the
same values and reports ``max |kernel - reference| / max |reference|`` over the output and the gradient of
every input.
"""

from __future__ import annotations

import torch

from nam56r.testing import SCAN_INPUTS, random_scan_inputs
from nam_core.checks import Measured
from nam_core.testing import model_parity, new_seed, worst

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
"""Max relative-to-max error per tensor. bf16: the kernels' dot operands (rotated q/k, v, the weighted score
tile, the carried states S_in and dS_out) are each rounded to bf16 once (~4e-3 relative per rounding, 8
mantissa bits) and a gradient passes through two or three such products; fp32 accumulation everywhere else.
fp32 (the CPU interpreter): only summation order differs, measured ~1e-6; 1e-4 leaves room."""

INPUT_NAMES = SCAN_INPUTS

ACTIVATIONS = ("q", "k", "v", "z")
"""Passed to the kernels in the low-precision dtype; the rest stay fp32 as the mixer hands them."""


def random_inputs(b: int, l: int, h: int, g: int, n: int, p: int, r: int, *, device, seed: int,
                  dtype=torch.bfloat16, rope_fraction: float = 0.5) -> dict[str, torch.Tensor]:
    """The ``SSMScan`` arguments by name (``INPUT_NAMES``), fp32, activations already rounded to ``dtype``;
    ``angles`` is ``[b, l, 1, s]`` (expand it over the heads)."""
    return random_scan_inputs(b, l, h, g, n, p, r, device=device, seed=seed, dtype=dtype,
                              rope_fraction=rope_fraction, shared_angles=True)


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
    dout = torch.randn(b, l, h, p, generator=gen).to(device)

    def args(a: dict) -> list:  # the mixer's broadcast view of the angles: [b, l, 1, s] -> [b, l, h, s]
        return [a[k].expand(b, l, h, -1) if k == "angles" else a[k] for k in INPUT_NAMES]

    return model_parity(lambda **a: mimo_scan(*args(a), block_t=block_t),
                        lambda **a: ReferenceSSMScan()(*args(a), chunk_size=reference_chunk),
                        x, activations=ACTIVATIONS, dtype=dtype, dout=dout, seed=seed, norms=norms)


def parity(*, n: int = 128, p: int = 64, r: int = 4, device="cuda") -> tuple[float, dict]:
    """Preflight's launch at the model's widths with a small batch, length and head count: ``(worst error,
    details)``. b=1, l=100 (ragged: 6 tiles of 16 tokens and one of 4 at rank 4), 4 heads in 2 groups (the dq/dk
    head loop sums 2 heads)."""
    details = compare(1, 100, 4, 2, n, p, r, device=device)
    return worst(details), details


def launch(spec) -> Measured:
    """Preflight's row on a real CUDA device (``PLUGIN.checks``): ``parity`` at the run's widths (NAM56R's
    without a run)."""
    from nam56r.config import NAM56RConfig

    model = spec.model if spec is not None else NAM56RConfig()
    err, details = parity(n=model.d_state, p=model.mamba_headdim, r=model.mamba_mimo_rank)
    return Measured(err <= TOLERANCE[torch.bfloat16],
                    f"worst relative error {err:.2e} (b=1 l=100 h=4 g=2 bf16; seed {details['seed']})")
