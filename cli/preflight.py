"""``nam preflight``: run exactly the activation that training runs, and print every check."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from nam_cli.console import STATUS_STYLE, out, print_json
from nam_cli.options import DeviceProfileOpt, JsonOpt, PluginsOpt, resolve_device
from nam_core.host import PluginHost, requested_plugins

RecipeOpt = Annotated[Optional[str], typer.Option("--recipe", help="Also run config checks against this recipe.")]


def preflight(
    plugins: PluginsOpt = None, device_profile: DeviceProfileOpt = None, recipe: RecipeOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Check whether the named plugins can run here: exit 0 if every check passes, 3 otherwise."""
    device = resolve_device(device_profile)
    config, recipe_plugins = None, []
    if recipe:
        from nam56r.recipes import get_recipe

        config = get_recipe(recipe)
        recipe_plugins = config.plugins
    names = requested_plugins(recipe_plugins, plugins)
    host = PluginHost()
    if config is not None:
        from nam56r.recipes import apply_plugin_selections

        infos = {n: info for n in names if n in host.installed and (info := host.info(n)) is not None}
        config = apply_plugin_selections(config, infos)
    ev = host.evaluate(names, device, config)
    notes = list(config.notes) if config is not None else []
    if json_out:
        print_json({"device": device.to_dict(), "plugins": names, "ok": ev.ok, "selected_by_plugins": notes,
                    "checks": [c.to_dict() for c in ev.checks]})
    else:
        _print(device, names, ev)
        for line in notes:
            out.print(f"config: {line}")
    if not ev.ok:
        raise typer.Exit(code=3)


def _print(device, names, ev) -> None:
    facts = Table(title="device", show_header=False)
    facts.add_column("fact")
    facts.add_column("value")
    for key, value in device.to_dict().items():
        if value not in (None, ""):
            facts.add_row(key, f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value))
    out.print(facts)
    if not names:
        out.print("no plugins requested (--plugins a,b or NAM_PLUGINS)")
        return
    table = Table(title=f"preflight: {', '.join(names)}")
    for col in ("plugin", "check", "status", "needed", "found", "hint"):
        table.add_column(col)
    for c in ev.checks:
        table.add_row(c.plugin, c.name, STATUS_STYLE[c.status], c.needed, c.found, c.hint or "")
    out.print(table)
    n_fail = len(ev.failures)
    out.print("[green]ready[/green]: every check passed" if ev.ok
              else f"[red]cannot run here[/red]: {n_fail} check{'s' if n_fail != 1 else ''} failed")
