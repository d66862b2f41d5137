"""``PluginInfo``: what a plugin module declares about itself, readable without importing any kernel."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from nam_core.registry import KINDS
from nam_core.requirements import Requirement


@dataclass(frozen=True)
class PluginInfo:
    summary: str
    """One line: what the plugin does."""
    provides: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """Registry kind -> names it registers, e.g. ``{"indexers": ["index-cache"]}``."""
    requires: Sequence[Requirement] = ()
    """Declarative needs, evaluated at activation and shown by ``nam plugins list``."""
    conflicts: Sequence[str] = ()
    """Plugin names that must not be active at the same time, each with this plugin."""
    conflict_reason: str = ""
    """Why the conflicts exist (shown in the activation error)."""
    selects: Mapping[str, str] = field(default_factory=dict)
    """Model-config fields this plugin sets when it is requested, e.g. ``{"indexer": "lemyx"}``.

    Naming a plugin is the user's choice of what it provides, so ``--plugins index-cache`` alone selects the
    ``index-cache`` indexer. An explicit ``--set field=...`` always wins; two requested plugins selecting
    different values for one field is a config error unless one of them ``wraps`` the field.
    """
    wraps: Mapping[str, str] = field(default_factory=dict)
    """Field -> option of this plugin that receives the value its selection displaced.

    ``{"indexer": "lemyx.sparse"}``: lemyx takes the ``indexer`` field and runs the strategy it would
    otherwise have held (``full``, or ``index-cache`` when that plugin is requested too) after its warm-up.
    """

    def __post_init__(self) -> None:
        unknown = sorted(set(self.provides) - set(KINDS))
        if unknown:
            raise ValueError(f"PluginInfo.provides has unknown kinds {unknown}; known: {sorted(KINDS)}")
        for req in self.requires:
            if not isinstance(req, Requirement):
                raise TypeError(f"PluginInfo.requires holds {req!r}; expected Requirement objects")
        stray = sorted(set(self.wraps) - set(self.selects))
        if stray:
            raise ValueError(f"PluginInfo.wraps names fields {stray} that PluginInfo.selects does not select")

    def to_dict(self) -> dict:
        return {
            "summary": self.summary,
            "provides": {k: list(v) for k, v in self.provides.items()},
            "requires": [r.to_dict() for r in self.requires],
            "conflicts": list(self.conflicts),
            "selects": dict(self.selects),
            "wraps": dict(self.wraps),
        }
