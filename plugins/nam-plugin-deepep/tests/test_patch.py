"""The patch-lane entry ``deepep-intranode-buffer`` against Megatron-Core's own ``fused_a2a`` module, loaded with a
stand-in DeepEP that answers its size hints as the H200 build did (the NVLink hint a size, the RDMA hint the
``NVSHMEM is disable during compilation`` assertion) or as an NVSHMEM build does (0 for <= 8 ranks)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

from nam_core.errors import CannotRunHere
from nam_plugin_deepep import patch

REFUSAL = "Failed: Assertion error csrc/config.hpp:95 'false and \"NVSHMEM is disable during compilation\"'"
"""What DeepEP v1.2.1 built without NVSHMEM raised from its RDMA hint on the GPU host (2026-11-25)."""


class Config:
    def __init__(self, per_rank: int, nvshmem: bool):
        self.per_rank, self.nvshmem = per_rank, nvshmem

    def get_nvl_buffer_size_hint(self, hidden_bytes, ranks):
        return self.per_rank * ranks + hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes, ranks):
        if not self.nvshmem:
            raise RuntimeError(REFUSAL)
        return 0 if ranks <= 8 else 1 << 20


def stand_in(nvshmem: bool) -> types.ModuleType:
    """A ``deep_ep`` whose Buffer records how it was built; dispatch and combine configs size differently."""
    class Buffer:
        def __init__(self, group, num_nvl_bytes, num_rdma_bytes):
            self.group, self.num_nvl_bytes, self.num_rdma_bytes = group, num_nvl_bytes, num_rdma_bytes

        @staticmethod
        def get_dispatch_config(ranks):
            return Config(1000, nvshmem)

        @staticmethod
        def get_combine_config(ranks):
            return Config(3000, nvshmem)

    deep_ep = types.ModuleType("deep_ep")
    deep_ep.Buffer = Buffer
    utils = types.ModuleType("deep_ep.utils")
    utils.EventHandle = utils.EventOverlap = object
    deep_ep.utils = utils
    return deep_ep


class Group:
    def __init__(self, ranks):
        self.ranks = ranks

    def size(self):
        return self.ranks


@pytest.fixture(params=[False, True], ids=["nvshmem-off", "nvshmem-on"])
def megatron(request, monkeypatch):
    """(Megatron's fused_a2a, loaded afresh against the stand-in DeepEP, and whether NVSHMEM is on)."""
    spec = importlib.util.find_spec("megatron.core.transformer.moe.fused_a2a")
    if spec is None:
        pytest.skip("megatron-core is not installed")
    deep_ep = stand_in(request.param)
    monkeypatch.setitem(sys.modules, "deep_ep", deep_ep)
    monkeypatch.setitem(sys.modules, "deep_ep.utils", deep_ep.utils)
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("fused_a2a_under_test",
                                                                                     spec.origin))
    module.__spec__.loader.exec_module(module)
    assert module.HAVE_DEEP_EP and module.Buffer is deep_ep.Buffer
    monkeypatch.setattr(patch, "_fused_a2a", lambda: module)
    yield module, request.param
    patch.revert()


def test_megatron_s_buffer_fails_without_nvshmem_and_the_patch_sizes_it_from_nvlink_alone(megatron):
    fa, nvshmem = megatron
    upstream = fa.get_buffer
    if nvshmem:
        assert not patch.detect()  # an NVSHMEM build answers the RDMA hint: nothing to fix
        assert upstream(Group(2), 4096).num_rdma_bytes == 0
        return
    with pytest.raises(RuntimeError, match="NVSHMEM is disable during compilation"):
        upstream(Group(2), 4096)
    assert patch.detect()
    patch.apply()
    patch.apply()  # idempotent: revert still finds Megatron's function
    assert fa.get_buffer is patch.intranode_buffer and not patch.detect()
    group = Group(2)
    buf = fa.get_buffer(group, 4096)
    assert (buf.group, buf.num_nvl_bytes, buf.num_rdma_bytes) == (group, 3000 * 2 + 4096, 0)  # combine's is larger
    assert fa.get_buffer(group, 1024) is buf  # big enough: reused, as Megatron reuses its one buffer
    bigger = fa.get_buffer(group, 8192)
    assert bigger is not buf and bigger.num_nvl_bytes == 3000 * 2 + 8192 and fa._buffer is bigger
    other = Group(4)
    assert fa.get_buffer(other, 8192).group is other
    patch.revert()
    assert fa.get_buffer is upstream and patch.detect()


def test_a_group_beyond_one_host_is_refused(megatron):
    fa, _ = megatron
    patch.apply()
    with pytest.raises(CannotRunHere, match=r"group of 16 ranks: DeepEP built without NVSHMEM .*at most 8 GPUs"):
        fa.get_buffer(Group(16), 4096)


def test_the_patch_is_registered_for_deep_ep_1_2():
    import nam_plugin_deepep.plugin as plugin

    registered = {}
    plugin.nam_register_patches(lambda name, entry: registered.setdefault(name, entry))
    [(name, p)] = registered.items()
    assert name == p.name == plugin.PATCH and plugin.PLUGIN.provides == {"patches": [plugin.PATCH]}
    assert (p.name, p.target, p.versions) == ("deepep-intranode-buffer", "deep_ep", ">=1.2.1,<1.3")
    assert p.revert is patch.revert and p.apply is patch.apply
