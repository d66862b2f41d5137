"""Multi-head latent attention (DeepSeek-V2/V3 MLA), the attention block of NAM56R.

Keys and values are rebuilt per head from one small latent per token, ``c_kv`` (kv_lora_rank wide), plus one
RoPE key ``k_rope`` that all heads share (kernels-and-math.md section 3). Because the per-head key up-projection
``W_UK`` is linear, it can be folded into the query instead ("absorbed"): ``q_nope . (W_UK c_kv)`` equals
``(W_UK^T q_nope) . c_kv``. Every head then attends over the same KV row ``[c_kv ; k_rope]``, which is MQA
with key width ``kv_lora + rope`` (NAM56R: 64 + 64 = 128) and value width ``kv_lora`` (64); the per-head
value up-projection ``W_UV`` runs after attention, on ``[b, s, h, kv_lora]``. The softmax scale stays
``(nope + rope)^-0.5`` in both forms: absorption changes where the product is taken, not its value.

The absorbed form is what the attention backends (``AttentionCore``) and DSA consume. The expanded form
(per-head k and v, plain softmax) exists only as the textbook check the tests compare against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from nam56r.backends import AttentionCore
from nam56r.blocks.rope import apply_rope_interleaved
from nam56r.config import NAM56RConfig
from nam56r.state import ForwardState


class MLAProjection(NamedTuple):
    """What MLA's projections hand to an attention core, and what DSA's indexer shares with it."""

    qr: torch.Tensor
    """``[b, s, q_lora]`` normalised query latent ``q_norm(wq_a(x))``; the lightning indexer's query input."""
    q: torch.Tensor
    """``[b, s, h, kv_lora + rope]`` absorbed query ``[W_UK^T q_nope ; rope(q_rope)]``."""
    kv: torch.Tensor
    """``[b, s, kv_lora + rope]`` shared KV row ``[kv_norm(c_kv) ; rope(k_rope)]``; value = first kv_lora."""


class MLA(nn.Module):
    """MLA with parameters named as in DeepSeek-V3 (``wq_a``, ``wkv_b``, ...) so checkpoints map one to one.

    ``absorbed=False`` computes per-head keys and values and an explicit causal softmax instead of calling
    the attention backend; it is slower and exists for the equivalence test.
    """

    def __init__(self, cfg: NAM56RConfig, attention: AttentionCore, absorbed: bool = True):
        super().__init__()
        self.cfg = cfg
        self.attention = attention
        self.absorbed = absorbed
        self.heads = cfg.attn_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        self.softmax_scale = cfg.qk_head_dim**-0.5  # (nope + rope)^-0.5, unchanged by absorption

        self.wq_a = nn.Linear(cfg.hidden, cfg.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * cfg.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.hidden, self.kv_lora + self.rope, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora, eps=cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora, self.heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(self.heads * self.v_dim, cfg.hidden, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) projections; the norms reset themselves (RMSNorm weight = 1)."""
        for linear in (self.wq_a, self.wq_b, self.wkv_a, self.wkv_b, self.wo):
            nn.init.normal_(linear.weight, std=self.cfg.init_std)

    # --- pieces ------------------------------------------------------------------------------------
    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head slices of ``wkv_b``: ``W_UK [h, nope, kv_lora]`` and ``W_UV [h, v, kv_lora]``."""
        w = self.wkv_b.weight.view(self.heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, : self.nope], w[:, self.nope :]

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [b, s, hidden]`` -> ``qr [b, s, q_lora]``, ``q_nope [b, s, h, nope]``, ``q_rope [b, s, h, rope]``.

        ``q_rope`` comes back rotated (interleaved pairs, DeepSeek-V3's MLA convention).
        """
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.heads, self.nope + self.rope))  # per head: [nope ; rope]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        return qr, q_nope, apply_rope_interleaved(q_rope, self.cfg.rope_theta)

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [b, s, hidden]`` -> normalised ``c_kv [b, s, kv_lora]`` and rotated ``k_rope [b, s, rope]``."""
        c_kv, k_rope = self.wkv_a(x).split([self.kv_lora, self.rope], dim=-1)
        return self.kv_norm(c_kv), apply_rope_interleaved(k_rope, self.cfg.rope_theta)

    def project(self, x: torch.Tensor) -> MLAProjection:
        """The absorbed-form inputs of the attention core (and the indexer's ``qr``), from ``x [b, s, hidden]``."""
        qr, q_nope, q_rope = self._queries(x)
        c_kv, k_rope = self._latents(x)
        w_uk, _ = self._up_weights()
        q_latent = torch.einsum("bshn,hnc->bshc", q_nope, w_uk)  # W_UK^T q_nope: [b, s, h, kv_lora]
        q = torch.cat((q_latent, q_rope), dim=-1)  # [b, s, h, kv_lora + rope]
        kv = torch.cat((c_kv, k_rope), dim=-1)  # [b, s, kv_lora + rope]
        return MLAProjection(qr, q, kv)

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """Attention output over latents ``[b, s, h, kv_lora]`` -> ``W_UV`` per head -> ``wo`` -> ``[b, s, hidden]``."""
        _, w_uv = self._up_weights()
        o = torch.einsum("bshc,hvc->bshv", o_latent, w_uv)  # [b, s, h, v]
        return self.wo(o.flatten(-2))

    # --- forward -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        """``x [b, s, hidden]`` -> ``[b, s, hidden]``, causal. MLA adds nothing to ``state``."""
        if not self.absorbed:
            return self._forward_expanded(x)
        _, q, kv = self.project(x)
        o_latent = self.attention.dense(q, kv, scale=self.softmax_scale, d_v=self.kv_lora)  # [b, s, h, kv_lora]
        return self.output(o_latent)

    def _forward_expanded(self, x: torch.Tensor) -> torch.Tensor:
        """Textbook MLA: per-head ``k = [W_UK c_kv ; k_rope]``, ``v = W_UV c_kv``, explicit causal softmax."""
        _, q_nope, q_rope = self._queries(x)
        c_kv, k_rope = self._latents(x)
        kv = self.wkv_b(c_kv).unflatten(-1, (self.heads, self.nope + self.v_dim))  # [b, s, h, nope + v]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)  # [b, s, h, nope + rope]
        k = torch.cat((k_nope, k_rope[:, :, None, :].expand_as(q_rope)), dim=-1)  # rope key shared by heads
        acc = torch.promote_types(x.dtype, torch.float32)
        scores = torch.einsum("bthd,bshd->bhts", q.to(acc), k.to(acc)) * self.softmax_scale  # [b, h, s, s]
        s = x.shape[1]
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        o = torch.einsum("bhts,bshv->bthv", probs, v.to(acc)).to(x.dtype)  # [b, s, h, v]
        return self.wo(o.flatten(-2))
