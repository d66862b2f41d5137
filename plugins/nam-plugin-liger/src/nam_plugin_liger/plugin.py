"""The liger plugin's declaration: requesting it selects ``ce_backend=liger`` (LM and MTP heads); the host checks it
(``smoke.py`` on a real GPU), the engine applies the patch lane before it builds the head."""

from __future__ import annotations

from nam_core import PluginInfo, Requirement, hookimpl
from nam_core.checks import LaunchCheck
from nam_plugin_liger import smoke

NAME, PATCH_NAME = "liger", "liger-none-reduction-bwd"  # PATCH_NAME = patch.NAME, kept here: this module stays light
PEFT_PATCH_NAME = "liger-peft-probe-import"  # = peft_probe.NAME

PLUGIN = PluginInfo(
    summary="liger: LM head + MTP heads through Liger-Kernel's fused linear cross-entropy "
            "(no [tokens, vocab] logits); Triton, CUDA",
    provides={"ce": {NAME: "nam_plugin_liger.head:LigerCEHead"}, "patches": [PEFT_PATCH_NAME, PATCH_NAME]},
    requires=(
        Requirement.cuda_device(reason="Liger's kernels are Triton kernels: CUDA only, no CPU path"),
        # Triton's README: "NVIDIA GPUs (Compute Capability 8.0+)"; bf16 also needs sm_80.
        Requirement.cuda_capability(at_least=(8, 0), reason="Triton supports NVIDIA compute capability 8.0+"),
        # 0.8.0 and 0.8.1 have the reduction="none" backward bug (issue #968): they activate, and the patch
        # lane applies the mean-and-rescale workaround (0.8.2, PR #1298, fixed it; the GPU host runs 0.8.5).
        Requirement.package("liger-kernel>=0.8.0", install_hint="pip install nam-plugin-liger[gpu]"),
    ),
    selects={"ce_backend": NAME},
    train_device="cuda", train_needs_reason="Liger's kernels run on CUDA tensors only",
    checks=(LaunchCheck(smoke.CHECK, smoke.NEEDED, smoke.launch, smoke.HINT),),
)


@hookimpl
def nam_register_patches(register):
    from nam_plugin_liger import peft_probe
    from nam_plugin_liger.patch import make_patch

    register(PEFT_PATCH_NAME, peft_probe.make_patch())
    register(PATCH_NAME, make_patch())
