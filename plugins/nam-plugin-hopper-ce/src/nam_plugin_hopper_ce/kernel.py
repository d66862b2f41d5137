"""The two Triton row kernels of the hopper-ce head, over one chunk of fp32 logits ``[c, v]``.

One program per row walks the vocabulary ``BLOCK_V`` at a time:

* ``row_lse_loss``: an online max and sum of exponentials give ``lse``; the loss is ``(lse - logit[y]) * m``.
  A row with ``m == 0`` reads no target (its id may be a placeholder such as -100) and its loss is 0.
* ``row_grad``: ``g = (exp(logit - lse) - onehot(y)) * w`` with ``w = m * dL/dloss``, written in the
  activation dtype: the logits gradient that the two cuBLAS products of the backward read, for one slice of
  the vocabulary (``lse`` is the whole row's, from forward). A row with ``w == 0`` is written as zeros.

Everything is computed in fp32; only ``g`` is stored narrower (the operand the bf16 tensor cores take).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def _row_lse_loss(logits, target, mask, lse_out, loss_out, V, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    m = tl.load(mask + row)
    run_max = -float("inf")
    run_sum = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=-float("inf"))
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        run_max = new_max
    lse = run_max + tl.log(run_sum)
    y = tl.where(m != 0, tl.load(target + row), 0)
    picked = tl.load(base + y)
    tl.store(lse_out + row, lse)
    tl.store(loss_out + row, tl.where(m != 0, (lse - picked) * m, 0.0))


@triton.jit
def _row_grad(logits, lse_in, target, weight, grad_out, V, stride, grad_stride, col0, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    out = grad_out + row * grad_stride
    w = tl.load(weight + row)
    lse = tl.load(lse_in + row)
    y = tl.where(w != 0, tl.load(target + row) - col0, -1)  # column within this slice; -1 matches none
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        live = cols < V
        x = tl.load(base + cols, mask=live, other=0.0)
        g = (tl.exp(x - lse) - tl.where(cols == y, 1.0, 0.0)) * w
        tl.store(out + cols, g.to(grad_out.dtype.element_ty), mask=live)


def row_lse_loss(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, lse: torch.Tensor,
                 loss: torch.Tensor, block: int = BLOCK_V) -> None:
    """Fill ``lse [c]`` and ``loss [c]`` (fp32) from ``logits [c, v]`` fp32 (unit stride over v)."""
    c, v = logits.shape
    _row_lse_loss[(c,)](logits, target, mask, lse, loss, v, logits.stride(0), BLOCK=block)


def row_grad(logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
             grad: torch.Tensor, col0: int = 0, block: int = BLOCK_V) -> None:
    """Fill ``grad [c, vs]`` (activation dtype) with ``(softmax - onehot(target)) * weight[:, None]`` for the
    vocabulary slice ``[col0, col0 + vs)`` whose logits are ``logits [c, vs]``; ``lse`` is the full row's."""
    c, v = logits.shape
    _row_grad[(c,)](logits, lse, target, weight, grad, v, logits.stride(0), grad.stride(0), col0, BLOCK=block)
