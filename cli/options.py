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


def resolve_device(profile: str | None):
    from nam_core.device import DeviceInfo

    return DeviceInfo.profile(profile) if profile else DeviceInfo.probe()
