"""The grouped-moe plugin's declaration. Requesting it selects ``moe_backend=grouped``: the routed experts of every
MoE layer run as two grouped GEMMs (``experts.py``) in both engines; the local engine sorts the rows itself, the
megatron engine takes them from Megatron's dispatcher (nam56r/megatron/slots.py). On a real GPU, activation
compares the experts against the fp32 reference (``selftest.py``) and refuses outside tolerance.

This module stays light (no torch at import) so ``nam plugins list`` can read ``PLUGIN``.
"""

from __future__ import annotations

from nam_core import PluginInfo, Requirement
from nam_core.checks import LaunchCheck, ShapeCheck

NAME = "grouped-moe"
BACKEND = "grouped"
ALIGN = 8
"""``grouped_mm`` needs every row of its operands 16-byte aligned: in bf16, K and N divisible by 8."""
TOLERANCE = 1e-2
"""Largest ``||ours - ref|| / ||ref||`` of the output and each gradient against the fp32 reference: bf16
operands with fp32 accumulation land near 3e-3; one wrong expert of 8 is off by ~0.35."""


def expert_widths(spec) -> tuple[bool, str]:
    """Whether the expert GEMMs' K and N are aligned; the unaligned widths (all of them when none is)."""
    widths = {"hidden": spec.model.hidden, "moe_ffn_hidden": spec.model.moe_ffn_hidden}
    bad = {k: v for k, v in widths.items() if v % ALIGN}
    return not bad, ", ".join(f"{k}={v}" for k, v in (bad or widths).items())


PLUGIN = PluginInfo(
    summary="grouped-moe: routed experts as two grouped GEMMs per layer (torch.nn.functional.grouped_mm, bf16), "
            "rows sorted by expert on the device: no per-expert loop, no host sync",
    provides={"moe": {BACKEND: "nam_plugin_grouped_moe.experts:GroupedExperts"}},
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
    checks=(
        ShapeCheck("expert GEMM shapes", f"hidden and moe_ffn_hidden divisible by {ALIGN}", expert_widths,
                   "choose widths divisible by 8, or --set moe_backend=reference"),
        LaunchCheck("grouped parity", f"output and every gradient within {TOLERANCE:g} (relative L2) of the fp32 "
                    "reference experts", "nam_plugin_grouped_moe.selftest:launch",
                    "report it with the seed; meanwhile --set moe_backend=reference"),
    ),
)
