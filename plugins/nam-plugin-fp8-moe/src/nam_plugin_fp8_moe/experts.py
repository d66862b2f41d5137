"""The ``fp8`` routed experts: tokens dispatched to their experts, expert GEMMs through ``torch._scaled_mm``.

Dispatch (no capacity, no dropped token)::

    slots   s = token * k + j  for the k choices of each token; chosen[s] is its expert
    order   the slots sorted by expert (stable), so expert e owns rows offsets[e] : offsets[e] + counts[e]
    tok     order // k: the token behind each sorted row

The per-expert row counts are read on the host once per layer call (``bincount(...).tolist()``), as every
dropless grouped-GEMM MoE must. Per expert e, with ``X_e`` its tokens' rows and ``g`` their gates::

    H_e  = X_e W_gu[e]^T                    [n_e, 2f]   FP8 x FP8 (E4M3)
    A_e  = swiglu(H_e) * g                  [n_e, f]    bf16 (the gate is applied before the down GEMM)
    O_e  = A_e W_d[e]^T                     [n_e, d]    FP8 x FP8 (E4M3)
    y    = sum over each token's k rows of O
  backward, dY the gradient of y, dO = dY at each row's token:
    dA_e = dO_e W_d[e]                      [n_e, f]    FP8 (E5M2 gradient) x FP8 (E4M3 weight)
    dW_d[e]  = dO_e^T A_e                   [d, f]      bf16
    dg   = rowsum(dA * swiglu(H)),   dH = swiglu'(H) . (dA * g)
    dX_e = dH_e W_gu[e]                     [n_e, d]    FP8 (E5M2) x FP8 (E4M3)
    dW_gu[e] = dH_e^T X_e                   [2f, d]     bf16

Forward and input-gradient GEMMs run in FP8; the two weight-gradient GEMMs stay bf16. In FP8 they would need
a transposed FP8 copy of a ``[t*k, d]`` operand each (``_scaled_mm`` takes its second operand column-major):
at NAM56R's shapes (d = 4096, 2f = 320) that copy moves about as many bytes as the GEMM saves.

Quantisation is per tensor (``quant.py``): one scale per activation/gradient role from the layer's amax
history, one per expert weight. GEMM outputs are bf16. The forward GEMMs accumulate exactly in fp32
(``use_fast_accum=False``); the input-gradient GEMMs use Hopper's fast FP8 accumulation, whose error is small
next to the E5M2 rounding of their gradient operand (measured on the H100 host at NAM56R's shapes: the down
GEMM's input gradient 0.526 -> 0.378 ms, the gate/up one 0.615 -> 0.569 ms).

``precision="bf16"`` runs the same dispatch with bf16 GEMMs (``torch.mm``): the like-for-like baseline of the
benchmark and the tests.
"""

from __future__ import annotations

import torch

from nam56r.blocks.mlp import swiglu
from nam_plugin_fp8_moe.quant import AmaxHistory, quantize, torch_cast, weight_fp8

PRECISIONS = ("fp8", "bf16")


def dispatch(chosen: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """``order`` [t*k] (slots sorted by expert), ``inverse`` [t*k] (each slot's sorted row), ``tok`` [t*k]
    (the sorted rows' tokens) and ``counts`` (rows per expert).

    ``counts`` comes to the host: the one device sync of a layer call.
    """
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, inverse, order // chosen.shape[1], counts


def _spans(counts: list[int]):
    """(expert, first row, rows) for every expert with at least one row."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, n
        start += n


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` along dim 0; FP8 rows are gathered as bytes."""
    if t.element_size() == 1:
        return t.view(torch.uint8)[index].view(t.dtype)
    return t[index]


def _gemm(a, b, scale_a, scale_b, out, *, fast_accum: bool = False) -> None:
    """``out = (a * scale_a) @ (b * scale_b)``; ``b`` column-major. bf16 operands when the scales are None."""
    if scale_a is None:
        torch.mm(a, b, out=out)
    else:
        torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out.dtype, out=out,
                         use_fast_accum=fast_accum)


class _Grouped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gates, w_gu, w_d, order, inverse, tok, counts, hist, fp8, cast):
        t, d = x.shape
        k = gates.shape[1]
        slot = hist.calls % hist.length
        hist.calls += 1
        g = gates.flatten()[order]  # [t*k] gates of the sorted rows
        if fp8:
            xq, sx = quantize(x, hist, "x", slot, cast)
            wq_gu, sw_gu = weight_fp8(w_gu)
        else:
            xq, sx, wq_gu, sw_gu = x, None, w_gu.to(x.dtype), [None] * w_gu.shape[0]
        xs = _rows(xq, tok)  # [t*k, d]
        h = x.new_empty(t * k, w_gu.shape[1])  # [t*k, 2f]
        for e, o, n in _spans(counts):
            _gemm(xs[o:o + n], wq_gu[e].t(), sx, sw_gu[e], h[o:o + n])
        ag = swiglu(h) * g[:, None]  # [t*k, f]
        if fp8:
            aq, sa = quantize(ag, hist, "a", slot, cast)
            wq_d, sw_d = weight_fp8(w_d)
        else:
            aq, sa, wq_d, sw_d = ag, None, w_d.to(x.dtype), [None] * w_d.shape[0]
        out = x.new_empty(t * k, d)
        for e, o, n in _spans(counts):
            _gemm(aq[o:o + n], wq_d[e].t(), sa, sw_d[e], out[o:o + n])
        ctx.save_for_backward(x, gates, w_gu, w_d, order, inverse, tok, h)
        ctx.counts, ctx.hist, ctx.slot, ctx.fp8, ctx.cast = counts, hist, slot, fp8, cast
        return out[inverse].view(t, k, d).sum(1)  # back to slot order (a gather), then each token's k rows

    @staticmethod
    def backward(ctx, dy):
        x, gates, w_gu, w_d, order, inverse, tok, h = ctx.saved_tensors
        counts, hist, slot, fp8, cast = ctx.counts, ctx.hist, ctx.slot, ctx.fp8, ctx.cast
        t, d = x.shape
        k = gates.shape[1]
        dy = dy.to(x.dtype).contiguous()
        g = gates.flatten()[order]
        a = swiglu(h)
        ag = a * g[:, None]
        dys = _rows(dy, tok)  # [t*k, d] bf16, for dW_d
        if fp8:
            dyq, sdy = quantize(dy, hist, "dy", slot, cast)
            dysq = _rows(dyq, tok)
            wq_d, sw_d = weight_fp8(w_d)
        else:
            dysq, sdy, wq_d, sw_d = dys, None, w_d.to(x.dtype), [None] * w_d.shape[0]
        wq_d_t = wq_d.transpose(1, 2).contiguous()  # [E, f, d]: row e, transposed, is W_d[e] column-major
        dag = x.new_empty(t * k, w_d.shape[2])  # [t*k, f]
        dw_d = torch.zeros(w_d.shape, dtype=x.dtype, device=x.device)
        for e, o, n in _spans(counts):
            _gemm(dysq[o:o + n], wq_d_t[e].t(), sdy, sw_d[e], dag[o:o + n], fast_accum=True)
            torch.mm(dys[o:o + n].t(), ag[o:o + n], out=dw_d[e])
        dgates = (dag.float() * a.float()).sum(-1)[inverse].view(t, k).to(gates.dtype)
        with torch.enable_grad():
            h_ = h.detach().requires_grad_()
            (dh,) = torch.autograd.grad(swiglu(h_), h_, dag * g[:, None])  # [t*k, 2f]
        if fp8:
            dhq, sdh = quantize(dh, hist, "dh", slot, cast)
            wq_gu, sw_gu = weight_fp8(w_gu)
        else:
            dhq, sdh, wq_gu, sw_gu = dh, None, w_gu.to(x.dtype), [None] * w_gu.shape[0]
        wq_gu_t = wq_gu.transpose(1, 2).contiguous()  # [E, d, 2f]
        xs = _rows(x, tok)  # [t*k, d] bf16, for dW_gu
        dxs = x.new_empty(t * k, d)
        dw_gu = torch.zeros(w_gu.shape, dtype=x.dtype, device=x.device)
        for e, o, n in _spans(counts):
            _gemm(dhq[o:o + n], wq_gu_t[e].t(), sdh, sw_gu[e], dxs[o:o + n], fast_accum=True)
            torch.mm(dh[o:o + n].t(), xs[o:o + n], out=dw_gu[e])
        dx = dxs[inverse].view(t, k, d).sum(1)
        return dx, dgates, dw_gu.to(w_gu.dtype), dw_d.to(w_d.dtype), None, None, None, None, None, None, None


class FP8Experts:
    """Kind ``moe`` backend ``fp8`` (see the module docstring). ``cast`` is the elementwise FP8 cast:
    ``triton_cast`` on a GPU (``build`` picks it for ``train.device=cuda``), ``torch_cast`` otherwise."""

    def __init__(self, *, amax_history: int = 16, precision: str = "fp8", cast=torch_cast):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, found {precision!r}")
        self.amax_history, self.precision, self.cast = amax_history, precision, cast

    @classmethod
    def build(cls, ctx) -> "FP8Experts":
        from nam_plugin_fp8_moe.plugin import NAME, PLUGIN

        opts = ctx.options.get(NAME) or PLUGIN.parse_options(NAME)  # no entry: built without a run
        cast = torch_cast
        if ctx.device == "cuda":
            from nam_plugin_fp8_moe.kernel import triton_cast

            cast = triton_cast
        return cls(amax_history=opts.amax_history, cast=cast)

    def layer_state(self, cfg) -> AmaxHistory:
        return AmaxHistory(self.amax_history)

    def __call__(self, x, chosen, gates, w_gate_up, w_down, state):
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"fp8 experts take bf16 or fp16 tokens, found {x.dtype}; set train.dtype=bfloat16")
        order, inverse, tok, counts = dispatch(chosen, w_gate_up.shape[0])
        return _Grouped.apply(x.contiguous(), gates, w_gate_up, w_down, order, inverse, tok, counts, state,
                              self.precision == "fp8", self.cast)
