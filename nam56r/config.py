"""NAM56R configuration: one dataclass, every field documented where it is declared.

Recipes (``nam56r/recipes.py``) are functions that return a complete ``NAM56RConfig``; nothing else builds
one from scratch. Widths that NAM56R's published description fixes carry that source; widths it leaves open
carry the reason for the value chosen.

Each field declares what it allows where it is declared (``bounded``, nam_core/bounds.py), and ``RULES``
relate fields to each other; the composition root (``nam56r.run.resolve``) checks both before anything is
written, so a bad ``--set`` fails in a second, not as a shape error in the middle of building the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from nam_core.bounds import Rule, bounded


@dataclass(kw_only=True)
class NAM56RConfig:
    """The model: layer pattern, widths of every block, and the backend names the blocks ask for."""

    name: str = "nam56r"
    """Recipe name this config came from (for logs and run folders)."""

    # --- stack -------------------------------------------------------------------------------------
    pattern: str = "R*EME*EME*EMM*"
    """Layer pattern: a leading R puts the n-gram-hash head at the entrance; the period ``*EME*EME*EMM*``
    ends with the ``*`` that opens the next period (nam56r/pattern.py)."""
    num_layers: int = bounded(52, ge=1, aka=("n_layers", "num_hidden_layers", "layers", "depth"))
    """Stack depth: 4 x 12 + 4 = 52 (NAM56R)."""
    mla_attention_ranks: tuple[int, ...] = bounded((0, 4, 8, 12), ge=0)
    """Attention slots (counted among ``*`` only) that are full MLA; every other slot is DSA (NAM56R)."""
    hidden: int = bounded(4096, ge=1, aka=("hidden_size", "d_model", "dim", "n_embd", "width"))
    """Model width (NAM56R)."""
    vocab_size: int = bounded(131072, ge=1, aka=("vocab", "n_vocab"))
    """Vocabulary (NAM56R: 2**17)."""
    seq_len: int = bounded(4096, ge=1, aka=("seq_length", "max_seq_len", "context_length", "block_size", "n_ctx"))
    """Training sequence length (NAM56R)."""
    norm_eps: float = bounded(1e-5, gt=0, aka=("rms_norm_eps", "layernorm_epsilon"))
    """RMSNorm epsilon for every pre-norm and the final norm."""
    tie_embeddings: bool = False
    """Untied output head: part of the 4.73B total (the head is 537M parameters at 131072 x 4096)."""
    init_std: float = bounded(0.02, gt=0, aka=("initializer_range",))
    """Std of the normal init for projection weights."""

    # --- attention: MLA (and the MLA half of DSA) --------------------------------------------------
    attn_heads: int = bounded(32, ge=1, aka=("heads", "n_heads", "num_heads", "num_attention_heads", "n_head"))
    """Attention heads (NAM56R: 32 heads of 128)."""
    q_lora_rank: int = bounded(64, ge=1)
    """Query down-projection rank (NAM56R)."""
    kv_lora_rank: int = bounded(64, ge=1)
    """Latent KV rank; the value width the absorbed kernels see (NAM56R)."""
    qk_nope_dim: int = bounded(64, ge=1, aka=("qk_nope_head_dim",))
    """Per-head query/key width without RoPE (NAM56R)."""
    qk_rope_dim: int = bounded(64, ge=2, multiple_of=2, note="RoPE rotates pairs", aka=("qk_rope_head_dim",))
    """Per-head decoupled RoPE width; the rope key is shared by all heads (NAM56R)."""
    v_head_dim: int = bounded(128, ge=1)
    """Per-head value width (NAM56R: 32 heads of 128)."""
    rope_theta: float = bounded(10000.0, gt=0, aka=("rotary_base", "rope_base"))
    """RoPE base for MLA and the indexer."""

    # --- DSA: lightning indexer --------------------------------------------------------------------
    index_heads: int = bounded(32, ge=1, aka=("index_n_heads",))
    """Indexer heads (NAM56R; DeepSeek-V3.2 uses 64)."""
    index_head_dim: int = bounded(64, ge=1)
    """Indexer head width (NAM56R; DeepSeek-V3.2 uses 128)."""
    index_topk: int = bounded(256, ge=1, aka=("topk", "dsa_topk"))
    """Keys kept per query by the indexer (NAM56R; DeepSeek-V3.2 uses 2048)."""
    indexer_loss_coeff: float = bounded(0.01, ge=0)
    """Weight of the indexer KL loss in the total loss."""
    dsa_dense_warmup: bool = False
    """True: DSA layers attend densely and train the indexer with the dense KL target (warmup stage)."""

    # --- Mamba-3 ----------------------------------------------------------------------------------
    d_state: int = bounded(128, ge=1, aka=("state_dim", "ssm_state_size"))
    """SSM state width N (NAM56R)."""
    mamba_expand: int = bounded(2, ge=1, aka=("expand",))
    """d_inner = expand * hidden (NAM56R)."""
    mamba_headdim: int = bounded(64, ge=1, aka=("headdim", "mamba_head_dim"))
    """Head width P; 2 * 4096 / 64 = 128 heads (NAM56R)."""
    mamba_ngroups: int = bounded(8, ge=1, aka=("ngroups", "n_groups"))
    """B/C groups G; heads share B/C in contiguous blocks of H/G (NAM56R)."""
    mamba_mimo_rank: int = bounded(4, ge=1, note="1: SISO", aka=("mimo_rank",))
    """MIMO rank R; 1 means SISO (NAM56R: 4)."""
    mamba_chunk: int = bounded(16, ge=1, aka=("chunk_size", "mamba_chunk_size"))
    """Chunk length of the chunked scan (NAM56R: 16 = 64 / rank)."""
    mamba_rope_fraction: float = bounded(0.5, choices=(0.5, 1.0))
    """Share of the state dims that rotate (0.5 or 1.0; upstream Mamba-3 default 0.5)."""
    mamba_dt_min: float = bounded(0.001, gt=0, aka=("dt_min",))
    mamba_dt_max: float = bounded(0.1, gt=0, aka=("dt_max",))
    mamba_a_floor: float = bounded(1e-4, ge=0)
    """A is clamped to at most -a_floor (upstream Mamba-3 default)."""
    mamba_compile_prelude: bool = False
    """True: the mixer's elementwise region between in_proj and the scan (dt, A*dt, B/C RMSNorm, the layout
    changes) runs as one compiled region shared by every Mamba layer (nam56r/regions.py; bench/mamba3_layer.py
    and bench/glue.py measure it)."""
    mamba_split_in_proj: bool = False
    """True: the mixer's in_proj runs as three GEMMs on row slices of its one weight (z, x, the rest), so z and x
    reach the scan's kernels contiguous, without the two [b, l, d_inner] copies per forward (and per
    ``mamba-scan`` replay) that slicing one output costs (~22 ms of the MBS 4 step: bench/results/glue.md);
    the backward sums three input gradients instead of concatenating one. Same parameter, same checkpoints.
    Refused when a plugin swapped in_proj (float8, te). Off until measured on the full model."""
    compile_glue: bool = False
    """True: the memory-bound steps between kernels that run faster as compiled regions (``torch.compile``,
    inductor: nam56r/regions.py) do: the grouped-moe experts' per-token row sums, the combine's forward and the
    dispatch's backward (``nam56r.experts.COMPILED_ROWS``; 2.27x eager on an H200 at MBS 4). The other regions
    bench/results/glue.md ranks measured slower compiled (gated SwiGLU 0.47x, the MIMO backward's group sums
    0.50x: ``mamba-ssm.group_sums=compiled`` still asks for those) and stay eager. Off until measured on the full
    model (``bench/glue.py`` times each region; ``bench/megatron.py throughput --train-set compile_glue=true`` the
    step). No fall-back: without inductor on the device, one ``CannotRunHere``; with another MoE backend, which
    reads none of it, a ConfigError."""

    # --- MoE --------------------------------------------------------------------------------------
    num_experts: int = bounded(16, ge=1, aka=("experts", "n_experts", "n_routed_experts", "num_moe_experts"))
    """Routed experts (NAM56R)."""
    moe_topk: int = bounded(4, ge=1, aka=("top_k", "num_experts_per_tok", "moe_router_topk", "experts_per_token"))
    """Experts per token (NAM56R)."""
    moe_ffn_hidden: int = bounded(160, ge=1, aka=("moe_intermediate_size", "expert_ffn_hidden"))
    """Routed expert SwiGLU width. Unpublished. The rest of the model is fixed by published widths and
    comes to ~3.86B (Mamba-3 2.31B, embedding + untied head 1.07B, attention 0.24B, n-gram tables 0.13B,
    MTP 0.12B), leaving ~0.87B for 22 MoE layers of 16 experts + 1 shared: fine-grained experts of 160."""
    moe_shared_ffn_hidden: int = bounded(576, ge=1, aka=("shared_expert_intermediate_size",))
    """Shared expert SwiGLU width. Unpublished: 576 (= 3.6 x the routed width, a multiple of 64) lands the
    total at 4.728B, within 0.05% of NAM56R's 4.73B (tests/test_model.py checks 1%)."""
    moe_aux_loss_coeff: float = bounded(1e-2, ge=0, aka=("aux_loss_coeff", "router_aux_loss_coef"))
    """Switch-style load-balancing loss weight."""

    # --- MTP --------------------------------------------------------------------------------------
    mtp_depths: int = bounded(2, ge=0, note="0: no MTP heads",
                              aka=("mtp", "num_nextn_predict_layers", "mtp_num_layers"))
    """Multi-token-prediction depths (NAM56R)."""
    mtp_ffn_hidden: int = bounded(640, ge=1)
    """Dense SwiGLU width in each MTP depth. Unpublished: 4 x the routed width, the width a token's 4 active
    experts add up to, so an MTP depth's MLP costs what a MoE layer's routed part costs."""
    mtp_loss_scale: float = bounded(0.1, ge=0, aka=("mtp_loss_scaling_factor",))
    """lambda in L_MTP = lambda / D * sum_k L_k (DeepSeek-V3 uses 0.3 then 0.1; Megatron default 0.1)."""

    # --- n-gram hash embedding --------------------------------------------------------------------
    ngram_orders: tuple[int, ...] = bounded((2, 3), ge=1)
    """N-gram orders hashed at the input (NAM56R)."""
    ngram_heads: int = bounded(8, ge=1)
    """Hash heads per order (NAM56R)."""
    ngram_table: int = bounded(500_000, ge=2, note="rows of a hash table (a prime near it)")
    """Approximate rows per hash table; each table takes a prime near it (NAM56R)."""
    ngram_dim: int = bounded(16, ge=1)
    """Width of one hash-table row (NAM56R)."""

    # --- structure-aware code signals ------------------------------------------------------------
    structure_vocab: int = bounded(16, ge=1)
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

    # --- relations between fields (each checked once every field is inside its own bound) ----------
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(("pattern", "num_layers", "mla_attention_ranks"), "a layer pattern that resolves",
             lambda c: _pattern_resolves(c)),
        Rule(("hidden", "mamba_expand", "mamba_headdim"), "mamba_expand * hidden divisible by mamba_headdim "
             "(Mamba-3 heads of mamba_headdim channels)", lambda c: c.d_inner % c.mamba_headdim == 0),
        Rule(("hidden", "mamba_expand", "mamba_headdim", "mamba_ngroups"), "mamba heads (mamba_expand * hidden / "
             "mamba_headdim) divisible by mamba_ngroups (heads share B/C in equal blocks)",
             lambda c: c.mamba_heads % c.mamba_ngroups == 0),
        Rule(("mamba_dt_min", "mamba_dt_max"), "mamba_dt_min <= mamba_dt_max",
             lambda c: c.mamba_dt_min <= c.mamba_dt_max),
        Rule(("moe_topk", "num_experts"), "moe_topk <= num_experts (a token is routed to moe_topk of the experts)",
             lambda c: c.moe_topk <= c.num_experts),
        Rule(("compile_glue", "moe_backend"), "compile_glue with moe_backend=grouped (what it compiles is the "
             "grouped-moe experts' row sums; the other MoE backends would run as without it)",
             lambda c: not c.compile_glue or c.moe_backend == "grouped"),
        Rule(("qk_rope_dim", "index_head_dim"), "min(qk_rope_dim, index_head_dim) even (the indexer rotates "
             "that many channels in pairs)", lambda c: min(c.qk_rope_dim, c.index_head_dim) % 2 == 0),
        Rule(("pattern", "ngram_orders"), "at least one n-gram order when the pattern starts with R (the "
             "n-gram-hash head)", lambda c: bool(c.ngram_orders) or not c.pattern.startswith("R")),
        Rule(("structure_vocab",), "structure_vocab >= the structure ids nam56r/blocks/structure.py defines",
             lambda c: c.structure_vocab >= _structure_ids()),
    )

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


def _pattern_resolves(cfg: NAM56RConfig) -> bool:
    """True, or the pattern's own ConfigError pointing at the bad symbol or slot."""
    from nam56r.pattern import resolve

    resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks)
    return True


def _structure_ids() -> int:
    from nam56r.blocks.structure import Structure

    return len(Structure)
