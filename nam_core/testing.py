"""Test helpers shared by nam's tests and by plugin test suites.

``new_seed()`` draws a fresh seed for a parity check (the check reports it, so a failure can be replayed) and
``max_rel_error(a, ref)`` is the error every parity check reports: ``max |a - ref| / max |ref|`` in float64,
``inf`` when ``a`` has a non-finite value; ``rel_norm_error(a, ref)`` is ``||a - ref|| / ||ref||``, the steadier
statistic for formats as coarse as FP8.

``no_host_sync()`` fails any op that reads a tensor's value on the host (``.item()``, ``torch.equal``,
data-dependent shapes such as ``nonzero``): on a GPU each of those stalls the stream and breaks CUDA-graph
capture, so the DSA and Mamba-3 paths must have none. On CPU the check works at the dispatcher, so it runs in
CI without a GPU.

``model_parity(fn, reference, inputs, activations=..., dout=..., seed=...)`` is the parity harness the kernel
plugins share (their preflight launch, GPU tests and benchmarks): one forward and backward of the function under
test and of its fp32 reference on the same values, and the error of the output and of every input gradient;
``worst(errors)`` is the number a tolerance is held against.

``fake_device(profile, **changes)`` builds a fake device (``nam_core.device.PROFILES``, or ``"a100"``: a
pre-Hopper part, sm_80 with less shared memory); activation evaluates requirements against it as against a real
one and skips launches. The fixtures built on these (``fake_h100``, ``fake_versions``, ``run_interpreted``, ...)
are in ``nam_core.pytest_plugin``, so this module imports no pytest: preflight uses its parity harness at run
time on hosts without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nam_core.device import GiB, DeviceInfo

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


def model_parity(fn: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor],
                 inputs: dict[str, torch.Tensor | None], *, dout: torch.Tensor, seed: int,
                 activations: Iterable[str] = (), dtype: torch.dtype = torch.bfloat16,
                 norms: bool = False, view: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> dict:
    """Errors of ``fn`` against ``reference``, forward and backward, on the same values.

    ``inputs``: the arguments by name, passed to both as keywords. Floating tensors come in fp32 and each side
    gets its own leaf copy with a gradient; None and integer tensors (indices) reach both sides as they are.
    ``activations``: the names ``fn`` takes in ``dtype`` (rounded once); the reference gets those rounded values
    back in fp32, so the comparison measures ``fn``'s arithmetic, not the inputs' rounding. Every other floating
    input reaches both sides in fp32. ``dout``: the gradient of the output; ``fn``'s output gets it in its own
    dtype, the reference the same values in fp32.

    Returns ``{"out": e, "d<name>": e for every floating input, "seed": seed}`` with e = ``max_rel_error``; a
    gradient the reference has and ``fn`` does not is ``inf``. ``norms``: also ``"norm"``, the same pairs'
    ``rel_norm_error``. ``seed`` is the one the inputs were drawn with, reported so a failure can be replayed.
    ``view(name, t)``: the reference computes on a slice only (``name`` an input's, or ``"out"`` for the output
    and its gradient); ``fn`` runs on the whole inputs and its output and gradients are compared through the
    same slice. For a computation that is independent along some axes (batch rows, groups of heads), so a
    kernel launched at a large shape is checked against a reference run on a part of it.
    """
    view = view or (lambda name, t: t)
    activations = set(activations)
    unknown = activations - set(inputs)
    if unknown:
        raise ValueError(f"activations {sorted(unknown)} are not among the inputs {sorted(inputs)}")

    def leaves(low: bool) -> dict:
        out = {}
        for name, t in inputs.items():
            if t is None or not t.is_floating_point():
                out[name] = t if low or t is None else view(name, t)
            elif name in activations:
                rounded = t.detach().to(dtype)
                out[name] = (rounded.clone() if low else view(name, rounded).to(torch.float32, copy=True)).requires_grad_()
            else:
                out[name] = (t if low else view(name, t)).detach().to(torch.float32, copy=True).requires_grad_()
        return out

    ours, theirs = leaves(True), leaves(False)
    out = fn(**ours)
    d = dout.detach().to(out.dtype)
    out.backward(d)
    ref = reference(**theirs)
    ref.backward(view("out", d).to(ref.dtype))

    pairs = {"out": (view("out", out), ref)}
    for name, t in theirs.items():
        if t is None or not t.is_floating_point():
            continue
        if t.grad is None:
            raise ValueError(f"the reference gives no gradient for {name!r}: pass it as an integer tensor or leave "
                             f"it out of the inputs")
        pairs[f"d{name}"] = (None if ours[name].grad is None else view(name, ours[name].grad), t.grad)
    errors = {k: math.inf if a is None else max_rel_error(a, r) for k, (a, r) in pairs.items()}
    if norms:
        errors["norm"] = {k: math.inf if a is None else rel_norm_error(a, r) for k, (a, r) in pairs.items()}
    errors["seed"] = seed
    return errors


def worst(errors: dict) -> float:
    """The largest error of a ``model_parity`` result (the seed and the norm table aside); NaN counts as ``inf``."""
    values = [v for k, v in errors.items() if k != "seed" and isinstance(v, (int, float))]
    return max((math.inf if math.isnan(v) else v) for v in values)


class _NaNAt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, at):
        ctx.at = at
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        g.view(-1)[ctx.at] = float("nan")
        return g, None


def nan_in_gradient(x: torch.Tensor, at: int = 7) -> torch.Tensor:
    """``x`` as it is, whose gradient comes back with one element (flat index ``at``) NaN: a kernel's broken store,
    for showing that a parity check does not let it through (``max`` over errors skips a NaN that is not first)."""
    return _NaNAt.apply(x, at)


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


# --- fake devices (the fixtures in nam_core.pytest_plugin build on these) ------------------------------
A100 = DeviceInfo(
    kind="cuda", name="NVIDIA A100-SXM4-80GB (fake)", capability=(8, 0),
    # 163 KiB opt-in shared memory per block on sm_80 (CUDA C++ Programming Guide, compute capability 8.0), 108 SMs.
    smem_per_block_optin=166_912, sm_count=108, memory_bytes=80 * GiB, device_count=1,
    torch_version="n/a", cuda_version="13.0", profile_name="a100",
)
"""A pre-Hopper part for refusals (sm_80 kernels, less shared memory than sm_90); not a ``--device-profile``."""


def fake_device(profile: str, **changes) -> DeviceInfo:
    """A fake device: ``profile`` from ``nam_core.device.PROFILES`` (or ``"a100"``) with ``changes`` to its fields.
    ``fake_device("h100", profile_name=None)`` is an H100 the host takes for real (its launch checks run)."""
    base = A100 if profile == "a100" else DeviceInfo.profile(profile)
    return dataclasses.replace(base, **changes)
