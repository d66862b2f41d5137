"""Option types shared by several commands, so each flag is spelled and documented once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

PluginsOpt = Annotated[
    Optional[str],
    typer.Option("--plugins", "-p", help="Comma-separated plugin names to activate (also NAM_PLUGINS)."),
]
DeviceProfileOpt = Annotated[
    Optional[str],
    typer.Option(
        "--device-profile",
        help="Evaluate against a fake device (cpu, h100, h200, gb10) instead of probing this machine.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE", help="KEY=VALUE override: a model field, "
                   "train.<field>, or <plugin>.<option>. Repeatable.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu or cuda (default: the recipe's).")]
NprocOpt = Annotated[Optional[int], typer.Option("--nproc", help="megatron: start torchrun with this many "
                     "processes on this host (instead of launching under torchrun yourself); 1 trains in this "
                     "process, as torchrun's one worker.")]
TpOpt = Annotated[Optional[int], typer.Option("--tp", help="megatron: tensor-parallel size (= --set train.tp=N).")]
PpOpt = Annotated[Optional[int], typer.Option("--pp", help="megatron: pipeline-parallel size (= --set train.pp=N).")]
EpOpt = Annotated[Optional[int], typer.Option("--ep", help="megatron: expert-parallel size, dividing the "
                  "data-parallel size and the expert count (= --set train.ep=N).")]


def resolve_device(profile: str | None):
    from nam_core.device import DeviceInfo

    return DeviceInfo.profile(profile) if profile else DeviceInfo.probe()
