"""The unfused warm-up, pure PyTorch: dense attention, then the indexer scores, then the KL.

This is what a DSA layer does in its dense stage without the plugin (``nam56r.blocks.dsa`` with
``dsa_dense_warmup``), written as one function of the kernel's inputs so the fused kernel has an oracle:

    o   = causal softmax attention of q over kv (MLA absorbed form), by the active attention backend
    kl  = per query row, KL( p_t || softmax(I_t) ) over the causal keys, with
          p_t    = mean over attention heads of softmax(scale * q_h . kv)      detached: the teacher
          I_t,s  = sum_j w_t,j * relu(iq_t,j . ik_s)                          carries the indexer's graph

``target="per-head"`` replaces the head-mean teacher with one KL per head against that head's own index
scores ``w_t,h * relu(iq_t,h . ik_s)`` (index heads must equal attention heads), averaged over heads.
"""

from __future__ import annotations

import torch

from nam56r.blocks.indexer import index_scores, indexer_kl_dense_rows
from nam56r.reference.attention import ReferenceAttention
from nam_plugin_lemyx.options import HEAD_SUM, PER_HEAD, TARGETS


def kl_rows(q: torch.Tensor, kv: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor, w: torch.Tensor, *,
            scale: float, target: str = HEAD_SUM) -> torch.Tensor:
    """Per-row KL ``[b, s]`` in ``w``'s dtype (fp32; fp64 for fp64 inputs); graph to iq, ik and w only."""
    if target == HEAD_SUM:
        return indexer_kl_dense_rows(index_scores(iq, ik, w), q, kv, scale)
    if target != PER_HEAD:
        raise ValueError(f"lemyx target {target!r}; expected one of {TARGETS}")
    h, H = q.shape[2], iq.shape[2]
    if h != H:
        raise ValueError(f"per-head target needs as many index heads as attention heads: {H} vs {h}")
    rows = [indexer_kl_dense_rows(index_scores(iq[:, :, j : j + 1], ik, w[:, :, j : j + 1]),
                                  q[:, :, j : j + 1], kv, scale) for j in range(h)]
    return torch.stack(rows).mean(0)


def warmup_reference(q: torch.Tensor, kv: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor, w: torch.Tensor, *,
                     scale: float, d_v: int, target: str = HEAD_SUM, attention=None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [b, s, h, d_v], kl [b, s])``: the attention core's dense output, then ``kl_rows``."""
    o = (attention if attention is not None else ReferenceAttention()).dense(q, kv, scale=scale, d_v=d_v)
    return o, kl_rows(q, kv, iq, ik, w, scale=scale, target=target)
