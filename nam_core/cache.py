"""nam's cache folder, and the kernel compilers' caches kept inside it.

Everything nam keeps between runs on a machine lives under one folder: ``$NAM_CACHE_DIR``, else
``~/.cache/nam``. That holds the prepared default corpus and the compile caches of the kernel libraries the
plugins and nam's compiled regions build with (TileLang, Triton, torch.compile's inductor), so moving or wiping
nam's cache is one folder, copying it to a fresh host takes every build along, and a second run on the same
machine reads its kernels from disk instead of rebuilding them (minutes for mamba-ssm's MIMO kernels).

A compile cache the user has pointed elsewhere (``TILELANG_CACHE_DIR``, ``TRITON_CACHE_DIR``,
``TORCHINDUCTOR_CACHE_DIR`` already set) is left where it is. TileLang reads its variable when it is imported, so
``use_kernel_caches()`` runs before any plugin is loaded (``PluginHost.evaluate``; the mamba-ssm plugin's
``upstream`` loader calls it too, for code that imports it without a host).
"""

from __future__ import annotations

import os
from pathlib import Path

KERNEL_CACHES = {"TILELANG_CACHE_DIR": "tilelang", "TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}
"""Environment variable of each kernel compiler's disk cache -> its folder under nam's cache."""


def cache_dir() -> Path:
    """``$NAM_CACHE_DIR``, else ``~/.cache/nam``."""
    return Path(os.environ.get("NAM_CACHE_DIR") or Path.home() / ".cache" / "nam")


def use_kernel_caches() -> dict[str, str]:
    """Point every kernel compiler cache the user has not placed at its folder under ``cache_dir()``; returns
    where each one is now. Idempotent; creates no folder (the compilers do, on their first write)."""
    for var, sub in KERNEL_CACHES.items():
        if not os.environ.get(var):
            os.environ[var] = str(cache_dir() / sub)
    return {var: os.environ[var] for var in KERNEL_CACHES}
