"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): MLA whose queries each attend to a chosen top-k of keys.

A DSA layer is an MLA layer (same parameters, same absorbed projections, same output path) plus a lightning
indexer. Per forward:

1. MLA's projections give the absorbed query and KV row, and ``qr`` for the indexer (``MLA.project``).
2. The indexer strategy (kind ``indexer``; ``full`` by default) picks ``[b, s, topk]`` key indices from
   the *detached* ``x`` and ``qr``, so the LM loss never reaches the indexer.
3. The attention core attends over those keys (``AttentionCore.sparse``), or over all past keys during the
   dense warm-up (``cfg.dsa_dense_warmup``).
4. The indexer KL loss, times ``cfg.indexer_loss_coeff``, goes to ``state`` as ``indexer_kl``: the dense
   form in warm-up, the top-k-restricted form after (kernels-and-math.md section 2.4). Its teacher is built
   from detached queries/keys, so it trains the indexer only. The index scores and the sparse teacher run on
   the layer's indexer kernels (kind ``indexer_kernels``: ``IndexerKernels.index_scores`` /
   ``sparse_teacher``), so a kernel backend speeds up the indexer too.

A ``WarmupStrategy`` that is warming up replaces steps 2-4 with its own dense attention + KL.

Freezing everything but the indexer during warm-up (DeepSeek-V3.2 trains only the indexer for its first
1000 steps) is the optimizer's job, not this block's.
"""

from __future__ import annotations

import torch

from nam56r.backends import AttentionCore, IndexerKernels, IndexerStrategy, WarmupStrategy
from nam56r.blocks.indexer import LightningIndexer, indexer_kl_dense, indexer_kl_sparse
from nam56r.blocks.mla import MLA
from nam56r.config import NAM56RConfig
from nam56r.state import ForwardState


class DSA(MLA):
    """MLA + lightning indexer + sparse core. Parameter names follow DeepSeek-V3.2 (``indexer.wq_b``, ...).

    ``dsa_rank`` is this layer's 0-based rank among the model's DSA layers and ``is_mtp`` marks a layer
    inside an MTP depth; strategies read both (IndexCache decides Full/Shared from them).
    """

    def __init__(
        self,
        cfg: NAM56RConfig,
        attention: AttentionCore,
        indexer_strategy: IndexerStrategy,
        dsa_rank: int,
        is_mtp: bool = False,
        indexer_kernels: IndexerKernels | None = None,
    ):
        """``indexer_kernels``: the run's backend of kind ``indexer_kernels`` (``Backends.indexer_kernels``; the
        model and the megatron slot pass it); None: the reference kernels, the kind's default."""
        super().__init__(cfg, attention, absorbed=True)
        if indexer_kernels is None:
            from nam56r.reference.attention import ReferenceIndexerKernels

            indexer_kernels = ReferenceIndexerKernels()
        self.indexer_kernels = indexer_kernels
        self.indexer = LightningIndexer(cfg, indexer_kernels)  # its scores run on the indexer kernels
        self.indexer_strategy = indexer_strategy
        self.dsa_rank = dsa_rank
        self.is_mtp = is_mtp

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        """``x [b, s, hidden]`` -> ``[b, s, hidden]``, causal; adds ``indexer_kl`` to ``state`` when given."""
        qr, q, kv = self.project(x)  # [b, s, q_lora], [b, s, h, kv_lora + rope], [b, s, kv_lora + rope]
        strategy = self.indexer_strategy
        if isinstance(strategy, WarmupStrategy) and strategy.warming_up():
            # The strategy's own dense stage: attention output and indexer KL from one call.
            return self.output(strategy.attend_dense(self, q, kv, x.detach(), qr.detach(), state))
        indices, index_scores = self.indexer_strategy.select(self, x.detach(), qr.detach(), state)  # [b, s, k]

        attend = dict(scale=self.softmax_scale, d_v=self.kv_lora)
        if self.cfg.dsa_dense_warmup:
            o_latent = self.attention.dense(q, kv, **attend)  # [b, s, h, kv_lora]
        else:
            o_latent = self.attention.sparse(q, kv, indices, **attend)

        if state is not None and index_scores is not None:
            if self.cfg.dsa_dense_warmup:
                kl = indexer_kl_dense(index_scores, q, kv, self.softmax_scale)
            else:
                teacher = self.indexer_kernels.sparse_teacher(q, kv, indices, scale=self.softmax_scale)  # [b, s, k]
                kl = indexer_kl_sparse(index_scores, indices, q, kv, self.softmax_scale, teacher=teacher)
            state.add_loss("indexer_kl", kl * self.cfg.indexer_loss_coeff)
        return self.output(o_latent)
