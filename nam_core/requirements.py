"""Declarative requirements and the checks they produce.

A plugin states what it needs in ``PluginInfo.requires`` as data, so ``nam plugins list`` and ``nam
preflight`` can show it without importing any kernel. Each ``Requirement`` evaluates to a ``Check`` against
a ``DeviceInfo``: pass, fail (with what was needed, what was found and the next command), or skip.

An engine states what it needs from its process the same way (``nam_core.engine.megatron.checks``), and
evaluates it against facts it gathered itself (``runtime_facts``, or a test's): a package against the version
found there (``check_installed``), a ``fact`` requirement against a yes/no and what was found (``check_fact``).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.requirements import InvalidRequirement, Requirement as PkgRequirement
from packaging.version import Version

from nam_core.device import DeviceInfo

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass(frozen=True)
class Check:
    """One line of a preflight report."""

    plugin: str
    name: str
    status: str
    """"pass", "fail" or "skip"."""
    needed: str = ""
    found: str = ""
    hint: str | None = None
    seconds: float | None = None
    """How long a launch check took (its kernel builds or cache loads and its launches); None for other rows."""

    @property
    def ok(self) -> bool:
        return self.status != FAIL

    def describe(self) -> str:
        text = f"{self.plugin}: {self.name}"
        if self.needed or self.found:
            text += f": needs {self.needed}, found {self.found}"
        return text

    def to_dict(self) -> dict:
        return {
            "plugin": self.plugin, "check": self.name, "status": self.status,
            "needed": self.needed, "found": self.found, "hint": self.hint,
            **({"seconds": self.seconds} if self.seconds is not None else {}),
        }


def unused(plugin: str, field: str, found: str) -> Check:
    """The skip row of a plugin that is active while the model's ``field`` names another backend, ``found``
    (an explicit ``--set`` beat the plugin's selection): the run goes on without it, and says so."""
    return Check(plugin, "selected", SKIP, f"{field}={plugin}", f"{field}={found}: active but unused",
                 hint=f"--set {field}={plugin}")


def _fmt_bytes(n: int) -> str:
    return f"{n:,} B ({n / 1024:.0f} KiB)"


@dataclass(frozen=True)
class Requirement:
    """A need a plugin declares. Build with the class methods; evaluate with ``check``."""

    kind: str
    capability: tuple[int, int] | None = None
    below: tuple[int, int] | None = None
    """For ``cuda_capability``: the first capability that no longer qualifies (None: no upper bound)."""
    nbytes: int | None = None
    spec: str | None = None
    known_bad: tuple[tuple[str, str], ...] = field(default=())
    reason: str = ""
    install_hint: str | None = None
    label: str | None = None
    """The row's name, when not the kind's (``title``); a ``fact`` requirement always has one."""
    text: str | None = None
    """What a ``fact`` requirement needs, in words (``needed``)."""

    # --- constructors ---------------------------------------------------------------------------
    @classmethod
    def cuda_device(cls, reason: str = "") -> "Requirement":
        """Any CUDA device."""
        return cls(kind="cuda_device", reason=reason)

    @classmethod
    def cuda_capability(cls, at_least: tuple[int, int], reason: str = "", *,
                        below: tuple[int, int] | None = None) -> "Requirement":
        """A CUDA device of compute capability ``at_least`` or newer (and older than ``below``, when given: a
        library built and measured for some architectures only)."""
        return cls(kind="cuda_capability", capability=tuple(at_least), below=tuple(below) if below else None,
                   reason=reason)

    @classmethod
    def shared_memory_per_block(cls, at_least: int, reason: str = "") -> "Requirement":
        """Opt-in shared memory per block of at least ``at_least`` bytes (what the largest kernel asks)."""
        return cls(kind="smem_per_block", nbytes=int(at_least), reason=reason)

    @classmethod
    def package(
        cls, spec: str, *, known_bad: dict[str, str] | None = None, install_hint: str | None = None,
        reason: str = "", label: str | None = None,
    ) -> "Requirement":
        """An installed distribution matching ``spec`` (PEP 508, e.g. ``"liger-kernel>=0.8.2"``).

        ``known_bad`` maps exact versions to the reason they must not be used; ``reason`` (why it is needed)
        is shown with what is needed.
        """
        try:
            PkgRequirement(spec)
        except InvalidRequirement as e:
            raise ValueError(f"invalid package requirement {spec!r}: {e}") from None
        return cls(
            kind="package", spec=spec, known_bad=tuple(sorted((known_bad or {}).items())),
            install_hint=install_hint, reason=reason, label=label,
        )

    @classmethod
    def fact(cls, label: str, needed: str, *, hint: str, reason: str = "") -> "Requirement":
        """A need that is neither a device nor a package (a launch, a torch feature, a setting). It has no
        probe of its own: its owner gathers the facts and evaluates it with ``check_fact``."""
        return cls(kind="fact", label=label, text=needed, install_hint=hint, reason=reason)

    # --- description ------------------------------------------------------------------------------
    @property
    def title(self) -> str:
        if self.label is not None:
            return self.label
        if self.kind == "cuda_device":
            return "CUDA device"
        if self.kind == "cuda_capability":
            return "CUDA capability"
        if self.kind == "smem_per_block":
            return "shared memory per block"
        return f"package {PkgRequirement(self.spec).name}"

    @property
    def needed(self) -> str:
        if self.kind == "cuda_device":
            return "a CUDA device"
        if self.kind == "cuda_capability":
            below = f", below sm_{self.below[0]}{self.below[1]}" if self.below else ""
            why = f" ({self.reason})" if self.reason and self.below else ""
            return f">= sm_{self.capability[0]}{self.capability[1]}{below}{why}"
        if self.kind == "smem_per_block":
            return f">= {_fmt_bytes(self.nbytes)}"
        if self.kind == "fact":
            return self.text
        bad = f", not {', '.join(v for v, _ in self.known_bad)}" if self.known_bad else ""
        why = f" ({self.reason})" if self.reason else ""
        return f"{self.spec}{bad}{why}"

    def to_dict(self) -> dict:
        return {"check": self.title, "needed": self.needed, "reason": self.reason}

    # --- evaluation -------------------------------------------------------------------------------
    def check(self, plugin: str, device: DeviceInfo) -> Check:
        if self.kind == "fact":
            raise TypeError(f"requirement {self.title!r} is a fact its owner gathers: evaluate it with check_fact")
        if self.kind == "package":
            return self._check_package(plugin)
        return self._check_device(plugin, device)

    def check_fact(self, plugin: str, ok: bool, found: str) -> Check:
        """This ``fact`` requirement against what its owner found: ``ok`` and, in words, ``found``."""
        if self.kind != "fact":
            raise TypeError(f"requirement {self.title!r} is a {self.kind} requirement, not a fact")
        return self._result(plugin, bool(ok), found, self.install_hint)

    def check_installed(self, plugin: str, installed: str | bool | None, *, note: str | None = None) -> Check:
        """This package requirement against a version found elsewhere than this environment's metadata (another
        process's facts, a module on ``PYTHONPATH`` without metadata, a test): ``installed`` is the version
        found, True for installed at an unknown version, None or False for not installed. ``note`` is added to
        what was found, in parentheses (``"Python 3.11"``)."""
        if self.kind != "package":
            raise TypeError(f"requirement {self.title!r} is a {self.kind} requirement, not a package")
        req = PkgRequirement(self.spec)
        hint = self.install_hint or f"pip install '{self.spec}'"
        if installed is None or installed is False:
            ok, found = False, "not installed"
        elif installed is True:  # no version to compare: enough only for a requirement without one
            ok = not str(req.specifier)
            found = "installed" if ok else "installed, version unknown"
        else:
            bad = dict(self.known_bad)
            why = next((w for v, w in bad.items() if Version(installed) == Version(v)), None)
            ok = why is None and req.specifier.contains(installed, prereleases=True)
            found = installed if why is None else f"{installed} (known bad: {why})"
        if note:
            found = f"{found} ({note})"
        return self._result(plugin, ok, found, hint)

    def _result(self, plugin: str, ok: bool, found: str, hint: str | None) -> Check:
        return Check(plugin, self.title, PASS if ok else FAIL, self.needed, found, None if ok else hint)

    def _check_device(self, plugin: str, device: DeviceInfo) -> Check:
        move = f"run on a machine that has it, or drop it: `nam preflight` without {plugin}"
        if not device.is_cuda:
            return self._result(plugin, False, f"no CUDA device ({device.label})", move)
        if self.kind == "cuda_device":
            return self._result(plugin, True, device.label, None)
        if self.kind == "cuda_capability":
            cap = device.capability
            ok = tuple(cap) >= self.capability and (self.below is None or tuple(cap) < self.below)
            return self._result(plugin, ok, f"sm_{cap[0]}{cap[1]}", move)
        have = device.smem_per_block_optin
        if have is None:
            return self._result(plugin, False, "unknown (this torch build does not report it)", move)
        return self._result(plugin, have >= self.nbytes, _fmt_bytes(have), move)

    def _check_package(self, plugin: str) -> Check:
        try:
            installed = importlib.metadata.version(PkgRequirement(self.spec).name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        return self.check_installed(plugin, installed)


def version_in(installed: str, specifier: str) -> bool:
    """True when ``installed`` lies in ``specifier`` (pre-releases included)."""
    return SpecifierSet(specifier).contains(installed, prereleases=True)
