"""Mixture of experts: top-k routed SwiGLU experts plus one always-on shared SwiGLU expert.

Routing: ``p = softmax(router(x))`` over ``E`` experts; each token keeps its ``k`` largest probabilities,
renormalised to sum to 1 over the chosen ``k`` (the gates). Output = ``sum_chosen gate_e * expert_e(x) +
shared(x)``. Dropless and exact: no capacity factor, no token is ever dropped.

Load balance (Switch Transformer, Fedus et al. 2021, extended to top-k as in Megatron's
``switch_load_balancing_loss_func``)::

    f_e = (tokens sending one of their k slots to e) / (t * k)     # not differentiable: a count
    P_e = mean over tokens of p_e                                   # carries the gradient
    aux = coeff * E * sum_e f_e * P_e                               # = coeff when routing is uniform

The routed experts' GEMMs come from the ``moe`` backend (``nam56r.backends.MoEExperts``; the reference
one is nam56r/reference/moe.py); the router, its loss and the shared expert are computed here, in the model's
dtype, whatever that backend is.
"""

from __future__ import annotations

import torch
from torch import nn

from nam56r.backends import MoEExperts
from nam56r.blocks.mlp import SwiGLU
from nam56r.config import NAM56RConfig
from nam56r.state import ForwardState


class MoE(nn.Module):
    def __init__(self, cfg: NAM56RConfig, experts: MoEExperts):
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
        self.experts = experts
        self.expert_state = experts.layer_state(cfg)  # a submodule (e.g. FP8 amax histories) or None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.router.weight, std=self.init_std)
        nn.init.normal_(self.w_gate_up, std=self.init_std)
        nn.init.normal_(self.w_down, std=self.init_std)
        self.shared.reset_parameters()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router probabilities, chosen experts and their gates for tokens ``x [t, d]``.

        Returns ``probs [t, E]`` (softmax in at least fp32), ``chosen [t, k]`` int64, and ``gates [t, k]``
        in ``x.dtype``: the top-k probabilities renormalised to sum to 1 per token.
        """
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 softmax for bf16 inputs; fp64 stays fp64
        probs = self.router(x).to(acc).softmax(dim=-1)  # [t, E]
        top_p, chosen = probs.topk(self.topk, dim=-1)  # [t, k]
        gates = top_p / top_p.sum(dim=-1, keepdim=True)
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
        routed = self.experts(x_t, chosen, gates, self.w_gate_up, self.w_down, self.expert_state)  # [t, d]
        if state is not None:
            state.add_loss("moe_aux", self.load_balance_loss(probs, chosen))
        return (routed + self.shared(x_t)).reshape(b, s, d)
