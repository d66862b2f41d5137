"""The patch lane: every fix nam carries for an upstream library, with proof and an end date.

A ``Patch`` names the distribution and version range it targets, a cheap ``detect()`` (is the bug present in
what is installed?), an idempotent ``apply()``, a ``reproduce()`` that returns ``BUG_REPRODUCED`` or
``FIX_VALIDATED`` (``nam patches --verify`` runs it), and its retirement condition: the upstream release or
PR that makes it unnecessary. Plugins register patches through ``nam_register_patches``.

States, in the order they are decided:

* ``not-installed``: the target distribution is absent; nothing to do.
* ``not-applicable``: the installed version is older than the range (``needs >= 0.19``): the patch is for a
  release this machine does not run yet; nothing to do here, and nothing upstream has fixed.
* ``retired``: the installed version is past the range, or ``detect()`` says the bug is absent. The
  patch is not applied, and ``nam patches`` says so: time to delete it once every supported version is out.
* ``needed`` -> ``applied`` by ``apply_all``. A patch that raises while applying, or whose ``detect()``
  still reports the bug afterwards, stops the run (``PatchError``).

A patch with a ``revert`` can be applied for a scope only: ``with applied(entries): ...`` applies what is
needed, and on the way out reverts what it applied, last first, whatever happens inside (the megatron
engine applies its Megatron-Core fixes for the run this way). ``apply_all`` applies for the rest of the
process, as before.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from nam_core.errors import PatchError
from nam_core.requirements import version_in

BUG_REPRODUCED = "BUG_REPRODUCED"
FIX_VALIDATED = "FIX_VALIDATED"

NOT_INSTALLED, NOT_APPLICABLE, RETIRED, NEEDED, APPLIED = (
    "not-installed", "not-applicable", "retired", "needed", "applied")


@dataclass(eq=False)
class Patch:
    name: str
    """Patch-lane name, e.g. ``mamba3-mimo-gqa-bwd``."""
    target: str
    """Distribution the fix is for, e.g. ``mamba-ssm``."""
    versions: str
    """Specifier of the versions that may carry the bug, e.g. ``"<=2.3.2.post1"``."""
    summary: str
    """One line: the bug and the fix."""
    retire_when: str
    """The upstream release or PR that makes this patch unnecessary."""
    detect: Callable[[], bool]
    """True when the bug is present in what is installed. Cheap: a version or feature check."""
    apply: Callable[[], None]
    """Apply the fix; calling it twice must be harmless."""
    reproduce: Callable[[], str] | None = None
    """Run the reproducer; return BUG_REPRODUCED (bug present, unpatched) or FIX_VALIDATED."""
    needs_gpu: bool = False
    """The reproducer launches GPU code; ``nam patches --verify`` skips it on a CPU machine."""
    revert: Callable[[], None] | None = None
    """Undo ``apply`` (put upstream's code back); calling it when nothing is applied must be harmless. A patch
    without one can be applied for the whole process only (``apply_all``), not for a scope (``applied``)."""

    def installed_version(self) -> str | None:
        try:
            return importlib.metadata.version(self.target)
        except importlib.metadata.PackageNotFoundError:
            return None

    def state(self) -> tuple[str, str]:
        """(state, detail) for what is installed now, without applying anything."""
        version = self.installed_version()
        if version is None:
            return NOT_INSTALLED, f"{self.target} is not installed"
        if not version_in(version, self.versions):
            floor = unmet_floor(version, self.versions)
            if floor is not None:
                return NOT_APPLICABLE, f"{self.target} {version}: not applicable: needs {floor}"
            return RETIRED, f"{self.target} {version} is outside {self.versions}; fixed upstream"
        if not self.detect():
            return RETIRED, f"{self.target} {version}: bug not present"
        return NEEDED, f"{self.target} {version}: bug present"


def unmet_floor(version: str, versions: str) -> str | None:
    """The lower bound of ``versions`` that ``version`` is below (``">= 0.19"`` for 0.16.1 in ``">=0.19"``), or
    None when ``version`` is not below the range (inside it, or past its upper end)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    have = Version(version)
    for spec in SpecifierSet(versions):
        if spec.contains(have, prereleases=True):
            continue
        if spec.operator in (">=", ">") or (spec.operator in ("~=", "==") and have < Version(spec.version.rstrip(".*"))):
            return f"{spec.operator} {spec.version}"
    return None


# --- what detections read: an installed package's source, without importing it ------------------------------


def package_dir(name: str) -> Path | None:
    """The installed folder of package ``name``, found without running its ``__init__`` (None: not installed, or
    not a package)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def imports_at_import(source: Path, package: str) -> list[str]:
    """The modules a module imports when it runs, read from its ``source`` (top level and the bodies of top-level
    ``try``, ``if`` and ``with``; not inside functions or classes): ``import a.b`` gives ``a.b``, ``from m import
    n`` gives ``m`` and ``m.n`` (``n`` may be a submodule); relative names are resolved in ``package``, the package
    the module belongs to (for a package's ``__init__``, the package itself)."""
    found: list[str] = []

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                found.extend([module, *(f"{module}.{alias.name}" for alias in node.names)])
            elif isinstance(node, (ast.Try, ast.If, ast.With)):
                for part in ("body", "orelse", "finalbody"):
                    visit(getattr(node, part, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
    visit(ast.parse(source.read_text()).body)
    return found


@dataclass(frozen=True)
class PatchReport:
    name: str
    plugin: str
    target: str
    state: str
    detail: str
    retire_when: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def apply_all(entries: Iterable) -> list[PatchReport]:
    """Apply every needed patch of the registry entries given; stop the run on any failure."""
    return _apply(entries, scoped=False)


@contextlib.contextmanager
def applied(entries: Iterable) -> Iterator[list[PatchReport]]:
    """Apply every needed patch of ``entries`` for the ``with`` block, then revert those it applied, last first.

    A needed patch without ``revert`` stops the run before anything is applied (``PatchError``): it could not
    be taken back. A failure to apply reverts what this call applied before it, then raises.
    """
    entries = list(entries)
    fixed = [e for e in entries if e.impl.revert is None and e.impl.state()[0] == NEEDED]
    if fixed:
        raise PatchError(f"patch {fixed[0].impl.name!r} (plugin {fixed[0].plugin!r}) has no revert and cannot be "
                         "applied for a scope only", hint="give the Patch a revert, or apply it with apply_all")
    done: list[Patch] = []
    try:
        yield _apply(entries, scoped=True, done=done)
    finally:
        for patch in reversed(done):
            patch.revert()


def _apply(entries: Iterable, *, scoped: bool, done: list | None = None) -> list[PatchReport]:
    reports = []
    for entry in entries:
        patch: Patch = entry.impl
        state, detail = patch.state()
        if state == NEEDED:
            try:
                patch.apply()
            except Exception as e:  # any failure to apply must stop the run, whatever its type
                raise PatchError(
                    f"patch {patch.name!r} (plugin {entry.plugin!r}) failed to apply to {detail}: {e}",
                    hint=f"run `nam patches --verify` for the reproducer; retire condition: {patch.retire_when}",
                ) from e
            if done is not None:
                done.append(patch)
            if patch.detect():
                raise PatchError(
                    f"patch {patch.name!r} (plugin {entry.plugin!r}) applied, but the bug is still detected",
                    hint="`nam patches --verify` shows the reproducer's result",
                )
            fixed = "fixed for this scope" if scoped else "fixed in-process"
            state, detail = APPLIED, detail.replace("bug present", fixed)
        reports.append(PatchReport(patch.name, entry.plugin, patch.target, state, detail, patch.retire_when))
    return reports
