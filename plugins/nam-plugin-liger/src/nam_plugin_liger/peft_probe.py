"""Patch-lane entry ``liger-peft-probe-import``: ``liger_kernel.utils`` imports peft to set one flag.

The cost. ``liger_kernel.utils`` opens with ``try: import peft`` only to set ``PEFT_AVAILABLE``, which Liger's
Hugging Face integration reads. Every import of Liger's kernels goes through that module (``liger_kernel.ops``
-> ``ops.utils`` -> ``liger_kernel.utils``), and where peft is installed, importing it imports transformers and
scikit-learn: 15.3 s of a warm ``nam train`` start on an H200 (``python -X importtime``, round 17,
bench/README.md), inside the liger launch check. Neither the flag nor peft is used by the fused linear
cross-entropy nam calls.

The fix (``apply``): import ``liger_kernel.utils`` while ``sys.modules["peft"]`` is ``None`` (Python's own
"import blocked" marker, so its ``import peft`` raises ImportError at once), take the marker out, and set
``PEFT_AVAILABLE`` to whether peft is installed (``importlib.util.find_spec``): the flag means what it meant,
and peft is imported by whoever uses it. ``revert`` imports peft as the unpatched module would have.

Detected from the installed source (a top-level ``import peft``) while ``liger_kernel.utils`` and peft are not
yet imported and peft is installed; the reproducer imports Liger's fused CE in a fresh interpreter and looks for
peft in ``sys.modules``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from nam_core.patches import BUG_REPRODUCED, FIX_VALIDATED, NEEDED, Patch, imports_at_import, package_dir

NAME = "liger-peft-probe-import"
UTILS = "liger_kernel.utils"
PEFT = "peft"
FLCE_MODULE = "liger_kernel.ops.fused_linear_cross_entropy"
MARK = "_nam_peft_probe_skipped"
"""Set on ``liger_kernel.utils`` by ``apply``: this process imported it without peft."""


def utils_source() -> Path | None:
    """``liger_kernel/utils.py`` of the installed Liger, found without importing the package."""
    root = package_dir("liger_kernel")
    source = None if root is None else root / "utils.py"
    return source if source is not None and source.is_file() else None


def imports_peft_at_import(source: Path | None = None) -> bool:
    """The module imports peft when it runs (``nam_core.patches.imports_at_import``: top level, or in a top-level
    ``try``/``if``/``with``)."""
    source = source if source is not None else utils_source()
    return source is not None and any(name.split(".")[0] == PEFT
                                      for name in imports_at_import(source, "liger_kernel"))


def peft_installed() -> bool:
    return sys.modules.get(PEFT) is not None or importlib.util.find_spec(PEFT) is not None


def detect() -> bool:
    """The import is still ahead, would import peft, and peft is there to be imported."""
    return UTILS not in sys.modules and PEFT not in sys.modules and peft_installed() and imports_peft_at_import()


def apply() -> None:
    if UTILS in sys.modules or PEFT in sys.modules:
        return  # imported already: the cost is paid or was never due
    available = peft_installed()
    sys.modules[PEFT] = None  # `import peft` raises ImportError while it is there
    try:
        utils = importlib.import_module(UTILS)
    finally:
        if PEFT in sys.modules and sys.modules[PEFT] is None:
            del sys.modules[PEFT]
    utils.PEFT_AVAILABLE = available
    setattr(utils, MARK, True)


def revert() -> None:
    """The state the unpatched import leaves: peft imported where installed, and the flag as it set it."""
    utils = sys.modules.get(UTILS)
    if utils is None or not getattr(utils, MARK, False):
        return
    try:
        importlib.import_module(PEFT)
        utils.PEFT_AVAILABLE = True
    except ImportError:
        utils.PEFT_AVAILABLE = False
    delattr(utils, MARK)


def applied() -> bool:
    return bool(getattr(sys.modules.get(UTILS), MARK, False))


def apply_needed() -> bool:
    """Apply the entry when needed, outside the engine's lane (the launch check imports Liger before the lane
    runs); True when it did."""
    if make_patch().state()[0] != NEEDED:
        return False
    apply()
    return True


def reproduce() -> str:
    """Import Liger's fused CE in a fresh interpreter (this one's ``sys.path``), with the fix when this process
    has it: BUG_REPRODUCED when peft is in ``sys.modules`` after it, FIX_VALIDATED when it is not."""
    import subprocess

    code = f"import sys; sys.path[:0] = {sys.path!r}; "
    if applied():
        code += "from nam_plugin_liger import peft_probe; peft_probe.apply(); "
    code += f"import {FLCE_MODULE}; print({PEFT!r} in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"importing Liger's fused CE failed:\n{done.stderr[-2000:]}")
    return BUG_REPRODUCED if done.stdout.strip().splitlines()[-1] == "True" else FIX_VALIDATED


def make_patch() -> Patch:
    return Patch(
        name=NAME, target="liger-kernel", versions=">=0.8.0",
        summary="liger_kernel.utils imports peft at import only to set PEFT_AVAILABLE; with peft installed that "
                "imports transformers and scikit-learn (15 s of a warm start on an H200); the module is imported "
                "with peft blocked and the flag set from find_spec",
        retire_when="a liger-kernel release whose liger_kernel.utils does not import peft at import (a lazy or "
                    "find_spec probe); detection reads its source, so it retires itself there",
        detect=detect, apply=apply, revert=revert, reproduce=reproduce, needs_gpu=False,
    )
