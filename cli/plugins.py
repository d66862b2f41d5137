"""``nam plugins list``: what is installed, what each provides and needs, and whether this machine has it."""

from __future__ import annotations

import typer

from nam_cli.console import STATUS_STYLE, out, print_json, table
from nam_cli.options import DeviceProfileOpt, JsonOpt, resolve_device
from nam_core.host import PluginHost

app = typer.Typer(help="Installed plugins.", no_args_is_help=True)


def describe_installed(host: PluginHost, device) -> list[dict]:
    rows = []
    for name, plugin in host.installed.items():
        row = {"name": name, "distribution": plugin.distribution, "version": plugin.version,
               "module": plugin.entry_point.value}
        info = host.info(name)
        if info is None:
            row.update(summary=None, provides={}, requires=[], conflicts=[], meets_requirements=False,
                       error="cannot be imported: `nam preflight --plugins " + name + "` shows why")
        else:
            checks = [req.check(name, device) for req in info.requires]
            row.update(info.to_dict())
            row["requires"] = [dict(r.to_dict(), status=c.status, found=c.found) for r, c in zip(info.requires, checks)]
            row["meets_requirements"] = all(c.ok for c in checks)
        rows.append(row)
    return rows


@app.command("list")
def list_plugins(json_out: JsonOpt = False, device_profile: DeviceProfileOpt = None) -> None:
    """List installed plugins (installed is not active: name them with --plugins to use them)."""
    device = resolve_device(device_profile)
    rows = describe_installed(PluginHost(), device)
    if json_out:
        print_json({"device": device.to_dict(), "plugins": rows})
        return
    if not rows:
        out.print("no nam plugins installed; `pip install ./plugins/nam-plugin-<name>` adds one")
        return
    t = table("plugin", "distribution", "provides", "requires", "here",
              title=f"nam plugins (checked against {device.label})", show_lines=True, names=("plugin", "distribution", "here"))
    for row in rows:
        provides = "\n".join(f"{k}: {', '.join(v)}" for k, v in row["provides"].items()) or "-"
        requires = "\n".join(f"{_requirement(r)}: {STATUS_STYLE[r['status']]} ({r['found']})"
                             for r in row["requires"]) or "-"
        here = "[green]yes[/green]" if row["meets_requirements"] else "[red]no[/red]"
        t.add_row(row["name"], f"{row['distribution']}\n{row['version']}", provides, requires, here)
    out.print(t)


def _requirement(req: dict) -> str:
    """A requirement as one phrase: ``CUDA capability >= sm_90``, ``torch>=2.11``, ``a CUDA device`` (the check's
    name only where what is needed does not already say it)."""
    check, needed = req["check"], req["needed"]
    if not needed:
        return check
    return needed if check.split()[-1].lower() in needed.lower() else f"{check} {needed}"
