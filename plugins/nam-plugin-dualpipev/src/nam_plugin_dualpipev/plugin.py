"""Entry point of the dualpipev plugin: what it declares (its layout rows among it) and the hook that registers
the schedule.

Requesting the plugin does not select the schedule (``train.schedule``; the plugin declares no
``PluginInfo.selects``). The user sets it: ``--set train.schedule=dualpipev``; while it is not set, the host
shows the plugin as active but unused (the kind ``schedules`` is picked by ``train.schedule``).

Keep this module light: torch and the executor are imported inside function bodies, so ``nam plugins list``
reads ``PLUGIN`` without them.
"""

from __future__ import annotations

from nam_core import PluginInfo, hookimpl
from nam_core.checks import Measured, ShapeCheck

NAME = "dualpipev"
ENABLE = f"nam train --engine megatron --nproc N --pp N --plugins {NAME} --set train.schedule={NAME}"


def on_megatron(spec) -> bool:
    return spec.train.engine == "megatron"


def off_megatron(spec) -> bool:
    return not on_megatron(spec)


def engine(spec) -> tuple[bool, str]:
    return False, f"engine={spec.train.engine}"


def layout(spec) -> Measured:
    """The run against the V's layout rules, which ``DualPipeV.check_layout`` states once (the megatron engine
    calls it too)."""
    from nam_core.errors import ConfigError
    from nam_plugin_dualpipev.engine import DualPipeV

    train = spec.train
    found = f"pp={train.pp}, ep={train.ep}, grad_accum={train.grad_accum}"
    try:
        DualPipeV().check_layout(tp=train.tp, pp=train.pp, ep=train.ep, num_microbatches=train.grad_accum)
    except ConfigError as e:
        return Measured(False, f"{found}: {e.message}", hint=f"{e.hint}, or drop --plugins {NAME}")
    return Measured(True, found)


def layout_runs(spec) -> bool:
    return on_megatron(spec) and layout(spec).ok


def stages(spec) -> Measured:
    """The stages the V needs from the model: two chunks per pipeline rank, equal ones."""
    layers, pp = spec.model.num_layers, spec.train.pp
    return Measured(layers % (2 * pp) == 0, f"num_layers={layers}",
                    f"2 x pp = {2 * pp} equal stages (two chunks per pipeline rank) dividing num_layers")


PLUGIN = PluginInfo(
    summary="dualpipev: DualPipeV pipeline schedule (DeepSeek), two V-shaped chunks per pipeline rank, "
            "forwards and backwards of different micro-batches interleaved; pure torch.distributed",
    provides={"schedules": [NAME]},
    requires=(),  # point-to-point through torch.distributed (gloo or NCCL); the megatron engine checks CUDA
    # Asked whether or not train.schedule names it: requested on a layout it cannot run, it says so at once.
    checks=(
        ShapeCheck("engine", "the megatron engine (pipeline ranks under torchrun)", engine,
                   f"{ENABLE}, or drop --plugins {NAME}", when=off_megatron),
        ShapeCheck("layout", "a layout the V runs (DualPipeV.check_layout: pp >= 2, ep = 1, train.grad_accum >= "
                   "2 x pp)", layout, "", when=on_megatron),
        ShapeCheck("V stages", "2 x pp equal stages dividing num_layers", stages,
                   lambda spec: f"choose --pp so that 2 x pp divides {spec.model.num_layers}", when=layout_runs),
    ),
)


@hookimpl
def nam_register_schedules(register):
    from nam_plugin_dualpipev.engine import DualPipeV

    register(NAME, DualPipeV)
