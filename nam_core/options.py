"""Plugin options: declared in ``PluginInfo.options``, parsed and validated by the host.

A user sets them with ``--set <plugin>.<option>=VALUE``; the composition root hands the raw strings of every
requested plugin to ``parse_options`` before anything is activated, and a bad one is a ``ConfigError`` (exit
2) that quotes the option's doc. Plugins read typed values (``spec.options[<plugin>].warmup_steps``), never
the raw strings.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from nam_core.errors import ConfigError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Option:
    """One option of a plugin: ``Option("warmup_steps", int, 1000, "dense steps before ...", min=0)``."""

    name: str
    type: type
    """``int``, ``float``, ``bool`` or ``str``."""
    default: Any
    """The value when unset; None where the plugin derives it from the run (say how in ``doc``)."""
    doc: str
    """What it does, with its unit and source; quoted in every error about it."""
    choices: Sequence[Any] | None = None
    min: float | None = None
    max: float | None = None

    def __post_init__(self) -> None:
        if self.type not in (int, float, bool, str):
            raise TypeError(f"Option {self.name!r}: type {self.type!r}; expected int, float, bool or str")

    @property
    def expected(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(map(str, self.choices))
        what = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}[self.type]
        if self.min is not None and self.max is not None:
            return f"{what} in [{self.min}, {self.max}]"
        if self.min is not None:
            return f"{what} >= {self.min}"
        if self.max is not None:
            return f"{what} <= {self.max}"
        return what

    def parse(self, plugin: str, raw: Any) -> Any:
        """``raw`` (a string from ``--set``, or an already typed value) as this option's type, in range."""
        key = f"{plugin}.{self.name}"
        text = str(raw).strip()
        try:
            if self.type is bool:
                if isinstance(raw, bool):
                    value = raw
                elif text.lower() in _TRUE + _FALSE:
                    value = text.lower() in _TRUE
                else:
                    raise ValueError(text)
            else:
                value = self.type(text) if not isinstance(raw, self.type) else raw
        except ValueError:
            self._refuse(key, raw)
        if isinstance(value, float) and not math.isfinite(value):
            self._refuse(key, raw)  # nan passes every min/max comparison below
        if self.choices is not None and value not in self.choices:
            self._refuse(key, raw)
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            self._refuse(key, raw)
        return value

    def _refuse(self, key: str, raw: Any):
        raise ConfigError(f"--set {key}={raw}: expected {self.expected} ({self.name}: {self.doc})",
                          hint=f"--set {key}={self.example}")

    @property
    def example(self) -> str:
        if self.choices:
            return str(self.choices[0])
        if self.default is not None:
            return str(self.default).lower() if self.type is bool else str(self.default)
        return {int: "1", float: "1.0", bool: "true", str: "VALUE"}[self.type]

    def to_dict(self) -> dict:
        return {"name": self.name, "type": self.type.__name__, "default": self.default, "doc": self.doc,
                "choices": list(self.choices) if self.choices is not None else None, "min": self.min, "max": self.max}


class OptionValues(Mapping[str, Any]):
    """One plugin's options after parsing: every declared option, typed (``values.warmup_steps``), and which
    of them the user set (``values.is_set("backend")``)."""

    def __init__(self, plugin: str, values: Mapping[str, Any], explicit: frozenset[str] = frozenset()):
        self._plugin, self._values, self._explicit = plugin, dict(values), frozenset(explicit)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(f"plugin {self.__dict__.get('_plugin')!r} declares no option {name!r}") from None

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def is_set(self, name: str) -> bool:
        """True when the user (or a plugin's ``wraps``) set ``name``; False when it holds its default."""
        return name in self._explicit

    def __repr__(self) -> str:
        return f"OptionValues({self._plugin!r}, {self._values!r})"


def parse_options(plugin: str, declared: Sequence[Option], raw: Mapping[str, Any]) -> OptionValues:
    """The ``<plugin>.*`` entries of ``raw`` (``train.plugin_options``) parsed against ``declared``.

    An unknown option or a bad value is a ConfigError naming what is declared, with its doc."""
    by_name = {o.name: o for o in declared}
    values = {o.name: o.default for o in declared}
    explicit = set()
    for key, value in raw.items():
        prefix, _, name = key.partition(".")
        if prefix != plugin:
            continue
        if name not in by_name:
            close = difflib.get_close_matches(name, by_name, n=1)
            did = f" (did you mean {plugin}.{close[0]}?)" if close else ""
            listed = "; ".join(f"{plugin}.{o.name}: {o.doc}" for o in declared) or "none"
            raise ConfigError(f"--set {key}: plugin {plugin!r} has no option {name!r}{did}; its options: {listed}",
                              hint="`nam plugins list --json` lists each plugin's options")
        values[name] = by_name[name].parse(plugin, value)
        explicit.add(name)
    return OptionValues(plugin, values, frozenset(explicit))
