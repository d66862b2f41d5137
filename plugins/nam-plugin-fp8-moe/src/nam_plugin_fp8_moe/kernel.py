"""The FP8 cast as one Triton pass: read x once, write saturate(x * inv_scale) in FP8, atomically max |x|.

Same contract and result as ``quant.torch_cast`` (fp32 multiply, round to nearest even, saturate), which is
its reference in the GPU tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nam_plugin_fp8_moe.quant import FP8_MAX

BLOCK = 8192


@triton.jit
def _cast_kernel(x_ptr, q_ptr, inv_ptr, amax_ptr, n, limit, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    live = offs < n
    x = tl.load(x_ptr + offs, mask=live, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))
    y = tl.minimum(tl.maximum(x * tl.load(inv_ptr), -limit), limit)
    tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=live)


def triton_cast(x: torch.Tensor, inv_scale: torch.Tensor, amax_out: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """``saturate(x * inv_scale)`` in ``fmt`` (E4M3 or E5M2); ``amax(|x|)`` lands in ``amax_out`` (0-dim fp32)."""
    if not x.is_cuda or not x.is_contiguous():
        raise ValueError(f"triton_cast takes a contiguous CUDA tensor, found device={x.device}, "
                         f"contiguous={x.is_contiguous()}")
    q = torch.empty(x.shape, dtype=fmt, device=x.device)
    amax_out.zero_()
    n = x.numel()
    _cast_kernel[(triton.cdiv(n, BLOCK),)](x, q, inv_scale.reshape(1).float(), amax_out, n, FP8_MAX[fmt],
                                           BLOCK=BLOCK, num_warps=8)
    return q
