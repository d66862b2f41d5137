"""Entry point of the fp8-moe plugin: what it declares and the hooks it implements.

Requesting the plugin selects ``moe_backend=fp8``: the routed experts' GEMMs run in FP8, and nothing else does
(router, shared expert, attention, Mamba and the heads stay in the run's dtype). The backend is the option
``fp8-moe.backend`` (``torch``, the default: ``torch._scaled_mm``; ``te``: Transformer Engine), never picked by
what happens to be installed. On a real GPU, activation runs ``selftest.compare`` against the reference
experts and refuses to activate outside FP8 tolerance.

This module stays light (no torch, no triton at import) so ``nam plugins list`` can read ``PLUGIN``.
"""

from __future__ import annotations

from nam_core import Check, PluginInfo, Requirement, hookimpl
from nam_core.requirements import FAIL, PASS, unused

NAME = "fp8-moe"
BACKEND = "fp8"
GPU_HINT = "pip install 'nam-plugin-fp8-moe[gpu]'"
BF16_HINT = "or keep the experts in bf16: drop --plugins fp8-moe"
GEMM_MULTIPLE = 16
"""``torch._scaled_mm`` needs both dims of its second operand divisible by 16 (each expert GEMM's K and N)."""

PLUGIN = PluginInfo(
    summary="fp8-moe: routed-expert GEMMs of every MoE layer in FP8 (E4M3 / E5M2 gradients, per-tensor scales "
            "from an amax history, torch._scaled_mm); router, shared expert and the rest stay bf16",
    provides={"moe_experts": [BACKEND]},
    requires=(
        Requirement.cuda_capability((8, 9), reason="FP8 tensor cores arrived with Ada (sm_89) and Hopper (sm_90)"),
        Requirement.package("torch>=2.5", install_hint=GPU_HINT),
        Requirement.package("triton>=3.3", install_hint=GPU_HINT),
    ),
    selects={"moe_backend": BACKEND},
)


@hookimpl
def nam_check_config(config, device):
    from nam_plugin_fp8_moe.options import BACKENDS, OptionError, parse_options

    options = dict(config.train.plugin_options) if config is not None else {}
    try:
        opts = parse_options(options)
    except OptionError as e:
        return [Check(NAME, "options", FAIL, e.expected, f"{e.option}={e.found!r}",
                      hint=f"--set {e.option}=... with {e.expected}")]
    checks = []
    if opts.backend == "te":
        te = Requirement.package("transformer-engine>=2.0", install_hint="pip install transformer-engine[pytorch]")
        checks.append(te.check(NAME, device))
        checks.append(Check(NAME, "backend", FAIL, f"{NAME}.backend one of {', '.join(BACKENDS)}",
                            "te: not built in this release (no GPU host nam is tested on carries Transformer "
                            "Engine, so it could not be verified)", hint=f"--set {NAME}.backend=torch"))
    else:
        checks.append(Check(NAME, "backend", PASS, f"{NAME}.backend one of {', '.join(BACKENDS)}",
                            f"torch (torch._scaled_mm), amax history of {opts.amax_history} calls"))
    if config is None:
        return checks
    model, train = config.model, config.train
    if model.moe_backend != BACKEND:
        return checks + [unused(NAME, "moe_backend", model.moe_backend)]
    if train.device != "cuda":
        checks.append(Check(NAME, "train.device", FAIL, "train.device=cuda", f"train.device={train.device}",
                            hint=f"--device cuda, {BF16_HINT}"))
    if train.dtype != "bfloat16":
        checks.append(Check(NAME, "train.dtype", FAIL, "train.dtype=bfloat16 (the non-FP8 GEMMs and the outputs)",
                            f"train.dtype={train.dtype}", hint=f"--set train.dtype=bfloat16, {BF16_HINT}"))
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
    try:
        r = selftest.compare(FP8Experts(cast=triton_cast), device="cuda")
    except Exception as e:  # a compile or launch failure is this check's failure, with what happened
        return [Check(NAME, "FP8 parity", FAIL, needed, f"{type(e).__name__}: {e}".splitlines()[0],
                      hint=f"python -m pytest plugins/nam-plugin-fp8-moe -m gpu -v; meanwhile {BF16_HINT}")]
    worst = selftest.worst(r)
    found = (", ".join(f"{k} {v:.3f}" for k, v in r.items() if k != "seed")
             + f" (512 tokens, 8 experts of 64, top-2, 2 calls; seed {r['seed']})")
    ok = worst <= bound
    return [Check(NAME, "FP8 parity", PASS if ok else FAIL, needed, found,
                  hint=None if ok else f"report it with the seed; meanwhile {BF16_HINT}")]


@hookimpl
def nam_register_moe_experts(register):
    from nam_plugin_fp8_moe.experts import FP8Experts

    register(BACKEND, FP8Experts)
