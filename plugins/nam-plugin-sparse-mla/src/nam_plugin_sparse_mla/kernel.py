"""Sparse MLA in absorbed form: each query token attends to the top-k keys its indexer picked, in Triton.

What one call computes (shapes as ``nam56r.backends.AttentionCore.sparse`` hands them over)::

    q        [b, s, h, dk]  bf16/fp16   absorbed queries: [q~ (kv_lora) ; q_rope]
    kv       [b, s, dk]     same dtype  one shared KV row per token: [c_kv (= the value, first dv) ; k_rope]
    indices  [b, s, topk]   int64       key positions per query; a slot is live iff 0 <= index <= t
    o        [b, s, h, dv]  q's dtype   o[t, i] = sum_{live j} softmax_j(scale * q[t, i] . kv[idx_j]) kv[idx_j, :dv]
    lse      [b, s, h]      fp32        log-sum-exp of the live logits (-inf for a row with no live slot)

Layout of the work. One program per (batch, query token). In DSA the top-k indices are shared by all heads
of a token, so the token's ``h`` heads are the M side of every ``tl.dot`` (padded with masked rows to
``head_block(h)`` >= 16, tl.dot's smallest side), and the program walks its ``topk`` slots ``BN`` at a time:
it gathers those key rows of ``kv`` once for all heads (masked slots read nothing, so an index of -1 or
beyond ``t`` never touches memory), scores them against every head, and keeps an online softmax.

The value is the first ``dv`` channels of the gathered key row. With ``DA == DK`` (``TILES[..]['value_from_key']``) the
kernels gather only the key row and use it as the value too: P @ V runs over all dk channels into a
``[HP, dk]`` accumulator of which the first dv columns are stored (the rest is never read), and in the
backward dO is zero-padded to dk columns, so dP = dO . v and the value gradient P^T @ dO come from the same
gathered tile, and the key and value gradients of a slot add up in registers into ONE ``[BN, dk]`` tile:
one fp32 atomic per (slot, channel) where a separate value tile needs dk + dv. The extra P @ V channels cost
tensor-core work (cheap here) instead of a second gather and a second atomic scatter (not cheap). With
``DA == DV`` the value rows are gathered separately, as a narrower tile.

Precision. Logits ``q . k`` and ``dO . v`` are dots of the bf16 inputs with fp32 accumulation (products of
two bf16 are exact in fp32). Softmax, P, dP and dS stay fp32. A dot that takes one of them (P @ V, dS @ K,
dS^T @ Q, P^T @ dO) has a bf16/fp16 input on the other side, exact in fp32, so only the fp32 side needs
care. bf16 inputs (``SPLIT``): the fp32 operand x is split into hi = bf16(x) and lo = bf16(x - hi) and the
dot runs twice on bf16 tensor cores, hi @ y + lo @ y, accumulating in fp32; hi + lo carries x to ~2^-17
relative (16 of fp32's 24 mantissa bits; bf16 has fp32's exponent range, so small gradients keep their
low part). That is two bf16 products where ``input_precision="tf32x3"`` takes three TF32 ones at half the bf16
rate (one of them multiplies by the zero low part of the exact operand), ~3x less tensor-core time, at an
error ~2^8 below the output's own bf16 rounding (2^-9). fp16 inputs keep tf32x3 (fp16's range would
flush the low part of small gradients to zero). The upstream TileLang kernels round P and dP to bf16
instead (~2^-9 per element); NAM56R keeps them fp32.

Backward. One program per (batch, query token) again: it recomputes P from q, the gathered keys and the
saved lse, forms dP = dO . v and dS = P * (dP - delta) * scale, delta = rowsum(dO * O), writes dq (each
program owns its token's rows), and scatters the key/value gradients of its gathered rows with
``tl.atomic_add`` into one fp32 ``[b*s, dk]`` buffer: dS^T @ q into all dk columns (the key), P^T @ dO into
the first dv (the value). Dead slots are masked out of the scatter. The buffer is cast to kv's dtype after.
The scatter is NOT deterministic: fp32 atomics from the tokens that picked the same key land in whatever
order the programs run, so dkv can differ between two runs in the last bits (~1e-7 relative); dq and the
forward are deterministic. A key row is picked by ~256 ln(s / key) queries, so a deterministic two-pass
(per-slot gradients written out, then reduced per key through the inverted index) would move
``b*s*topk*dk`` fp32 values (1 GiB at b=2, s=4096) through memory, more than the whole kernel takes.

Nothing here reads a tensor value on the host (no ``.item()``, no ``nonzero``, grids from shapes only), so
forward and backward can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nam_plugin_sparse_mla.shape import head_block, shape_problem

TILES = {"fwd": {"block_n": 128, "num_warps": 4, "num_stages": 2, "value_from_key": True},
         "bwd": {"block_n": 64, "num_warps": 4, "num_stages": 2, "value_from_key": True, "keys_as_rows": True}}
"""Per kernel: top-k slots per loop step (a power of two >= 16, tl.dot's smallest side), warps (64+ heads
take 8 whatever this says), pipeline stages, whether the value comes from the gathered key tile (module
docstring), and for the backward the orientation of its score tiles (``[slots, heads]`` when
``keys_as_rows``, else ``[heads, slots]``). The fastest of ``gpu/smla.sh``'s sweep on one H200 at NAM56R's
shape (b=2, s=4096, top-k 256; Triton 3.6; 2026-11-28): forward 0.34 ms (0.38 with 3 stages), backward 0.67 ms
with the slots as rows (0.77 with the heads as rows, 0.96 with 3 stages); fwd+bwd 1.04 ms, 0.485x dense SDPA's
2.16 in the same run. A caller's ``block_n`` replaces both kernels' (the tests take 16 to walk several
blocks)."""
PRECISION = "tf32x3"
"""tl.dot input precision of the dots with an fp32 operand when the inputs are fp16 (bf16 splits instead)."""


# --- the dots with one fp32 operand ----------------------------------------------------------------
@triton.jit
def split_bf16(x):
    """fp32 ``x`` -> ``(hi, lo)`` bf16 with hi + lo == x to ~2^-17 relative (hi = bf16(x), lo = bf16(x - hi))."""
    hi = x.to(tl.bfloat16)
    lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def dot_f32(a, b, acc, SPLIT: tl.constexpr, PREC: tl.constexpr):
    """``acc + a @ b`` for fp32 ``a`` and bf16/fp16 ``b`` (exact in fp32), fp32 accumulation.

    SPLIT (bf16 ``b``): two bf16 tensor-core dots of ``a``'s high and low bf16 parts. Else: one dot of fp32
    operands at ``input_precision=PREC``."""
    if SPLIT:
        hi, lo = split_bf16(a)
        acc = tl.dot(hi, b, acc)
        acc = tl.dot(lo, b, acc)
    else:
        acc = tl.dot(a, b.to(tl.float32), acc, input_precision=PREC)
    return acc


@triton.jit
def _gather_rows(KV, IDX, row, b, t, s, topk, start, DK: tl.constexpr, DA: tl.constexpr, BN: tl.constexpr):
    """Slots ``start .. start + BN`` of token ``row``: key rows ``[BN, DK]``, their first ``DA`` channels
    (the key tile itself when ``DA == DK``), the live mask ``[BN]`` and the row numbers ``[BN]`` in kv."""
    offs_n = start + tl.arange(0, BN)
    offs_dk = tl.arange(0, DK)
    idx = tl.load(IDX + row * topk + offs_n, mask=offs_n < topk, other=-1)
    live = (idx >= 0) & (idx <= t)  # [BN]: -1 (empty) and future keys are dead
    key_rows = b * s + tl.where(live, idx, 0).to(tl.int64)  # [BN] rows of kv viewed as [b*s, dk]
    k = tl.load(KV + key_rows[:, None] * DK + offs_dk[None, :], mask=live[:, None], other=0.0)  # [BN, DK]
    if DA == DK:
        v = k
    else:
        offs_da = tl.arange(0, DA)
        v = tl.load(KV + key_rows[:, None] * DK + offs_da[None, :], mask=live[:, None], other=0.0)  # [BN, DA]
    return k, v, live, key_rows


# --- forward ---------------------------------------------------------------------------------------
@triton.jit
def _sparse_mla_fwd(Q, KV, IDX, O, LSE, s, h, topk, scale,
                    DK: tl.constexpr, DV: tl.constexpr, DA: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr,
                    SPLIT: tl.constexpr, PREC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * s + t
    b = row // s
    t = row % s
    offs_h = tl.arange(0, HP)
    offs_dk = tl.arange(0, DK)
    offs_da = tl.arange(0, DA)
    head_ok = offs_h < h
    heads = row * h + offs_h  # rows of q / o viewed as [b*s*h, .]
    q = tl.load(Q + heads[:, None] * DK + offs_dk[None, :], mask=head_ok[:, None], other=0.0)  # [HP, DK]
    m_i = tl.full([HP], -1.0e30, tl.float32)  # finite: a block with no live slot leaves exp(-inf - m) = 0
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, DA], tl.float32)  # the first DV columns are the output
    for start in range(0, topk, BN):
        k, v, live, _rows = _gather_rows(KV, IDX, row, b, t, s, topk, start, DK, DA, BN)
        logits = tl.dot(q, tl.trans(k)) * scale  # [HP, BN] fp32
        logits = tl.where(live[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])  # [HP, BN] fp32, 0 on dead slots
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot_f32(p, v, acc * alpha[:, None], SPLIT, PREC)
        m_i = m_new
    has_slot = l_i > 0.0
    out = acc / tl.where(has_slot, l_i, 1.0)[:, None]  # a row with no live slot: 0, not 0/0
    lse = tl.where(has_slot, m_i + tl.log(tl.where(has_slot, l_i, 1.0)), float("-inf"))
    tl.store(O + heads[:, None] * DV + offs_da[None, :], out.to(O.dtype.element_ty),
             mask=head_ok[:, None] & (offs_da[None, :] < DV))
    tl.store(LSE + heads, lse, mask=head_ok)


# --- backward --------------------------------------------------------------------------------------
@triton.jit
def _sparse_mla_bwd(Q, KV, IDX, O, DO, LSE, DQ, DKV, s, h, topk, scale,
                    DK: tl.constexpr, DV: tl.constexpr, DA: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr,
                    SPLIT: tl.constexpr, PREC: tl.constexpr, KEYS_AS_ROWS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * s + t
    b = row // s
    t = row % s
    offs_h = tl.arange(0, HP)
    offs_dk = tl.arange(0, DK)
    offs_da = tl.arange(0, DA)
    head_ok = offs_h < h
    heads = row * h + offs_h
    value_cols = head_ok[:, None] & (offs_da[None, :] < DV)
    q = tl.load(Q + heads[:, None] * DK + offs_dk[None, :], mask=head_ok[:, None], other=0.0)  # [HP, DK]
    do = tl.load(DO + heads[:, None] * DV + offs_da[None, :], mask=value_cols, other=0.0)  # [HP, DA], 0 past DV
    o = tl.load(O + heads[:, None] * DV + offs_da[None, :], mask=value_cols, other=0.0)
    lse = tl.load(LSE + heads, mask=head_ok, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # [HP] fp32: rowsum(dO * O)
    dq = tl.zeros([HP, DK], tl.float32)
    for start in range(0, topk, BN):
        k, v, live, key_rows = _gather_rows(KV, IDX, row, b, t, s, topk, start, DK, DA, BN)
        # Padded heads and dead slots get p = 0, so they add nothing to dq or to the scatter below.
        if KEYS_AS_ROWS:  # [BN, HP] tiles: the slots are the dots' M side, the key gradient needs no transpose
            logits = tl.dot(k, tl.trans(q)) * scale
            p = tl.where(live[:, None] & head_ok[None, :], tl.exp(logits - lse[None, :]), 0.0)  # [BN, HP] fp32
            dp = tl.dot(v, tl.trans(do))  # [BN, HP] fp32 (dO's zero columns past DV add nothing)
            ds = p * (dp - delta[None, :]) * scale  # [BN, HP] fp32: d (q . k)
            dq = dot_f32(tl.trans(ds), k, dq, SPLIT, PREC)
            ds_rows, p_rows = ds, p
        else:  # [HP, BN] tiles: the heads are the M side
            logits = tl.dot(q, tl.trans(k)) * scale
            p = tl.where(head_ok[:, None] & live[None, :], tl.exp(logits - lse[:, None]), 0.0)  # [HP, BN] fp32
            dp = tl.dot(do, tl.trans(v))  # [HP, BN] fp32
            ds = p * (dp - delta[:, None]) * scale  # [HP, BN] fp32
            dq = dot_f32(ds, k, dq, SPLIT, PREC)
            ds_rows, p_rows = tl.trans(ds), tl.trans(p)
        dkv = dot_f32(ds_rows, q, tl.zeros([BN, DK], tl.float32), SPLIT, PREC)  # [BN, DK] key gradient
        if DA == DK:  # the value gradient joins the key gradient's tile: one scatter
            dkv = dot_f32(p_rows, do, dkv, SPLIT, PREC)
        else:
            dv = dot_f32(p_rows, do, tl.zeros([BN, DA], tl.float32), SPLIT, PREC)  # [BN, DV]
            tl.atomic_add(DKV + key_rows[:, None] * DK + offs_da[None, :], dv, mask=live[:, None], sem="relaxed")
        tl.atomic_add(DKV + key_rows[:, None] * DK + offs_dk[None, :], dkv, mask=live[:, None], sem="relaxed")
    tl.store(DQ + heads[:, None] * DK + offs_dk[None, :], dq.to(DQ.dtype.element_ty), mask=head_ok[:, None])


# --- autograd --------------------------------------------------------------------------------------
def _launch_options(kind: str, hp: int, dk: int, dv: int, block_n: int | None) -> dict:
    """Tile constexprs and launch options of one kernel from ``TILES``: ``BN`` (``block_n`` if given), ``DA``
    (dk when the value comes from the key tile, else dv), warps and stages."""
    tile = TILES[kind]
    extra = {"KEYS_AS_ROWS": tile["keys_as_rows"]} if kind == "bwd" else {}
    return {"BN": block_n or tile["block_n"], "DA": dk if tile["value_from_key"] else dv,
            "num_warps": max(8 if hp > 32 else 1, tile["num_warps"]), "num_stages": tile["num_stages"], **extra}


class SparseMLAFunction(torch.autograd.Function):
    """``(q, kv, indices) -> (o, lse)``; see the module docstring. ``lse`` is not differentiable."""

    @staticmethod
    def forward(ctx, q, kv, indices, scale: float, d_v: int, block_n: int | None):
        b, s, h, dk = q.shape
        topk = indices.shape[-1]
        q, kv, indices = q.contiguous(), kv.contiguous(), indices.contiguous()
        o = q.new_empty(b, s, h, d_v)
        lse = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
        hp = head_block(h)
        if b * s > 0:
            _sparse_mla_fwd[(b * s,)](q, kv, indices, o, lse, s, h, topk, scale, DK=dk, DV=d_v, HP=hp,
                                      SPLIT=q.dtype == torch.bfloat16, PREC=PRECISION,
                                      **_launch_options("fwd", hp, dk, d_v, block_n))
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
            _sparse_mla_bwd[(b * s,)](q, kv, indices, o, do, lse, dq, dkv32, s, h, topk, ctx.scale, DK=dk,
                                      DV=ctx.d_v, HP=hp, SPLIT=q.dtype == torch.bfloat16, PREC=PRECISION,
                                      **_launch_options("bwd", hp, dk, ctx.d_v, ctx.block_n))
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
               block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``o [b, s, h, d_v]`` (q's dtype) and ``lse [b, s, h]`` fp32 of sparse attention over ``indices``.
    ``block_n``: top-k slots per loop step of both kernels; None: each kernel's ``TILES`` entry."""
    check_inputs(q, kv, indices, d_v, block_n or TILES["fwd"]["block_n"])
    return SparseMLAFunction.apply(q, kv, indices, float(scale), int(d_v), block_n and int(block_n))
