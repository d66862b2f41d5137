"""Per-tensor FP8 quantisation with an amax history (delayed scaling), and its Triton kernel.

A tensor ``x`` goes to FP8 as ``q = saturate(x / s)`` and comes back as ``q * s``; ``s`` (the *dequantisation*
scale handed to ``torch._scaled_mm``) is one fp32 number per tensor::

    s = max(history) / FP8_MAX            history: the amax of this role's tensor over its last N calls

The history holds *earlier* calls only, so the cast needs no pass over ``x`` before it: one kernel reads ``x``
once, writes ``q`` and records ``amax(x)`` for the next call (delayed scaling). A value above the history's
maximum saturates to +-FP8_MAX. The first call of a role (empty history) measures ``amax(x)`` first and uses
it, so the opening call is never clipped. Weights take their exact current amax per expert instead: they are
small next to the activations, and there is nothing to gain by delaying.

Formats: E4M3 (max 448, 3 mantissa bits) for activations and weights, E5M2 (max 57344, 2 mantissa bits) for
gradients, the usual "hybrid" split.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}

ROLES = ("x", "a", "dy", "dh")
"""Activation roles with a history: the gate/up GEMM input, the (gated) down GEMM input, the gradient at the
layer output, the gradient at the gate/up output."""
FORMAT = {"x": E4M3, "a": E4M3, "dy": E5M2, "dh": E5M2}


class AmaxHistory(nn.Module):
    """One MoE layer's activation amaxes over its last ``length`` calls (``ROLES`` rows), fp32, on device.

    Calls, not optimizer steps: with gradient accumulation each micro-batch writes its own slot. Buffers are
    non-persistent (a checkpoint has the same keys with or without FP8); a resumed run starts a new history.
    """

    def __init__(self, length: int):
        super().__init__()
        if length < 1:
            raise ValueError(f"amax history length must be >= 1, found {length}")
        self.length = length
        self.register_buffer("amax", torch.zeros(len(ROLES), length), persistent=False)
        self.calls = 0  # forward calls so far (host-side: picks the slot, never read from the device)
        self.seen: set[str] = set()  # roles with at least one recorded amax (host-side)

    def row(self, role: str) -> torch.Tensor:
        return self.amax[ROLES.index(role)]


def torch_cast(x: torch.Tensor, inv_scale: torch.Tensor, amax_out: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """Reference cast: ``saturate(x * inv_scale)`` in ``fmt``; writes ``amax(|x|)`` into ``amax_out`` (0-dim)."""
    amax_out.copy_(x.detach().abs().amax().float())
    limit = FP8_MAX[fmt]
    return (x.float() * inv_scale).clamp(-limit, limit).to(fmt)


def quantize(x: torch.Tensor, hist: AmaxHistory, role: str, slot: int,
             cast=torch_cast) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in FP8 for ``role`` and its dequantisation scale (0-dim fp32); records ``amax(x)`` at ``slot``.

    ``cast(x, inv_scale, amax_out, fmt)`` does the elementwise work (``triton_cast`` on a GPU, ``torch_cast``
    as its reference).
    """
    fmt, row = FORMAT[role], hist.row(role)
    first = role not in hist.seen  # host-side flag: no slot of this role's history written yet
    hist.seen.add(role)
    ref = x.detach().abs().amax().float() if first else row.max()
    scale = torch.where(ref > 0, ref / FP8_MAX[fmt], torch.ones_like(ref))
    q = cast(x, 1.0 / scale, row[slot], fmt)
    return q, scale


SCALE_STRIDE = 64
"""fp32 elements between two experts' scales (256 bytes). cuBLASLt refuses a tensor-wise FP8 scale whose
address is not aligned (measured on the H100 host, torch 2.11 + CUDA 13: ``scale[1]`` of a packed ``[E]``
tensor, 4 bytes in, gives CUBLAS_STATUS_NOT_SUPPORTED; a fresh allocation works), so each expert's scale
starts its own 256-byte block."""


def weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights ``[E, n, k]`` in E4M3 and one scale per expert (current amax): ``[E]`` fp32 whose
    elements lie ``SCALE_STRIDE`` apart, so ``scale[e]`` can go to ``torch._scaled_mm`` as it is."""
    amax = w.detach().abs().amax(dim=(1, 2)).float()
    scale = torch.where(amax > 0, amax / FP8_MAX[E4M3], torch.ones_like(amax))
    q = (w.detach().float() / scale[:, None, None]).clamp(-FP8_MAX[E4M3], FP8_MAX[E4M3]).to(E4M3)
    aligned = torch.zeros(w.shape[0], SCALE_STRIDE, dtype=torch.float32, device=w.device)
    aligned[:, 0] = scale
    return q, aligned[:, 0]
