"""The liger plugin: declarations and hooks. Requesting it selects ``ce_backend=liger`` (LM and MTP heads);
the host checks the requirements and ``train.device``, the engine applies the patch lane
(``liger-none-reduction-bwd``) before it builds the head. Heavy imports stay inside hook bodies."""

from __future__ import annotations

from nam_core import PluginInfo, Requirement, hookimpl

NAME = "liger"
PATCH_NAME = "liger-none-reduction-bwd"  # same string as patch.NAME, kept here so this module stays light
INSTALL_HINT = "pip install nam-plugin-liger[gpu]"  # same string as head.INSTALL_HINT

PLUGIN = PluginInfo(
    summary="liger: LM head + MTP heads through Liger-Kernel's fused linear cross-entropy "
            "(no [tokens, vocab] logits); Triton, CUDA",
    provides={"ce": [NAME], "patches": [PATCH_NAME]},
    requires=(
        Requirement.cuda_device(reason="Liger's kernels are Triton kernels: CUDA only, no CPU path"),
        # Triton's README: "NVIDIA GPUs (Compute Capability 8.0+)"; bf16 also needs sm_80.
        Requirement.cuda_capability(at_least=(8, 0), reason="Triton supports NVIDIA compute capability 8.0+"),
        # 0.8.0 and 0.8.1 have the reduction="none" backward bug (issue #968): they activate, and the patch
        # lane applies the mean-and-rescale workaround (0.8.2, PR #1298, fixed it; the GPU host runs 0.8.5).
        Requirement.package("liger-kernel>=0.8.0", install_hint=INSTALL_HINT),
    ),
    selects={"ce_backend": NAME},
    train_device="cuda", train_needs_reason="Liger's kernels run on CUDA tensors only",
)


@hookimpl
def nam_preflight(device, config):
    from nam_plugin_liger.smoke import launch_check

    return [launch_check(device)]


@hookimpl
def nam_register_ce_backends(register):
    from nam_plugin_liger.head import LigerCEHead

    register(NAME, LigerCEHead)


@hookimpl
def nam_register_patches(register):
    from nam_plugin_liger.patch import make_patch

    register(PATCH_NAME, make_patch())
