"""Which cuDNN Transformer Engine loads: torch's own, or the process gets two.

TE's loader (``transformer_engine/common/__init__.py``, 2.20) looks for ``libcudnn.so*`` in ``$CUDNN_HOME``,
``$CUDNN_PATH``, ``$CUDA_HOME``, ``$CUDA_PATH`` and ``/usr/local/cuda`` before the Python wheels, and loads the
first it finds with ``RTLD_GLOBAL``. On a host whose CUDA toolkit carries an older cuDNN (9.14) than the one
torch's wheel bundles and was built against (9.19), TE loads the toolkit's, torch then finds that one by its
soname, and ``torch.backends.cudnn`` refuses ("cuDNN version incompatibility") or a cuDNN symbol is missing.
Pointing ``CUDNN_HOME`` at torch's bundled cuDNN before TE is first imported makes TE load torch's file.

This module stays light (no torch, no TE): ``nam_plugin_te`` calls ``prefer_torch_cudnn`` when it is imported,
which in ``nam train`` and ``nam preflight`` is before anything imports TE (the megatron engine's ranks inherit
the variable through the relaunch).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

LAYOUTS = ("nvidia/cudnn/lib", "nvidia/cu13/lib", "nvidia/cu12/lib")
"""Where the ``nvidia-cudnn`` wheels put ``libcudnn.so.9``, relative to a site-packages folder."""


def torch_cudnn_dir() -> str | None:
    """The folder of the cuDNN library torch's wheel bundles (found without importing torch), or None."""
    spec = importlib.util.find_spec("torch")
    roots = [Path(spec.origin).parent.parent] if spec is not None and spec.origin else []
    roots += [Path(p) for p in sys.path if p and Path(p).is_dir()]
    for root in roots:
        for layout in LAYOUTS:
            folder = root / layout
            if folder.is_dir() and any(folder.glob("libcudnn.so*")):
                return str(folder)
    return None


def prefer_torch_cudnn() -> str | None:
    """Set ``CUDNN_HOME`` to torch's bundled cuDNN, unless the user set ``CUDNN_HOME`` or ``CUDNN_PATH``, TE is
    already imported, or torch bundles none; the folder set, or None."""
    if "transformer_engine" in sys.modules or os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH"):
        return None
    folder = torch_cudnn_dir()
    if folder is not None:
        os.environ["CUDNN_HOME"] = folder
    return folder


def loaded_cudnn_files(maps: str = "/proc/self/maps") -> list[str]:
    """The ``libcudnn.so*`` files mapped into this process (Linux), in the order first seen."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return []
    paths = [line.split()[-1] for line in text.splitlines() if "/libcudnn.so" in line]
    return list(dict.fromkeys(paths))
