"""Entry point of the dualpipev plugin: what it declares and the hooks it implements.

Requesting the plugin does not select the schedule: ``PluginInfo.selects`` sets model-config fields only
(``nam56r.recipes.apply_plugin_selections`` refuses any other), and the schedule is ``train.schedule``. The
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
    from nam_plugin_dualpipev.schedule import min_microbatches

    train = config.train
    checks = [
        _row("engine", train.engine == "megatron", "the megatron engine (pipeline ranks under torchrun)",
             f"engine={train.engine}", f"{ENABLE}, or drop --plugins {NAME}"),
        _row("pipeline size", train.pp >= 2, "pp >= 2 (the V folds 2 x pp stages over pp ranks)",
             f"pp={train.pp}: nothing to pipeline" if train.pp < 2 else f"pp={train.pp}",
             f"use --pp 2 or more, or drop --plugins {NAME}"),
        _row("expert parallelism", train.ep == 1,
             "ep = 1 (an expert all-to-all desynchronises across the V-shape's rank pairs)", f"ep={train.ep}",
             f"use --ep 1, or drop --plugins {NAME}"),
    ]
    if train.pp >= 2:
        need = min_microbatches(train.pp)
        checks.append(_row("micro-batches", train.grad_accum >= need,
                           f"train.grad_accum >= 2 x pp = {need} (rank 0 starts {need - 1} forwards before its "
                           "first loss returns round the V)", f"grad_accum={train.grad_accum}",
                           f"--set train.grad_accum={need}"))
        layers = config.model.num_layers
        checks.append(_row("V stages", layers % (2 * train.pp) == 0,
                           f"2 x pp = {2 * train.pp} equal stages (two chunks per pipeline rank) dividing num_layers",
                           f"num_layers={layers}", f"choose --pp so that 2 x pp divides {layers}"))
    return checks


@hookimpl
def nam_register_schedules(register):
    from nam_plugin_dualpipev.engine import DualPipeV

    register(NAME, DualPipeV)
