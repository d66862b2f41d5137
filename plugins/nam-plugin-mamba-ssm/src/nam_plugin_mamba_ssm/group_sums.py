"""``reduce_groups`` in one pass over memory: a Triton kernel that reads the per-head gradient once and writes both
of its sums (``mimo.reduce_groups`` has the contract).

Eager, and as a compiled region, the two sums are two reductions over different axes of ``[b, l, r, h, n]`` (batch
and time for the bias, the heads of a group for the input), so the tensor is read twice: 2 x 2.15 GiB per call at
NAM56R's MBS 4 in bf16, two calls per layer. Here one program owns one (rank, group) and a chunk of ``CHUNK``
tokens: it loads ``[BT tokens, h/g heads, n]`` tiles, writes their sum over the heads (the input's gradient) and
keeps their sum over tokens (fp32) for its chunk; the chunks' partial sums ``[chunks, r, h, n]`` (16 MiB at MBS
4) are added afterwards by ``torch.sum`` in a fixed order. No atomics: deterministic.

The MIMO backward runs it when asked (``--set mamba-ssm.group_sums=fused``: ``mimo.use_group_sums``); off until
``bench/glue.py`` and the full model have timed it against the eager and compiled forms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 256
"""Tokens per program: 64 chunks x 32 (rank, group) pairs = 2,048 programs at MBS 4 (16,384 tokens)."""
BT = 4
"""Tokens per loaded tile: 4 x 16 heads x 128 = 8,192 values per load at NAM56R's widths."""


@triton.jit
def _group_and_bias_sums(d_ptr, grouped_ptr, partial_ptr, T, R: tl.constexpr, H: tl.constexpr, G: tl.constexpr,
                         N: tl.constexpr, J: tl.constexpr, JP: tl.constexpr, NP: tl.constexpr, CHUNK: tl.constexpr,
                         BT: tl.constexpr):
    chunk = tl.program_id(0)
    r = tl.program_id(1) // G
    g = tl.program_id(1) % G
    tt = tl.arange(0, BT)
    jj = tl.arange(0, JP)
    nn = tl.arange(0, NP)
    head = g * J + jj  # [JP] this group's heads
    jn_mask = (jj[:, None] < J) & (nn[None, :] < N)  # [JP, NP]
    acc = tl.zeros((JP, NP), dtype=tl.float32)
    for start in range(0, CHUNK, BT):
        t = (chunk * CHUNK + start + tt).to(tl.int64)  # [BT]
        t_mask = t < T
        offs = (((t * R + r) * H)[:, None, None] + head[None, :, None]) * N + nn[None, None, :]  # [BT, JP, NP]
        x = tl.load(d_ptr + offs, mask=t_mask[:, None, None] & jn_mask[None, :, :], other=0.0).to(tl.float32)
        out = ((t * R + r) * G + g)[:, None] * N + nn[None, :]  # [BT, NP]
        tl.store(grouped_ptr + out, tl.sum(x, axis=1).to(grouped_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & (nn[None, :] < N))
        acc += tl.sum(x, axis=0)
    part = ((chunk * R + r) * H + head)[:, None] * N + nn[None, :]  # [JP, NP]
    tl.store(partial_ptr + part, acc, mask=jn_mask)


def fused_reduce_groups(d_per_head: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mimo.reduce_groups``'s contract in one read of ``d_per_head`` ``[b, l, r, h, n]``: (bias grad ``[h, r, n]``
    fp32, grad of the ``[b, l, r, g, n]`` input in d's dtype), both summed in fp32."""
    b, l, r, h, n = d_per_head.shape
    if h % groups:
        raise ValueError(f"{h} heads do not split into {groups} groups")
    d = d_per_head.contiguous()
    tokens, j = b * l, h // groups
    chunks = triton.cdiv(tokens, CHUNK)
    grouped = torch.empty((b, l, r, groups, n), dtype=d.dtype, device=d.device)
    partial = torch.empty((chunks, r, h, n), dtype=torch.float32, device=d.device)
    _group_and_bias_sums[(chunks, r * groups)](d, grouped, partial, tokens, R=r, H=h, G=groups, N=n, J=j,
                                               JP=triton.next_power_of_2(j), NP=triton.next_power_of_2(n),
                                               CHUNK=CHUNK, BT=BT)
    return partial.sum(0).transpose(0, 1), grouped
