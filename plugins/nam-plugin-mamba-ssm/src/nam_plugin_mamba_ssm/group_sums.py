"""``reduce_groups`` in one pass over memory: a Triton kernel that reads the per-head gradient once and writes both
of its sums (``mimo.reduce_groups`` has the contract).

Eager, and as a compiled region, the two sums are two reductions over different axes of ``[b, l, r, h, n]`` (batch
and time for the bias, the heads of a group for the input), so the tensor is read twice: 2 x 2.15 GiB per call at
NAM56R's MBS 4 in bf16, two calls per layer. Here one program owns one (rank, group) and a chunk of ``CHUNK``
tokens: it loads ``[BT tokens, h/g heads, n]`` tiles, writes their sum over the heads (the input's gradient) and
keeps their sum over tokens (fp32) for its chunk; the chunks' partial sums ``[chunks, r, h, n]`` (16 MiB at MBS
4) are added afterwards by ``torch.sum`` in a fixed order. No atomics: deterministic.

The MIMO backward runs it unless told otherwise (``mamba-ssm.group_sums``, ``MambaSSMScan.build``). On an H200
at MBS 4 (``bench/group_sums.py --sweep``, 2026-11-29) it takes 0.95 ms a call at ``TILE`` against eager's 1.24
(1.31x; ~10 ms a step). The first version, which summed each tile over its tokens inside the loop, took 3.46 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = (512, 8, 4, 1)
"""(CHUNK, BT, warps, stages): tokens per program (32 chunks x 32 (rank, group) pairs = 1,024 programs at MBS 4,
16,384 tokens), tokens per loaded tile (8 x 16 heads x 128 = 16,384 values at NAM56R's widths), and the launch's
warps and pipeline stages: the fastest of ``bench/group_sums.py --sweep``'s 36 on an H200 (0.95 ms; 8 warps or
2-token tiles were 0.24-0.47x of eager, bench/results/group_sums_sweep.json)."""


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
    # The sum over tokens stays a [BT, JP, NP] tile of per-lane sums until the loop ends: summing over the tile's
    # tokens in every step would move data between warps (shared memory and a barrier) once per loaded tile.
    acc = tl.zeros((BT, JP, NP), dtype=tl.float32)
    for start in range(0, CHUNK, BT):
        t = (chunk * CHUNK + start + tt).to(tl.int64)  # [BT]
        t_mask = t < T
        offs = (((t * R + r) * H)[:, None, None] + head[None, :, None]) * N + nn[None, None, :]  # [BT, JP, NP]
        x = tl.load(d_ptr + offs, mask=t_mask[:, None, None] & jn_mask[None, :, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        out = ((t * R + r) * G + g)[:, None] * N + nn[None, :]  # [BT, NP]
        tl.store(grouped_ptr + out, tl.sum(x, axis=1).to(grouped_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & (nn[None, :] < N))
        acc += x
    part = ((chunk * R + r) * H + head)[:, None] * N + nn[None, :]  # [JP, NP]
    tl.store(partial_ptr + part, tl.sum(acc, axis=0), mask=jn_mask)


def fused_reduce_groups(d_per_head: torch.Tensor, groups: int, *,
                        tile: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``mimo.reduce_groups``'s contract in one read of ``d_per_head`` ``[b, l, r, h, n]``: (bias grad ``[h, r, n]``
    fp32, grad of the ``[b, l, r, g, n]`` input in d's dtype), both summed in fp32. ``tile``: ``TILE``'s fields
    (CHUNK and BT powers of two, BT <= CHUNK), for the sweep."""
    b, l, r, h, n = d_per_head.shape
    if h % groups:
        raise ValueError(f"{h} heads do not split into {groups} groups")
    chunk, bt, warps, stages = tile or TILE
    if chunk % bt or chunk & (chunk - 1) or bt & (bt - 1):
        raise ValueError(f"tile {tile}: CHUNK and BT must be powers of two with BT dividing CHUNK")
    d = d_per_head.contiguous()
    tokens, j = b * l, h // groups
    chunks = triton.cdiv(tokens, chunk)
    grouped = torch.empty((b, l, r, groups, n), dtype=d.dtype, device=d.device)
    partial = torch.empty((chunks, r, h, n), dtype=torch.float32, device=d.device)
    _group_and_bias_sums[(chunks, r * groups)](d, grouped, partial, tokens, R=r, H=h, G=groups, N=n, J=j,
                                               JP=triton.next_power_of_2(j), NP=triton.next_power_of_2(n),
                                               CHUNK=chunk, BT=bt, num_warps=warps, num_stages=stages)
    return partial.sum(0).transpose(0, 1), grouped
