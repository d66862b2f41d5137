"""``nam preflight``: run exactly the activation that training runs, and print every check."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from nam_cli.console import STATUS_STYLE, out, print_json
from nam_cli.options import DeviceProfileOpt, JsonOpt, PluginsOpt, resolve_device
from nam_core.host import PluginHost, requested_plugins

RecipeOpt = Annotated[Optional[str], typer.Option("--recipe", help="Also run config checks against this recipe.")]
EngineOpt = Annotated[str, typer.Option("--engine", help="local, or megatron: also check what the megatron engine "
                      "needs here (megatron-core >= 0.19, CUDA, torch.distributed, psutil; DeepEP for the flex "
                      "dispatcher).")]


def preflight(
    plugins: PluginsOpt = None, device_profile: DeviceProfileOpt = None, recipe: RecipeOpt = None,
    engine: EngineOpt = "local", json_out: JsonOpt = False,
) -> None:
    """Check whether the named plugins (and the engine) can run here: exit 0 if every check passes, 3 otherwise."""
    from nam_core.errors import ConfigError

    if engine not in ("local", "megatron"):
        raise ConfigError(f"--engine {engine!r}: expected local or megatron", hint="--engine megatron")
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
    engine_rows = []
    if engine == "megatron":  # facts of this process, never of a --device-profile fake
        from nam_core.engine.megatron import runtime_checks, runtime_facts

        dispatcher = config.train.moe_dispatcher if config is not None else "alltoall"
        engine_rows = runtime_checks(runtime_facts(), dispatcher=dispatcher, launched=False)
    ok = ev.ok and all(c.ok for c in engine_rows)
    if json_out:
        print_json({"device": device.to_dict(), "plugins": names, "ok": ok, "selected_by_plugins": notes,
                    "checks": [c.to_dict() for c in ev.checks], "engine": engine,
                    "engine_checks": [c.to_dict() for c in engine_rows]})
    else:
        _print(device, names, ev)
        if engine_rows:
            _print_rows("engine: megatron", engine_rows)
        for line in notes:
            out.print(f"config: {line}")
    if not ok:
        raise typer.Exit(code=3)


def _print_rows(title: str, rows) -> None:
    table = Table(title=title)
    for col in ("check", "status", "needed", "found", "hint"):
        table.add_column(col)
    for c in rows:
        table.add_row(c.name, STATUS_STYLE[c.status], c.needed, c.found, c.hint or "")
    out.print(table)
    failed = [c for c in rows if not c.ok]
    out.print("[green]megatron engine ready[/green]" if not failed
              else f"[red]megatron engine cannot run here[/red]: {', '.join(c.name for c in failed)}")


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
