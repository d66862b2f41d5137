"""The hopper-ce plugin's declaration. Requesting it selects ``ce_backend=hopper-ce`` (an explicit ``--set`` wins).
On a real GPU the host runs ``selftest.launch`` before a run uses the head (three heads sharing one weight, masked
bf16 tokens, against the reference head) and refuses to activate if any gradient is off, a masked token gets a
gradient, or anything is not finite. This module stays light (no torch, no triton at import)."""

from __future__ import annotations

from nam_core import PluginInfo, Requirement
from nam_core.checks import LaunchCheck
from nam_core.options import Option

NAME = "hopper-ce"
GRADIENTS = ("forward", "backward")
"""Where the head computes its gradients (``head.py``'s docstring): ``forward`` (three products, dh and dW held
until backward; the default: 86.9 ms against 112.8 at 16384 x 4096 x 131072 on an H200, bench/hopper_ce.py) or
``backward`` (the logits again in backward, four products, nothing held)."""
GPU_HINT = "pip install 'nam-plugin-hopper-ce[gpu]'"
REFERENCE_HINT = "or the reference head: --set ce_backend=reference"

PLUGIN = PluginInfo(
    summary="hopper-ce: LM + MTP heads as chunked fused linear CE on Hopper (fp32 logits from cuBLAS, fp32 dW, "
            "Triton row kernels); gradient self-test at activation",
    provides={"ce": {NAME: "nam_plugin_hopper_ce.head:HopperCEHead"}},
    requires=(
        Requirement.cuda_capability((9, 0), reason="built and measured for Hopper (sm_90): cuBLAS bf16 GEMMs with "
                                                   "fp32 output, Triton row kernels"),
        Requirement.package("triton>=3.3", install_hint=GPU_HINT),
    ),
    selects={"ce_backend": NAME},
    train_device="cuda", train_dtypes=("bfloat16", "float16"),
    train_needs_reason="CUDA kernels whose GEMMs take 16-bit inputs",
    checks=(LaunchCheck("gradient self-test", None, "nam_plugin_hopper_ce.selftest:launch",
                        f"report it with the seed; meanwhile {REFERENCE_HINT}"),),
    options=(
        Option("gradients", str, GRADIENTS[0], "where the head computes dL/dhidden and dL/dW: forward (three [t, d] x "
               "[d, v] products; each call holds its dh and dW in the weights' dtype until backward, 1.13 GiB per "
               "call at 16384 tokens x 4096 x 131072; 1.30x the backward path at that shape on an H200) or backward "
               "(the logits again in backward: four products, nothing held between forward and backward)",
               choices=GRADIENTS),
    ),
)
