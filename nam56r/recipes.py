"""Recipes: Python functions that return a complete run (model config, training config, plugins).

Variants start from a base recipe and change a few fields, each change with its reason. ``nam recipe list``
lists them; ``nam recipe show NAME`` prints the resolved config with parameter and FLOP counts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping

from nam56r.config import NAM56RConfig
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
            # with exact-size kernels, 16.2 ms fwd+bwd at b2 x 4096 against 66.6 ms for nam's mimo-scan, H100
            # (bench/mimo_scan.py, results/mimo_scan.json). mimo-scan stays selectable by name.
            ssm_backend="mamba-ssm", attention_backend="sparse-mla", indexer_kernels_backend="sparse-mla",
            ce_backend="liger", indexer_backend="full",
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
        plugins=["mamba-ssm", "sparse-mla", "liger", "grouped-moe", "reference"],
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


def _coerce(raw: str, annotation, key: str):
    """Parse ``raw`` as the field's declared type; a ConfigError names the field and the type otherwise."""
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else str(annotation)
    try:
        if annotation is bool or text == "bool":
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if annotation is int or text == "int":
            return int(raw)
        if annotation is float or text == "float":
            return float(raw)
        if text.startswith("tuple[int"):
            return tuple(int(x) for x in raw.split(",") if x.strip())
        if text.startswith("tuple[str"):
            return tuple(x.strip() for x in raw.split(",") if x.strip())
        if annotation is str or text == "str":
            return raw
    except ValueError:
        raise ConfigError(f"--set {key}={raw}: expected {text}, found {raw!r}",
                          hint=f"give {key} a value of type {text}") from None
    raise ConfigError(f"--set {key}: field of type {text} cannot be set from the command line",
                      hint="change it in a recipe function instead")


def _field_type(name: str, types: dict, *, key: str, owner: str, excluded: str, recipe_name: str,
                plugin_infos: Mapping | None):
    """The declared type of field ``name``; a ConfigError with close matches when there is no such field."""
    if name in types and name != excluded:
        return types[name]
    raise ConfigError(f"--set {key}: {owner} has no field {name!r}{_did_you_mean(key, plugin_infos)}",
                      hint=f"`nam recipe show {recipe_name}` lists every field")


def _settable_keys(plugin_infos: Mapping | None) -> dict[str, str]:
    """Every key ``--set`` takes, and the names other tools use for them -> the key: model fields, ``train.``
    fields, the options of the requested plugins (``<plugin>.<option>``)."""
    from nam_core.bounds import aliases

    keys = {f.name: f.name for f in dataclasses.fields(NAM56RConfig) if f.name != "name"}
    keys |= {f"train.{f.name}": f"train.{f.name}" for f in dataclasses.fields(TrainConfig)
             if f.name != "plugin_options"}
    keys |= {f"{p}.{o.name}": f"{p}.{o.name}" for p, info in (plugin_infos or {}).items() for o in info.options}
    for alias, fld in aliases(NAM56RConfig).items():
        keys.setdefault(alias, fld)
    for alias, fld in aliases(TrainConfig).items():
        keys.setdefault(f"train.{alias}", f"train.{fld}")
    return keys


def _did_you_mean(key: str, plugin_infos: Mapping | None) -> str:
    """`` (did you mean train.lr?)`` for ``train.learning_rate``, ``lr``, ``train.lrr`` or ``tarin.lr``; ``""``
    when nothing is close. The name without its prefix is looked up in every namespace first (a model field
    set under ``train.``, another tool's name for a field), then the whole key by spelling."""
    import difflib

    keys = _settable_keys(plugin_infos)
    bare = key.rpartition(".")[2]
    exact = [keys[k] for k in (bare, f"train.{bare}") if k in keys]
    close = exact or [keys[k] for k in difflib.get_close_matches(key, keys, n=3)]
    close = list(dict.fromkeys(c for c in close if c != key))
    return f" (did you mean {', '.join(close)}?)" if close else ""


def apply_overrides(
    recipe: Recipe, overrides: list[str], *, plugin_names: list[str] = (), plugin_infos: Mapping | None = None,
) -> Recipe:
    """Apply ``key=value`` overrides: model fields by name, ``train.<field>``, or ``<plugin>.<option>``.

    Unknown keys and mistyped values are ConfigErrors; plugin options go to ``train.plugin_options`` and
    are parsed by the composition root against ``PluginInfo.options`` (``nam56r.run.resolve``). ``plugin_infos`` (name -> PluginInfo of the requested
    plugins) then fill the fields the requested plugins select (``apply_plugin_selections``), leaving every
    field the overrides set alone.
    """
    import typing

    model_types = typing.get_type_hints(NAM56RConfig)
    train_types = typing.get_type_hints(TrainConfig)
    model_changes, train_changes = {}, {}
    options = dict(recipe.train.plugin_options)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE", hint="e.g. --set hidden=128")
        prefix, dot, rest = key.partition(".")
        if dot and prefix == "train":
            field_type = _field_type(rest, train_types, key=key, owner="TrainConfig", excluded="plugin_options",
                                     recipe_name=recipe.name, plugin_infos=plugin_infos)
            train_changes[rest] = _coerce(raw, field_type, key)
        elif dot:
            if prefix not in plugin_names:
                raise ConfigError(f"--set {key}: {prefix!r} is neither 'train' nor an active plugin"
                                  f"{_did_you_mean(key, plugin_infos)}",
                                  hint=f"activate it with --plugins {prefix}, or check the key")
            options[key] = raw
        else:
            from nam56r.kinds import FIELD_ALIASES

            key = FIELD_ALIASES.get(key, key)
            field_type = _field_type(key, model_types, key=key, owner="the model config", excluded="name",
                                     recipe_name=recipe.name, plugin_infos=plugin_infos)
            model_changes[key] = _coerce(raw, field_type, key)
    recipe = dataclasses.replace(
        recipe, model=recipe.model.replace(**model_changes),
        train=recipe.train.replace(**train_changes, plugin_options=options),
        explicit=recipe.explicit | frozenset(model_changes),
    )
    return apply_plugin_selections(recipe, plugin_infos or {}, explicit=set(model_changes) | set(options))


def apply_plugin_selections(recipe: Recipe, infos: Mapping, *, explicit: set[str] = frozenset()) -> Recipe:
    """Set the model fields that requested plugins select (``PluginInfo.selects``), noting each change.

    ``infos``: plugin name -> PluginInfo, for the requested plugins. ``explicit``: model fields and plugin
    options the user set, which no selection touches. Per field: the plain selections must agree (else a
    ConfigError naming the plugins and the ``--set`` that settles it); a plugin that *wraps* the field takes
    it and receives the value it displaced (the plain selection, or the recipe's) in its wrap option.
    """
    import typing

    model_types = typing.get_type_hints(NAM56RConfig)
    changes: dict[str, object] = {}
    options = dict(recipe.train.plugin_options)
    notes: list[str] = []
    for fld in sorted({f for info in infos.values() for f in info.selects}):
        pickers = {name: info.selects[fld] for name, info in infos.items() if fld in info.selects}
        if fld not in model_types or fld == "name":
            raise ConfigError(f"plugin(s) {', '.join(pickers)} select {fld!r}, which is not a model-config field",
                              hint="report this to the plugin's authors; deactivate it meanwhile")
        current = getattr(recipe.model, fld)
        if fld in explicit:
            for name, value in pickers.items():
                if value != current:
                    notes.append(f"{fld}={current} (your --set; plugin {name} would have selected {value})")
            continue
        plain = {n: v for n, v in pickers.items() if fld not in infos[n].wraps}
        wrappers = {n: v for n, v in pickers.items() if fld in infos[n].wraps}
        if len(set(plain.values())) > 1 or len(wrappers) > 1:
            both = ", ".join(f"{n} -> {v}" for n, v in pickers.items())
            raise ConfigError(f"requested plugins select different values for {fld!r}: {both}",
                              hint=f"choose one with --set {fld}=VALUE, or request fewer plugins")
        base = next(iter(plain.values()), current)
        source = f"selected by plugin {', '.join(plain)}" if plain else "the recipe's"
        if wrappers:
            (name, value), = wrappers.items()
            option = infos[name].wraps[fld]
            if option not in explicit:
                options[option] = str(base)
                notes.append(f"{fld}={value} (selected by plugin {name}; after it, {option}={base}: {source})")
            else:
                notes.append(f"{fld}={value} (selected by plugin {name}; {option}={options[option]} is your --set)")
            base = value
        elif plain:
            notes.append(f"{fld}={base} ({source})")
        changes[fld] = _coerce(str(base), model_types[fld], fld)
    if not changes and not notes:
        return recipe
    return dataclasses.replace(recipe, model=recipe.model.replace(**changes),
                               train=recipe.train.replace(plugin_options=options), notes=recipe.notes + notes)
