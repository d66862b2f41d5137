"""The ``hopper-ce`` head: ``sum_t m_t * CE(h_t W^T, y_t)`` in chunks of tokens, fp32 logits, exact gradients.

Per chunk of ``CHUNK_TOKENS`` tokens (``c``), with ``W [v, d]`` and ``h [c, d]`` in bf16:

* forward: ``logits = h W^T`` as one cuBLAS product with **fp32 output** (``torch.mm(..., out_dtype=fp32)``:
  bf16 tensor-core inputs, the fp32 accumulator stored as is; Liger and plain torch round it to bf16), then
  ``row_lse_loss``. Only ``lse [t]`` (fp32) is kept for backward, besides the inputs.
* backward, one vocabulary slice of ``VOCAB_SLICE`` rows of W at a time (the full-row ``lse`` from forward
  makes the slices independent), and within it chunk by chunk: the product again for the slice,
  ``row_grad`` writes ``g = (softmax - onehot) * m * dL`` in bf16, then ``dh += g W_slice`` and
  ``dW_slice += g^T h``, both accumulated in **fp32** by cuBLAS (``addmm(..., out_dtype=fp32)``); each
  finished slice of dW is cast into W's dtype, and dh once at the end.

So nothing of size ``[t, v]`` exists and nothing but ``lse`` is held between forward and backward (the model
calls the head three times, LM + 2 MTP, before its backward). Transients at NAM56R's head: forward one
chunk's fp32 logits (1 GiB at 2048 x 131072); backward the bf16 dW being filled (1 GiB), one slice's fp32
dW (512 MiB at 32768 rows), fp32 dh (128 MiB at 8192 tokens) and one chunk-by-slice of fp32 logits and bf16
gradient (384 MiB). Masked tokens contribute exactly 0 and their targets are never read.

``gradients="forward"`` (the plugin option ``hopper-ce.gradients``, the default) does three products instead of
four: each chunk's full-vocabulary fp32 logits, once they have given ``lse``, also give ``g = (softmax - onehot) *
m`` in bf16 right away, so ``dh_chunk = g W`` and ``dW += g^T h`` (fp32 in cuBLAS) run in the forward and no product is
repeated in backward. The head's loss is a scalar, so its upstream gradient ``dL`` is one number: backward only
scales the held ``dh`` and ``dW`` by it. What that costs: ``dh`` (``[t, d]``) and ``dW`` (``[v, d]``), both in
W's dtype, are held from the call's forward to its backward (1.13 GiB per call at 16384 tokens x 4096 x
131072, three calls a step), a full fp32 dW (2 GiB) exists during the call's forward, and dh and dW are rounded
to bf16 once before the scaling by ``dL`` (the backward path rounds once after it): the same values within one
bf16 rounding (2^-9 relative). Under ``torch.no_grad`` (or when neither input needs a gradient) it computes the
loss alone, as the default does.

The two cuBLAS calls with ``out_dtype`` are CUDA-only; ``Matmuls`` lets the CPU tests substitute plain fp32
products around the same row kernels (run under Triton's interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nam_core.errors import NamError
from nam_plugin_hopper_ce.plugin import GRADIENTS, NAME

CHUNK_TOKENS = 2048
VOCAB_SLICE = 32768
"""Chosen on the H100 at 8192 x 4096 x 131072 (bench/hopper_ce.py --configs, results/hopper_ce.json): 2048:32768
took 60.8 ms at 2.00 GiB extra peak; 1024:32768 65.0 ms / 1.81 GiB; 2048:65536 59.2 ms / 2.88 GiB;
4096:16384 59.6 ms / 4.00 GiB; Liger 64.8 ms / 3.06 GiB."""


@dataclass(frozen=True)
class Matmuls:
    """``logits(h [c, d], w [v, d]) -> h w^T [c, v] fp32`` and ``accumulate(acc fp32, a, b)``: ``acc += a b``
    in place, 16-bit operands, fp32 accumulator."""

    logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    accumulate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def _cuda_logits(h, w):
    return torch.mm(h, w.t(), out_dtype=torch.float32)


def _cuda_accumulate(acc, a, b):
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


CUBLAS = Matmuls(_cuda_logits, _cuda_accumulate)


class HopperLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, mask, chunk: int, vocab_slice: int, mm: Matmuls):
        from nam_plugin_hopper_ce.kernel import row_lse_loss

        t = hidden.shape[0]
        mask = mask.to(torch.float32).contiguous()
        lse = torch.empty(t, dtype=torch.float32, device=hidden.device)
        rows = torch.empty(t, dtype=torch.float32, device=hidden.device)
        for s in range(0, t, chunk):
            logits = mm.logits(hidden[s : s + chunk], weight)  # [c, v] fp32
            row_lse_loss(logits, target[s : s + chunk], mask[s : s + chunk], lse[s : s + chunk],
                         rows[s : s + chunk])
        ctx.chunk, ctx.vocab_slice, ctx.mm = chunk, vocab_slice, mm
        ctx.save_for_backward(hidden, weight, target, mask, lse)
        return rows.sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        from nam_plugin_hopper_ce.kernel import row_grad

        hidden, weight, target, mask, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        (t, d), v, chunk, mm = hidden.shape, weight.shape[0], ctx.chunk, ctx.mm
        row_weight = (mask * grad_loss.to(torch.float32)).contiguous()  # [t], on the device: no host sync
        dh32 = torch.zeros((t, d), dtype=torch.float32, device=hidden.device) if need_h else None
        dw = torch.empty_like(weight) if need_w else None
        for v0 in range(0, v, ctx.vocab_slice):
            w_slice = weight[v0 : v0 + ctx.vocab_slice]  # [vs, d]
            dw32 = torch.zeros(w_slice.shape, dtype=torch.float32, device=weight.device) if need_w else None
            for s in range(0, t, chunk):
                h = hidden[s : s + chunk]
                logits = mm.logits(h, w_slice)  # [c, vs] fp32
                g = torch.empty(logits.shape, dtype=hidden.dtype, device=hidden.device)
                row_grad(logits, lse[s : s + chunk], target[s : s + chunk], row_weight[s : s + chunk], g, col0=v0)
                del logits
                if need_h:
                    mm.accumulate(dh32[s : s + chunk], g, w_slice)
                if need_w:
                    mm.accumulate(dw32, g.t(), h)
                del g
            if need_w:
                dw[v0 : v0 + ctx.vocab_slice].copy_(dw32)
                del dw32
        return None if dh32 is None else dh32.to(hidden.dtype), dw, None, None, None, None, None


class HopperLinearCEGradsInForward(torch.autograd.Function):
    """The ``gradients="forward"`` path: loss and both gradients in one pass over the chunks (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, mask, chunk: int, need_h: bool, need_w: bool, mm: Matmuls):
        from nam_plugin_hopper_ce.kernel import row_grad, row_lse_loss

        (t, d), v = hidden.shape, weight.shape[0]
        mask = mask.to(torch.float32).contiguous()
        lse = torch.empty(t, dtype=torch.float32, device=hidden.device)
        rows = torch.empty(t, dtype=torch.float32, device=hidden.device)
        dh = torch.empty_like(hidden) if need_h else None
        dw32 = torch.zeros((v, d), dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, t, chunk):
            h = hidden[s : s + chunk]
            logits = mm.logits(h, weight)  # [c, v] fp32
            row_lse_loss(logits, target[s : s + chunk], mask[s : s + chunk], lse[s : s + chunk], rows[s : s + chunk])
            g = torch.empty(logits.shape, dtype=hidden.dtype, device=hidden.device)
            row_grad(logits, lse[s : s + chunk], target[s : s + chunk], mask[s : s + chunk], g, col0=0)
            del logits
            if need_h:
                dh32 = torch.zeros((h.shape[0], d), dtype=torch.float32, device=hidden.device)
                mm.accumulate(dh32, g, weight)
                dh[s : s + chunk].copy_(dh32)
                del dh32
            if need_w:
                mm.accumulate(dw32, g.t(), h)
            del g
        dw = None
        if need_w:
            dw = dw32.to(weight.dtype)
            del dw32
        ctx.save_for_backward(dh, dw)
        return rows.sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        scale = grad_loss.to(torch.float32)  # a 0-dim device tensor: the products stay in dh's and dW's dtype
        return (None if dh is None else dh * scale, None if dw is None else dw * scale,
                None, None, None, None, None, None)


class HopperCEHead:
    """``CEHead`` (nam56r/backends.py): ``sum_t mask_t * CE_t`` as an fp32 scalar; ``mask`` is a per-token weight
    (0 for masked tokens) and gets no gradient."""

    def __init__(self, chunk_tokens: int = CHUNK_TOKENS, vocab_slice: int = VOCAB_SLICE,
                 matmuls: Matmuls | None = None, gradients: str = GRADIENTS[0]):
        if chunk_tokens < 1 or vocab_slice < 1:
            raise ValueError(f"chunk_tokens and vocab_slice must be >= 1, found {chunk_tokens}, {vocab_slice}")
        if gradients not in GRADIENTS:
            raise ValueError(f"gradients must be one of {GRADIENTS}, found {gradients!r}")
        self.chunk_tokens, self.vocab_slice, self.matmuls = chunk_tokens, vocab_slice, matmuls
        self.gradients = gradients

    @classmethod
    def build(cls, ctx) -> "HopperCEHead":
        """The run's head: the plugin's ``gradients`` option (``hopper-ce.gradients``); defaults without a run."""
        options = ctx.options.get(NAME)
        return cls() if options is None else cls(gradients=options.gradients)

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        mm = self.matmuls
        if mm is None:
            if not (hidden.is_cuda and weight.is_cuda):
                raise NamError(f"the hopper-ce head runs cuBLAS and Triton on CUDA tensors; found hidden on "
                               f"{hidden.device}, weight on {weight.device}",
                               hint="train on a GPU (--device cuda), or the reference head: --set "
                                    "ce_backend=reference --plugins reference")
            mm = CUBLAS
        if hidden.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != hidden.dtype:
            raise NamError(f"the hopper-ce head takes bf16 or fp16 hidden and weight of one dtype; found "
                           f"{hidden.dtype} and {weight.dtype}", hint="--set train.dtype=bfloat16")
        hidden, weight, target = hidden.contiguous(), weight.contiguous(), target.contiguous()
        if self.gradients == "forward":
            grad = torch.is_grad_enabled()
            return HopperLinearCEGradsInForward.apply(hidden, weight, target, mask, self.chunk_tokens,
                                                      grad and hidden.requires_grad, grad and weight.requires_grad, mm)
        return HopperLinearCE.apply(hidden, weight, target, mask, self.chunk_tokens, self.vocab_slice, mm)
