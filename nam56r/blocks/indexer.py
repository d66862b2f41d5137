"""The DSA lightning indexer: which past keys each query keeps, and the KL loss that teaches it.

The indexer is a cheap many-head scorer over one shared key per token (DeepSeek-V3.2, kernels-and-math.md
section 2.2)::

    I[t, s] = sum_j w[t, j] * relu(q[t, j] . k[s])        j over index heads, w = weights_proj(x) * H^-0.5 * d^-0.5

Each query keeps the ``min(index_topk, s)`` keys with the largest causal-masked ``I[t, :]``; the sparse MLA
core then attends over only those. Slots that land on future keys (row ``t`` has just ``t + 1`` past keys)
become ``-1``.

The indexer learns only from a KL loss towards the main attention (section 2.4): its inputs ``x`` and ``qr``
arrive detached and the teacher is built from detached MLA queries/keys, so the indexer gets no gradient
from the LM loss and the model none from the KL.

Memory: an index score for every (query, head, key) would be ``[b, H, s, s]`` fp32 (NAM56R: 32 x 4096^2 x 4 B
= 2 GiB per sequence and layer). Scores and the attention teacher are therefore summed head by head into
``[b, s, s]``, and the score backward recomputes each head instead of saving it (``_IndexScores``).

The functions here are the reference. A DSA layer runs its scores and its sparse teacher through its indexer
kernels (kind ``indexer_kernels``: ``IndexerKernels.index_scores`` / ``sparse_teacher``): the ``reference``
backend calls ``index_scores`` and ``teacher_sparse`` below, a kernel backend fuses the head loops.

The FP8 path's Hadamard rotation of q and k is left out: an orthonormal rotation applied to both sides leaves
every dot product unchanged, and it exists only to spread outliers before FP8 quantisation (section 2.5).

Every step is branchless on tensor values (``topk``, ``where``, ``masked_fill``; no ``.item()``, no
``nonzero``), so the whole path is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from nam56r.backends import IndexerKernels, IndexerStrategy
from nam56r.blocks.rope import apply_rope_halves
from nam56r.config import NAM56RConfig
from nam56r.state import ForwardState

__all__ = [
    "FullIndexer",
    "IndexerStrategy",
    "LightningIndexer",
    "causal_topk",
    "gather_keys",
    "index_scores",
    "indexer_kl_dense",
    "indexer_kl_dense_rows",
    "indexer_kl_sparse",
    "live_slots",
    "teacher_sparse",
]

# Probabilities below this are clamped inside log(p); Megatron's DSA loss uses the same 1e-10 floor.
_LOG_FLOOR = 1e-10


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    # fp32 accumulate; float64 stays float64 so CPU parity tests are exact.
    return torch.promote_types(t.dtype, torch.float32)


def _future(s: int, device: torch.device) -> torch.Tensor:
    """``[s, s]`` bool, True where the key comes after the query."""
    return torch.ones(s, s, dtype=torch.bool, device=device).triu(1)


# --- scores ---------------------------------------------------------------------------------------
class _IndexScores(torch.autograd.Function):
    """``I[b, t, s] = sum_j w[b, t, j] * relu(q[b, t, j] . k[b, s])``, one head at a time.

    Autograd over a Python loop would save every head's ``[b, s, s]`` ReLU output, i.e. the very
    ``[b, H, s, s]`` the loop avoids; this Function saves only q, k, w and recomputes each head in backward.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # q [b, s, H, d], k [b, s, d], w [b, s, H] -> [b, s, s]
        ctx.save_for_backward(q, k, w)
        k_t = k.transpose(1, 2)  # [b, d, s]
        out = q.new_zeros(q.shape[0], q.shape[1], k.shape[1])
        for j in range(q.shape[2]):
            out += w[:, :, j, None] * torch.relu(torch.bmm(q[:, :, j], k_t))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        q, k, w = ctx.saved_tensors
        dq, dk, dw = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(w)
        k_t = k.transpose(1, 2)
        for j in range(q.shape[2]):
            logits = torch.bmm(q[:, :, j], k_t)  # [b, s, s], recomputed
            dw[:, :, j] = (grad * torch.relu(logits)).sum(-1)
            d_logits = grad * w[:, :, j, None] * (logits > 0)
            dq[:, :, j] = torch.bmm(d_logits, k)
            dk += torch.bmm(d_logits.transpose(1, 2), q[:, :, j])
        return dq, dk, dw


class LightningIndexer(nn.Module):
    """Index scores ``[b, s, s]`` from the block input ``x`` and MLA's query latent ``qr`` (both detached).

    The module owns the projections; ``core.index_scores`` (its DSA layer's ``indexer_kernels`` backend) owns
    the score math, so a kernel backend takes over both the scores and the KL teacher of the layer.
    """

    def __init__(self, cfg: NAM56RConfig, core: IndexerKernels):
        super().__init__()
        self.cfg = cfg
        self.core = core
        self.heads, self.head_dim = cfg.index_heads, cfg.index_head_dim
        # The leading rope_dim channels rotate, the rest do not (DeepSeek-V3.2 puts the rope part first).
        # NAM56R: min(64, 64) = 64, so its indexer heads are rotary end to end.
        self.rope_dim = min(cfg.qk_rope_dim, cfg.index_head_dim)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)  # eps 1e-6: DeepSeek-V3.2 LayerNorm default
        # DeepSeek keeps weights_proj in fp32 (inference/model.py); a mixed-precision cast of the model
        # should exempt it. Its product is taken in fp32 below whatever its storage dtype.
        self.weights_proj = nn.Linear(cfg.hidden, self.heads, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) projections; k_norm resets itself (weight 1, bias 0)."""
        for linear in (self.wq_b, self.wk, self.weights_proj):
            nn.init.normal_(linear.weight, std=self.cfg.init_std)

    def _rotate(self, t: torch.Tensor) -> torch.Tensor:
        """Non-interleaved RoPE on the first ``rope_dim`` channels of ``t [b, s, ..., d]``."""
        rope, rest = t.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope_halves(rope, self.cfg.rope_theta), rest), dim=-1)

    def inputs(self, x: torch.Tensor, qr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The score inputs: rotated ``q [b, s, H, d]`` and ``k [b, s, d]`` in the model's dtype, and the head
        weights ``w [b, s, H]`` in fp32 (fp64 for fp64 inputs). A fused kernel takes these three."""
        acc = _acc_dtype(x)
        q = self._rotate(self.wq_b(qr).unflatten(-1, (self.heads, self.head_dim)))  # [b, s, H, d]
        k = self._rotate(self.k_norm(self.wk(x)))  # [b, s, d]: one key head shared by all index heads
        # Head weights: H^-0.5 * d^-0.5 as in DeepSeek-V3.2's Indexer (tilelang's finetune example instead
        # scales after the head sum; the two differ only by a constant temperature).
        w = F.linear(x.to(acc), self.weights_proj.weight.to(acc)) * (self.heads**-0.5 * self.head_dim**-0.5)
        return q, k, w

    def forward(self, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        """``x [b, s, hidden]``, ``qr [b, s, q_lora]`` -> fp32 scores ``[b, s, s]``, ``-inf`` on future keys."""
        return self.core.index_scores(*self.inputs(x, qr))


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Causal-masked scores ``[b, s, s]`` in ``w``'s dtype from ``q [b, s, H, d]``, ``k [b, s, d]``, ``w [b, s, H]``.

    The reference ``IndexerKernels.index_scores``.
    """
    acc = w.dtype
    scores = _IndexScores.apply(q.to(acc), k.to(acc), w)  # [b, s, s]
    return scores.masked_fill(_future(q.shape[1], q.device), float("-inf"))


# --- selection ------------------------------------------------------------------------------------
def causal_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-``min(topk, s)`` key positions per query from causal-masked ``scores [b, s, s]``.

    Returns ``[b, s, k]`` int64. A row ``t`` with fewer than ``k`` past keys picks some future keys (score
    ``-inf``); those slots become ``-1``, decided by position, not by score value.
    """
    s = scores.shape[-1]
    indices = scores.detach().topk(min(topk, s), dim=-1).indices  # [b, s, k]
    query_pos = torch.arange(s, device=scores.device).view(1, s, 1)
    return torch.where(indices > query_pos, -1, indices)


def live_slots(indices: torch.Tensor) -> torch.Tensor:
    """``[b, s, k]`` bool: the slot names a key at or before its query (``0 <= index <= t``)."""
    s = indices.shape[1]
    query_pos = torch.arange(s, device=indices.device).view(1, s, 1)
    return (indices >= 0) & (indices <= query_pos)


def gather_keys(kv: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows of ``kv [b, s, dk]`` at ``indices [b, s, k]`` -> ``[b, s, k, dk]`` (-1 reads row 0: mask it).

    Indexes the flattened ``[b*s, dk]`` table, so the backward is an ``index_add`` into ``[b*s, dk]``
    rather than a scatter into a broadcast ``[b, s, s, dk]``.
    """
    b, s, dk = kv.shape
    k = indices.shape[-1]
    batch_offset = torch.arange(b, device=indices.device).view(b, 1, 1) * s
    flat = (indices.clamp(min=0) + batch_offset).reshape(-1)  # [b*s*k]
    return kv.reshape(b * s, dk).index_select(0, flat).view(b, s, k, dk)


class FullIndexer:
    """Indexer strategy ``full``: every DSA layer runs its own indexer and top-k."""

    name = "full"

    def select(
        self, layer: nn.Module, x: torch.Tensor, qr: torch.Tensor, state: ForwardState | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = layer.indexer(x, qr)  # [b, s, s]
        return causal_topk(scores, layer.cfg.index_topk), scores


# --- KL loss --------------------------------------------------------------------------------------
@torch.no_grad()
def _teacher_dense(q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
    """Head-summed causal attention, L1-normalised: ``[b, s, s]``. ``q [b, s, h, dk]``, ``kv [b, s, dk]``."""
    acc = _acc_dtype(q)
    q, kv_t = q.detach().to(acc), kv.detach().to(acc).transpose(1, 2)  # kv_t [b, dk, s]
    future = _future(q.shape[1], q.device)
    total = q.new_zeros(q.shape[0], q.shape[1], q.shape[1])
    for h in range(q.shape[2]):
        logits = torch.bmm(q[:, :, h], kv_t) * scale  # [b, s, s]
        total += logits.masked_fill_(future, float("-inf")).softmax(dim=-1)
    return total / total.sum(-1, keepdim=True)


@torch.no_grad()
def teacher_sparse(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """As ``_teacher_dense`` but each head's softmax runs over the top-k set only: ``[b, s, k]``, dead slots 0.

    ``indices [b, s, k]`` as ``causal_topk`` returns them. The reference ``IndexerKernels.sparse_teacher``;
    a kernel backend replaces it (``indexer_kl_sparse(..., teacher=...)``).
    """
    acc = _acc_dtype(q)
    q = q.detach().to(acc)
    picked = gather_keys(kv.detach().to(acc), indices)  # [b, s, k, dk]
    live = live_slots(indices)
    total = q.new_zeros(indices.shape)
    for h in range(q.shape[2]):
        logits = torch.einsum("btd,btkd->btk", q[:, :, h], picked) * scale
        total += logits.masked_fill_(~live, torch.finfo(acc).min).softmax(dim=-1) * live
    return total / total.sum(-1, keepdim=True).clamp(min=torch.finfo(acc).tiny)


def _kl_rows(p: torch.Tensor, student: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Per query row, ``KL(p || softmax(student))`` restricted to ``live`` entries: ``[b, s]``."""
    # A finite fill keeps dead entries out of the softmax without -inf * 0 = NaN in forward or backward.
    log_q = student.masked_fill(~live, torch.finfo(student.dtype).min).log_softmax(dim=-1)
    terms = torch.where(live, p * (p.clamp(min=_LOG_FLOOR).log() - log_q), 0.0)
    return terms.sum(-1)


def indexer_kl_dense_rows(
    index_scores: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, scale: float
) -> torch.Tensor:
    """``indexer_kl_dense`` before the mean: one KL per query row, ``[b, s]``."""
    p = _teacher_dense(q, kv, scale)
    live = ~_future(index_scores.shape[-1], index_scores.device)
    return _kl_rows(p.to(index_scores.dtype), index_scores, live.expand_as(index_scores))


def indexer_kl_dense(index_scores: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, scale: float) -> torch.Tensor:
    """Warm-up loss (paper eq. 3): KL from the full causal attention to the indexer, mean over rows.

    ``index_scores [b, s, s]`` (graph to the indexer), ``q [b, s, h, dk]`` and ``kv [b, s, dk]`` MLA's
    absorbed query and KV (used detached), ``scale`` MLA's softmax scale. Returns an fp32 scalar.
    """
    return indexer_kl_dense_rows(index_scores, q, kv, scale).mean()


def indexer_kl_sparse(
    index_scores: torch.Tensor, indices: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, scale: float,
    *, teacher: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse-stage loss (paper eq. 4): as ``indexer_kl_dense`` with both sides restricted to ``indices``.

    ``teacher [b, s, k]``: the teacher distribution when the caller already has it (DSA passes its attention
    core's ``sparse_teacher``); None computes it here with the reference ``teacher_sparse``.
    """
    p = teacher_sparse(q, kv, indices, scale) if teacher is None else teacher  # [b, s, k]
    student = index_scores.gather(-1, indices.clamp(min=0))  # [b, s, k]
    return _kl_rows(p.to(index_scores.dtype), student, live_slots(indices)).mean()
