"""Entry point of the liger plugin: what it declares and the hooks it implements.

Requesting the plugin selects its head (``PluginInfo.selects``: ``ce_backend=liger``) unless the user sets
``ce_backend`` themselves; the ``nam56r`` recipes name it already. The head runs the main LM head and both
MTP heads (the model calls one CE backend for all three).

Order within one run: activation checks the requirements below, the config check, and on a real GPU the
launch check (``nam_preflight``); the engine then applies the patch lane (``liger-none-reduction-bwd``,
retired on liger-kernel >= 0.8.2), and only then builds the head, which picks its formulation at its first
call from the installed release and the patch's state (``nam_plugin_liger.head``).

Keep this module light: torch and Liger are imported inside hook bodies and the backend modules, so
``nam plugins list`` reads ``PLUGIN`` without them.
"""

from __future__ import annotations

from nam_core import Check, PluginInfo, Requirement, hookimpl
from nam_core.requirements import FAIL, unused

NAME = "liger"
PATCH_NAME = "liger-none-reduction-bwd"  # same string as patch.NAME, kept here so this module stays light
INSTALL_HINT = "pip install nam-plugin-liger[gpu]"  # same string as head.INSTALL_HINT

PLUGIN = PluginInfo(
    summary="liger: LM head + MTP heads through Liger-Kernel's fused linear cross-entropy "
            "(no [tokens, vocab] logits); Triton, CUDA",
    provides={"ce_heads": [NAME], "patches": [PATCH_NAME]},
    requires=(
        Requirement.cuda_device(reason="Liger's kernels are Triton kernels: CUDA only, no CPU path"),
        # Triton's README: "NVIDIA GPUs (Compute Capability 8.0+)"; bf16 also needs sm_80.
        Requirement.cuda_capability(at_least=(8, 0), reason="Triton supports NVIDIA compute capability 8.0+"),
        # 0.8.0 and 0.8.1 have the reduction="none" backward bug (issue #968): they activate, and the patch
        # lane applies the mean-and-rescale workaround (0.8.2, PR #1298, fixed it; the GPU host runs 0.8.5).
        Requirement.package("liger-kernel>=0.8.0", install_hint=INSTALL_HINT),
    ),
    selects={"ce_backend": NAME},
)


@hookimpl
def nam_check_config(config, device):
    if config is None:
        return []
    model, train = config.model, config.train
    if model.ce_backend != NAME:
        return [unused(NAME, "ce_backend", model.ce_backend)]
    if train.device != "cuda":
        return [Check(NAME, "train.device", FAIL, "train.device=cuda (Liger's kernels run on CUDA tensors only)",
                      f"train.device={train.device}",
                      hint="--device cuda, or the pure-PyTorch head: --set ce_backend=reference --plugins reference")]
    return []


@hookimpl
def nam_preflight(device, config):
    from nam_plugin_liger.smoke import launch_check

    return [launch_check(device)]


@hookimpl
def nam_register_ce_heads(register):
    from nam_plugin_liger.head import LigerCEHead

    register(NAME, LigerCEHead)


@hookimpl
def nam_register_patches(register):
    from nam_plugin_liger.patch import make_patch

    register(PATCH_NAME, make_patch())
