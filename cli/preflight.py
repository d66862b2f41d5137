"""``nam preflight``: run exactly the activation that training runs, and print every check."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from nam_cli.console import STATUS_STYLE, out, print_hints, print_json, table
from nam_cli.options import (
    DeviceOpt, DeviceProfileOpt, EpOpt, JsonOpt, NprocOpt, PluginsOpt, PpOpt, SetOpt, TpOpt, resolve_device,
)
from nam_core.errors import CannotRunHere, PluginActivationError
from nam_core.host import PluginHost, requested_plugins

RecipeOpt = Annotated[Optional[str], typer.Option("--recipe", "-r", help="Judge this run exactly as `nam train` "
                      "would (with --set, --engine, the layout flags); without it and them, the device alone.")]
EngineOpt = Annotated[str, typer.Option("--engine", help="local, or megatron: also check what the megatron engine "
                      "needs here (megatron-core >= 0.19, CUDA, torch.distributed, psutil; DeepEP's rows are "
                      "nam-plugin-deepep's: --plugins deepep).")]


def preflight(
    plugins: PluginsOpt = None, device_profile: DeviceProfileOpt = None, recipe: RecipeOpt = None,
    engine: EngineOpt = "local", set_: SetOpt = None, device: DeviceOpt = None, nproc: NprocOpt = None,
    tp: TpOpt = None, pp: PpOpt = None, ep: EpOpt = None, json_out: JsonOpt = False,
) -> None:
    """Check whether the named plugins (and the engine) can run here: exit 0 if every check passes, 3 otherwise.

    With a run (--recipe, --set, --device or a layout flag) this is `nam train --dry-run`'s resolution and
    activation: it refuses exactly what training refuses, with the same exit code and error.
    """
    from nam_core.errors import ConfigError

    if engine not in ("local", "megatron"):
        raise ConfigError(f"--engine {engine!r}: expected local or megatron", hint="--engine megatron")
    host = PluginHost()
    wants_run = recipe is not None or set_ or device is not None or any(v is not None for v in (nproc, tp, pp, ep))
    if wants_run:
        from nam56r import run as root

        run = root.resolve(root.RunRequest(recipe=recipe or "nam56r-tiny", plugins=plugins, overrides=list(set_ or []),
                                           engine=engine, device=device, tp=tp, pp=pp, ep=ep, nproc=nproc), host)
        dev = root.run_device(run.spec, profile=device_profile)
        spec, ev = root.evaluate(run, host, dev)
        if ev.ok:  # as `nam train` after activation: sizes that cannot fit the device, exit 2 with the numbers
            from nam56r import memory

            memory.check_fits(spec, dev)
        from nam_core.engine.megatron.optimizer import precision_aware

        names, notes, dispatcher = list(spec.plugins), list(spec.notes), spec.train.moe_dispatcher
        aware = precision_aware(spec.train)
    else:
        dev = resolve_device(device_profile)
        names = requested_plugins(plugins)
        ev = host.evaluate(names, dev)
        notes, dispatcher, aware = [], "alltoall", False
    engine_rows = []
    if engine == "megatron":  # facts of this process, never of a --device-profile fake
        from nam_core.engine.megatron import runtime_checks, runtime_facts

        engine_rows = runtime_checks(runtime_facts(), dispatcher=dispatcher, launched=False, precision_aware=aware)
    ok = ev.ok and all(c.ok for c in engine_rows)
    if json_out:
        print_json({"device": dev.to_dict(), "plugins": names, "ok": ok, "selected_by_plugins": notes,
                    "checks": [c.to_dict() for c in ev.checks], "engine": engine,
                    "engine_checks": [c.to_dict() for c in engine_rows]})
    else:
        _print(dev, names, ev)
        if engine_rows:
            _print_rows("engine: megatron", engine_rows)
        for line in notes:
            out.print(f"config: {line}")
    if not ev.ok:
        raise PluginActivationError(ev.failures)  # what `nam train` raises for the same run
    if not ok:
        raise CannotRunHere("the megatron engine cannot run here: "
                            + "; ".join(f"{c.name}: needs {c.needed}, found {c.found}" for c in engine_rows if not c.ok),
                            hint="; ".join(dict.fromkeys(c.hint for c in engine_rows if not c.ok and c.hint)))


def _print_rows(title: str, rows) -> None:
    t = table("check", "status", "needed", "found", title=title, names=("check", "status"))
    for c in rows:
        t.add_row(c.name, STATUS_STYLE[c.status], c.needed, c.found)
    out.print(t)
    failed = [c for c in rows if not c.ok]
    print_hints([(c.name, c.hint) for c in failed])
    out.print("[green]megatron engine ready[/green]" if not failed
              else f"[red]megatron engine cannot run here[/red]: {', '.join(c.name for c in failed)}")


def _print(device, names, ev) -> None:
    facts = table("fact", "value", title="device", show_header=False, names=("fact",))
    for key, value in device.to_dict().items():
        if value not in (None, ""):
            facts.add_row(key, f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value))
    out.print(facts)
    if not names:
        out.print("no plugins requested (--plugins a,b or NAM_PLUGINS)")
        return
    t = table("plugin", "check", "status", "needed", "found", title=f"preflight: {', '.join(names)}",
              names=("plugin", "status"))
    for c in ev.checks:
        t.add_row(c.plugin, c.name, STATUS_STYLE[c.status], c.needed, c.found)
    out.print(t)
    print_hints([(c.plugin, c.hint) for c in ev.checks if c.status != "pass"])  # skips may say how to use it
    n_fail = len(ev.failures)
    out.print("[green]ready[/green]: every check passed" if ev.ok
              else f"[red]cannot run here[/red]: {n_fail} check{'s' if n_fail != 1 else ''} failed")
