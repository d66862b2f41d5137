"""``--set KEY=VALUE``: parse overrides against a model's config dataclass, ``TrainConfig`` and plugin options.

A key is a model field by name (``hidden=128``), a ``TrainConfig`` field (``train.lr=1e-3``) or an option of
an active plugin (``lemyx.warmup_steps=5``). Values are parsed as the field's declared type; an unknown key
or a mistyped value is one ``ConfigError`` (exit 2) that names the field and, when a known key is close,
suggests it (``did you mean train.lr?``): names other tools use (``bounds.Bound.aka``) are suggested, never
accepted. Plugin options stay strings here; the composition root parses them against ``PluginInfo.options``.
The model package passes its own config class and its short names for fields (nam56r: ``indexer`` ->
``indexer_backend``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from nam_core.bounds import aliases
from nam_core.engine.config import TrainConfig
from nam_core.errors import ConfigError

TRAIN = "train"
"""The prefix of ``TrainConfig`` keys."""
UNSETTABLE_MODEL = "name"
UNSETTABLE_TRAIN = "plugin_options"
"""Fields ``--set`` does not reach: the model's name, and the plugin options (set as ``<plugin>.<option>``)."""


@dataclass(frozen=True)
class Overrides:
    """Parsed ``--set`` items: typed model and train changes, and every plugin option (raw strings)."""

    model: dict[str, object] = field(default_factory=dict)
    train: dict[str, object] = field(default_factory=dict)
    options: dict[str, str] = field(default_factory=dict)
    """``"<plugin>.<option>" -> raw value``: the ones given before (``TrainConfig.plugin_options``) and these."""


def parse(items: Sequence[str], *, model_type: type, options: Mapping[str, str] = (), plugin_names: Sequence[str] = (),
          plugin_infos: Mapping | None = None, field_aliases: Mapping[str, str] = (), recipe_name: str = "") -> Overrides:
    """``items`` (``["hidden=128", "train.lr=1e-3", "lemyx.warmup_steps=5"]``) as typed changes.

    ``model_type``: the model's config dataclass. ``options``: plugin options already set (a recipe's).
    ``plugin_names``: the requested plugins (whose prefixes are keys); ``plugin_infos``: their ``PluginInfo``
    (name -> info), for suggestions. ``field_aliases``: the model's short names (``{"indexer": "indexer_backend"}``).
    """
    model_types, train_types = typing.get_type_hints(model_type), typing.get_type_hints(TrainConfig)
    field_aliases = dict(field_aliases)
    out = Overrides(options=dict(options))
    keys = functools.partial(settable_keys, model_type, plugin_infos)  # built only for an error
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE", hint="e.g. --set hidden=128")
        prefix, dot, rest = key.partition(".")
        if dot and prefix == TRAIN:
            field_type = _field_type(rest, train_types, key=key, owner="TrainConfig", excluded=UNSETTABLE_TRAIN,
                                     recipe_name=recipe_name, keys=keys)
            out.train[rest] = coerce(raw, field_type, key)
        elif dot:
            if prefix not in plugin_names:
                raise ConfigError(f"--set {key}: {prefix!r} is neither 'train' nor an active plugin"
                                  f"{did_you_mean(key, keys())}",
                                  hint=f"activate it with --plugins {prefix}, or check the key")
            out.options[key] = raw
        else:
            key = field_aliases.get(key, key)
            field_type = _field_type(key, model_types, key=key, owner="the model config", excluded=UNSETTABLE_MODEL,
                                     recipe_name=recipe_name, keys=keys)
            out.model[key] = coerce(raw, field_type, key)
    return out


def coerce(raw: str, annotation, key: str):
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


def _field_type(name: str, types: dict, *, key: str, owner: str, excluded: str, recipe_name: str, keys):
    """The declared type of field ``name``; a ConfigError with close matches when there is no such field."""
    if name in types and name != excluded:
        return types[name]
    raise ConfigError(f"--set {key}: {owner} has no field {name!r}{did_you_mean(key, keys())}",
                      hint=f"`nam recipe show {recipe_name}` lists every field")


def settable_keys(model_type: type, plugin_infos: Mapping | None) -> dict[str, str]:
    """Every key ``--set`` takes, and the names other tools use for them -> the key: model fields, ``train.``
    fields, the options of the requested plugins (``<plugin>.<option>``)."""
    keys = {f.name: f.name for f in dataclasses.fields(model_type) if f.name != UNSETTABLE_MODEL}
    keys |= {f"{TRAIN}.{f.name}": f"{TRAIN}.{f.name}" for f in dataclasses.fields(TrainConfig)
             if f.name != UNSETTABLE_TRAIN}
    keys |= {f"{p}.{o.name}": f"{p}.{o.name}" for p, info in (plugin_infos or {}).items() for o in info.options}
    for alias, fld in aliases(model_type).items():
        keys.setdefault(alias, fld)
    for alias, fld in aliases(TrainConfig).items():
        keys.setdefault(f"{TRAIN}.{alias}", f"{TRAIN}.{fld}")
    return keys


def did_you_mean(key: str, keys: Mapping[str, str]) -> str:
    """`` (did you mean train.lr?)`` for ``train.learning_rate``, ``lr``, ``train.lrr`` or ``tarin.lr``; ``""``
    when nothing is close. ``keys``: ``settable_keys``. The name without its prefix is looked up in every
    namespace first (a model field set under ``train.``, another tool's name for a field), then the whole key
    by spelling."""
    bare = key.rpartition(".")[2]
    exact = [keys[k] for k in (bare, f"{TRAIN}.{bare}") if k in keys]
    close = exact or [keys[k] for k in difflib.get_close_matches(key, keys, n=3)]
    close = list(dict.fromkeys(c for c in close if c != key))
    return f" (did you mean {', '.join(close)}?)" if close else ""
