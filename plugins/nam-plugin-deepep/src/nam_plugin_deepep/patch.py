"""Patch-lane entry ``deepep-intranode-buffer``: Megatron-Core's DeepEP buffer on a DeepEP built without NVSHMEM.

The bug (measured on an H200, 2026-11-25, Megatron-Core 0.19.2, DeepEP v1.2.1 built by device/install-deepep.sh):
``megatron.core.transformer.moe.fused_a2a.get_buffer`` sizes the buffer from both of DeepEP's size hints,
NVLink and RDMA, for every group. A DeepEP compiled with ``DISABLE_NVSHMEM`` raises from the RDMA hint
(``'false and "NVSHMEM is disable during compilation"'``, csrc/config.hpp) even for a group of 2, so the flex
dispatcher's first dispatch fails before any token moves. For groups of at most 8 ranks (one host) the RDMA
buffer is unused: DeepEP's own hint is 0 there when NVSHMEM is compiled in, and its buffer refuses RDMA bytes
below 9 ranks outside low-latency mode.

The fix (``apply``): ``fused_a2a.get_buffer`` becomes ``intranode_buffer``: the same NVLink size (the larger
hint of DeepEP's dispatch and combine configs for the group), no RDMA bytes, the same one cached buffer
(``fused_a2a._buffer``) reused while it is big enough and on the same group. A group of more than 8 ranks is
refused: without NVSHMEM there is no internode path. ``revert`` puts Megatron's function back.

``detect()`` is a feature check: Megatron's function is in place, its module has DeepEP, and DeepEP's RDMA
hint refuses (an NVSHMEM build answers it, and the patch is not needed).
"""

from __future__ import annotations

from nam_core.errors import CannotRunHere
from nam_core.patches import Patch

NAME = "deepep-intranode-buffer"  # nam_plugin_deepep.plugin.PATCH
NVL_PEERS = 8
"""DeepEP's ``NUM_MAX_NVL_PEERS``: the most ranks one intranode (NVLink) group holds."""
RETIRE_WHEN = ("a Megatron-Core release whose fused_a2a.get_buffer skips DeepEP's RDMA size hint for intranode "
               "groups, or a DeepEP built with NVSHMEM (the RDMA hint then answers 0 for <= 8 ranks)")
_upstream = {}
"""Megatron's ``get_buffer``, kept while the patch is applied (for ``revert``)."""


def _fused_a2a():
    from megatron.core.transformer.moe import fused_a2a

    return fused_a2a


def rdma_hint_refused(buffer_cls) -> bool:
    """Whether DeepEP (its ``Buffer`` class, as Megatron imported it) raises from its RDMA size hint: a build
    without NVSHMEM. Other errors propagate."""
    config = buffer_cls.get_dispatch_config(2)
    try:
        config.get_rdma_buffer_size_hint(2 * 1024, 2)
    except RuntimeError as e:
        if "NVSHMEM" in str(e):
            return True
        raise
    return False


def intranode_buffer(group, hidden_bytes: int):
    """``fused_a2a.get_buffer`` for an intranode group: DeepEP's buffer with NVLink bytes only."""
    fa = _fused_a2a()
    ranks = group.size()
    if ranks > NVL_PEERS:
        raise CannotRunHere(f"an expert-parallel group of {ranks} ranks: DeepEP built without NVSHMEM moves tokens "
                            f"within one host's NVLink group (at most {NVL_PEERS} GPUs)",
                            hint="--ep 2, 4 or 8, or drop --plugins deepep")
    nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, ranks)
              for config in (fa.Buffer.get_dispatch_config(ranks), fa.Buffer.get_combine_config(ranks)))
    buffer = fa._buffer
    if buffer is None or buffer.group != group or buffer.num_nvl_bytes < nvl:
        buffer = fa._buffer = fa.Buffer(group, nvl, 0)
    return buffer


def detect() -> bool:
    fa = _fused_a2a()
    return fa.get_buffer is not intranode_buffer and getattr(fa, "HAVE_DEEP_EP", False) and rdma_hint_refused(fa.Buffer)


def apply() -> None:
    fa = _fused_a2a()
    if fa.get_buffer is not intranode_buffer:
        _upstream["get_buffer"] = fa.get_buffer
        fa.get_buffer = intranode_buffer


def revert() -> None:
    if "get_buffer" in _upstream:
        _fused_a2a().get_buffer = _upstream.pop("get_buffer")


def make_patch() -> Patch:
    return Patch(
        name=NAME,
        target="deep_ep",
        versions=">=1.2.1,<1.3",
        summary="Megatron's fused_a2a.get_buffer asks DeepEP for an RDMA size that a build without NVSHMEM refuses "
                "(even for 2 ranks); nam sizes the intranode buffer from the NVLink hints only",
        retire_when=RETIRE_WHEN,
        detect=detect,
        apply=apply,
        revert=revert,
    )
