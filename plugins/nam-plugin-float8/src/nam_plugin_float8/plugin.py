"""The float8 plugin: declarations and hooks. Two parts, each off until the user (or a recipe) turns it on:

* ``float8.linears`` = none | tensorwise | rowwise: the dense projections (``linears.py``) become torchao
  ``Float8Linear`` modules, in both engines, through ``nam_transform_model`` (after the model is built and
  cast, before the optimizer).
* ``float8.experts`` = off | rowwise: the routed experts run on torchao's FP8 grouped GEMM (``experts.py``),
  as the ``moe`` backend ``float8-grouped``. The option and ``moe_backend`` must agree (requesting the plugin
  selects no backend by itself: its parts are off by default); ``nam_check_config`` says which ``--set`` fixes
  a mismatch.

On a real GPU, activation runs a parity self-test of each enabled part against fp32 and refuses outside its
FP8 tolerance, and shows each part's measured speed against bf16 (``MEASURED``; "not measured yet" while it is
empty). This module stays light (no torch, no torchao at import) so ``nam plugins list`` can read ``PLUGIN``.
"""

from __future__ import annotations

from nam_core import Check, PluginInfo, Requirement, hookimpl
from nam_core.checks import LaunchCheck, ShapeCheck
from nam_core.options import Option
from nam_core.requirements import FAIL, PASS, SKIP
from nam_plugin_float8.shapes import MULTIPLE

NAME = "float8"
BACKEND = "float8-grouped"
GPU_HINT = "pip install 'nam-plugin-float8[gpu]'"
LINEAR_RECIPES = ("none", "tensorwise", "rowwise")  # "none" + linears.RECIPES
EXPERT_RECIPES = ("off", "rowwise")

LINEARS_TOLERANCE = 0.10
"""Largest ``||fp8 - ref|| / ||ref||`` of a ``Float8Linear``'s output, input gradient and weight gradient against
``nn.Linear`` in fp32 (4096 tokens, 1024 -> 2048). Measured on the CPU at 256 tokens, 128 -> 256 (torchao 0.18,
torch 2.13): rowwise 0.037-0.038 for all three (e4m3 everywhere), tensorwise 0.038 out and 0.059 for both
gradients (e5m2 gradients: 2 mantissa bits); a wrong scale or a transposed operand is off by ~1."""
EXPERTS_TOLERANCE = 0.15
"""Largest ``||fp8 - ref|| / ||ref||`` of the experts' output and every gradient against the fp32 reference
experts (``nam56r.testing.compare_experts``: 512 tokens, 8 experts of 64, top-2): two FP8 GEMMs and a SwiGLU
in between; the bound the retired fp8-moe plugin was held to. One wrong expert of 8 is off by ~0.35."""

MEASURED: dict[str, dict] = {
    # bench/results/moe.json, 8192 tokens (NAM56R's micro-batch 2 x 4096), forward + backward: bf16 grouped
    # 2.62 ms, FP8 grouped 7.13 ms (0.30x at 4096 tokens, 0.37x at 16384).
    "experts": {"speedup": 0.37, "bench": "python bench/moe.py", "date": "2026-11-23", "gpu": "H200"},
    # bench/results/megatron_throughput_h200_float8.json: the whole NAM56R step, local engine, MBS 2, the 159
    # dense projections rowwise: 6,319 against bf16's 8,899 tokens/s in the same run (the casts are unfused
    # eager kernels: the profiled step has 24,419 device events against 9,479). Tensorwise is not measured.
    "linears": {"speedup": 0.71, "bench": "python bench/megatron.py throughput --gpus 1 --engines local --mbs 2 "
                                          "--float8 none,rowwise", "date": "2026-11-23", "gpu": "H200"},
}
"""Part (``linears`` / ``experts``) -> its speed against bf16 at NAM56R's shapes, filled from a GPU bench:
``{"speedup": bf16 time / fp8 time, "bench": the command, "date": "YYYY-MM-DD", "gpu": "H100"}``. Empty until
measured; the preflight row then says "not measured yet"."""
BENCH = {"linears": "python bench/megatron.py throughput --gpus 1 --engines local --float8 none,rowwise",
         "experts": "python bench/moe.py (the grouped FP8 column)"}



def enabled_parts(opts) -> dict[str, str]:
    """Part -> its recipe, for the parts that are on."""
    parts = {"linears": opts.linears, "experts": opts.experts}
    return {k: v for k, v in parts.items() if v not in ("none", "off")}


@hookimpl
def nam_check_config(config, device):
    opts, model, train = config.options[NAME], config.model, config.train
    parts = enabled_parts(opts)
    rows = [Check(NAME, "parts", PASS if parts else SKIP, "float8.linears or float8.experts on",
                  ", ".join(f"{k}={v}" for k, v in parts.items()) if parts else
                  "float8.linears=none, float8.experts=off: active, changes nothing",
                  hint=None if parts else f"--set {NAME}.linears=rowwise and/or --set {NAME}.experts=rowwise")]
    rows += _experts_selection(opts, model)
    if opts.linears != "none" and getattr(model, "mamba_split_in_proj", False):
        rows.append(Check(NAME, "mamba_split_in_proj", FAIL, "Mamba's in_proj run by its own module (float8.linears "
                          "swaps it for an FP8 linear)", "mamba_split_in_proj=true (three GEMMs on slices of the "
                          "weight, skipping the swapped module)",
                          hint=f"--set mamba_split_in_proj=false, or --set {NAME}.linears=none"))
    if not parts:
        return rows
    why = " (FP8 GEMMs on CUDA; everything else and the outputs in bf16)"
    if train.device != "cuda":
        rows.append(Check(NAME, "train.device", FAIL, f"train.device=cuda{why}", f"train.device={train.device}",
                          hint=f"--device cuda, or drop --plugins {NAME}"))
    if train.dtype != "bfloat16":
        rows.append(Check(NAME, "train.dtype", FAIL, f"train.dtype=bfloat16{why}", f"train.dtype={train.dtype}",
                          hint=f"--set train.dtype=bfloat16, or drop --plugins {NAME}"))
    if "experts" in parts:
        rows.append(Requirement.cuda_capability(
            (9, 0), reason="torch._scaled_grouped_mm runs FP8 on sm_90 and newer").check(NAME, device))
    return rows


def _experts_selection(opts, model) -> list[Check]:
    """``float8.experts`` and ``moe_backend`` name the same thing: a mismatch is refused, not guessed."""
    if opts.experts == "rowwise" and model.moe_backend != BACKEND:
        return [Check(NAME, "experts backend", FAIL, f"moe_backend={BACKEND} with {NAME}.experts=rowwise",
                      f"moe_backend={model.moe_backend}", hint=f"--set moe_backend={BACKEND}, or "
                      f"--set {NAME}.experts=off")]
    if opts.experts == "off" and model.moe_backend == BACKEND:
        return [Check(NAME, "experts backend", FAIL, f"{NAME}.experts=rowwise with moe_backend={BACKEND}",
                      f"{NAME}.experts=off", hint=f"--set {NAME}.experts=rowwise, or --set moe_backend=grouped")]
    return []


def parts_of(spec) -> dict[str, str]:
    """Part -> its recipe for the run; both parts (rowwise) without a run (``nam preflight --plugins float8``)."""
    return enabled_parts(spec.options[NAME]) if spec is not None else {"linears": "rowwise", "experts": "rowwise"}


def linears_on(spec) -> bool:
    return "linears" in parts_of(spec)


def experts_on(spec) -> bool:
    return "experts" in parts_of(spec)


def expert_shapes(spec) -> tuple[bool, str]:
    model = spec.model
    widths = {"hidden": model.hidden, "moe_ffn_hidden": model.moe_ffn_hidden}
    bad = {k: v for k, v in widths.items() if v % MULTIPLE}
    return not bad, ", ".join(f"{k}={v}" for k, v in (bad or widths).items())


def linear_shapes(spec) -> tuple[bool, str]:
    from nam56r.projections import shape_row

    ok, found = shape_row(spec.model, MULTIPLE)
    if not ok:
        return ok, found
    if spec.engine == "megatron":
        found += ("; on the megatron engine the shared expert and the MTP projections are Megatron's parallel "
                  "linears and stay bf16")
    return True, found


CHECKS = (
    ShapeCheck("expert GEMM shapes", f"hidden and moe_ffn_hidden divisible by {MULTIPLE} (K and N of both FP8 "
               "grouped GEMMs)", expert_shapes, f"choose widths divisible by {MULTIPLE}, or --set {NAME}.experts=off "
               "--set moe_backend=grouped", when=experts_on),
    ShapeCheck("linear shapes", f"every selected projection's in and out features divisible by {MULTIPLE}",
               linear_shapes, f"choose widths that make them divisible by {MULTIPLE} (the Mamba in_proj is "
               f"2*d_inner + 2*B/C + 3*heads + angles wide), or --set {NAME}.linears=none", when=linears_on),
    LaunchCheck("linears parity", f"output and gradients within {LINEARS_TOLERANCE:g} (relative L2) of nn.Linear in "
                "fp32", "nam_plugin_float8.selftest:linears", f"report it; meanwhile --set {NAME}.linears=none",
                when=linears_on),
    LaunchCheck("experts parity", f"output and every gradient within {EXPERTS_TOLERANCE:g} (relative L2) of the fp32 "
                "reference experts", "nam_plugin_float8.selftest:experts", f"report it with the seed; meanwhile "
                f"--set {NAME}.experts=off --set moe_backend=grouped", when=experts_on),
)
"""``PLUGIN.checks``: the host writes these rows for the parts the run turns on (both parts' launches without a
run)."""


PLUGIN = PluginInfo(
    summary="float8: FP8 training through torchao: dense projections as Float8Linear (tensorwise or rowwise) "
            "and routed experts on torchao's FP8 grouped GEMM (moe: float8-grouped); each part off until set",
    provides={"moe": {BACKEND: "nam_plugin_float8.experts:Float8GroupedExperts"}},
    requires=(
        Requirement.cuda_device(reason="torchao's float8 casts are Triton kernels and its GEMMs cuBLAS/CUTLASS FP8"),
        Requirement.cuda_capability((8, 9), reason="FP8 tensor cores arrived with Ada (sm_89) and Hopper (sm_90)"),
        Requirement.package("torch>=2.11", install_hint="pip install 'torch>=2.11'",
                            reason="torch._scaled_grouped_mm and rowwise torch._scaled_mm"),
        Requirement.package("torchao==0.18.*", install_hint=GPU_HINT,
                            reason="known-good: its float8 training API and moe_training grouped GEMM are "
                                   "prototype APIs that change between releases"),
    ),
    options=(
        Option("linears", str, "none", "the dense projections (Mamba in/out, MLA/DSA, shared expert, MTP) as "
               "torchao Float8Linear: none, tensorwise (per-tensor scales) or rowwise (per-row power-of-two "
               "scales)", choices=LINEAR_RECIPES),
        Option("experts", str, "off", "the routed experts on torchao's FP8 rowwise grouped GEMM: off or rowwise "
               "(rowwise also needs --set moe_backend=float8-grouped)", choices=EXPERT_RECIPES),
    ),
    checks=CHECKS,
)


@hookimpl
def nam_preflight(device, config):
    """On a real CUDA device, after the parity rows (``CHECKS``): each enabled part's measured speed."""
    return [speed_row(part, MEASURED) for part in parts_of(config)]


def speed_row(part: str, measured: dict) -> Check:
    """What is known of ``part``'s speed against bf16: not measured yet (skip), slower (skip, saying so), or
    faster (pass). Never a failure: the user chose the part; the row says what it costs."""
    needed = "faster than bf16 at NAM56R's shapes, measured"
    m = measured.get(part)
    if m is None:
        return Check(NAME, f"{part} speed", SKIP, needed, "not measured yet", hint=f"measure: {BENCH[part]}")
    where = f"{m['bench']}, {m['date']}, {m['gpu']}"
    if m["speedup"] < 1.0:
        off = f"--set {NAME}.linears=none" if part == "linears" else f"--set {NAME}.experts=off --set moe_backend=grouped"
        return Check(NAME, f"{part} speed", SKIP, needed, f"{m['speedup']:.2f}x of bf16: SLOWER than bf16 ({where})",
                     hint=f"bf16 is faster here: {off}")
    return Check(NAME, f"{part} speed", PASS, needed, f"{m['speedup']:.2f}x of bf16 ({where})")


@hookimpl
def nam_transform_model(model, spec):
    recipe = spec.options[NAME].linears
    if recipe == "none":
        return None
    from nam_plugin_float8.linears import convert

    return convert(model, recipe)
