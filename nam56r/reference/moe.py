"""Reference routed experts: every expert on every row, unchosen ones zeroed by a gate matrix.

Routed weights are stacked ``[E, ...]`` tensors (so the model builds on the meta device and counts parameters
without a Python loop), and this backend runs them densely: ``einsum`` over the stacked weights, then a
sparse ``[rows, E]`` gate matrix zeroes every expert a row did not choose before the down projection. Cost:
E / k times the routed FLOPs (NAM56R: 16 / 4 = 4x) and an intermediate of ``rows * E * 2f`` values -- for
NAM56R the same as one dense SwiGLU of width E * f = 2560, so it stays usable for small runs. In exchange no
shape depends on the routing, hence no host sync. Dispatching backends (kind ``moe``) are tested against it.

``__call__`` takes one row per token and its ``k`` gates; ``sorted`` one row per (token, slot), sorted by
expert (Megatron's experts slot), each with its gate and its expert from the per-expert ``counts``. Gates arrive
in the router's dtype (fp32 from Megatron's flex dispatcher under DeepEP) and are rounded to the rows' dtype, as
the dispatching backends round them.
"""

from __future__ import annotations

import torch

from nam56r.blocks.mlp import swiglu
from nam56r.experts import expert_of_rows


def dense_experts(x: torch.Tensor, gate_matrix: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor) -> torch.Tensor:
    """``sum_e gate_matrix[:, e] * expert_e(x)`` for ``x [r, d]`` and ``gate_matrix [r, E]``."""
    h = torch.einsum("rd,efd->ref", x, w_gate_up)  # [r, E, 2f]
    a = swiglu(h) * gate_matrix.unsqueeze(-1)  # [r, E, f]
    return torch.einsum("ref,edf->rd", a, w_down)  # [r, d]


class ReferenceExperts:
    def layer_state(self, cfg) -> None:
        return None

    def __call__(self, x, chosen, gates, w_gate_up, w_down, state=None) -> torch.Tensor:
        dense = torch.zeros(x.shape[0], w_gate_up.shape[0], dtype=x.dtype, device=x.device)
        dense = dense.scatter(1, chosen, gates.to(x.dtype))  # [t, E]: the gate at each chosen expert, 0 elsewhere
        return dense_experts(x, dense, w_gate_up, w_down)

    def sorted(self, x, counts, probs, w_gate_up, w_down, state=None) -> torch.Tensor:
        experts = expert_of_rows(counts, x.shape[0]).unsqueeze(1)  # [r, 1]
        dense = torch.zeros(x.shape[0], w_gate_up.shape[0], dtype=x.dtype, device=x.device)
        return dense_experts(x, dense.scatter(1, experts, probs.to(x.dtype).unsqueeze(1)), w_gate_up, w_down)
