"""Mamba-3 scan in pure PyTorch: a chunked (SSD) form for training and a step-by-step oracle.

Both compute the exponential-trapezoidal recurrence of kernels-and-math.md section 1.2, one P x N state per
head shared by the R ranks::

    S_t = alpha_t S_{t-1} + beta_t U_{t-1} + gamma_t U_t,     U_t = sum_r v_{t,r} k~_{t,r}^T
    y_{t,r} = S_t q~_{t,r} + D v_{t,r}

with alpha = exp(A dt), beta = (1 - lam) dt alpha, gamma = lam dt, lam = sigmoid(trap), and k~, q~ the
biased B/C rotated by the accumulated phase phi_t = sum_{i<=t} pi tanh(angle_i) dt_i (mod 2 pi).

``mamba3_step_scan`` runs that loop token by token and is the oracle the tests hold everything else to.
``ReferenceSSMScan`` unrolls it instead: U_u reaches S_t (u < t) with weight

    L[t, u] * c_u,      c_u = gamma_u + (1 - lam_{u+1}) dt_{u+1},     L[t, u] = exp(sum_{i=u+1..t} a_i)

(the second term of c_u is the beta that step u+1 gives U_u), and U_t reaches S_t with gamma_t alone. So the
state carried between chunks is S'_T = sum_{u<=T} L[T, u] c_u U_u: every later token sees U_u through the
full c_u. Inside a chunk the weights form a T x T matrix (c_u below the diagonal, gamma_t on it), so no
over-counted diagonal has to be subtracted afterwards as mamba-ssm's chunk refs do.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

TWO_PI = 2 * math.pi


# --- rotation ----------------------------------------------------------------------------------------------


def angle_rate(angles: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """Phase added at each step: pi * tanh(angle) * dt.  angles [b, l, h, s], dt [b, h, l] -> [b, l, h, s]."""
    return math.pi * torch.tanh(angles) * dt.transpose(1, 2).unsqueeze(-1)


def angle_phase(angles: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """Accumulated phase phi_t = cumsum over time of ``angle_rate``, mod 2 pi.  -> [b, l, h, s]

    The mod changes no cos/sin; it keeps the phase small so a long sequence loses no precision in it.
    """
    return torch.remainder(torch.cumsum(angle_rate(angles, dt), dim=1), TWO_PI)


def rotate_adjacent(x: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """SISO convention: rotate pairs (2i, 2i+1) by phi_i for i < s; dims from 2s on pass through.

    x [..., n], phi [..., s] (broadcastable), 2s <= n.  (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos).
    """
    s = phi.shape[-1]
    cos, sin = torch.cos(phi), torch.sin(phi)
    pairs = x[..., : 2 * s].unflatten(-1, (s, 2))  # [..., s, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return torch.cat([rotated, x[..., 2 * s :]], dim=-1)


def rotate_half(x: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """MIMO convention: rotate pairs (i, i + n/2) by phi_i for i < s; the other dims pass through.

    With rope_fraction 0.5 (s = n/4) that is mamba-ssm's TileLang layout: of four blocks of n/4, blocks 0
    and 2 rotate together, 1 and 3 are untouched.  x [..., n], phi [..., s], s <= n/2.
    """
    s, half = phi.shape[-1], x.shape[-1] // 2
    cos, sin = torch.cos(phi), torch.sin(phi)
    x0, x1 = x[..., :s], x[..., half : half + s]
    return torch.cat(
        [x0 * cos - x1 * sin, x[..., s:half], x0 * sin + x1 * cos, x[..., half + s :]], dim=-1
    )


def rotate(x: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """Rotate B or C laid out [..., r, h, n] in the convention its rank implies (protocol: r == 1 is SISO)."""
    return rotate_adjacent(x, phi) if x.shape[-3] == 1 else rotate_half(x, phi)


# --- pieces both scans share ---------------------------------------------------------------------------------


def _promote(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Cast the inputs to their common dtype, at least fp32 (bf16 activations are scanned in fp32)."""
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in tensors if t is not None], torch.float32)
    return [None if t is None else t.to(dtype) for t in tensors]


def _biased_qk(q, k, q_bias, k_bias, heads: int):
    """Expand the g B/C groups to h heads (head h reads group h // (h/g)) and add the per-head biases.

    q, k [b, l, r, g, n]; biases [h, r, n]  ->  [b, l, r, h, n] each, not yet rotated.
    """
    b, l, r, g, n = q.shape

    def per_head(x):
        return x.unsqueeze(4).expand(b, l, r, g, heads // g, n).reshape(b, l, r, heads, n)

    return per_head(q) + q_bias.transpose(0, 1), per_head(k) + k_bias.transpose(0, 1)


def _rank_inputs(v: torch.Tensor, mimo_x: torch.Tensor | None) -> torch.Tensor:
    """v_{t,r} = x_t * mimo_x[h, r]: [b, l, h, p] -> [b, l, r, h, p] (SISO: r = 1, v unchanged)."""
    if mimo_x is None:
        return v.unsqueeze(2)
    return v.unsqueeze(2) * mimo_x.transpose(0, 1)


def _skip_gate_contract(y, v_r, d, z, mimo_z, mimo_o) -> torch.Tensor:
    """Add D v, gate with silu(z mimo_z), sum the ranks with mimo_o: [b, l, r, h, p] -> [b, l, h, p].

    SISO (mimo_* None) reduces to (y + D x) * silu(z), the not-``is_outproj_norm`` form of section 1.2.
    """
    o = y + d.unsqueeze(-1) * v_r  # D [h] broadcast over p
    gate = z.unsqueeze(2) if mimo_z is None else z.unsqueeze(2) * mimo_z.transpose(0, 1)
    o = o * F.silu(gate)
    if mimo_o is None:
        return o.sum(2)
    return torch.einsum("blrhp,hrp->blhp", o, mimo_o)


# --- step-by-step oracle -------------------------------------------------------------------------------------


def mamba3_step_scan(
    q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o, *, chunk_size=None
) -> torch.Tensor:
    """The section 1.2 recurrence one token at a time (``chunk_size`` is ignored). Arguments as ``SSMScan``.

    Slow (a Python loop over l) and plain on purpose: it is the oracle the chunked scan and GPU backends are
    tested against, so it keeps the phase as a running sum and the state as an explicit P x N matrix.
    """
    out_dtype = v.dtype
    q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o = _promote(
        q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o
    )
    b, l, h, p = v.shape
    n = q.shape[-1]

    qb, kb = _biased_qk(q, k, q_bias, k_bias, h)  # [b, l, r, h, n]
    v_r = _rank_inputs(v, mimo_x)  # [b, l, r, h, p]
    rate = angle_rate(angles, dt)  # [b, l, h, s]
    lam = torch.sigmoid(trap)  # [b, h, l]
    per_step = lambda c: c.transpose(1, 2)[..., None, None]  # noqa: E731  [b, h, l] -> [b, l, h, 1, 1]
    alpha = per_step(torch.exp(adt))
    beta = per_step((1 - lam) * dt * torch.exp(adt))
    gamma = per_step(lam * dt)

    state = v.new_zeros(b, h, p, n)  # S_{t-1}
    prev_u = v.new_zeros(b, h, p, n)  # U_{t-1}; U_{-1} = 0
    phi = v.new_zeros(b, h, rate.shape[-1])
    ys = []
    for t in range(l):
        phi = torch.remainder(phi + rate[:, t], TWO_PI)
        q_t = rotate(qb[:, t], phi.unsqueeze(1))  # [b, r, h, n]
        k_t = rotate(kb[:, t], phi.unsqueeze(1))
        u = torch.einsum("brhp,brhn->bhpn", v_r[:, t], k_t)
        state = alpha[:, t] * state + beta[:, t] * prev_u + gamma[:, t] * u
        ys.append(torch.einsum("bhpn,brhn->brhp", state, q_t))
        prev_u = u
    y = torch.stack(ys, dim=1)  # [b, l, r, h, p]
    return _skip_gate_contract(y, v_r, d, z, mimo_z, mimo_o).to(out_dtype)


# --- chunked scan ---------------------------------------------------------------------------------------------


def _chunked_ssd(q, k, v, a, w_diag, w_past, chunk_size: int) -> torch.Tensor:
    """y_{t,r} = sum_{u<=t} L[t,u] w[t,u] sum_{r'} (q_{t,r} . k_{u,r'}) v_{u,r'} for l a multiple of chunk_size.

    q, k [b, h, l, r, n] (rotated); v [b, h, l, r, p]; a, w_diag, w_past [b, h, l] with w[t,t] = w_diag_t and
    w[t,u] = w_past_u for u < t.  Returns [b, h, l, r, p].
    """
    b, h, l, r, n = q.shape
    c, T = l // chunk_size, chunk_size
    q, k, v = (x.unflatten(2, (c, T)) for x in (q, k, v))  # [b, h, c, T, r, *]
    a, w_diag, w_past = (x.unflatten(2, (c, T)) for x in (a, w_diag, w_past))  # [b, h, c, T]

    cs = torch.cumsum(a, dim=-1)  # log-decay from the chunk start, inclusive
    below = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)
    on = torch.eye(T, dtype=torch.bool, device=a.device)
    seg = cs.unsqueeze(-1) - cs.unsqueeze(-2)  # [b, h, c, T, T]: log L[t, u]
    decay = torch.exp(seg.masked_fill(~(below | on), -math.inf))  # masked before exp: no overflow above
    weight = decay * (w_past.unsqueeze(-2) * below + w_diag.unsqueeze(-2) * on)  # [b, h, c, t, u]
    y_intra = torch.einsum("bhctrn,bhcusn,bhctu,bhcusp->bhctrp", q, k, weight, v)

    # Each chunk's own contribution to the carried state S'_T, then the serial pass over chunks.
    to_end = torch.exp(cs[..., -1:] - cs) * w_past  # [b, h, c, T]: L[T, u] c_u
    chunk_states = torch.einsum("bhcu,bhcusp,bhcusn->bhcpn", to_end, v, k)
    chunk_decay = torch.exp(cs[..., -1])  # [b, h, c]
    state = v.new_zeros(b, h, v.shape[-1], n)
    incoming = []
    for i in range(c):
        incoming.append(state)
        state = chunk_decay[:, :, i, None, None] * state + chunk_states[:, :, i]
    incoming = torch.stack(incoming, dim=2)  # [b, h, c, p, n]: S' at the end of the previous chunk
    y_inter = torch.einsum("bhctrn,bhcpn,bhct->bhctrp", q, incoming, torch.exp(cs))

    return (y_intra + y_inter).flatten(2, 3)


class ReferenceSSMScan:
    """``SSMScan`` in pure PyTorch: chunked, exact, CPU or GPU, any 1 <= g <= h with h % g == 0, any l.

    Computes in the inputs' dtype promoted to at least fp32 and returns v's dtype. No host syncs: shapes alone
    steer the Python control flow, so it runs under ``nam_core.testing.no_host_sync()`` and CUDA graphs.
    """

    def __call__(
        self, q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o, *, chunk_size
    ) -> torch.Tensor:
        out_dtype = v.dtype
        q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o = _promote(
            q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o
        )
        b, l, h, p = v.shape

        qb, kb = _biased_qk(q, k, q_bias, k_bias, h)  # [b, l, r, h, n]
        phi = angle_phase(angles, dt).unsqueeze(2)  # [b, l, 1, h, s]
        q_rot, k_rot = rotate(qb, phi), rotate(kb, phi)
        v_r = _rank_inputs(v, mimo_x)  # [b, l, r, h, p]

        lam = torch.sigmoid(trap)  # [b, h, l]
        gamma = lam * dt  # weight of U_t in S_t
        # (1 - lam_{t+1}) dt_{t+1}: step t+1's beta without its alpha, which L[., t] already holds; 0 at the end
        shifted = F.pad((1 - lam[..., 1:]) * dt[..., 1:], (0, 1))

        # Pad l up to whole chunks with a = 0 and zero weights: padded tokens neither decay nor add.
        pad = -l % chunk_size

        def heads_first(x):  # [b, l, r, h, e] -> [b, h, l + pad, r, e]
            return F.pad(x.permute(0, 3, 1, 2, 4), (0, 0, 0, 0, 0, pad))

        y = _chunked_ssd(
            heads_first(q_rot), heads_first(k_rot), heads_first(v_r),
            F.pad(adt, (0, pad)), F.pad(gamma, (0, pad)), F.pad(gamma + shifted, (0, pad)),
            chunk_size,
        )
        y = y[:, :, :l].permute(0, 2, 3, 1, 4)  # [b, h, l, r, p] -> [b, l, r, h, p]
        return _skip_gate_contract(y, v_r, d, z, mimo_z, mimo_o).to(out_dtype)
