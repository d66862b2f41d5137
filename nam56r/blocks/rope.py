"""Rotary position embedding in the two pairings NAM56R's attention uses.

RoPE rotates pairs of channels by an angle ``position * theta^(-2i/r)`` for pair ``i`` of an ``r``-wide slice.
Which channels form pair ``i`` is a convention, and the two halves of DSA disagree on it:

* MLA (``apply_rope_interleaved``): adjacent channels ``(2i, 2i+1)``, as DeepSeek-V3's ``apply_rotary_emb``.
* The lightning indexer (``apply_rope_halves``): channels ``(i, i + r/2)``. DeepSeek-V3.2-Exp shipped the
  indexer with the interleaved pairing and fixed it to this one in 2025-11 (commit 8631a81; see
  kernels-and-math.md section 2.6); Megatron calls the switch ``dsa_indexer_rope_interleaved``.

Both rotations are exact orthogonal maps, so either pairing is a valid RoPE; the point is to match the kernels
and checkpoints that assume one. Tables are built per forward from the sequence length: an outer product of
``s x r/2`` numbers, cheaper than keeping buffers in sync across devices and dtypes.
"""

from __future__ import annotations

import torch


def rope_cos_sin(
    seq_len: int, dim: int, theta: float, *, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``position * theta^(-2i/dim)`` for positions ``0..seq_len-1``.

    Returns two ``[seq_len, dim/2]`` tensors in ``dtype`` (callers pass fp32 or wider: the angles reach
    ``seq_len`` radians, which bf16 cannot hold to better than a few units).
    """
    if dim % 2:
        raise ValueError(f"RoPE needs an even width, got {dim}; check qk_rope_dim / index_head_dim in the config")
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=device, dtype=dtype) / dim)  # [r/2]
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=dtype), inv_freq)  # [s, r/2]
    return angles.cos(), angles.sin()


def _table_dtype(x: torch.Tensor) -> torch.dtype:
    # fp32 at least (see rope_cos_sin); float64 stays float64 so CPU parity tests stay exact.
    return torch.promote_types(x.dtype, torch.float32)


def _broadcast(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # [s, r/2] -> [1, s, 1, ..., r/2] against x [b, s, ..., r]: sequence is dim 1 everywhere in nam56r.
    return table.view(1, table.shape[0], *([1] * (x.ndim - 3)), table.shape[1])


def apply_rope_interleaved(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs ``(2i, 2i+1)`` of the last dim of ``x [b, s, ..., r]`` (MLA's convention)."""
    dtype = _table_dtype(x)
    cos, sin = rope_cos_sin(x.shape[1], x.shape[-1], theta, device=x.device, dtype=dtype)
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    pairs = x.to(dtype).unflatten(-1, (-1, 2))  # [..., r/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def apply_rope_halves(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs ``(i, i + r/2)`` of the last dim of ``x [b, s, ..., r]`` (the DSA indexer's convention)."""
    dtype = _table_dtype(x)
    cos, sin = rope_cos_sin(x.shape[1], x.shape[-1], theta, device=x.device, dtype=dtype)
    cos, sin = _broadcast(cos, x), _broadcast(sin, x)
    first, second = x.to(dtype).chunk(2, dim=-1)  # [..., r/2] each
    out = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return out.to(x.dtype)
