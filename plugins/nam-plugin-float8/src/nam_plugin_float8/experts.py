"""The ``float8-grouped`` routed experts: each MoE layer's experts as two FP8 grouped GEMMs (torchao).

torchao 0.18's ``torchao.prototype.moe_training._to_fp8_rowwise_then_scaled_grouped_mm(A, B_t, offs,
out_dtype=bf16, float8_dtype=e4m3fn, pad_token_groups_for_grouped_mm=...)`` quantises ``A [M, K]`` per row
and ``B_t [E, K, N]`` (column-major per expert) per column to e4m3 with power-of-two scales, runs
``torch._scaled_grouped_mm``, and differentiates itself (its backward quantises the output gradient the same
way and runs two more scaled grouped GEMMs). Its constraints:

* K and N divisible by 16 (hidden and moe_ffn_hidden: ``nam_check_config`` refuses others);
* every group's row count divisible by 16, ``offs`` the int32 end row of each group. torchao's own padding
  (``pad_token_groups_for_grouped_mm=True``) asserts "not yet supported" in 0.18, so this module pads.

Padding, on the device and without a host sync: rows sorted by expert (``nam56r.experts``) move to a buffer of
a size fixed by the shapes alone, ``r + E * 15`` rounded up to 16, where expert ``e``'s group starts at a
multiple of 16; padding rows and the rows past the last group are zeros (they add nothing to a weight gradient
and are never read back)::

    counts [E] -> padded = ceil16(counts); ends = cumsum(padded)           [E] int32, the GEMM's offs
    row i of expert e -> i - start[e] + (ends[e] - padded[e])              [r] int64, ``PaddedGroups.rows``
    Y = gemm(zeros[P, K].index_copy(0, rows, X), W^T, ends).index_select(0, rows)

Each of the two GEMMs pads its input and unpads its output (the SwiGLU and the gate run on the ``r`` real
rows only); the padding indices are computed once per layer call.
"""

from __future__ import annotations

import importlib
from typing import Callable, NamedTuple

import torch

from nam56r.blocks.mlp import swiglu
from nam56r.experts import expert_of_rows, routed

ALIGN = 16
"""Rows per group a multiple of this, and K, N divisible by it: ``torch._scaled_grouped_mm`` on FP8
(torchao 0.18 ``fp8_grouped_mm.py`` asserts the dims; the group alignment is its ``alignment_size=16``)."""

GroupedMM = Callable[..., torch.Tensor]
"""``(a [P, K], b_t [E, K, N], offs=[E] int32) -> [P, N]`` in ``a.dtype`` or bf16: row group ``e`` of ``a``
times ``b_t[e]``; every group starts at a multiple of ``ALIGN``."""


class PaddedGroups(NamedTuple):
    """Where each sorted row sits in the padded layout. ``rows [r]`` int64, ``ends [E]`` int32 (the GEMM's
    ``offs``), ``size``: the padded buffer's rows (static: from ``r`` and ``E`` only)."""

    rows: torch.Tensor
    ends: torch.Tensor
    size: int


def pad_groups(counts: torch.Tensor, rows: int, align: int = ALIGN) -> PaddedGroups:
    """The padded layout for ``rows`` rows sorted by expert with ``counts [E]`` rows per expert (on the
    device; nothing is read on the host)."""
    padded = (counts + (align - 1)) // align * align  # [E]
    ends = padded.cumsum(0)
    shift = (ends - padded) - (counts.cumsum(0) - counts)  # [E] padded start - sorted start
    expert = expert_of_rows(counts, rows)  # [r]
    dest = torch.arange(rows, device=counts.device) + shift.index_select(0, expert)
    size = -(-(rows + counts.numel() * (align - 1)) // align) * align
    return PaddedGroups(rows=dest, ends=ends.to(torch.int32), size=size)


def padded_mm(grouped_mm: GroupedMM, a: torch.Tensor, b_t: torch.Tensor, groups: PaddedGroups) -> torch.Tensor:
    """``grouped_mm`` of ``a [r, K]`` (rows sorted by expert) and ``b_t [E, K, N]`` through the padded layout;
    ``[r, N]``."""
    a_pad = a.new_zeros(groups.size, a.shape[1]).index_copy(0, groups.rows, a)  # [P, K]
    return grouped_mm(a_pad, b_t, offs=groups.ends).index_select(0, groups.rows)  # [r, N]


def torchao_rowwise_mm(a: torch.Tensor, b_t: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """torchao's differentiable FP8 grouped GEMM: e4m3, rowwise power-of-two scales, bf16 out; groups already
    aligned (``pad_token_groups_for_grouped_mm=False``)."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(a, b_t, offs, out_dtype=torch.bfloat16,
                                                  float8_dtype=torch.float8_e4m3fn,
                                                  pad_token_groups_for_grouped_mm=False)


class Float8GroupedExperts:
    """``MoEExperts`` on FP8 grouped GEMMs. ``Float8GroupedExperts()`` is the product configuration (torchao's
    rowwise GEMM; the import fails loudly where torchao is missing); tests pass a ``grouped_mm`` with the
    same contract."""

    def __init__(self, grouped_mm: GroupedMM | None = None):
        if grouped_mm is None:
            importlib.import_module("torchao.prototype.moe_training")  # a missing torchao fails here, not mid-step
            grouped_mm = torchao_rowwise_mm
        self.grouped_mm = grouped_mm

    def layer_state(self, cfg) -> None:
        return None

    def sorted(self, x, counts, probs, w_gate_up, w_down, state=None) -> torch.Tensor:
        groups = pad_groups(counts, x.shape[0])
        h = padded_mm(self.grouped_mm, x, w_gate_up.transpose(-2, -1), groups)  # [r, 2f]
        a = swiglu(h) * probs.to(h.dtype).unsqueeze(-1)  # [r, f]
        return padded_mm(self.grouped_mm, a, w_down.transpose(-2, -1), groups).to(x.dtype)  # [r, d]

    def __call__(self, x, chosen, gates, w_gate_up, w_down, state=None) -> torch.Tensor:
        return routed(self.sorted, x, chosen, gates, w_gate_up, w_down, state)
