"""Recipes: Python functions that return a complete run (model config, training config, plugins).

Variants start from a base recipe and change a few fields, each change with its reason. ``nam recipe list``
lists them; ``nam recipe show NAME`` prints the resolved config with parameter and FLOP counts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping

from nam56r.config import NAM56RConfig
from nam56r.kinds import FIELD_ALIASES
from nam_core import overrides as overrides_
from nam_core import selection
from nam_core.engine.config import TrainConfig
from nam_core.errors import ConfigError


@dataclass(kw_only=True)
class Recipe:
    name: str
    summary: str
    model: NAM56RConfig
    train: TrainConfig
    plugins: list[str] = field(default_factory=list)
    """Plugins this recipe needs; merged with --plugins and NAM_PLUGINS."""
    notes: list[str] = field(default_factory=list)
    """How requested plugins changed the config (``PluginInfo.selects``); printed before a run starts."""
    explicit: frozenset = frozenset()
    """Model fields the user set by name (``--set``): a choice config checks may treat as deliberate."""

    def to_dict(self) -> dict:
        return {"name": self.name, "summary": self.summary, "plugins": list(self.plugins),
                "model": dataclasses.asdict(self.model), "train": dataclasses.asdict(self.train)}


def nam56r() -> Recipe:
    """The full 4.73B NAM56R at sequence 4096 on GPUs, fast backends, bf16."""
    return Recipe(
        name="nam56r",
        summary="full NAM56R (52 layers, hidden 4096, 4.73B parameters) on GPUs",
        model=NAM56RConfig(
            # The fastest MIMO scan that passes its parity self-test (run at activation on a real GPU): mamba-ssm
            # with exact-size kernels, 16.11 ms fwd+bwd at b2 x 4096 against 17.53 ms for nam's mimo-scan (0.92x),
            # and 17.07 against 18.66 under train.recompute=mamba-scan, one H100 run (bench/mimo_scan.py, r66 in
            # bench/README.md). mimo-scan stays selectable by name.
            ssm_backend="mamba-ssm", attention_backend="sparse-mla", indexer_kernels_backend="sparse-mla",
            # The LM + MTP heads: hopper-ce with its gradients in the forward (three products, fp32 logits):
            # 86.9 ms fwd+bwd at 16384 x 4096 x 131072 against 113.9 for liger, H200 (bench/hopper_ce.py); the
            # full model at MBS 4 went 9,703 -> 10,279 tokens/s (local) and 9,774 -> 10,391 (megatron + TE bf16)
            # (bench/README.md, seventh session). liger stays selectable by name.
            ce_backend="hopper-ce", indexer_backend="full",
            # Routed experts as two grouped GEMMs per layer, no host sync, in both engines. H200, fwd+bwd at 8192
            # tokens (micro-batch 2): 2.62 ms against 2.95 ms for the reference's every-expert-on-every-token
            # and 9.97 ms for a per-expert loop (bench/moe.py, results/moe.json; level with the reference at
            # 4096 tokens, 1.18x at 16384).
            moe_backend="grouped",
            # 1.02-1.08x on a Mamba-3 layer fwd+bwd, H100 (bench/mamba3_layer.py, results/mamba3_layer.json)
            mamba_compile_prelude=True,
        ),
        train=TrainConfig(device="cuda", dtype="bfloat16", micro_batch_size=1, lr=3e-4, warmup_steps=2000,
                          total_steps=100_000, checkpoint_every=1000),
        # reference: the DSA indexer `full` (lemyx and index-cache wrap or replace it when requested).
        plugins=["mamba-ssm", "sparse-mla", "hopper-ce", "grouped-moe", "reference"],
    )


def nam56r_small() -> Recipe:
    """The full 52-layer pattern at half width: fits one 80 GB GPU with Adam state."""
    base = nam56r()
    return Recipe(
        name="nam56r-small",
        summary="52-layer NAM56R at hidden 2048 (one GPU)",
        # Half width: 16 heads of 128, 64 Mamba heads of 64; block internals (ranks, indexer) unchanged.
        model=base.model.replace(name="nam56r-small", hidden=2048, attn_heads=16, seq_len=4096),
        train=base.train.replace(micro_batch_size=2, total_steps=20_000, warmup_steps=500),
        plugins=base.plugins,
    )


def nam56r_tiny() -> Recipe:
    """The same 52-layer pattern at toy widths, reference backends, CPU: the embedded default of ``nam train``."""
    return Recipe(
        name="nam56r-tiny",
        summary="52-layer NAM56R pattern at toy widths on the CPU (reference backends)",
        model=NAM56RConfig(
            name="nam56r-tiny",
            hidden=64, vocab_size=257, seq_len=64,  # 257 = the built-in byte tokenizer (256 bytes + eod)
            attn_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_dim=16, qk_rope_dim=16, v_head_dim=16,
            index_heads=4, index_head_dim=16, index_topk=16,  # top-k 16 of 64: the sparse path is exercised
            d_state=16, mamba_headdim=16, mamba_ngroups=2, mamba_mimo_rank=4, mamba_chunk=16,
            # 8 Mamba heads in 2 groups keeps 1 < ngroups < nheads, NAM56R's hard case.
            num_experts=16, moe_topk=4, moe_ffn_hidden=32, moe_shared_ffn_hidden=64, mtp_ffn_hidden=64,
            ngram_table=1000, ngram_dim=8,
        ),
        train=TrainConfig(device="cpu", dtype="float32", micro_batch_size=4, lr=3e-3, warmup_steps=5,
                          total_steps=200, checkpoint_every=20, weight_decay=0.0),
        plugins=["reference"],
    )


RECIPES: dict[str, Callable[[], Recipe]] = {
    "nam56r": nam56r,
    "nam56r-small": nam56r_small,
    "nam56r-tiny": nam56r_tiny,
}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown recipe {name!r}; known: {', '.join(RECIPES)}", hint="`nam recipe list` shows them"
        ) from None


def apply_overrides(
    recipe: Recipe, overrides: list[str], *, plugin_names: list[str] = (), plugin_infos: Mapping | None = None,
) -> Recipe:
    """Apply ``key=value`` overrides (``nam_core.overrides``): model fields by name, ``train.<field>``, or
    ``<plugin>.<option>``, then what the requested plugins select (``apply_plugin_selections``), leaving every
    field the overrides set alone. ``plugin_infos``: name -> PluginInfo of the requested plugins."""
    parsed = overrides_.parse(overrides, model_type=NAM56RConfig, options=recipe.train.plugin_options,
                              plugin_names=plugin_names, plugin_infos=plugin_infos, field_aliases=FIELD_ALIASES,
                              recipe_name=recipe.name)
    recipe = dataclasses.replace(
        recipe, model=recipe.model.replace(**parsed.model),
        train=recipe.train.replace(**parsed.train, plugin_options=parsed.options),
        explicit=recipe.explicit | frozenset(parsed.model),
    )
    return apply_plugin_selections(recipe, plugin_infos or {}, explicit=set(parsed.model) | set(parsed.options)
                                   | {selection.TRAIN + k for k in parsed.train})


def apply_plugin_selections(recipe: Recipe, infos: Mapping, *, explicit: set[str] = frozenset()) -> Recipe:
    """The recipe with the model and train fields requested plugins select (``nam_core.selection.select``,
    ``select_train``), noted. ``explicit``: model fields, plugin options and ``train.<field>`` keys the user set."""
    chosen = selection.select(recipe.model, recipe.train.plugin_options, infos, explicit=explicit)
    train, train_notes = selection.select_train(recipe.train, infos, explicit=explicit)
    if not chosen.changes and not chosen.notes and not train_notes:
        return recipe
    return dataclasses.replace(recipe, model=recipe.model.replace(**chosen.changes),
                               train=recipe.train.replace(plugin_options=chosen.options, **train),
                               notes=recipe.notes + chosen.notes + train_notes)
