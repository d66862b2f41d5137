"""Kinds of implementation a plugin can provide: one ``Kind`` per registry, declared once.

A kind has one name, used everywhere: the registry (``host.registry("ssm")``), the key of
``PluginInfo.provides`` (``{"ssm": ["my-scan"]}``) and, for a model backend, the attribute of the model's
backends object (``backends.ssm``). The provider hook and the config field that picks an implementation
follow from it (``Kind.backend``: ``nam_register_ssm_backends``, ``ssm_backend``).

The core owns two kinds (``CORE_KINDS``: schedules and patches, whose hooks ``nam_core.hookspecs`` lists).
Backend kinds belong to the model: an installed model package publishes its table under the entry-point group
``nam.kinds`` (nam-train: ``nam56r = "nam56r.kinds:BACKEND_KINDS"``), and the host makes one registry and
one provider hook per entry. Adding a backend kind is one entry in that table, the config field it names,
and a plugin that provides it.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Iterable

import pluggy

ENTRY_POINT_GROUP = "nam.kinds"


@dataclass(frozen=True)
class Kind:
    name: str
    """The registry, the ``PluginInfo.provides`` key, the backends attribute: ``ssm``."""
    hook: str
    """The provider hook that fills the registry: ``nam_register_ssm_backends(register)``."""
    summary: str
    """What an implementation of this kind does (hook docs, ``nam plugins list``, README's table)."""
    field: str | None = None
    """The config field whose value names the implementation a run uses: ``ssm_backend``, ``train.schedule``;
    None for kinds that are not chosen by name (patches: every registered one is considered)."""
    protocol: str | None = None
    """Dotted path of the protocol an implementation satisfies: ``nam56r.backends.SSMScan``."""
    default: str | None = None
    """The implementation a run uses unless told otherwise (the field's default)."""

    @classmethod
    def backend(cls, name: str, *, summary: str, protocol: str, default: str = "reference") -> "Kind":
        """A model backend kind: hook ``nam_register_<name>_backends``, config field ``<name>_backend``."""
        return cls(name, f"nam_register_{name}_backends", summary, f"{name}_backend", protocol, default)


CORE_KINDS: tuple[Kind, ...] = (
    Kind("schedules", "nam_register_schedules", "training schedules (how micro-batches are ordered)",
         field="train.schedule", default="single"),
    Kind("patches", "nam_register_patches", "patch-lane entries (nam_core.patches.Patch)"),
)

RENAMED = {"ssm_mixers": "ssm", "attention_backends": "attention", "ce_heads": "ce", "indexers": "indexer",
           "moe_experts": "moe"}
"""Registry names before issue 20, for the error a plugin written against them gets."""


def installed_kinds() -> tuple[Kind, ...]:
    """The core kinds and every kind table an installed model package publishes (``nam.kinds``)."""
    kinds = list(CORE_KINDS)
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        kinds.extend(ep.load())
    return check_table(kinds)


def check_table(kinds: Iterable[Kind]) -> tuple[Kind, ...]:
    """The table as a tuple; a ValueError if two entries share a name, a hook or a field."""
    kinds = tuple(kinds)
    for attr in ("name", "hook", "field"):
        values = [getattr(k, attr) for k in kinds if getattr(k, attr) is not None]
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise ValueError(f"kind table: {attr} {twice} declared twice")
    return kinds


def provider_hookspecs(kinds: Iterable[Kind], project: str) -> type:
    """A namespace of pluggy hookspecs, one ``<kind.hook>(register)`` per kind, for ``add_hookspecs``."""
    spec = pluggy.HookspecMarker(project)
    namespace = {}
    for kind in kinds:
        def hook(register) -> None: ...

        hook.__name__ = hook.__qualname__ = kind.hook
        protocol = f" Each implementation satisfies ``{kind.protocol}``." if kind.protocol else ""
        field = f" Selected by ``{kind.field}``." if kind.field else ""
        hook.__doc__ = f"Offer {kind.summary}: ``register(name, impl)`` into registry ``{kind.name}``.{protocol}{field}"
        namespace[kind.hook] = spec(hook)
    return type("ProviderHooks", (), namespace)
