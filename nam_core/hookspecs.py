"""Every hook nam calls, and nothing else. Pluggy project ``"nam"``, entry-point group ``"nam.plugins"``.

A plugin is a module with a ``PLUGIN = PluginInfo(...)`` object and some ``@hookimpl`` functions. It is
only loaded when its name is requested (``--plugins``, a recipe, ``NAM_PLUGINS``), and only registered when
every requested plugin passes every check (``nam_core.host.PluginHost.activate``).

Hooks come in four groups:

* provider hooks, ``nam_register_<...>(register)``: offer named implementations; config picks the name.
  Called once per activation, one plugin at a time; a name must be declared in ``PLUGIN.provides``. The
  core's two are below; the model's backend kinds add one each, declared in the model's kind table and
  never here (nam56r/kinds.py: ``nam_register_ssm_backends``, ``nam_register_attention_backends``,
  ``nam_register_indexer_kernels_backends``, ``nam_register_indexer_backends``, ``nam_register_ce_backends``,
  ``nam_register_moe_backends``; ``nam_core.kinds.provider_hookspecs`` makes their specs).
* check hooks: ``nam_check_config`` (rules about the run) and ``nam_preflight`` (checks that launch code on
  a real device). Both receive the typed ``nam_core.run.RunSpec`` and run before anything is registered; a
  failed check stops activation. The host itself writes what every plugin would repeat: the selected /
  "active but unused" row, ``train.device``/``train.dtype`` against ``PluginInfo.train_device``/
  ``train_dtypes``, the parsing of ``PluginInfo.options``, the rows of ``PluginInfo.checks`` (shape and
  launch checks, asked only when the run uses the plugin's backend: ``nam_core.checks``), and a FAIL row for a
  hook that raises. These hooks are for the rules a declaration cannot state.
* build hooks: ``nam_transform_model``, once per model (chunk) after the engine built it and before it
  builds the optimizer, in both engines.
* lifecycle hooks: ``nam_before_step`` / ``nam_after_step`` around every optimizer step, with a
  ``nam_core.run.StepContext`` that both engines build, and ``nam_run_report`` once after the last step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch

    from nam_core.device import DeviceInfo
    from nam_core.registry import Registry
    from nam_core.requirements import Check
    from nam_core.run import RunSpec, StepContext

PROJECT = "nam"
ENTRY_POINT_GROUP = "nam.plugins"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- provider hooks ------------------------------------------------------------------------------


@hookspec
def nam_register_schedules(register: "Registry") -> None:
    """Offer training schedules (how micro-batches' forward and backward passes are ordered).

    Selected by the run's ``schedule`` field; the engine documents the call it makes.

    .. versionadded:: 0.1
    """


@hookspec
def nam_register_patches(register: "Registry") -> None:
    """Offer patch-lane entries: ``register("<library>-<bug>", Patch(...))``.

    Each value is a ``nam_core.patches.Patch``. After activation every registered patch whose bug is
    present is applied; one that fails to apply stops the run. ``nam patches`` lists them.

    .. versionadded:: 0.1
    """


# --- check hooks ---------------------------------------------------------------------------------


@hookspec
def nam_check_config(config: "RunSpec", device: "DeviceInfo") -> "list[Check] | None":
    """Check the run before anything is registered.

    Called once per activation for each plugin that implements it, and only when there is a run (``nam
    preflight`` without ``--recipe`` judges the device alone): ``config`` is the resolved ``RunSpec`` (model
    and train config, engine, layout, the plugin's parsed options in ``config.options[<plugin>]``), ``device``
    the device it runs on. Return a list of ``Check`` (failures included) or None. Example: a pipeline
    schedule refuses a layout it cannot run.

    .. versionchanged:: 0.2 ``config`` is a ``RunSpec``; never None.
    .. versionadded:: 0.1
    """


@hookspec
def nam_preflight(device: "DeviceInfo", config: "RunSpec | None") -> "list[Check] | None":
    """Checks that launch code: compile and run a tiny kernel, read its shared memory against the cap.

    Called only on a real device (never on a ``--device-profile`` fake, where each implementing plugin
    shows one skipped row instead), after the declarative requirements and the config checks passed.
    ``config`` is the run's ``RunSpec``, or None for ``nam preflight`` without a run (then check the model's
    default widths). Return ``Check`` rows; a hook that raises is a FAIL row with the exception.

    .. versionchanged:: 0.2 ``config`` is a ``RunSpec``.
    .. versionadded:: 0.1
    """


# --- build hooks ---------------------------------------------------------------------------------


@hookspec
def nam_transform_model(model: "torch.nn.Module", spec: "RunSpec") -> "str | None":
    """Change the built model in place before the optimizer sees its parameters (e.g. swap ``nn.Linear``
    modules for FP8 ones).

    Called by both engines once per model after it is built and cast to ``train.dtype``, before the optimizer
    (and, on the megatron engine, once per model chunk, inside Megatron's ``Float16Module`` and before its DDP
    wrapper). ``spec`` is the activated run. A transform must keep every parameter object and its name (the
    optimizer, the checkpoint and Megatron's grad buffers hold them), and must not depend on anything but the
    model and ``spec``. Return one line saying what it changed (the engine writes it to the run log), or None
    when it changed nothing.

    .. versionadded:: 0.3
    """


# --- lifecycle hooks -----------------------------------------------------------------------------


@hookspec
def nam_before_step(step: int, run: "StepContext") -> None:
    """Called before optimizer step ``step`` (0-based) begins its forward passes.

    ``run`` is the engine's ``StepContext``: ``run.spec`` (the RunSpec), ``run.backend(kind)`` /
    ``run.find(kind, cls)`` (the backend objects, through wrappers), ``run.parameters()`` (the trainable
    parameters by name), ``run.note(line)`` (the run log). Example: an indexer strategy ends its warm-up here.

    .. versionchanged:: 0.2 ``run`` is a ``StepContext``.
    .. versionadded:: 0.1
    """


@hookspec
def nam_after_step(step: int, run: "StepContext", metrics: dict) -> None:
    """Called after optimizer step ``step`` with the ``StepContext`` and the metrics that will be logged.

    A hook may add keys to ``metrics``.

    .. versionadded:: 0.1
    """


@hookspec
def nam_run_report(run: "StepContext") -> "str | None":
    """Called once when a run has trained its last step (both engines, every rank; rank 0's lines go into the
    summary), with the ``StepContext`` of the step it stopped at (``run.step``).

    Return one line saying what the plugin did in this run, from what it counted while it ran (not from what
    its configuration promises): a plugin whose feature never ran says so ("did nothing: ...", and why) and
    claims no saving. None: nothing to report (the run did not use the plugin's backends). ``nam train`` prints
    the lines after its summary and writes them to ``summary.json`` (``plugin_report``).

    .. versionadded:: 0.4
    """
