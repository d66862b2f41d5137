"""Entry point of the fp8-moe plugin: what it declares and the hooks it implements.

Requesting the plugin selects ``moe_backend=fp8``: the routed experts' GEMMs run in FP8, and nothing else does
(router, shared expert, attention, Mamba and the heads stay in the run's dtype). The backend is the option
``fp8-moe.backend`` (``torch``, the default: ``torch._scaled_mm``; ``te``: Transformer Engine), never picked by
what happens to be installed. The host parses the options and checks ``train.device``/``train.dtype`` when the
experts are used; on a real GPU, activation runs ``selftest.compare`` against the reference experts and refuses
to activate outside FP8 tolerance.

This module stays light (no torch, no triton at import) so ``nam plugins list`` can read ``PLUGIN``.
"""

from __future__ import annotations

from nam_core import Check, PluginInfo, Requirement, hookimpl
from nam_core.options import Option
from nam_core.requirements import FAIL, PASS

NAME = "fp8-moe"
BACKEND = "fp8"
GPU_HINT = "pip install 'nam-plugin-fp8-moe[gpu]'"
BF16_HINT = "or keep the experts in bf16: drop --plugins fp8-moe"
GEMM_MULTIPLE = 16
"""``torch._scaled_mm`` needs both dims of its second operand divisible by 16 (each expert GEMM's K and N)."""
BACKENDS = ("torch", "te")

PLUGIN = PluginInfo(
    summary="fp8-moe: routed-expert GEMMs of every MoE layer in FP8 (E4M3 / E5M2 gradients, per-tensor scales "
            "from an amax history, torch._scaled_mm); router, shared expert and the rest stay bf16",
    provides={"moe": [BACKEND]},
    requires=(
        Requirement.cuda_capability((8, 9), reason="FP8 tensor cores arrived with Ada (sm_89) and Hopper (sm_90)"),
        Requirement.package("torch>=2.5", install_hint=GPU_HINT),
        Requirement.package("triton>=3.3", install_hint=GPU_HINT),
    ),
    selects={"moe_backend": BACKEND},
    options=(
        Option("backend", str, "torch", "torch: torch._scaled_mm (this plugin's kernels); te: Transformer Engine "
               "(not built yet)", choices=BACKENDS),
        Option("amax_history", int, 16, "calls of amax kept per activation role; the scale is the history's max "
               "over FP8's max", min=1),
    ),
    train_device="cuda", train_dtypes=("bfloat16",),
    train_needs_reason="FP8 GEMMs on CUDA; the non-FP8 GEMMs and the outputs in bf16",
)


@hookimpl
def nam_check_config(config, device):
    opts, model = config.options[NAME], config.model
    if opts.backend == "te":
        te = Requirement.package("transformer-engine>=2.0", install_hint="pip install transformer-engine[pytorch]")
        return [te.check(NAME, device),
                Check(NAME, "backend", FAIL, f"{NAME}.backend one of {', '.join(BACKENDS)}",
                      "te: not built in this release (no GPU host nam is tested on carries Transformer Engine, so "
                      "it could not be verified)", hint=f"--set {NAME}.backend=torch")]
    checks = [Check(NAME, "backend", PASS, f"{NAME}.backend one of {', '.join(BACKENDS)}",
                    f"torch (torch._scaled_mm), amax history of {opts.amax_history} calls")]
    if model.moe_backend != BACKEND:
        return checks
    bad = {k: v for k, v in (("hidden", model.hidden), ("moe_ffn_hidden", model.moe_ffn_hidden)) if v % GEMM_MULTIPLE}
    checks.append(Check(NAME, "expert GEMM shapes", FAIL if bad else PASS,
                        f"hidden and moe_ffn_hidden divisible by {GEMM_MULTIPLE}",
                        ", ".join(f"{k}={v}" for k, v in bad.items()) if bad else
                        f"hidden={model.hidden}, moe_ffn_hidden={model.moe_ffn_hidden}",
                        hint=None if not bad else BF16_HINT))
    return checks


@hookimpl
def nam_preflight(device, config):
    """The activation self-test on a real CUDA device: FP8 experts against the reference, within tolerance."""
    from nam_plugin_fp8_moe import selftest
    from nam_plugin_fp8_moe.experts import FP8Experts
    from nam_plugin_fp8_moe.kernel import triton_cast

    bound = selftest.TOLERANCE["fp8"]
    needed = f"output and every gradient within {bound:g} (relative L2) of the fp32 reference experts"
    r = selftest.compare(FP8Experts(cast=triton_cast), device="cuda")
    worst = selftest.worst(r)
    found = (", ".join(f"{k} {v:.3f}" for k, v in r.items() if k != "seed")
             + f" (512 tokens, 8 experts of 64, top-2, 2 calls; seed {r['seed']})")
    ok = worst <= bound
    return [Check(NAME, "FP8 parity", PASS if ok else FAIL, needed, found,
                  hint=None if ok else f"report it with the seed; meanwhile {BF16_HINT}")]


@hookimpl
def nam_register_moe_backends(register):
    from nam_plugin_fp8_moe.experts import FP8Experts

    register(BACKEND, FP8Experts)
