"""The fused warm-up kernel: dense causal MLA attention and the indexer's KL loss, in Triton.

What one call computes (shapes as ``nam56r.backends.WarmupStrategy`` hands them over)::

    q   [b, s, h, dk]  bf16   MLA's absorbed query           kv [b, s, dk] bf16   one shared KV row per token
    iq  [b, s, H, di]  bf16   indexer queries (rotated)       ik [b, s, di] bf16   indexer key
    w   [b, s, H]      fp32   indexer head weights
    o   [b, s, h, dv]         softmax_s(scale * q_h . kv_s) @ kv_s[:dv]          (causal)
    kl  [b, s]         fp32   KL( p_t || softmax_s(I_t) ),  p_t = mean_h softmax_s(scale * q_h . kv_s)
                                                            I_t,s = sum_j w_t,j * relu(iq_t,j . ik_s)

Memory. Nothing of shape ``[h, sq, sk]`` is ever written: per (query block, key block) tile the kernel
recomputes every head's logits in registers and keeps only running row statistics. Forward keeps the
attention's log-sum-exp per (head, row) and the indexer's per row. Backward writes one ``[b, sq, sk]`` bf16
tensor, the KL's gradient with respect to the index scores, causal tiles only, and three small kernels
reduce it into the indexer's gradients.

Launches. Forward: the attention pass (o, per-head lse), then the KL pass (recomputes the head-summed
probabilities tile by tile, builds the index scores, accumulates the KL with an online log-sum-exp).
Backward: attention dq and dkv (the KL's teacher is detached, so only ``o`` reaches q and kv) and the
KL's ``dI``, then ``d iq``/``d w`` by query blocks and ``d ik`` by key blocks. For fp16 inputs the indexer-gradient
dots take fp32 operands: their values scale with the loss coefficient / (b * s), below fp16's normal range.

Kernel constraints, checked by ``shape_problem`` before any launch: ``dk``, ``dv``, ``di`` powers of two in
[16, 256]; fp16/bf16 q, kv, iq, ik. Sequence length and head counts are free (masks handle ragged tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nam_plugin_lemyx.options import shape_problem

BLOCK = (64, 64)
"""(query rows, key columns) per tile on the GPU; tests under Triton's interpreter use (16, 16)."""
LOG_FLOOR = 1e-10
"""log(p) is taken of max(p, LOG_FLOOR), as in the reference loss."""


# --- forward ---------------------------------------------------------------------------------------
@triton.jit
def _attn_fwd(Q, KV, O, LSE, s, h, scale,
              DK: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // h).to(tl.int64)
    hh = pid_bh % h
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_dk = tl.arange(0, DK)
    offs_dv = tl.arange(0, DV)
    row_ok = offs_m < s
    q = tl.load(Q + ((b * s + offs_m[:, None]) * h + hh) * DK + offs_dk[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DV], tl.float32)
    for start in range(0, (pid_m + 1) * BM, BN):  # causal: keys up to the block's last row
        offs_n = start + tl.arange(0, BN)
        col_ok = offs_n < s
        rows = (b * s + offs_n[:, None]) * DK
        k = tl.load(KV + rows + offs_dk[None, :], mask=col_ok[:, None], other=0.0)  # [BN, DK]
        v = tl.load(KV + rows + offs_dv[None, :], mask=col_ok[:, None], other=0.0)  # [BN, DV]
        logits = tl.dot(q, tl.trans(k)) * scale
        live = (offs_n[None, :] <= offs_m[:, None]) & col_ok[None, :]
        logits = tl.where(live, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + ((b * s + offs_m[:, None]) * h + hh) * DV + offs_dv[None, :], acc.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(LSE + (b * h + hh) * s + offs_m, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _teacher_tile(Q, LSE, k, b, offs_m, row_ok, live, s, h, scale, DK: tl.constexpr):
    """Head-mean causal attention probabilities of one tile, recomputed from q and the stored lse."""
    offs_dk = tl.arange(0, DK)
    p = tl.zeros(live.shape, tl.float32)
    for hh in range(h):
        q = tl.load(Q + ((b * s + offs_m[:, None]) * h + hh) * DK + offs_dk[None, :], mask=row_ok[:, None],
                    other=0.0)
        lse = tl.load(LSE + (b * h + hh) * s + offs_m, mask=row_ok, other=0.0)
        p += tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None])
    return tl.where(live, p / h, 0.0)


@triton.jit
def _score_tile(IQ, W, ik, b, offs_m, row_ok, s, H, DI: tl.constexpr):
    """Index scores of one tile: sum_j w_j * relu(iq_j . ik)."""
    offs_di = tl.arange(0, DI)
    scores = tl.zeros([offs_m.shape[0], ik.shape[0]], tl.float32)
    for j in range(H):
        iq = tl.load(IQ + ((b * s + offs_m[:, None]) * H + j) * DI + offs_di[None, :], mask=row_ok[:, None],
                     other=0.0)
        wj = tl.load(W + (b * s + offs_m) * H + j, mask=row_ok, other=0.0)
        scores += wj[:, None] * tl.maximum(tl.dot(iq, tl.trans(ik)), 0.0)
    return scores


@triton.jit
def _kl_fwd(Q, KV, LSE, IQ, IK, W, KL, LSEI, s, h, H, scale,
            DK: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_dk = tl.arange(0, DK)
    offs_di = tl.arange(0, DI)
    row_ok = offs_m < s
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    cross = tl.zeros([BM], tl.float32)  # sum_s p (log p - I)
    for start in range(0, (pid_m + 1) * BM, BN):  # causal: keys up to the block's last row
        offs_n = start + tl.arange(0, BN)
        col_ok = offs_n < s
        live = (offs_n[None, :] <= offs_m[:, None]) & col_ok[None, :] & row_ok[:, None]
        k = tl.load(KV + (b * s + offs_n[:, None]) * DK + offs_dk[None, :], mask=col_ok[:, None], other=0.0)
        p = _teacher_tile(Q, LSE, k, b, offs_m, row_ok, live, s, h, scale, DK)
        ik = tl.load(IK + (b * s + offs_n[:, None]) * DI + offs_di[None, :], mask=col_ok[:, None], other=0.0)
        scores = _score_tile(IQ, W, ik, b, offs_m, row_ok, s, H, DI)
        masked = tl.where(live, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(masked, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(masked - m_new[:, None]), 1)
        m_i = m_new
        cross += tl.sum(tl.where(live, p * (tl.log(tl.maximum(p, 1e-10)) - scores), 0.0), 1)
    lse_i = m_i + tl.log(l_i)
    # KL = sum p log p - sum p log softmax(I) = cross + lse_I * sum p, and sum p = 1.
    tl.store(KL + b * s + offs_m, cross + lse_i, mask=row_ok)
    tl.store(LSEI + b * s + offs_m, lse_i, mask=row_ok)


# --- backward: attention ---------------------------------------------------------------------------
@triton.jit
def _attn_bwd_dq(Q, KV, DO, LSE, DELTA, DQ, s, h, scale,
                 DK: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // h).to(tl.int64)
    hh = pid_bh % h
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_dk = tl.arange(0, DK)
    offs_dv = tl.arange(0, DV)
    row_ok = offs_m < s
    head_rows = (b * s + offs_m[:, None]) * h + hh
    q = tl.load(Q + head_rows * DK + offs_dk[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + head_rows * DV + offs_dv[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + (b * h + hh) * s + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + (b * h + hh) * s + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BM, DK], tl.float32)
    for start in range(0, (pid_m + 1) * BM, BN):  # causal: keys up to the block's last row
        offs_n = start + tl.arange(0, BN)
        col_ok = offs_n < s
        rows = (b * s + offs_n[:, None]) * DK
        k = tl.load(KV + rows + offs_dk[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(KV + rows + offs_dv[None, :], mask=col_ok[:, None], other=0.0)
        live = (offs_n[None, :] <= offs_m[:, None]) & col_ok[None, :]
        p = tl.where(live, tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + head_rows * DK + offs_dk[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _attn_bwd_dkv(Q, KV, DO, LSE, DELTA, DK_PART, DV_PART, s, h, scale,
                  DK: tl.constexpr, DV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // h).to(tl.int64)
    hh = pid_bh % h
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_dk = tl.arange(0, DK)
    offs_dv = tl.arange(0, DV)
    col_ok = offs_n < s
    rows = (b * s + offs_n[:, None]) * DK
    k = tl.load(KV + rows + offs_dk[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(KV + rows + offs_dv[None, :], mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BN, DK], tl.float32)
    dv = tl.zeros([BN, DV], tl.float32)
    for start in range((pid_n * BN // BM) * BM, s, BM):
        offs_m = start + tl.arange(0, BM)
        row_ok = offs_m < s
        head_rows = (b * s + offs_m[:, None]) * h + hh
        q = tl.load(Q + head_rows * DK + offs_dk[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + head_rows * DV + offs_dv[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + (b * h + hh) * s + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + (b * h + hh) * s + offs_m, mask=row_ok, other=0.0)
        live = (offs_n[None, :] <= offs_m[:, None]) & col_ok[None, :] & row_ok[:, None]
        p = tl.where(live, tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None]), 0.0)  # [BM, BN]
        dv += tl.dot(tl.trans(p.to(do.dtype)), do)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    part = (b * h + hh) * s + offs_n[:, None]
    tl.store(DK_PART + part * DK + offs_dk[None, :], dk * scale, mask=col_ok[:, None])
    tl.store(DV_PART + part * DV + offs_dv[None, :], dv, mask=col_ok[:, None])


# --- backward: KL ----------------------------------------------------------------------------------
@triton.jit
def _kl_bwd_dscores(Q, KV, LSE, IQ, IK, W, LSEI, GKL, DS, s, h, H, scale,
                    DK: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """dKL/dI = g_t * (softmax(I_t) - p_t) on causal tiles, written as fp32 [b, s, s]."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_dk = tl.arange(0, DK)
    offs_di = tl.arange(0, DI)
    row_ok = offs_m < s
    lse_i = tl.load(LSEI + b * s + offs_m, mask=row_ok, other=0.0)
    g = tl.load(GKL + b * s + offs_m, mask=row_ok, other=0.0)
    for start in range(0, (pid_m + 1) * BM, BN):  # causal: keys up to the block's last row
        offs_n = start + tl.arange(0, BN)
        col_ok = offs_n < s
        live = (offs_n[None, :] <= offs_m[:, None]) & col_ok[None, :] & row_ok[:, None]
        k = tl.load(KV + (b * s + offs_n[:, None]) * DK + offs_dk[None, :], mask=col_ok[:, None], other=0.0)
        p = _teacher_tile(Q, LSE, k, b, offs_m, row_ok, live, s, h, scale, DK)
        ik = tl.load(IK + (b * s + offs_n[:, None]) * DI + offs_di[None, :], mask=col_ok[:, None], other=0.0)
        scores = _score_tile(IQ, W, ik, b, offs_m, row_ok, s, H, DI)
        student = tl.where(live, tl.exp(scores - lse_i[:, None]), 0.0)
        ds = g[:, None] * (student - p)
        tl.store(DS + (b * s + offs_m[:, None]) * s + offs_n[None, :], ds.to(DS.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _kl_bwd_query(IQ, IK, W, DS, DIQ, DW, s, H,
                  DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, FP32_DOTS: tl.constexpr):
    """Per (query block, index head): d iq_j = sum_s dI * w_j * [l_j > 0] ik_s and d w_j = sum_s dI * relu(l_j)."""
    pid_m = tl.program_id(0)
    pid_bj = tl.program_id(1)
    b = (pid_bj // H).to(tl.int64)
    j = pid_bj % H
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_di = tl.arange(0, DI)
    row_ok = offs_m < s
    head_rows = (b * s + offs_m[:, None]) * H + j
    iq = tl.load(IQ + head_rows * DI + offs_di[None, :], mask=row_ok[:, None], other=0.0)
    wj = tl.load(W + (b * s + offs_m) * H + j, mask=row_ok, other=0.0)
    diq = tl.zeros([BM, DI], tl.float32)
    dw = tl.zeros([BM], tl.float32)
    for start in range(0, (pid_m + 1) * BM, BN):  # causal: keys up to the block's last row
        offs_n = start + tl.arange(0, BN)
        col_ok = offs_n < s
        live = (offs_n[None, :] <= offs_m[:, None]) & col_ok[None, :] & row_ok[:, None]
        ik = tl.load(IK + (b * s + offs_n[:, None]) * DI + offs_di[None, :], mask=col_ok[:, None], other=0.0)
        ds = tl.load(DS + (b * s + offs_m[:, None]) * s + offs_n[None, :], mask=live, other=0.0).to(tl.float32)
        logits = tl.dot(iq, tl.trans(ik))
        dw += tl.sum(ds * tl.maximum(logits, 0.0), 1)
        through = tl.where(logits > 0, ds * wj[:, None], 0.0)
        # `through` carries the loss coefficient / (b * s): far below fp16's normal range, fine in bf16 (fp32's
        # range). fp16 inputs therefore take fp32 operands (tf32 on tensor cores); bf16 stays on bf16.
        if FP32_DOTS:
            diq += tl.dot(through, ik.to(tl.float32))
        else:
            diq += tl.dot(through.to(ik.dtype), ik)
    tl.store(DIQ + head_rows * DI + offs_di[None, :], diq.to(DIQ.dtype.element_ty), mask=row_ok[:, None])
    tl.store(DW + (b * s + offs_m) * H + j, dw, mask=row_ok)


@triton.jit
def _kl_bwd_key(IQ, IK, W, DS, DIK_PART, s, H,
                DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, FP32_DOTS: tl.constexpr):
    """Per (key block, index head): d ik_s = sum_t dI * w_j * [l_j > 0] iq_t,j (summed over heads after)."""
    pid_n = tl.program_id(0)
    pid_bj = tl.program_id(1)
    b = (pid_bj // H).to(tl.int64)
    j = pid_bj % H
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_di = tl.arange(0, DI)
    col_ok = offs_n < s
    ik = tl.load(IK + (b * s + offs_n[:, None]) * DI + offs_di[None, :], mask=col_ok[:, None], other=0.0)
    dik = tl.zeros([BN, DI], tl.float32)
    for start in range((pid_n * BN // BM) * BM, s, BM):
        offs_m = start + tl.arange(0, BM)
        row_ok = offs_m < s
        live = (offs_n[None, :] <= offs_m[:, None]) & col_ok[None, :] & row_ok[:, None]
        iq = tl.load(IQ + ((b * s + offs_m[:, None]) * H + j) * DI + offs_di[None, :], mask=row_ok[:, None],
                     other=0.0)
        wj = tl.load(W + (b * s + offs_m) * H + j, mask=row_ok, other=0.0)
        ds = tl.load(DS + (b * s + offs_m[:, None]) * s + offs_n[None, :], mask=live, other=0.0).to(tl.float32)
        logits = tl.dot(iq, tl.trans(ik))
        through = tl.where(logits > 0, ds * wj[:, None], 0.0)
        if FP32_DOTS:  # see _kl_bwd_query
            dik += tl.dot(tl.trans(through), iq.to(tl.float32))
        else:
            dik += tl.dot(tl.trans(through.to(iq.dtype)), iq)
    tl.store(DIK_PART + ((b * H + j) * s + offs_n[:, None]) * DI + offs_di[None, :], dik, mask=col_ok[:, None])


# --- autograd --------------------------------------------------------------------------------------
class FusedWarmup(torch.autograd.Function):
    """``(q, kv, iq, ik, w) -> (o, kl)``; see the module docstring. The KL trains iq, ik and w only."""

    @staticmethod
    def forward(ctx, q, kv, iq, ik, w, scale: float, d_v: int, block: tuple[int, int]):
        b, s, h, dk = q.shape
        H, di = iq.shape[2], iq.shape[3]
        q, kv, iq, ik = q.contiguous(), kv.contiguous(), iq.contiguous(), ik.contiguous()
        w = w.float().contiguous()
        bm, bn = block
        o = q.new_empty(b, s, h, d_v)
        lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device)
        kl = torch.empty(b, s, dtype=torch.float32, device=q.device)
        lse_i = torch.empty(b, s, dtype=torch.float32, device=q.device)
        rows = triton.cdiv(s, bm)
        _attn_fwd[(rows, b * h)](q, kv, o, lse, s, h, scale, DK=dk, DV=d_v, BM=bm, BN=bn)
        _kl_fwd[(rows, b)](q, kv, lse, iq, ik, w, kl, lse_i, s, h, H, scale, DK=dk, DI=di, BM=bm, BN=bn)
        ctx.save_for_backward(q, kv, iq, ik, w, o, lse, lse_i)
        ctx.scale, ctx.d_v, ctx.block = scale, d_v, block
        return o, kl

    @staticmethod
    def backward(ctx, do, dkl):
        q, kv, iq, ik, w, o, lse, lse_i = ctx.saved_tensors
        b, s, h, dk = q.shape
        H, di = iq.shape[2], iq.shape[3]
        d_v, scale = ctx.d_v, ctx.scale
        bm, bn = ctx.block
        dq = dkv = diq = dik = dw = None
        if do is not None and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            do = do.contiguous()
            delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()  # [b, h, s]
            dq = torch.empty_like(q)
            dk_part = torch.empty(b, h, s, dk, dtype=torch.float32, device=q.device)
            dv_part = torch.empty(b, h, s, d_v, dtype=torch.float32, device=q.device)
            _attn_bwd_dq[(triton.cdiv(s, bm), b * h)](q, kv, do, lse, delta, dq, s, h, scale,
                                                      DK=dk, DV=d_v, BM=bm, BN=bn)
            _attn_bwd_dkv[(triton.cdiv(s, bn), b * h)](q, kv, do, lse, delta, dk_part, dv_part, s, h, scale,
                                                       DK=dk, DV=d_v, BM=bm, BN=bn)
            dkv32 = dk_part.sum(1)
            dkv32[..., :d_v] += dv_part.sum(1)
            dkv = dkv32.to(kv.dtype)
        if dkl is not None and any(ctx.needs_input_grad[2:5]):
            g = dkl.float().contiguous()
            dscores = torch.empty(b, s, s, dtype=torch.float32, device=q.device)
            _kl_bwd_dscores[(triton.cdiv(s, bm), b)](q, kv, lse, iq, ik, w, lse_i, g, dscores, s, h, H, scale,
                                                     DK=dk, DI=di, BM=bm, BN=bn)
            diq = torch.empty_like(iq)
            dw = torch.empty_like(w)
            dik_part = torch.empty(b, H, s, di, dtype=torch.float32, device=q.device)
            fp32_dots = iq.dtype == torch.float16
            _kl_bwd_query[(triton.cdiv(s, bm), b * H)](iq, ik, w, dscores, diq, dw, s, H, DI=di, BM=bm, BN=bn,
                                                       FP32_DOTS=fp32_dots)
            _kl_bwd_key[(triton.cdiv(s, bn), b * H)](iq, ik, w, dscores, dik_part, s, H, DI=di, BM=bm, BN=bn,
                                                     FP32_DOTS=fp32_dots)
            dik = dik_part.sum(1).to(ik.dtype)
        return dq, dkv, diq, dik, dw, None, None, None


def fused_warmup(q: torch.Tensor, kv: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor, w: torch.Tensor, *,
                 scale: float, d_v: int, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention output ``[b, s, h, d_v]`` and per-row KL ``[b, s]`` fp32 in one fused pass."""
    problem = shape_problem(q.shape[-1], d_v, iq.shape[-1])
    if problem is not None:
        raise ValueError(f"lemyx fused kernel: unsupported {problem}")
    for name, t in (("q", q), ("kv", kv), ("iq", iq), ("ik", ik)):
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"lemyx fused kernel: {name} must be bf16 or fp16, found {t.dtype}")
    return FusedWarmup.apply(q, kv, iq, ik, w, scale, d_v, tuple(block))
