"""The __NAME__ plugin's declaration: what it provides, needs and selects, read by ``nam plugins list`` and
``nam preflight`` without importing any kernel. Requesting it selects ``indexer_backend=__NAME__`` (an explicit
``--set`` wins). The host registers the class named in ``provides`` at activation, so no provider hook is
needed; add hooks (``nam_core.hookspecs``) only for what a declaration cannot say, with heavy imports inside
their bodies. This module stays light (no torch, no GPU library at import)."""

from __future__ import annotations

from nam_core import PluginInfo, Requirement

NAME = "__NAME__"

PLUGIN = PluginInfo(
    summary="__NAME__: say in one line what it offers.",
    provides={"indexer": {NAME: "__MODULE__.strategy:Strategy"}},  # kind -> {name: "module:Class"}
    requires=(),  # e.g. Requirement.cuda_capability((9, 0), reason="..."), Requirement.package("triton>=3.3")
    selects={"indexer_backend": NAME},
)
