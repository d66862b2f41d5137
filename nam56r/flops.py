"""Model FLOPs per token of NAM56R: what turns a tokens/s measurement into model TFLOP/s per GPU.

Conventions (every function below follows them):

* A matmul of ``[m, k] x [k, n]`` costs ``2 * m * n * k`` FLOPs (one multiply-add = 2). Every count here is a
  sum of such products, per token of the main sequence (``s`` = sequence length).
* Elementwise work is excluded: norms, activations, softmax, RoPE, residual adds and gates, the Mamba-3
  decay / trapezoid weights / rotation, the MIMO rank expansion ``v * mimo_x`` and contraction
  ``sum_r o * mimo_o`` (``2 H R P`` per token), the indexer's ``w``-weighted sum over index heads (``2 H_I``
  per query-key pair), top-k selection, gathers, hashing and embedding lookups.
* Attention counts the keys a query actually uses: ``(s + 1) / 2`` on average for full causal attention
  (``causal_keys``), ``mean_t min(topk, t)`` for DSA's sparse attention (``sparse_keys``). Kernels that
  compute whole masked tiles do more work than this; that is hardware work, not model work.
* Training = 3 x forward (backward = grad w.r.t. inputs + grad w.r.t. weights, each as costly as the
  forward), applied to every block. It overcounts the parts that have no backward: the no-grad KL teacher
  and, in the dense warm-up, whatever the optimizer freezes (DeepSeek-V3.2 freezes all but the indexer).
* MTP depths are counted at full sequence length (labels rolled and masked, as Megatron does, not a shorter
  sequence); the ``s - k`` shortening would change them by ``k / s`` (0.05% at s = 4096).

Block keys of ``FlopReport.by_block``: ``mamba``, ``moe``, ``mla``, ``dsa`` (the main stack, counted from the
layer plan), ``mtp`` (eh_proj + MLA + SwiGLU of every depth; their output heads are in ``ce``), ``ce`` (the
output head of the main model and of every MTP depth), ``embedding`` (the n-gram hash ``out_proj``; token and
structure embeddings are lookups, 0 FLOPs).

NAM56R's own published figure is 289 TFLOP/s at ~9,250 tokens/s per GPU, i.e. ~31.2 GFLOP/token for
training. Its formula is not published; this module does not try to match it (tests/test_flops.py prints
what these formulas give for the full config).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from nam56r.config import NAM56RConfig
from nam56r.pattern import resolve
from nam_core.errors import ConfigError

BLOCKS = ("mamba", "moe", "mla", "dsa", "mtp", "ce", "embedding")
"""The keys of ``FlopReport.by_block``, in report order."""

TRAINING_FACTOR = 3
"""Forward + backward = 3 x forward (backward: 2 x forward, grads w.r.t. inputs and weights)."""


@dataclass
class FlopReport:
    """FLOPs per token of one configuration: the total and its split by block kind."""

    total: float
    """FLOPs per token, the sum of ``by_block``."""
    by_block: dict[str, float]
    """Per block kind (``BLOCKS``), FLOPs per token summed over every layer of that kind."""
    seq_len: int
    """Sequence length the attention terms were counted at."""
    training: bool
    """True: forward + backward (3 x forward); False: forward only."""
    dense_warmup: bool
    """True: DSA layers counted in the dense warm-up (dense attention + dense KL teacher)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --- how many keys a query sees -------------------------------------------------------------------
def causal_keys(s: int) -> float:
    """Mean keys per query of full causal attention over ``s`` tokens: ``(1 + 2 + ... + s) / s = (s + 1) / 2``."""
    return (s + 1) / 2


def sparse_keys(s: int, topk: int) -> float:
    """Mean live keys per query of top-k causal attention: ``mean_{t=1..s} min(k, t)``, ``k = min(topk, s)``.

    ``= (k (k + 1) / 2 + (s - k) k) / s``. NAM56R (s 4096, top-k 256): 248.03 (the first 255 queries have fewer
    than 256 past keys; their empty slots are masked, so they cost nothing useful).
    """
    k = min(topk, s)
    return (k * (k + 1) / 2 + (s - k) * k) / s


# --- Mamba-3 --------------------------------------------------------------------------------------
def mamba3_rope_angles(cfg: NAM56RConfig) -> int:
    """``S = floor_even(N * rope_fraction) / 2`` rotation angles per token (N 128, rope 0.5 -> 32; section 1.1)."""
    return int(cfg.d_state * cfg.mamba_rope_fraction) // 2 * 2 // 2


def mamba3_projection_flops(cfg: NAM56RConfig) -> float:
    """Mamba-3 projections per token: ``in_proj`` and ``out_proj`` (section 1.1).

    * in_proj  ``2 * hidden * (2 d_inner + 2 N G R + 3 H + S)``   (z, x, B, C, dt, A, trap, angles)
    * out_proj ``2 * d_inner * hidden``
    """
    h, d_inner = cfg.hidden, cfg.d_inner
    n, g, r, heads = cfg.d_state, cfg.mamba_ngroups, cfg.mamba_mimo_rank, cfg.mamba_heads
    in_width = 2 * d_inner + 2 * n * g * r + 3 * heads + mamba3_rope_angles(cfg)
    return 2 * h * in_width + 2 * d_inner * h


def mamba3_scan_flops(cfg: NAM56RConfig, s: int) -> float:
    """The chunked MIMO scan per token, as matmuls (chunk C, rank R, H heads of width P, state N).

    Per head and per token (a chunk's cost divided by its C tokens):

    * intra-chunk scores ``Q K^T`` over all rank pairs: ``[C R, N] x [N, C R]`` per chunk -> ``2 C R^2 N``
    * intra-chunk masked weights times V:  ``[C R, C R] x [C R, P]`` per chunk          -> ``2 C R^2 P``
    * inter-chunk state update ``S += K^T V``: ``[N, C R] x [C R, P]`` per chunk        -> ``2 R N P``
    * state readout ``y += Q S``:             ``[C R, N] x [N, P]`` per chunk           -> ``2 R N P``

    Sum ``H (2 C R^2 (N + P) + 4 R N P)``. The intra-chunk blocks count whole ``C x C`` tiles, as the kernels
    and the reference scan compute them (the causal mask zeroes their upper half afterwards). A sequence that
    is not a multiple of C is padded to one (reference and kernels both do), hence ``* ceil(s / C) C / s``.
    The serial state decay ``S = exp(sum a) S`` and the skip ``D v`` are elementwise and not counted.
    """
    c, r = cfg.mamba_chunk, cfg.mamba_mimo_rank
    n, p, heads = cfg.d_state, cfg.mamba_headdim, cfg.mamba_heads
    intra = 2 * c * r * r * (n + p)
    inter = 2 * r * n * p + 2 * r * n * p  # state update + state readout
    padded = math.ceil(s / c) * c
    return heads * (intra + inter) * padded / s


def mamba3_forward_flops(cfg: NAM56RConfig, s: int) -> float:
    """One Mamba-3 mixer layer, per token: ``mamba3_projection_flops + mamba3_scan_flops``."""
    return mamba3_projection_flops(cfg) + mamba3_scan_flops(cfg, s)


# --- MLA ------------------------------------------------------------------------------------------
def mla_projection_flops(cfg: NAM56RConfig) -> float:
    """MLA's projections per token in the absorbed form (section 3), heads ``n``, ``d_c = kv_lora``.

    * wq_a   ``2 * hidden * q_lora``
    * wq_b   ``2 * q_lora * n (nope + rope)``
    * wkv_a  ``2 * hidden * (d_c + rope)``
    * W_UK^T q_nope (query absorption)      ``2 * n * nope * d_c``
    * W_UV o_latent (value up-projection)   ``2 * n * d_c * v``
    * wo     ``2 * n * v * hidden``

    ``wkv_b`` never runs as a matmul of its own in the absorbed form: its two slices are the absorption and
    the up-projection above, which together cost exactly ``2 * d_c * n (nope + v)``, the ``wkv_b`` count.
    """
    h, n = cfg.hidden, cfg.attn_heads
    d_c, nope, rope, v = cfg.kv_lora_rank, cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.v_head_dim
    return (
        2 * h * cfg.q_lora_rank
        + 2 * cfg.q_lora_rank * n * (nope + rope)
        + 2 * h * (d_c + rope)
        + 2 * n * nope * d_c
        + 2 * n * d_c * v
        + 2 * n * v * h
    )


def mla_attention_flops(cfg: NAM56RConfig, keys: float) -> float:
    """Absorbed (MQA-form) attention per query over ``keys`` keys: one shared KV row for all ``n`` heads.

    * scores ``q . [c_kv ; k_rope]``:  ``2 * n * (d_c + rope) * keys``
    * probabilities times latent values ``c_kv``: ``2 * n * d_c * keys``
    """
    n, d_c = cfg.attn_heads, cfg.kv_lora_rank
    return 2 * n * (d_c + cfg.qk_rope_dim) * keys + 2 * n * d_c * keys


def mla_forward_flops(cfg: NAM56RConfig, s: int) -> float:
    """One full (causal) MLA layer per token: ``mla_projection_flops + mla_attention_flops(causal_keys(s))``."""
    return mla_projection_flops(cfg) + mla_attention_flops(cfg, causal_keys(s))


# --- DSA ------------------------------------------------------------------------------------------
def indexer_projection_flops(cfg: NAM56RConfig) -> float:
    """Lightning indexer projections per token (section 2.2), ``H_I`` heads of ``d_I``.

    * wq_b          ``2 * q_lora * H_I d_I``   (its input is MLA's query latent ``qr``)
    * wk            ``2 * hidden * d_I``       (one key head shared by all index heads)
    * weights_proj  ``2 * hidden * H_I``
    """
    hi, di = cfg.index_heads, cfg.index_head_dim
    return 2 * cfg.q_lora_rank * hi * di + 2 * cfg.hidden * di + 2 * cfg.hidden * hi


def indexer_score_flops(cfg: NAM56RConfig, keys: float) -> float:
    """Index scores per query over ``keys`` keys: ``q_j . k`` for every index head, ``2 * H_I * d_I * keys``.

    The scorer always runs over the whole causal context (it chooses the top-k from it). Its ``w``-weighted
    ReLU sum over heads (``2 * H_I * keys``, 1/d_I of this term) is elementwise and not counted.
    """
    return 2 * cfg.index_heads * cfg.index_head_dim * keys


def indexer_teacher_flops(cfg: NAM56RConfig, keys: float) -> float:
    """KL teacher per query: each attention head's scores again, detached, ``2 * n * (d_c + rope) * keys``.

    Dense warm-up: over all causal keys; sparse stage: over the top-k keys (nam56r/blocks/dsa.py computes the
    top-k-restricted KL in the sparse stage too, DeepSeek-V3.2 eq. 4). No values are read, so no ``p V`` term.
    """
    return 2 * cfg.attn_heads * (cfg.kv_lora_rank + cfg.qk_rope_dim) * keys


def dsa_forward_flops(cfg: NAM56RConfig, s: int, *, dense_warmup: bool = False) -> float:
    """One DSA layer per token: MLA projections + indexer + attention + KL teacher.

    ``mla_projection_flops + indexer_projection_flops + indexer_score_flops(causal_keys(s))
    + mla_attention_flops(keys) + indexer_teacher_flops(keys)``, with ``keys = sparse_keys(s, topk)`` in the
    sparse stage and ``causal_keys(s)`` in the dense warm-up (attention dense, teacher dense).
    """
    keys = causal_keys(s) if dense_warmup else sparse_keys(s, cfg.index_topk)
    return (
        mla_projection_flops(cfg)
        + indexer_projection_flops(cfg)
        + indexer_score_flops(cfg, causal_keys(s))
        + mla_attention_flops(cfg, keys)
        + indexer_teacher_flops(cfg, keys)
    )


# --- MoE, MTP, head, embedding --------------------------------------------------------------------
def swiglu_flops(hidden: int, ffn: int) -> float:
    """One SwiGLU per token: gate, up and down, three ``hidden x ffn`` matmuls: ``3 * 2 * hidden * ffn``."""
    return 3 * 2 * hidden * ffn


def moe_forward_flops(cfg: NAM56RConfig) -> float:
    """One MoE layer per token, active experts only.

    * router  ``2 * hidden * num_experts``
    * routed  ``moe_topk * 6 * hidden * moe_ffn_hidden``   (only the k chosen experts run)
    * shared  ``6 * hidden * moe_shared_ffn_hidden``

    The reference MoE (nam56r/blocks/moe.py) runs every expert on every token and zeroes the unchosen ones:
    hardware work ``num_experts / moe_topk`` times the routed term, model work unchanged.
    """
    h = cfg.hidden
    return (
        2 * h * cfg.num_experts
        + cfg.moe_topk * swiglu_flops(h, cfg.moe_ffn_hidden)
        + swiglu_flops(h, cfg.moe_shared_ffn_hidden)
    )


def mtp_depth_forward_flops(cfg: NAM56RConfig, s: int) -> float:
    """One MTP depth per token, without its output head (counted in ``ce``; section 10).

    * eh_proj ``Linear(2 hidden, hidden)``: ``2 * 2 hidden * hidden``
    * one full causal MLA layer: ``mla_forward_flops(cfg, s)``
    * one dense SwiGLU of width ``mtp_ffn_hidden``: ``6 * hidden * mtp_ffn_hidden``
    """
    h = cfg.hidden
    return 2 * (2 * h) * h + mla_forward_flops(cfg, s) + swiglu_flops(h, cfg.mtp_ffn_hidden)


def ce_forward_flops(cfg: NAM56RConfig) -> float:
    """One output head per token: ``2 * hidden * vocab_size`` (the softmax / CE itself is elementwise)."""
    return 2 * cfg.hidden * cfg.vocab_size


def ngram_forward_flops(cfg: NAM56RConfig) -> float:
    """N-gram hash embedding per token: ``out_proj``, ``2 * (len(orders) * ngram_heads * ngram_dim) * hidden``.

    Hashing and the table lookup are integer work and a gather: 0 FLOPs.
    """
    return 2 * len(cfg.ngram_orders) * cfg.ngram_heads * cfg.ngram_dim * cfg.hidden


# --- the whole model ------------------------------------------------------------------------------
def flops_per_token(
    cfg: NAM56RConfig, *, seq_len: int | None = None, dense_warmup: bool | None = None, training: bool = True
) -> FlopReport:
    """Model FLOPs per token of ``cfg`` at ``seq_len`` (default ``cfg.seq_len``), split by block kind.

    Layer counts come from the layer plan (``nam56r.pattern.resolve``); ``dense_warmup`` defaults to
    ``cfg.dsa_dense_warmup``. The n-gram hash ``out_proj`` counts only when the plan has the n-gram head
    (pattern starting with ``R``), as the plan decides whether the model has one.
    """
    s = cfg.seq_len if seq_len is None else seq_len
    if s < 1:
        raise ConfigError(f"seq_len must be a positive token count, found {s}", hint="e.g. --set seq_len=4096")
    warmup = cfg.dsa_dense_warmup if dense_warmup is None else dense_warmup
    plan = resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks)
    n = plan.counts()
    forward = {
        "mamba": n["mamba"] * mamba3_forward_flops(cfg, s),
        "moe": n["moe"] * moe_forward_flops(cfg),
        "mla": n["mla"] * mla_forward_flops(cfg, s),
        "dsa": n["dsa"] * dsa_forward_flops(cfg, s, dense_warmup=warmup),
        "mtp": cfg.mtp_depths * mtp_depth_forward_flops(cfg, s),
        "ce": (1 + cfg.mtp_depths) * ce_forward_flops(cfg),
        "embedding": ngram_forward_flops(cfg) if plan.ngram_head else 0.0,
    }
    factor = TRAINING_FACTOR if training else 1
    by_block = {k: float(factor * forward[k]) for k in BLOCKS}
    return FlopReport(
        total=sum(by_block.values()), by_block=by_block, seq_len=s, training=training, dense_warmup=warmup
    )


def tflops_per_device(cfg: NAM56RConfig, tokens_per_s_per_device: float, **kwargs) -> float:
    """Model TFLOP/s per device: training ``flops_per_token(cfg, **kwargs).total * tokens/s / 1e12``."""
    return flops_per_token(cfg, **kwargs).total * tokens_per_s_per_device / 1e12
