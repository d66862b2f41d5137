"""Routed experts over rows sorted by expert: the layout every dispatching ``moe`` backend computes on.

A token's ``k`` choices are ``k`` rows (slot ``s = token * k + j``). Sorted by expert (stably), expert ``e``
owns the contiguous rows ``[offs[e-1], offs[e])``; a grouped GEMM runs all experts on those rows in one
launch. Megatron's dispatcher hands the experts exactly this layout (rows sorted by expert, a per-expert row
count and each row's gate); the local engine builds it here. Both stay on the device: the counts come from
``scatter_add_`` into a fixed ``[E]`` vector and the row order from ``argsort``, so no shape depends on the
routing and nothing is read on the host.

Per sorted row ``r`` of expert ``e`` with gate ``g_r``::

    y_r = W_down[e] (swiglu(W_gate_up[e] x_r) * g_r)

and a token's output is the sum of its ``k`` rows. Applying the gate before the down projection equals
applying it after (the projection is linear); it is where Megatron's experts apply it too.

Between the GEMMs the work is memory-bound row moves and elementwise steps (``RowOps``): a token's ``k`` rows
gathered and summed (``gather_sum``: the forward of the combine, the backward of the dispatch) and the gated
SwiGLU. Eager, ``gather_sum`` writes the ``[t*k, d]`` gathered rows and reads them back for the sum; compiled
(``COMPILED_ROWS``, ``compile_glue``: nam56r/regions.py) the sum reads each row where it lies, in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from nam56r.regions import Region


@dataclass(frozen=True)
class ByExpert:
    """Slots sorted by expert: ``order [t*k]`` (the slot behind each sorted row), ``counts [E]`` int64 rows
    per expert, ``topk`` (slots per token). All on the routing's device."""

    order: torch.Tensor
    counts: torch.Tensor
    topk: int

    @property
    def tokens(self) -> torch.Tensor:
        """``[t*k]``: the token behind each sorted row."""
        return self.order // self.topk


def sort_by_expert(chosen: torch.Tensor, num_experts: int) -> ByExpert:
    """Sort the slots of ``chosen [t, k]`` (int64 expert ids) by expert, without a host sync."""
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return ByExpert(order=order, counts=counts, topk=chosen.shape[1])


def group_ends(counts: torch.Tensor) -> torch.Tensor:
    """``offs [E]`` int32: the end row of each expert's group (what ``torch._grouped_mm`` takes)."""
    return counts.cumsum(0).to(torch.int32)


def expert_of_rows(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows]`` int64: the expert of each sorted row. ``rows`` is passed so the size is not read from
    the device (``repeat_interleave`` would otherwise sync to learn it)."""
    experts = torch.arange(counts.numel(), device=counts.device)
    return torch.repeat_interleave(experts, counts, output_size=rows)


def gather_sum(rows: torch.Tensor, index: torch.Tensor, topk: int) -> torch.Tensor:
    """``out[i] = sum_j rows[index[i * topk + j]]``: rows ``[r, d]``, index ``[t * topk]`` int64 -> ``[t, d]`` in
    rows' dtype (the sum accumulates in fp32 at least and rounds once, eager and compiled alike)."""
    t = index.numel() // topk
    return rows.index_select(0, index).view(t, topk, -1).sum(dim=1)


def gated_swiglu(h: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * g`` per sorted row: h ``[r, 2f]`` (gate half first), gates ``[r]`` -> ``[r, f]`` in h's
    dtype."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up * gates.to(h.dtype).unsqueeze(-1)


@dataclass(frozen=True)
class RowOps:
    """The memory-bound steps between the experts' GEMMs, as one set: eager (``EAGER_ROWS``) or compiled regions
    (``COMPILED_ROWS``). Both compute the same values up to the order of fp32 additions and, in bf16, where the
    intermediate roundings fall (eager rounds silu(gate) and silu(gate) * up to bf16; compiled, once at the end)."""

    gather_sum: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    gated_swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


EAGER_ROWS = RowOps(gather_sum, gated_swiglu)
COMPILED_ROWS = RowOps(Region(gather_sum, "compile_glue"), gated_swiglu)
"""The rows under ``compile_glue``: only the gather-sum is compiled. One H200, MBS 4 shapes (bench/glue.py,
bench/results/glue.md): the compiled gather-sum 2.27x eager (+14 ms a step), a compiled gated SwiGLU 0.47x (its
forward and backward as one region were slower than torch's three fused elementwise kernels), so SwiGLU stays
eager."""


def row_ops(compiled: bool) -> RowOps:
    """``COMPILED_ROWS`` when ``compiled`` (the model's ``compile_glue``), else ``EAGER_ROWS``."""
    return COMPILED_ROWS if compiled else EAGER_ROWS


class _Dispatch(torch.autograd.Function):
    """Token rows to sorted rows (``x[tokens]``); backward gathers each slot's gradient back into slot order
    and sums a token's ``k`` slots (``gather_sum``, where ``index_select``'s own backward would scatter-add with
    atomics)."""

    @staticmethod
    def forward(ctx, x, tokens, slots, topk, ops):
        ctx.save_for_backward(slots)
        ctx.topk, ctx.ops = topk, ops
        return x.index_select(0, tokens)

    @staticmethod
    def backward(ctx, grad_rows):
        (slots,) = ctx.saved_tensors
        return ctx.ops.gather_sum(grad_rows, slots, ctx.topk), None, None, None, None


class _Combine(torch.autograd.Function):
    """Sorted rows to tokens: each token's ``k`` rows, in slot order, summed (``gather_sum``); backward hands
    every row its token's gradient (a gather)."""

    @staticmethod
    def forward(ctx, rows, tokens, slots, topk, ops):
        ctx.save_for_backward(tokens)
        return ops.gather_sum(rows, slots, topk)

    @staticmethod
    def backward(ctx, grad_out):
        (tokens,) = ctx.saved_tensors
        return grad_out.index_select(0, tokens), None, None, None, None


def routed(sorted_experts, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor, w_gate_up: torch.Tensor,
           w_down: torch.Tensor, state, *, ops: RowOps = EAGER_ROWS) -> torch.Tensor:
    """The ``MoEExperts.__call__`` contract through a backend's ``sorted`` method: sort the slots, run the
    experts on the sorted rows, and sum each token's ``k`` rows back in slot order (``ops.gather_sum``). Every
    move of rows, forward and backward, is a gather: deterministic, no atomics."""
    by = sort_by_expert(chosen, w_gate_up.shape[0])
    tokens, k = by.tokens, by.topk
    slots = torch.empty_like(by.order)
    slots[by.order] = torch.arange(by.order.numel(), device=by.order.device)  # each slot's sorted row
    rows = sorted_experts(_Dispatch.apply(x, tokens, slots, k, ops), by.counts,
                          gates.flatten().index_select(0, by.order), w_gate_up, w_down, state)  # [t*k, d], gated
    return _Combine.apply(rows, tokens, slots, k, ops)
