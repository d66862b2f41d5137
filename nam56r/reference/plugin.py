"""The built-in plugin ``reference``: NAM56R's pure-PyTorch backends, the oracle for every kernel.

It runs anywhere torch runs and needs nothing else. Like every plugin it is active only when named (the
``nam56r-tiny`` recipe names it); GPU recipes name the kernel plugins instead, and a user who wants the
reference path on a GPU names it too (e.g. ``--set attention_backend=reference --plugins reference``).
"""

from __future__ import annotations

from nam_core import PluginInfo, hookimpl

PLUGIN = PluginInfo(
    summary="pure-PyTorch NAM56R backends (exact on CPU; the reference every kernel is tested against)",
    provides={
        "ssm_mixers": ["reference"],
        "attention_backends": ["reference"],
        "ce_heads": ["reference"],
        "indexers": ["full"],
    },
)


@hookimpl
def nam_register_ssm_mixers(register):
    from nam56r.reference.mamba3 import ReferenceSSMScan

    register("reference", ReferenceSSMScan)


@hookimpl
def nam_register_attention_backends(register):
    from nam56r.reference.attention import ReferenceAttention

    register("reference", ReferenceAttention)


@hookimpl
def nam_register_ce_heads(register):
    from nam56r.reference.ce import ReferenceCEHead

    register("reference", ReferenceCEHead)


@hookimpl
def nam_register_indexers(register):
    from nam56r.blocks.indexer import FullIndexer

    register("full", FullIndexer)


def reference_backends():
    """The reference backends without a plugin host (tests, meta-device counting)."""
    from nam56r.blocks.indexer import FullIndexer
    from nam56r.model import Backends
    from nam56r.reference.attention import ReferenceAttention
    from nam56r.reference.ce import ReferenceCEHead
    from nam56r.reference.mamba3 import ReferenceSSMScan

    return Backends(ssm=ReferenceSSMScan(), attention=ReferenceAttention(), ce=ReferenceCEHead(),
                    indexer=FullIndexer())
