"""The te plugin: declarations and hooks. Requesting it swaps NAM56R's dense projections for Transformer Engine
linears (``linears.py``) in both engines, through ``nam_transform_model`` (after the model is built and cast,
before the optimizer); ``te.fp8`` picks what they compute in:

* ``off`` (default): bf16 TE linears, the same GEMMs as torch's (the baseline an FP8 row is measured against);
* ``delayed`` / ``current`` / ``blockwise``: TE's FP8 recipes (``recipes.py``), inside each linear's own
  ``te.autocast``; ``mxfp8`` is offered so that asking for it on Hopper is refused with the reason.

On the megatron engine the lowering also takes Megatron-Core's TE modules where it builds a linear or a norm
(``nam56r.run.te_lowering``: the MTP projection and dense MLP, the shared expert, every RMSNorm), FP8 through
Megatron's ``fp8``/``fp8_recipe`` with the same recipe, and with ``te.experts=grouped`` Megatron's
``TEGroupedMLP`` for the routed experts; the transform turns on TE's gradient-accumulation fusion (the wgrad
GEMM accumulates into Megatron's fp32 ``main_grad``) in every TE linear of the chunk (``megatron.py``).

Activation checks what a TE install gets wrong: the package's version (declared), its torch extension against
this torch (an ABI mismatch or a missing build is a refusal row with the exception, never an import crash),
cuDNN, the FP8 recipes this GPU and CUDA run, and parity of a TE linear against torch's (bf16) and against fp32
(FP8) on fresh random inputs. This module stays light (no torch, no TE at import) so ``nam plugins list`` can
read ``PLUGIN``.
"""

from __future__ import annotations

from nam_core import Check, PluginInfo, Requirement, hookimpl
from nam_core.checks import LaunchCheck, ShapeCheck
from nam_core.options import Option
from nam_core.requirements import FAIL, PASS
from nam_plugin_te.recipes import CHOICES, OFF, RECIPES, cuda_at_least

NAME = "te"
GPU_HINT = "pip install 'nam-plugin-te[gpu]'"
TE_SPEC = "transformer-engine>=2.13"
REBUILD_HINT = ("rebuild TE's torch extension against this torch: pip install --no-build-isolation --force-reinstall "
                "'transformer-engine[pytorch]' (on nam's GPU host: bash .device-te/install-te.sh CACHE_DIR, then "
                "PYTHONPATH=/tmp/site)")
OFF_HINT = f"--set {NAME}.fp8=off (bf16 TE linears), or drop --plugins {NAME}"
OTHER_HINT = f"--set {NAME}.fp8=current (or delayed), or {OFF_HINT}"

BF16_TOLERANCE = 1e-2
"""Largest ``||te - torch|| / ||torch||`` of a bf16 TE linear's output, input gradient and weight gradient
against ``nn.Linear`` in bf16 on the same values (4096 tokens, 1024 -> 2048): both are one cuBLAS bf16 GEMM
with fp32 accumulation; another GEMM algorithm would differ by the rounding of the bf16 outputs (~2^-9 relative
per element, ~3e-3 in L2). Measured on an H200 (TE 2.20.2): 0, bit-identical (TE calls the same cuBLAS GEMM). A
wrong layout or a dropped gradient is off by ~1."""
FP8_TOLERANCE = 0.10
"""Largest ``||fp8 - ref|| / ||ref||`` of an FP8 TE linear's output and gradients against ``nn.Linear`` in fp32
(same shapes): e4m3 (3 mantissa bits) in forward gives ~0.03-0.04 in L2, e5m2 (2 bits) gradients ~0.06; the
bound nam's other FP8 linears are held to (nam-plugin-float8). A wrong scale is off by ~1."""
FP8_FLOOR = 0.01
"""Smallest error an FP8 result must show: bf16 against fp32 is ~3e-3, so an "FP8" linear below this did not
quantize (its autocast was not entered) and the row fails."""


@hookimpl
def nam_check_config(config, device):
    fp8, train = config.options[NAME].fp8, config.train
    rows = []
    why = " (Transformer Engine's GEMMs run on CUDA)"
    if train.device != "cuda":
        rows.append(Check(NAME, "train.device", FAIL, f"train.device=cuda{why}", f"train.device={train.device}",
                          hint=f"--device cuda, or drop --plugins {NAME}"))
    if fp8 != OFF and train.dtype != "bfloat16":
        rows.append(Check(NAME, "train.dtype", FAIL, "train.dtype=bfloat16 (FP8 GEMMs with bf16 in and out)",
                          f"train.dtype={train.dtype}", hint=f"--set train.dtype=bfloat16, or {OFF_HINT}"))
    if fp8 != OFF:
        rows.append(recipe_row(fp8, device))
    if config.options[NAME].fp8_param_gather:
        rows += _fp8_param_gather_rows(config, fp8)
    if getattr(config.model, "mamba_split_in_proj", False):
        rows.append(Check(NAME, "mamba_split_in_proj", FAIL, "Mamba's in_proj run by its own module (te swaps it for "
                          "a TE linear)", "mamba_split_in_proj=true (three GEMMs on slices of the weight, skipping "
                          "the swapped module)", hint=f"--set mamba_split_in_proj=false, or drop --plugins {NAME}"))
    if config.options[NAME].experts == "grouped" and config.engine != "megatron":
        rows.append(Check(NAME, "experts", FAIL, "the megatron engine (te.experts=grouped is Megatron's TEGroupedMLP)",
                          f"engine {config.engine}", hint=f"--engine megatron, or --set {NAME}.experts=nam"))
    if config.options[NAME].moe_fusion and config.engine != "megatron":
        rows.append(Check(NAME, "moe_fusion", FAIL, "the megatron engine (te.moe_fusion swaps Megatron's router top-k "
                          "and token permutation for TE's fused kernels; the local engine has neither)",
                          f"engine {config.engine}", hint=f"--engine megatron, or --set {NAME}.moe_fusion=false"))
    return rows


def _fp8_param_gather_rows(config, fp8: str) -> list[Check]:
    """``nam_check_config``'s rows for ``te.fp8_param_gather``: what it needs, and the pairs refused with it."""
    train, rows = config.train, []
    if fp8 == OFF or config.engine != "megatron":
        rows.append(Check(NAME, "fp8_param_gather", FAIL, "the megatron engine and an FP8 recipe (FP8 weights of "
                          "Megatron's TE modules)", f"engine {config.engine}, te.fp8={fp8}",
                          hint=f"--engine megatron --set {NAME}.fp8=current, or --set {NAME}.fp8_param_gather=false"))
    if train.fused_master_weights:
        # Megatron 0.19 hands FusedAdam the masters of FP8 weights too unless its optimizer knows the FP8 recipe,
        # and TE's FusedAdam casts into FP8 weights only under delayed scaling: not run here, so not offered
        rows.append(Check(NAME, "fused_master_weights", FAIL, "with te.fp8_param_gather, Megatron's own fp32 masters (FP8 weights are cast from "
                          "them after each step)", "train.fused_master_weights=true (TE's FusedAdam holds the masters)",
                          hint=f"--set train.fused_master_weights=false, or --set {NAME}.fp8_param_gather=false"))
    if not train.grad_reduce_in_fp32:
        # full NAM56R, one H200, MBS 2, te.fp8=current: the loss of step 1 non-finite, the embedding's weight first
        # (2026-11-28, bench/results/logs-2026-11-28b/r3/M2.log); fp32 gradient buffers with FP8 weights not run
        rows.append(Check(NAME, "grad_reduce_in_fp32", FAIL, "fp32 gradient buffers with te.fp8_param_gather (with "
                          "bf16 buffers full NAM56R's first update was non-finite on an H200)",
                          "train.grad_reduce_in_fp32=false", hint=f"--set train.grad_reduce_in_fp32=true, or --set "
                          f"{NAME}.fp8_param_gather=false"))
    return rows


def recipe_row(fp8: str, device) -> Check:
    """Whether ``device`` (a probe or a profile) can run recipe ``fp8``: its capability and torch's CUDA."""
    r = RECIPES[fp8]
    needed = f"sm_{r.capability[0]}{r.capability[1]} or newer" + (
        f" and CUDA >= {r.cuda[0]}.{r.cuda[1]}" if r.cuda else "") + f" ({fp8}: {r.scales})"
    cap = tuple(device.capability or (0, 0))
    found = f"{device.label}, CUDA {device.cuda_version or 'none'}"
    if cap < r.capability:
        return Check(NAME, "fp8 recipe", FAIL, needed, found + f": TE runs {r.te_class} on sm_{r.capability[0]}"
                     f"{r.capability[1]} and newer only", hint=OTHER_HINT)
    if r.cuda and not cuda_at_least(device.cuda_version, r.cuda):
        return Check(NAME, "fp8 recipe", FAIL, needed, found + f": TE's {r.te_class} GEMMs need CUDA "
                     f"{r.cuda[0]}.{r.cuda[1]}", hint=OTHER_HINT)
    return Check(NAME, "fp8 recipe", PASS, needed, found)


def fp8_of(spec) -> str:
    return spec.options[NAME].fp8


def fp8_on(spec) -> bool:
    return fp8_of(spec) != OFF


def linear_shapes(spec) -> tuple[bool, str]:
    from nam56r.projections import shape_row
    from nam_plugin_te.linears import MULTIPLE

    ok, found = shape_row(spec.model, MULTIPLE)
    if not ok:
        return ok, found
    if spec.options[NAME].experts == "grouped":  # TEGroupedMLP's FP8 GEMMs: [2f, d] and [d, f] per expert
        widths = {"hidden": spec.model.hidden, "moe_ffn_hidden": spec.model.moe_ffn_hidden}
        off = {k: v for k, v in widths.items() if v % MULTIPLE}
        if off:
            return False, "the grouped experts' " + ", ".join(f"{k}={v}" for k, v in off.items())
        return True, f"{found} and the grouped experts"
    return True, found


CHECKS = (
    ShapeCheck("linear shapes", "every swapped projection's in and out features (and with te.experts=grouped, "
               "hidden and moe_ffn_hidden) divisible by 16 (TE's FP8 GEMMs)",
               linear_shapes, f"choose widths that make them divisible by 16, or {OFF_HINT}", when=fp8_on),
    LaunchCheck("torch extension", "transformer_engine.pytorch imports: TE's torch extension "
                "(transformer_engine_torch) built for this torch", "nam_plugin_te.selftest:extension",
                REBUILD_HINT, when=lambda spec: True),
    LaunchCheck("cuDNN", None, "nam_plugin_te.selftest:cudnn", "install the cuDNN wheel torch names (nvidia-cudnn)",
                when=lambda spec: True),
    LaunchCheck("fp8 recipes", None, "nam_plugin_te.selftest:fp8_support",
                OTHER_HINT,
                when=fp8_on),
    LaunchCheck("bf16 parity", f"output and gradients within {BF16_TOLERANCE:g} (relative L2) of nn.Linear in bf16",
                "nam_plugin_te.selftest:bf16_parity", f"report it with the numbers; meanwhile drop --plugins {NAME}",
                when=lambda spec: True),
    LaunchCheck("fp8 parity", f"output and gradients within {FP8_TOLERANCE:g} (relative L2) of nn.Linear in fp32, "
                f"and above {FP8_FLOOR:g} (FP8 ran)", "nam_plugin_te.selftest:fp8_parity",
                f"report it with the numbers; meanwhile {OFF_HINT}", when=fp8_on),
)
"""``PLUGIN.checks``: the shape row for an FP8 run; on a real device the launch rows, in this order (without a
run, ``nam preflight --plugins te``: all of them, FP8 for delayed and current scaling)."""


PLUGIN = PluginInfo(
    summary="te: NAM56R's dense projections (Mamba in/out, MLA/DSA, shared expert, MTP) as Transformer Engine "
            "linears, bf16 or FP8 (te.fp8=delayed|current|blockwise), both engines; parity self-tests at activation",
    requires=(
        Requirement.cuda_capability((9, 0), below=(12, 0), reason="TE measured on Hopper; sm_12x (GB10) lacks its "
                                    "MXFP8 and blockwise FP8 GEMMs"),
        Requirement.package(TE_SPEC, install_hint=GPU_HINT,
                            reason="te.Linear, te.autocast and the FP8 recipes (the record: 2.13; "
                                   "measured: 2.20.2)"),
    ),
    options=(
        Option("fp8", str, OFF, "what the TE linears compute in: off (bf16), delayed (per-tensor scales from the "
               "amax history), current (per-tensor scales from each tensor), blockwise (1x128 / 128x128 block "
               "scales, CUDA >= 12.9), mxfp8 (sm_100 and newer)", choices=CHOICES),
        Option("experts", str, "nam", "the routed experts on the megatron engine: nam (the run's moe backend in "
               "nam's experts slot) or grouped (Megatron's TEGroupedMLP: TE grouped GEMMs, FP8 with te.fp8)",
               choices=("nam", "grouped")),
        Option("fp8_param_gather", bool, False, "megatron engine, with an FP8 recipe: Megatron's TE modules (shared "
               "expert, MTP, grouped experts) keep FP8 weights, all-gathered in FP8 by the distributed optimizer "
               "(nam's swapped projections keep bf16 weights)"),
        Option("moe_fusion", bool, False, "megatron engine: Megatron's MoE router (softmax top-k, aux-loss scores) "
               "and token permute/unpermute run as TE's fused kernels (moe_router_fusion, moe_permute_fusion) "
               "instead of torch's topk, index_select and scatter_add; the same rows and gates"),
    ),
    checks=CHECKS,
)


@hookimpl
def nam_transform_model(model, spec):
    from nam_plugin_te import linears

    te = linears._te()
    line = linears.convert(model, spec.options[NAME].fp8, te=te)
    if spec.engine == "megatron":
        from nam_plugin_te.megatron import fuse_wgrad_accumulation

        line += f"; {fuse_wgrad_accumulation(model, te)}"
    return line
