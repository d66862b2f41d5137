"""Where the plugin reaches into mamba-ssm, and the import shim its 2.3.2.post1 release needs.

Every name the plugin uses from mamba-ssm, TileLang and Triton is resolved here, so a renamed module fails in
one place with one message. Nothing is imported at module load: ``nam plugins list`` and the CPU tests read
this file without mamba-ssm installed.

The shim. ``import mamba_ssm.<anything>`` runs the package ``__init__``, which imports the Mamba-1 selective
scan interface, which imports the compiled extension ``selective_scan_cuda`` without a guard. Mamba-3 uses
none of it (SISO is Triton, MIMO TileLang), and an install built with ``MAMBA_SKIP_CUDA_BUILD=TRUE`` does not
have it, so every Mamba-3 import fails. The patch-lane entry ``mamba-ssm-import-shim`` (``patches.py``)
installs a stand-in module under that name whose every attribute raises ``Mamba1Unavailable``: Mamba-3
imports, and anything that really calls Mamba-1 gets a clear error instead of a wrong result.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import re
import sys
import types
from pathlib import Path

from nam_core.errors import NamError

DISTRIBUTION = "mamba-ssm"
TESTED = "2.3.2.post1"
INSTALL_HINT = "MAMBA_SKIP_CUDA_BUILD=TRUE pip install --no-build-isolation 'nam-plugin-mamba-ssm[gpu]'"
EXTENSION = "selective_scan_cuda"
"""The Mamba-1 CUDA extension ``mamba_ssm/__init__`` imports (``ops/selective_scan_interface.py``)."""

SISO_MODULE = "mamba_ssm.ops.triton.mamba3.mamba3_siso_combined"
MIMO_MODULE = "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo"
MIMO_FWD_MODULE = "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_fwd"
MIMO_BWD_MODULE = "mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_bwd"
GROUPED_REDUCTION_MODULE = "mamba_ssm/ops/triton/mamba3/grouped_head_reduction.py"
"""Added with mamba-ssm's own grouped MIMO backward (PR #967); absent from 2.3.2.post1."""


def installed_version() -> str | None:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_dir() -> Path | None:
    """The installed ``mamba_ssm`` folder, found without running its ``__init__``."""
    from nam_core.patches import package_dir as installed_package_dir

    return installed_package_dir("mamba_ssm")


# --- the import shim ---------------------------------------------------------------------------------------


class Mamba1Unavailable(AttributeError):
    """Raised by the stand-in extension: Mamba-1's selective scan was called, and it is not installed."""


class _MissingExtension(types.ModuleType):
    """Stand-in for ``selective_scan_cuda``. Module dunders behave as absent; every other name raises."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise Mamba1Unavailable(
            f"{EXTENSION}.{name}: Mamba-1's CUDA selective scan is not installed. nam's mamba-ssm plugin put a "
            f"stand-in {EXTENSION} in sys.modules so Mamba-3 (which never uses it) can be imported. To run "
            "Mamba-1, install mamba-ssm with its CUDA build (pip install mamba-ssm, without MAMBA_SKIP_CUDA_BUILD)."
        )


def shim_installed() -> bool:
    return isinstance(sys.modules.get(EXTENSION), _MissingExtension)


def extension_missing() -> bool:
    """No real ``selective_scan_cuda`` can be imported (the stand-in does not count)."""
    module = sys.modules.get(EXTENSION)
    if module is not None:
        return isinstance(module, _MissingExtension)
    return importlib.util.find_spec(EXTENSION) is None


def imports_extension_unguarded(root: Path | None = None) -> bool:
    """The installed mamba-ssm imports the extension at package import, outside any ``try`` (2.3.2.post1).

    Read from the source: the fix upstream (PR #977) wraps the import in ``try``, but keeps the version
    string, so a version check cannot tell the two apart.
    """
    root = root if root is not None else package_dir()
    if root is None:
        return False
    source = root / "ops" / "selective_scan_interface.py"
    if not source.is_file():
        return False
    return re.search(rf"^import {EXTENSION}\b", source.read_text(), re.MULTILINE) is not None


def install_shim() -> None:
    """Put the stand-in in ``sys.modules`` (no-op when a real extension or the stand-in is there)."""
    if not extension_missing() or shim_installed():
        return
    stub = _MissingExtension(EXTENSION, "nam-plugin-mamba-ssm's stand-in for Mamba-1's CUDA extension")
    stub.__spec__ = importlib.machinery.ModuleSpec(EXTENSION, loader=None)
    sys.modules[EXTENSION] = stub


def remove_shim() -> None:
    """Take the stand-in out of ``sys.modules`` (the revert of ``install_shim``; a real extension stays)."""
    if shim_installed():
        del sys.modules[EXTENSION]


# --- the package's own import, deferred -------------------------------------------------------------------

PACKAGE = "mamba_ssm"


def package_init_imports(root: Path | None = None) -> list[str]:
    """The modules the installed package ``__init__`` imports when it runs (``nam_core.patches.imports_at_import``).
    2.3.2.post1's imports Mamba-1's scan, the Mamba, Mamba2 and Mamba3 modules and the LM head model, whose
    generation utilities import transformers: none of which Mamba-3's kernel modules use."""
    from nam_core.patches import imports_at_import

    root = root if root is not None else package_dir()
    source = None if root is None else root / "__init__.py"
    if source is None or not source.is_file():
        return []
    return imports_at_import(source, PACKAGE)


class _DeferredPackage(types.ModuleType):
    """The ``mamba_ssm`` package in ``sys.modules`` before its ``__init__`` has run (``defer_package_init``).
    Its submodules import as they would (``__path__`` is set); a submodule asked for as an attribute is imported
    alone; any other name (``Mamba2``, ``MambaLMHeadModel``, ``__version__``) runs the real ``__init__`` in
    place first, so the package then holds exactly what an ordinary import gives."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name not in ("__version__", "__all__"):
            raise AttributeError(name)  # the import machinery's and tools' probes do not run the package
        if importlib.util.find_spec(f"{self.__name__}.{name}") is not None:
            return importlib.import_module(f"{self.__name__}.{name}")
        run_package_init()
        return getattr(sys.modules[self.__name__], name)


def package_deferred() -> bool:
    return isinstance(sys.modules.get(PACKAGE), _DeferredPackage)


def defer_package_init() -> None:
    """Put the package in ``sys.modules`` without running its ``__init__`` (``_DeferredPackage``), so importing
    Mamba-3's modules costs only those modules. No-op when it is imported already (the cost is paid) or is not
    installed."""
    if PACKAGE in sys.modules:
        return
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _DeferredPackage
    sys.modules[PACKAGE] = module


def run_package_init() -> None:
    """Run the deferred package's ``__init__`` in place (the revert of ``defer_package_init``, and what the first
    name asked of the package does): the module object stays, so the submodules imported meanwhile stay its
    attributes. An error in it propagates, as from an ordinary import."""
    module = sys.modules.get(PACKAGE)
    if not isinstance(module, _DeferredPackage):
        return
    module.__class__ = types.ModuleType
    module.__spec__.loader.exec_module(module)


def has_grouped_backward(root: Path | None = None) -> bool:
    """The installed mamba-ssm reduces MIMO dQ/dK per B/C group itself (the file PR #967 added)."""
    root = root if root is not None else package_dir()
    return root is not None and (root.parent / GROUPED_REDUCTION_MODULE).is_file()


MIMO_FWD_SOURCE = "ops/tilelang/mamba3/mamba3_mimo_fwd.py"
"""The module whose ``mamba_mimo_forward`` driver builds the forward kernel; 2.3.2.post1 builds it with
``T.dynamic("B")``, ``"S"``, ``"H"``, ``"G"`` (PR #963), main builds it for the call's sizes again (PR #968)."""


def builds_dynamic_shapes(root: Path | None = None) -> bool:
    """The installed mamba-ssm's MIMO driver builds its kernels with dynamic batch/length/heads/groups."""
    root = root if root is not None else package_dir()
    source = None if root is None else root / MIMO_FWD_SOURCE
    if source is None or not source.is_file():
        return False
    return re.search(r"dynamic\(\s*[\"']B[\"']", source.read_text()) is not None


MIMO_SOURCE = "ops/tilelang/mamba3/mamba3_mimo.py"
"""The module of the MIMO autograd function (``_Mamba3Function``), whose backward 2.3.2.post1 writes reading
``ctx.saved_tensors`` twice."""


def mimo_backward_unpacks_twice(root: Path | None = None) -> bool:
    """The installed MIMO autograd function's backward reads ``ctx.saved_tensors`` more than once (read from the
    source: no import, so it works before the import shim)."""
    root = root if root is not None else package_dir()
    source = None if root is None else root / MIMO_SOURCE
    if source is None or not source.is_file():
        return False
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "_Mamba3Function":
            backward = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "backward"), None)
            return backward is not None and ast.unparse(backward).count("ctx.saved_tensors") > 1
    return False


# --- modules ------------------------------------------------------------------------------------------------


def tilelang_cache() -> str:
    """Where TileLang keeps its builds in this process (nam's cache unless the user set TILELANG_CACHE_DIR)."""
    from nam_core.cache import use_kernel_caches

    return use_kernel_caches()["TILELANG_CACHE_DIR"]


def load(module: str) -> types.ModuleType:
    """Import one of mamba-ssm's Mamba-3 modules, or fail with what is missing and the command that fixes it.

    The kernel compilers' disk caches are pointed into nam's cache first (``nam_core.cache``): TileLang reads
    its variable at import."""
    from nam_core.cache import use_kernel_caches

    use_kernel_caches()
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == EXTENSION:
            raise NamError(
                f"importing {module} needs Mamba-1's CUDA extension {EXTENSION} (mamba-ssm {installed_version()} "
                "imports it at package import, though Mamba-3 never uses it), and the import shim is not applied",
                hint="run through `nam train`, which applies the patch lane; in a script call "
                     "nam_plugin_mamba_ssm.patches.apply_needed() first",
            ) from e
        missing = e.name or str(e)
        raise NamError(f"importing {module} failed: module {missing!r} is not installed "
                       f"(mamba-ssm {installed_version() or 'not installed'})", hint=INSTALL_HINT) from e
