"""Declared bounds of config fields: what a field allows sits next to the field, and one function checks them.

A config dataclass declares a field's allowed values where it declares the field::

    lr: float = bounded(3e-4, gt=0, aka=("learning_rate",))
    dtype: str = bounded("float32", choices=("float32", "bfloat16"))

and the relations between fields as ``RULES = (Rule(("moe_topk", "num_experts"), "moe_topk <= num_experts",
lambda c: c.moe_topk <= c.num_experts),)``. ``out_of_bounds(config)`` lists every value outside its
bound, ``broken_rules(config)`` (asked only when every field is in range, so a rule may divide by any width)
every relation that fails; ``refuse`` turns such a list into one ``ConfigError`` (exit 2) naming each field,
its value, what is allowed, and the ``--set`` that works. The composition root (``nam56r.run.resolve``)
runs both before anything is written.

Every float, bounded or not, must be finite: ``nan > 0`` is False and ``inf > 0`` is True, so a comparison
alone lets one of them through, and either one turns a run's loss into nan a few steps later.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from nam_core.errors import ConfigError

BOUND = "nam.bound"
"""The key of a field's ``Bound`` in its dataclass metadata."""


@dataclass(frozen=True)
class Bound:
    """What one field allows. A tuple value is checked element by element."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None
    multiple_of: int | None = None
    note: str = ""
    """Why, or what a special value means (``0: no checkpoints``); quoted in the error."""
    flag: str | None = None
    """The command-line flag that also sets the field (``--seed``), for the hint."""
    aka: tuple[str, ...] = ()
    """Names other tools give this field (``learning_rate`` for ``lr``): ``--set`` suggests the field for
    them, and never accepts them silently."""

    def allows(self, value: Any) -> bool:
        """Whether ``value`` (each element of a tuple) is inside the bound; a nan or inf never is."""
        if isinstance(value, tuple):
            return all(self.allows(v) for v in value)
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.choices is not None:
            return value in self.choices
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return True  # strings and flags: only ``choices`` constrains them
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt)
                and (self.multiple_of is None or value % self.multiple_of == 0))

    def expected(self, value: Any) -> str:
        """What is allowed, in words: ``an integer >= 1``, ``a finite number in (0, 1)``, ``one of a, b``."""
        if self.choices is not None:
            text = "one of " + ", ".join(map(str, self.choices))
        else:
            sample = value[0] if isinstance(value, tuple) and value else value
            what = "an integer" if isinstance(sample, int) and not isinstance(sample, bool) else "a finite number"
            if isinstance(value, tuple):
                what = f"a list of {'integers' if what == 'an integer' else 'finite numbers'}, each"
            text = " and ".join(filter(None, [what + self._interval(), self._multiple()]))
        return f"{text} ({self.note})" if self.note else text

    def _interval(self) -> str:
        low = (f"[{_num(self.ge)}", self.ge) if self.ge is not None else (f"({_num(self.gt)}", self.gt)
        high = (f"{_num(self.le)}]", self.le) if self.le is not None else (f"{_num(self.lt)})", self.lt)
        if low[1] is not None and high[1] is not None:
            return f" in {low[0]}, {high[0]}"
        if low[1] is not None:
            return f" {'>=' if self.ge is not None else '>'} {_num(low[1])}"
        if high[1] is not None:
            return f" {'<=' if self.le is not None else '<'} {_num(high[1])}"
        return ""

    def _multiple(self) -> str:
        return f"a multiple of {self.multiple_of}" if self.multiple_of else ""

    def example(self) -> Any:
        """A value inside the bound, for a hint when the recipe's own value is no help."""
        if self.choices:
            return self.choices[0]
        for candidate in (self.ge, self.gt, self.le, self.lt):
            if candidate is None:
                continue
            for v in (candidate, candidate + 1, candidate - 1, candidate / 2, (candidate or 1) * 1e-3):
                if self.allows(v):
                    return v
        return self.multiple_of or 1


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def bounded(default: Any, *, ge=None, gt=None, le=None, lt=None, choices: Sequence | None = None,
            multiple_of: int | None = None, note: str = "", flag: str | None = None,
            aka: Sequence[str] = ()) -> Any:
    """A dataclass field with ``default`` and its declared ``Bound`` (see the module docstring)."""
    bound = Bound(ge=ge, gt=gt, le=le, lt=lt, choices=tuple(choices) if choices is not None else None,
                  multiple_of=multiple_of, note=note, flag=flag, aka=tuple(aka))
    return dataclasses.field(default=default, metadata={BOUND: bound})


@dataclass(frozen=True)
class Rule:
    """A relation between fields: ``Rule(("moe_topk", "num_experts"), "moe_topk <= num_experts", holds)``.

    ``holds(config)`` runs only when every field is inside its own bound; it may raise a ``ConfigError`` of
    its own where it knows more than True or False (a layer pattern points at the bad symbol)."""

    fields: tuple[str, ...]
    expected: str
    holds: Callable[[Any], bool]


def aliases(cls: type) -> dict[str, str]:
    """Other tools' names for fields of ``cls`` -> the field (``{"learning_rate": "lr"}``), for suggestions."""
    return {a: f.name for f in dataclasses.fields(cls) for a in f.metadata.get(BOUND, Bound()).aka}


@dataclass(frozen=True)
class Problem:
    """One value, or one relation, outside what the config allows."""

    line: str
    """``train.lr=nan: expected a finite number > 0``."""
    hint: str
    """``--set train.lr=0.003``."""


def out_of_bounds(config: Any, *, prefix: str = "", reference: Any = None) -> list[Problem]:
    """Every field of ``config`` outside its declared bound (every float outside the finite numbers).

    ``prefix``: how ``--set`` spells the fields (``"train."``). ``reference``: a config of the same class
    whose values the hints suggest (the recipe before the user's overrides)."""
    found = []
    for f in dataclasses.fields(config):
        bound = f.metadata.get(BOUND, Bound())
        value = getattr(config, f.name)
        if bound.allows(value):
            continue
        good = getattr(reference, f.name, None) if reference is not None else None
        good = _show(good if good is not None and bound.allows(good) else bound.example())
        key = prefix + f.name
        hint = f"{bound.flag} {good} (or --set {key}={good})" if bound.flag else f"--set {key}={good}"
        found.append(Problem(f"{key}={_show(value, quote=True)}: expected {bound.expected(value)}", hint))
    return found


def broken_rules(config: Any, *, prefix: str = "", reference: Any = None) -> list[Problem]:
    """Every ``RULES`` entry of ``config``'s class that does not hold. Call it only when ``out_of_bounds``
    found nothing: a rule may divide by a width it takes to be positive."""
    found = []
    for rule in getattr(type(config), "RULES", ()):
        if rule.holds(config):
            continue
        now = ", ".join(f"{prefix}{n}={_show(getattr(config, n), quote=True)}" for n in rule.fields)
        fixes = []
        if reference is not None:
            restored = dataclasses.replace(config, **{n: getattr(reference, n) for n in rule.fields})
            if rule.holds(restored):
                fixes = [f"--set {prefix}{n}={_show(getattr(reference, n))}" for n in rule.fields
                         if getattr(reference, n) != getattr(config, n)]
        found.append(Problem(f"{now}: expected {rule.expected}",
                             " ".join(fixes) or f"change one of {', '.join(prefix + n for n in rule.fields)}"))
    return found


def _show(value: Any, *, quote: bool = False) -> str:
    """A value as ``--set`` takes it: tuples as ``0,4,8``, strings quoted only in messages."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, str) and quote:
        return repr(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def refuse(found: Sequence[Problem]) -> None:
    """Raise one ``ConfigError`` listing ``found`` (nothing when it is empty)."""
    if not found:
        return
    if len(found) == 1:
        raise ConfigError(found[0].line, hint=found[0].hint)
    lines = "\n".join(f"  {p.line}" for p in found)
    raise ConfigError(f"{len(found)} problems with the config:\n{lines}",
                      hint=" ".join(dict.fromkeys(p.hint for p in found)))
