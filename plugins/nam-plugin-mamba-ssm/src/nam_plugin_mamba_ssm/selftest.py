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


GROUP_AXIS = {"q": 3, "k": 3}
"""Where the inputs hold their group (``[b, l, r, g, n]``); every other input and the output hold heads: on axis
2 for ``[b, l, h, *]`` (v, z, angles), 1 for ``[b, h, l]`` (adt, dt, trap), 0 for per-head parameters."""

HEAD_AXIS = {"v": 2, "z": 2, "angles": 2, "out": 2, "adt": 1, "dt": 1, "trap": 1,
             "q_bias": 0, "k_bias": 0, "d": 0, "mimo_x": 0, "mimo_z": 0, "mimo_o": 0}


def first_group(h: int, g: int):
    """``model_parity``'s ``view`` onto group 0 (its ``h // g`` heads). The scan is independent across groups --
    a group's heads read only that group's q and k, and every per-head parameter's gradient sums over the batch
    and the sequence, not over heads -- so the kernel's output and gradients restricted to group 0 must equal
    the reference run on group 0 alone."""
    heads = h // g

    def view(name: str, t: torch.Tensor) -> torch.Tensor:
        if name in GROUP_AXIS:
            return t.narrow(GROUP_AXIS[name], 0, 1)
        return t.narrow(HEAD_AXIS[name], 0, heads)
    return view


def compare(scan, b: int, l: int, h: int, g: int, n: int, p: int, r: int, *, chunk_size: int, device="cuda",
            seed: int | None = None, dtype=torch.bfloat16, one_group: bool = False) -> dict[str, float]:
    """Relative error of ``scan``'s output and every input gradient against ``ReferenceSSMScan`` (fp32), plus
    the ``seed``. ``scan`` gets the activations in ``dtype`` and the fp32 inputs as fp32. ``one_group``: the
    reference runs on group 0 only and the kernel is compared there (``first_group``): a kernel launched at a
    run's full size is checked at 1/g of the reference's cost."""
    from nam56r.reference.mamba3 import ReferenceSSMScan

    seed = new_seed() if seed is None else seed
    x = random_inputs(b, l, h, g, n, p, r, device=device, seed=seed, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    dout = torch.randn(b, l, h, p, generator=gen, device=device)

    def call(fn):
        return lambda **a: fn(*(a[k] for k in INPUT_NAMES), chunk_size=chunk_size)

    return model_parity(call(scan), call(ReferenceSSMScan()), x, activations=ACTIVATIONS, dtype=dtype,
                        dout=dout, seed=seed, view=first_group(h, g) if one_group else None)


def parity(scan, *, n: int = 128, p: int = 64, r: int = 4, chunk_size: int = 16, device="cuda") -> tuple[float, dict]:
    """Preflight's launch of ``scan`` (a ``MambaSSMScan``) at the model's static widths (which share the compiled
    kernels with a real run) and a small batch, length and head count: ``(worst error, details)``. Two groups of
    two heads: the grouped backward is exercised."""
    details = compare(scan, 1, 4 * chunk_size, 4, 2, n, p, r, chunk_size=chunk_size, device=device)
    return worst(details), details


def parity_at(scan, b: int, l: int, h: int, g: int, *, n: int, p: int, r: int, chunk_size: int,
              device="cuda") -> tuple[float, dict]:
    """Preflight's launch at a run's own size ``(b, l, h, g)``: the kernels it compiles are the ones the run's
    first step uses (they are compiled per exact size), so a cold host builds one set, not a self-test set and
    then the run's. The reference runs on group 0 (``first_group``)."""
    details = compare(scan, b, l, h, g, n, p, r, chunk_size=chunk_size, device=device, one_group=True)
    return worst(details), details
