"""The ``grouped`` routed experts: each MoE layer's experts as two grouped GEMMs over rows sorted by expert.

On rows sorted by expert (``nam56r.experts``; Megatron's dispatcher hands them over already sorted), with
``offs`` the end row of each expert's group::

    H = grouped_mm(X, W_gate_up^T, offs)      [r, 2f]   one launch for every expert
    A = swiglu(H) * g                         [r, f]    g: each row's gate
    Y = grouped_mm(A, W_down^T, offs)         [r, d]

``torch.nn.functional.grouped_mm`` differentiates itself (its backward is grouped GEMMs too), takes bf16 with
groups of any size (no padding per expert; an expert with no row is an empty group) and int32 cumulative
``offs`` that stay on the device: the layer never reads the routing on the host.

The gate step and the per-token sums around the GEMMs are ``nam56r.experts.RowOps``: eager, or compiled regions
when the model's ``compile_glue`` is on (``build``).
"""

from __future__ import annotations

from typing import Callable

import torch

from nam56r.experts import RowOps, group_ends, routed, row_ops

GroupedMM = Callable[..., torch.Tensor]
"""``(a [r, K], b [E, K, N], offs=[E] int32) -> [r, N]``: row group ``e`` of ``a`` times ``b[e]``."""


class GroupedExperts:
    """``MoEExperts`` on ``grouped_mm`` (torch's own unless a test passes another with the same contract);
    ``compile_glue``: the row steps between the GEMMs as compiled regions (``nam56r.experts.COMPILED_ROWS``)."""

    def __init__(self, grouped_mm: GroupedMM | None = None, *, compile_glue: bool = False):
        self.grouped_mm = grouped_mm or torch.nn.functional.grouped_mm
        self.rows: RowOps = row_ops(compile_glue)

    @classmethod
    def build(cls, ctx) -> "GroupedExperts":
        """The backend a run builds (``nam56r.backends.build_backend``): the model's ``compile_glue`` chooses the
        row steps."""
        return cls(compile_glue=ctx.model.compile_glue)

    def layer_state(self, cfg) -> None:
        return None

    def sorted(self, x, counts, probs, w_gate_up, w_down, state=None) -> torch.Tensor:
        offs = group_ends(counts)
        h = self.grouped_mm(x, w_gate_up.transpose(-2, -1), offs=offs)  # [r, 2f]
        a = self.rows.gated_swiglu(h, probs)  # [r, f]
        return self.grouped_mm(a, w_down.transpose(-2, -1), offs=offs)  # [r, d]

    def __call__(self, x, chosen, gates, w_gate_up, w_down, state=None) -> torch.Tensor:
        return routed(self.sorted, x, chosen, gates, w_gate_up, w_down, state, ops=self.rows)
