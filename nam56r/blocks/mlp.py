"""SwiGLU feed-forward: ``down( silu(x W_gate) * (x W_up) )``, no biases.

The gate and up projections share one matrix (``w_gate_up``, gate rows first) so the input is read once; the
MoE's shared expert and the MTP depths use this module, and the routed experts use the same math on stacked
weights (nam56r/blocks/moe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a last dimension laid out ``[gate ; up]`` (each half ``ffn_hidden`` wide)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    def __init__(self, d_in: int, ffn_hidden: int, *, init_std: float = 0.02):
        """``init_std`` defaults to NAM56RConfig.init_std; callers holding a config pass it explicitly."""
        super().__init__()
        self.init_std = init_std
        self.w_gate_up = nn.Linear(d_in, 2 * ffn_hidden, bias=False)
        self.w_down = nn.Linear(ffn_hidden, d_in, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate_up.weight, std=self.init_std)
        nn.init.normal_(self.w_down.weight, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(swiglu(self.w_gate_up(x)))  # [..., d_in] -> [..., 2f] -> [..., f] -> [..., d_in]
