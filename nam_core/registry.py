"""Named registries handed to provider hooks: ``register("name", Impl)``.

There is one registry per kind of implementation (``nam_core.kinds``). Plugins fill them during activation; config
picks a name; the model asks the registry. A name that no active plugin registered is an error that names
the installed plugin which would provide it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from nam_core.errors import UnknownBackendError

class RegistrationError(Exception):
    """A plugin registered a name twice, a name another plugin owns, or a name it did not declare."""


@dataclass(frozen=True)
class Entry:
    name: str
    impl: Any
    plugin: str


class Registry:
    """Name -> implementation for one kind. Filled by one plugin at a time (``owner``)."""

    def __init__(self, kind: str, *, providers: Callable[[str, str], list[str]] | None = None):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._owner: str | None = None
        self._declared: set[str] | None = None
        self._providers = providers

    def _open(self, plugin: str, declared: set[str]) -> None:
        self._owner, self._declared = plugin, declared

    def _close(self) -> None:
        self._owner, self._declared = None, None

    def __call__(self, name: str, impl: Any) -> None:
        """Register ``impl`` under ``name`` (this is the ``register`` argument of provider hooks)."""
        if self._owner is None:
            raise RegistrationError(f"{self.kind}: register({name!r}) called outside activation")
        if name in self._entries:
            other = self._entries[name].plugin
            raise RegistrationError(
                f"{self.kind} {name!r} registered by both {other!r} and {self._owner!r}; activate only one"
            )
        if name not in self._declared:
            raise RegistrationError(
                f"plugin {self._owner!r} registered {self.kind} {name!r} without declaring it in "
                f"PLUGIN.provides (declared: {sorted(self._declared) or 'none'})"
            )
        self._entries[name] = Entry(name, impl, self._owner)

    register = __call__

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self):
        return iter(self._entries.values())

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, name: str) -> Any:
        """The implementation registered as ``name``; an error naming who would provide it otherwise."""
        if name in self._entries:
            return self._entries[name].impl
        providers = self._providers(self.kind, name) if self._providers else []
        active = ", ".join(self.names()) or "none"
        if providers:
            hint = f"add --plugins {providers[0]} (installed, not active)"
            msg = f"{self.kind} {name!r} is provided by plugin {providers[0]!r}, which is not active"
        else:
            hint = "`nam plugins list` shows what each installed plugin provides"
            msg = f"no installed plugin provides {self.kind} {name!r}"
        raise UnknownBackendError(f"{msg} (active {self.kind}: {active})", hint=hint)

    def plugin_of(self, name: str) -> str:
        return self._entries[name].plugin
