"""NAM56R configuration: one dataclass, every field documented where it is declared.

Recipes (``nam56r/recipes.py``) are functions that return a complete ``NAM56RConfig``; nothing else builds
one from scratch. Widths that NAM56R's published description fixes carry that source; widths it leaves open
carry the reason for the value chosen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class NAM56RConfig:
    """The model: layer pattern, widths of every block, and the backend names the blocks ask for."""

    name: str = "nam56r"
    """Recipe name this config came from (for logs and run folders)."""

    # --- stack -------------------------------------------------------------------------------------
    pattern: str = "R*EME*EME*EMM*"
    """Layer pattern: a leading R puts the n-gram-hash head at the entrance; the period ``*EME*EME*EMM*``
    ends with the ``*`` that opens the next period (nam56r/pattern.py)."""
    num_layers: int = 52
    """Stack depth: 4 x 12 + 4 = 52 (NAM56R)."""
    mla_attention_ranks: tuple[int, ...] = (0, 4, 8, 12)
    """Attention slots (counted among ``*`` only) that are full MLA; every other slot is DSA (NAM56R)."""
    hidden: int = 4096
    """Model width (NAM56R)."""
    vocab_size: int = 131072
    """Vocabulary (NAM56R: 2**17)."""
    seq_len: int = 4096
    """Training sequence length (NAM56R)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon for every pre-norm and the final norm."""
    tie_embeddings: bool = False
    """Untied output head: part of the 4.73B total (the head is 537M parameters at 131072 x 4096)."""
    init_std: float = 0.02
    """Std of the normal init for projection weights."""

    # --- attention: MLA (and the MLA half of DSA) --------------------------------------------------
    attn_heads: int = 32
    """Attention heads (NAM56R: 32 heads of 128)."""
    q_lora_rank: int = 64
    """Query down-projection rank (NAM56R)."""
    kv_lora_rank: int = 64
    """Latent KV rank; the value width the absorbed kernels see (NAM56R)."""
    qk_nope_dim: int = 64
    """Per-head query/key width without RoPE (NAM56R)."""
    qk_rope_dim: int = 64
    """Per-head decoupled RoPE width; the rope key is shared by all heads (NAM56R)."""
    v_head_dim: int = 128
    """Per-head value width (NAM56R: 32 heads of 128)."""
    rope_theta: float = 10000.0
    """RoPE base for MLA and the indexer."""

    # --- DSA: lightning indexer --------------------------------------------------------------------
    index_heads: int = 32
    """Indexer heads (NAM56R; DeepSeek-V3.2 uses 64)."""
    index_head_dim: int = 64
    """Indexer head width (NAM56R; DeepSeek-V3.2 uses 128)."""
    index_topk: int = 256
    """Keys kept per query by the indexer (NAM56R; DeepSeek-V3.2 uses 2048)."""
    indexer_loss_coeff: float = 0.01
    """Weight of the indexer KL loss in the total loss."""
    dsa_dense_warmup: bool = False
    """True: DSA layers attend densely and train the indexer with the dense KL target (warmup stage)."""

    # --- Mamba-3 ----------------------------------------------------------------------------------
    d_state: int = 128
    """SSM state width N (NAM56R)."""
    mamba_expand: int = 2
    """d_inner = expand * hidden (NAM56R)."""
    mamba_headdim: int = 64
    """Head width P; 2 * 4096 / 64 = 128 heads (NAM56R)."""
    mamba_ngroups: int = 8
    """B/C groups G; heads share B/C in contiguous blocks of H/G (NAM56R)."""
    mamba_mimo_rank: int = 4
    """MIMO rank R; 1 means SISO (NAM56R: 4)."""
    mamba_chunk: int = 16
    """Chunk length of the chunked scan (NAM56R: 16 = 64 / rank)."""
    mamba_rope_fraction: float = 0.5
    """Share of the state dims that rotate (0.5 or 1.0; upstream Mamba-3 default 0.5)."""
    mamba_dt_min: float = 0.001
    mamba_dt_max: float = 0.1
    mamba_a_floor: float = 1e-4
    """A is clamped to at most -a_floor (upstream Mamba-3 default)."""
    mamba_compile_prelude: bool = False
    """True: the mixer's elementwise region between in_proj and the scan (dt, A*dt, B/C RMSNorm, the layout
    changes) runs as one ``torch.compile`` graph shared by every Mamba layer (bench/mamba_ssm.py measures it)."""

    # --- MoE --------------------------------------------------------------------------------------
    num_experts: int = 16
    """Routed experts (NAM56R)."""
    moe_topk: int = 4
    """Experts per token (NAM56R)."""
    moe_ffn_hidden: int = 160
    """Routed expert SwiGLU width. Unpublished. The rest of the model is fixed by published widths and
    comes to ~3.86B (Mamba-3 2.31B, embedding + untied head 1.07B, attention 0.24B, n-gram tables 0.13B,
    MTP 0.12B), leaving ~0.87B for 22 MoE layers of 16 experts + 1 shared: fine-grained experts of 160."""
    moe_shared_ffn_hidden: int = 576
    """Shared expert SwiGLU width. Unpublished: 576 (= 3.6 x the routed width, a multiple of 64) lands the
    total at 4.728B, within 0.05% of NAM56R's 4.73B (tests/test_model.py checks 1%)."""
    moe_aux_loss_coeff: float = 1e-2
    """Switch-style load-balancing loss weight."""

    # --- MTP --------------------------------------------------------------------------------------
    mtp_depths: int = 2
    """Multi-token-prediction depths (NAM56R)."""
    mtp_ffn_hidden: int = 640
    """Dense SwiGLU width in each MTP depth. Unpublished: 4 x the routed width, the width a token's 4 active
    experts add up to, so an MTP depth's MLP costs what a MoE layer's routed part costs."""
    mtp_loss_scale: float = 0.1
    """lambda in L_MTP = lambda / D * sum_k L_k (DeepSeek-V3 uses 0.3 then 0.1; Megatron default 0.1)."""

    # --- n-gram hash embedding --------------------------------------------------------------------
    ngram_orders: tuple[int, ...] = (2, 3)
    """N-gram orders hashed at the input (NAM56R)."""
    ngram_heads: int = 8
    """Hash heads per order (NAM56R)."""
    ngram_table: int = 500_000
    """Approximate rows per hash table; each table takes a prime near it (NAM56R)."""
    ngram_dim: int = 16
    """Width of one hash-table row (NAM56R)."""

    # --- structure-aware code signals ------------------------------------------------------------
    structure_vocab: int = 16
    """Number of per-token structure ids (nam56r/blocks/structure.py lists them)."""

    # --- backends: names looked up in the plugin registries (one field per kind of nam56r/kinds.py) -----
    ssm_backend: str = "reference"
    """Kind ``ssm``: who runs the Mamba-3 scan."""
    attention_backend: str = "reference"
    """Kind ``attention``: who runs MLA/DSA core attention."""
    indexer_kernels_backend: str = "reference"
    """Kind ``indexer_kernels``: who runs the DSA lightning indexer's scores and its sparse KL teacher."""
    indexer_backend: str = "full"
    """Kind ``indexer``: the DSA top-k strategy (``--set indexer=...`` still works)."""
    ce_backend: str = "reference"
    """Kind ``ce``: who runs the LM head + cross-entropy (main and MTP)."""
    moe_backend: str = "reference"
    """Kind ``moe``: who runs the routed experts' GEMMs (router and shared expert stay bf16)."""

    # --- derived ---------------------------------------------------------------------------------
    @property
    def indexer(self) -> str:
        """The field's name before issue 20 (read-only; ``indexer_backend`` is the field)."""
        return self.indexer_backend

    @property
    def d_inner(self) -> int:
        return self.mamba_expand * self.hidden

    @property
    def mamba_heads(self) -> int:
        return self.d_inner // self.mamba_headdim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    def replace(self, **changes) -> "NAM56RConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
