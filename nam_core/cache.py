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

KERNEL_CACHES = {"TILELANG_CACHE_DIR": "tilelang", "TRITON_CACHE_DIR": "triton",
                 "TORCHINDUCTOR_CACHE_DIR": "inductor"}
"""Environment variable of each kernel compiler's disk cache -> its folder under nam's cache."""
CACHE_SWITCHES = {"TRITON_CACHE_AUTOTUNING": "1"}
"""Caching a compiler leaves off by default, switched on unless the user set the variable: Triton's autotuner
keeps each choice in Triton's cache (keyed by Triton, the GPU target, the kernel's source, the configs and the
tuning key), so a second process on the host launches an autotuned kernel without timing every config again
(mamba-ssm's angle/dt kernels spent ~5 s of a warm start's launch check timing theirs; H200, 2026-11-28). A choice
is a speed, not a result: every config a tuner is offered computes the same values (a config measured to compute
otherwise is kept out of the list, as mimo-scan's ``PER_HEAD_CONFIGS``). Triton reads it when a kernel is
decorated, so this too must be set before the plugins import their kernels."""


_AT_START = {var: os.environ.get(var) for var in KERNEL_CACHES}
"""The kernel-cache variables as the process found them (the user's), before any compiler set its own default
(importing ``torch._inductor`` sets ``TORCHINDUCTOR_CACHE_DIR`` to ``/tmp/torchinductor_<user>``)."""


def planned_kernel_caches() -> list[str]:
    """Where a run started now puts each kernel compiler's cache (``use_kernel_caches``, which runs before any
    plugin loads): the user's own location, else its folder under ``cache_dir()``. The dry-run plan shows it."""
    return [_AT_START[var] or str(cache_dir() / sub) for var, sub in KERNEL_CACHES.items()]


def cache_dir() -> Path:
    """``$NAM_CACHE_DIR``, else ``~/.cache/nam``."""
    return Path(os.environ.get("NAM_CACHE_DIR") or Path.home() / ".cache" / "nam")


def use_kernel_caches() -> dict[str, str]:
    """Point every kernel compiler cache the user has not placed at its folder under ``cache_dir()`` and switch
    on ``CACHE_SWITCHES`` the user has not set; returns where each cache is now. Idempotent; creates no folder
    (the compilers do, on their first write)."""
    for var, sub in KERNEL_CACHES.items():
        if not os.environ.get(var):
            os.environ[var] = str(cache_dir() / sub)
    for var, value in CACHE_SWITCHES.items():
        os.environ.setdefault(var, value)
    return {var: os.environ[var] for var in KERNEL_CACHES}
