"""Which cuDNN Transformer Engine loads: torch's own, or the process gets two.

TE's loader (``transformer_engine/common/__init__.py``, 2.20) looks for ``libcudnn.so*`` in ``$CUDNN_HOME``,
``$CUDNN_PATH``, ``$CUDA_HOME``, ``$CUDA_PATH`` and ``/usr/local/cuda`` before the Python wheels, and loads the
first it finds with ``RTLD_GLOBAL``. Then it loads its core library, ``libtransformer_engine.so``, which names
every cuDNN sub-library (``libcudnn_graph.so.9``, ``libcudnn_ops.so.9``, ...) as a dependency and carries no
run path: the dynamic loader resolves those through ``ld.so.cache``. On nam's GPU host (2026-11-25) the system
holds cuDNN 9.14 in ``/lib/x86_64-linux-gnu`` while torch 2.11 bundles and was built with 9.19: TE's core
pulled in the system's ``libcudnn_graph.so.9``, torch's ``libcudnn.so.9`` then found that one by its soname, and
``torch.backends.cudnn`` refused ("cuDNN version incompatibility: ... found runtime version (9, 14, 0)") or a
cuDNN symbol was missing. Setting ``CUDNN_HOME`` alone did not help (measured: the same refusal).

TE is imported by more than nam-plugin-te: Megatron-Core imports it wherever it is installed, and nam imports
Megatron-Core in both engines (its indexed datasets, the megatron engine). On the same host a local-engine run
without the te plugin died in liger's launch check (2026-11-28, H200: ``libcudnn_cnn.so.9: undefined symbol
..., version libcudnn_graph.so.9``): the process held torch's cuDNN and the system's at once.

So before TE is first imported, ``prefer_torch_cudnn`` points ``CUDNN_HOME`` at torch's bundled folder and loads
each of that folder's cuDNN libraries with ``RTLD_GLOBAL``: every soname TE's core asks for is then already
torch's. ``import nam_core`` calls it when Transformer Engine is installed (``when_te_installed``), which is
before anything nam runs imports TE; the processes it starts (the megatron engine's ranks, a benchmark's
workers) get torch's folder first on ``LD_LIBRARY_PATH``, which this sets (measured: without it the ranks loaded
the system's sub-libraries and the row refused the run). Whatever went wrong, nam-plugin-te's ``cuDNN``
preflight row compares what the process mapped with torch's folder and refuses with the fix.
"""

from __future__ import annotations

import ctypes
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


FIRST = ("libcudnn.so.9", "libcudnn_graph.so.9", "libcudnn_ops.so.9", "libcudnn_heuristic.so.9")
"""Loaded before the folder's other cuDNN libraries, which depend on them."""

PRELOAD_ERROR: str | None = None
"""Why the preload of torch's cuDNN failed in this process (shown by the ``cuDNN`` preflight row), or None."""


def preload_order(folder: str) -> list[Path]:
    """The cuDNN libraries of ``folder`` (one file per soname, ``libcudnn*.so.9``) in the order they load."""
    files = sorted(Path(folder).glob("libcudnn*.so.9"))
    rank = {name: i for i, name in enumerate(FIRST)}
    return sorted(files, key=lambda f: (rank.get(f.name, len(FIRST)), f.name))


def preload(folder: str, load=ctypes.CDLL) -> list[str]:
    """Load every cuDNN library of ``folder`` with ``RTLD_GLOBAL`` (``load`` is ctypes' loader; tests pass a
    recorder); the files loaded. A failure is kept in ``PRELOAD_ERROR`` for the preflight row, not raised: an
    import must not crash ``nam plugins list``, and the row refuses the run."""
    global PRELOAD_ERROR
    done = []
    for file in preload_order(folder):
        try:
            load(str(file), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            PRELOAD_ERROR = f"loading {file} failed: {e}"
            break
        done.append(str(file))
    return done


def prefer_torch_cudnn(load=ctypes.CDLL) -> str | None:
    """Point TE at torch's bundled cuDNN: set ``CUDNN_HOME`` to its folder, put it first on ``LD_LIBRARY_PATH`` for
    the processes this one starts and preload its libraries here, unless the
    user set ``CUDNN_HOME`` or ``CUDNN_PATH``, TE is already imported, or torch bundles none; the folder, or
    None."""
    if "transformer_engine" in sys.modules or os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH"):
        return None
    folder = torch_cudnn_dir()
    if folder is not None:
        os.environ["CUDNN_HOME"] = folder
        # the processes this one starts (the megatron engine's ranks import Megatron, and so TE, before any
        # plugin) resolve TE's cuDNN dependencies through LD_LIBRARY_PATH, read when they start
        paths = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != folder]
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([folder, *paths])
        preload(folder, load)
    return folder


def loaded_cudnn_files(maps: str = "/proc/self/maps") -> list[str]:
    """The cuDNN libraries (``libcudnn*.so*``: the entry library and its sub-libraries) mapped into this process
    (Linux), in the order first seen."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return []
    paths = [line.split()[-1] for line in text.splitlines() if "/libcudnn" in line and ".so" in line]
    return list(dict.fromkeys(paths))


def when_te_installed() -> str | None:
    """``prefer_torch_cudnn`` on a host where Transformer Engine is installed (found without importing it); on
    others nothing happens. The folder, or None."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    return prefer_torch_cudnn()
