"""Compiled regions: small pure functions of tensors run under ``torch.compile`` (inductor), one graph per function
and shape, shared by every layer that calls it.

The memory-bound glue between NAM56R's kernels (the per-token sums of MoE rows, the routed experts' gate, the
mamba-ssm backward's per-group sums: ``compile_glue``, ranked in bench/results/glue.md) reads and writes each
tensor once per eager op; compiled, a region's ops share one pass over memory. Only the small function is
compiled, never a block or the model: the kernels around it (GEMMs, scans) stay as they are.

A region compiles with ``fullgraph=True`` (a graph break is an error, not a silent eager fall-back) and
``dynamic=False`` (NAM56R trains at one shape; a new shape builds a new graph). Before its first call on a device
type, ``require_inductor`` checks that inductor can build code there and raises one ``CannotRunHere`` otherwise;
an error inside the compile propagates. Nothing falls back to the eager function.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from nam_core.errors import CannotRunHere


def require_inductor(device_type: str, setting: str) -> None:
    """Raise ``CannotRunHere`` unless inductor can build kernels for ``device_type`` (CUDA: a working Triton; CPU:
    a C++ compiler). ``setting`` is the config field that asked for compiled regions, named in the error."""
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        found = None if has_triton() else "no working Triton for this GPU (torch.utils._triton.has_triton() is False)"
    elif device_type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
            found = None
        except RuntimeError as e:
            found = f"no C++ compiler ({e})"
    else:
        found = f"tensors on {device_type!r}; inductor builds compiled regions for cpu and cuda here"
    if found is not None:
        raise CannotRunHere(
            f"{setting}=true runs regions under torch.compile (inductor), which needs Triton on a GPU or a C++ "
            f"compiler on the CPU; found {found}",
            hint=f"--set {setting}=false runs them eagerly; or install Triton (GPU) / g++ (CPU)")


class Region:
    """``fn`` under ``torch.compile(fullgraph=True, dynamic=False)``, built at the first call; ``setting`` names
    the config field that turned it on (for the error when inductor cannot build). The first call on each device
    type checks inductor there (``require_inductor``)."""

    def __init__(self, fn: Callable[..., object], setting: str):
        self.fn, self.setting = fn, setting
        self._compiled = None
        self._checked: set[str] = set()
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        device = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        if device not in self._checked:
            require_inductor(device, self.setting)
            self._checked.add(device)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, fullgraph=True, dynamic=False)
        return self._compiled(*args)
