"""Entry point of the dualpipev plugin: what it declares and the hooks it implements.

Requesting the plugin does not select the schedule: ``PluginInfo.selects`` sets model-config fields only
(``nam_core.selection.select`` refuses any other), and the schedule is ``train.schedule``. The
user sets it: ``--set train.schedule=dualpipev``; while it is not set, the host shows the plugin as active
but unused (the kind ``schedules`` is picked by ``train.schedule``).

Keep this module light: torch and the executor are imported inside hook bodies, so ``nam plugins list``
reads ``PLUGIN`` without them.
"""

from __future__ import annotations

from nam_core import Check, PluginInfo, hookimpl
from nam_core.requirements import FAIL, PASS

NAME = "dualpipev"
ENABLE = f"nam train --engine megatron --nproc N --pp N --plugins {NAME} --set train.schedule={NAME}"

PLUGIN = PluginInfo(
    summary="dualpipev: DualPipeV pipeline schedule (DeepSeek), two V-shaped chunks per pipeline rank, "
            "forwards and backwards of different micro-batches interleaved; pure torch.distributed",
    provides={"schedules": [NAME]},
    requires=(),  # point-to-point through torch.distributed (gloo or NCCL); the megatron engine checks CUDA
)


def _row(name: str, ok: bool, needed: str, found: str, hint: str) -> Check:
    return Check(NAME, name, PASS if ok else FAIL, needed, found, None if ok else hint)


@hookimpl
def nam_check_config(config, device):
    """The run against the V's layout rules, which ``DualPipeV.check_layout`` states once (the megatron engine
    calls it too), and the stages the V needs from the model."""
    from nam_core.errors import ConfigError
    from nam_plugin_dualpipev.engine import DualPipeV

    train = config.train
    if train.engine != "megatron":
        return [_row("engine", False, "the megatron engine (pipeline ranks under torchrun)", f"engine={train.engine}",
                     f"{ENABLE}, or drop --plugins {NAME}")]
    needed = "a layout the V runs (DualPipeV.check_layout: pp >= 2, ep = 1, train.grad_accum >= 2 x pp)"
    found = f"pp={train.pp}, ep={train.ep}, grad_accum={train.grad_accum}"
    try:
        DualPipeV().check_layout(tp=train.tp, pp=train.pp, ep=train.ep, num_microbatches=train.grad_accum)
    except ConfigError as e:
        return [_row("layout", False, needed, f"{found}: {e.message}", f"{e.hint}, or drop --plugins {NAME}")]
    layers = config.model.num_layers
    return [_row("layout", True, needed, found, ""),
            _row("V stages", layers % (2 * train.pp) == 0,
                 f"2 x pp = {2 * train.pp} equal stages (two chunks per pipeline rank) dividing num_layers",
                 f"num_layers={layers}", f"choose --pp so that 2 x pp divides {layers}")]


@hookimpl
def nam_register_schedules(register):
    from nam_plugin_dualpipev.engine import DualPipeV

    register(NAME, DualPipeV)
