"""Reference ``AttentionCore`` (causal MLA attention in absorbed (MQA) form) and ``IndexerKernels``, pure PyTorch.

Every query head attends to one shared KV "head": the key is the full ``[c_kv ; k_rope]`` row and the value
is its first ``d_v`` channels (the latent ``c_kv``), see kernels-and-math.md section 3. This is the contract
the GPU kernels implement (tilelang ``sparse_mla_fwd``, FlashMLA), so this file is their CPU oracle.

* ``dense``: ordinary causal softmax attention. It holds the ``[b, h, s, s]`` score matrix, which is fine for
  an oracle on CPU-sized inputs; kernels never form it.
* ``ReferenceIndexerKernels.index_scores`` and ``sparse_teacher`` (kind ``indexer_kernels``): the DSA
  indexer's scores and its sparse KL teacher, the head-by-head pure-PyTorch functions of
  ``nam56r.blocks.indexer``, unchanged.
* ``sparse``: each query ``t`` attends only to the keys listed in ``indices[b, t, :]``. The keys are gathered
  into ``[b, s, topk, dk]`` (never a ``[b, s, s]`` anything), so cost and memory scale with top-k.
  A slot is live iff ``0 <= index <= t``: ``-1`` marks an empty slot (a row with fewer than top-k past keys),
  and the causal half of the test is the same rule the tilelang kernels apply.

Scores, softmax and the weighted sum run in fp32 (or float64 for float64 inputs); the result is cast back
to the query's dtype. Nothing here reads a tensor value on the host, so both paths are CUDA-graph safe.
"""

from __future__ import annotations

import torch

from nam56r.blocks.indexer import gather_keys, index_scores, live_slots, teacher_sparse


def _accumulate_dtype(q: torch.Tensor) -> torch.dtype:
    # fp32 accumulate for bf16/fp16/fp32 inputs; float64 stays float64 for exact CPU parity tests.
    return torch.promote_types(q.dtype, torch.float32)


class ReferenceIndexerKernels:
    """The ``reference`` backend of kind ``indexer_kernels``."""

    def index_scores(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``nam56r.blocks.indexer.index_scores``: ``[b, s, s]`` in ``w``'s dtype, -inf above the diagonal."""
        return index_scores(q, k, w)

    def sparse_teacher(
        self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float
    ) -> torch.Tensor:
        """``nam56r.blocks.indexer.teacher_sparse``: ``[b, s, topk]``, no gradient."""
        return teacher_sparse(q, kv, indices, scale)


class ReferenceAttention:
    """The ``reference`` backend of kind ``attention``."""

    def dense(self, q: torch.Tensor, kv: torch.Tensor, *, scale: float, d_v: int) -> torch.Tensor:
        """Causal attention of ``q [b, s, h, dk]`` over ``kv [b, s, dk]``; returns ``[b, s, h, d_v]``."""
        acc = _accumulate_dtype(q)
        s = q.shape[1]
        kv = kv.to(acc)
        scores = torch.einsum("bthd,bsd->bhts", q.to(acc), kv) * scale  # [b, h, s, s] fp32
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)  # [t, s]: key after query
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        out = torch.einsum("bhts,bsd->bthd", probs, kv[..., :d_v])  # [b, s, h, d_v]
        return out.to(q.dtype)

    def sparse(
        self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float, d_v: int
    ) -> torch.Tensor:
        """Attention of ``q [b, s, h, dk]`` over the keys ``indices [b, s, topk]`` names; ``-1`` = empty slot."""
        acc = _accumulate_dtype(q)
        picked = gather_keys(kv, indices).to(acc)  # [b, s, topk, dk]
        live = live_slots(indices)  # [b, s, topk]
        scores = torch.einsum("bthd,btkd->bthk", q.to(acc), picked) * scale  # [b, s, h, topk]
        # A finite fill (not -inf) keeps a row with no live slot NaN-free; the live mask then zeroes it.
        # Rows with >= 1 live slot are exact: exp(min - max) underflows to 0.
        scores = scores.masked_fill(~live[:, :, None, :], torch.finfo(acc).min)
        probs = scores.softmax(dim=-1) * live[:, :, None, :]
        out = torch.einsum("bthk,btkd->bthd", probs, picked[..., :d_v])  # [b, s, h, d_v]
        return out.to(q.dtype)

