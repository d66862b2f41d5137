"""Reference routed experts: every expert on every token, unchosen ones zeroed by the gate matrix.

Routed weights are stacked ``[E, ...]`` tensors (so the model builds on the meta device and counts parameters
without a Python loop), and this backend runs them densely: ``einsum`` over the stacked weights, then a
sparse ``[t, E]`` gate matrix zeroes the ``E - k`` unchosen experts of each token before the down
projection. Cost: E / k times the routed FLOPs (NAM56R: 16 / 4 = 4x) and an intermediate of ``t * E * 2f``
values -- for NAM56R the same as one dense SwiGLU of width E * f = 2560, so it stays usable for small runs.
In exchange no shape depends on the routing, hence no host sync. Kernel backends (kind ``moe``) dispatch
tokens to their experts instead and are tested against this one.
"""

from __future__ import annotations

import torch

from nam56r.blocks.mlp import swiglu


class ReferenceExperts:
    def layer_state(self, cfg) -> None:
        return None

    def __call__(self, x, chosen, gates, w_gate_up, w_down, state=None) -> torch.Tensor:
        dense = torch.zeros(x.shape[0], w_gate_up.shape[0], dtype=gates.dtype, device=x.device)
        dense = dense.scatter(1, chosen, gates)  # [t, E]: the gate at each chosen expert, 0 elsewhere
        h = torch.einsum("td,efd->tef", x, w_gate_up)  # [t, E, 2f]
        a = swiglu(h) * dense.unsqueeze(-1)  # [t, E, f]
        return torch.einsum("tef,edf->td", a, w_down)  # [t, d]
