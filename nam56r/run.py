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
from pathlib import Path
from typing import Any, Callable, Sequence

from nam56r import memory
from nam56r.config import NAM56RConfig
from nam56r.kinds import BACKEND_KINDS
from nam56r.recipes import Recipe, apply_overrides, get_recipe
from nam_core import bounds, selection
from nam_core.device import DeviceInfo
from nam_core.engine.config import ENGINES, MEGATRON_ONLY, TrainConfig, recompute_kinds
from nam_core.engine.contract import Engine, EngineRun, HookChain, Ranks
from nam_core.errors import CannotRunHere, ConfigError, PluginActivationError
from nam_core.host import Evaluation, PluginHost, requested_plugins
from nam_core.run import Layout, RunSpec

BUILTIN_PLUGINS = ("reference",)
"""nam56r's own plugin, active in every run: the provider of every kind's default."""
LOCAL_SCHEDULES = ("single",)
"""The local engine runs micro-batches one after the other and nothing else."""
BATCH_KEYS = ("tokens", "labels", "loss_mask", "segment_ids", "structure")
"""What NAM56R reads of a packed row (``nam_core.data.dataset.PackedSequences.batch_at`` gives more)."""


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
    world = (request.nproc or int(os.environ.get("WORLD_SIZE", "1"))) if request.engine == "megatron" else 1
    memory.check_lower_bound(rec.model, train, world=world)  # sizes no device could hold: exit 2
    check_values(rec.model, train, reference=base)
    steps = request.max_steps if request.max_steps is not None else train.total_steps
    if steps < 1:
        raise ConfigError(f"--max-steps must be >= 1, found {steps}", hint="--max-steps 80")
    options = {n: info.parse_options(n, train.plugin_options) for n, info in infos.items()}
    layout = _layout(request, train, selected={k[len(selection.TRAIN):] for info in infos.values()
                                               for k in info.selects if k.startswith(selection.TRAIN)})
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
    from nam_core.engine.summary import note_self_tests

    note_self_tests(host.activate(spec.plugins, device, spec).checks)
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


@dataclass
class Session:
    """A built run: what ``build`` made from an activated ``Run``, everything an engine needs."""

    run: Run
    host: PluginHost
    engine: Engine
    ranks: Ranks
    device: DeviceInfo
    patches: list
    """The patch lane's reports (``nam_core.patches.PatchReport``), applied for this process."""
    backends: Any
    """``nam56r.model.Backends``: the backend object of every kind."""
    flops_per_token: float
    model: Any
    """Local engine: a ``LocalModel`` on the run's device, built by ``trainable()`` (after the run folder has
    accepted the run, so a refused start allocates nothing); megatron engine: a ``NamMegatronModel`` (built on
    each rank by the engine); a dry run: NAM56R on the meta device (allocates nothing)."""
    notes: list[str]
    """Lines for the run log: how plugins changed the config, then what the blocks report while training."""
    data: Path | None = None
    batches: Callable[[int, int], dict] | None = None
    """``batches(index, batch_size)``: micro-batch ``index`` of the data (None on a dry run)."""
    held_out: Any = None
    """The validation rows (``HeldOut``) when ``train.eval_every`` asks for them."""
    say: Callable[[str], None] = lambda line: None
    init_from: Path | None = None
    optimizer_from: Any = None
    """AdamW's state the export at ``init_from`` carries (``nam56r.export.ExportedOptimizer``), or None."""

    def trainable(self):
        """The model the engine trains (the local engine's is built here, once, on first use)."""
        if self.model is None:
            spec = self.spec
            first = (f"the first step {'compiles kernels and ' if spec.train.device == 'cuda' else ''}warms up, so "
                     "it takes longer than the rest")
            self.say(f"building the model ({spec.train.dtype}, on {spec.train.device})")
            self.model = _local_model(spec, self.backends, self.notes, self.init_from)
            self.say(f"model: {sum(p.numel() for p in self.model.module.parameters()):,} parameters; {first}")
        return self.model

    @property
    def spec(self) -> RunSpec[NAM56RConfig]:
        return self.run.spec

    def record(self) -> dict:
        """What makes two runs the same run (config.json; every checkpoint's manifest): resuming under a
        different record is refused, except for the fields ``rundir.RESUMABLE`` names; a resume on data
        replaced under the same path is refused by the dataset's identity (its checksums); one on another number
        of processes by ``world_size`` (tp, pp and ep are train fields), before the run folder is written."""
        from nam_core.data.dataset import identity

        s = self.spec
        return {"recipe": s.recipe, "model": dataclasses.asdict(s.model), "train": dataclasses.asdict(s.train),
                "plugins": {n: self.host.installed[n].version for n in s.plugins},
                "data": str(Path(self.data).resolve()) if self.data is not None else None,
                "dataset": identity(self.data) if self.data is not None else None,
                "world_size": s.layout.world_size}

    def plugins_info(self) -> dict:
        """What ran (plugins.json): plugins and their distributions, backends, patches, versions, device."""
        import platform

        import torch

        installed = self.host.installed
        info = {"active": {n: {"distribution": installed[n].distribution, "version": installed[n].version}
                           for n in self.spec.plugins},
                "backends": {k: type(b).__name__ for k, b in self.backends.as_mapping().items()},
                "patches": [r.to_dict() for r in self.patches],
                "python": platform.python_version(), "torch": torch.__version__, "device": self.device.to_dict()}
        if self.spec.engine == "megatron":
            info["megatron"] = self.megatron_layout()
        return info

    def megatron_layout(self) -> dict:
        """The megatron engine's process count, parallel sizes and layer pattern (for the plan and plugins.json)."""
        lay, lowering = self.spec.layout, self.run.lowering
        return {"world_size": self.ranks.world_size, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep,
                "hybrid_layer_pattern": lowering.hybrid_layer_pattern}

    def engine_run(self, run_dir: Path, *, resume_from: Path | None = None, notes: Sequence[str] = (),
                   quiet: bool = False, again=None, hooks: Any = None, checkpoints: bool = True,
                   record: dict | None = None) -> EngineRun:
        """The ``EngineRun`` of this session in ``run_dir``. ``hooks``: lifecycle hooks that run after the
        plugins' (a benchmark's profiler); ``notes``: lines of the start (resume, restart) before the session's;
        ``record``: the identity the run folder recorded (``record()`` and the start's branch)."""
        schedules = self.host.registry("schedules")
        self.notes[:0] = list(notes)
        return EngineRun(
            run_dir=Path(run_dir), spec=self.spec, model=self.trainable(),
            host=HookChain(self.host, hooks) if hooks is not None else self.host,
            batch_at=self.batches,
            max_steps=self.run.max_steps, flops_per_token=self.flops_per_token,
            backends=self.backends.as_mapping(), schedules={n: schedules.get(n) for n in schedules.names()},
            held_out=self.held_out, record=record if record is not None else self.record(), resume_from=resume_from, quiet=quiet, notes=self.notes, again=again,
            checkpoints=checkpoints, optimizer_from=self.optimizer_from)


def build(run: Run, host: PluginHost, engine: Engine, ranks: Ranks = Ranks(), *, data: Path | None = None,
          dry_run: bool = False, quiet: bool = False, device: DeviceInfo | None = None,
          init_from: Path | None = None, batches: Callable[[int, int], dict] | None = None,
          say: Callable[[str], None] = lambda line: None, eval_data: Path | None = None) -> Session:
    """Stages 3 and 4 (the device, activation), then everything ``engine`` needs to train ``run``: the patch
    lane applied, the backends, FLOPs per token, the model or model provider, the data (rank 0 prepares it
    first; the other ranks wait), in that order, so a refusal comes before any allocation.

    ``device``: in place of the probed one (the gloo suite's double); ``init_from``: an export folder (``nam
    export``) or a nam ``model.pt`` the weights start from instead of nam's initialisation at the seed
    (``nam train --init-from``; the benches' shared initial state), read by ``nam56r.export.initial_weights``;
    ``batches``: rows in place of a dataset (the tests' fixed random rows); ``say(line)``: what is being done,
    before each slow part (``nam train`` prints it before the first step); ``eval_data``: a prepared dataset to
    evaluate on (``--eval-data``) in place of the training data's validation split."""
    from nam56r import memory
    from nam56r.flops import flops_per_token
    from nam56r.model import Backends, build_model
    from nam_core.engine.summary import mark as mark_phase
    from nam_core.patches import apply_all

    megatron = run.spec.engine == "megatron"
    if init_from is not None:  # a missing path or another model's export: refused before the self-tests
        from nam56r.export import check_init_from

        check_init_from(init_from, run.spec.model)
    device = device or run_device(run.spec, index=int(os.environ.get("LOCAL_RANK", "0")) if megatron else 0)
    run = activate(run, host, device)  # PluginActivationError (exit 3) lists every failed check
    mark_phase("self-tests")
    spec = run.spec
    memory.check_fits(spec, device)  # ConfigError (exit 2) with the plan's numbers: nothing allocated or written
    patches = apply_all(host.registry("patches"))
    backends = Backends.from_registries(host.registries, spec.model, options=spec.options, device=spec.train.device)
    session = Session(run=run, host=host, engine=engine, ranks=ranks, device=device, patches=patches,
                      backends=backends, flops_per_token=flops_per_token(spec.model).total, model=None,
                      notes=list(spec.notes), say=say, init_from=init_from)
    if init_from is not None:
        _init_notes(session, init_from)
    if dry_run:
        session.model = build_model(spec.model, backends, device="meta")  # it builds with these backends
        return session
    _announce(say, session)
    if megatron:
        say(f"building the model ({spec.train.dtype}, on {spec.train.device}); the first step compiles kernels "
            "and warms up, so it takes longer than the rest")
        session.model = _megatron_model(run, backends, host, init_from)
        mark_phase("model")
    if batches is not None:
        session.batches = batches
        return session
    say(f"data: {data}" if data is not None else
        "data: the Python standard library's source, tokenized once into nam's cache (reused after)")
    if not ranks.writes:
        engine.barrier()  # rank 0 prepares the data first (one writer into the cache)
    session.data, packed = _dataset(data, spec, quiet=quiet or not ranks.writes)
    if spec.model.structure_vocab > 0 and not packed.dataset.has_structure:  # in run.log, and on screen
        session.notes.append(f"warning: data: {session.data} carries no structure ids (prepared with "
                             "--no-structure, or from token shards): the model's structure embedding gets no input "
                             "and stays as initialised; prepare the data with them (nam data prepare SRC --out DIR) "
                             "to train it")
    if ranks.writes and megatron:
        engine.barrier()
    session.held_out = _held_out(spec, packed.dataset, eval_data)
    mark_phase("data")
    session.batches = lambda i, b: {k: v for k, v in packed.batch_at(i, b).items() if k in BATCH_KEYS}
    return session


def _announce(say: Callable[[str], None], session: Session) -> None:
    """The first lines of a run: what trains, where, with which plugins."""
    spec = session.spec
    layout = f", {spec.layout.world_size} processes" if spec.engine == "megatron" else ""
    say(f"nam train: recipe {spec.recipe} ({spec.model.num_layers} layers, hidden {spec.model.hidden}, "
        f"{session.flops_per_token / 1e9:.3g} GFLOPs/token), engine {spec.engine}{layout}, device {session.device.label}")
    say(f"plugins: {', '.join(spec.plugins)}; backends: "
        + ", ".join(f"{kind} {name}" for kind, name in spec.backends.items()))


def _init_notes(session: Session, init_from: Path) -> None:
    """``--init-from``: the optimizer state the export carries (refused for other numerics), and what the run
    says it takes from it."""
    from nam56r.export import initial_optimizer

    train = session.spec.train
    session.optimizer_from = initial_optimizer(init_from, numerics=train.optimizer_numerics, dtype=train.dtype)
    if session.optimizer_from is None:
        session.notes.append(f"weights from {init_from}; the optimizer, lr schedule and data start at step 0")
        return
    step = session.optimizer_from.step
    session.notes.append(f"weights and optimizer state ({session.optimizer_from.describe()}) from {init_from}: the "
                         f"run goes on at step {step + 1}, the lr schedule and the data at that step's place; not "
                         "carried: the RNG state (this run's seed) and the metrics before it")


def _local_model(spec: RunSpec, backends, notes: list[str], init_from: Path | None):
    import torch

    from nam56r import recompute
    from nam56r.model import build_model
    from nam56r.state import ForwardState
    from nam_core.engine.local import LocalModel

    torch.manual_seed(spec.train.seed)
    module = build_model(spec.model, backends, device=spec.train.device)
    if init_from is not None:
        from nam56r.export import initial_weights

        module.load_state_dict(initial_weights(init_from, spec.model))
    module = module.to(dtype=getattr(torch, spec.train.dtype))
    notes.extend(recompute.apply(module, recompute_kinds(spec.train)))  # train.recompute: checkpointed blocks

    def forward(batch: dict, micro_batch: int) -> dict:
        state = ForwardState(micro_batch=micro_batch, seq_layout=tuple(batch["tokens"].shape))
        out = module(**batch, state=state)
        notes.extend(state.log)  # the engine logs each distinct line once
        return out

    return LocalModel(module, forward)


def _megatron_model(run: Run, backends, host: PluginHost, init_from: Path | None):
    """NAM56R for the megatron engine from the activated run's lowering (``activate`` lowered it with the
    registered schedule and checked the layout), checked before anything is written."""
    from nam56r.megatron import NamMegatronModel

    model = NamMegatronModel(run.spec.model, backends, run.lowering, seed=run.spec.train.seed, init_from=init_from)
    model.check(registered_schedules=_schedules(host))
    return model


def _dataset(data: Path | None, spec: RunSpec, *, quiet: bool):
    """The prepared dataset ``data`` (default: the Python standard library corpus, prepared once into nam's
    cache) and its packed rows at the run's sequence length and seed."""
    from nam_core.data.dataset import PackedSequences, open_dataset

    if data is None:
        from nam56r.blocks.structure import char_structure_ids
        from nam_core.cache import cache_dir
        from nam_core.data.prepare import build_stdlib_corpus
        from nam_core.data.tokenizer import ByteTokenizer

        data = build_stdlib_corpus(cache_dir(), ByteTokenizer(), char_structure_ids, progress=not quiet)
    dataset = open_dataset(data)
    dataset.check_vocab(spec.model.vocab_size)
    return data, PackedSequences(dataset.split("train"), spec.model.seq_len, spec.train.seed)  # never held-out rows


def _held_out(spec: RunSpec, dataset, eval_data: Path | None):
    """The validation rows (nam_core/engine/validation.py) when ``train.eval_every`` asks for them: ``--eval-data``
    (a whole prepared dataset, the training data's tokenizer), else the training dataset's validation split.
    None when the run does not evaluate; DataError (exit 4) when it should and there is nothing to evaluate on."""
    from nam_core.data.dataset import PackedSequences, open_dataset
    from nam_core.engine.validation import HeldOut
    from nam_core.errors import DataError

    train, seq_len = spec.train, spec.model.seq_len
    if train.eval_every == 0:
        return None
    if eval_data is not None:
        held = open_dataset(eval_data)
        held.check_vocab(spec.model.vocab_size)
        if held.tokenizer != dataset.tokenizer:
            raise DataError(f"--eval-data {eval_data} was tokenized with {held.tokenizer.get('name')!r}, the "
                            f"training data {dataset.path} with {dataset.tokenizer.get('name')!r}",
                            hint=f"prepare it with the training data's tokenizer: nam data prepare SRC --out "
                                 f"{eval_data} --tokenizer ... --overwrite")
        source = str(held.path)
    elif dataset.validation_documents:
        held, source = open_dataset(dataset.path).split("validation"), f"{dataset.path}, validation split"
    else:
        raise DataError(f"train.eval_every={train.eval_every} needs held-out data; {dataset.path} holds none out",
                        hint=f"prepare it with a validation split (nam data prepare SRC --out {dataset.path} "
                             "--val-fraction 0.01 --overwrite), pass --eval-data DIR, or --set train.eval_every=0")
    rows = PackedSequences(held, seq_len, train.seed)
    return HeldOut(batch_at=lambda i, b: {k: v for k, v in rows.batch_at(i, b).items() if k in BATCH_KEYS},
                   rows=len(rows), seq_len=seq_len, source=source)


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


def _layout(request: RunRequest, train, *, selected: set[str] = frozenset()) -> Layout:
    """The layout, refusing one the engine cannot run (the megatron engine's full check is ``_check_megatron``),
    and on the local engine a megatron-engine train field off its default, unless a requested plugin selects that
    field (``selected``: the plugin's own rows refuse the engine then, e.g. deepep's)."""
    sizes = {"tp": train.tp, "pp": train.pp, "ep": train.ep}
    if request.engine == "local":
        if request.nproc is not None or set(sizes.values()) != {1}:
            raise ConfigError("--nproc and a parallel layout (--tp, --pp, --ep, train.tp/pp/ep) are megatron-engine "
                              f"options; the local engine runs one process on one device (found "
                              f"nproc={request.nproc}, {sizes})", hint="add --engine megatron, or drop them")
        default = TrainConfig()
        changed = {f: getattr(train, f) for f in MEGATRON_ONLY
                   if f not in selected and getattr(train, f) != getattr(default, f)}
        if changed:
            found = ", ".join(f"train.{f}={str(v).lower() if isinstance(v, bool) else v}" for f, v in changed.items())
            raise ConfigError(f"{found}: megatron-engine setting{'s' if len(changed) > 1 else ''} (Megatron's "
                              "dispatcher, DDP or optimizer), which the local engine would not apply",
                              hint="add --engine megatron, or drop " + " ".join(f"--set train.{f}=..." for f in changed))
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


def lowering_for(spec: RunSpec, *, schedule: Any = None):
    """NAM56R lowered for the megatron engine at ``spec``'s layout (the one place ``lower`` is called).
    ``schedule``: a registered schedule object (its chunks and stages), else ``train.schedule`` by name."""
    from nam56r.megatron.lowering import lower

    train, lay = spec.train, spec.layout
    return lower(spec.model, tp=lay.tp, pp=lay.pp, ep=lay.ep, micro_batch_size=train.micro_batch_size,
                 schedule=schedule if schedule is not None else train.schedule, bf16=train.dtype == "bfloat16",
                 dispatcher=train.moe_dispatcher, recompute=recompute_kinds(train),
                 transformer_engine=te_lowering(spec))


def te_lowering(spec: RunSpec):
    """Megatron's Transformer Engine modules for the lowering when the run has nam-plugin-te (its options
    ``te.fp8`` and ``te.experts``), else None (Megatron's local modules)."""
    from nam56r.megatron.lowering import TransformerEngine

    te = spec.options.get("te")
    return None if te is None else TransformerEngine(fp8=te.fp8, grouped_experts=te.experts == "grouped",
                                                     fp8_param_gather=te.fp8_param_gather, moe_fusion=te.moe_fusion)


def _check_megatron(spec: RunSpec, *, registered: dict | None = None, declared: Sequence[str] = ()):
    """The megatron engine's layout and lowering checks, and the lowering. Before activation (``registered``
    None) a plugin schedule is taken on trust if a requested plugin declares it (``declared``) and lowered
    with Megatron's layout; after it, the lowering is made from the registered schedule's instance, so its
    chunks and stages are the schedule's."""
    from nam56r.megatron.lowering import check_lowering
    from nam_core.engine import megatron as meg
    from nam_core.engine.megatron.checks import check_dispatcher

    train, lay = spec.train, spec.layout
    schedule = (meg.schedule_for(train.schedule, pp=lay.pp, registered=registered) if registered is not None
                else None)
    check_dispatcher(train.moe_dispatcher, spec.plugins)
    lowering = lowering_for(spec, schedule=schedule)
    meg.check_layout(world_size=lay.world_size, tp=lay.tp, pp=lay.pp, ep=lay.ep, train=train,
                     registered_schedules=registered if registered is not None else {train.schedule: None})
    check_lowering(lowering, registered_schedules=registered if registered is not None
                   else dict.fromkeys(declared))
    return lowering
