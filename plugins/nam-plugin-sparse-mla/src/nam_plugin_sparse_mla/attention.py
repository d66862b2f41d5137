"""The ``sparse-mla`` backends of kinds ``attention`` (``SparseMLA``, a ``nam56r.backends.AttentionCore``) and
``indexer_kernels`` (``SparseMLAIndexerKernels``, a ``nam56r.backends.IndexerKernels``).

* ``sparse``: the Triton kernels of ``kernel.py`` (DSA layers after the indexer warm-up).
* ``dense``: torch's fused attention, ``scaled_dot_product_attention`` (MLA layers, and DSA layers during the
  dense warm-up), as one MQA call: every query head against the single shared KV row (``enable_gqa``).
* ``SparseMLAIndexerKernels.index_scores`` and ``sparse_teacher``: the DSA lightning indexer's scores (with
  backward) and its sparse KL teacher, the Triton kernels of ``indexer.py``.

Why ``dense`` passes the *full* key row as the value and keeps the first ``d_v`` output channels, instead of
passing ``kv[..., :d_v]``: torch's flash kernel (the one that takes ``enable_gqa`` on every sm80+ build)
requires the query, key and value widths to be equal, and with a 64-wide value against a 128-wide key it
refuses; SDPA would then fall back to its math path, which repeats KV per head and holds ``[b, h, s, s]``
scores, worse than the reference. With value = the whole row the widths match, the flash (or cuDNN) kernel
runs, and the extra value channels are the rope key's, whose outputs are dropped, so they get zero gradient
through the value (cost: the P @ V work on dk instead of dv channels). The call also runs with the math
backend switched off, so if no fused kernel can take a shape it raises instead of silently materialising
the scores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nam_plugin_sparse_mla import indexer
from nam_plugin_sparse_mla.kernel import sparse_mla

FUSED_SDPA = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
"""SDPA backends ``dense`` may use: torch's fused kernels only, never the math path."""


def dense_attention(q: torch.Tensor, kv: torch.Tensor, *, scale: float, d_v: int) -> torch.Tensor:
    """Causal MQA attention of ``q [b, s, h, dk]`` over ``kv [b, s, dk]`` -> ``[b, s, h, d_v]``, fused."""
    shared = kv[:, None]  # [b, 1, s, dk]: one KV head for all query heads
    with sdpa_kernel(FUSED_SDPA):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), shared, shared, is_causal=True, scale=scale,
                                           enable_gqa=True)  # [b, h, s, dk]
    return o[..., :d_v].transpose(1, 2)  # [b, s, h, d_v]


class SparseMLAIndexerKernels:
    """``IndexerKernels``: the lightning indexer's scores and sparse teacher on the sparse-mla Triton kernels."""

    def index_scores(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return indexer.index_scores(q, k, w)

    def sparse_teacher(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *,
                       scale: float) -> torch.Tensor:
        return indexer.sparse_teacher(q, kv, indices, scale=scale)


class SparseMLA:
    """``AttentionCore`` whose sparse path is the sparse-mla Triton kernel and whose dense path is torch's fused
    SDPA."""

    def __init__(self, block_n: int | None = None):  # None: kernel.TILES
        self.block_n = block_n

    def dense(self, q: torch.Tensor, kv: torch.Tensor, *, scale: float, d_v: int) -> torch.Tensor:
        return dense_attention(q, kv, scale=scale, d_v=d_v)

    def sparse(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float,
               d_v: int) -> torch.Tensor:
        o, _lse = sparse_mla(q, kv, indices, scale=scale, d_v=d_v, block_n=self.block_n)
        return o
