"""The DSA lightning indexer's two hot loops as Triton kernels: the index scores and the sparse KL teacher.

Both replace the head-by-head fp32 loops of ``nam56r.blocks.indexer`` (the reference, and these kernels' CPU
oracle) and compute the same math.

**Index scores** (``index_scores``, with autograd)::

    q  [b, s, H, d]  bf16/fp16   index queries (rotated)
    k  [b, s, d]     same dtype  one shared index key per token
    w  [b, s, H]     fp32        head weights
    I  [b, s, s]     fp32        I[t, u] = sum_j w[t, j] * relu(q[t, j] . k[u]) for u <= t, -inf for u > t

One program per (query block, key block, batch) walks all H heads: per head one tensor-core dot of the bf16
inputs with fp32 accumulation (a product of two bf16 is exact in fp32, so only the summation order differs
from the fp32 reference), then ReLU and the weighted head sum in fp32 registers. The ``[b, H, s, s]``
per-head scores never exist. A block wholly above the diagonal computes nothing and writes -inf.

Backward recomputes each head's logits, as ``_IndexScores.backward`` does; ``G`` is the incoming gradient,
read only where ``u <= t`` (the causal fill's backward is zero above the diagonal)::

    dw[t, j] = sum_u G[t, u] relu(L_j[t, u])      dL_j = G * w[:, j] * (L_j > 0)
    dq[t, j] = sum_u dL_j[t, u] k[u]              dk[u] = sum_{t, j} dL_j[t, u] q[t, j]

Both backward kernels tile (token, head) PAIRS as the rows of their dots: one token's ``HG`` heads are
neighbouring rows of q (``q`` viewed as ``[b*s*H, d]``), so ``BT`` tokens x ``HG`` heads form one
``[BT*HG, d]`` tile and every head's logits of a key block come out of ONE dot ``[BT*HG, d] @ [d, BN]``
(the old kernels looped over heads with one small dot each). ``G`` is per token: each row reads its token's
row of G (the heads of one token read the same addresses, served by L1).

``_scores_bwd_dq``: one program per (``BT`` tokens, group of ``HG`` heads, batch), NAM56R: 4 tokens x all 32
heads, so G is read once; it walks the key blocks up to the diagonal and accumulates ``R = sum_u G (L > 0)
k[u]`` (``dq = w * R``, w factored out of the loop) and ``dw = sum_u G relu(L)`` in fp32. ``_scores_bwd_dk``:
one program per (key block, head group, batch), NAM56R: 16 tokens x 8 heads per step, 4 groups; it walks the
query blocks from the diagonal down and accumulates ``dk += dL^T @ q`` with dL = G * w * (L > 0) for all
rows at once, a dot whose reduction runs over tokens and heads together; each group writes its own fp32
partial dk, summed after (deterministic, no atomics). Not fused into one kernel: a program owns either query
rows (dq) or key rows (dk), and the other gradient would need fp32 atomics over every (query block, key
block, head) ``[rows, d]`` tile, ~0.5 G atomics at NAM56R's shape, more than the recomputed logits cost (one
dot of the three in each kernel).

dL is fp32; the dots that take it use ``kernel.dot_f32``: on bf16 inputs dL splits into a high and a low
bf16 part (~2^-17 relative) and runs two bf16 tensor-core dots, against ``tf32x3``'s three TF32 ones (fp16
inputs keep tf32x3). dw never goes through a split dot: it is summed in fp32 registers.

**Sparse teacher** (``sparse_teacher``, no autograd)::

    q        [b, s, h, dk]  bf16/fp16   MLA's absorbed queries
    kv       [b, s, dk]     same dtype  MLA's shared KV row
    indices  [b, s, topk]   int64/32    the indexer's picks; slot live iff 0 <= index <= t
    p        [b, s, topk]   fp32        (1/h) sum_i softmax_live(scale * q[t, i] . kv[idx]), dead slots 0

One program per (batch, query token), heads as the M side of the dot (as in ``kernel.py``). Pass 1 gathers
the live key rows ``BN`` slots at a time straight from ``kv`` and keeps each head's online max and sum; pass
2 gathers them again, forms each head's probabilities from that log-sum-exp and sums over heads. Every head
shares one live set, so each head's softmax sums to 1 and the head sum sums to h: dividing by h is the
reference's L1 normalisation up to one fp32 rounding. A row with no live slot is 0, as in the reference.

Nothing reads a tensor value on the host; grids come from shapes only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nam_plugin_sparse_mla.kernel import PRECISION, check_inputs, dot_f32
from nam_plugin_sparse_mla.shape import head_block, index_shape_problem

SCORE_TILES = {"fwd": (64, 64, 4)}
"""(query rows, key rows, warps) of the forward. Picked from a small sweep on one H200 at NAM56R's shape (b=1,
s=4096, 32 heads of 64; 2026-11, Triton 3.6): 0.13 ms."""
BWD_TILES = {"dq": (64, 32, 32, 4, 3), "dk": (64, 8, 64, 4, 3)}
"""(rows = tokens x heads, most heads per group, keys, warps, stages) per backward kernel (``bwd_tile``). dq
takes all 32 of NAM56R's heads in a group (2 tokens x 32 heads: G read once), dk groups of 8 (8 tokens x 8
heads; 4 groups x 64 key blocks x b programs, 4 fp32 partial dk buffers). The fastest of ``gpu/smla.sh``'s
sweep on one H200 at NAM56R's shape (b=2, s=4096, 32 heads of 64; Triton 3.6; 2026-11-28): dq 0.81 ms, dk
1.75 ms (with ``DK_KEYS_AS_ROWS``), against 2.52 and 3.04 ms for the kernels before (heads looped one dot
each, tf32x3) in the same run."""
DK_KEYS_AS_ROWS = True
"""Orientation of the dk kernel's tiles: ``[keys, rows]`` (dL^T straight out of the logits dot) or
``[rows, keys]`` (transposed for the dk dot); keys as rows measured faster at the tiles above."""
TEACHER_BLOCK_N = 64
"""Top-k slots per teacher loop step (not swept; the sparse MLA kernels' are in ``kernel.TILES``)."""


# --- index scores: forward ------------------------------------------------------------------------
@triton.jit
def _scores_fwd(Q, K, W, OUT, s, H, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    m0 = tl.program_id(0) * BM
    n0 = tl.program_id(1) * BN
    b = tl.program_id(2).to(tl.int64)
    offs_m = m0 + tl.arange(0, BM)
    offs_n = n0 + tl.arange(0, BN)
    row_ok = offs_m < s
    col_ok = offs_n < s
    out_ptrs = OUT + b * s * s + offs_m[:, None].to(tl.int64) * s + offs_n[None, :]
    tile_ok = row_ok[:, None] & col_ok[None, :]
    if n0 > m0 + BM - 1:  # every key of this tile comes after every query: nothing to compute
        tl.store(out_ptrs, tl.full([BM, BN], float("-inf"), tl.float32), mask=tile_ok)
    else:
        offs_d = tl.arange(0, D)
        rows = b * s + offs_m.to(tl.int64)  # token rows of q / w
        cols = b * s + offs_n.to(tl.int64)  # token rows of k
        k = tl.load(K + cols[:, None] * D + offs_d[None, :], mask=col_ok[:, None], other=0.0)  # [BN, D]
        acc = tl.zeros([BM, BN], tl.float32)
        for j in range(0, H):
            q = tl.load(Q + (rows[:, None] * H + j) * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            wj = tl.load(W + rows * H + j, mask=row_ok, other=0.0)  # [BM] fp32
            logits = tl.dot(q, tl.trans(k))  # [BM, BN] fp32 accumulate of exact bf16 products
            acc += wj[:, None] * tl.maximum(logits, 0.0)
        acc = tl.where(offs_n[None, :] > offs_m[:, None], float("-inf"), acc)
        tl.store(out_ptrs, acc, mask=tile_ok)


# --- index scores: backward -----------------------------------------------------------------------
@triton.jit
def _head_rows(t0, j0, b, s, H, BT: tl.constexpr, HG: tl.constexpr):
    """Rows ``r = token * HG + head`` of a (``BT`` tokens from ``t0``) x (``HG`` heads from ``j0``) tile: each
    row's token ``[R]``, whether it exists (token < s, head < H), and its row of q / w viewed as
    ``[b*s*H, .]``. One token's heads are neighbours in q, so a token's rows are one contiguous run."""
    r = tl.arange(0, BT * HG)
    t = t0 + r // HG
    j = j0 + r % HG
    ok = (t < s) & (j < H)
    return t, ok, (b * s + t.to(tl.int64)) * H + j


@triton.jit
def _scores_bwd_dq(Q, K, W, G, DQ, DW, s, H, D: tl.constexpr, BT: tl.constexpr, HG: tl.constexpr,
                   BN: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr):
    t0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BT  # longest rows (most key blocks) first
    j0 = tl.program_id(1) * HG
    b = tl.program_id(2).to(tl.int64)
    t, ok, qrow = _head_rows(t0, j0, b, s, H, BT, HG)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + qrow[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)  # [R, D]
    w = tl.load(W + qrow, mask=ok, other=0.0)  # [R] fp32
    g_rows = G + b * s * s + t.to(tl.int64) * s  # [R]: each row reads its token's row of G
    acc = tl.zeros([BT * HG, D], tl.float32)  # sum_u G * (L > 0) * k[u]; dq = w * acc
    dw = tl.zeros([BT * HG], tl.float32)  # sum_u G relu(L), in fp32 registers (no split dot on its path)
    for n0 in range(0, tl.minimum(t0 + BT, s), BN):  # key blocks up to the diagonal
        offs_n = n0 + tl.arange(0, BN)
        k = tl.load(K + (b * s + offs_n.to(tl.int64))[:, None] * D + offs_d[None, :], mask=(offs_n < s)[:, None],
                    other=0.0)  # [BN, D]
        live = ok[:, None] & (offs_n[None, :] <= t[:, None])  # causal (and so < s)
        g = tl.load(g_rows[:, None] + offs_n[None, :], mask=live, other=0.0)  # [R, BN] fp32
        logits = tl.dot(q, tl.trans(k))  # [R, BN] fp32, recomputed
        dw += tl.sum(g * tl.maximum(logits, 0.0), 1)
        acc = dot_f32(tl.where(logits > 0.0, g, 0.0), k, acc, SPLIT, PREC)
    tl.store(DQ + qrow[:, None] * D + offs_d[None, :], (acc * w[:, None]).to(DQ.dtype.element_ty),
             mask=ok[:, None])
    tl.store(DW + qrow, dw, mask=ok)


@triton.jit
def _scores_bwd_dk(Q, K, W, G, DK_PART, s, H, D: tl.constexpr, BT: tl.constexpr, HG: tl.constexpr,
                   BN: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, KEYS_AS_ROWS: tl.constexpr):
    n0 = tl.program_id(0) * BN  # key block 0 has the most query blocks; it goes first
    group = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_n = n0 + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    col_ok = offs_n < s
    cols = b * s + offs_n.to(tl.int64)
    k = tl.load(K + cols[:, None] * D + offs_d[None, :], mask=col_ok[:, None], other=0.0)  # [BN, D]
    dk = tl.zeros([BN, D], tl.float32)
    for t0 in range((n0 // BT) * BT, s, BT):  # query blocks from the diagonal down
        t, ok, qrow = _head_rows(t0, group * HG, b, s, H, BT, HG)
        q = tl.load(Q + qrow[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)  # [R, D]
        w = tl.load(W + qrow, mask=ok, other=0.0)
        if KEYS_AS_ROWS:  # [BN, R] tiles: dL^T comes out of the dot as the next dot's left operand
            live = col_ok[:, None] & ok[None, :] & (offs_n[:, None] <= t[None, :])
            g = tl.load(G + b * s * s + t.to(tl.int64)[None, :] * s + offs_n[:, None], mask=live, other=0.0)
            logits = tl.dot(k, tl.trans(q))  # [BN, R] fp32, recomputed
            dl = tl.where(logits > 0.0, g * w[None, :], 0.0)  # [BN, R] fp32: dL^T
            dk = dot_f32(dl, q, dk, SPLIT, PREC)  # [BN, D], summed over tokens and heads at once
        else:  # [R, BN] tiles, transposed for the dk dot
            live = ok[:, None] & col_ok[None, :] & (offs_n[None, :] <= t[:, None])
            g = tl.load(G + b * s * s + t.to(tl.int64)[:, None] * s + offs_n[None, :], mask=live, other=0.0)
            logits = tl.dot(q, tl.trans(k))  # [R, BN] fp32, recomputed
            dl = tl.where(logits > 0.0, g * w[:, None], 0.0)  # [R, BN] fp32: dL for every (token, head) row
            dk = dot_f32(tl.trans(dl), q, dk, SPLIT, PREC)
    tl.store(DK_PART + (group * tl.num_programs(2) * s + cols[:, None]) * D + offs_d[None, :], dk,
             mask=col_ok[:, None])


def bwd_tile(tile: tuple, h: int) -> tuple[int, int, int, int, int]:
    """``(tokens BT, heads per group HG, keys BN, warps, stages)`` of a backward kernel from its ``BWD_TILES``
    entry ``(rows, most heads per group, keys, warps, stages)``: HG = the head count rounded up to a power of
    two, capped; BT = rows / HG (rows = BT * HG stays the dot's M side)."""
    rows, max_heads, bn, warps, stages = tile
    hg = min(head_block(h, least=1), max_heads, rows)
    return rows // hg, hg, bn, warps, stages


class IndexScoresFunction(torch.autograd.Function):
    """``(q, k, w) -> I [b, s, s]`` fp32, causal-masked; backward gives dq, dk (their dtypes) and dw (fp32)."""

    @staticmethod
    def forward(ctx, q, k, w, tiles: dict):
        b, s, h, d = q.shape
        q, k, w = q.contiguous(), k.contiguous(), w.contiguous()
        out = torch.empty(b, s, s, dtype=torch.float32, device=q.device)
        if b * s > 0:
            bm, bn, warps = tiles["fwd"]
            _scores_fwd[(triton.cdiv(s, bm), triton.cdiv(s, bn), b)](q, k, w, out, s, h, D=d, BM=bm, BN=bn,
                                                                    num_warps=warps)
        ctx.save_for_backward(q, k, w)
        ctx.tiles = tiles
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, w = ctx.saved_tensors
        b, s, h, d = q.shape
        grad = grad.contiguous().float()
        dq, dw = torch.empty_like(q), torch.empty_like(w)
        split = q.dtype == torch.bfloat16
        bt, hg, bn, warps, stages = bwd_tile(ctx.tiles["dk"], h)
        groups = triton.cdiv(h, hg)
        dk_part = torch.empty(groups, b, s, d, dtype=torch.float32, device=q.device)
        if b * s > 0:
            _scores_bwd_dk[(triton.cdiv(s, bn), groups, b)](q, k, w, grad, dk_part, s, h, D=d, BT=bt, HG=hg, BN=bn,
                                                            SPLIT=split, PREC=PRECISION,
                                                            KEYS_AS_ROWS=DK_KEYS_AS_ROWS, num_warps=warps,
                                                            num_stages=stages)
            bt, hg, bn, warps, stages = bwd_tile(ctx.tiles["dq"], h)
            _scores_bwd_dq[(triton.cdiv(s, bt), triton.cdiv(h, hg), b)](q, k, w, grad, dq, dw, s, h, D=d, BT=bt,
                                                                        HG=hg, BN=bn, SPLIT=split, PREC=PRECISION,
                                                                        num_warps=warps, num_stages=stages)
        return dq, dk_part.sum(0).to(k.dtype), dw, None


def check_score_inputs(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, block: int) -> None:
    """Shapes and dtypes ``index_scores`` takes; raises ValueError/TypeError naming what was found."""
    if q.dim() != 4 or k.dim() != 3 or w.dim() != 3:
        raise ValueError(f"sparse-mla index scores: expected q [b, s, H, d], k [b, s, d], w [b, s, H]; found "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, w {tuple(w.shape)}")
    b, s, h, d = q.shape
    if tuple(k.shape) != (b, s, d) or tuple(w.shape) != (b, s, h):
        raise ValueError(f"sparse-mla index scores: q {tuple(q.shape)}, k {tuple(k.shape)} and w "
                         f"{tuple(w.shape)} disagree on [b, s], H or d")
    problem = index_shape_problem(d)
    if problem is not None:
        raise ValueError(f"sparse-mla index scores: unsupported shape: {problem}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"sparse-mla index scores: block {block}; expected a power of two >= 16")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype:
        raise TypeError(f"sparse-mla index scores: q and k must be both bf16 or both fp16; found {q.dtype}, "
                        f"{k.dtype}")
    if w.dtype != torch.float32:
        raise TypeError(f"sparse-mla index scores: w must be fp32 (LightningIndexer.inputs); found {w.dtype}")


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """Causal-masked index scores ``[b, s, s]`` fp32 of ``q [b, s, H, d]``, ``k [b, s, d]``, ``w [b, s, H]``.

    ``block``: one square tile for all three kernels (tests use 16 for ragged edges: 16 query rows and keys
    forward, 16 (token, head) rows and 16 keys backward); None: ``SCORE_TILES`` and ``BWD_TILES``.
    """
    if block is None:
        tiles = {**SCORE_TILES, **BWD_TILES}
    else:
        tiles = {"fwd": (block, block, 4), "dq": (block, block, block, 4, 2), "dk": (block, block, block, 4, 2)}
    check_score_inputs(q, k, w, 16 if block is None else block)
    return IndexScoresFunction.apply(q, k, w, tiles)


# --- sparse teacher -------------------------------------------------------------------------------
@triton.jit
def _teacher_logits(q, KV, IDX, row, b, t, s, topk, start, scale, DK: tl.constexpr, BN: tl.constexpr):
    """Scaled logits ``[HP, BN]`` of slots ``start .. start + BN`` (-inf on dead slots) and their live mask."""
    offs_n = start + tl.arange(0, BN)
    offs_dk = tl.arange(0, DK)
    idx = tl.load(IDX + row * topk + offs_n, mask=offs_n < topk, other=-1)
    live = (idx >= 0) & (idx <= t)  # [BN]: -1 (empty) and future keys are dead and read nothing
    key_rows = b * s + tl.where(live, idx, 0).to(tl.int64)
    k = tl.load(KV + key_rows[:, None] * DK + offs_dk[None, :], mask=live[:, None], other=0.0)  # [BN, DK]
    logits = tl.dot(q, tl.trans(k)) * scale  # [HP, BN] fp32
    return tl.where(live[None, :], logits, float("-inf")), live


@triton.jit
def _teacher_fwd(Q, KV, IDX, P, s, h, topk, scale, DK: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * s + t
    b = row // s
    t = row % s
    offs_h = tl.arange(0, HP)
    offs_dk = tl.arange(0, DK)
    head_ok = offs_h < h
    q = tl.load(Q + (row * h + offs_h)[:, None] * DK + offs_dk[None, :], mask=head_ok[:, None], other=0.0)
    # Pass 1: each head's max and sum over the live slots (online; finite start so exp(-inf - m) = 0).
    m_i = tl.full([HP], -1.0e30, tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    for start in range(0, topk, BN):
        logits, live = _teacher_logits(q, KV, IDX, row, b, t, s, topk, start, scale, DK, BN)
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(logits - m_new[:, None]), 1)
        m_i = m_new
    # A row with no live slot has l_i = 0: its probabilities are exp(-inf) = 0 below, and stay 0.
    lse = m_i + tl.log(tl.where(l_i > 0.0, l_i, 1.0))
    valid = head_ok & (l_i > 0.0)
    # Pass 2: probabilities per head from the lse, summed over heads; every head's sum is 1, so / h.
    for start in range(0, topk, BN):
        logits, live = _teacher_logits(q, KV, IDX, row, b, t, s, topk, start, scale, DK, BN)
        p = tl.where(valid[:, None] & live[None, :], tl.exp(logits - lse[:, None]), 0.0)  # [HP, BN]
        offs_n = start + tl.arange(0, BN)
        tl.store(P + row * topk + offs_n, tl.sum(p, 0) / h, mask=offs_n < topk)


def check_teacher_inputs(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, block_n: int) -> None:
    """Shapes and dtypes ``sparse_teacher`` takes: the sparse kernel's, with no value (dv = dk passes whenever
    dk does); raises ValueError/TypeError naming what was found."""
    dk = q.shape[-1] if q.dim() == 4 else 0  # a wrong rank is refused by check_inputs' first test
    check_inputs(q, kv, indices, dk, block_n, what="sparse-mla teacher")


@torch.no_grad()
def sparse_teacher(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float,
                   block_n: int = TEACHER_BLOCK_N) -> torch.Tensor:
    """The sparse KL teacher ``[b, s, topk]`` fp32 (see the module docstring); q and kv are read detached."""
    check_teacher_inputs(q, kv, indices, block_n)
    b, s, h, dk = q.shape
    topk = indices.shape[-1]
    q, kv, indices = q.detach().contiguous(), kv.detach().contiguous(), indices.contiguous()
    p = torch.empty(b, s, topk, dtype=torch.float32, device=q.device)
    if b * s > 0 and topk > 0:
        hp = head_block(h)
        _teacher_fwd[(b * s,)](q, kv, indices, p, s, h, topk, float(scale), DK=dk, HP=hp, BN=block_n,
                               num_warps=8 if hp > 32 else 4)
    return p
