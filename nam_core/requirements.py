"""Declarative requirements and the checks they produce.

A plugin states what it needs in ``PluginInfo.requires`` as data, so ``nam plugins list`` and ``nam
preflight`` can show it without importing any kernel. Each ``Requirement`` evaluates to a ``Check`` against
a ``DeviceInfo``: pass, fail (with what was needed, what was found and the next command), or skip.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field

from packaging.specifiers import InvalidSpecifier, SpecifierSet
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
    nbytes: int | None = None
    spec: str | None = None
    known_bad: tuple[tuple[str, str], ...] = field(default=())
    reason: str = ""
    install_hint: str | None = None

    # --- constructors ---------------------------------------------------------------------------
    @classmethod
    def cuda_device(cls, reason: str = "") -> "Requirement":
        """Any CUDA device."""
        return cls(kind="cuda_device", reason=reason)

    @classmethod
    def cuda_capability(cls, at_least: tuple[int, int], reason: str = "") -> "Requirement":
        """A CUDA device of compute capability ``at_least`` or newer."""
        return cls(kind="cuda_capability", capability=tuple(at_least), reason=reason)

    @classmethod
    def shared_memory_per_block(cls, at_least: int, reason: str = "") -> "Requirement":
        """Opt-in shared memory per block of at least ``at_least`` bytes (what the largest kernel asks)."""
        return cls(kind="smem_per_block", nbytes=int(at_least), reason=reason)

    @classmethod
    def package(
        cls, spec: str, *, known_bad: dict[str, str] | None = None, install_hint: str | None = None
    ) -> "Requirement":
        """An installed distribution matching ``spec`` (PEP 508, e.g. ``"liger-kernel>=0.8.2"``).

        ``known_bad`` maps exact versions to the reason they must not be used.
        """
        try:
            PkgRequirement(spec)
        except InvalidRequirement as e:
            raise ValueError(f"invalid package requirement {spec!r}: {e}") from None
        return cls(
            kind="package", spec=spec, known_bad=tuple(sorted((known_bad or {}).items())),
            install_hint=install_hint,
        )

    # --- description ------------------------------------------------------------------------------
    @property
    def title(self) -> str:
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
            return f">= sm_{self.capability[0]}{self.capability[1]}"
        if self.kind == "smem_per_block":
            return f">= {_fmt_bytes(self.nbytes)}"
        bad = f", not {', '.join(v for v, _ in self.known_bad)}" if self.known_bad else ""
        return f"{self.spec}{bad}"

    def to_dict(self) -> dict:
        return {"check": self.title, "needed": self.needed, "reason": self.reason}

    # --- evaluation -------------------------------------------------------------------------------
    def check(self, plugin: str, device: DeviceInfo) -> Check:
        if self.kind == "package":
            return self._check_package(plugin)
        return self._check_device(plugin, device)

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
            return self._result(plugin, tuple(cap) >= self.capability, f"sm_{cap[0]}{cap[1]}", move)
        have = device.smem_per_block_optin
        if have is None:
            return self._result(plugin, False, "unknown (this torch build does not report it)", move)
        return self._result(plugin, have >= self.nbytes, _fmt_bytes(have), move)

    def _check_package(self, plugin: str) -> Check:
        req = PkgRequirement(self.spec)
        hint = self.install_hint or f"pip install '{self.spec}'"
        try:
            installed = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            return self._result(plugin, False, "not installed", hint)
        for bad, why in self.known_bad:
            if Version(installed) == Version(bad):
                return self._result(plugin, False, f"{installed} (known bad: {why})", hint)
        try:
            ok = req.specifier.contains(installed, prereleases=True)
        except InvalidSpecifier:  # pragma: no cover - validated at construction
            ok = False
        return self._result(plugin, ok, installed, hint)


def version_in(installed: str, specifier: str) -> bool:
    """True when ``installed`` lies in ``specifier`` (pre-releases included)."""
    return SpecifierSet(specifier).contains(installed, prereleases=True)
