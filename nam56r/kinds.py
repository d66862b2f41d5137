"""NAM56R's backend kinds: the one table of what a block asks a plugin for.

Each entry names a kind once; the rest follows from it (``nam_core.kinds.Kind.backend``):

=================  ==================================  =========================  ===============================
kind (registry,    provider hook                       config field               protocol (nam56r.backends)
``backends.<k>``)
=================  ==================================  =========================  ===============================
ssm                nam_register_ssm_backends           ssm_backend                SSMScan
attention          nam_register_attention_backends     attention_backend          AttentionCore
indexer_kernels    nam_register_indexer_kernels_...    indexer_kernels_backend    IndexerKernels
indexer            nam_register_indexer_backends       indexer_backend            IndexerStrategy
ce                 nam_register_ce_backends            ce_backend                 CEHead
moe                nam_register_moe_backends           moe_backend                MoEExperts
=================  ==================================  =========================  ===============================

The host makes a registry and a provider hook per entry (nam-train publishes this table under the entry
point group ``nam.kinds``); ``nam56r.model.Backends`` has one attribute per entry; ``NAM56RConfig`` one field
per entry (tests/test_kinds.py checks both). This module imports nothing heavy: plugin declarations read it.
"""

from __future__ import annotations

from nam_core.kinds import Kind

BACKEND_KINDS: tuple[Kind, ...] = (
    Kind.backend("ssm", summary="the Mamba-3 chunked scan", protocol="nam56r.backends.SSMScan"),
    Kind.backend("attention", summary="MLA/DSA core attention (dense and top-k sparse)",
                 protocol="nam56r.backends.AttentionCore"),
    Kind.backend("indexer_kernels", summary="the DSA lightning indexer's scores and its sparse KL teacher",
                 protocol="nam56r.backends.IndexerKernels"),
    Kind.backend("indexer", summary="DSA top-k selection strategies", protocol="nam56r.backends.IndexerStrategy",
                 default="full"),
    Kind.backend("ce", summary="LM head + cross-entropy (main and MTP heads)", protocol="nam56r.backends.CEHead"),
    Kind.backend("moe", summary="the routed experts of MoE layers", protocol="nam56r.backends.MoEExperts"),
)

FIELD_ALIASES = {"indexer": "indexer_backend"}
"""Config fields renamed for one name per kind; ``--set indexer=...`` still works."""


def kind(name: str) -> Kind:
    """The table entry named ``name``."""
    for k in BACKEND_KINDS:
        if k.name == name:
            return k
    raise KeyError(f"no backend kind {name!r}; known: {', '.join(k.name for k in BACKEND_KINDS)}")
