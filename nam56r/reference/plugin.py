"""The built-in plugin ``reference``: NAM56R's pure-PyTorch backends, the oracle for every kernel.

It runs anywhere torch runs and needs nothing else. It is essential: every run resolved by ``nam56r.run`` has
it active, so a config field set to ``reference`` (``--set attention_backend=reference``) always finds its
provider. GPU recipes select kernel plugins for the hot kinds; the reference stays the implementation of the
kinds nobody else was chosen for.
"""

from __future__ import annotations

from nam_core import PluginInfo, hookimpl

PLUGIN = PluginInfo(
    summary="pure-PyTorch NAM56R backends (exact on CPU; the reference every kernel is tested against)",
    provides={"ssm": ["reference"], "attention": ["reference"], "indexer_kernels": ["reference"],
              "indexer": ["full"], "ce": ["reference"], "moe": ["reference"]},
)


@hookimpl
def nam_check_config(config, device):
    """No unfused DSA on a GPU: the reference attention core there only when the user named it.

    On CUDA the reference path holds every DSA layer's ``[b, h, s, s]`` scores (or gathers top-k rows head by
    head), i.e. a silent 10-20x slowdown; a GPU run must name a kernel plugin or choose the reference by name.
    """
    from nam_core import Check
    from nam_core.requirements import FAIL, PASS

    if config.train.device != "cuda" or config.model.attention_backend != "reference":
        return []
    from nam56r.pattern import resolve

    model = config.model
    counts = resolve(model.pattern, model.num_layers, model.mla_attention_ranks).counts()
    if not counts["dsa"]:
        return []
    needed = "a fused attention backend for DSA on CUDA, or attention_backend=reference set by name"
    if "attention_backend" in config.explicit:
        return [Check("reference", "DSA on CUDA", PASS, needed,
                      f"attention_backend=reference, chosen by you: {counts['dsa']} DSA layers run unfused")]
    providers = _attention_providers()
    fast = (f"add --plugins {providers[0]}" if providers else
            "install a plugin that provides an attention backend (`nam plugins list` shows what each provides)")
    return [Check("reference", "DSA on CUDA", FAIL, needed,
                  f"{counts['dsa']} DSA layers on the unfused reference attention (the recipe's default)",
                  hint=f"{fast}, or choose the slow path by name: --set attention_backend=reference")]


def _attention_providers() -> list[str]:
    """Installed plugins whose declaration provides an attention backend (the host reads their ``PLUGIN``)."""
    from nam_core.host import PluginHost

    host = PluginHost()
    return [n for n in host.installed if n != "reference" and (info := host.info(n)) is not None
            and info.provides.get("attention")]


@hookimpl
def nam_register_ssm_backends(register):
    from nam56r.reference.mamba3 import ReferenceSSMScan

    register("reference", ReferenceSSMScan)


@hookimpl
def nam_register_attention_backends(register):
    from nam56r.reference.attention import ReferenceAttention

    register("reference", ReferenceAttention)


@hookimpl
def nam_register_indexer_kernels_backends(register):
    from nam56r.reference.attention import ReferenceIndexerKernels

    register("reference", ReferenceIndexerKernels)


@hookimpl
def nam_register_ce_backends(register):
    from nam56r.reference.ce import ReferenceCEHead

    register("reference", ReferenceCEHead)


@hookimpl
def nam_register_moe_backends(register):
    from nam56r.reference.moe import ReferenceExperts

    register("reference", ReferenceExperts)


@hookimpl
def nam_register_indexer_backends(register):
    from nam56r.blocks.indexer import FullIndexer

    register("full", FullIndexer)

