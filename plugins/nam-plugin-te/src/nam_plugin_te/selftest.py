"""The launch rows the host writes on a real CUDA device (``plugin.CHECKS``), in order: TE's torch extension,
cuDNN, the FP8 recipes this device runs, bf16 parity, FP8 parity. TE is imported inside each row, so a broken
install is a failed row with the exception's text; the rows after it say they did not run rather than raise
the same error again."""

from __future__ import annotations

from nam_core.checks import Measured
from nam_plugin_te.plugin import BF16_TOLERANCE, FP8_FLOOR, FP8_TOLERANCE, fp8_of
from nam_plugin_te.recipes import OFF, RECIPES

NOT_LOADED = "not run: Transformer Engine did not import (the torch extension row says why)"
NO_RUN_FP8 = ("delayed", "current", "blockwise")
"""FP8 recipes ``nam preflight --plugins te`` (no run) measures: those a Hopper GPU runs."""


def _import_te():
    """(``transformer_engine.pytorch``, None), or (None, the exception's text)."""
    try:
        import transformer_engine.pytorch as te
    except Exception as e:  # an ABI mismatch is an ImportError or OSError; TE's own checks raise AssertionError
        return None, f"import transformer_engine.pytorch raised {type(e).__name__}: {str(e).strip()[:400]}"
    return te, None


def extension(spec) -> Measured:
    import torch

    te, error = _import_te()
    if te is None:
        return Measured(False, f"{error} (torch {torch.__version__})")
    import transformer_engine_torch as tex

    return Measured(True, f"transformer_engine_torch loaded ({tex.__file__}) with torch {torch.__version__}")


def cudnn(spec) -> Measured:
    """The cuDNN TE loaded against the one torch was built with and bundles: one library, the same version.
    torch's own version check raises on a mismatch; that is this row failing, with the fix."""
    import torch

    from nam_core import cudnn as which

    te, _ = _import_te()
    if te is None:
        return Measured(None, NOT_LOADED)
    te_has = tuple(te.get_cudnn_version())
    built = tuple(torch._C._cudnn.getCompileVersion())
    files, bundled = which.loaded_cudnn_files(), which.torch_cudnn_dir()
    try:
        torch.backends.cudnn.version()
        torch_ok = ""
    except RuntimeError as e:
        torch_ok = f"; torch refuses it: {str(e).strip()[:160]}"
    foreign = [f for f in files if bundled is None or not f.startswith(bundled + "/")]
    mapped = (f"{len(files) - len(foreign)} cuDNN libraries from torch's folder" +
              (f", others: {', '.join(foreign)}" if foreign else "")) if files else "no cuDNN file found mapped"
    preload = f"; preload failed: {which.PRELOAD_ERROR}" if which.PRELOAD_ERROR else ""
    found = (f"TE loaded cuDNN {'.'.join(map(str, te_has))} ({mapped}); torch was built with "
             f"{'.'.join(map(str, built))} and bundles {bundled or 'none'}{preload}{torch_ok}")
    ok = te_has[:2] == built[:2] and not torch_ok and not foreign
    hint = (f"export CUDNN_HOME={bundled} LD_LIBRARY_PATH={bundled}:$LD_LIBRARY_PATH before anything imports "
            "Transformer Engine (nam_plugin_te preloads torch's cuDNN when it is imported first; here TE came "
            "first, the preload failed, or CUDNN_HOME/CUDNN_PATH points elsewhere)"
            if bundled else "install the cuDNN wheel torch was built with (nvidia-cudnn)")
    return Measured(ok, found, needed="TE and torch on one cuDNN, the version torch was built with", hint=hint)


def _support(te, name: str) -> tuple[bool, str]:
    check = {"blockwise": te.is_fp8_block_scaling_available, "mxfp8": te.is_mxfp8_available}.get(
        name, te.is_fp8_available)
    ok, reason = check(return_reason=True)
    return bool(ok), reason


def fp8_support(spec) -> Measured:
    """The run's recipe as TE judges this device (its own reason when not); without a run every recipe, where
    delayed and current must run (blockwise and MXFP8 are shown)."""
    te, _ = _import_te()
    if te is None:
        return Measured(None, NOT_LOADED)
    names = [fp8_of(spec)] if spec is not None else list(RECIPES)
    told = {n: _support(te, n) for n in names}
    found = "; ".join(f"{n}: {'runs' if ok else 'refused: ' + why}" for n, (ok, why) in told.items())
    if spec is not None:
        return Measured(told[names[0]][0], found, needed=f"TE runs {RECIPES[names[0]].te_class} on this device")
    return Measured(told["delayed"][0] and told["current"][0], found,
                    needed="TE runs delayed and current scaling on this device")


def bf16_parity(spec) -> Measured:
    from nam_plugin_te.parity import linear_errors

    te, _ = _import_te()
    if te is None:
        return Measured(None, NOT_LOADED)
    r = linear_errors(OFF, te=te)
    found = ", ".join(f"{k} {v:.1e}" for k, v in r.items()) + " (4096 tokens, 1024 -> 2048)"
    return Measured(max(r.values()) <= BF16_TOLERANCE, found)


def fp8_parity(spec) -> Measured:
    from nam_plugin_te.parity import linear_errors

    te, _ = _import_te()
    if te is None:
        return Measured(None, NOT_LOADED)
    names = [fp8_of(spec)] if spec is not None else [n for n in NO_RUN_FP8 if _support(te, n)[0]]
    worst, shown = [], []
    for name in names:
        r = linear_errors(name, te=te)
        worst.append(max(r.values()))
        shown.append(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
    ok = all(FP8_FLOOR < w <= FP8_TOLERANCE for w in worst)
    return Measured(ok, "; ".join(shown) + " (4096 tokens, 1024 -> 2048)")
