"""Plugin selection: what requesting a plugin chooses (``PluginInfo.selects``) and wraps (``PluginInfo.wraps``).

Naming a plugin is the user's choice of what it provides: ``--plugins mamba-ssm`` alone sets
``ssm_backend=mamba-ssm``. An explicit ``--set`` always wins; two requested plugins selecting different values
for one field is a ``ConfigError`` unless one of them wraps the field, in which case it takes the field and
receives the displaced value in its wrap option (lemyx runs ``full`` or ``index-cache`` after its warm-up).
``select`` decides the fields, ``wrapped`` tells the host which implementation runs inside a wrapper (so a
wrapped backend counts as used and needs its provider).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from nam_core.errors import ConfigError
from nam_core.overrides import UNSETTABLE_MODEL, coerce


@dataclass(frozen=True)
class Selection:
    """What the requested plugins chose: typed model-field changes, plugin options, one note per decision."""

    changes: dict[str, object] = field(default_factory=dict)
    options: dict[str, str] = field(default_factory=dict)
    """Every plugin option (``"<plugin>.<option>" -> raw``), wrap options filled."""
    notes: list[str] = field(default_factory=list)
    """How requested plugins changed the config; printed before a run starts."""


def select(model: Any, options: Mapping[str, str], infos: Mapping, *, explicit: Iterable[str] = ()) -> Selection:
    """The model fields the requested plugins select, noting each change.

    ``model``: the model's config dataclass instance; ``options``: the plugin options set so far; ``infos``:
    plugin name -> PluginInfo, for the requested plugins. ``explicit``: model fields and plugin options the
    user set, which no selection touches. Per field: the plain selections must agree (else a ConfigError naming
    the plugins and the ``--set`` that settles it); a plugin that *wraps* the field takes it and receives the
    value it displaced (the plain selection, or the recipe's) in its wrap option.
    """
    model_types = typing.get_type_hints(type(model))
    explicit = set(explicit)
    out = Selection(options=dict(options))
    for fld in sorted({f for info in infos.values() for f in info.selects if not f.startswith(TRAIN)}):
        pickers = {name: info.selects[fld] for name, info in infos.items() if fld in info.selects}
        if fld not in model_types or fld == UNSETTABLE_MODEL:
            raise ConfigError(f"plugin(s) {', '.join(pickers)} select {fld!r}, which is not a model-config field",
                              hint="report this to the plugin's authors; deactivate it meanwhile")
        current = getattr(model, fld)
        if fld in explicit:
            for name, value in pickers.items():
                if value != current:
                    out.notes.append(f"{fld}={current} (your --set; plugin {name} would have selected {value})")
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
                out.options[option] = str(base)
                out.notes.append(f"{fld}={value} (selected by plugin {name}; after it, {option}={base}: {source})")
            else:
                out.notes.append(f"{fld}={value} (selected by plugin {name}; {option}={out.options[option]} is "
                                 "your --set)")
            base = value
        elif plain:
            out.notes.append(f"{fld}={base} ({source})")
        out.changes[fld] = coerce(str(base), model_types[fld], fld)
    return out


TRAIN = "train."
"""``PluginInfo.selects`` keys with this prefix name ``TrainConfig`` fields (``select_train``); the others, model
fields (``select``)."""


def select_train(train: Any, infos: Mapping, *, explicit: Iterable[str] = ()) -> tuple[dict[str, object], list[str]]:
    """The ``train.<field>`` values the requested plugins select (the deepep plugin: ``train.moe_dispatcher=flex``),
    as typed ``TrainConfig`` changes and one note each. ``explicit``: the ``train.<field>`` keys the user set,
    which win (noted). Requested plugins selecting different values for one field is a ConfigError; a train
    field cannot be wrapped."""
    train_types = typing.get_type_hints(type(train))
    explicit, changes, notes = set(explicit), {}, []
    for key in sorted({f for info in infos.values() for f in info.selects if f.startswith(TRAIN)}):
        fld = key[len(TRAIN):]
        pickers = {name: info.selects[key] for name, info in infos.items() if key in info.selects}
        if fld not in train_types or any(key in info.wraps for info in infos.values()):
            raise ConfigError(f"plugin(s) {', '.join(pickers)} select {key!r}, which is not a train-config field "
                              "a plugin may select", hint="report this to the plugin's authors; deactivate it meanwhile")
        current = getattr(train, fld)
        if key in explicit:
            notes += [f"{key}={current} (your --set; plugin {name} would have selected {value})"
                      for name, value in pickers.items() if value != current]
            continue
        if len(set(pickers.values())) > 1:
            both = ", ".join(f"{n} -> {v}" for n, v in pickers.items())
            raise ConfigError(f"requested plugins select different values for {key!r}: {both}",
                              hint=f"choose one with --set {key}=VALUE, or request fewer plugins")
        value = next(iter(pickers.values()))
        notes.append(f"{key}={value} (selected by plugin {', '.join(pickers)})")
        changes[fld] = coerce(str(value), train_types[fld], key)
    return changes, notes


def wrapped(model: Any, infos: Mapping, options: Mapping, kinds: Iterable) -> dict[str, str]:
    """Kind -> the name a selected wrapping plugin runs inside it (a warm-up strategy: ``{"indexer": <the value
    of its wrapping option>}``). ``options``: plugin -> parsed ``OptionValues``; ``kinds``: ``nam_core.kinds.Kind``
    entries, whose ``field`` names the model field a kind is picked by."""
    by_field = {k.field: k.name for k in kinds if k.field}
    found = {}
    for name, info in infos.items():
        for fld, option in info.wraps.items():
            if getattr(model, fld, None) == info.selects.get(fld) and fld in by_field:
                found[by_field[fld]] = options[name][option.partition(".")[2]]
    return found
