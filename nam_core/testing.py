"""Test helpers shared by nam's tests and by plugin test suites.

``prepare_corpus(tmp_path_factory, modules, chars)`` prepares a small dataset from the source of a few
standard-library modules through ``nam data prepare`` (faster than the full stdlib default of ``nam train``).

``new_seed()`` draws a fresh seed for a parity check (the check reports it, so a failure can be replayed) and
``max_rel_error(a, ref)`` is the error every parity check reports: ``max |a - ref| / max |ref|`` in float64,
``inf`` when ``a`` has a non-finite value; ``rel_norm_error(a, ref)`` is ``||a - ref|| / ||ref||``, the steadier
statistic for formats as coarse as FP8.

``no_host_sync()`` fails any op that reads a tensor's value on the host (``.item()``, ``torch.equal``,
data-dependent shapes such as ``nonzero``): on a GPU each of those stalls the stream and breaks CUDA-graph
capture, so the DSA and Mamba-3 paths must have none. On CPU the check works at the dispatcher, so it runs in
CI without a GPU.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result depends on tensor *values* read back to the host, or whose output shape does.
HOST_SYNC_OPS = frozenset(
    {
        "aten::_local_scalar_dense",  # .item(), float(t), bool(t), Python branching on a tensor
        "aten::equal",
        "aten::is_nonzero",
        "aten::nonzero",
        "aten::nonzero_static",
        "aten::masked_select",
        "aten::unique_dim",
        "aten::_unique2",
        "aten::unique_consecutive",
        "aten::repeat_interleave",
        "aten::bincount",
        "aten::histc",
        "aten::allclose",
        "aten::_assert_async",
    }
)


def new_seed() -> int:
    """A fresh 32-bit seed from the OS (never a fixed one: each run of a parity check draws new inputs)."""
    return int.from_bytes(os.urandom(4), "little")


def max_rel_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |a - ref| / max |ref|`` in float64; ``inf`` if ``a`` has a NaN or an infinity."""
    a, ref = a.detach().double(), ref.detach().double()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def rel_norm_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``||a - ref||_2 / ||ref||_2`` in float64; ``inf`` if ``a`` has a NaN or an infinity."""
    a, ref = a.detach().double(), ref.detach().double()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - ref).norm() / ref.norm().clamp(min=1e-30)).item()


class HostSyncError(AssertionError):
    pass


class _NoHostSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in HOST_SYNC_OPS:
            raise HostSyncError(f"{name} reads tensor values on the host (a device sync)")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync():
    """Raise HostSyncError on any host-syncing op run inside the block (forward and backward alike)."""
    with _NoHostSync():
        yield


def fake_installed(tmp_path, monkeypatch, plugins: dict[str, str]) -> dict:
    """Write each ``name -> module source`` as an importable module and return an ``installed`` mapping.

    Use with ``PluginHost(installed=...)`` to test activation without installing distributions. Module
    names are ``nam_fake_<name>``; the directory is put on ``sys.path`` for the test only.
    """
    import importlib.metadata
    import sys

    from nam_core.host import InstalledPlugin

    root = tmp_path / "fake_plugins"
    root.mkdir(exist_ok=True)
    monkeypatch.syspath_prepend(str(root))
    installed = {}
    for name, source in plugins.items():
        module = "nam_fake_" + name.replace("-", "_")
        (root / f"{module}.py").write_text(source)
        sys.modules.pop(module, None)
        ep = importlib.metadata.EntryPoint(name=name, value=module, group="nam.plugins")
        installed[name] = InstalledPlugin(name, ep, f"nam-plugin-{name}", "0.0.test")
    return installed


def prepare_corpus(tmp_path_factory, modules, chars: int):
    """The first ``chars`` characters of each module's source, prepared with ``nam data prepare``: its folder."""
    import inspect

    from nam_cli.main import run

    src = tmp_path_factory.mktemp("src")
    for i, mod in enumerate(modules):
        (src / f"m{i}.py").write_text(inspect.getsource(mod)[:chars])
    out = tmp_path_factory.mktemp("data") / "ds"
    code = run(["data", "prepare", str(src), "--out", str(out)])
    if code != 0:
        raise RuntimeError(f"nam data prepare exited {code}")
    return out
