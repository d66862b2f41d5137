"""Check rows a plugin declares and the host writes: ``ShapeCheck`` (the run's widths against what the kernels
take, at activation) and ``LaunchCheck`` (the kernels against the reference, on a real device).

A plugin says *what* is measured (``measure``: ``(ok, found)``, or a ``Measured`` that also states what was
needed) and what to do when it fails (``hint``); the host decides *whether* to ask, and writes the row:

* only when the run uses the plugin: one of its provided names is what a kind's field selects, or what a
  selected wrapper runs (``RunSpec.runs``); ``when`` replaces that rule for a check tied to an option;
* a ``LaunchCheck`` only on a real device (one skipped row per plugin on a ``--device-profile`` fake), only
  when none of the plugin's rows has failed (no kernel launches on a device or a model already refused), and
  also without a run (``nam preflight`` alone: ``measure`` gets ``None`` and checks the model's default widths);
* PASS or FAIL from ``ok`` (``Measured(None, ...)``: a skipped row; ``measure`` returning None: no row), the
  hint on a failure only, and a ``measure`` that raises is a FAIL row with the exception.

``measure`` may be a function or a ``"module:function"`` string, imported only when the row is written, so a
plugin's declaration stays importable without torch or its kernels.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Union

from nam_core.requirements import FAIL, PASS, SKIP, Check

if TYPE_CHECKING:
    from nam_core.plugin import PluginInfo
    from nam_core.run import RunSpec

Ref = Union[str, Callable]
"""A function, or the ``"module:function"`` path of one."""


class Measured(NamedTuple):
    ok: bool | None
    """Whether it passed; None: it does not apply to this run (a skipped row saying why in ``found``)."""
    found: str
    needed: str | None = None
    """What was needed, when only the measurement knows it (a tolerance the self-test returns)."""
    hint: str | None = None
    """The next command, when it depends on how the check failed."""


def load(ref: Ref) -> Callable:
    """The function ``ref`` names (``"nam_plugin_x.selftest:launch"``), or ``ref`` itself."""
    if callable(ref):
        return ref
    module, sep, attr = ref.partition(":")
    if not sep:
        raise ValueError(f"{ref!r}: expected a function or 'module:function'")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class ShapeCheck:
    """A row written at activation: does the run's model have widths the plugin's kernels take?"""

    name: str
    """The row's name (``kernel shapes``)."""
    needed: str
    """What the kernels take, in words."""
    measure: Ref
    """``measure(spec) -> (ok, found)``: ``found`` says the run's widths and, when not ok, why they do not fit."""
    hint: str | Callable[[Any], str]
    """The next command when the widths do not fit (or ``hint(spec)``)."""
    when: Callable[[Any], bool] | None = None
    """``when(spec) -> bool`` in place of "the run uses the plugin" (a check of an option's part)."""

    def row(self, plugin: str, spec: "RunSpec") -> Check | None:
        return _row(plugin, self.name, self.needed, load(self.measure)(spec), self.hint, spec)


@dataclass(frozen=True)
class LaunchCheck:
    """A row written on a real device: the plugin's kernels compiled, launched once, held to the reference."""

    name: str
    """The row's name (``kernel launch``)."""
    needed: str | None
    """What passes, in words; None when only the measurement knows it (then ``Measured.needed`` says it)."""
    measure: Ref
    """``measure(spec) -> (ok, found)`` or a ``Measured`` (or None: no row); ``spec`` is None for ``nam
    preflight`` without a run (then check the model's default widths). Imported and called only on a real
    device."""
    hint: str | Callable[[Any], str]
    """The next command when it fails (or ``hint(spec)``): report it, and what to run meanwhile."""
    when: Callable[[Any], bool] | None = None
    """``when(spec) -> bool`` in place of "the run uses the plugin" (asked only with a run)."""

    def row(self, plugin: str, spec: "RunSpec | None") -> Check | None:
        started = time.perf_counter()
        row = _row(plugin, self.name, self.needed, load(self.measure)(spec), self.hint, spec)
        return None if row is None else dataclasses.replace(row, seconds=round(time.perf_counter() - started, 3))


def _row(plugin: str, name: str, needed: str, measured: Any, hint, spec) -> Check | None:
    if measured is None:
        return None  # nothing of this check applies (a launch check of a part the run does not build)
    m = Measured(*measured)
    needed = m.needed if m.needed is not None else needed
    if m.ok is None:
        return Check(plugin, name, SKIP, needed, m.found)
    if m.ok:
        return Check(plugin, name, PASS, needed, m.found)
    return Check(plugin, name, FAIL, needed, m.found, m.hint or (hint(spec) if callable(hint) else hint))


def uses(info: "PluginInfo", spec: "RunSpec") -> bool:
    """Whether the run uses a backend the plugin provides (named by its kind's field, or wrapped by that one)."""
    return any(spec.runs(kind, name) for kind, names in info.provides.items() for name in names)


def asked(check: ShapeCheck | LaunchCheck, info: "PluginInfo", spec: "RunSpec | None") -> bool:
    """Whether the host writes ``check``'s row for this run (``None``: launch checks without a run)."""
    if spec is None:
        return isinstance(check, LaunchCheck)
    return check.when(spec) if check.when is not None else uses(info, spec)


def config_rows(plugin: str, info: "PluginInfo", spec: "RunSpec") -> list[Check]:
    """The ``ShapeCheck`` rows of ``plugin`` that the host writes for ``spec``, in declaration order."""
    return _rows(ShapeCheck, "config", plugin, info, spec)


def launch_rows(plugin: str, info: "PluginInfo", spec: "RunSpec | None") -> list[Check]:
    """The ``LaunchCheck`` rows of ``plugin`` for ``spec`` (call on a real device only)."""
    return _rows(LaunchCheck, "launch", plugin, info, spec)


def _rows(kind: type, what: str, plugin: str, info: "PluginInfo", spec: "RunSpec | None") -> list[Check]:
    """The rows of ``plugin``'s declared checks of ``kind`` that the run asks, in declaration order."""
    rows = [_guarded(plugin, what, lambda c=check: c.row(plugin, spec))
            for check in info.checks if isinstance(check, kind) and asked(check, info, spec)]
    return [r for r in rows if r is not None]


def _guarded(plugin: str, what: str, write: Callable[[], Check | None]) -> Check | None:
    try:
        return write()
    except Exception as e:  # a declared check that crashes has failed; activation must stop, not skip it
        return raised(plugin, what, e)


def raised(plugin: str, what: str, error: Exception) -> Check:
    """The FAIL row of a check that raised instead of answering."""
    return Check(plugin, f"{what} check", FAIL, "the check to run", f"it raised {type(error).__name__}: {error}")
