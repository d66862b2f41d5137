"""The plugin's patch-lane entries for mamba-ssm, each with its detection, fix, reproducer and end date.

* ``mamba-ssm-import-shim``: ``import mamba_ssm.*`` fails without the Mamba-1 extension ``selective_scan_cuda``,
  which Mamba-3 never uses (``upstream.py``). Fix: a stand-in module. Detected from the installed source (an
  unguarded top-level import), because the upstream fix did not change the version string.
* ``mamba-ssm-package-import``: importing any ``mamba_ssm`` module runs the package ``__init__``, which imports
  Mamba-1, Mamba-2, the Mamba-3 module and the LM head model, and through its generation utilities transformers:
  21.55 s for a fresh interpreter's import of the MIMO module on a fresh H200 host (bench/README.md, sixth
  session), none of it used by Mamba-3's kernels. Fix: the package goes into ``sys.modules`` with its
  ``__init__`` deferred to the first name asked of it (``upstream.defer_package_init``). Detected from the
  ``__init__``'s source.
* ``mamba3-mimo-grouped-bwd``: the MIMO backward raises ``G value of 8 is not currently supported!`` for any
  1 < ngroups < nheads, NAM56R's setting. Fix: ``mimo.backward`` reduces the per-head dQ/dK per group.
  Detected while upstream's driver is bound and the installed tree lacks its own grouped reduction.
* ``mamba3-mimo-host-overhead``: every MIMO call re-runs TileLang's front end before reaching the compiled
  kernel (the reproducer's warm call: 235 ms of host time on the H100, plugin README; ~775 ms when first seen at
  a full NAM56R layer, against ~36 ms of its GPU work). Fix: the drivers of ``mimo.py``, which keep the compiled
  kernels. Detected while upstream's forward driver is bound:
  no cheap check tells a fixed upstream from this one, so the reproducer measures it, and reports
  FIX_VALIDATED for an upstream that no longer pays it (then the patch is to be retired).

* ``mamba3-mimo-saved-tensors-once``: the MIMO autograd function's backward reads ``ctx.saved_tensors`` twice
  (a length check, then the unpack). Plain autograd allows that; ``torch.utils.checkpoint`` without reentrancy,
  which ``train.recompute=mamba`` puts around the mixer, raises ``CheckpointError: Unpack is being triggered for
  a tensor that was already unpacked once`` (seen on an H200, 2026-11-25). Fix: upstream's backward runs on a
  view of ``ctx`` whose saved tensors are unpacked once (``saved_once``). Detected from the backward's source.

The MIMO driver patches swap upstream's module-level drivers (in ``mamba3_mimo`` and the modules that define
them) for ``mimo.forward`` / ``mimo.backward``; upstream's autograd function, Triton helpers and kernels stay.
Apply the shim first: the others import mamba-ssm. The registry keeps this order. Every entry can be taken
back (``revert``: upstream's own drivers bound again, ``mimo.STATIC`` off, the stand-in removed), so
``nam_core.patches.applied`` can apply the lane for a scope only.
"""

from __future__ import annotations

import functools
import inspect
import statistics
import sys
import time

from nam_core.errors import NamError
from nam_core.patches import BUG_REPRODUCED, FIX_VALIDATED, NEEDED, Patch
from nam_plugin_mamba_ssm import upstream

LAZY = "mamba-ssm-package-import"
SHIM, GROUPED, HOST = "mamba-ssm-import-shim", "mamba3-mimo-grouped-bwd", "mamba3-mimo-host-overhead"
STATIC = "mamba3-mimo-static-shapes"
SAVED_ONCE = "mamba3-mimo-saved-tensors-once"
NAMES = (SHIM, LAZY, GROUPED, HOST, STATIC, SAVED_ONCE)
VERSIONS = ">=2.3.0"
"""Mamba-3 arrived in 2.3.0; every release since is checked by ``detect`` rather than by number."""

STATIC_SLOWDOWN_BUG = 1.25
"""Dynamic-shape over static-shape time of the MIMO forward kernel above which the dynamic build is the bug. At
NAM56R's shape the ratio was 3.3x for the forward kernel and 1.7-1.9x for the whole scan (H100, TileLang 0.1.8)."""

HOST_MS_BUG = 50.0
"""Host milliseconds per warm MIMO forward at a tiny shape above which the per-call rebuild is present. With
it a call costs hundreds of ms whatever the shape; without it, a few kernel launches (well under 5 ms)."""

_DRIVERS = {  # module -> {name bound there: the nam driver that replaces it}
    upstream.MIMO_MODULE: {"mamba_mimo_forward": "forward", "mamba_mimo_bwd_combined": "backward"},
    upstream.MIMO_FWD_MODULE: {"mamba_mimo_forward": "forward"},
    upstream.MIMO_BWD_MODULE: {"mamba_mimo_bwd_combined": "backward"},
}


def _bound(module: str, name: str, driver: str) -> bool:
    """``module.name`` is nam's driver already. A module not imported yet is not patched."""
    from nam_plugin_mamba_ssm import mimo

    loaded = sys.modules.get(module)
    return loaded is not None and getattr(loaded, name, None) is getattr(mimo, driver)


_UPSTREAM: dict[tuple[str, str], object] = {}
"""(module, name) -> upstream's own driver, kept when nam's is bound there so a revert can put it back."""


def _bind(driver: str) -> None:
    from nam_plugin_mamba_ssm import mimo

    for module, names in _DRIVERS.items():
        loaded = upstream.load(module)
        for name, ours in names.items():
            if ours == driver and getattr(loaded, name, None) is not getattr(mimo, ours):
                _UPSTREAM[(module, name)] = getattr(loaded, name, None)
                setattr(loaded, name, getattr(mimo, ours))


def _unbind(driver: str) -> None:
    """Put upstream's own driver back wherever nam's ``driver`` is bound (the revert of ``_bind``)."""
    from nam_plugin_mamba_ssm import mimo

    for module, names in _DRIVERS.items():
        loaded = sys.modules.get(module)
        for name, ours in names.items():
            if ours == driver and loaded is not None and getattr(loaded, name, None) is getattr(mimo, ours):
                setattr(loaded, name, _UPSTREAM.pop((module, name)))


def revert_static() -> None:
    from nam_plugin_mamba_ssm import mimo

    mimo.STATIC = False


# --- detection --------------------------------------------------------------------------------------------


def lazy_needed() -> bool:
    """The installed ``__init__`` imports modules, and the package is not imported yet (once it is, deferred or
    not, there is nothing left to defer)."""
    return bool(upstream.package_init_imports()) and upstream.PACKAGE not in sys.modules


def shim_needed() -> bool:
    return upstream.imports_extension_unguarded() and upstream.extension_missing() and not upstream.shim_installed()


def grouped_needed() -> bool:
    return (not upstream.has_grouped_backward()
            and not _bound(upstream.MIMO_MODULE, "mamba_mimo_bwd_combined", "backward"))


def host_needed() -> bool:
    return not _bound(upstream.MIMO_MODULE, "mamba_mimo_forward", "forward")


def static_needed() -> bool:
    from nam_plugin_mamba_ssm import mimo

    return upstream.builds_dynamic_shapes() and not (mimo.STATIC and not host_needed())


def apply_static() -> None:
    """nam's drivers bound (as for the host patch) and told to build for exact sizes."""
    from nam_plugin_mamba_ssm import mimo

    _bind("forward")
    _bind("backward")
    mimo.STATIC = True


class _SavedOnce:
    """``ctx`` as a backward sees it, with ``saved_tensors`` unpacked once (a checkpointed tensor may be unpacked
    once only); every other attribute is the real context's."""

    def __init__(self, ctx):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "saved_tensors", ctx.saved_tensors)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


def saved_once(backward):
    """``backward(ctx, *grads)`` run on a context whose saved tensors are unpacked once."""

    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        return backward(_SavedOnce(ctx), *grads)

    wrapped.unwrapped = backward
    return wrapped


def _mimo_function():
    return upstream.load(upstream.MIMO_MODULE)._Mamba3Function


def unpacks_twice(function) -> bool:
    """``function.backward`` (an autograd Function's) reads ``ctx.saved_tensors`` more than once, unwrapped."""
    backward = function.backward
    return not hasattr(backward, "unwrapped") and inspect.getsource(backward).count("ctx.saved_tensors") > 1


def saved_once_needed() -> bool:
    """Upstream's backward unpacks twice (its source says) and is not wrapped in this process yet."""
    loaded = sys.modules.get(upstream.MIMO_MODULE)
    function = getattr(loaded, "_Mamba3Function", None)
    if function is not None and hasattr(function.backward, "unwrapped"):
        return False
    return upstream.mimo_backward_unpacks_twice()


def apply_saved_once(function=None) -> None:
    function = function or _mimo_function()
    if not hasattr(function.backward, "unwrapped"):
        function.backward = staticmethod(saved_once(function.backward))


def revert_saved_once(function=None) -> None:
    function = function or _mimo_function()
    if hasattr(function.backward, "unwrapped"):
        function.backward = staticmethod(function.backward.unwrapped)


# --- reproducers (CUDA) ------------------------------------------------------------------------------------


def reproduce_shim() -> str:
    """Import Mamba-3's SISO and MIMO modules in a fresh interpreter (this one's ``sys.path``), with the stand-in
    when this process has it."""
    import subprocess

    code = f"import sys; sys.path[:0] = {sys.path!r}; "
    if upstream.shim_installed():
        code += "from nam_plugin_mamba_ssm import upstream; upstream.install_shim(); "
    code += f"import {upstream.SISO_MODULE}, {upstream.MIMO_MODULE}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode == 0:
        return FIX_VALIDATED
    if upstream.EXTENSION in done.stderr:
        return BUG_REPRODUCED
    raise RuntimeError(f"importing Mamba-3 failed for another reason:\n{done.stderr[-2000:]}")


def reproduce_lazy() -> str:
    """Import Mamba-3's MIMO module in a fresh interpreter (this one's ``sys.path``, the stand-in extension), with
    the package's import deferred when this process defers it: BUG_REPRODUCED when a module the package
    ``__init__`` imports is in ``sys.modules`` after it (the MIMO module's own parent packages aside), FIX_VALIDATED
    when none is."""
    import json
    import subprocess

    init = [name for name in upstream.package_init_imports() if not upstream.MIMO_MODULE.startswith(name + ".")]
    code = (f"import sys, json; sys.path[:0] = {sys.path!r}; from nam_plugin_mamba_ssm import upstream; "
            "upstream.install_shim(); ")
    if upstream.package_deferred():
        code += "upstream.defer_package_init(); "
    code += f"import {upstream.MIMO_MODULE}; print(json.dumps([m for m in {init!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"importing Mamba-3's MIMO module failed:\n{done.stderr[-2000:]}")
    return BUG_REPRODUCED if json.loads(done.stdout.strip().splitlines()[-1]) else FIX_VALIDATED


def reproduce_grouped() -> str:
    """A tiny MIMO forward+backward through upstream's ``mamba3_mimo`` with 4 heads in 2 groups, at NAM56R's
    static widths: BUG_REPRODUCED if it raises upstream's unsupported-G error or a gradient misses the
    reference by more than ``selftest.TOLERANCE``."""
    from nam_plugin_mamba_ssm import selftest
    from nam_plugin_mamba_ssm.kernel_args import mimo_args

    mimo = upstream.load(upstream.MIMO_MODULE).mamba3_mimo

    def call(*scan_args, chunk_size):  # the SSMScan arguments, handed over as the scan does
        return mimo(*mimo_args(*scan_args, chunk_size=chunk_size))

    try:
        errors = selftest.compare(call, 1, 64, 4, 2, 128, 64, 4, chunk_size=16)
    except ValueError as e:
        if "G value" in str(e):
            return BUG_REPRODUCED
        raise
    return FIX_VALIDATED if selftest.worst(errors) <= selftest.TOLERANCE else BUG_REPRODUCED


def host_ms_per_call(calls: int = 3) -> float:
    """Median wall milliseconds of a warm, synchronised MIMO forward at a tiny shape (1 x 64 tokens, 4 heads)."""
    import torch

    from nam_plugin_mamba_ssm import selftest
    from nam_plugin_mamba_ssm.kernel_args import mimo_args

    mimo = upstream.load(upstream.MIMO_MODULE).mamba3_mimo
    x = selftest.random_inputs(1, 64, 4, 2, 128, 64, 4, device="cuda", seed=selftest.new_seed())
    x["v"] = x["v"].to(torch.bfloat16)  # mimo_args casts the other activations to v's dtype
    args = mimo_args(*(x[k] for k in selftest.INPUT_NAMES), chunk_size=16)
    with torch.no_grad():
        mimo(*args)  # compile, or read the disk cache
        torch.cuda.synchronize()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            mimo(*args)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def reproduce_host() -> str:
    return BUG_REPRODUCED if host_ms_per_call() > HOST_MS_BUG else FIX_VALIDATED


def forward_kernel_ms(static: bool | None = None, b: int = 1, l: int = 2048, h: int = 32, g: int = 8) -> float:
    """Median ms of nam's MIMO forward driver (one kernel launch) at NAM56R's widths (d_state 128, headdim 64,
    rank 4, chunk 16) and ``b, l, h, g``: built for exact sizes (``static=True``), as the installed upstream
    builds (``False``) or as the drivers build in this process now (``None``). Builds the kernels when TileLang's
    cache does not have them (a minute or more each)."""
    import torch

    from nam_plugin_mamba_ssm import mimo, selftest
    from nam_plugin_mamba_ssm.kernel_args import mimo_args

    x = selftest.random_inputs(b, l, h, g, 128, 64, 4, device="cuda", seed=selftest.new_seed())
    x["v"] = x["v"].to(torch.bfloat16)
    q, k, v, adt, dt, trap, q_bias, k_bias, mimo_x, mimo_z, mimo_o, angles, d, z, chunk, div, dtype = mimo_args(
        *(x[name] for name in selftest.INPUT_NAMES), chunk_size=16)
    seg = torch.zeros(b, h, l // chunk, chunk, chunk, device="cuda")  # the kernel's cost does not depend on them
    dA = torch.zeros(b, h, l, device="cuda")
    was = mimo.STATIC
    mimo.STATIC = was if static is None else static
    try:
        run = lambda: mimo.forward(q, k, v, q_bias, k_bias, mimo_x, mimo_o, z, d, mimo_z, angles, dA, dA, dt,  # noqa: E731
                                   trap, seg, chunk, div, dtype)
        run()
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    finally:
        mimo.STATIC = was
    return statistics.median(times)


def reproduce_saved_once() -> str:
    """A tiny MIMO forward+backward through upstream's ``mamba3_mimo`` inside a non-reentrant
    ``torch.utils.checkpoint`` (what ``train.recompute=mamba`` does): BUG_REPRODUCED on upstream's double unpack."""
    import torch
    from torch.utils.checkpoint import CheckpointError, checkpoint

    from nam_plugin_mamba_ssm import selftest
    from nam_plugin_mamba_ssm.kernel_args import mimo_args

    mimo = upstream.load(upstream.MIMO_MODULE).mamba3_mimo

    def call(*scan_args, chunk_size):
        return checkpoint(lambda *a: mimo(*mimo_args(*a, chunk_size=chunk_size)), *scan_args, use_reentrant=False)

    try:
        selftest.compare(call, 1, 64, 4, 2, 128, 64, 4, chunk_size=16)
    except CheckpointError as e:
        if "already unpacked once" in str(e):
            return BUG_REPRODUCED
        raise
    finally:
        torch.cuda.synchronize()
    return FIX_VALIDATED


def reproduce_static() -> str:
    """BUG_REPRODUCED while the forward kernel as the drivers build it in this process (upstream's dynamic sizes,
    unpatched) is ``STATIC_SLOWDOWN_BUG`` times slower than the same kernel built for exact sizes."""
    slowdown = forward_kernel_ms() / forward_kernel_ms(static=True)
    return BUG_REPRODUCED if slowdown > STATIC_SLOWDOWN_BUG else FIX_VALIDATED


# --- the lane -----------------------------------------------------------------------------------------------


def make_patches() -> dict[str, Patch]:
    """The six entries, in the order they must apply: the package's import is deferred before anything imports
    it, and after the stand-in extension, so that a scope's revert (last first) can still run the package's
    ``__init__``."""
    return {
        SHIM: Patch(
            name=SHIM, target=upstream.DISTRIBUTION, versions=VERSIONS,
            summary="mamba_ssm/__init__ imports Mamba-1's CUDA extension unguarded, so Mamba-3 cannot be imported "
                    "from a MAMBA_SKIP_CUDA_BUILD install; a stand-in selective_scan_cuda (raises on use)",
            retire_when="the first mamba-ssm release with PR #977 (commit f577286, on main since 2026-07-07: the "
                        "import is guarded); detection reads the source, so it retires itself there",
            detect=shim_needed, apply=upstream.install_shim, revert=upstream.remove_shim, reproduce=reproduce_shim,
            needs_gpu=False,
        ),
        LAZY: Patch(
            name=LAZY, target=upstream.DISTRIBUTION, versions=VERSIONS,
            summary="importing any mamba_ssm module runs the package __init__, which imports Mamba-1, Mamba-2, "
                    "the Mamba-3 module and the LM head model (and through it transformers): seconds of every "
                    "start that Mamba-3's kernels never use; the package is put in sys.modules with its __init__ "
                    "deferred to the first name asked of it",
            retire_when="a mamba-ssm release whose __init__ imports nothing at package import (lazy names); "
                        "detection reads its source, so it retires itself there",
            detect=lazy_needed, apply=upstream.defer_package_init, revert=upstream.run_package_init,
            reproduce=reproduce_lazy, needs_gpu=False,
        ),
        GROUPED: Patch(
            name=GROUPED, target=upstream.DISTRIBUTION, versions=VERSIONS,
            summary="Mamba-3 MIMO backward raises 'G value of 8 is not currently supported!' for 1 < ngroups < "
                    "nheads; nam's driver reduces per-head dQ/dK per group, bias grads from the per-head tensors",
            retire_when="the first mamba-ssm release with PR #967 (commit 33e2849, grouped_head_reduction.py, on "
                        "main since 2026-06-07); detection looks for that file",
            detect=grouped_needed, apply=lambda: _bind("backward"), revert=lambda: _unbind("backward"),
            reproduce=reproduce_grouped, needs_gpu=True,
        ),
        HOST: Patch(
            name=HOST, target=upstream.DISTRIBUTION, versions=VERSIONS,
            summary="each Mamba-3 MIMO call re-runs TileLang's front end (235-775 ms) before the compiled kernel; "
                    "nam's drivers compile once per static configuration and launch the kept kernel",
            retire_when=f"a mamba-ssm (or TileLang) release whose warm MIMO call costs under {HOST_MS_BUG:g} ms of "
                        "host time: `nam patches --plugins mamba-ssm --verify` then reports FIX_VALIDATED "
                        "for upstream's own drivers",
            detect=host_needed, apply=lambda: (_bind("forward"), _bind("backward")),
            revert=lambda: (_unbind("forward"), _unbind("backward")), reproduce=reproduce_host,
            needs_gpu=True,
        ),
        STATIC: Patch(
            name=STATIC, target=upstream.DISTRIBUTION, versions=VERSIONS,
            summary="Mamba-3 MIMO kernels are built with dynamic batch, length, heads and groups (PR #963), 1.7-1.9x "
                    "slower at NAM56R's shape; nam's drivers build them for each call's exact sizes (mimo.compiled)",
            retire_when="the first mamba-ssm release with PR #968 (B, S, H, G static again); detection reads the "
                        "forward driver's source for T.dynamic('B'), so it retires itself there",
            detect=static_needed, apply=apply_static, revert=revert_static, reproduce=reproduce_static,
            needs_gpu=True,
        ),
        SAVED_ONCE: Patch(
            name=SAVED_ONCE, target=upstream.DISTRIBUTION, versions=VERSIONS,
            summary="Mamba-3 MIMO backward reads ctx.saved_tensors twice, which non-reentrant activation "
                    "checkpointing (train.recompute=mamba) refuses; upstream's backward runs on a context that "
                    "unpacks them once",
            retire_when="a mamba-ssm release whose _Mamba3Function.backward unpacks ctx.saved_tensors once; "
                        "detection reads its source, so it retires itself there",
            detect=saved_once_needed, apply=apply_saved_once, revert=revert_saved_once,
            reproduce=reproduce_saved_once, needs_gpu=True,
        ),
    }


def apply_needed() -> list[str]:
    """Apply every needed entry in order, outside the engine (benchmarks, tests, scripts); returns their names.
    ``nam train`` does this itself through ``nam_core.patches.apply_all``."""
    applied = []
    for name, patch in make_patches().items():
        if patch.state()[0] == NEEDED:
            patch.apply()
            applied.append(name)
    return applied


def require_mimo_fixes() -> None:
    """Refuse to run MIMO while a needed MIMO patch is not applied (fail closed: upstream would raise in the
    backward for ngroups 8, or spend most of each step rebuilding kernels)."""
    patches = make_patches()
    pending = [name for name in (GROUPED, HOST, STATIC) if patches[name].state()[0] == NEEDED]
    if pending:
        raise NamError(f"mamba-ssm MIMO needs the patch-lane fixes {', '.join(pending)}, not applied in this process",
                       hint="run through `nam train` (it applies the patch lane after activation); in a script "
                            "call nam_plugin_mamba_ssm.patches.apply_needed() first")
