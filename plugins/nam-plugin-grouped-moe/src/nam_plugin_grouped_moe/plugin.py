"""The grouped-moe plugin: declarations and hooks. Requesting it selects ``moe_backend=grouped``: the routed
experts of every MoE layer run as two grouped GEMMs (``experts.py``) in both engines; the local engine sorts
the rows itself, the megatron engine takes them from Megatron's dispatcher (nam56r/megatron/slots.py).
On a real GPU, activation compares the experts against the fp32 reference and refuses outside tolerance.

This module stays light (no torch at import) so ``nam plugins list`` can read ``PLUGIN``.
"""

from __future__ import annotations

from nam_core import Check, PluginInfo, Requirement, hookimpl
from nam_core.requirements import FAIL, PASS

NAME = "grouped-moe"
BACKEND = "grouped"
ALIGN = 8
"""``grouped_mm`` needs every row of its operands 16-byte aligned: in bf16, K and N divisible by 8."""
TOLERANCE = 1e-2
"""Largest ``||ours - ref|| / ||ref||`` of the output and each gradient against the fp32 reference: bf16
operands with fp32 accumulation land near 3e-3; one wrong expert of 8 is off by ~0.35."""

PLUGIN = PluginInfo(
    summary="grouped-moe: routed experts as two grouped GEMMs per layer (torch.nn.functional.grouped_mm, bf16), "
            "rows sorted by expert on the device: no per-expert loop, no host sync",
    provides={"moe": [BACKEND]},
    requires=(
        Requirement.cuda_device(reason="torch's grouped GEMM has no backward on the CPU"),
        Requirement.cuda_capability((9, 0), reason="the sm_90 CUTLASS grouped GEMM is the one measured "
                                    "(bench/moe.py); other architectures are untested"),
        Requirement.package("torch>=2.11", install_hint="pip install 'torch>=2.11'",
                            reason="torch.nn.functional.grouped_mm with autograd, int32 offsets, bf16"),
    ),
    selects={"moe_backend": BACKEND},
    train_device="cuda", train_dtypes=("bfloat16",),
    train_needs_reason="torch's grouped GEMM runs bf16 on CUDA",
)


@hookimpl
def nam_check_config(config, device):
    model = config.model
    if model.moe_backend != BACKEND:
        return []
    bad = {k: v for k, v in (("hidden", model.hidden), ("moe_ffn_hidden", model.moe_ffn_hidden)) if v % ALIGN}
    return [Check(NAME, "expert GEMM shapes", FAIL if bad else PASS, f"hidden and moe_ffn_hidden divisible by {ALIGN}",
                  ", ".join(f"{k}={v}" for k, v in bad.items()) if bad else
                  f"hidden={model.hidden}, moe_ffn_hidden={model.moe_ffn_hidden}",
                  hint="choose widths divisible by 8, or --set moe_backend=reference" if bad else None)]


@hookimpl
def nam_preflight(device, config):
    """The activation self-test on a real CUDA device: grouped experts against the fp32 reference."""
    from nam56r.testing import compare_experts, worst_error
    from nam_plugin_grouped_moe.experts import GroupedExperts

    r = compare_experts(GroupedExperts(), device="cuda")
    ok = worst_error(r) <= TOLERANCE
    found = (", ".join(f"{k} {v:.2e}" for k, v in r.items() if k != "seed")
             + f" (512 tokens, 8 experts of 64, top-2; seed {r['seed']})")
    return [Check(NAME, "grouped parity", PASS if ok else FAIL,
                  f"output and every gradient within {TOLERANCE:g} (relative L2) of the fp32 reference experts",
                  found, hint=None if ok else "report it with the seed; meanwhile --set moe_backend=reference")]


@hookimpl
def nam_register_moe_backends(register):
    from nam_plugin_grouped_moe.experts import GroupedExperts

    register(BACKEND, GroupedExperts)
