"""The deepep plugin's declaration. Requesting it selects ``train.moe_dispatcher=flex``: Megatron's flex token
dispatcher, on DeepEP's intranode buffer (the lowering sets ``moe_flex_dispatcher_backend=deepep``); an explicit
``--set train.moe_dispatcher=...`` wins. DeepEP v1.2.x is built without NVSHMEM (intranode only), for sm_90.

Rows, asked when the run uses the flex dispatcher: the megatron engine, expert parallelism of 2, 4 or 8 ranks
(EP 1 has nothing to dispatch across); on a real device, DeepEP's extension loading against the installed torch
on an sm_90 GPU, and peer access between every pair of visible GPUs (DeepEP's buffers are CUDA IPC memory that
each rank's kernels write into). Its patch-lane entry (``patch.py``, ``deepep-intranode-buffer``) lets Megatron's
flex dispatcher size DeepEP's buffer without the RDMA hint an NVSHMEM-less build refuses. This module stays
light: torch, deep_ep and megatron are imported inside the checks and the hook.
"""

from __future__ import annotations

from nam_core import PluginInfo, Requirement, hookimpl
from nam_core.checks import LaunchCheck, Measured, ShapeCheck

NAME = "deepep"
DEEPEP = "deep_ep>=1.2.1,<1.3"
"""v1.2.x: upstream main (V2) needs NCCL >= 2.30.4; torch 2.11's wheels ship 2.28.9."""
RANKS = (2, 4, 8)
"""The rank counts DeepEP v1.2.1's intranode kernels are instantiated for (``SWITCH_RANKS``); without NVSHMEM
there is no internode path, so an expert-parallel group is one host's 2, 4 or 8 GPUs."""
STAGE = ("bash plugins/nam-plugin-deepep/device/fetch-deepep.sh here (packs the v1.2.1 source into "
         ".device-deepep/), then on the GPU host bash .device-deepep/install-deepep.sh CACHE_DIR and "
         "PYTHONPATH=/tmp/site")
ALLTOALL = "Megatron's all-to-all dispatcher: drop --plugins deepep"
ENABLE = f"nam train --engine megatron --nproc 8 --ep 8 --plugins {NAME}"
PATCH = "deepep-intranode-buffer"
"""The patch-lane entry (``patch.py``): Megatron's buffer sizing without the RDMA hint NVSHMEM-less DeepEP refuses."""


def uses_flex(spec) -> bool:
    return spec.train.moe_dispatcher == "flex"


def flex_on_megatron(spec) -> bool:
    return uses_flex(spec) and spec.train.engine == "megatron"


def engine(spec) -> Measured:
    """The flex dispatcher is Megatron's: the local engine keeps all experts on one GPU and has no dispatcher."""
    return Measured(spec.train.engine == "megatron", f"engine={spec.train.engine}",
                    hint=f"{ENABLE}, or drop --plugins {NAME}")


def expert_parallel(spec) -> Measured:
    """EP must be 2, 4 or 8: at EP 1 every rank holds every expert (nothing to dispatch across; Megatron
    asserts TP x EP > 1 for this dispatcher), and DeepEP's intranode kernels exist for 2, 4 and 8 ranks only."""
    ep = spec.layout.ep
    if ep == 1:
        return Measured(False, "ep=1: every rank holds all experts, so there is nothing to dispatch across",
                        hint=f"--nproc N --ep N with N in {RANKS} (one host's GPUs), or {ALLTOALL}")
    if ep not in RANKS:
        return Measured(False, f"ep={ep}: DeepEP v1.2.x (NVSHMEM off) runs intranode groups of {RANKS} ranks only",
                        hint=f"--ep 2, 4 or 8, or {ALLTOALL}")
    return Measured(True, f"ep={ep}")


def dtype(spec) -> Measured:
    """DeepEP's intranode combine kernel has a bf16 instantiation only: any other dtype reaches its device-side
    ``Unsupported type`` assertion (intranode.cu) at the first MoE layer's combine, which aborts every rank
    (measured on 2 H200s, 2026-11-28, nam56r-tiny in fp32)."""
    return Measured(spec.train.dtype == "bfloat16", f"train.dtype={spec.train.dtype}",
                    hint=f"--set train.dtype=bfloat16, or {ALLTOALL}")


def extension(spec) -> Measured:
    """DeepEP's extension loads against this torch (an ABI mismatch is an ImportError here, not a crash in the
    first MoE layer), its version is 1.2.x, and this GPU is the sm_90 the build targets."""
    import importlib.metadata

    import torch

    try:
        version = importlib.metadata.version("deep_ep")
    except importlib.metadata.PackageNotFoundError:
        return Measured(False, "deep_ep not installed", hint=STAGE)
    try:
        import deep_ep
    except ImportError as e:
        return Measured(False, f"deep_ep {version}: the extension does not load against torch {torch.__version__}: "
                               f"{e}", hint=f"rebuild it for this torch: {STAGE}")
    capability = torch.cuda.get_device_capability()
    found = (f"deep_ep {version}, extension loads against torch {torch.__version__}, "
             f"SM90 features {'on' if deep_ep.Buffer.is_sm90_compiled() else 'off'}, GPU sm_{capability[0]}{capability[1]}")
    if capability != (9, 0):
        return Measured(False, f"{found}: the build holds sm_90 code only",
                        hint="rebuild with TORCH_CUDA_ARCH_LIST for this GPU (device/install-deepep.sh sets 9.0)")
    return Measured(True, found)


def peer_access(spec) -> Measured:
    """Every pair of visible GPUs can access each other's memory (DeepEP opens the other ranks' buffers with
    CUDA IPC and its kernels store into them); the run needs at least EP GPUs on this host."""
    import torch

    count = torch.cuda.device_count()
    ep = spec.layout.ep if spec is not None else None
    if ep is not None and count < ep:
        return Measured(False, f"{count} GPU(s) visible for ep={ep}",
                        hint=f"run on a host with {ep} GPUs (DeepEP without NVSHMEM is intranode only)")
    if count < 2:
        return Measured(None, f"{count} GPU visible: no pair to check (EP > 1 needs several)")
    missing = [(a, b) for a in range(count) for b in range(count)
               if a != b and not torch.cuda.can_device_access_peer(a, b)]
    if missing:
        return Measured(False, f"no peer access for {missing[:8]} of {count} GPUs",
                        hint="use GPUs connected by NVLink (nvidia-smi topo -m), or " + ALLTOALL)
    return Measured(True, f"all {count * (count - 1)} ordered pairs of {count} GPUs")


PLUGIN = PluginInfo(
    summary="deepep: Megatron's flex MoE token dispatcher on DeepEP's intranode kernels (v1.2.x, NVSHMEM off, "
            "sm_90) for expert parallelism of 2, 4 or 8 GPUs of one host",
    provides={"patches": [PATCH]},
    requires=(
        Requirement.cuda_capability((9, 0), reason="DeepEP is built for sm_90 (device/install-deepep.sh)"),
        Requirement.package(DEEPEP, install_hint=STAGE,
                            reason="the flex dispatcher's buffer; no wheel: an nvcc build on the GPU host"),
    ),
    selects={"train.moe_dispatcher": "flex"},
    checks=(
        ShapeCheck("engine", "the megatron engine (the flex dispatcher is Megatron's)", engine, "",
                   when=uses_flex),
        ShapeCheck("expert parallelism", f"ep in {RANKS} (GPUs of one host)", expert_parallel, "",
                   when=flex_on_megatron),
        ShapeCheck("train.dtype", "bfloat16 (DeepEP's intranode combine is built for bf16 only)", dtype, "",
                   when=flex_on_megatron),
        LaunchCheck("DeepEP extension", f"{DEEPEP} whose extension loads against this torch, on sm_90", extension,
                    STAGE, when=flex_on_megatron),
        LaunchCheck("peer access", "peer access between every pair of this host's GPUs, at least ep of them",
                    peer_access, ALLTOALL, when=flex_on_megatron),
    ),
)


@hookimpl
def nam_register_patches(register):
    from nam_plugin_deepep.patch import make_patch

    register(PATCH, make_patch())
