"""Every hook nam calls, and nothing else. Pluggy project ``"nam"``, entry-point group ``"nam.plugins"``.

A plugin is a module with a ``PLUGIN = PluginInfo(...)`` object and some ``@hookimpl`` functions. It is
only loaded when its name is requested (``--plugins``, a recipe, ``NAM_PLUGINS``), and only registered when
every requested plugin passes every check (``nam_core.host.PluginHost.activate``).

Hooks come in three groups:

* provider hooks, ``nam_register_<kind>(register)``: offer named implementations; config picks the name.
  Called once per activation, one plugin at a time; a name must be declared in ``PLUGIN.provides``.
* check hooks: ``nam_check_config`` (rules about the run's config) and ``nam_preflight`` (checks that
  launch code on a real device). Both run before anything is registered; a failed check stops activation.
* lifecycle hooks: ``nam_before_step`` / ``nam_after_step`` around every optimizer step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from nam_core.device import DeviceInfo
    from nam_core.registry import Registry
    from nam_core.requirements import Check

PROJECT = "nam"
ENTRY_POINT_GROUP = "nam.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- provider hooks ------------------------------------------------------------------------------


@hookspec
def nam_register_attention_backends(register: "Registry") -> None:
    """Offer MLA/DSA core-attention backends: ``register("sparse-mla", SparseMLA)``.

    The class must implement ``nam56r.backends.AttentionCore``; the model instantiates it with no arguments.
    Selected by ``attention_backend`` in the model config.

    .. versionadded:: 0.1
    """


@hookspec
def nam_register_ssm_mixers(register: "Registry") -> None:
    """Offer Mamba-3 scan implementations: ``register("mamba-ssm", MambaSSMScan)``.

    The class must implement ``nam56r.backends.SSMScan``. Selected by ``ssm_backend``.

    .. versionadded:: 0.1
    """


@hookspec
def nam_register_ce_heads(register: "Registry") -> None:
    """Offer LM-head + cross-entropy implementations (main and MTP heads): ``register("liger", LigerCE)``.

    The class must implement ``nam56r.backends.CEHead``. Selected by ``ce_backend``.

    .. versionadded:: 0.1
    """


@hookspec
def nam_register_indexers(register: "Registry") -> None:
    """Offer DSA top-k indexer strategies: ``register("index-cache", IndexCache)``.

    The class must implement ``nam56r.backends.IndexerStrategy``. Selected by ``indexer``.

    .. versionadded:: 0.1
    """


@hookspec
def nam_register_moe_experts(register: "Registry") -> None:
    """Offer routed-expert implementations for MoE layers: ``register("fp8", FP8Experts)``.

    The class must implement ``nam56r.backends.MoEExperts`` (the router and the shared expert stay in the
    block). Selected by ``moe_backend``.

    .. versionadded:: 0.2
    """


@hookspec
def nam_register_schedules(register: "Registry") -> None:
    """Offer training schedules (how micro-batches' forward and backward passes are ordered).

    Selected by the run's ``schedule`` field; the engine documents the call it makes.

    .. versionadded:: 0.1
    """


@hookspec
def nam_register_patches(register: "Registry") -> None:
    """Offer patch-lane entries: ``register("liger-none-reduction-bwd", Patch(...))``.

    Each value is a ``nam_core.patches.Patch``. After activation every registered patch whose bug is
    present is applied; one that fails to apply stops the run. ``nam patches`` lists them.

    .. versionadded:: 0.1
    """


# --- check hooks ---------------------------------------------------------------------------------


@hookspec
def nam_check_config(config: Any, device: "DeviceInfo") -> "list[Check] | None":
    """Check the run's configuration before anything is registered.

    Called once per activation for each plugin that implements it, with the resolved run config (``None``
    when there is none, e.g. ``nam preflight`` without a recipe) and the device. Return a list of
    ``Check`` (failures included) or None. Example: DualPipeV refuses expert parallelism > 1.

    .. versionadded:: 0.1
    """


@hookspec
def nam_preflight(device: "DeviceInfo", config: Any) -> "list[Check] | None":
    """Checks that launch code: compile and run a tiny kernel, read its shared memory against the cap.

    Called only on a real device (never on a ``--device-profile`` fake, where each implementing plugin
    shows one skipped row instead), after the declarative requirements passed. Return ``Check`` rows.

    .. versionadded:: 0.1
    """


# --- lifecycle hooks -----------------------------------------------------------------------------


@hookspec
def nam_before_step(step: int, run: Any) -> None:
    """Called before optimizer step ``step`` (0-based) begins its forward passes.

    ``run`` is the engine's run object (config, model, optimizer, log). Example: lemyx ends its indexer
    warmup at its configured step here.

    .. versionadded:: 0.1
    """


@hookspec
def nam_after_step(step: int, run: Any, metrics: dict) -> None:
    """Called after optimizer step ``step`` with the metrics that will be logged for it.

    A hook may add keys to ``metrics``.

    .. versionadded:: 0.1
    """
