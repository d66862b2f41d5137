"""``PluginInfo``: what a plugin module declares about itself, readable without importing any kernel."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from nam_core.checks import LaunchCheck, ShapeCheck
from nam_core.options import Option, OptionValues, parse_options
from nam_core.requirements import Requirement


@dataclass(frozen=True)
class PluginInfo:
    summary: str
    """One line: what the plugin does."""
    provides: Mapping[str, Sequence[str] | Mapping[str, str]] = field(default_factory=dict)
    """Kind -> names it registers, e.g. ``{"indexer": ["my-strategy"]}`` (kinds: ``nam_core.kinds``, and the
    model's table, e.g. ``nam56r/kinds.py``; the host refuses a kind it does not know). A name mapped to a
    ``"module:Class"`` path (``{"ce": {"my-head": "nam_plugin_x.head:MyHead"}}``) is registered by the host at
    activation, with no provider hook; a name in a list is registered by the plugin's hook."""
    requires: Sequence[Requirement] = ()
    """Declarative needs, evaluated at activation and shown by ``nam plugins list``."""
    conflicts: Sequence[str] = ()
    """Plugin names that must not be active at the same time, each with this plugin."""
    conflict_reason: str = ""
    """Why the conflicts exist (shown in the activation error)."""
    options: Sequence[Option] = ()
    """What ``--set <plugin>.<option>=VALUE`` may set: name, type, default, range or choices, doc. The host
    parses and validates them (a bad one is a usage error quoting the doc); hooks and backends read typed
    values (``spec.options[<plugin>]``, ``BackendContext.options[<plugin>]``)."""
    train_device: str | None = None
    """``train.device`` the plugin's backends need when the run uses them (``"cuda"``); the host refuses others."""
    train_dtypes: Sequence[str] = ()
    """``train.dtype`` values the plugin's backends take when the run uses them; empty: any."""
    train_needs_reason: str = ""
    """Why (shown in the refusal)."""
    selects: Mapping[str, str] = field(default_factory=dict)
    """Model-config fields this plugin sets when it is requested, e.g. ``{"indexer_backend": "my-strategy"}``,
    or ``train.<field>`` keys for ``TrainConfig`` fields (the deepep plugin: ``{"train.moe_dispatcher": "flex"}``;
    ``nam_core.selection.select_train``, which no plugin may wrap).

    Naming a plugin is the user's choice of what it provides, so ``--plugins my-strategy`` alone selects the
    ``my-strategy`` indexer. An explicit ``--set field=...`` always wins; two requested plugins selecting
    different values for one field is a config error unless one of them ``wraps`` the field.
    """
    checks: Sequence[ShapeCheck | LaunchCheck] = ()
    """Rows the host writes (``nam_core.checks``): ``ShapeCheck`` at activation, ``LaunchCheck`` on a real
    device, each only when the run uses the plugin's backend (or its ``when`` says so)."""
    wraps: Mapping[str, str] = field(default_factory=dict)
    """Field -> option of this plugin that receives the value its selection displaced.

    ``{"indexer_backend": "my-warmup.sparse"}``: a warm-up strategy takes the ``indexer_backend`` field and runs the
    strategy it would otherwise have held (``full``, or another requested plugin's) after its warm-up.
    """

    def __post_init__(self) -> None:
        for req in self.requires:
            if not isinstance(req, Requirement):
                raise TypeError(f"PluginInfo.requires holds {req!r}; expected Requirement objects")
        stray = sorted(set(self.wraps) - set(self.selects))
        if stray:
            raise ValueError(f"PluginInfo.wraps names fields {stray} that PluginInfo.selects does not select")
        for opt in self.options:
            if not isinstance(opt, Option):
                raise TypeError(f"PluginInfo.options holds {opt!r}; expected Option objects")
        for check in self.checks:
            if not isinstance(check, (ShapeCheck, LaunchCheck)):
                raise TypeError(f"PluginInfo.checks holds {check!r}; expected ShapeCheck or LaunchCheck objects")
        for kind, names in self.provides.items():
            paths = names.values() if isinstance(names, Mapping) else ()
            if any(not isinstance(p, str) or ":" not in p for p in paths):
                raise ValueError(f"PluginInfo.provides[{kind!r}] maps names to {dict(names)}; expected 'module:Class' "
                                 "paths")

    def classes(self, kind: str) -> Mapping[str, str]:
        """Name -> ``"module:Class"`` of the ``kind`` names the host registers for this plugin."""
        names = self.provides.get(kind, ())
        return dict(names) if isinstance(names, Mapping) else {}

    def parse_options(self, plugin: str, raw: Mapping[str, object] | None = None) -> OptionValues:
        """``plugin``'s entries of ``raw`` (``train.plugin_options``) as typed values; defaults when None."""
        return parse_options(plugin, self.options, raw or {})

    def to_dict(self) -> dict:
        return {
            "summary": self.summary,
            "provides": {k: list(v) for k, v in self.provides.items()},
            "requires": [r.to_dict() for r in self.requires],
            "conflicts": list(self.conflicts),
            "selects": dict(self.selects),
            "wraps": dict(self.wraps),
            "options": [o.to_dict() for o in self.options],
        }
