"""``nam recipe list`` / ``nam recipe show NAME [--megatron-args]``: recipes, resolved, with parameter and FLOP
counts, and their lowering to Megatron-Core (nam56r/megatron.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from nam_cli.console import out, print_json, table

app = typer.Typer(help="Model recipes.", no_args_is_help=True)

NameArg = Annotated[str, typer.Argument(help="Recipe name (`nam recipe list`).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
MegatronOpt = Annotated[bool, typer.Option(
    "--megatron-args", help="Print the Megatron-Core >= 0.19 lowering (pattern, slots, args, gaps) and its flags.")]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel size for --megatron-args.")]
PpOpt = Annotated[int, typer.Option("--pp", help="Pipeline-parallel size for --megatron-args.")]
EpOpt = Annotated[int, typer.Option("--ep", help="Expert-parallel size for --megatron-args.")]


def describe(name: str) -> dict:
    from nam56r.flops import flops_per_token
    from nam56r.model import count_parameters
    from nam56r.pattern import resolve
    from nam56r.recipes import get_recipe

    recipe = get_recipe(name)
    cfg = recipe.model
    plan = resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks)
    params = count_parameters(cfg)
    flops = flops_per_token(cfg)
    return {
        "name": recipe.name,
        "summary": recipe.summary,
        "plugins": recipe.plugins,
        "params": params,
        "flops_per_token": flops.total,
        "flops_by_block": flops.by_block,
        "pattern": cfg.pattern,
        "resolved_pattern": plan.resolved,
        "counts": plan.counts(),
        "layers": [
            {"index": l.index, "kind": l.kind, "attention_rank": l.attention_rank, "dsa_rank": l.dsa_rank}
            for l in plan.layers
        ],
        "config": recipe.to_dict(),
    }


@app.command("list")
def list_recipes(json_out: JsonOpt = False) -> None:
    """List recipes."""
    from nam56r.recipes import RECIPES

    rows = [{"name": n, "summary": f().summary, "plugins": f().plugins} for n, f in RECIPES.items()]
    if json_out:
        print_json({"recipes": rows})
        return
    t = table("name", "summary", "plugins", title="recipes", names=("name",))
    for r in rows:
        t.add_row(r["name"], r["summary"], ", ".join(r["plugins"]))
    out.print(t)


def describe_megatron(name: str, *, tp: int, pp: int, ep: int) -> dict:
    """The recipe's Megatron lowering at ``tp/pp/ep`` as JSON-ready data, with the equivalent command-line
    flags: the lowering ``nam train --engine megatron`` makes (``nam56r.run.lowering_for``), shown with its
    open gaps rather than refused, so a user sees what a layout still lacks."""
    from nam56r.megatron import megatron_args
    from nam56r.run import RunRequest, lowering_for, resolve
    from nam_core.run import Layout

    spec = resolve(RunRequest(recipe=name, env_plugins=False)).spec
    spec = spec.replace(engine="megatron", layout=Layout(tp=tp, pp=pp, ep=ep, world_size=tp * pp * ep))
    lowering = lowering_for(spec)
    return {"recipe": spec.recipe, **lowering.to_dict(), "flags": megatron_args(lowering)}


def _print_megatron(m: dict) -> None:
    import shlex

    out.print(f"[bold]{m['recipe']}[/bold] lowered for megatron-core {m['megatron_core']}")
    out.print(f"hybrid_layer_pattern {m['hybrid_layer_pattern']}  ({m['mtp_depths']} MTP depths of "
              f"{m['mtp_pattern']!r}; schedule {m['schedule']}, MoE dispatcher {m['moe_dispatcher']})")
    out.print("[bold]slots[/bold] (symbol, slot -> class, provider, backends):")
    for slot in m["slots"]:
        backends = "".join(f"; {k}: {v}" for k, v in slot["backends"].items())
        out.print(f"  {slot['symbol']:5} {slot['path']} -> {slot['module']} ({slot['provider']}{backends})")
    for title, key in (("MLATransformerConfig", "config_args"), ("HybridModel", "model_args")):
        t = table("argument", "value", title=title, names=("argument",))
        for k, v in m[key].items():
            t.add_row(k, str(v))
        out.print(t)
    out.print("[bold]what Megatron-Core lacks, and how nam covers it[/bold]:")
    for gap in m["gaps"]:
        out.print(f"  [{gap['status']}] {gap['what']}\n      megatron-core: {gap['megatron']}\n      nam: {gap['nam']}",
                  markup=False)
    for note in m["notes"]:
        out.print(f"note: {note}")
    out.print(shlex.join(m["flags"]))


@app.command("show")
def show(
    name: NameArg,
    json_out: JsonOpt = False,
    megatron: MegatronOpt = False,
    tp: TpOpt = 1,
    pp: PpOpt = 1,
    ep: EpOpt = 1,
) -> None:
    """Show a recipe: layer plan, parameters (counted on the meta device), FLOPs per token, config."""
    if megatron:
        m = describe_megatron(name, tp=tp, pp=pp, ep=ep)
        if json_out:
            print_json(m)
        else:
            _print_megatron(m)
        return
    d = describe(name)
    if json_out:
        print_json(d)
        return
    p = d["params"]
    out.print(f"[bold]{d['name']}[/bold]: {d['summary']}")
    out.print(f"plugins: {', '.join(d['plugins'])}")
    out.print(f"pattern {d['pattern']} -> {d['resolved_pattern']}  ({d['counts']})")
    out.print(f"parameters: {p['total']:,} total, {p['active_per_token']:,} active per token")
    out.print(f"model FLOPs per token (training, fwd+bwd): {d['flops_per_token'] / 1e9:.2f} G")
    t = table("group", "parameters", title="parameters by group", names=("group", "parameters"),
              right=("parameters",))
    for k, v in p["by_kind"].items():
        t.add_row(k, f"{v:,}")
    out.print(t)
    for section in ("model", "train"):
        t = table("field", "value", title=section, names=("field",))
        for k, v in d["config"][section].items():
            t.add_row(k, str(v))
        out.print(t)
