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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


class _Dispatch(torch.autograd.Function):
    """Token rows to sorted rows (``x[tokens]``); backward gathers each slot's gradient back into slot order
    and sums a token's ``k`` slots (a gather and a reshape-sum, where ``index_select``'s own backward would
    scatter-add with atomics)."""

    @staticmethod
    def forward(ctx, x, tokens, slots, topk):
        ctx.save_for_backward(slots)
        ctx.topk = topk
        return x.index_select(0, tokens)

    @staticmethod
    def backward(ctx, grad_rows):
        (slots,) = ctx.saved_tensors
        t = slots.numel() // ctx.topk
        return grad_rows.index_select(0, slots).view(t, ctx.topk, -1).sum(dim=1), None, None, None


class _Combine(torch.autograd.Function):
    """Sorted rows to tokens: each token's ``k`` rows, gathered in slot order, summed; backward hands every row
    its token's gradient (a gather)."""

    @staticmethod
    def forward(ctx, rows, tokens, slots, topk):
        ctx.save_for_backward(tokens)
        t = slots.numel() // topk
        return rows.index_select(0, slots).view(t, topk, -1).sum(dim=1)

    @staticmethod
    def backward(ctx, grad_out):
        (tokens,) = ctx.saved_tensors
        return grad_out.index_select(0, tokens), None, None, None


def routed(sorted_experts, x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor, w_gate_up: torch.Tensor,
           w_down: torch.Tensor, state) -> torch.Tensor:
    """The ``MoEExperts.__call__`` contract through a backend's ``sorted`` method: sort the slots, run the
    experts on the sorted rows, and sum each token's ``k`` rows back in slot order. Every move of rows, forward
    and backward, is a gather: deterministic, no atomics."""
    by = sort_by_expert(chosen, w_gate_up.shape[0])
    tokens, k = by.tokens, by.topk
    slots = torch.empty_like(by.order)
    slots[by.order] = torch.arange(by.order.numel(), device=by.order.device)  # each slot's sorted row
    rows = sorted_experts(_Dispatch.apply(x, tokens, slots, k), by.counts, gates.flatten().index_select(0, by.order),
                          w_gate_up, w_down, state)  # [t*k, d], gates applied
    return _Combine.apply(rows, tokens, slots, k)
