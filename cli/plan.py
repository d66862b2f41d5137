"""``nam train --dry-run``: the plan of a run, for a person (short sections) or a script (``--json``).

The plan says what ``nam train`` with the same flags would do, without doing it: recipe, engine and device,
the layers by kind, parameters, FLOPs per token, a memory estimate, the plugins and the backend each kind
would use, the patches that would apply, and what would be written where. Nothing is written.

``--device-profile NAME`` (a described device, ``nam_core.device.PROFILES``) plans a GPU run on a machine
without that GPU: the plugins' declared requirements are evaluated against the profile exactly as ``nam
preflight --device-profile`` does, and nothing asks CUDA. A profile describes another machine, so a package a
plugin needs and this environment lacks is listed as what that machine must have, not refused; every other
failed check still refuses the run (exit 3). The plan says it was made against a profile, not on hardware.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nam_cli.console import out, print_json
from nam_core.errors import ConfigError, PluginActivationError

RUN_FILES = {
    "run.lock": "held by the live run, so a second run cannot share the folder",
    "history.jsonl": "one line per start: fresh, restart or resume",
    "config.json": "the resolved config (what makes a resume the same run)",
    "plugins.json": "active plugins, backends, patches, versions, device",
    "metrics.jsonl": "one JSON line per logged step",
    "run.log": "one-off notes (selected fields, hand-overs, checkpoints saved)",
    "checkpoints/": "",
    "summary.json": "steady-state tokens/s and TFLOP/s, first step apart, LM loss over the last steps, the newest "
                    "checkpoint, the resume command",
    "tensorboard/": "event files of every logged step, when tensorboard is installed (the [tensorboard] extra)",
}
"""What a run folder holds (``nam_core.engine.rundir.RunFolder`` owns every file)."""


# --- building the plan ----------------------------------------------------------------------------------


def check_profile_flag(profile: str | None, dry_run: bool) -> None:
    """``--device-profile`` describes a device to plan for; training needs the real one, so it is refused
    without ``--dry-run`` (exit 2)."""
    if profile is not None and not dry_run:
        raise ConfigError(f"--device-profile {profile} plans a run against a described device; training needs "
                          "the real one, found no --dry-run",
                          hint=f"nam train --dry-run --device-profile {profile} ... (or drop --device-profile)")


def profile_device(spec, profile: str):
    """The described device ``profile`` for ``spec``'s run. A CUDA profile for a CPU run is refused (exit 2): the
    plan would describe a run that never touches that device."""
    from nam_core.device import DeviceInfo

    device = DeviceInfo.profile(profile)
    if spec.train.device != device.kind:
        raise ConfigError(f"--device-profile {profile} describes a {device.kind} device, but this run trains on "
                          f"train.device={spec.train.device}",
                          hint=f"add --device {device.kind}, or plan a GPU recipe: nam train --recipe nam56r "
                               f"--dry-run --device-profile {profile}")
    return device


def evaluate_on_profile(run, host, device) -> list[str]:
    """Every activation check of ``run`` against the described ``device``, registering nothing. Returns the
    package requirements this environment does not meet (the GPU host must); raises ``PluginActivationError``
    (exit 3) for any other failure, the same error ``nam preflight --device-profile`` raises."""
    from nam56r.run import evaluate

    spec, ev = evaluate(run, host, device)
    packages = {(name, req.title) for name, module in ev.modules.items()
                for req in module.PLUGIN.requires if req.kind == "package"}
    needed = [c for c in ev.failures if (c.plugin, c.name) in packages]
    refused = [c for c in ev.failures if (c.plugin, c.name) not in packages]
    if refused:
        raise PluginActivationError(refused)
    return [f"{c.plugin}: {c.needed} (here: {c.found})" for c in needed]


def on_profile(run, host, profile: str, *, run_dir: Path | None, data: Path | None) -> dict:
    """The plan of ``run`` against the described device ``profile``: no CUDA, no engine start, no activation
    (nothing is registered or built from a plugin); parameters are counted on the meta device."""
    from nam56r import memory

    device = profile_device(run.spec, profile)
    memory.check_fits(run.spec, device)  # ConfigError (exit 2): a run too big for that device is no plan
    packages = evaluate_on_profile(run, host, device)
    run = dataclasses.replace(run, spec=run.spec.replace(device=device))
    return build(run, host, device, run_dir=run_dir, data=data, packages_needed=tuple(packages))


def of_session(session, *, run_dir: Path | None, data: Path | None) -> dict:
    """The plan of a built dry-run ``session`` (``nam56r.run.build(..., dry_run=True)``): its activated
    plugins, built backends, applied patches and, on the megatron engine, its layout."""
    megatron = session.megatron_layout() if session.spec.engine == "megatron" else None
    return build(session.run, session.host, session.device, run_dir=run_dir, data=data, backends=session.backends,
                 patches=session.patches, megatron=megatron)


def build(run, host, device, *, run_dir: Path | None, data: Path | None, backends=None, patches=None,
          megatron: dict | None = None, packages_needed: tuple[str, ...] = ()) -> dict:
    """The plan as JSON-ready data. ``backends`` (the built objects) and ``patches`` (the patch reports) come
    from a real activation; with a profile they are None and the plan names implementations instead."""
    spec = run.spec
    plan = {
        "recipe": spec.recipe, "engine": spec.engine, "device": device.label,
        "device_profile": device.profile_name, "checked_on_hardware": not device.is_fake,
        "plugins": list(spec.plugins), "selected_by_plugins": list(spec.notes),
        "max_steps": run.max_steps, "tokens_per_step": tokens_per_step(spec),
        **model_section(spec.model),
        "memory": memory_section(spec, device),
        "backends": ({k: type(b).__name__ for k, b in backends.as_mapping().items()} if backends is not None
                     else dict(spec.backends)),
        "backend_providers": backend_providers(spec, host),
        "patches": ([r.to_dict() for r in patches] if patches is not None else declared_patches(spec, host)),
        "packages_needed": list(packages_needed),
        "writes": writes_section(spec, run_dir, data),
    }
    if spec.engine == "megatron":
        plan["megatron"] = megatron_section(run, megatron)
        plan["patches"] += megatron_patches()
    return plan


def tokens_per_step(spec) -> int:
    """Tokens one optimizer step trains on, over every data-parallel rank."""
    t = spec.train
    return t.micro_batch_size * t.grad_accum * spec.model.seq_len * max(1, spec.layout.dp)


def model_section(cfg) -> dict:
    """Layers by kind, parameters (meta device) and FLOPs per token. ``layers`` is the resolved pattern, one
    symbol per layer (M Mamba-3, E MoE, A MLA, D DSA)."""
    from nam56r.flops import flops_per_token
    from nam56r.model import count_parameters
    from nam56r.pattern import resolve

    layers = resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks)
    flops = flops_per_token(cfg)
    return {"pattern": cfg.pattern, "layers": layers.resolved, "layers_by_kind": layers.counts(),
            "mtp_depths": cfg.mtp_depths, "parameters": count_parameters(cfg),
            "flops_per_token": flops.total, "flops_by_block": flops.by_block}


def memory_section(spec, device) -> dict:
    """Per-device memory under the run's optimizer numerics and activation recompute, in total and per part
    (``by_part``: each layer kind, the MTP depths, the head, the embedding): weights, gradients and optimizer
    states counted exactly, activations from the constants measured per part and recompute choice at NAM56R's
    shape, the peak by replaying the backward, and the largest micro-batch whose plan fits (nam56r/memory.py)."""
    import torch

    from nam56r import memory
    from nam_core.engine.config import recompute_kinds
    from nam_core.engine.numerics import describe

    cfg, train, lay = spec.model, spec.train, spec.layout
    split = memory.parameters_by_part(cfg)
    dense, routed = sum(d for d, _ in split.values()), sum(r for _, r in split.values())
    capacity = device.memory_bytes / memory.GIB if device.memory_bytes else None
    kinds = recompute_kinds(train)
    section = {"capacity_gib": capacity, "outside_allocator_gib": None, "activations": None, "fits": None,
               "numerics": describe(train.optimizer_numerics, train.dtype), "recompute": list(kinds),
               "micro_batch": train.micro_batch_size, "activations_by_kind": None, "by_part": None}
    measured = memory.activations_measured(cfg)
    if spec.engine == "local":
        nbytes = torch.empty((), dtype=getattr(torch, train.dtype)).element_size()
        section.update(scope="one process holds everything, in " + train.dtype,
                       **memory.local_static_gib(dense + routed, nbytes, train.optimizer_numerics),
                       by_part=memory.static_by_part(split, engine="local", numerics=train.optimizer_numerics,
                                                     dtype_bytes=nbytes))
        if not measured or nbytes != 2:
            section["activations"] = ("not estimated: the local engine's were measured only in bfloat16 at "
                                      + ", ".join(f"{k} {v}" for k, v in memory.MEASURED_SHAPE.items()))
            return section
        mbs = train.micro_batch_size
        plan = memory.local_plan(dense + routed, nbytes, numerics=train.optimizer_numerics, mbs=mbs, cfg=cfg,
                                 kinds=kinds)
        rows = plan.pop("rows")
        section.update(plan, activations=_activations_note(), activations_by_kind=rows,
                       outside_allocator_gib=memory.OUTSIDE_ALLOCATOR_GIB)
        _with_activations(section["by_part"], rows)
        if capacity is not None:
            fits = lambda m: memory.local_plan(dense + routed, nbytes, numerics=train.optimizer_numerics, mbs=m,
                                               cfg=cfg, kinds=kinds)["total_gib"] + memory.OUTSIDE_ALLOCATOR_GIB \
                <= capacity
            section.update(fits=fits(mbs), largest_micro_batch=memory.largest_fitting(fits))
        return section
    if lay.pp > 1 or lay.tp > 1:
        section.update(scope="per GPU", activations=f"not estimated: the model is for pp 1 and tp 1 (found pp "
                                                    f"{lay.pp}, tp {lay.tp})")
        return section
    numerics = memory.megatron_numerics(train)
    numerics = numerics if numerics in memory.MEGATRON_OPTIMIZER else "fp32-master"
    if measured:  # the estimate bench/megatron.py memory measures at these per-GPU shapes on one GPU
        plan, rows = memory.megatron_estimate(cfg, world=lay.world_size, ep=lay.ep, mbs=train.micro_batch_size,
                                              kinds=kinds, numerics=numerics, split=(dense, routed),
                                              grad_bytes=memory.grad_bytes(train))
    else:
        plan = memory.megatron_plan(dense, routed, world=lay.world_size, ep=lay.ep, mbs=train.micro_batch_size,
                                    numerics=numerics, grad_bytes=memory.grad_bytes(train))
    section.update(scope=f"per GPU, {lay.world_size} GPUs at ep {lay.ep}, micro-batch {train.micro_batch_size}",
                   **plan.to_dict(), by_part=memory.static_by_part(split, engine="megatron", numerics=numerics,
                                                                   world=lay.world_size, ep=lay.ep,
                                                                   grad_bytes=memory.grad_bytes(train)))
    if not measured:
        section["activations"] = ("not estimated: measured only at " + ", ".join(
            f"{k} {v}" for k, v in memory.MEASURED_SHAPE.items()))
        return section
    _with_activations(section["by_part"], rows)
    section.update(activations=_activations_note(), activations_by_kind=rows,
                   outside_allocator_gib=memory.OUTSIDE_ALLOCATOR_GIB,
                   one_gpu_check=(f"python bench/megatron.py memory --world {lay.world_size} --ep {lay.ep} --mbs "
                                  f"{train.micro_batch_size} --recompute {','.join(kinds) or 'none'} --numerics "
                                  f"{train.optimizer_numerics}"))
    if capacity is not None:
        section.update(fits=plan.fits(capacity), largest_micro_batch=memory.largest_mbs(
            cfg, world=lay.world_size, ep=lay.ep, kinds=kinds, capacity_gib=capacity, numerics=numerics,
            split=(dense, routed), grad_bytes=memory.grad_bytes(train)))
    return section


def _with_activations(by_part: dict, rows: dict) -> None:
    """Each part's static row gets what its forward keeps at the run's micro-batch and the recompute choice."""
    for part, row in by_part.items():
        act = rows.get(part)
        row.update(layers=act["layers"] if act else 0, activations_gib=act["gib"] if act else 0.0,
                   recompute=act["choice"] if act else "none")


def _activations_note() -> str:
    from nam56r import memory

    meta = memory.load_constants().meta
    return (f"measured per block and recompute choice on {meta['gpu']}, {meta['date']} (nam56r/activations.json, "
            "bench/activations.py); the peak replays the backward (nam56r/memory.py backward_peak)")


def backend_providers(spec, host) -> dict[str, dict]:
    """Kind -> the implementation the run asks for and the requested plugin that provides it."""
    rows = {}
    for kind, name in spec.backends.items():
        providers = [p for p in host.providers_of(kind, name) if p in spec.plugins]
        rows[kind] = {"name": name, "plugin": providers[0] if providers else None,
                      "wraps": spec.wrapped.get(kind)}
    return rows


def declared_patches(spec, host) -> list[dict]:
    """The patches the run's plugins declare, with their state in this environment (nothing applied)."""
    rows = []
    for name in spec.plugins:
        for entry in host.declared_patches(name):
            state, detail = entry.impl.state()
            rows.append({"name": entry.impl.name, "plugin": entry.plugin, "target": entry.impl.target,
                         "state": state, "detail": detail + " (here; the GPU host may differ)",
                         "retire_when": entry.impl.retire_when})
    return rows


def megatron_patches() -> list[dict]:
    """The lanes the megatron engine applies itself (Megatron-Core's workarounds, NAM56R's Megatron build), with
    their state in this environment: ``nam patches`` lists the same."""
    from nam56r.megatron import patches as model_patches
    from nam_core.engine.megatron import patches as engine_patches

    rows = []
    for entry in (*engine_patches.lane(), *model_patches.lane()):
        state, detail = entry.impl.state()
        rows.append({"name": entry.impl.name, "plugin": entry.plugin, "target": entry.impl.target, "state": state,
                     "detail": detail + " (here)", "retire_when": entry.impl.retire_when})
    return rows


def writes_section(spec, run_dir: Path | None, data: Path | None) -> dict:
    """Where the run would write: its run folder, the data cache, the kernel compilers' caches."""
    from nam_core.cache import cache_dir

    train = spec.train
    folder = run_dir or Path("runs") / spec.recipe
    every = (f"every {train.checkpoint_every} steps and at the end, newest {train.keep_checkpoints} kept"
             if train.checkpoint_every > 0 else "none (train.checkpoint_every=0)")
    files = dict(RUN_FILES, **{"checkpoints/": every})
    cache = cache_dir()
    corpus = (f"reads {data} (prepared by `nam data prepare`)" if data is not None else
              f"the Python standard library corpus, prepared once into {cache} and reused")
    writes = {"run_dir": str(folder), "run_files": files, "data": corpus}
    if train.device == "cuda":  # TileLang's, Triton's and inductor's: nam's folder, or where the user pointed one
        from nam_core.cache import planned_kernel_caches

        writes["kernel_caches"] = f"{', '.join(planned_kernel_caches())} (compiled once per shape, reused)"
    return writes


def megatron_section(run, megatron: dict | None) -> dict:
    """The megatron engine's layout and lowering (``megatron``: the started engine's facts, when it started)."""
    lay, lowering = run.spec.layout, run.lowering
    section = {"world_size": lay.world_size, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "dp": lay.dp,
               "nproc": lay.nproc, "hybrid_layer_pattern": lowering.hybrid_layer_pattern if lowering else None,
               "schedule": lowering.schedule if lowering else run.spec.train.schedule}
    if megatron:
        section.update(megatron)
    return section


# --- showing it -----------------------------------------------------------------------------------------


def show(plan: dict, *, json_out: bool) -> None:
    """``--json``: the plan as one object; otherwise the sections below, one fact per line."""
    if json_out:
        print_json(plan)
        return
    for section in (_head, _model, _memory, _plugins, _writes):
        for line in section(plan):
            out.print(line, markup=False, highlight=False)


def _head(plan: dict) -> list[str]:
    if plan["checked_on_hardware"]:
        where = f"{plan['device']}, checked on this machine"
    else:
        where = (f"{plan['device']}: planned against the profile's description, not checked on hardware; run "
                 f"`nam preflight` with the same flags on the GPU host")
    lines = [f"plan: nam train --recipe {plan['recipe']} --engine {plan['engine']}  (dry run: nothing trained, "
             "nothing written)", f"device: {where}",
             f"steps: {plan['max_steps']:,} of {plan['tokens_per_step']:,} tokens each"]
    m = plan.get("megatron")
    if m:
        lines.append(f"layout: {m['world_size']} processes, tp {m['tp']}, pp {m['pp']}, ep {m['ep']}, dp {m['dp']}; "
                     f"schedule {m['schedule']}; hybrid_layer_pattern {m['hybrid_layer_pattern']}")
        if not plan["checked_on_hardware"]:
            lines.append("  the megatron engine's runtime (megatron-core >= 0.19 on Python >= 3.12, torchrun, psutil) "
                         "is checked on the GPU host: nam preflight --engine megatron")
    return lines


def _model(plan: dict) -> list[str]:
    p = plan["parameters"]
    counts = ", ".join(f"{n} {kind}" for kind, n in plan["layers_by_kind"].items())
    by_kind = ", ".join(f"{kind} {_count(n)}" for kind, n in p["by_kind"].items() if n)
    flops = ", ".join(f"{k} {_count(v)}" for k, v in plan["flops_by_block"].items())
    return ["", f"layers: {len(plan['layers'])} ({counts}) + {plan['mtp_depths']} MTP depths",
            f"  {plan['layers']}",
            f"parameters: {_count(p['total'])} total ({p['total']:,}), {_count(p['active_per_token'])} active per token",
            f"  by kind: {by_kind}",
            f"model FLOPs per token (fwd+bwd): {_count(plan['flops_per_token'])}  ({flops})"]


def _memory(plan: dict) -> list[str]:
    m = plan["memory"]
    head = [f"numerics: {m['numerics']}", f"activation recompute: {', '.join(m['recompute']) or 'none'}"]
    if "static_gib" not in m:
        return ["", *head, f"memory: {m['activations']}"]
    lines = ["", *head, f"memory ({m['scope']}): weights {_gib(m['weights_gib'])} + gradients {_gib(m['grads_gib'])} "
                        f"+ optimizer {_gib(m['optimizer_gib'])} = {_gib(m['static_gib'])} static"]
    measured = m.get("outside_allocator_gib") is not None
    kept = f"; activations: kept at micro-batch {m['micro_batch']} under the recompute shown" if measured else ""
    lines.append(f"  by part{kept}:")
    lines += [_part_line(part, r, measured) for part, r in (m.get("by_part") or {}).items()]
    lines.append(f"  activations: {m['activations']}")
    if measured:
        need = m["total_gib"] + m["outside_allocator_gib"]
        at = f" (at the {m['peak_at']})" if m.get("peak_at") else ""
        held = m["total_gib"] - m["other_gib"]
        lines.append(f"  peak {m['total_gib']:.1f} GiB{at} = {held:.1f} held + {m['other_gib']:.1f} activations, "
                     f"temporaries{' and gradients made by the backward' if m.get('peak_at') else ''}; "
                     f"+ {m['outside_allocator_gib']:.1f} GiB outside the allocator = {need:.1f} GiB")
    if m.get("fits") is not None:
        verdict = "fits" if m["fits"] else "does NOT fit"
        largest = m["largest_micro_batch"]
        lines.append(f"  {verdict} in {m['capacity_gib']:.1f} GiB; largest micro-batch that fits: "
                     + (f"{largest} (--set train.micro_batch_size=N)" if largest else "none"))
        if not m["fits"]:
            lines.append("  (a start is refused only below the lower bound of weights, optimizer and activations; "
                         "past it, this plan's estimate says the run would run out of memory)")
    elif m.get("capacity_gib"):
        lines.append(f"  device memory: {m['capacity_gib']:.1f} GiB")
    if m.get("one_gpu_check"):
        lines.append(f"  measured on one GPU at these per-GPU shapes by: {m['one_gpu_check']}")
    return lines


def _part_line(part: str, r: dict, measured: bool) -> str:
    """One part's row of the memory section: its parameters, their three static parts, what it keeps."""
    line = (f"    {part:9s} {_count(r['parameters']):>7s} params: weights {_gib(r['weights_gib']):>9s}, grads "
            f"{_gib(r['grads_gib']):>9s}, optimizer {_gib(r['optimizer_gib']):>9s}")
    if not measured:
        return line
    recompute = f" (recompute {r['recompute']})" if r["recompute"] != "none" else ""
    return line + f", activations {_gib(r['activations_gib']):>9s} in {r['layers']}{recompute}"


def _plugins(plan: dict) -> list[str]:
    lines = ["", f"plugins: {', '.join(plan['plugins'])}"]
    for kind, row in plan["backend_providers"].items():
        built = plan["backends"].get(kind)
        cls = f" -> {built}" if built and built != row["name"] else ""
        wraps = f", wrapping {row['wraps']}" if row["wraps"] else ""
        lines.append(f"  {kind}: {row['name']} (plugin {row['plugin']}{wraps}){cls}")
    lines += [f"  selected: {note}" for note in plan["selected_by_plugins"]]
    if plan["packages_needed"]:
        lines.append("packages the GPU host must have (missing here, not needed for planning):")
        lines += [f"  {p}" for p in plan["packages_needed"]]
    if plan["patches"]:
        lines.append("patches:")
        lines += [f"  {p['name']} ({p['plugin']}, {p['target']}): {p['state']}: {p['detail']}" for p in plan["patches"]]
    else:
        lines.append("patches: none declared by these plugins")
    return lines


def _writes(plan: dict) -> list[str]:
    w = plan["writes"]
    lines = ["", f"would write: run folder {w['run_dir']}/"]
    lines += [f"  {name}" + (f"  {what}" if what else "") for name, what in w["run_files"].items()]
    lines.append(f"data: {w['data']}")
    if "kernel_caches" in w:
        lines.append(f"kernel caches: {w['kernel_caches']}")
    return lines


def _gib(x: float) -> str:
    """A size in GiB, or MiB below one GiB (a toy model's 0.0 GiB says nothing)."""
    return f"{x:.1f} GiB" if x >= 1 else f"{x * 1024:.1f} MiB"


def _count(n: float) -> str:
    """A count as a person reads it: 4.73B, 112.5M, 20.1K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'B' else 1}f}{unit}"
    return str(int(n))

