"""The composition root: (recipe, ``--set`` overrides, plugins, engine, layout, device) -> a checked run.

``nam train``, ``nam train --dry-run`` and ``nam preflight --recipe ...`` all call ``resolve`` and then
activate through ``activate`` (preflight: ``evaluate``, which raises the same error), so preflight refuses
exactly what training refuses. Nothing else assembles a run.

Stages, in order (each raises the one error of its kind, before anything is written):

1. ``resolve(request, host)`` -> ``RunSpec`` (no CUDA touched): the recipe, the plugins it and the user
   request plus the built-in ``reference`` (always active: its names are the defaults of every kind), the
   overrides and what requested plugins select (``PluginInfo.selects``/``wraps``), every plugin option parsed
   against ``PluginInfo.options``, every value against the bound its field declares and every relation
   between fields (``check_values``), the engine, its schedule and layout (the megatron lowering and its gaps
   included). Usage errors: ``ConfigError``, exit 2.
2. The engine starts (the megatron engine sets its allocator and process group first, in ``nam train``).
3. ``run_device(spec, ...)`` probes the device (or takes a ``--device-profile`` fake); no CUDA device for a
   CUDA run is ``CannotRunHere``, exit 3.
4. ``activate(spec, host)``: the host checks every plugin against the run (requirements, a provider for every
   backend the config names, the selected rows, train device/dtype, config checks, launch checks) and
   registers all or nothing (``PluginActivationError``, exit 3); the megatron layout is checked again against
   the schedules the plugins registered.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Sequence

from nam56r.config import NAM56RConfig
from nam56r.kinds import BACKEND_KINDS
from nam56r.recipes import Recipe, apply_overrides, get_recipe
from nam_core import bounds, selection
from nam_core.device import DeviceInfo
from nam_core.engine.config import ENGINES, TrainConfig
from nam_core.errors import CannotRunHere, ConfigError, PluginActivationError
from nam_core.host import Evaluation, PluginHost, requested_plugins
from nam_core.run import Layout, RunSpec

BUILTIN_PLUGINS = ("reference",)
"""nam56r's own plugin, active in every run: the provider of every kind's default."""
LOCAL_SCHEDULES = ("single",)
"""The local engine runs micro-batches one after the other and nothing else."""


@dataclass(frozen=True)
class RunRequest:
    """What a user asked for: the flags ``nam train`` and ``nam preflight`` share."""

    recipe: str = "nam56r-tiny"
    plugins: Sequence[str] | str | None = None
    overrides: Sequence[str] = ()
    engine: str = "local"
    device: str | None = None
    """``--device cpu|cuda`` (default: the recipe's)."""
    device_profile: str | None = None
    """A fake device (``h100``, ``gb10``, ...) in place of the probed CUDA device (preflight)."""
    seed: int | None = None
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    nproc: int | None = None
    max_steps: int | None = None
    env_plugins: bool = True
    """Add ``NAM_PLUGINS``."""


@dataclass(frozen=True)
class Run:
    """A resolved run: the spec hooks see, and what the engines need beyond it."""

    spec: RunSpec[NAM56RConfig]
    max_steps: int
    lowering: Any = None
    """The megatron engine's lowering (``nam56r.megatron.Lowering``); None on the local engine."""

    @property
    def recipe(self) -> Recipe:
        """The spec as a ``Recipe`` (what config.json records)."""
        s = self.spec
        return Recipe(name=s.recipe, summary="", model=s.model, train=s.train, plugins=list(s.plugins),
                      notes=list(s.notes), explicit=s.explicit)


def resolve(request: RunRequest, host: PluginHost | None = None) -> Run:
    """Stage 1: the request as a checked ``Run`` (its spec has no device yet). ConfigError on a bad request."""
    host = host or PluginHost()
    if request.engine not in ENGINES:
        raise ConfigError(f"--engine {request.engine!r}: expected local or megatron", hint="--engine local")
    base = get_recipe(request.recipe)
    names = requested_plugins(base.plugins, request.plugins, BUILTIN_PLUGINS, env=request.env_plugins)
    infos = {n: info for n in names if n in host.installed and (info := host.info(n)) is not None}
    rec = apply_overrides(base, list(request.overrides), plugin_names=names, plugin_infos=infos)
    train = rec.train
    if request.seed is not None:
        train = train.replace(seed=request.seed)
    if request.device is not None:
        train = train.replace(device=request.device)
    flags = {k: v for k, v in (("tp", request.tp), ("pp", request.pp), ("ep", request.ep)) if v is not None}
    train = train.replace(engine=request.engine, **flags)  # the flags beat --set train.*
    check_values(rec.model, train, reference=base)
    steps = request.max_steps if request.max_steps is not None else train.total_steps
    if steps < 1:
        raise ConfigError(f"--max-steps must be >= 1, found {steps}", hint="--max-steps 80")
    options = {n: info.parse_options(n, train.plugin_options) for n, info in infos.items()}
    layout = _layout(request, train)
    spec = RunSpec(
        recipe=rec.name, model=rec.model, train=train, engine=request.engine, layout=layout, plugins=tuple(names),
        backends=_backends(rec.model, train), options=options, explicit=rec.explicit, notes=tuple(rec.notes),
        wrapped=selection.wrapped(rec.model, infos, options, BACKEND_KINDS),
    )
    declared = [n for info in infos.values() for n in info.provides.get("schedules", ())]
    lowering = _check_megatron(spec, declared=declared) if request.engine == "megatron" else None
    return Run(spec=spec, max_steps=steps, lowering=lowering)


def check_values(model: NAM56RConfig, train: TrainConfig, *, reference: Recipe | None = None) -> None:
    """Every value of the run inside its declared bound, and every relation between fields holding (one
    ConfigError listing each one that is not, with a ``--set`` from ``reference``, the recipe as written).
    Runs before anything is built or written: a bad value must not surface as a traceback mid-build."""
    parts = ((model, "", reference.model if reference else None),
             (train, "train.", reference.train if reference else None))
    found = [p for config, prefix, ref in parts for p in bounds.out_of_bounds(config, prefix=prefix, reference=ref)]
    found = found or [p for config, prefix, ref in parts
                      for p in bounds.broken_rules(config, prefix=prefix, reference=ref)]
    bounds.refuse(found)


def run_device(spec: RunSpec, *, profile: str | None = None, index: int = 0) -> DeviceInfo:
    """Stage 3: the device the run trains on: a CPU, or the probed CUDA device ``index`` (``profile``: a fake
    in its place). Touches CUDA: on the megatron engine, only after the allocator is set."""
    import torch

    if spec.train.device == "cpu":
        return DeviceInfo(kind="cpu", name="cpu", torch_version=torch.__version__)
    if profile is not None:
        return DeviceInfo.profile(profile)
    info = DeviceInfo.probe(index)
    if not info.is_cuda:
        raise CannotRunHere("--device cuda: no CUDA device is visible to this process",
                            hint="run on a GPU host, train on the CPU with --device cpu, or plan the run "
                                 "here: nam train --dry-run --device-profile h200 (with the same flags)")
    return info


def evaluate(run: Run, host: PluginHost, device: DeviceInfo) -> tuple[RunSpec, Evaluation]:
    """Stage 4 without registering (preflight): every check of the run on ``device``."""
    spec = run.spec.replace(device=device)
    return spec, host.evaluate(spec.plugins, device, spec)


def activate(run: Run, host: PluginHost, device: DeviceInfo) -> Run:
    """Stage 4: activate the run's plugins on ``device`` (PluginActivationError listing every failure), then the
    megatron layout against the schedules they registered. Returns the run with its device set and, on the
    megatron engine, the lowering made from the registered schedule object (its chunks and stages: what the
    engine builds)."""
    spec = run.spec.replace(device=device)
    host.activate(spec.plugins, device, spec)
    lowering = _check_megatron(spec, registered=_schedules(host)) if spec.engine == "megatron" else None
    return dataclasses.replace(run, spec=spec, lowering=lowering)


def refuse(ev: Evaluation) -> None:
    """The error ``activate`` raises for ``ev``, or nothing when it passed (preflight raises exactly this)."""
    if not ev.ok:
        raise PluginActivationError(ev.failures)


def spec_for(recipe: str | Recipe = "nam56r-tiny", *overrides: str, plugins: Sequence[str] = (),
             device: str | None = None, engine: str = "local", profile: str = "h100", **layout) -> RunSpec:
    """A resolved ``RunSpec`` with its device set (a CPU, or the fake ``profile``), for tests and benches.
    ``recipe``: a name, or a ``Recipe`` object (then only its plugin-free resolution is redone)."""
    request = RunRequest(recipe=recipe if isinstance(recipe, str) else recipe.name, plugins=list(plugins),
                         overrides=list(overrides), device=device, engine=engine, env_plugins=False, **layout)
    run = resolve(request)
    spec = run.spec
    if not isinstance(recipe, str):
        spec = spec.replace(model=recipe.model, train=recipe.train.replace(engine=engine))
    return spec.replace(device=run_device(spec, profile=profile))


# --- the pieces ----------------------------------------------------------------------------------------


def _backends(model: NAM56RConfig, train) -> dict[str, str]:
    """Kind -> the name the run asks for: every backend kind's field, and ``train.schedule`` unless it is
    the engine's own (a plugin schedule needs its provider like any backend)."""
    chosen = {k.name: getattr(model, k.field) for k in BACKEND_KINDS}
    own = LOCAL_SCHEDULES if train.engine == "local" else _megatron_schedules()
    if train.schedule not in own:
        if train.engine == "local" and train.schedule in _megatron_schedules():
            raise ConfigError(f"train.schedule={train.schedule!r} is a megatron-engine schedule; the local engine "
                              f"runs micro-batches one after the other (train.schedule=single)",
                              hint="--set train.schedule=single, or --engine megatron")
        chosen["schedules"] = train.schedule
    return chosen


def _layout(request: RunRequest, train) -> Layout:
    """The layout, refusing one the engine cannot run (the megatron engine's full check is ``_check_megatron``)."""
    sizes = {"tp": train.tp, "pp": train.pp, "ep": train.ep}
    if request.engine == "local":
        if request.nproc is not None or set(sizes.values()) != {1}:
            raise ConfigError("--nproc and a parallel layout (--tp, --pp, --ep, train.tp/pp/ep) are megatron-engine "
                              f"options; the local engine runs one process on one device (found "
                              f"nproc={request.nproc}, {sizes})", hint="add --engine megatron, or drop them")
        return Layout()
    launched = "WORLD_SIZE" in os.environ
    if request.nproc is not None and request.nproc < 1:
        raise ConfigError(f"--nproc {request.nproc}: expected at least 1 process", hint="--nproc 2")
    if request.nproc is not None and launched and int(os.environ["WORLD_SIZE"]) != request.nproc:
        raise ConfigError(f"--nproc {request.nproc} under a torchrun of {os.environ['WORLD_SIZE']} processes",
                          hint="drop --nproc when launching with torchrun yourself")
    world = int(os.environ["WORLD_SIZE"]) if launched else (request.nproc or 1)
    return Layout(**sizes, world_size=world, nproc=request.nproc)


def _megatron_schedules() -> tuple[str, ...]:
    from nam_core.engine.megatron.schedule import MEGATRON_SCHEDULES

    return tuple(MEGATRON_SCHEDULES)


def _schedules(host: PluginHost) -> dict[str, Any]:
    reg = host.registry("schedules")
    return {n: reg.get(n) for n in reg.names()}


def _check_megatron(spec: RunSpec, *, registered: dict | None = None, declared: Sequence[str] = ()):
    """The megatron engine's layout and lowering checks, and the lowering. Before activation (``registered``
    None) a plugin schedule is taken on trust if a requested plugin declares it (``declared``) and lowered
    with Megatron's layout; after it, the lowering is made from the registered schedule's instance, so its
    chunks and stages are the schedule's."""
    from nam56r.megatron.lowering import check_lowering, lower
    from nam_core.engine import megatron as meg

    train, lay = spec.train, spec.layout
    schedule = (meg.schedule_for(train.schedule, pp=lay.pp, registered=registered) if registered is not None
                else train.schedule)
    lowering = lower(spec.model, tp=lay.tp, pp=lay.pp, ep=lay.ep, micro_batch_size=train.micro_batch_size,
                     schedule=schedule, bf16=train.dtype == "bfloat16", dispatcher=train.moe_dispatcher)
    meg.check_layout(world_size=lay.world_size, tp=lay.tp, pp=lay.pp, ep=lay.ep, train=train,
                     registered_schedules=registered if registered is not None else {train.schedule: None})
    check_lowering(lowering, registered_schedules=registered if registered is not None
                   else dict.fromkeys(declared))
    return lowering
