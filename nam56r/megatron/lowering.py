"""NAM56R lowered into Megatron-Core >= 0.19 terms, as plain data: pattern, stages, slots, arguments, gaps.

``lower(cfg, tp=, pp=, ep=, schedule=)`` returns a ``Lowering``: the hybrid layer pattern string, which stage
each pipeline rank's chunks hold (from the schedule), which class fills each ``HybridStackSubmodules`` slot
(and whether Megatron-Core or nam provides it), the ``MLATransformerConfig`` and ``HybridModel`` keyword
arguments, and what Megatron-Core lacks for this model with where the build covers it. The spec
(``nam56r.megatron.spec``) is built from these slots, and ``check_lowering`` refuses any gap the build does not
cover, so ``nam recipe show NAME --megatron-args`` reports exactly what a run would build.
``megatron_args(lowering)`` prints the same as Megatron command-line flags.

Nothing here imports megatron: the lowering is checked on any CPU (tests/test_megatron_lowering.py).
Section numbers (§) refer to ``shared/reference/megatron-core.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from nam56r.config import NAM56RConfig
from nam56r.kinds import kind
from nam56r.pattern import LayerPlan, resolve
from nam_core.engine.config import MOE_DISPATCHERS
from nam_core.engine.megatron.schedule import MEGATRON_SCHEDULES, MegatronSchedule, PipelineSchedule
from nam_core.errors import ConfigError

MEGATRON_CORE = ">=0.19"
"""`+` (MLA layer) arrived in core_v0.19.0; `D` in 0.18, `/` and `|` in 0.17 (§1.2)."""

# nam symbol -> Megatron hybrid symbol (§1.2, `class Symbols`). Fail-closed: a nam symbol missing here is a
# ConfigError, never a guess.
SYMBOL = {"M": "M", "E": "E", "A": "+", "D": "D"}
MLP = "-"  # dense MLP layer (`mlp_layer`): only inside NAM56R's MTP depths
MTP_SEPARATOR = "/"  # one `/`-part per MTP depth, all identical (§1.3 parse_hybrid_pattern)
PIPE = "|"  # pipeline-segment separator, main pattern only (§1.3 select_pipeline_segment)
MTP_DEPTH = "+-"  # nam's MTPDepth: one full-MLA layer, then one dense SwiGLU (nam56r/model.py)



@dataclass(frozen=True)
class Slot:
    """One module position in ``HybridStackSubmodules`` (or around the stack) and what fills it."""

    symbol: str
    """Megatron symbol the slot serves (`M`, `E`, `D`, `+`, `-`), or `model` for slots outside the stack."""
    path: str
    """Where the class goes, e.g. ``mamba_layer.submodules.mixer`` (0.19 ``hybrid_stack_spec``)."""
    module: str
    """Importable class path that fills the slot."""
    provider: str
    """``megatron``: Megatron-Core's own class; ``nam``: a nam56r block replaces Megatron's."""
    nam_block: str | None = None
    """The nam56r class this slot stands for (for a ``megatron`` slot: the parity oracle)."""
    adapter: str | None = None
    """The class the spec puts in the slot when it is not ``module`` itself: a nam block sits behind an
    adapter with the slot's call signature (``nam56r.megatron.slots``)."""
    adapter_params: dict = field(default_factory=dict)
    """Keyword arguments the spec gives the adapter (besides the shared ``Slots``)."""
    backends: dict[str, str] = field(default_factory=dict)
    """Backend kind (``nam56r.kinds``) -> the name the slot's nam block asks for (the kind's config field)."""
    kwargs: dict = field(default_factory=dict)
    """NAM56R dims the slot's module needs (nam config field names for nam blocks; config args otherwise)."""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Gap:
    """Something Megatron-Core lacks or gets wrong for NAM56R, and how nam covers it."""

    what: str
    megatron: str
    """What Megatron-Core does, with the reference section."""
    nam: str
    """How nam covers it."""
    covered_by: str | None
    """Where the build covers it, ``module:attribute`` (importable without megatron); None: nothing does yet."""
    status: str = ""
    """``covered`` or ``open``, from ``covered_by`` (an open gap refuses the run: ``check_lowering``)."""

    def __post_init__(self):
        object.__setattr__(self, "status", "covered" if self.covered_by else "open")


@dataclass(frozen=True)
class TransformerEngine:
    """Megatron-Core's Transformer Engine modules in the lowering (nam-plugin-te's options; ``te_lowering``)."""

    fp8: str = "off"
    """``te.fp8``: ``off`` or a TE recipe name (``TE_FP8_RECIPES``): Megatron's ``fp8``/``fp8_recipe``."""
    grouped_experts: bool = False
    """``te.experts=grouped``: Megatron's ``TEGroupedMLP`` in place of nam's experts slot."""
    fp8_param_gather: bool = False
    """``te.fp8_param_gather``: Megatron's TE modules keep FP8 weights (``fp8_param``), which its distributed
    optimizer all-gathers in FP8 (the DDP config's ``fp8_param_gather``, set from ``fp8_param``)."""
    moe_fusion: bool = False
    """``te.moe_fusion``: Megatron's ``moe_router_fusion`` and ``moe_permute_fusion`` (TE's fused router top-k
    and aux-loss scores; TE's fused permute, unpermute and chunk sort in the token dispatcher)."""


TE = "megatron.core.extensions.transformer_engine"
TE_FP8_RECIPES = {"delayed": "delayed", "current": "tensorwise", "blockwise": "blockwise", "mxfp8": "mxfp8"}
"""``te.fp8`` recipe -> Megatron's ``fp8_recipe`` (``Fp8Recipe``); all in the ``hybrid`` format (e4m3 forward,
e5m2 gradients) except blockwise and MXFP8, which Megatron runs in e4m3 whatever ``fp8`` says."""


@dataclass(frozen=True)
class Lowering:
    """NAM56R as Megatron-Core >= 0.19 sees it. JSON-serialisable through ``to_dict()``."""

    name: str
    megatron_core: str
    hybrid_layer_pattern: str
    """Main pattern (with `|` between pipeline stages when pp > 1), then one `/`-part per MTP depth."""
    main_pattern: str
    """The main pattern without `|`: one symbol per stack layer, in nam56r.pattern.resolve order."""
    mtp_pattern: str
    mtp_depths: int
    layers: tuple[dict, ...]
    """Per stack layer: index, nam symbol, Megatron symbol, dsa_rank, pipeline stage, Megatron layer_number."""
    slots: tuple[Slot, ...]
    config_args: dict
    """``MLATransformerConfig(**config_args)`` (§3, §4, §5, §6 field names)."""
    model_args: dict
    """``HybridModel(config, hybrid_stack_spec, **model_args)`` (§1.3)."""
    micro_batch_size: int
    schedule: str
    """``megatron`` (its own pp schedules, §7) or the ``train.schedule`` name of a registered schedule."""
    chunks: int
    """Model chunks per pipeline rank (the schedule's ``chunks_per_rank``)."""
    stage_map: tuple[tuple[int, ...], ...]
    """``stage_map[rank][chunk]``: the pipeline stage each chunk holds (the schedule's ``stage_of``). The
    pattern's `|` segments are the stages in stage order; where a chunk's stage is not Megatron's interleaved
    choice (segment ``vp * pp + rank``), the model builder picks the segment itself."""
    moe_dispatcher: str
    cuda_graphs: bool
    gaps: tuple[Gap, ...]
    notes: tuple[str, ...]
    recompute_in_slots: tuple[str, ...] = ()
    """``train.recompute`` kinds nam's slot adapters run under ``nam56r.recompute.checkpointed`` (``mamba``,
    ``attention``: Megatron's selective modules do not reach nam's blocks); ``layer`` and ``moe`` are Megatron's
    own recompute, in ``config_args`` (``recompute_args``)."""
    linears: str = "local"
    """``local``: Megatron's own linears where the spec builds one (the MTP projection and dense MLP, the shared
    expert); ``transformer_engine``: its TE modules there (``nam56r.megatron.spec``)."""

    @property
    def open_gaps(self) -> tuple[Gap, ...]:
        """Gaps no part of the build covers: ``check_lowering`` refuses the run while any remain."""
        return tuple(g for g in self.gaps if g.status == "open")

    @property
    def megatron_order(self) -> bool:
        """Every chunk holds the stage Megatron itself would give it (``vp * pp + rank``)."""
        pp = len(self.stage_map)
        return all(stage == chunk * pp + rank for rank, row in enumerate(self.stage_map)
                   for chunk, stage in enumerate(row))

    def to_dict(self) -> dict:
        """Plain JSON types only (tuples become lists), so ``json.loads(json.dumps(d)) == d``."""
        return _plain(dataclasses.asdict(self))


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# --- validation ---------------------------------------------------------------------------------------------


def _divides(what: str, value: int, by: int, option: str, hint: str) -> None:
    """ConfigError unless ``option=by`` is >= 1 and divides ``what=value``."""
    if by < 1:
        raise ConfigError(f"{option} must be >= 1, found {by}", hint=hint)
    if value % by:
        raise ConfigError(f"{option}={by} must divide {what}, found {what}={value} ({value} % {by} = {value % by})",
                          hint=hint)


def _check_parallel(cfg: NAM56RConfig, *, tp: int, pp: int, ep: int, chunks: int) -> None:
    # Stock MambaMixer asserts nheads % tp == 0 and ngroups % tp == 0 (§2); MLA splits heads over tp (§3).
    tp_hint = "choose --tp among the common divisors of attn_heads, mamba heads and mamba_ngroups"
    _divides("attn_heads", cfg.attn_heads, tp, "tp", tp_hint)
    _divides("mamba heads", cfg.mamba_heads, tp, "tp", tp_hint)
    _divides("mamba_ngroups", cfg.mamba_ngroups, tp, "tp", tp_hint)
    # Local experts = num_moe_experts / EP (§5).
    _divides("num_experts", cfg.num_experts, ep, "ep",
             f"choose --ep among the divisors of num_experts={cfg.num_experts}")
    # pp > 1: one `|` segment per stage, segment count divisible by pp (§1.3); uneven splits are not lowered.
    # The schedule's own layout rules (e.g. expert parallelism it cannot run) are its ``check_layout``.
    stages = pp * chunks
    _divides("num_layers", cfg.num_layers, stages, "pipeline stages" if stages != pp else "pp",
             f"choose --pp so that {stages // pp} x pp divides num_layers={cfg.num_layers}; an uneven stage split "
             "(num_layers_in_first/last_pipeline_stage) is not supported by the lowering yet")


def _schedule(schedule: str | PipelineSchedule) -> PipelineSchedule:
    """The schedule whose stages the lowering lays out: an object as given; a name of Megatron's own as
    Megatron's layout. Any other name (a plugin's, before the plugins are active: ``nam56r.run.resolve``) is
    lowered with Megatron's layout too; ``nam56r.run.activate`` lowers again with the registered schedule's
    instance, and ``NamMegatronModel.check`` refuses a lowering whose stages are not the schedule's."""
    if isinstance(schedule, PipelineSchedule):
        return schedule
    found = MegatronSchedule(schedule)
    if schedule not in MEGATRON_SCHEDULES:
        found.name = schedule
    return found


def _stage_map(schedule: PipelineSchedule, pp: int) -> tuple[tuple[int, ...], ...]:
    chunks = schedule.chunks_per_rank
    stage_map = tuple(tuple(schedule.stage_of(r, c, pp) for c in range(chunks)) for r in range(pp))
    if sorted(s for row in stage_map for s in row) != list(range(pp * chunks)):
        raise ConfigError(f"schedule {schedule.name!r} maps pp={pp} ranks x {chunks} chunk(s) to stages "
                          f"{[list(row) for row in stage_map]}, not to each of 0..{pp * chunks - 1} once",
                          hint="fix the schedule's stage_of")
    return stage_map


# --- pattern ------------------------------------------------------------------------------------------------


def _main_symbols(plan: LayerPlan, pattern: str) -> str:
    out = []
    for layer in plan.layers:
        if layer.symbol not in SYMBOL:
            raise ConfigError(f"layer {layer.index} of {pattern!r} resolved to {layer.symbol!r}, which has no "
                              f"Megatron hybrid symbol (known: {', '.join(SYMBOL)})",
                              hint="fix the pattern; nam56r/pattern.py lists the symbols")
        out.append(SYMBOL[layer.symbol])
    return "".join(out)


def _hybrid_pattern(main: str, stages: int, mtp_depths: int) -> str:
    stage = len(main) // stages
    staged = PIPE.join(main[i : i + stage] for i in range(0, len(main), stage))
    return MTP_SEPARATOR.join([staged] + [MTP_DEPTH] * mtp_depths)


# --- slots --------------------------------------------------------------------------------------------------


def _mla_kwargs(cfg: NAM56RConfig) -> dict:
    return {"hidden": cfg.hidden, "attn_heads": cfg.attn_heads, "q_lora_rank": cfg.q_lora_rank,
            "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_dim": cfg.qk_nope_dim, "qk_rope_dim": cfg.qk_rope_dim,
            "v_head_dim": cfg.v_head_dim, "rope_theta": cfg.rope_theta, "norm_eps": cfg.norm_eps}


ADAPTER_NOTE = ("nam blocks take (cfg, backend) and [b, s, h]; the slot passes (config, layer_number, "
                "pg_collection, ...) and [s, b, h] (§1.4): the adapter translates")
SLOTS = "nam56r.megatron.slots"
MOE = "nam56r.megatron.moe"
MODEL = "nam56r.megatron.model"


def _backends(cfg: NAM56RConfig, *kinds: str) -> dict[str, str]:
    """Kind -> the implementation the config names for it (the kind's field, ``nam56r.kinds``)."""
    return {k: getattr(cfg, kind(k).field) for k in kinds}


def _slots(cfg: NAM56RConfig, dispatcher: str) -> tuple[Slot, ...]:
    mla = _mla_kwargs(cfg)
    return (
        Slot("M", "mamba_layer", "megatron.core.ssm.mamba_layer.MambaLayer", "megatron",
             notes=("norm, mixer and mamba_bda come from the submodules below",)),
        Slot("M", "mamba_layer.submodules.norm", "megatron.core.transformer.torch_norm.WrappedTorchNorm",
             "megatron", kwargs={"normalization": "RMSNorm", "eps": cfg.norm_eps},
             notes=("the stock spec fuses the norm into a TE in_proj; a plugin mixer needs an explicit norm (§2)",)),
        Slot("M", "mamba_layer.submodules.mixer", "nam56r.blocks.mamba3.Mamba3Mixer", "nam",
             nam_block="nam56r.blocks.mamba3.Mamba3Mixer", adapter=f"{SLOTS}.MambaSlot",
             backends=_backends(cfg, "ssm"),
             kwargs={"hidden": cfg.hidden, "d_state": cfg.d_state, "mamba_expand": cfg.mamba_expand,
                     "mamba_headdim": cfg.mamba_headdim, "mamba_heads": cfg.mamba_heads,
                     "mamba_ngroups": cfg.mamba_ngroups, "mamba_mimo_rank": cfg.mamba_mimo_rank,
                     "mamba_chunk": cfg.mamba_chunk, "mamba_rope_fraction": cfg.mamba_rope_fraction,
                     "mamba_dt_min": cfg.mamba_dt_min, "mamba_dt_max": cfg.mamba_dt_max,
                     "mamba_a_floor": cfg.mamba_a_floor},
             notes=(ADAPTER_NOTE, "the mixer must return (out [s, b, h], None) (§2)")),
        Slot("E", "moe_layer", "megatron.core.transformer.transformer_layer.MoETransformerLayer", "megatron",
             notes=("pre_mlp_layernorm RMSNorm, mlp = MoELayer, mlp_bda (§1.2, 0.19 hybrid_stack_spec)",)),
        Slot("E", "moe_layer.submodules.mlp", "megatron.core.transformer.moe.moe_layer.MoELayer", "megatron",
             nam_block="nam56r.blocks.moe.MoE", adapter=f"{MOE}.NamMoELayer",
             kwargs={"num_moe_experts": cfg.num_experts, "moe_router_topk": cfg.moe_topk,
                     "moe_ffn_hidden_size": cfg.moe_ffn_hidden,
                     "moe_shared_expert_intermediate_size": cfg.moe_shared_ffn_hidden,
                     "moe_router_score_function": "softmax", "moe_router_load_balancing_type": "aux_loss",
                     "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff, "moe_token_dispatcher_type": dispatcher},
             notes=("softmax over the top-k logits = nam's renormalised top-k gates; aux_loss is the Switch loss "
                    "nam56r.blocks.moe.MoE computes",
                    f"dispatcher {dispatcher!r} (train.moe_dispatcher; 'flex' runs on DeepEP's kernels, §5)",
                    "NamMoELayer: Megatron's MoELayer; at EP = TP = 1 its dispatcher keeps the per-expert counts "
                    "on the device (nam56r/megatron/moe.py)")),
        Slot("E", "moe_layer.submodules.mlp.submodules.experts", "nam56r.backends.MoEExperts", "nam",
             nam_block="nam56r.blocks.moe.MoE", adapter=f"{MOE}.ExpertsSlot", backends=_backends(cfg, "moe"),
             kwargs={"num_moe_experts": cfg.num_experts, "moe_ffn_hidden_size": cfg.moe_ffn_hidden},
             notes=("this rank's experts stacked [E_local, 2f, d] / [E_local, d, f], run by the moe backend on the "
                    "dispatched rows (MoEExperts.sorted) instead of SequentialMLP's loop over experts",)),
        Slot("D", "dsa_layer", "megatron.core.transformer.transformer_layer.TransformerLayer", "megatron",
             notes=("input_layernorm RMSNorm, self_attention, self_attn_bda",)),
        Slot("D", "dsa_layer.submodules.self_attention", "nam56r.blocks.dsa.DSA", "nam",
             nam_block="nam56r.blocks.dsa.DSA", adapter=f"{SLOTS}.AttentionSlot", adapter_params={"sparse": True},
             backends=_backends(cfg, "attention", "indexer_kernels", "indexer"),
             kwargs={**mla, "index_heads": cfg.index_heads, "index_head_dim": cfg.index_head_dim,
                     "index_topk": cfg.index_topk, "indexer_loss_coeff": cfg.indexer_loss_coeff,
                     "dsa_dense_warmup": cfg.dsa_dense_warmup},
             notes=(ADAPTER_NOTE, "dsa_rank per layer comes from `layers` (IndexCache places Full/Shared by it)")),
        Slot("+", "mla_layer", "megatron.core.transformer.transformer_layer.TransformerLayer", "megatron",
             notes=("input_layernorm RMSNorm, self_attention, self_attn_bda",)),
        Slot("+", "mla_layer.submodules.self_attention", "nam56r.blocks.mla.MLA", "nam",
             nam_block="nam56r.blocks.mla.MLA", adapter=f"{SLOTS}.AttentionSlot", adapter_params={"sparse": False},
             backends=_backends(cfg, "attention"), kwargs=mla,
             notes=(ADAPTER_NOTE, "Megatron's MLASelfAttention + TEDotProductAttention would fit these dims; "
                    "nam's MLA keeps MLA and DSA on one projection code, one attention backend and "
                    "DeepSeek-V3 parameter names")),
        Slot("-", "mlp_layer", "megatron.core.ssm.mlp_layer.MLPLayer", "megatron", nam_block="nam56r.blocks.mlp.SwiGLU",
             kwargs={"ffn_hidden_size": cfg.mtp_ffn_hidden, "gated_linear_unit": True},
             notes=("only in the MTP depths: NAM56R's main stack has no dense MLP layer",)),
        Slot("model", "mtp_block_spec", "megatron.core.transformer.multi_token_prediction.MultiTokenPredictionBlock",
             "megatron", kwargs={"mtp_num_layers": cfg.mtp_depths, "mtp_loss_scaling_factor": cfg.mtp_loss_scale},
             notes=(f"each depth builds a HybridStack from {MTP_DEPTH!r} with the same slots (§6)",
                    "enorm/hnorm/layer_norm RMSNorm, eh_proj; check the [embedding, hidden] concat order against "
                    "nam's MTPDepth when converting checkpoints")),
        Slot("model", "embedding", "nam56r.blocks.ngram_hash.NgramHashEmbedding", "nam",
             nam_block="nam56r.blocks.ngram_hash.NgramHashEmbedding",
             kwargs={"ngram_orders": list(cfg.ngram_orders), "ngram_heads": cfg.ngram_heads,
                     "ngram_table": cfg.ngram_table, "ngram_dim": cfg.ngram_dim,
                     "structure_vocab": cfg.structure_vocab},
             notes=("added to Megatron's token embedding on the first pipeline stage, with "
                    "nam56r.blocks.structure.StructureEmbedding",)),
        Slot("model", "final_norm", "megatron.core.transformer.torch_norm.WrappedTorchNorm", "megatron",
             kwargs={"normalization": "RMSNorm", "eps": cfg.norm_eps},
             notes=("HybridStack hard-wires TENorm here (§1.4); the stack is built without it and NamHybridModel "
                    "applies this class (see gaps)",)),
        Slot("model", "output_layer", "megatron.core.tensor_parallel.layers.ColumnParallelLinear", "megatron",
             backends=_backends(cfg, "ce"),
             kwargs={"vocab_size": cfg.vocab_size, "hidden": cfg.hidden},
             notes=("keeps Megatron's weight and checkpoint keys; LM and MTP losses go through the active "
                    "ce backend instead of compute_language_model_loss (see gaps)",)),
    )


# --- arguments ----------------------------------------------------------------------------------------------


def _config_args(cfg: NAM56RConfig, *, tp: int, pp: int, ep: int, bf16: bool, num_layers: int,
                 dispatcher: str) -> dict:
    flex = {"moe_flex_dispatcher_backend": "deepep"} if dispatcher == "flex" else {}
    return {
        # Library users set num_layers (main-pattern length) and mtp_num_layers themselves (§1.3).
        "num_layers": num_layers,
        "hidden_size": cfg.hidden,
        "num_attention_heads": cfg.attn_heads,
        "ffn_hidden_size": cfg.mtp_ffn_hidden,  # the `-` layers exist only in MTP depths
        "gated_linear_unit": True,  # SwiGLU everywhere (nam56r/blocks/mlp.py)
        "activation_func": "silu",
        "normalization": "RMSNorm",
        "layernorm_epsilon": cfg.norm_eps,
        "add_bias_linear": False,  # DSA requires it (§4); nam's linears have no bias
        "init_method_std": cfg.init_std,
        # MLA (§3). Megatron's qk_head_dim is the no-RoPE part: nam's qk_nope_dim, not nam's qk_head_dim.
        "multi_latent_attention": True,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_head_dim": cfg.qk_nope_dim,
        "qk_pos_emb_head_dim": cfg.qk_rope_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_type": "rope",
        "rotary_base": cfg.rope_theta,
        # DSA (§4).
        "experimental_attention_variant": "dsa",
        "dsa_indexer_n_heads": cfg.index_heads,
        "dsa_indexer_head_dim": cfg.index_head_dim,
        "dsa_indexer_topk": cfg.index_topk,
        "dsa_indexer_loss_coeff": cfg.indexer_loss_coeff,
        "dsa_indexer_use_sparse_loss": not cfg.dsa_dense_warmup,
        # Mamba (§2): read by inference state shapes; nam's mixer reads the nam config.
        "mamba_state_dim": cfg.d_state,
        "mamba_head_dim": cfg.mamba_headdim,
        "mamba_num_groups": cfg.mamba_ngroups,
        "mamba_num_heads": cfg.mamba_heads,
        # MoE (§5).
        "num_moe_experts": cfg.num_experts,
        "moe_router_topk": cfg.moe_topk,
        "moe_ffn_hidden_size": cfg.moe_ffn_hidden,
        "moe_shared_expert_intermediate_size": cfg.moe_shared_ffn_hidden,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff,
        "moe_token_dispatcher_type": dispatcher,
        **flex,
        "moe_grouped_gemm": False,  # no Transformer Engine: SequentialMLP
        # MTP (§6).
        "mtp_num_layers": cfg.mtp_depths,
        "mtp_loss_scaling_factor": cfg.mtp_loss_scale,
        # Precision and parallelism.
        "bf16": bf16,
        "params_dtype": "bfloat16" if bf16 else "float32",
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "expert_model_parallel_size": ep,
    }


def _model_args(cfg: NAM56RConfig, pattern: str) -> dict:
    return {
        "vocab_size": cfg.vocab_size,
        "max_sequence_length": cfg.seq_len,
        "hybrid_layer_pattern": pattern,
        # MLA and DSA apply their own decoupled RoPE; HybridModel builds none with multi_latent_attention (§1.3).
        "position_embedding_type": "none",
        "share_embeddings_and_output_weights": cfg.tie_embeddings,
    }


MEGATRON_RECOMPUTES = {"layer": {"recompute_granularity": "full", "recompute_method": "uniform",
                                  "recompute_num_layers": 1},
                        "moe": {"recompute_granularity": "selective", "recompute_modules": ["moe"]}}
"""``train.recompute`` kinds Megatron-Core 0.19 recomputes itself: ``layer`` as its full recompute of every layer
of the hybrid stack and the MTP depths (``HybridStack.forward``'s checkpointed_forward, one layer per unit);
``moe`` as its selective ``moe`` module (``MoELayer``: router, dispatch, experts and combine). Its other
selective modules (``core_attn``, ``mla_up_proj``, ``moe_act``, ``layernorm``) recompute parts of Megatron's own
attention and experts, which NAM56R's slots replace, so nam recomputes Mamba and attention in its adapters."""
NAM_RECOMPUTES = ("mamba", "mamba-scan", "attention")


def recompute_args(kinds: Sequence[str]) -> tuple[dict, tuple[str, ...]]:
    """(Megatron config args, kinds nam's slots recompute) for the recompute ``kinds`` (expanded
    ``train.recompute``; ``layer`` comes alone, the train config's rule)."""
    if "layer" in kinds:
        return dict(MEGATRON_RECOMPUTES["layer"]), ()
    args = dict(MEGATRON_RECOMPUTES["moe"]) if "moe" in kinds else {}
    return args, tuple(k for k in NAM_RECOMPUTES if k in kinds)


def _te_args(te: TransformerEngine | None) -> dict:
    """Config arguments for Megatron's TE modules: grouped experts, and FP8 for every TE module the stack runs
    (Megatron wraps each layer's forward in TE's autocast with ``fp8_recipe``)."""
    if te is None:
        return {}
    if te.fp8 != "off" and te.fp8 not in TE_FP8_RECIPES:
        raise ConfigError(f"te.fp8={te.fp8!r}: expected off or one of {', '.join(TE_FP8_RECIPES)}",
                          hint="--set te.fp8=current")
    fp8 = {"fp8": "hybrid", "fp8_recipe": TE_FP8_RECIPES[te.fp8]} if te.fp8 != "off" else {}
    if te.fp8_param_gather:
        if not fp8:
            raise ConfigError("te.fp8_param_gather keeps Megatron's TE weights in FP8: it needs an FP8 recipe",
                              hint="--set te.fp8=current, or --set te.fp8_param_gather=false")
        fp8["fp8_param"] = True
    fusion = {"moe_router_fusion": True, "moe_permute_fusion": True} if te.moe_fusion else {}
    return {"moe_grouped_gemm": te.grouped_experts, **fp8, **fusion}


def _te_slots(slots: tuple[Slot, ...], te: TransformerEngine | None) -> tuple[Slot, ...]:
    """The slots with TE's RMSNorm (``TENorm``) for Megatron's norms and, with ``grouped_experts``, Megatron's
    ``TEGroupedMLP`` (one TE grouped GEMM per expert projection) in the experts slot."""
    if te is None:
        return slots
    norm = f"{TE}.TENorm"
    out = []
    for s in slots:
        if s.module == "megatron.core.transformer.torch_norm.WrappedTorchNorm":
            s = dataclasses.replace(s, module=norm)
        elif s.path.endswith(".experts") and te.grouped_experts:
            s = Slot(s.symbol, s.path, "megatron.core.transformer.moe.experts.TEGroupedMLP", "megatron",
                     nam_block=s.nam_block, kwargs=s.kwargs,
                     notes=("Megatron's TEGroupedMLP: TE GroupedLinear fc1/fc2 over this rank's experts (weight0.. "
                            "per expert; nam's stacked weights split by nam56r.megatron.weights)",))
        out.append(s)
    return tuple(out)


# --- gaps ---------------------------------------------------------------------------------------------------


def _gaps(cfg: NAM56RConfig, *, tp: int, schedule: PipelineSchedule) -> tuple[Gap, ...]:
    """What Megatron-Core lacks for NAM56R, each with the part of the build that covers it (the one place
    gap status is decided: a gap is covered exactly when ``covered_by`` names code the build runs)."""
    hybrid = f"{MODEL}:nam_hybrid_model_class"  # NamHybridModel subclasses Megatron's HybridModel lazily
    gaps = [
        Gap("Mamba-3 mixer",
            "no Mamba-3 (SISO or MIMO) in any release 0.16.1-0.19.2, main or dev; only community PR #5038 (§2)",
            "nam56r.blocks.mamba3.Mamba3Mixer in mamba_layer.submodules.mixer, scan from the ssm backend "
            f"(ssm_backend={cfg.ssm_backend!r})", f"{SLOTS}:MambaSlot"),
        Gap("DSA at NAM56R's MLA dims",
            "the fused TileLang sparse MLA only takes absorbed dims 576/512 and falls back to the O(s^2) "
            f"unfused path; NAM56R's is {cfg.kv_lora_rank + cfg.qk_rope_dim}/{cfg.kv_lora_rank} (§4)",
            f"nam56r.blocks.dsa.DSA in dsa_layer, core from the attention backend ({cfg.attention_backend!r}), "
            f"indexer scores and teacher from the indexer_kernels backend ({cfg.indexer_kernels_backend!r}), "
            f"top-k from the indexer backend ({cfg.indexer_backend!r})", f"{SLOTS}:AttentionSlot"),
        Gap("DSA indexer loss scale",
            "0.16-0.18 schedules never call DSAIndexerLossAutoScaler.set_loss_scale; 0.19 does it only for "
            "Megatron's own DSAttention (§4, §10 step 7)",
            "the attention adapter attaches the aux losses nam's DSA adds to its ForwardState (the indexer KL) "
            "through DSAIndexerLossAutoScaler, whose scale the 0.19 schedules set for "
            "experimental_attention_variant='dsa'", f"{SLOTS}:AttentionSlot.forward"),
        Gap("final norm",
            "HybridStack hard-wires TENorm as the final norm, not spec-configurable; without Transformer "
            "Engine it raises ImportError (§1.4, §9.2)",
            "the stack is built with post_layer_norm=False and NamHybridModel applies the final_norm slot's "
            "RMSNorm (Megatron's WrappedTorchNorm) before each CE head", hybrid),
        Gap("CE head",
            "the output layer's loss is compute_language_model_loss (native or te); the fused linear-CE module "
            "exists only on dev, Blackwell only (§6)",
            f"NamHybridModel computes the LM and MTP losses through the active ce backend ({cfg.ce_backend!r}), "
            "with the output weight kept in ColumnParallelLinear's checkpoint keys", hybrid),
        Gap("n-gram hash and structure embeddings",
            "LanguageModelEmbedding has the token table only",
            "NamHybridModel adds nam56r.blocks.ngram_hash.NgramHashEmbedding and "
            "nam56r.blocks.structure.StructureEmbedding on the first pipeline stage", hybrid),
        Gap("slot contract",
            "slots build with (config, layer_number, pg_collection, ...) and call with [s, b, h] (§1.4)",
            "one adapter per nam slot (Slot.adapter): builds the nam block from the nam config, transposes to "
            "[b, s, h], returns (out, None)", f"{SLOTS}:Slots"),
        Gap("fp32 SSM parameters under Float16Module",
            "Float16Module casts every parameter to bf16; no keep-fp32 list (§8)",
            "Mamba3Mixer._apply keeps D, dt_bias, B_bias, C_bias fp32 (the §8 plugin pattern)",
            "nam56r.blocks.mamba3:Mamba3Mixer._apply"),
    ]
    if tp > 1:
        gaps.append(Gap("tensor parallelism in nam slots",
                        "Megatron's own layers shard over tp; plugin modules must shard themselves (§2)",
                        f"nam's Mamba3Mixer, MLA and DSA have no tp sharding yet: tp={tp} needs them", None))
    if schedule.name != "megatron":
        gaps.append(Gap(f"{schedule.name} schedule",
                        "not one of Megatron-Core's pipeline schedules (§7)",
                        f"the schedules plugin registered as {schedule.name!r} drives the pipeline "
                        "(nam_core.engine.megatron.schedule.PipelineSchedule); NamMegatronModel builds each rank's "
                        f"{schedule.chunks_per_rank} chunk(s) at the stages it names",
                        "nam_core.engine.megatron.schedule:PipelineSchedule"))
    return tuple(gaps)


# --- entry points -------------------------------------------------------------------------------------------


def lower(
    cfg: NAM56RConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    micro_batch_size: int = 1,
    schedule: str | PipelineSchedule = "1f1b",
    bf16: bool = True,
    dispatcher: str = "alltoall",
    recompute: Sequence[str] = (),
    transformer_engine: TransformerEngine | None = None,
) -> Lowering:
    """Lower ``cfg`` for Megatron-Core >= 0.19 at the given tensor/pipeline/expert parallel sizes.

    ``schedule``: a ``PipelineSchedule`` (a registered schedule's instance), whose ``chunks_per_rank`` and
    ``stage_of`` lay out ``pp x chunks`` stages; or the run's ``train.schedule`` name, lowered with Megatron's
    layout (one chunk per rank). ``recompute``: the run's recompute kinds (``recompute_args``).
    ``transformer_engine``: Megatron's TE modules where it builds linears and norms (nam-plugin-te; None: its
    local ones). Raises ConfigError for a parallel layout the model or the lowering cannot take.
    """
    if dispatcher not in MOE_DISPATCHERS:  # train.moe_dispatcher (§5): Megatron's all-to-all, or flex on DeepEP
        raise ConfigError(f"MoE dispatcher {dispatcher!r}: expected one of {', '.join(MOE_DISPATCHERS)}",
                          hint="--set train.moe_dispatcher=alltoall")
    if micro_batch_size < 1:
        raise ConfigError(f"micro_batch_size must be >= 1, found {micro_batch_size}", hint="e.g. 1")
    sched = _schedule(schedule)
    chunks = sched.chunks_per_rank
    _check_parallel(cfg, tp=tp, pp=pp, ep=ep, chunks=chunks)
    stage_map = _stage_map(sched, pp)
    plan = resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks)
    main = _main_symbols(plan, cfg.pattern)
    pattern = _hybrid_pattern(main, pp * chunks, cfg.mtp_depths)
    stage = len(main) // (pp * chunks)
    where = {s: (r, c) for r, row in enumerate(stage_map) for c, s in enumerate(row)}
    layers = tuple(
        {"index": l.index, "nam": l.symbol, "megatron": main[l.index], "dsa_rank": l.dsa_rank,
         "pp_stage": l.index // stage, "pp_rank": where[l.index // stage][0], "chunk": where[l.index // stage][1],
         "layer_number": l.index + 1}  # Megatron's layer_number is 1-based, global
        for l in plan.layers
    )
    notes = [
        "D + '+' + M + E in one pattern is allowed; '*' may not appear with D or '+' (§1.3)",
        "EP all-to-all overlap (combined_1f1b) stays off: it needs GPTModel.build_schedule_plan and "
        f"mtp_num_layers <= 1, NAM56R has {cfg.mtp_depths} (§5)",
    ]
    megatron_recompute, slot_recompute = recompute_args(recompute)
    if megatron_recompute or slot_recompute:
        notes.append(f"activation recompute: Megatron's {megatron_recompute or 'none'}; nam's slots: "
                     f"{', '.join(slot_recompute) or 'none'}")
    last = where[pp * chunks - 1][0]
    if pp == 1:
        notes.append("CUDA graphs off: nam's config check refuses CUDA graphs at pp == 1")
    elif chunks > 1:
        notes.append(f"{pp * chunks} even stages of {stage} layers, {chunks} chunks per rank as schedule "
                     f"{sched.name!r} places them: rank {where[0][0]} holds the embeddings, rank {last} the MTP "
                     "depths and the output layer")
    else:
        notes.append(f"{pp} even stages of {stage} layers; the first also holds the embeddings, the last the MTP "
                     "depths and the output layer (§1.3: MTP is forced onto the last stage)")
    return Lowering(
        name=cfg.name,
        megatron_core=MEGATRON_CORE,
        hybrid_layer_pattern=pattern,
        main_pattern=main,
        mtp_pattern=MTP_DEPTH if cfg.mtp_depths else "",
        mtp_depths=cfg.mtp_depths,
        layers=layers,
        slots=_te_slots(_slots(cfg, dispatcher), transformer_engine),
        config_args={**_config_args(cfg, tp=tp, pp=pp, ep=ep, bf16=bf16, num_layers=len(main), dispatcher=dispatcher),
                     **megatron_recompute, **_te_args(transformer_engine)},
        model_args=_model_args(cfg, pattern),
        micro_batch_size=micro_batch_size,
        schedule=sched.name,
        chunks=chunks,
        stage_map=stage_map,
        moe_dispatcher=dispatcher,
        cuda_graphs=False,
        gaps=_gaps(cfg, tp=tp, schedule=sched),
        notes=tuple(notes),
        recompute_in_slots=slot_recompute,
        linears="local" if transformer_engine is None else "transformer_engine",
    )


def check_lowering(lowering: Lowering, *, registered_schedules: Mapping) -> None:
    """Refuse a lowering the build cannot run: an open gap (one no part of the build covers), a schedule no
    active plugin registered, or CUDA graphs."""
    if lowering.schedule != "megatron" and lowering.schedule not in registered_schedules:
        raise ConfigError(f"the model was lowered for schedule {lowering.schedule!r} ({lowering.chunks} chunk(s) per "
                          f"pipeline rank) and no registered schedule of that name drives it (registered: "
                          f"{', '.join(sorted(registered_schedules)) or 'none'})",
                          hint="add the plugin that provides it with --plugins (`nam plugins list` shows which), "
                               "or --set train.schedule=1f1b")
    if lowering.open_gaps:
        raise ConfigError("the megatron engine cannot close these gaps of the lowering: "
                          + "; ".join(f"{g.what} ({g.nam})" for g in lowering.open_gaps),
                          hint="`nam recipe show NAME --megatron-args` lists the gaps; e.g. --tp 1")
    if lowering.cuda_graphs:
        raise ConfigError("the lowering asks for CUDA graphs, which the megatron engine does not capture",
                          hint="leave CUDA graphs off")


# Config/model argument -> Megatron command-line flag, where the flag is not the name with dashes.
# None: no flag (implied by another one or not a command-line setting).
_FLAG = {
    "num_moe_experts": "--num-experts",
    "gated_linear_unit": "--swiglu",
    "activation_func": None,  # --swiglu implies silu
    "layernorm_epsilon": "--norm-epsilon",
    "max_sequence_length": "--seq-length",
    "params_dtype": None,  # --bf16 implies it
    "share_embeddings_and_output_weights": None,  # handled below (--untie-embeddings-and-output-weights)
    "add_bias_linear": None,  # handled below (--disable-bias-linear)
    "fp8": "--fp8-format",
}


def megatron_args(lowering: Lowering) -> list[str]:
    """The lowering as Megatron training flags (``pretrain_hybrid.py``-style), one list item per token."""
    args: list[str] = []
    merged = {**lowering.config_args, **lowering.model_args}
    for key, value in merged.items():
        flag = _FLAG.get(key, "--" + key.replace("_", "-"))
        if flag is None:
            continue
        if isinstance(value, bool):
            if value:
                args.append(flag)
            continue
        args += [flag, *map(str, value)] if isinstance(value, (list, tuple)) else [flag, str(value)]
    if not merged["add_bias_linear"]:
        args.append("--disable-bias-linear")
    if not merged["share_embeddings_and_output_weights"]:
        args.append("--untie-embeddings-and-output-weights")
    args += ["--max-position-embeddings", str(merged["max_sequence_length"])]
    args += ["--micro-batch-size", str(lowering.micro_batch_size)]
    return args
