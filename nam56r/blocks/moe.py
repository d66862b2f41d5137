"""Mixture of experts: top-k routed SwiGLU experts plus one always-on shared SwiGLU expert.

Routing: ``p = softmax(router(x))`` over ``E`` experts; each token keeps its ``k`` largest probabilities,
renormalised to sum to 1 over the chosen ``k`` (the gates). Output = ``sum_chosen gate_e * expert_e(x) +
shared(x)``. Dropless and exact: no capacity factor, no token is ever dropped.

Load balance (Switch Transformer, Fedus et al. 2021, extended to top-k as in Megatron's
``switch_load_balancing_loss_func``)::

    f_e = (tokens sending one of their k slots to e) / (t * k)     # not differentiable: a count
    P_e = mean over tokens of p_e                                   # carries the gradient
    aux = coeff * E * sum_e f_e * P_e                               # = coeff when routing is uniform

This is the reference computation. Routed weights are stacked ``[E, ...]`` tensors so the model builds on the
meta device and counts parameters without a Python loop, and the forward runs *every* expert on *every* token
(``einsum`` over the stacked weights) and zeroes the unchosen ones through the sparse gate matrix. Cost: E / k
times the routed FLOPs (NAM56R: 16 / 4 = 4x) and an intermediate of ``t * E * 2f`` values -- for NAM56R the
same as one dense SwiGLU of width E * f = 2560, so it stays usable for small runs. In exchange there is no
data-dependent shape anywhere, hence no host sync; a grouped-GEMM backend replaces it for real training.
"""

from __future__ import annotations

import torch
from torch import nn

from nam56r.blocks.mlp import SwiGLU, swiglu
from nam56r.config import NAM56RConfig
from nam56r.state import ForwardState


class MoE(nn.Module):
    def __init__(self, cfg: NAM56RConfig):
        super().__init__()
        if not 1 <= cfg.moe_topk <= cfg.num_experts:
            raise ValueError(
                f"moe_topk must be in [1, num_experts={cfg.num_experts}], found {cfg.moe_topk}; "
                "fix the recipe (nam recipe show NAME prints the resolved config)"
            )
        d, e, f = cfg.hidden, cfg.num_experts, cfg.moe_ffn_hidden
        self.num_experts = e
        self.topk = cfg.moe_topk
        self.aux_loss_coeff = cfg.moe_aux_loss_coeff
        self.init_std = cfg.init_std
        self.router = nn.Linear(d, e, bias=False)
        # Routed experts, stacked; per expert the same layout as SwiGLU (gate rows first in w_gate_up).
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * f, d))  # [E, 2f, d]
        self.w_down = nn.Parameter(torch.empty(e, d, f))  # [E, d, f]
        self.shared = SwiGLU(d, cfg.moe_shared_ffn_hidden, init_std=cfg.init_std)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.router.weight, std=self.init_std)
        nn.init.normal_(self.w_gate_up, std=self.init_std)
        nn.init.normal_(self.w_down, std=self.init_std)
        self.shared.reset_parameters()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities, chosen experts and the sparse gate matrix for tokens ``x [t, d]``.

        Returns ``probs [t, E]`` (softmax in at least fp32), ``chosen [t, k]`` int64, and ``gates [t, E]``
        in ``x.dtype``: the renormalised top-k probabilities at the chosen experts, 0 elsewhere.
        """
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 softmax for bf16 inputs; fp64 stays fp64
        probs = self.router(x).to(acc).softmax(dim=-1)  # [t, E]
        top_p, chosen = probs.topk(self.topk, dim=-1)  # [t, k]
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(1, chosen, top_p)  # [t, E]
        return probs, chosen, gates.to(x.dtype)

    def load_balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``coeff * E * sum_e f_e * P_e`` for ``probs [t, E]`` and ``chosen [t, k]`` (fp32 or wider scalar)."""
        t = probs.shape[0]
        counts = torch.zeros(self.num_experts, dtype=probs.dtype, device=probs.device)
        counts.scatter_add_(0, chosen.flatten(), torch.ones_like(chosen, dtype=probs.dtype).flatten())
        f = counts / (t * self.topk)  # [E], sums to 1
        p_mean = probs.mean(dim=0)  # [E], sums to 1
        return self.aux_loss_coeff * self.num_experts * (f * p_mean).sum()

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        b, s, d = x.shape
        x_t = x.reshape(b * s, d)  # [t, d]
        probs, chosen, gates = self.route(x_t)
        # Dense over experts: one [t, d] x [d, E*2f] matmul, then one [t, E*f] x [E*f, d] matmul; the gate
        # matrix zeroes the E - k unchosen experts of each token before the down projection.
        h = torch.einsum("td,efd->tef", x_t, self.w_gate_up)  # [t, E, 2f]
        a = swiglu(h) * gates.unsqueeze(-1)  # [t, E, f]
        routed = torch.einsum("tef,edf->td", a, self.w_down)  # [t, d]
        if state is not None:
            state.add_loss("moe_aux", self.load_balance_loss(probs, chosen))
        return (routed + self.shared(x_t)).reshape(b, s, d)
