"""The Triton kernels of the MIMO scan: walks over the chunks (or time blocks) of one (b, h) in order, and
passes over all chunks in parallel (scan.py lists them in launch order).

A tile is ``T`` tokens of one (batch, head); its rows are the ``T * RP`` (token, rank) pairs, row ``i`` =
token ``i // RP``, rank ``i % RP`` (``RP``: the rank padded to a power of two; padded ranks are masked to 0).
``n`` is split in halves ``[0, n/2)`` and ``[n/2, n)`` so rotate_half's pairs ``(i, i + n/2)`` are the same
column of two register tiles. Every ``tl.dot`` takes the dtype of ``q`` (bf16 on the GPU) and accumulates in
fp32; decays, weights, state carries and every gradient reduction stay fp32 in registers (stored states are in
q's dtype, which every reader rounds them to for its dot). No atomics: every output element has exactly one
writer, so the result is deterministic.

Per (batch, head), with ``cs`` the chunk-local inclusive cumsum of ``adt``, ``c_u`` and ``gamma_t`` the
trapezoid weights (scan.py) and ``S_in[c]`` the state carried into chunk ``c``::

    y_tr     = sum_{u<=t in chunk, r'} exp(cs_t - cs_u) w[t,u] (q~_tr . k~_ur') v_ur' + exp(cs_t) S_in q~_tr
    S_in[c+1] = exp(cs_end) S_in[c] + sum_u exp(cs_end - cs_u) c_u sum_r v_ur k~_ur^T
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


@triton.jit
def _rows(c, L, R, T: tl.constexpr, RP: tl.constexpr):
    """Token, rank and validity of the tile's ``T * RP`` rows in chunk ``c``."""
    rows = tl.arange(0, T * RP)
    tok = c * T + rows // RP
    rank = rows % RP
    return tok, rank, (tok < L) & (rank < R)


@triton.jit
def _table_rows(rot_ptr, toks, L, rot_base, rot_sl, S, col0, W: tl.constexpr):
    """cos and sin of the phases of tokens ``toks``, ``[len(toks), W]`` fp32 each: columns ``[col0, col0 + W)`` of
    the half (columns >= S: cos 1, sin 0) of the table the ``phase`` kernel writes (``[b, l, h, 2S]``: cos, then
    sin)."""
    cols = col0 + tl.arange(0, W)
    ptr = rot_ptr + rot_base + toks[:, None] * rot_sl + cols[None, :]
    m = (toks < L)[:, None] & (cols[None, :] < S)
    return tl.load(ptr, mask=m, other=1.0), tl.load(ptr + S, mask=m, other=0.0)


@triton.jit
def _cos_sin_table(rot_ptr, c, L, rot_base, rot_sl, S, col0, T: tl.constexpr, W: tl.constexpr):
    """``_table_rows`` of chunk ``c``'s tokens, ``[T, W]``: the dstate walk and the dq / dk windows load it a
    step ahead and repeat it over the ranks (``_over_ranks``) when they use it."""
    return _table_rows(rot_ptr, c * T + tl.arange(0, T), L, rot_base, rot_sl, S, col0, W)


@triton.jit
def _repeat_ranks(t, T: tl.constexpr, RP: tl.constexpr, W: tl.constexpr):
    """A per-token ``[T, W]`` tile repeated over the ranks in registers, ``[T * RP, W]``."""
    return tl.reshape(tl.broadcast_to(t[:, None, :], (T, RP, W)), (T * RP, W))


@triton.jit
def _over_ranks(cos, sin, T: tl.constexpr, RP: tl.constexpr, W: tl.constexpr):
    """Per-token ``[T, W]`` tiles repeated over the ranks in registers, ``[T * RP, W]``."""
    return _repeat_ranks(cos, T, RP, W), _repeat_ranks(sin, T, RP, W)


@triton.jit
def _cos_sin(rot_ptr, c, L, rot_base, rot_sl, S, col0, T: tl.constexpr, RP: tl.constexpr, W: tl.constexpr):
    """cos and sin of the phases of chunk ``c``'s rows, ``[T * RP, W]`` fp32: each (token, rank) row loads its
    token's row of the table (``_table_rows``; RP loads a token, from L1). Loaded once per token and repeated over
    the ranks in registers instead (a layout change through shared memory), the state walk, fwd_chunk and the
    per-head pass were slower (r52, H200, NAM56R's b2: 1.08 / 2.25 / 5.83 ms against 1.03 / 1.97 / 5.73), and
    fwd_chunk took 248 registers against 188 (capped at 168 it spills 548 B against 64: three programs an SM).
    The dstate walk and the dq / dk windows hold a per-token table a step ahead (``_cos_sin_table``: a quarter of
    the registers). q and k of a (token, head) share them, so a kernel rotating both reads them once."""
    return _table_rows(rot_ptr, c * T + tl.arange(0, T * RP) // RP, L, rot_base, rot_sl, S, col0, W)


@triton.jit
def _raw_rows(x_ptr, tok, rank, valid, x_base, x_sl, x_sr, col0, HALF: tl.constexpr, W: tl.constexpr):
    """x (q or k of a group) as loaded, columns ``[col0, col0 + W)`` of its two halves ``[M, W]``."""
    cols = col0 + tl.arange(0, W)
    m = valid[:, None]
    ptr = x_ptr + x_base + tok[:, None] * x_sl + rank[:, None] * x_sr + cols[None, :]
    return tl.load(ptr, mask=m, other=0.0), tl.load(ptr + HALF, mask=m, other=0.0)


@triton.jit
def _plus_bias(lo, hi, bias_ptr, rank, valid, bias_base, col0, HALF: tl.constexpr, W: tl.constexpr):
    """``_raw_rows``'s halves plus a head's bias, fp32 (0 on invalid rows)."""
    cols = col0 + tl.arange(0, W)
    m = valid[:, None]
    bptr = bias_ptr + bias_base + rank[:, None] * (2 * HALF) + cols[None, :]
    lo = tl.where(m, lo.to(tl.float32) + tl.load(bptr, mask=m, other=0.0), 0.0)
    hi = tl.where(m, hi.to(tl.float32) + tl.load(bptr + HALF, mask=m, other=0.0), 0.0)
    return lo, hi


@triton.jit
def _raw(x_ptr, bias_ptr, tok, rank, valid, x_base, x_sl, x_sr, bias_base, col0, HALF: tl.constexpr,
         W: tl.constexpr):
    """x + bias, not rotated, as columns ``[col0, col0 + W)`` of its two halves ``[M, W]`` fp32 (0 on invalid
    rows)."""
    lo, hi = _raw_rows(x_ptr, tok, rank, valid, x_base, x_sl, x_sr, col0, HALF, W)
    return _plus_bias(lo, hi, bias_ptr, rank, valid, bias_base, col0, HALF, W)


@triton.jit
def _rotate(lo, hi, cos, sin):
    """The halves of x + bias rotated by the phase."""
    return lo * cos - hi * sin, lo * sin + hi * cos


@triton.jit
def _rotated(x_ptr, bias_ptr, tok, rank, valid, x_base, x_sl, x_sr, bias_base, cos, sin, col0, HALF: tl.constexpr,
             W: tl.constexpr):
    """(x + bias) rotated by the phase (cos, sin from ``_cos_sin`` at the same columns), as columns
    ``[col0, col0 + W)`` of its two halves ``[M, W]`` fp32."""
    lo, hi = _raw(x_ptr, bias_ptr, tok, rank, valid, x_base, x_sl, x_sr, bias_base, col0, HALF, W)
    return _rotate(lo, hi, cos, sin)


@triton.jit
def _load_rows(ptr, base, tok, sl, valid, pcols):
    """``[M, BP]`` fp32: row i reads token ``tok[i]`` (a per-token tensor repeated over the ranks)."""
    return tl.load(ptr + base + tok[:, None] * sl + pcols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)


@triton.jit
def _token_rows(ptr, base, sl, valid, pcols, c, L, T: tl.constexpr, RP: tl.constexpr):
    """``_load_rows``' tile with each token's row loaded once and repeated over the ranks in registers. The
    per-head pass takes it (r43, H200, NAM56R's b2: 6.48 -> 5.77 ms); the walks, the forward and dk were slower
    with it (dstate walk 1.37 -> 1.69 ms: more spilled registers) and dq the same, so they load row by row."""
    toks = c * T + tl.arange(0, T)
    one = tl.load(ptr + base + toks[:, None] * sl + pcols[None, :], mask=(toks < L)[:, None], other=0.0)
    return tl.where(valid[:, None], _repeat_ranks(one.to(tl.float32), T, RP, pcols.shape[0]), 0.0)


@triton.jit
def _load_proj(ptr, h, rank, valid, R, P, pcols):
    """``[M, BP]`` fp32: row i reads ``mimo_*[h, rank[i], pcols]``."""
    return tl.load(ptr + (h * R + rank[:, None]) * P + pcols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)


@triton.jit
def _decay_weights(tok, cs, gam, cc, T: tl.constexpr, RP: tl.constexpr):
    """``A [M, M]``: exp(cs_t - cs_u) * (gamma_t on the token diagonal, c_u below it), 0 above; and the
    bare decay ``exp(cs_t - cs_u)`` on and below the diagonal."""
    ti = tok[:, None]
    tj = tok[None, :]
    decay = tl.exp(tl.where(ti >= tj, cs[:, None] - cs[None, :], float("-inf")))
    return decay * tl.where(ti == tj, gam[None, :], cc[None, :]), decay


_PTX: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
"""On a GPU ``_sigmoid`` and ``_cos_sin_mod`` are PTX (the interpreter runs no PTX, and takes
``1 / (1 + exp(-x))``, ``tl.cos``, ``tl.sin``)."""


@triton.jit
def _sigmoid(x):
    """1 / (1 + 2^(-x log2 e)): ex2.approx, an add and rcp.approx (1 ulp), flushing denormals to zero. Triton's
    ``tl.sigmoid`` divides with ``div.full`` (range-scaled: ~20 SASS instructions an element; r40's profile of
    the per-head pass put 12% of its stall samples there); both are within a few ulp of the exact value."""
    if _PTX:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 e; ex2.approx.ftz.f32 e, $1; add.ftz.f32 e, e, 0f3F800000; rcp.approx.ftz.f32 $0, e; }",
            "=r,r", [x * -1.4426950408889634], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _cos_sin_mod(phi):
    """cos and sin of a phase, taken mod 2 pi first (into [-pi, pi): the same cos and sin as the reference's
    [0, 2 pi)). On a GPU ``cos.approx`` / ``sin.approx`` (one MUFU instruction each, absolute error <= 2^-20.5 on
    [-pi, pi]; mamba-ssm's MIMO kernels take cos and sin the same way, under TileLang's fast math); libdevice's
    ``cosf`` / ``sinf`` carry a slow argument reduction that a reduced phase never takes, and were 2,732 of the
    phase kernel's 3,528 SASS instructions (sm_90 build; 952 with these)."""
    red = phi - 6.283185307179586 * tl.floor(phi / 6.283185307179586 + 0.5)
    if _PTX:
        cos = tl.inline_asm_elementwise("cos.approx.ftz.f32 $0, $1;", "=r,r", [red], dtype=tl.float32,
                                        is_pure=True, pack=1)
        sin = tl.inline_asm_elementwise("sin.approx.ftz.f32 $0, $1;", "=r,r", [red], dtype=tl.float32,
                                        is_pure=True, pack=1)
        return cos, sin
    else:
        return tl.cos(red), tl.sin(red)


@triton.jit
def _prefetch_l1(ptrs):
    """Ask L1 for the lines at ``ptrs`` (PTX ``prefetch.global.L1``: a hint, nothing returned, nothing written);
    nothing under the interpreter."""
    if _PTX:
        tl.inline_asm_elementwise("prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(ptr, starts, length, W: tl.constexpr):
    """Ask L1 for the 128-byte lines of rows of ``length`` elements (at most ``W``, a power of two) starting at
    element offsets ``starts`` of ``ptr``: ``_prefetch_l1`` at each line's first element (the row's last element
    for a row shorter than ``W``). A hint: nothing returned, nothing written; nothing under the interpreter.

    The walks along time (``phase``, ``time_grads``) ask for their next block's lines: H200, NAM56R's b2, one run
    each way (r60): phase 0.256 -> 0.191 ms, time_grads 0.247 -> 0.197, the same bits out. The walks over chunks
    asking for their next chunk's rows (and fwd_chunk over 2 or 4 chunks a program asking for the next one's) were
    slower (r59: state walk 1.01 -> 1.08, dstate walk 1.35 -> 1.46: the pointers spill; fwd_chunk 2.10-2.15
    against 1.90 at one chunk a program)."""
    if _PTX:
        LE: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth
        NL: tl.constexpr = (W + LE - 1) // LE
        cols = tl.minimum(tl.arange(0, NL) * LE, length - 1)
        _prefetch_l1(ptr + starts[:, None] + cols[None, :])


@triton.jit
def _prefetch_biases(qb_ptr, kb_ptr, h, R, col0, HALF: tl.constexpr, RP: tl.constexpr):
    """Head ``h``'s q and k bias lines that a dq / dk window reads, asked of L1 a head ahead: the line at column
    ``col0`` of each rank's two halves (the whole window at NAM56R's NS 2: 32 fp32 columns, 128 bytes). Without
    it the bias loads at each head's start were 25% / 22% of dq's / dk's stall samples, mostly waiting on global
    memory (r46's ncu). H200, NAM56R's b2, one run each way (r57): dq 2.66 -> 2.51 ms, dk 2.81 -> 2.80; the same
    bits out."""
    i = tl.arange(0, 2 * RP)
    off = h * R * 2 * HALF + tl.minimum(i // 2, R - 1) * (2 * HALF) + (i % 2) * HALF + col0
    _prefetch_l1(qb_ptr + off)
    _prefetch_l1(kb_ptr + off)


@triton.jit
def _dy(dout, mo, z, mz):
    """dL/dy_tr = dout_t * mimo_o_r * silu(z_t mimo_z_r)."""
    zm = z * mz
    return dout * mo * zm * _sigmoid(zm)


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add3(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _walk_scalars(rot_ptr, cs_ptr, c, L, R, rot_base, rot_sl, S, seq_base, T: tl.constexpr, RP: tl.constexpr,
                  HALF: tl.constexpr):
    """What the dstate walk reads of chunk ``c`` besides its rows: the phase table ``[T, n/2]`` (cos, sin) and the
    log-decays of its rows and of its last token."""
    cos_t, sin_t = _cos_sin_table(rot_ptr, c, L, rot_base, rot_sl, S, 0, T, HALF)
    tok, _, _ = _rows(c, L, R, T, RP)
    cs = tl.load(cs_ptr + seq_base + tok)
    cs_end = tl.load(cs_ptr + seq_base + c * T + T - 1)
    return cos_t, sin_t, cs, cs_end


@triton.jit
def state_walk_kernel(k_ptr, kb_ptr, rot_ptr, x_ptr, mx_ptr, cs_ptr, c_ptr, s_ptr,
                      L, H, HPG, R, S, NC, k_sb, k_sl, k_sr, k_sg, x_sb, x_sl, x_sh,
                      T: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr, P: tl.constexpr,
                      PSPLIT: tl.constexpr):
    """Grid (b*h, PSPLIT): ``S_in[c]`` for every chunk, chunks in order, the carry ``[p/PSPLIT, n]`` in fp32
    registers; stored in the dtype of ``s_ptr`` (q's: every reader rounds S_in to it for its dot anyway).
    S_in[0] = 0, S_in[c+1] = exp(cs_end[c]) S_in[c] + sum_u exp(cs_end - cs_u) c_u sum_r v_ur k~_ur^T."""
    bh = tl.program_id(0)
    BP: tl.constexpr = P // PSPLIT
    pcols = tl.program_id(1) * BP + tl.arange(0, BP)
    b = bh // H
    h = bh % H
    LP = NC * T
    DT = k_ptr.dtype.element_ty
    hcols = tl.arange(0, HALF)
    k_base = b * k_sb + (h // HPG) * k_sg
    rot_base = (b * L * H + h) * 2 * S
    carry_lo = tl.zeros((BP, HALF), tl.float32)
    carry_hi = tl.zeros((BP, HALF), tl.float32)
    for c in range(NC):
        tok, rank, valid = _rows(c, L, R, T, RP)
        sp = s_ptr + ((bh * NC + c) * P + pcols[:, None]) * (2 * HALF) + hcols[None, :]
        tl.store(sp, carry_lo.to(s_ptr.dtype.element_ty))
        tl.store(sp + HALF, carry_hi.to(s_ptr.dtype.element_ty))
        cos, sin = _cos_sin(rot_ptr, c, L, rot_base, H * 2 * S, S, 0, T, RP, HALF)
        klo, khi = _rotated(k_ptr, kb_ptr, tok, rank, valid, k_base, k_sl, k_sr, h * R * 2 * HALF, cos, sin, 0,
                            HALF, HALF)
        cs = tl.load(cs_ptr + bh * LP + tok)
        cs_end = tl.load(cs_ptr + bh * LP + c * T + T - 1)
        w = tl.exp(cs_end - cs) * tl.load(c_ptr + bh * LP + tok)
        v = (_load_rows(x_ptr, b * x_sb + h * x_sh, tok, x_sl, valid, pcols)
             * _load_proj(mx_ptr, h, rank, valid, R, P, pcols))
        vw = tl.trans((v * w[:, None]).to(DT))  # [BP, M]
        decay = tl.exp(cs_end)
        carry_lo = carry_lo * decay + tl.dot(vw, klo.to(DT))
        carry_hi = carry_hi * decay + tl.dot(vw, khi.to(DT))


@triton.jit
def dstate_walk_kernel(q_ptr, qb_ptr, rot_ptr, z_ptr, do_ptr, mz_ptr, mo_ptr, cs_ptr, ds_ptr,
                       L, H, HPG, R, S, NC, q_sb, q_sl, q_sr, q_sg, z_sb, z_sl, z_sh, do_sb, do_sl, do_sh,
                       T: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr, P: tl.constexpr,
                       PSPLIT: tl.constexpr):
    """Grid (b*h, PSPLIT): ``dS_out[c]`` = dL/dS_in[c+1] for every chunk, chunks in reverse, the carry in fp32
    registers, stored in the dtype of ``ds_ptr``. dS_out[last] = 0, dS_out[c-1] = exp(cs_end[c]) dS_out[c] +
    sum_t exp(cs_t) sum_r dy_tr q~_tr^T (chunk c's own dL/dS_in[c])."""
    bh = tl.program_id(0)
    BP: tl.constexpr = P // PSPLIT
    pcols = tl.program_id(1) * BP + tl.arange(0, BP)
    b = bh // H
    h = bh % H
    LP = NC * T
    DT = q_ptr.dtype.element_ty
    hcols = tl.arange(0, HALF)
    q_base = b * q_sb + (h // HPG) * q_sg
    rot_base = (b * L * H + h) * 2 * S
    carry_lo = tl.zeros((BP, HALF), tl.float32)
    carry_hi = tl.zeros((BP, HALF), tl.float32)
    # chunk c - 1's phase table and log-decays are loaded while chunk c computes: the walk is a chain of chunks,
    # where a load issued in the chunk that uses it waits out its whole latency (r42: 2.15 -> 1.36 ms at NAM56R's
    # b2; the state walk, the same way, went 1.07 -> 1.21 ms and loads its own)
    cos_t, sin_t, cs, cs_end = _walk_scalars(rot_ptr, cs_ptr, NC - 1, L, R, rot_base, H * 2 * S, S, bh * LP, T,
                                             RP, HALF)
    for i in range(NC):
        c = NC - 1 - i
        tok, rank, valid = _rows(c, L, R, T, RP)
        sp = ds_ptr + ((bh * NC + c) * P + pcols[:, None]) * (2 * HALF) + hcols[None, :]
        tl.store(sp, carry_lo.to(ds_ptr.dtype.element_ty))
        tl.store(sp + HALF, carry_hi.to(ds_ptr.dtype.element_ty))
        cos, sin = _over_ranks(cos_t, sin_t, T, RP, HALF)
        ecs = tl.exp(cs)
        decay = tl.exp(cs_end)
        # the next chunk's (the first chunk loads its own again)
        cos_t, sin_t, cs, cs_end = _walk_scalars(rot_ptr, cs_ptr, tl.maximum(c - 1, 0), L, R, rot_base, H * 2 * S,
                                                 S, bh * LP, T, RP, HALF)
        qlo, qhi = _rotated(q_ptr, qb_ptr, tok, rank, valid, q_base, q_sl, q_sr, h * R * 2 * HALF, cos, sin, 0,
                            HALF, HALF)
        dy = _dy(_load_rows(do_ptr, b * do_sb + h * do_sh, tok, do_sl, valid, pcols),
                 _load_proj(mo_ptr, h, rank, valid, R, P, pcols),
                 _load_rows(z_ptr, b * z_sb + h * z_sh, tok, z_sl, valid, pcols),
                 _load_proj(mz_ptr, h, rank, valid, R, P, pcols))
        dyt = tl.trans((dy * ecs[:, None]).to(DT))  # [BP, M]
        carry_lo = carry_lo * decay + tl.dot(dyt, qlo.to(DT))
        carry_hi = carry_hi * decay + tl.dot(dyt, qhi.to(DT))


@triton.jit
def fwd_chunk_kernel(q_ptr, k_ptr, qb_ptr, kb_ptr, rot_ptr, x_ptr, z_ptr, mx_ptr, mz_ptr, mo_ptr, d_ptr,
                     cs_ptr, gam_ptr, c_ptr, s_ptr, out_ptr,
                     L, H, HPG, R, S, NC, q_sb, q_sl, q_sr, q_sg, k_sb, k_sl, k_sr, k_sg,
                     x_sb, x_sl, x_sh, z_sb, z_sl, z_sh, o_sb, o_sl, o_sh,
                     T: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr, P: tl.constexpr):
    """Grid (nc, b*h): one chunk's output, intra-chunk plus ``S_in[c]``'s, gated and summed over ranks."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    g = h // HPG
    LP = NC * T
    DT = q_ptr.dtype.element_ty
    pcols = tl.arange(0, P)
    hcols = tl.arange(0, HALF)
    tok, rank, valid = _rows(c, L, R, T, RP)
    rot_base = (b * L * H + h) * 2 * S
    cos, sin = _cos_sin(rot_ptr, c, L, rot_base, H * 2 * S, S, 0, T, RP, HALF)
    qlo, qhi = _rotated(q_ptr, qb_ptr, tok, rank, valid, b * q_sb + g * q_sg, q_sl, q_sr, h * R * 2 * HALF, cos, sin,
                        0, HALF, HALF)
    klo, khi = _rotated(k_ptr, kb_ptr, tok, rank, valid, b * k_sb + g * k_sg, k_sl, k_sr, h * R * 2 * HALF, cos, sin,
                        0, HALF, HALF)
    qlo = qlo.to(DT)
    qhi = qhi.to(DT)
    cs = tl.load(cs_ptr + bh * LP + tok)
    amat, _ = _decay_weights(tok, cs, tl.load(gam_ptr + bh * LP + tok), tl.load(c_ptr + bh * LP + tok), T, RP)
    qk = tl.dot(qlo, tl.trans(klo.to(DT))) + tl.dot(qhi, tl.trans(khi.to(DT)))  # [M, M]
    x = _load_rows(x_ptr, b * x_sb + h * x_sh, tok, x_sl, valid, pcols)
    v = x * _load_proj(mx_ptr, h, rank, valid, R, P, pcols)
    y = tl.dot((qk * amat).to(DT), v.to(DT))
    sp = s_ptr + ((bh * NC + c) * P + pcols[None, :]) * (2 * HALF) + hcols[:, None]  # S_in^T halves [n/2, p]
    y += tl.exp(cs)[:, None] * (tl.dot(qlo, tl.load(sp).to(DT)) + tl.dot(qhi, tl.load(sp + HALF).to(DT)))
    zm = _load_rows(z_ptr, b * z_sb + h * z_sh, tok, z_sl, valid, pcols) * _load_proj(mz_ptr, h, rank, valid, R, P,
                                                                                       pcols)
    o = (y + tl.load(d_ptr + h) * v) * zm * _sigmoid(zm) * _load_proj(mo_ptr, h, rank, valid, R, P, pcols)
    out = tl.sum(tl.reshape(o, (T, RP, P)), axis=1)  # [T, p]
    toks = c * T + tl.arange(0, T)
    tl.store(out_ptr + b * o_sb + toks[:, None] * o_sl + h * o_sh + pcols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(toks < L)[:, None])


@triton.jit
def _decays(cs, cs_end, cc):
    """A chunk's rows' exp(cs_t), exp(cs_end - cs_u) and the inter-chunk weight exp(cs_end - cs_u) c_u ``[M, 1]``."""
    to_end = tl.exp(cs_end - cs)
    return tl.exp(cs), to_end, (to_end * cc)[:, None]


@triton.jit
def _bias_partials(ptr, u_lo, u_hi, rmask, T: tl.constexpr, RP: tl.constexpr, NW: tl.constexpr,
                   HALF: tl.constexpr):
    """A bias's gradient partials over this chunk's tokens, ``[RP, NW]`` at ``ptr`` (lo) and ``ptr + HALF`` (hi)."""
    lo, hi = tl.reduce((tl.reshape(u_lo, (T, RP, NW)), tl.reshape(u_hi, (T, RP, NW))), 0, _add2)
    tl.store(ptr, lo, mask=rmask)
    tl.store(ptr + HALF, hi, mask=rmask)


@triton.jit
def _head_cols(hp, mmat, qlo_d, qhi_d, klo_d, khi_d, ecs, inter, dskip, x_ptr, z_ptr, do_ptr, mx_ptr, mz_ptr,
               mo_ptr, s_ptr, ds_ptr, dx_ptr, dz_ptr, dmx_ptr, dmz_ptr, dmo_ptr, tok, rank, valid, b, c, h, L, H, R,
               NC, x_base, x_sl, z_base, z_sl, do_base, do_sl,
               T: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr, P: tl.constexpr, PH: tl.constexpr):
    """Column block ``hp`` of the per-head pass's ``PH`` blocks of the head dim (its ``[M, P/PH]`` tiles live
    only here): dx, dz and the d mimo_* partials of those columns. Returns the block's shares of three per-row
    sums: d c's inter-chunk part, d Lambda, dD."""
    DT = qlo_d.dtype
    bh = b * H + h
    toks = c * T + tl.arange(0, T)
    ranks = tl.arange(0, RP)
    tmask = (toks < L)[:, None]
    rmask = (ranks < R)[:, None]
    hcols = tl.arange(0, HALF)
    cols = hp * (P // PH) + tl.arange(0, P // PH)
    stt = ((bh * NC + c) * P + cols[None, :]) * (2 * HALF) + hcols[:, None]  # [n/2, P/PH] halves
    x = _token_rows(x_ptr, x_base, x_sl, valid, cols, c, L, T, RP)
    mx = _load_proj(mx_ptr, h, rank, valid, R, P, cols)
    vb = x * mx
    z = _token_rows(z_ptr, z_base, z_sl, valid, cols, c, L, T, RP)
    mz = _load_proj(mz_ptr, h, rank, valid, R, P, cols)
    d_o = _token_rows(do_ptr, do_base, do_sl, valid, cols, c, L, T, RP) * _load_proj(mo_ptr, h, rank, valid, R, P,
                                                                                       cols)
    zm = z * mz
    sg = _sigmoid(zm)
    dyb = d_o * zm * sg
    y = tl.dot(mmat, vb.to(DT)) + ecs[:, None] * (tl.dot(qlo_d, tl.load(s_ptr + stt).to(DT))
                                                 + tl.dot(qhi_d, tl.load(s_ptr + stt + HALF).to(DT)))
    dvi = (tl.dot(klo_d, tl.load(ds_ptr + stt).to(DT))
           + tl.dot(khi_d, tl.load(ds_ptr + stt + HALF).to(DT)))
    dv = tl.dot(tl.trans(mmat), dyb.to(DT)) + inter * dvi
    dvt = dv + dskip * dyb
    ypd = y + dskip * vb
    out_off = ((b * L + toks[:, None]) * H + h) * P + cols[None, :]  # dx, dz contiguous [b, l, h, p]
    part = (((b * NC + c) * H + h) * R + ranks[:, None]) * P + cols[None, :]
    dzm = d_o * ypd * sg * (1.0 + zm * (1.0 - sg))
    # dL/d mimo_o = dout * ypd * silu(zm); d_o = dout * mimo_o, so divide nothing: reload dout
    dout = _token_rows(do_ptr, do_base, do_sl, valid, cols, c, L, T, RP)
    # sums that share an axis are one reduction (one set of shuffles and barriers, the same sums):
    # over the ranks (dx, dz), over the tokens (d mimo_x, _z, _o partials; rows spread over the warps)
    dxs, dzs = tl.reduce((tl.reshape(dvt * mx, (T, RP, P // PH)), tl.reshape(dzm * mz, (T, RP, P // PH))), 1,
                         _add2)
    dmxs, dmzs, dmos = tl.reduce((tl.reshape(dvt * x, (T, RP, P // PH)), tl.reshape(dzm * z, (T, RP, P // PH)),
                                  tl.reshape(dout * ypd * zm * sg, (T, RP, P // PH))), 0, _add3)
    rows_dc, rows_dcs, rows_dd = tl.reduce((vb * dvi, dyb * y - vb * dv, dyb * vb), 1, _add3)
    tl.store(dx_ptr + out_off, dxs.to(dx_ptr.dtype.element_ty), mask=tmask)
    tl.store(dz_ptr + out_off, dzs.to(dz_ptr.dtype.element_ty), mask=tmask)
    tl.store(dmx_ptr + part, dmxs, mask=rmask)
    tl.store(dmz_ptr + part, dmzs, mask=rmask)
    tl.store(dmo_ptr + part, dmos, mask=rmask)
    return rows_dc, rows_dcs, rows_dd


@triton.jit
def _head_pass(c, b, h, q_ptr, k_ptr, qb_ptr, kb_ptr, rot_ptr, x_ptr, z_ptr, do_ptr, mx_ptr, mz_ptr, mo_ptr, d_ptr,
               cs_ptr, gam_ptr, c_ptr, s_ptr, ds_ptr, dx_ptr, dz_ptr, dgam_ptr, dc_ptr, dcs_ptr, dmx_ptr, dmz_ptr,
               dmo_ptr, dd_ptr, hq_ptr, hy_ptr, L, H, R, S, NC, q_base, q_sl, q_sr, k_base, k_sl, k_sr,
               x_base, x_sl, z_base, z_sl, do_base, do_sl,
               T: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr, P: tl.constexpr, PH: tl.constexpr):
    """The per-head pass (``bwd_kernel``'s ``CHUNK``) for chunk ``c`` of head ``h``; the head dim in a loop over
    ``PH`` column blocks (``_head_cols``)."""
    LP = NC * T
    DT = q_ptr.dtype.element_ty
    bh = b * H + h
    pcols = tl.arange(0, P)
    tok, rank, valid = _rows(c, L, R, T, RP)
    toks = c * T + tl.arange(0, T)
    qb_base = h * R * 2 * HALF
    cs = tl.load(cs_ptr + bh * LP + tok)
    cs_end = tl.load(cs_ptr + bh * LP + c * T + T - 1)
    cc = tl.load(c_ptr + bh * LP + tok)
    ecs, to_end, inter = _decays(cs, cs_end, cc)
    cos, sin = _cos_sin(rot_ptr, c, L, (b * L * H + h) * 2 * S, H * 2 * S, S, 0, T, RP, HALF)
    rows = tl.arange(0, T * RP)
    hand = (bh * NC + c) * (T * RP) + rows  # this (chunk, head)'s rows of the hand-off buffers
    qlo, qhi = _rotated(q_ptr, qb_ptr, tok, rank, valid, q_base, q_sl, q_sr, qb_base, cos, sin, 0, HALF,
                        HALF)
    qlo_d = qlo.to(DT)
    qhi_d = qhi.to(DT)
    klo, khi = _rotated(k_ptr, kb_ptr, tok, rank, valid, k_base, k_sl, k_sr, qb_base, cos, sin, 0, HALF,
                        HALF)
    klo_d = klo.to(DT)
    khi_d = khi.to(DT)
    v = _token_rows(x_ptr, x_base, x_sl, valid, pcols, c, L, T, RP) * _load_proj(mx_ptr, h, rank, valid, R, P,
                                                                                  pcols)
    vd = v.to(DT)
    dy = _dy(_token_rows(do_ptr, do_base, do_sl, valid, pcols, c, L, T, RP),
             _load_proj(mo_ptr, h, rank, valid, R, P, pcols),
             _token_rows(z_ptr, z_base, z_sl, valid, pcols, c, L, T, RP),
             _load_proj(mz_ptr, h, rank, valid, R, P, pcols))
    dyd = dy.to(DT)
    # M = (q~ k~^T) * decay * W, W = gamma_u on the token diagonal, c_u below it
    same = tok[:, None] == tok[None, :]
    decay = tl.exp(tl.where(tok[:, None] >= tok[None, :], cs[:, None] - cs[None, :], float("-inf")))
    wmat = tl.where(same, tl.load(gam_ptr + bh * LP + tok)[None, :], cc[None, :])
    dmd = tl.dot(dyd, tl.trans(vd)) * decay  # dL/dM * decay [M, M]
    dqk = (dmd * wmat).to(DT)  # dL/d(q~.k~)
    # handed to the dq and dk passes as the dots take them (q's dtype), so they need not form them again
    tl.store(hq_ptr + hand[:, None] * (T * RP) + rows[None, :], dqk)
    tl.store(hy_ptr + hand[:, None] * P + pcols[None, :], dyd)
    qk = tl.dot(qlo_d, tl.trans(klo_d)) + tl.dot(qhi_d, tl.trans(khi_d))  # [M, M]
    # weights: E[i, j] = dM[i, j] (q~_i . k~_j) exp(cs_i - cs_j); gamma on the token diagonal, c below
    e = dmd * qk
    dgam_col, e_col = tl.reduce((tl.where(same, e, 0.0), e), 0, _add2)
    tl.store(dgam_ptr + bh * LP + toks, tl.sum(tl.reshape(dgam_col, (T, RP)), axis=1))
    dc_col = e_col - dgam_col
    mmat = (qk * decay * wmat).to(DT)
    dskip = tl.load(d_ptr + h)
    dc_row = tl.zeros((T * RP,), tl.float32)
    dcs_row = tl.zeros((T * RP,), tl.float32)
    dd_row = tl.zeros((T * RP,), tl.float32)
    for hp in range(PH):
        dc_b, dcs_b, dd_b = _head_cols(
            hp, mmat, qlo_d, qhi_d, klo_d, khi_d, ecs, inter, dskip, x_ptr, z_ptr, do_ptr, mx_ptr, mz_ptr, mo_ptr,
            s_ptr, ds_ptr, dx_ptr, dz_ptr, dmx_ptr, dmz_ptr, dmo_ptr, tok, rank, valid, b, c, h, L, H, R, NC,
            x_base, x_sl, z_base, z_sl, do_base, do_sl, T, RP, HALF, P, PH)
        dc_row += dc_b
        dcs_row += dcs_b
        dd_row += dd_b
    dc_t, dcs_t = tl.reduce((tl.reshape(dc_col + to_end * dc_row, (T, RP)), tl.reshape(dcs_row, (T, RP))), 1,
                            _add2)
    tl.store(dc_ptr + bh * LP + toks, dc_t)
    tl.store(dcs_ptr + bh * LP + toks, dcs_t)
    tl.store(dd_ptr + (b * NC + c) * H + h, tl.sum(dd_row, axis=0))


@triton.jit
def bwd_kernel(q_ptr, k_ptr, qb_ptr, kb_ptr, rot_ptr, x_ptr, z_ptr, do_ptr, mx_ptr, mz_ptr, mo_ptr, d_ptr,
               cs_ptr, gam_ptr, c_ptr, s_ptr, ds_ptr,
               dx_ptr, dz_ptr, dgam_ptr, dc_ptr, dcs_ptr, dmx_ptr, dmz_ptr, dmo_ptr, dd_ptr,
               dq_ptr, dk_ptr, dqb_ptr, dkb_ptr, dph_ptr, hq_ptr, hy_ptr,
               L, H, HPG, R, S, NC, q_sb, q_sl, q_sr, q_sg, k_sb, k_sl, k_sr, k_sg,
               x_sb, x_sl, x_sh, z_sb, z_sl, z_sh, do_sb, do_sl, do_sh, G,
               T: tl.constexpr, RP: tl.constexpr, HALF: tl.constexpr, P: tl.constexpr,
               CHUNK: tl.constexpr, DQ: tl.constexpr, DK: tl.constexpr, PH: tl.constexpr,
               PER_HEAD: tl.constexpr, NS: tl.constexpr):
    """One of the backward's three passes over a chunk, launched in turn (a flag each):

    * ``CHUNK`` (``PER_HEAD``: grid (nc, b*h), one head a program): everything but dq and dk: dx, dz, the
      weights' and log-decay's per-token gradients, the partials of dD and d mimo_*; the head dim in a loop over
      ``PH`` column blocks of >= 16 (``scan.COLUMN_BLOCKS``); it hands dL/d(q~.k~) and dy to the next two (dq
      forming dy again from dout and z instead, r38: the per-head pass 7.53 -> 7.30 ms, dq 2.79 -> 4.43);
    * ``DQ`` / ``DK`` (grid (nc*NS, b*g), a loop over the group's heads): dq / dk summed over the heads in fp32
      registers, un-rotated, with their bias partials and their share of d phase (``DK`` adds to ``DQ``'s),
      from the hand-off (``hq_ptr``: dL/d(q~.k~), ``hy_ptr``: dy, both as the per-head pass's dots took them);
      each program a window of n/(2 NS) columns of each half of n.

    Passes that share a launch kept more tiles live and spilled KBs of registers (and the all-in-one launch
    faulted on the H200), hence one a launch. dq and dk in one launch, reading the hand-off once (r36-r37, H200,
    NAM56R's b2): 10.1 ms against 6.2 for the two, and wrong (1.33) or faulting at 3 of 8 configs checked.

    Register diet (ptxas showed 255 registers and KBs of spills when everything stayed live): the rotated q, k
    are kept in q's dtype only; dL/dM = dy v^T is formed first so the score tiles die early; rows,
    projections and S tiles are loaded (computed) again where used late; d phi comes from the un-rotated
    (x + bias), reloaded, and the un-rotated gradient u: d_hi x~_lo - d_lo x~_hi = u_hi (x+b)_lo - u_lo (x+b)_hi.
    """
    tl.static_assert((CHUNK + DQ + DK == 1) and (PER_HEAD == CHUNK) and (NS == 1 or not CHUNK),
                     "one pass a launch: CHUNK per head (NS 1), or DQ, or DK over the group's heads")
    if PER_HEAD:  # grid (nc, b*h): one chunk of one head
        b = tl.program_id(1) // H
        h = tl.program_id(1) % H
        g = h // HPG
        args = (b, h, q_ptr, k_ptr, qb_ptr, kb_ptr, rot_ptr, x_ptr, z_ptr, do_ptr, mx_ptr, mz_ptr, mo_ptr, d_ptr,
                cs_ptr, gam_ptr, c_ptr, s_ptr, ds_ptr, dx_ptr, dz_ptr, dgam_ptr, dc_ptr, dcs_ptr, dmx_ptr, dmz_ptr,
                dmo_ptr, dd_ptr, hq_ptr, hy_ptr, L, H, R, S, NC, b * q_sb + g * q_sg, q_sl, q_sr,
                b * k_sb + g * k_sg, k_sl, k_sr, b * x_sb + h * x_sh, x_sl, b * z_sb + h * z_sh, z_sl,
                b * do_sb + h * do_sh, do_sl)
        _head_pass(tl.program_id(0), *args, T, RP, HALF, P, PH)
        return
    NW: tl.constexpr = HALF // NS  # dq / dk: this program's window of each half of n
    # grid (nc*NS, b*g), the group's heads in turn; a chunk's NS windows are adjacent programs, so they
    c = tl.program_id(0) // NS  # run together and all but the first read the hand-off from L2
    b = tl.program_id(1) // G
    g = tl.program_id(1) % G
    h0 = g * HPG
    col0 = (tl.program_id(0) % NS) * NW
    LP = NC * T
    DT = q_ptr.dtype.element_ty
    pcols = tl.arange(0, P)
    ncols = col0 + tl.arange(0, NW)
    tok, rank, valid = _rows(c, L, R, T, RP)
    toks = c * T + tl.arange(0, T)
    ranks = tl.arange(0, RP)
    rmask = (ranks < R)[:, None]
    tmask = (toks < L)[:, None]
    pmask = tmask & (ncols < S)[None, :]
    q_base = b * q_sb + g * q_sg
    k_base = b * k_sb + g * k_sg
    dq_lo = tl.zeros((T * RP, NW), tl.float32)
    dq_hi = tl.zeros((T * RP, NW), tl.float32)
    dk_lo = tl.zeros((T * RP, NW), tl.float32)
    dk_hi = tl.zeros((T * RP, NW), tl.float32)
    # GO (in windows, NS > 1): q and k are the group's, the same for each of its heads: loaded once, as stored (the
    # heads differ in their biases and phases), and the next head's phase table and log-decays are loaded (its
    # bias lines prefetched into L1, _prefetch_biases) while this head computes. r42 (H200, NAM56R's b2), 4 warps
    # 2 stages in 2 windows: dq 3.11 -> 2.77 ms, dk 3.52 -> 2.94; unwindowed (4 warps 1 stage) the held tiles
    # spill (584 -> 832 B for dq), dq 2.87 -> 3.37, so NS 1 loads them per head as before
    GO: tl.constexpr = NS > 1
    rot_sl = H * 2 * S
    if GO:
        q_lo, q_hi = _raw_rows(q_ptr, tok, rank, valid, q_base, q_sl, q_sr, col0, HALF, NW)
        k_lo, k_hi = _raw_rows(k_ptr, tok, rank, valid, k_base, k_sl, k_sr, col0, HALF, NW)
        cos_t, sin_t = _cos_sin_table(rot_ptr, c, L, (b * L * H + h0) * 2 * S, rot_sl, S, col0, T, NW)
        cs = tl.load(cs_ptr + (b * H + h0) * LP + tok)
        cc = tl.load(c_ptr + (b * H + h0) * LP + tok)
        _prefetch_biases(qb_ptr, kb_ptr, h0, R, col0, HALF, RP)
    for j in range(HPG):
        h = h0 + j
        bh = b * H + h
        ph_base = (b * L * H + h) * S  # d phase [b, l, h, s]
        rot_base = 2 * ph_base  # the cos / sin table [b, l, h, 2s]
        x_base = b * x_sb + h * x_sh
        qb_base = h * R * 2 * HALF
        if GO:
            cs_end = tl.load(cs_ptr + bh * LP + c * T + T - 1)
            ecs, to_end, inter = _decays(cs, cs_end, cc)
            st = ((bh * NC + c) * P + pcols[:, None]) * (2 * HALF) + ncols[None, :]  # [p, NW] windows of the halves
            cos, sin = _over_ranks(cos_t, sin_t, T, RP, NW)
            nxt = b * H + tl.minimum(h + 1, h0 + HPG - 1)  # the last head loads its own again
            cos_t, sin_t = _cos_sin_table(rot_ptr, c, L, 2 * (nxt - b * H + b * L * H) * S, rot_sl, S, col0, T, NW)
            cs = tl.load(cs_ptr + nxt * LP + tok)
            cc = tl.load(c_ptr + nxt * LP + tok)
            _prefetch_biases(qb_ptr, kb_ptr, nxt - b * H, R, col0, HALF, RP)
        else:
            cs = tl.load(cs_ptr + bh * LP + tok)
            cs_end = tl.load(cs_ptr + bh * LP + c * T + T - 1)
            cc = tl.load(c_ptr + bh * LP + tok)
            ecs, to_end, inter = _decays(cs, cs_end, cc)
            st = ((bh * NC + c) * P + pcols[:, None]) * (2 * HALF) + ncols[None, :]
            cos, sin = _cos_sin(rot_ptr, c, L, rot_base, rot_sl, S, col0, T, RP, NW)
        rows = tl.arange(0, T * RP)
        hand = (bh * NC + c) * (T * RP) + rows  # this (chunk, head)'s rows of the hand-off buffers

        # dq~ = dqk k~ + exp(cs_t) dy S_in; dk~ = dqk^T q~ + exp(cs_end - cs_u) c_u v dS_out; u = R^T d
        bpart = (((b * NC + c) * H + h) * R + ranks[:, None]) * (2 * HALF) + ncols[None, :]
        dph = dph_ptr + ph_base + toks[:, None] * (H * S) + ncols[None, :]
        dphi = tl.zeros((T * RP, NW), tl.float32)
        if DQ:
            if GO:
                klo, khi = _rotate(*_plus_bias(k_lo, k_hi, kb_ptr, rank, valid, qb_base, col0, HALF, NW), cos, sin)
            else:
                klo, khi = _rotated(k_ptr, kb_ptr, tok, rank, valid, k_base, k_sl, k_sr, qb_base, cos, sin, col0,
                                    HALF, NW)
            dqk = tl.load(hq_ptr + hand[:, None] * (T * RP) + rows[None, :])
            dyd = tl.load(hy_ptr + hand[:, None] * P + pcols[None, :])
            d_lo = tl.dot(dqk, klo.to(DT)) + ecs[:, None] * tl.dot(dyd, tl.load(s_ptr + st).to(DT))
            d_hi = tl.dot(dqk, khi.to(DT)) + ecs[:, None] * tl.dot(dyd, tl.load(s_ptr + st + HALF).to(DT))
            u_lo = d_lo * cos + d_hi * sin
            u_hi = d_hi * cos - d_lo * sin
            dq_lo += u_lo
            dq_hi += u_hi
            _bias_partials(dqb_ptr + bpart, u_lo, u_hi, rmask, T, RP, NW, HALF)
            if GO:
                rlo, rhi = _plus_bias(q_lo, q_hi, qb_ptr, rank, valid, qb_base, col0, HALF, NW)
            else:
                rlo, rhi = _raw(q_ptr, qb_ptr, tok, rank, valid, q_base, q_sl, q_sr, qb_base, col0, HALF, NW)
            dphi += u_hi * rlo - u_lo * rhi
        if DK:
            if GO:
                qlo, qhi = _rotate(*_plus_bias(q_lo, q_hi, qb_ptr, rank, valid, qb_base, col0, HALF, NW), cos, sin)
            else:
                qlo, qhi = _rotated(q_ptr, qb_ptr, tok, rank, valid, q_base, q_sl, q_sr, qb_base, cos, sin, col0,
                                    HALF, NW)
            dqkt = tl.load(hq_ptr + hand[None, :] * (T * RP) + rows[:, None])  # dL/d(q~.k~), transposed
            vd = (_load_rows(x_ptr, x_base, tok, x_sl, valid, pcols)
                  * _load_proj(mx_ptr, h, rank, valid, R, P, pcols)).to(DT)
            d_lo = tl.dot(dqkt, qlo.to(DT)) + inter * tl.dot(vd, tl.load(ds_ptr + st).to(DT))
            d_hi = tl.dot(dqkt, qhi.to(DT)) + inter * tl.dot(vd, tl.load(ds_ptr + st + HALF).to(DT))
            u_lo = d_lo * cos + d_hi * sin
            u_hi = d_hi * cos - d_lo * sin
            dk_lo += u_lo
            dk_hi += u_hi
            _bias_partials(dkb_ptr + bpart, u_lo, u_hi, rmask, T, RP, NW, HALF)
            if GO:
                rlo, rhi = _plus_bias(k_lo, k_hi, kb_ptr, rank, valid, qb_base, col0, HALF, NW)
            else:
                rlo, rhi = _raw(k_ptr, kb_ptr, tok, rank, valid, k_base, k_sl, k_sr, qb_base, col0, HALF, NW)
            dphi += u_hi * rlo - u_lo * rhi
        if DQ or DK:
            dphi_t = tl.sum(tl.reshape(dphi, (T, RP, NW)), axis=1)
            if DK:
                dphi_t += tl.load(dph, mask=pmask, other=0.0)
            tl.store(dph, dphi_t, mask=pmask)
    out = ((b * L + tok[:, None]) * R + rank[:, None]) * (G * 2 * HALF) + g * 2 * HALF + ncols[None, :]
    m = valid[:, None]
    if DQ:
        tl.store(dq_ptr + out, dq_lo.to(dq_ptr.dtype.element_ty), mask=m)
        tl.store(dq_ptr + out + HALF, dq_hi.to(dq_ptr.dtype.element_ty), mask=m)
    if DK:
        tl.store(dk_ptr + out, dk_lo.to(dk_ptr.dtype.element_ty), mask=m)
        tl.store(dk_ptr + out + HALF, dk_hi.to(dk_ptr.dtype.element_ty), mask=m)


@triton.jit
def _tanh(x):
    """tanh from exp (overflow-safe both ways: exp -> inf gives 1, exp -> 0 gives -1)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def phase_kernel(ang_ptr, dt_ptr, adt_ptr, rot_ptr, cs_ptr, L, LP, H, S, a_sb, a_sl, a_sh, a_ss, dt_sb, dt_sh,
                 dt_sl, ad_sb, ad_sh, ad_sl, BT: tl.constexpr, SP: tl.constexpr, T: tl.constexpr):
    """Grid (b*h,), walking the sequence in blocks of ``BT`` tokens (a multiple of the tile ``T``):

    * the rotary phase phi_t = (sum_{i<=t} pi tanh(angle_i) dt_i) mod 2 pi, the running sum in fp32 (the mod is
      taken of the full sum, as the reference takes it), written as its cos and sin, fp32 ``[b, l, h, 2s]`` (cos
      in columns [0, s), sin in [s, 2s)), so that the kernels rotating q and k read them instead of evaluating cos
      and sin per (token, rank) row: libdevice's cosf / sinf carry a branch to a slow argument reduction for every
      element, and were a large part of each kernel's code (ncu, 2026-11-29: instruction-cache stalls were 18-32%
      of the samples);
    * the log-decay within each tile, cs_t = sum of adt over the tile's tokens up to t, fp32 ``[b*h, LP]`` (``LP``
      the sequence padded to whole tiles; adt 0 past ``L``). A torch cumsum over 16-token rows took 0.38 ms at
      NAM56R's b2 (r46), twice a step."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    cols = tl.arange(0, SP)
    cmask = cols < S
    carry = tl.zeros((SP,), tl.float32)
    for t0 in range(0, LP, BT):
        toks = t0 + tl.arange(0, BT)
        tmask = toks < L
        adt = tl.load(adt_ptr + b * ad_sb + h * ad_sh + toks * ad_sl, mask=tmask, other=0.0).to(tl.float32)
        cs = tl.reshape(tl.cumsum(tl.reshape(adt, (BT // T, T)), axis=1), (BT,))
        tl.store(cs_ptr + bh * LP + toks, cs, mask=toks < LP)
        m = tmask[:, None] & cmask[None, :]
        a = tl.load(ang_ptr + b * a_sb + toks[:, None] * a_sl + h * a_sh + cols[None, :] * a_ss, mask=m, other=0.0)
        dt = tl.load(dt_ptr + b * dt_sb + h * dt_sh + toks * dt_sl, mask=tmask, other=0.0)
        nt = tl.minimum(toks + BT, L - 1)
        _prefetch_rows(adt_ptr, b * ad_sb + h * ad_sh + nt * ad_sl, 1, 1)
        _prefetch_rows(dt_ptr, b * dt_sb + h * dt_sh + nt * dt_sl, 1, 1)
        _prefetch_rows(ang_ptr, b * a_sb + nt * a_sl + h * a_sh, (S - 1) * a_ss + 1, SP)
        rate = 3.141592653589793 * _tanh(a.to(tl.float32)) * dt.to(tl.float32)[:, None]
        cos, sin = _cos_sin_mod(carry[None, :] + tl.cumsum(rate, axis=0))
        rot = rot_ptr + ((b * L + toks[:, None]) * H + h) * (2 * S) + cols[None, :]
        tl.store(rot, cos, mask=m)
        tl.store(rot + S, sin, mask=m)
        carry += tl.sum(rate, axis=0)


@triton.jit
def time_grads_kernel(dph_ptr, dcs_ptr, ang_ptr, dt_ptr, dang_ptr, ddt_ptr, dadt_ptr, L, LP, H, S,
                      a_sb, a_sl, a_sh, a_ss, dt_sb, dt_sh, dt_sl,
                      BT: tl.constexpr, SP: tl.constexpr, CUMULATIVE: tl.constexpr):
    """Grid (b*h,), the sequence in blocks of ``BT`` tokens from the end, running sums in fp32:

    * d adt_i = sum_{t>=i} dLambda_t (``dcs`` ``[b*h, LP]``: adt_i is in the log-decay of every later token);
    * d rate_i = sum_{t>=i} d phi_t (``dph`` ``[b, l, h, s]``), then, as rate = pi tanh(angle) dt:
      d angles ``[b, l, h, s]`` = d rate pi (1 - tanh^2) dt and the phase's share of d dt ``[b*h, l]``,
      sum_s d rate pi tanh.

    ``CUMULATIVE`` False drops both reverse sums (how the CPU tests show the parity check catches a wrong
    d adt and d angles)."""
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    cols = tl.arange(0, SP)
    cmask = cols < S
    carry = tl.zeros((SP,), tl.float32)
    carry_a = tl.zeros((1,), tl.float32)
    nblocks = tl.cdiv(L, BT)
    for i in range(nblocks):
        toks = (nblocks - 1 - i) * BT + tl.arange(0, BT)
        tmask = toks < L
        m = tmask[:, None] & cmask[None, :]
        dlam = tl.load(dcs_ptr + bh * LP + toks, mask=tmask, other=0.0)
        ph_off = ((b * L + toks[:, None]) * H + h) * S + cols[None, :]
        dph = tl.load(dph_ptr + ph_off, mask=m, other=0.0)
        pt = tl.maximum(toks - BT, 0)
        _prefetch_rows(dcs_ptr, bh * LP + pt, 1, 1)
        _prefetch_rows(dph_ptr, ((b * L + pt) * H + h) * S, S, SP)
        _prefetch_rows(ang_ptr, b * a_sb + pt * a_sl + h * a_sh, (S - 1) * a_ss + 1, SP)
        _prefetch_rows(dt_ptr, b * dt_sb + h * dt_sh + pt * dt_sl, 1, 1)
        if CUMULATIVE:
            dadt = carry_a + tl.cumsum(dlam, axis=0, reverse=True)
            drate = carry[None, :] + tl.cumsum(dph, axis=0, reverse=True)
            carry_a += tl.sum(dlam, axis=0)
            carry += tl.sum(dph, axis=0)
        else:
            dadt = dlam
            drate = dph
        tl.store(dadt_ptr + bh * L + toks, dadt, mask=tmask)
        a = tl.load(ang_ptr + b * a_sb + toks[:, None] * a_sl + h * a_sh + cols[None, :] * a_ss, mask=m, other=0.0)
        th = _tanh(a.to(tl.float32))
        dt = tl.load(dt_ptr + b * dt_sb + h * dt_sh + toks * dt_sl, mask=tmask, other=0.0).to(tl.float32)
        tl.store(dang_ptr + ph_off, drate * (3.141592653589793 * (1.0 - th * th)) * dt[:, None], mask=m)
        tl.store(ddt_ptr + bh * L + toks, tl.sum(drate * (3.141592653589793 * th), axis=1), mask=tmask)


# --- launch configurations: a few per kernel, timed on the GPU at the first launch of each shape ----------------
def _config(warps: int, stages: int = 1, maxnreg: int | None = None, **meta) -> triton.Config:
    """``maxnreg``: a cap on the registers a thread (ptxas spills above it), so more blocks fit an SM."""
    return triton.Config(meta, num_warps=warps, num_stages=stages, maxnreg=maxnreg)


CONFIGS = {
    # the walks loop over chunks: 2 stages prefetch the next chunk's rows; PSPLIT 2 (4) doubles (quadruples) the
    # programs (b*h*2 = 512 at NAM56R's b2) at the price of rotating k (q) in each. r30 (H200, NAM56R's b2): state
    # walk 1.92 ms at 4 warps PSPLIT 1 (1.95 at 8 warps, 2.62 at PSPLIT 2); dstate walk 2.71 at 8 warps PSPLIT 1
    # (2.80 at 4 warps PSPLIT 2). A walk has one program per (b, h): 256 at b2, so a walk runs in one wave only
    # if two programs fit an SM (shared memory <= ~113 KB, registers <= 255 a thread at 4 warps); with the
    # cos / sin table read per token (r32) PSPLIT 1 at 2 stages took 99 KB (123 KB in r30 and again since r52, the
    # table read per row: one program an SM; the 1-stage config, 16 KB, is the one taken).
    # r50: PSPLIT 2 capped at 128 registers (four programs an SM, b2's 512 in one wave; 324 / 444 B of spills)
    # took 2.00 ms (state walk) and 2.74 (dstate walk) against 1.07 / 1.36 at PSPLIT 1
    "state_walk": [_config(4, 2, PSPLIT=1), _config(4, 2, PSPLIT=2), _config(4, 1, PSPLIT=1)],
    "dstate_walk": [_config(4, 1, PSPLIT=1), _config(8, 2, PSPLIT=1)],
    # fwd_chunk one chunk a program, n whole. Slower, measured (H200, NAM56R's b2): 2 / 4 chunks a program in a
    # loop with 2 stages, 5.49 / 4.98 ms against 2.22 (r49: 189 KB of shared memory, one program an SM); q~ k~^T
    # and q~ S_in^T summed over 4 windows of 16 columns, those past the angles not rotated, 3.76 ms (3.07 capped
    # at 168 registers: three programs an SM) against 2.40 for the same code in one window (r51)
    # r52: with the cos / sin table read per row (_cos_sin), 1.97 ms at 4 warps capped at 168 registers (64 B of
    # spills, three programs an SM) against 2.33 uncapped and 3.80 at 8 warps
    "fwd_chunk": [_config(4, 1, 168), _config(4)],
    # one program per chunk and head (the per-head pass, a loop over column blocks) or per chunk and group (dq, dk:
    # a loop over heads). Registers are near 255 a thread at 4 and 8 warps: two blocks of 4 warps (one of 8) fit an
    # SM. 2 stages prefetch the next column block (head). Which pass may take which config: _fits. r32 (H200,
    # NAM56R's b2, the tuner's timings): per head 7.66 ms at 4 warps with 2 stages (9.23 at 1 stage; 18.3 / 26.4 /
    # 13.9 at 8 / 16 / 8 with 2 stages); dq 2.90 at 4 warps (3.74 / 4.51 / 3.81); dk 3.98 at 8 with 2 stages
    # (4.22 / 4.65 / 5.01 at 4 / 8 / 16)
    # NS: dq / dk in NS programs a chunk and group, each a window of n/(2 NS) columns of each half (fewer registers
    # a program); the per-head pass takes NS 1. r33 (H200, NAM56R's b2): dk 3.63 ms at NS 2, 4 warps, 2 stages
    # (4.02 at its best NS 1; 5.40 at NS 4), 3.52 with a chunk's windows adjacent (r36); dq 3.06 at NS 2 against
    # 2.96 at NS 1. NS 2 and 4 at 4 warps, 2 stages matched the reference at 16- and 32-token tiles
    # (gpu/mimo_fault.py, r33 and r35). A cap on registers (_config's maxnreg) was slower for every pass in r35;
    # r54 (the per-head pass at 4 column blocks since r43): the per-head pass at 4 warps, 2 stages capped at 168
    # registers (132 B of spills, 75 KB of shared memory: three programs an SM) 5.15 ms against 5.85 uncapped; dq
    # / dk capped slower (NS 2 at 168: 2.89 / 4.27 against 2.80 / 2.94; NS 4 at 128: 2.93 / 4.55; at 168: 3.12 /
    # 3.98), and at 8 warps NS 2 (r55: capped at 128 3.39 / 3.80, uncapped 4.46 / 4.46)
    # r62 / r64: dq at NS 2 with 3 stages (110.6 KB of shared memory: still two programs an SM) 2.55 ms against
    # 2.63 at 2 stages in the tuner's timings (the launch 2.42 in r62 against 2.50 in r61; the same bits); dk 3.94 / 2.92
    # (135 KB: one an SM). _fits offers it to dq at 64-row tiles only (at 128 rows it needs 246 KB, over what an
    # SM has); r65: gpu/mimo_fault.py 4 3 --pass DQ --ns 2 --block-t 16 within the bf16 bounds, memcheck clean
    "bwd": [_config(4, NS=1), _config(8, NS=1), _config(16, NS=1), _config(8, 2, NS=1), _config(4, 2, NS=1),
            _config(4, 2, 168, NS=1), _config(4, 2, NS=2), _config(4, 3, NS=2)],
}
"""Under ``TRITON_INTERPRET=1`` each launch takes the first config ``_fits`` leaves it (nothing to time there)."""


PER_HEAD_CONFIGS = {(4, 2, None), (4, 2, 168), (16, 1, None)}
"""(warps, stages, maxnreg) the per-head ``bwd`` pass may take: those it has been measured correct at, on an
H200, at both 16- and 32-token tiles ((4, 2, 168): r55, ``gpu/mimo_fault.py 4 2 --maxnreg 168``, and the same
bits as uncapped). At 8 warps with 1 stage it returned non-finite gradients (dx, dz, d adt, d mimo_*) at 32-token
tiles (r31's parity test, where the tuner chose it; r32 ``gpu/mimo_fault.py 8 1``); 4 warps with 1 stage was
checked at 16-token tiles, and at 32 only capped at 168 registers (r35, both right; 1 stage is slower: 9.23 ms
against 7.66 in r32), but today's build of it reads shared or local memory out of range at 16-token tiles (r63,
Compute Sanitizer's memcheck at b1, l=1000: ``_head_cols``' S_in load); when that began is not known. (16, 1)
under memcheck at 16-token tiles (r66, an H100): within the bf16 bounds, 0 errors."""


def _bwd_may_take(config, per_head: bool, half: int, dq: bool, rows: int) -> bool:
    """Whether a ``bwd`` pass may take this config (``_fits``): the per-head pass only ``PER_HEAD_CONFIGS``,
    whole (NS 1); dq / dk any but r30's 4 warps with 2 stages unwindowed, in windows of >= 16 columns; 3 stages
    only dq, at tiles of <= 64 (token, rank) rows (``rows``), where it was measured and fits."""
    ns = config.kwargs.get("NS", 1)
    if per_head:
        return (config.num_warps, config.num_stages, config.maxnreg) in PER_HEAD_CONFIGS and ns == 1
    if config.num_stages > 2 and not (dq and rows <= 64):
        return False
    return (config.num_warps, config.num_stages, ns) != (4, 2, 1) and half // ns >= 16


def _fits(configs, nargs, **kwargs):
    """A split of the head dim, or a window of n's halves, under 16 columns cannot feed ``tl.dot``. The per-head
    ``bwd`` pass only at ``PER_HEAD_CONFIGS``, whole (NS 1); dq and dk not at 4 warps with 2 stages unwindowed:
    r30 (H200), the one round that offered them that (178 B of spills, 214 KB of shared memory, 8.4 ms for dk
    against 5.05 at 1 stage), faulted with an illegal address while the tuner timed ``bwd`` at 32-token tiles."""
    fit = [c for c in configs if kwargs["P"] // c.kwargs.get("PSPLIT", 1) >= 16]
    if "CHUNK" in kwargs:  # the bwd kernel
        fit = [c for c in fit if _bwd_may_take(c, kwargs["CHUNK"], kwargs["HALF"], kwargs["DQ"],
                                               kwargs["T"] * kwargs["RP"])]
    fit = fit or [c for c in configs if c.kwargs.get("PSPLIT", 1) == 1 and c.kwargs.get("NS", 1) == 1][:1]
    return fit[:1] if os.environ.get("TRITON_INTERPRET") == "1" else fit  # the interpreter: nothing to time


RESTORE = {"bwd": ["dph_ptr"]}
"""Outputs a kernel reads before it writes (the dk pass adds its share of d phase to the dq pass's): the
autotuner restores them after each timed run, or the timing runs would add up in them (the GPU round's first
calls had d angles and d dt wrong by 1e2-1e3x exactly so, 2026-11-25)."""


def _tuned(name: str, kernel):
    # the shape and pass arguments this kernel has (Triton >= 3.9 refuses a key naming an argument it lacks)
    key = [k for k in ("H", "HPG", "P", "HALF", "RP", "T", "CHUNK", "DQ", "DK", "PER_HEAD") if k in kernel.arg_names]
    return triton.autotune(CONFIGS[name], key=key,
                           prune_configs_by={"early_config_prune": _fits},
                           restore_value=RESTORE.get(name, []))(kernel)


KERNELS = {name: _tuned(name, kernel) for name, kernel in (
    ("state_walk", state_walk_kernel), ("dstate_walk", dstate_walk_kernel), ("fwd_chunk", fwd_chunk_kernel),
    ("bwd", bwd_kernel))}
"""The kernels as launched (each wrapped in ``triton.autotune`` over ``CONFIGS[name]``)."""
