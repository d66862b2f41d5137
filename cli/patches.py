"""``nam patches``: each upstream fix nam carries, and its state on this machine."""

from __future__ import annotations

from typing import Annotated

import typer

from nam_cli.console import err, out, print_json
from nam_cli.options import JsonOpt, PluginsOpt
from nam_core.device import DeviceInfo
from nam_core.host import PluginHost, requested_plugins
from nam_core.patches import NOT_APPLICABLE, NOT_INSTALLED

app = typer.Typer(help="The patch lane: upstream fixes, their state here, their reproducers.",
                  invoke_without_command=True)

VerifyOpt = Annotated[bool, typer.Option("--verify", help="Run each reproducer of a patch whose target is installed "
                                                         "in a version it applies to (GPU ones only on a GPU); exit 1 "
                                                         "if one raises.")]


@app.callback(invoke_without_command=True)
def patches(plugins: PluginsOpt = None, verify: VerifyOpt = False, json_out: JsonOpt = False) -> None:
    """List patches of the named plugins (default: every installed plugin, and the built-in ones of the megatron
    engine and NAM56R's Megatron build) with their state here."""
    host = PluginHost()
    requested = requested_plugins(plugins)
    names = requested or list(host.installed)
    device = DeviceInfo.probe()
    entries = [] if requested else _builtin()
    for name in names:
        entries += host.declared_patches(name)
    rows = []
    for entry in entries:
        patch = entry.impl
        state, detail = patch.state()
        row = {"name": patch.name, "plugin": entry.plugin, "target": patch.target, "versions": patch.versions,
               "state": state, "detail": detail, "retire_when": patch.retire_when}
        if verify:
            row["verify"] = _verify(patch, state, device)
        rows.append(row)
    if json_out:
        print_json({"patches": rows})
    else:
        _print(rows, verify)
    failed = [r["name"] for r in rows if verify and r["verify"].startswith("ERROR")]
    if failed:
        err.print(f"error: the reproducer of {', '.join(failed)} raised (its verify line says what)", markup=False)
        raise typer.Exit(code=1)


def _builtin() -> list:
    """The lanes nam carries itself (applied by the megatron engine for a run, not by a plugin)."""
    from nam56r.megatron import patches as model_patches
    from nam_core.engine.megatron import patches as engine_patches

    return [*engine_patches.lane(), *model_patches.lane()]


def _verify(patch, state: str, device) -> str:
    """The reproducer's answer, or why it did not run: a target that is not installed, or installed in a
    version the patch does not apply to, has nothing to reproduce on (its code is absent or other)."""
    if patch.reproduce is None:
        return "no reproducer"
    if state in (NOT_INSTALLED, NOT_APPLICABLE):
        return f"skipped: {state}"
    if patch.needs_gpu and not device.is_cuda:
        return "skipped: needs a GPU"
    try:
        return patch.reproduce()
    except Exception as e:  # reported as this patch's verification result, and the command exits 1
        return f"ERROR: {type(e).__name__}: {e}"


def _print(rows, verify: bool) -> None:
    if not rows:
        out.print("no patches registered by the selected plugins")
        return
    # One block per patch, not a table: its name and its retire condition are long, and a table of six columns
    # at 80 columns would fold them; these lines are never wrapped (the terminal wraps them, whole).
    out.print("patch lane")
    for r in rows:
        out.print(f"{r['name']}  ({r['plugin']}; {r['target']} {r['versions']}): {r['state']}", markup=False)
        out.print(f"  {r['detail']}", markup=False)
        out.print(f"  retire when: {r['retire_when']}", markup=False)
        if verify:
            out.print(f"  verify: {r['verify']}", markup=False)
