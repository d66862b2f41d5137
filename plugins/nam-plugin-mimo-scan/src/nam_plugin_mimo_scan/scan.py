"""nam's Mamba-3 MIMO scan: the ``SSMScan`` backend ``mimo-scan`` (a ``torch.autograd.Function``).

The math is ``nam56r/reference/mamba3.py``'s (kernels-and-math.md section 1.2); the kernels are in kernels.py.
Chunk-parallel, as Mamba-2's SSD, where the work is parallel; walks along the sequence where it is a recurrence::

    both      phase         grid (b*h)              the rotary phase, a cumulative sum over time (mod 2 pi), as cos,
                                                    sin; the log-decay's cumulative sum within each tile
    forward   state_walk    grid (b*h, split)       chunks in order: S_in[c] [b*h, nc, p, n] in q's dtype, fp32 carry
              fwd_chunk     grid (nc, b*h)          intra-chunk + S_in's contribution, gate, rank sum -> out
    backward  phase, state_walk  again, unless the forward kept S_in and the phase table (``keep_states``: by
                                                    default inside nam's activation checkpoint, whose replay
                                                    rebuilds them right before the backward)
              dstate_walk   grid (b*h, split)       chunks in reverse: dS_out[c] = dL/dS_in[c+1]
              bwd (CHUNK)   grid (nc, b*h)          dx, dz, per-token d gamma / d c / d Lambda, partials of dD,
                                                    d mimo_*; hands dL/d(q~.k~) and dy on (1.07 GB at NAM56R's b2)
              bwd (DQ, DK)  grid (nc*NS, b*g) x 2  dq, then dk, summed over the group's heads in registers; d phase
              time_grads    grid (b*h)              reverse sums over time: d adt, d angles, the phase's d dt

Cheap [b, h, l] work is torch: sigmoid and the trapezoid weights, the chain rule through sigmoid, the sums of
per-chunk partials. ``d adt`` uses d Lambda_t = sum_r dy_tr.y_tr -
sum_r v_tr.dv_tr (row minus column sums of dA*A over the whole causal matrix; the diagonal cancels), so no
kernel needs a segment-sum of its own.

The kernels' tile is ``tile_tokens(r)`` tokens (16 at rank 4: 64 (token, rank) rows per tile), whatever the
model's ``chunk_size`` (the chunking is exact for any tile, so ``chunk_size`` does not change the result).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nam56r.recompute import inside_checkpointed

TILE_ROWS = 64
"""(token, rank) rows per tile: 16 tokens at rank 4. On the H100, 128-row tiles (32 tokens) ran 3x slower
(fp32 [128, 128] score tiles and [128, 64] row tiles spill registers)."""
SHARED_BYTES: dict[str, int] = {}
"""Shared memory per block (``.metadata.shared``) of each kernel as compiled by its last launch on a GPU."""
PASSES = ((True, False, False), (False, True, False), (False, False, True))
"""The backward's ``bwd`` launches, (CHUNK, DQ, DK) in order: the per-head gradients, dq, dk (which adds to
dq's d phase)."""
COLUMN_BLOCKS = 4
"""Column blocks of the head dim in the per-head backward pass (``bwd`` ``PH``, a loop, each block >= 16
columns). Triton 3.6 for sm_90, headdim 64, 4 warps with 2 stages (the pass's faster config; 2026-11-29): spills
2,120 / 236 / 20 B a thread at 1 / 2 / 4 blocks. ``gpu/mimo_kernels.py --ph`` times others."""
CHOSEN: dict[str, str] = {}
"""The launch config (``kernels.CONFIGS``) the autotuner picked for each kernel's last launch."""


def tile_tokens(rank: int) -> int:
    """Tokens per tile at this rank: ``TILE_ROWS`` rows, at least 8 tokens."""
    return max(8, TILE_ROWS // _pow2(rank))


def _pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def _tiling(l: int, r: int, block_t: int | None) -> tuple[int, int]:
    """Tokens per tile and tiles (chunks) for a sequence of ``l`` tokens at rank ``r``."""
    t = block_t or tile_tokens(r)
    return t, -(-l // t)


def _lastdim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(name, grid, *args, **meta):
    from nam_plugin_mimo_scan.kernels import KERNELS

    kernel = KERNELS[name]
    compiled = kernel[grid](*args, **meta)
    shared = getattr(getattr(compiled, "metadata", None), "shared", None)
    if isinstance(shared, int):
        SHARED_BYTES[name] = shared
    CHOSEN[name] = str(kernel.best_config)
    return compiled


class _Geometry:
    """Shapes and the torch-side coefficients both passes need."""

    def __init__(self, q, v, adt, dt, trap, angles, block_t, phase=None):
        self.b, self.l, self.r, self.g, self.n = q.shape
        self.h, self.p = v.shape[2], v.shape[3]
        self.s = angles.shape[-1]
        self.rp = _pow2(self.r)
        self.t, self.nc = _tiling(self.l, self.r, block_t)
        pad = self.nc * self.t - self.l
        dt = dt.float()
        self.lam = torch.sigmoid(trap.float())  # [b, h, l]
        gamma = self.lam * dt
        shifted = F.pad((1 - self.lam[..., 1:]) * dt[..., 1:], (0, 1))
        self.gamma = F.pad(gamma, (0, pad)).contiguous()  # [b, h, nc*T]
        self.c = F.pad(gamma + shifted, (0, pad)).contiguous()
        # cos, sin of the phase [b, l, h, 2s]; the log-decay's cumsum within each tile [b, h, nc*T] (``phase``:
        # the forward's, kept with its states)
        self.rot, self.cs = phase or _phase_and_decay(angles, dt, adt, self.t, self.nc)

    def meta(self):
        return dict(T=self.t, RP=self.rp, HALF=self.n // 2, P=self.p)

    def grid_walk(self, meta):
        return (self.b * self.h, meta["PSPLIT"])

    def states(self, q, k, q_bias, k_bias, v, mimo_x):
        """``S_in`` [b*h, nc, p, n] in q's dtype: one walk over the chunks per (b, h) (and head-dim split), the
        carry in fp32 registers."""
        s_in = torch.empty(self.b * self.h, self.nc, self.p, self.n, device=q.device, dtype=q.dtype)
        _launch("state_walk", self.grid_walk, k, k_bias, self.rot, v, mimo_x, self.cs, self.c, s_in,
                self.l, self.h, self.h // self.g, self.r, self.s, self.nc,
                *k.stride()[:4], *v.stride()[:3], **self.meta())
        return s_in


class _MimoScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o, block_t,
                keep_states, output_used):
        q, k, v, z = (_lastdim_contiguous(t) for t in (q, k, v, z))
        params = [t.float().contiguous() for t in (q_bias, k_bias, d, mimo_x, mimo_z, mimo_o)]
        qb, kb, dd, mx, mz, mo = params
        out = torch.empty_like(v, memory_format=torch.contiguous_format)  # [b, l, h, p]
        ctx.kept = inside_checkpointed() if keep_states is None else keep_states
        kept = []
        if output_used or ctx.kept:  # else (a replay whose backward walks again) no kernel at all
            geo = _Geometry(q, v, adt, dt, trap, angles, block_t)
            s_in = geo.states(q, k, qb, kb, v, mx)
            kept = [s_in, geo.rot, geo.cs] if ctx.kept else []
        if output_used:
            common = (geo.l, geo.h, geo.h // geo.g, geo.r, geo.s, geo.nc, *q.stride()[:4], *k.stride()[:4],
                      *v.stride()[:3], *z.stride()[:3], *out.stride()[:3])
            _launch("fwd_chunk", (geo.nc, geo.b * geo.h), q, k, qb, kb, geo.rot, v, z, mx, mz, mo, dd, geo.cs,
                    geo.gamma, geo.c, s_in, out, *common, **geo.meta())
        ctx.save_for_backward(q, k, v, adt, dt, trap, angles, z, *params, *kept)
        ctx.block_t = block_t
        ctx.dtypes = [t.dtype for t in (q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z,
                                        mimo_o)]
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, adt, dt, trap, angles, z, qb, kb, dd, mx, mz, mo, *kept = ctx.saved_tensors
        dout = _lastdim_contiguous(dout)
        geo = _Geometry(q, v, adt, dt, trap, angles, ctx.block_t, phase=tuple(kept[1:]) if ctx.kept else None)
        b, l, h, p, r, g, n, nc = geo.b, geo.l, geo.h, geo.p, geo.r, geo.g, geo.n, geo.nc
        common = (geo.l, geo.h, geo.h // geo.g, geo.r, geo.s, geo.nc)
        dev, f32 = q.device, torch.float32
        s_in = kept[0] if ctx.kept else geo.states(q, k, qb, kb, v, mx)

        ds_out = torch.empty_like(s_in)
        _launch("dstate_walk", geo.grid_walk, q, qb, geo.rot, z, dout, mz, mo, geo.cs, ds_out, *common,
                *q.stride()[:4], *z.stride()[:3], *dout.stride()[:3], **geo.meta())

        dx = torch.empty(b, l, h, p, device=dev, dtype=v.dtype)
        dz = torch.empty(b, l, h, p, device=dev, dtype=z.dtype)
        dgam, dc, dcs = (torch.empty(b, h, nc * geo.t, device=dev, dtype=f32) for _ in range(3))
        dmx, dmz, dmo = (torch.empty(b, nc, h, r, p, device=dev, dtype=f32) for _ in range(3))
        dd_part = torch.empty(b, nc, h, device=dev, dtype=f32)
        dq = torch.empty(b, l, r, g, n, device=dev, dtype=q.dtype)
        dk = torch.empty(b, l, r, g, n, device=dev, dtype=k.dtype)
        dqb, dkb = (torch.empty(b, nc, h, r, n, device=dev, dtype=f32) for _ in range(2))
        dphase = torch.empty(b, l, h, geo.s, device=dev, dtype=f32)
        # the per-head pass hands dL/d(q~.k~) and dy (in q's dtype, as its dots take them) to the dq and dk passes
        rows = geo.t * geo.rp
        hand_qk = torch.empty(b * h, nc, rows, rows, device=dev, dtype=q.dtype)
        hand_dy = torch.empty(b * h, nc, rows, p, device=dev, dtype=q.dtype)
        inputs = (q, k, qb, kb, geo.rot, v, z, dout, mx, mz, mo)
        strides = (*common, *q.stride()[:4], *k.stride()[:4], *v.stride()[:3], *z.stride()[:3], *dout.stride()[:3])
        bwd_args = (*inputs, dd, geo.cs, geo.gamma, geo.c, s_in, ds_out, dx, dz, dgam, dc, dcs, dmx, dmz, dmo,
                    dd_part, dq, dk, dqb, dkb, dphase, hand_qk, hand_dy, *strides, g)
        for chunk, dq_, dk_ in PASSES:  # the per-head pass: a program per head; dq, dk: per group, summing heads,
            grid = (lambda meta: (nc, b * h)) if chunk else (lambda meta: (nc * meta["NS"], b * g))  # and per window
            _launch("bwd", grid, *bwd_args, **geo.meta(), CHUNK=chunk, DQ=dq_, DK=dk_,  # of n's columns (NS)
                    PH=min(COLUMN_BLOCKS, p // 16), PER_HEAD=chunk)

        # trapezoid weights: gamma_t = lam_t dt_t on the diagonal, c_u = gamma_u + (1 - lam_{u+1}) dt_{u+1} below
        dt32, lam = dt.float(), geo.lam
        dshift = dc[..., :l]
        dgamma = dgam[..., :l] + dshift
        dlam = dgamma * dt32
        dlam[..., 1:] -= dshift[..., :-1] * dt32[..., 1:]
        ddt = dgamma * lam
        ddt[..., 1:] += dshift[..., :-1] * (1 - lam[..., 1:])
        dtrap = dlam * lam * (1 - lam)
        # adt_i is in Lambda_t for every t >= i; the phase phi_t = sum_{i<=t} pi tanh(angle_i) dt_i
        dadt, dangles, ddt_phase = _time_grads(dphase, dcs, angles, dt32)
        ddt = ddt + ddt_phase
        grads = (dq, dk, dx, dadt, ddt, dtrap, dqb.sum((0, 1)), dkb.sum((0, 1)), dangles, dd_part.sum((0, 1)), dz,
                 dmx.sum((0, 1)), dmz.sum((0, 1)), dmo.sum((0, 1)))
        return (*(gr.to(dtype) for gr, dtype in zip(grads, ctx.dtypes)), None, None, None)


TIME_BLOCK = 64
"""Tokens per step of the two walks along the sequence (the phase, and the reverse sums of the backward)."""


def _phase_and_decay(angles: torch.Tensor, dt: torch.Tensor, adt: torch.Tensor, t: int, nc: int, *,
                     block: int | None = None, warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``angle_phase(angles, dt)`` (nam56r.reference.mamba3), fp32 ``[b, l, h, 2s]`` (cos, then
    sin), and the cumulative sum of ``adt`` within each tile of ``t`` tokens, fp32 ``[b, h, nc*t]`` (0 past the
    sequence), in one kernel walking the sequence per (b, h); angles may be a stride-0 view over the heads.
    ``block`` (tokens a step, at least ``t``; ``TIME_BLOCK`` unless given) and ``warps``: for
    ``gpu/phase_sweep.py``."""
    from nam_plugin_mimo_scan.kernels import phase_kernel

    b, l, h, s = angles.shape
    rot = torch.empty(b, l, h, 2 * s, device=angles.device, dtype=torch.float32)
    cs = torch.empty(b, h, nc * t, device=angles.device, dtype=torch.float32)
    phase_kernel[(b * h,)](angles, dt, adt, rot, cs, l, nc * t, h, s, *angles.stride(), *dt.stride(),
                           *adt.stride(), BT=max(block or TIME_BLOCK, t), SP=max(16, _pow2(s)), T=t, num_warps=warps)
    return rot, cs


def _time_grads(dphase, dcs, angles, dt, *, cumulative: bool = True, block: int | None = None, warps: int = 4):
    """The reverse sums along the sequence, in one kernel per (b, h): ``(d adt [b, h, l], d angles [b, l, h, s],
    the phase's share of d dt [b, h, l])``, fp32, from d phi ``[b, l, h, s]`` and d Lambda ``dcs [b, h, nc*T]``.
    ``cumulative=False`` leaves the sums out (the CPU tests' wrong gradient); ``block`` (tokens a step,
    ``TIME_BLOCK`` unless given) and ``warps``: for ``gpu/phase_sweep.py``."""
    from nam_plugin_mimo_scan.kernels import time_grads_kernel

    b, l, h, s = dphase.shape
    dadt = torch.empty(b, h, l, device=dphase.device, dtype=torch.float32)
    ddt = torch.empty_like(dadt)
    dangles = torch.empty_like(dphase)
    time_grads_kernel[(b * h,)](dphase, dcs, angles, dt, dangles, ddt, dadt, l, dcs.shape[-1], h, s,
                                *angles.stride(), *dt.stride(), BT=block or TIME_BLOCK, SP=max(16, _pow2(s)),
                                CUMULATIVE=cumulative, num_warps=warps)
    return dadt, dangles, ddt


def mimo_scan(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o, *,
              block_t: int | None = None, keep_states: bool | None = None, output_used: bool = True) -> torch.Tensor:
    """The MIMO scan, differentiable in every input. Arguments as ``nam56r.backends.SSMScan``; ``block_t``:
    tokens per kernel tile (a power of two; default ``tile_tokens(r)``). Returns ``[b, l, h, p]`` in v's dtype.

    ``keep_states``: whether the forward keeps the chunk states ``S_in`` (q's dtype, ``[b*h, nc, p, n]``: 1 GiB
    at NAM56R's b2) and the phase table (fp32 ``[b, l, h, 2s]``, 0.5 GiB) for the backward, which then skips its
    state walk and phase kernel (the same kernels on the same inputs, so the same bits). None (the default)
    keeps them inside nam's activation checkpoint (``nam56r.recompute.inside_checkpointed``: ``train.recompute``
    ``mamba-scan``, ``mamba``, ``layer`` on the local engine), which drops them after the first pass and
    rebuilds them in its replay, right before the backward that holds them anyway (recomputed or kept): there
    they cost no memory past the backward's own. True keeps them always, at that memory per layer from the
    forward to its backward; False never. ``output_used`` False: the result's values are not read
    (``MimoScan.for_backward_only``), so the forward launches only what it keeps (the phase and the state walk
    when it keeps the states; nothing otherwise)."""
    problem = input_problem(q, v, angles, mimo_x) or index_problem(
        q.shape[0], q.shape[1], v.shape[2], q.shape[2], q.shape[-1], v.shape[3], angles.shape[-1], block_t)
    if problem:
        raise ValueError(f"mimo-scan: {problem}")
    return _MimoScanFn.apply(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o,
                             block_t, keep_states, output_used)


def input_problem(q, v, angles, mimo_x) -> str | None:
    """Why the kernels cannot take these inputs, or None."""
    if mimo_x is None or q.shape[2] < 2:
        return "MIMO only (rank >= 2); for rank 1 use --set ssm_backend=reference or mamba-ssm"
    n, p, s = q.shape[-1], v.shape[-1], angles.shape[-1]
    if n < 32 or n & (n - 1):
        return f"d_state {n} must be a power of two >= 32 (two halves of >= 16 for tl.dot)"
    if p < 16 or p & (p - 1):
        return f"headdim {p} must be a power of two >= 16"
    if 2 * s > n:
        return f"{s} angles rotate {2 * s} > d_state {n} dims"
    return None


INDEX_LIMIT = 2**31 - 1
"""The largest element offset the kernels compute: their offsets are 32-bit integers (64-bit ones would cost
registers in kernels already at 255 a thread)."""


def index_problem(b: int, l: int, h: int, r: int, n: int, p: int, s: int, block_t: int | None = None) -> str | None:
    """Why a buffer of the scan would hold more elements than a 32-bit offset reaches, or None: ``b`` sequences of
    ``l`` tokens, ``h`` heads of ``p``, rank ``r``, d_state ``n``, ``s`` angles. The states (``[b*h, nc, p, n]``:
    2**31 elements at NAM56R's widths, b=8, l=4096) come first. ``mimo_scan`` asks it of every call, the plugin's
    config check of the run's micro-batch."""
    t, nc = _tiling(l, r, block_t)
    rows = t * _pow2(r)
    sizes = {"states [b*h, nc, p, n]": b * h * nc * p * n, "hand-off [b*h, nc, rows, rows]": b * h * nc * rows * rows,
             "hand-off [b*h, nc, rows, p]": b * h * nc * rows * p, "cos / sin [b, l, h, 2s]": b * l * h * 2 * s}
    name, size = max(sizes.items(), key=lambda kv: kv[1])
    if size - 1 <= INDEX_LIMIT:
        return None
    fits = (INDEX_LIMIT + 1) // (size // b)  # sequences a call whose largest offset still fits
    found = f"at b={b}, l={l} the {name} buffer holds {size:,} elements, past the kernels' 32-bit offsets"
    if fits:
        return f"{found}; at this length at most {fits} a call: --set train.micro_batch_size={fits} or lower"
    return f"{found}, even for one sequence: use --set ssm_backend=mamba-ssm at this length"


class MimoScan:
    """``SSMScan`` backend ``mimo-scan``: nam's Triton MIMO kernels (CUDA; any device under TRITON_INTERPRET=1).

    ``chunk_size`` is accepted and ignored: the kernels tile ``tile_tokens(r)`` tokens (16 at rank 4), and the
    chunked math is exact for any tile, so the result does not depend on it. ``keep_states``: ``mimo_scan``'s
    (the host builds it with the default: kept inside nam's activation checkpoint only).
    """

    def __init__(self, keep_states: bool | None = None):
        self.keep_states = keep_states

    def __call__(self, q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o, *,
                 chunk_size: int) -> torch.Tensor:
        return mimo_scan(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o,
                         keep_states=self.keep_states)

    def for_backward_only(self, q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o, *,
                          chunk_size: int) -> torch.Tensor:
        """``nam56r.backends.SSMScan.for_backward_only``: a call whose output values are not read (the replay of
        ``train.recompute=mamba-scan``): the same saved tensors, no ``fwd_chunk``; inside nam's activation
        checkpoint it keeps the states, so the replay runs the phase and the state walk and the backward
        neither."""
        return mimo_scan(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o,
                         keep_states=self.keep_states, output_used=False)


def forward_backward(inputs: dict, dout: torch.Tensor, *, block_t: int | None = None) -> torch.Tensor:
    """One forward and backward (for benchmarks): ``inputs`` by ``SSMScan`` name, leaves with requires_grad
    where a gradient is wanted; returns the output (gradients land in ``.grad``)."""
    out = mimo_scan(*(inputs[k] for k in INPUT_NAMES), block_t=block_t)
    out.backward(dout)
    return out


INPUT_NAMES = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "d", "z", "mimo_x", "mimo_z",
               "mimo_o")
