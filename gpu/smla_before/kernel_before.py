"""Sparse MLA in absorbed form: each query token attends to the top-k keys its indexer picked, in Triton.

What one call computes (shapes as ``nam56r.backends.AttentionCore.sparse`` hands them over)::

    q        [b, s, h, dk]  bf16/fp16   absorbed queries: [q~ (kv_lora) ; q_rope]
    kv       [b, s, dk]     same dtype  one shared KV row per token: [c_kv (= the value, first dv) ; k_rope]
    indices  [b, s, topk]   int64       key positions per query; a slot is live iff 0 <= index <= t
    o        [b, s, h, dv]  q's dtype   o[t, i] = sum_{live j} softmax_j(scale * q[t, i] . kv[idx_j]) kv[idx_j, :dv]
    lse      [b, s, h]      fp32        log-sum-exp of the live logits (-inf for a row with no live slot)

Layout of the work. One program per (batch, query token). The token's ``h`` heads are the M side of every
``tl.dot`` (padded with masked rows to ``head_block(h)`` >= 16, tl.dot's smallest side), and the program
walks its ``topk`` slots ``BN`` at a time: it gathers those key rows of ``kv`` (masked slots read nothing,
so an index of -1 or beyond ``t`` never touches memory), scores them against all heads at once, and keeps
an online softmax. All heads of a token share the same gathered rows, which is why the heads, not the
keys, fill the tile: a row is read once per token, not once per head.

Precision. Logits ``q . k`` and ``dO . v`` are dots of the bf16 inputs with fp32 accumulation (products of
two bf16 are exact in fp32). Softmax, P, dP and dS stay fp32, and the dots that take them (P @ V, dS @ K,
dS^T @ Q, P^T @ dO) run on fp32 operands with ``input_precision=PRECISION``: "tf32x3" splits each fp32
operand into a high and a low TF32 part and sums three tensor-core products, ~fp32 accuracy at
tensor-core speed (the bf16 operand upcasts exactly, so its low part is zero). The upstream TileLang
kernels round P and dP to bf16 instead; NAM56R keeps them fp32.

Backward. One program per (batch, query token) again: it recomputes P from q, the gathered keys and the
saved lse, forms dP = dO . v and dS = P * (dP - delta), delta = rowsum(dO * O), writes dq (each program
owns its token's rows), and scatters the key/value gradients of its gathered rows with ``tl.atomic_add``
into one fp32 ``[b*s, dk]`` buffer: dS^T @ q * scale into all dk columns (the key), P^T @ dO into the
first dv (the value). Dead slots are masked out of the scatter. The buffer is cast to kv's dtype after.

Nothing here reads a tensor value on the host (no ``.item()``, no ``nonzero``, grids from shapes only), so
forward and backward can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nam_plugin_sparse_mla.shape import head_block, shape_problem

BLOCK_N = 64
"""Top-k slots per loop step (upstream TileLang sparse_mla_fwd's block_I is 64 too); >= 16 for tl.dot."""
PRECISION = "tf32x3"
"""tl.dot input precision of the dots with an fp32 operand (P, dS): ~fp32 accuracy on tensor cores."""
# log(0) for a row with no live slot; the backward masks such rows before it reads their lse.
_NO_SLOT = float("-inf")


# --- forward ---------------------------------------------------------------------------------------
@triton.jit
def _sparse_mla_fwd(Q, KV, IDX, O, LSE, s, h, topk, scale,
                    DK: tl.constexpr, DV: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr,
                    PREC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * s + t
    b = row // s
    t = row % s
    offs_h = tl.arange(0, HP)
    offs_dk = tl.arange(0, DK)
    offs_dv = tl.arange(0, DV)
    head_ok = offs_h < h
    heads = row * h + offs_h  # rows of q / o viewed as [b*s*h, .]
    q = tl.load(Q + heads[:, None] * DK + offs_dk[None, :], mask=head_ok[:, None], other=0.0)  # [HP, DK]
    m_i = tl.full([HP], -1.0e30, tl.float32)  # finite: a block with no live slot leaves exp(-inf - m) = 0
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, DV], tl.float32)
    for start in range(0, topk, BN):
        offs_n = start + tl.arange(0, BN)
        idx = tl.load(IDX + row * topk + offs_n, mask=offs_n < topk, other=-1)
        live = (idx >= 0) & (idx <= t)  # [BN]: -1 (empty) and future keys are dead
        key_rows = b * s + tl.where(live, idx, 0).to(tl.int64)  # [BN] rows of kv viewed as [b*s, dk]
        k = tl.load(KV + key_rows[:, None] * DK + offs_dk[None, :], mask=live[:, None], other=0.0)  # [BN, DK]
        v = tl.load(KV + key_rows[:, None] * DK + offs_dv[None, :], mask=live[:, None], other=0.0)  # [BN, DV]
        logits = tl.dot(q, tl.trans(k)) * scale  # [HP, BN] fp32
        logits = tl.where(live[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])  # [HP, BN] fp32, 0 on dead slots
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PREC)
        m_i = m_new
    has_slot = l_i > 0.0
    out = acc / tl.where(has_slot, l_i, 1.0)[:, None]  # a row with no live slot: 0, not 0/0
    lse = tl.where(has_slot, m_i + tl.log(tl.where(has_slot, l_i, 1.0)), float("-inf"))
    tl.store(O + heads[:, None] * DV + offs_dv[None, :], out.to(O.dtype.element_ty), mask=head_ok[:, None])
    tl.store(LSE + heads, lse, mask=head_ok)


# --- backward --------------------------------------------------------------------------------------
@triton.jit
def _sparse_mla_bwd(Q, KV, IDX, O, DO, LSE, DQ, DKV, s, h, topk, scale,
                    DK: tl.constexpr, DV: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr,
                    PREC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * s + t
    b = row // s
    t = row % s
    offs_h = tl.arange(0, HP)
    offs_dk = tl.arange(0, DK)
    offs_dv = tl.arange(0, DV)
    head_ok = offs_h < h
    heads = row * h + offs_h
    q = tl.load(Q + heads[:, None] * DK + offs_dk[None, :], mask=head_ok[:, None], other=0.0)  # [HP, DK]
    do = tl.load(DO + heads[:, None] * DV + offs_dv[None, :], mask=head_ok[:, None], other=0.0)  # [HP, DV]
    o = tl.load(O + heads[:, None] * DV + offs_dv[None, :], mask=head_ok[:, None], other=0.0)
    lse = tl.load(LSE + heads, mask=head_ok, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # [HP] fp32: rowsum(dO * O)
    q32 = q.to(tl.float32)
    do32 = do.to(tl.float32)
    dq = tl.zeros([HP, DK], tl.float32)
    for start in range(0, topk, BN):
        offs_n = start + tl.arange(0, BN)
        idx = tl.load(IDX + row * topk + offs_n, mask=offs_n < topk, other=-1)
        live = (idx >= 0) & (idx <= t)
        key_rows = b * s + tl.where(live, idx, 0).to(tl.int64)
        k = tl.load(KV + key_rows[:, None] * DK + offs_dk[None, :], mask=live[:, None], other=0.0)  # [BN, DK]
        v = tl.load(KV + key_rows[:, None] * DK + offs_dv[None, :], mask=live[:, None], other=0.0)  # [BN, DV]
        logits = tl.dot(q, tl.trans(k)) * scale
        # Padded heads and dead slots get p = 0, so they add nothing to dq or to the scatter below.
        p = tl.where(head_ok[:, None] & live[None, :], tl.exp(logits - lse[:, None]), 0.0)  # [HP, BN] fp32
        dp = tl.dot(do, tl.trans(v))  # [HP, BN] fp32
        ds = p * (dp - delta[:, None])  # [HP, BN] fp32; d logits = ds, d (q . k) = ds * scale
        dq += tl.dot(ds, k.to(tl.float32), input_precision=PREC)
        dk_rows = tl.dot(tl.trans(ds), q32, input_precision=PREC) * scale  # [BN, DK]
        dv_rows = tl.dot(tl.trans(p), do32, input_precision=PREC)  # [BN, DV]
        tl.atomic_add(DKV + key_rows[:, None] * DK + offs_dk[None, :], dk_rows, mask=live[:, None], sem="relaxed")
        tl.atomic_add(DKV + key_rows[:, None] * DK + offs_dv[None, :], dv_rows, mask=live[:, None], sem="relaxed")
    tl.store(DQ + heads[:, None] * DK + offs_dk[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=head_ok[:, None])


# --- autograd --------------------------------------------------------------------------------------
def _num_warps(hp: int, backward: bool = False) -> int:
    # Forward: 4 warps hold NAM56R's [32, 64] fp32 scores and [32, 64] accumulator; 64+ heads take 8.
    # Backward also carries dq [HP, DK] and the gathered rows' dK [BN, DK] / dV [BN, DV] tiles, ~3x the live
    # registers, so it takes 8. Not tuned on hardware yet: a starting point, not a measurement.
    return 8 if backward or hp > 32 else 4


class SparseMLAFunction(torch.autograd.Function):
    """``(q, kv, indices) -> (o, lse)``; see the module docstring. ``lse`` is not differentiable."""

    @staticmethod
    def forward(ctx, q, kv, indices, scale: float, d_v: int, block_n: int):
        b, s, h, dk = q.shape
        topk = indices.shape[-1]
        q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
        o = q.new_empty(b, s, h, d_v)
        lse = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
        hp = head_block(h)
        if b * s > 0:
            _sparse_mla_fwd[(b * s,)](q, kv, indices, o, lse, s, h, topk, scale,
                                      DK=dk, DV=d_v, HP=hp, BN=block_n, PREC=PRECISION, num_warps=_num_warps(hp))
        ctx.save_for_backward(q, kv, indices, o, lse)
        ctx.scale, ctx.d_v, ctx.block_n = scale, d_v, block_n
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, kv, indices, o, lse = ctx.saved_tensors
        if do is None:
            return None, None, None, None, None, None
        b, s, h, dk = q.shape
        topk = indices.shape[-1]
        hp = head_block(h)
        do = do.contiguous()
        dq = torch.empty_like(q)
        dkv32 = torch.zeros(b * s, dk, dtype=torch.float32, device=q.device)  # fp32 scatter target
        if b * s > 0:
            _sparse_mla_bwd[(b * s,)](q, kv, indices, o, do, lse, dq, dkv32, s, h, topk, ctx.scale,
                                      DK=dk, DV=ctx.d_v, HP=hp, BN=ctx.block_n, PREC=PRECISION,
                                      num_warps=_num_warps(hp, backward=True))
        return dq, dkv32.view(b, s, dk).to(kv.dtype), None, None, None, None


def check_inputs(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, block_n: int, *,
                 what: str = "sparse-mla") -> None:
    """Shapes and dtypes the kernels take; raises ValueError/TypeError naming ``what`` and what was found
    (``indexer.sparse_teacher`` checks its inputs here too)."""
    if q.dim() != 4 or kv.dim() != 3 or indices.dim() != 3:
        raise ValueError(f"{what}: expected q [b, s, h, dk], kv [b, s, dk], indices [b, s, topk]; found "
                         f"q {tuple(q.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)}")
    b, s, h, dk = q.shape
    if tuple(kv.shape) != (b, s, dk) or tuple(indices.shape[:2]) != (b, s):
        raise ValueError(f"{what}: q {tuple(q.shape)}, kv {tuple(kv.shape)} and indices "
                         f"{tuple(indices.shape)} disagree on [b, s] or dk")
    problem = shape_problem(dk, d_v, h)
    if problem is not None:
        raise ValueError(f"{what}: unsupported shape: {problem}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{what}: block_n {block_n}; expected a power of two >= 16")
    if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype:
        raise TypeError(f"{what}: q and kv must be both bf16 or both fp16; found {q.dtype}, {kv.dtype}")
    if indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{what}: indices must be int64 (or int32); found {indices.dtype}")


def sparse_mla(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float, d_v: int,
               block_n: int = BLOCK_N) -> tuple[torch.Tensor, torch.Tensor]:
    """``o [b, s, h, d_v]`` (q's dtype) and ``lse [b, s, h]`` fp32 of sparse attention over ``indices``."""
    check_inputs(q, kv, indices, d_v, block_n)
    return SparseMLAFunction.apply(q, kv, indices, float(scale), int(d_v), int(block_n))
