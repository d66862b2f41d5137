"""PluginHost: discover installed plugins, activate requested ones all-or-nothing, expose the registries.

Installed is not active: discovery reads entry points (group ``nam.plugins``) and imports nothing. Only the
names requested through ``--plugins``, the recipe or ``NAM_PLUGINS`` are imported. ``evaluate`` then runs
every check (installed, importable, declared, conflicts, requirements, hook names, config checks, launch
checks, registration) and collects *every* failure; ``activate`` registers all plugins only when there are
none, and otherwise raises one ``PluginActivationError`` listing them. ``nam preflight`` and ``nam train``
share this code, so preflight shows exactly what training would refuse.
"""

from __future__ import annotations

import importlib.metadata
import os
import types
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import pluggy

from nam_core import checks, hookspecs
from nam_core.cache import use_kernel_caches
from nam_core.device import DeviceInfo
from nam_core.errors import CannotRunHere, PluginActivationError
from nam_core.kinds import RENAMED, Kind, installed_kinds, provider_hookspecs
from nam_core.plugin import PluginInfo
from nam_core.registry import Registry, RegistrationError
from nam_core.requirements import FAIL, PASS, SKIP, Check
from nam_core.run import RunSpec, StepContext

ENV_PLUGINS = "NAM_PLUGINS"


@dataclass(frozen=True)
class InstalledPlugin:
    """An entry point in ``nam.plugins``: known by name, not imported."""

    name: str
    entry_point: importlib.metadata.EntryPoint
    distribution: str | None
    version: str | None

    def load(self) -> types.ModuleType:
        return self.entry_point.load()


def discover() -> dict[str, InstalledPlugin]:
    """Every installed plugin, by entry-point name. Imports nothing. A name that two installed distributions
    register is refused: which one ran would depend on the order of ``sys.path``."""
    found: dict[str, InstalledPlugin] = {}
    for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        dist = ep.dist
        plugin = InstalledPlugin(ep.name, ep, dist.metadata["Name"] if dist else None, dist.version if dist else None)
        first = found.setdefault(ep.name, plugin)
        if first is not plugin and (first.distribution, first.entry_point.value) != (plugin.distribution, ep.value):
            both = " and ".join(f"{p.distribution} {p.version} ({p.entry_point.value})" for p in (first, plugin))
            raise CannotRunHere(
                f"plugin {ep.name!r} is registered by two installed distributions: {both}; nam cannot tell "
                "which one to run",
                hint=f"pip uninstall the one you do not want: pip uninstall {plugin.distribution or first.distribution}")
    return dict(sorted(found.items()))


def requested_plugins(*sources: Iterable[str] | str | None, env: bool = True) -> list[str]:
    """Merge plugin names from the given sources and ``NAM_PLUGINS``, keeping first-seen order."""
    names: list[str] = []
    all_sources = list(sources) + ([os.environ.get(ENV_PLUGINS)] if env else [])
    for src in all_sources:
        if not src:
            continue
        items = src.split(",") if isinstance(src, str) else src
        for item in items:
            item = item.strip()
            if item and item not in names:
                names.append(item)
    return names


def not_installed_hint(name: str, installed: Iterable[str]) -> str:
    """What to do about a requested plugin that is not installed. Only a plugin this checkout holds gets an
    install command (its folder): a guessed ``pip install nam-plugin-<name>`` would name a package that may not
    exist, or worse, someone else's. Otherwise: the close installed names, and where the list is."""
    import difflib
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "plugins" / f"nam-plugin-{name}"
    if (folder / "pyproject.toml").is_file():
        return f"install it from this checkout: pip install -e {folder}  (then `nam plugins list`)"
    close = difflib.get_close_matches(name, list(installed), n=3)
    did = f"did you mean {', '.join(close)}? " if close else ""
    return f"{did}{name!r} is not a nam plugin known here; `nam plugins list` shows the installed ones"


@dataclass
class Evaluation:
    """The outcome of evaluating a set of requested plugins: every check, and what would be registered."""

    requested: list[str]
    device: DeviceInfo
    checks: list[Check] = field(default_factory=list)
    modules: dict[str, types.ModuleType] = field(default_factory=dict)
    pm: pluggy.PluginManager | None = None
    registries: dict[str, Registry] = field(default_factory=dict)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def ok(self) -> bool:
        return not self.failures


class PluginHost:
    """Owns one pluggy PluginManager and the registries of the plugins it activated."""

    def __init__(self, installed: dict[str, InstalledPlugin] | None = None, kinds: Sequence[Kind] | None = None):
        self.installed = discover() if installed is None else installed
        self.kinds: dict[str, Kind] = {k.name: k for k in (installed_kinds() if kinds is None else kinds)}
        """Every kind a plugin may provide: the core's and the installed model's table (``nam_core.kinds``)."""
        self.pm = self._new_manager()
        self.registries = {kind: Registry(kind, providers=self.providers_of) for kind in self.kinds}
        self.active: dict[str, types.ModuleType] = {}
        self.spec: RunSpec | None = None
        """The run the active plugins were checked against (None: activated without a run)."""
        self._info_cache: dict[str, PluginInfo | None] = {}

    # --- activation ---------------------------------------------------------------------------------
    def evaluate(self, names: Iterable[str], device: DeviceInfo, config: RunSpec | None = None) -> Evaluation:
        """Run every activation check for ``names`` (against the run ``config``, when there is one) and collect
        the results; register nothing."""
        if config is not None and not isinstance(config, RunSpec):
            raise TypeError(f"PluginHost.evaluate: config must be a nam_core.run.RunSpec (the composition root "
                            f"builds one: nam56r.run.resolve), found {type(config).__name__}")
        ev = Evaluation(requested=list(dict.fromkeys(names)), device=device)
        use_kernel_caches()  # before a plugin imports a kernel compiler: its disk cache is then nam's folder
        for name in ev.requested:
            module = self._load_checked(name, ev)
            if module is not None:
                ev.modules[name] = module
        self._check_conflicts(ev)
        for name, module in ev.modules.items():
            for req in module.PLUGIN.requires:
                ev.checks.append(req.check(name, device))
        pm = self._new_manager()
        for name, module in list(ev.modules.items()):
            self._register_checked(pm, name, module, ev)
        ev.pm = pm
        if config is not None:
            self._check_providers(ev, config)
            for name, module in ev.modules.items():
                ev.checks.extend(self._selection_rows(name, module.PLUGIN, config))
        self._run_check_hooks(ev, config)
        if ev.ok:
            ev.registries = self._fill_registries(ev)
        return ev

    def activate(self, names: Iterable[str], device: DeviceInfo, config: RunSpec | None = None) -> Evaluation:
        """Activate all of ``names`` or none: raises ``PluginActivationError`` listing every failure."""
        if self.active:
            raise RuntimeError("this PluginHost already activated plugins; use a fresh host per run")
        ev = self.evaluate(names, device, config)
        if not ev.ok:
            raise PluginActivationError(ev.failures)
        self.pm, self.active, self.spec = ev.pm, dict(ev.modules), config
        for kind, reg in ev.registries.items():
            self.registries[kind] = reg
        return ev

    def _load_checked(self, name: str, ev: Evaluation) -> types.ModuleType | None:
        plugin = self.installed.get(name)
        if plugin is None:
            listed = ", ".join(self.installed) or "none"
            ev.checks.append(Check(
                name, "installed", FAIL, f"an installed plugin named {name!r}", f"installed: {listed}",
                not_installed_hint(name, self.installed),
            ))
            return None
        try:
            module = plugin.load()
        except Exception as e:  # an import failure of any kind is this plugin's activation failure
            ev.checks.append(Check(
                name, "import", FAIL, f"module {plugin.entry_point.value} imports",
                f"{type(e).__name__}: {e}", f"reinstall it: pip install --force-reinstall {plugin.distribution}",
            ))
            return None
        info = getattr(module, "PLUGIN", None)
        if not isinstance(info, PluginInfo):
            ev.checks.append(Check(
                name, "declaration", FAIL, "a module-level PLUGIN = PluginInfo(...)",
                f"PLUGIN = {info!r}", "see plugins/_template/ for the expected shape",
            ))
            return None
        unknown = sorted(set(info.provides) - set(self.kinds))
        if unknown:
            renamed = [f"{k!r} is now {RENAMED[k]!r}" for k in unknown if k in RENAMED]
            ev.checks.append(Check(
                name, "declaration", FAIL, f"PLUGIN.provides keys among the kinds: {', '.join(self.kinds)}",
                f"unknown kinds {', '.join(map(repr, unknown))}" + (f" ({'; '.join(renamed)})" if renamed else ""),
                "rename them (and the matching nam_register_... hooks) as nam_core/kinds.py and the model's kind "
                "table name them",
            ))
            return None
        ev.checks.append(Check(name, "import", PASS, "importable", plugin.version or "?"))
        return module

    def _check_conflicts(self, ev: Evaluation) -> None:
        seen: set[frozenset] = set()
        for name, module in ev.modules.items():
            for other in module.PLUGIN.conflicts:
                pair = frozenset((name, other))
                if other in ev.modules and pair not in seen:
                    seen.add(pair)
                    why = module.PLUGIN.conflict_reason or "declared incompatible"
                    ev.checks.append(Check(
                        name, f"conflicts with {other}", FAIL, f"not together with {other}",
                        f"both requested ({why})", f"activate only one of {name}, {other}",
                    ))

    def _register_checked(self, pm: pluggy.PluginManager, name: str, module, ev: Evaluation) -> None:
        try:
            pm.register(module, name=name)
            pm.check_pending()
        except pluggy.PluginValidationError as e:
            if pm.is_registered(module):
                pm.unregister(module)
            ev.checks.append(Check(
                name, "hooks", FAIL, "hook implementations matching nam's hookspecs", str(e),
                "fix the hook's name or arguments (nam_core/hookspecs.py lists them)",
            ))
            del ev.modules[name]

    def _check_providers(self, ev: Evaluation, spec: RunSpec) -> None:
        """Every implementation the run names has a provider among the plugins being activated."""
        chosen = [(kind, name, "") for kind, name in spec.backends.items()]
        chosen += [(kind, name, " (wrapped)") for kind, name in spec.wrapped.items()]
        for kind, name, how in chosen:
            if any(name in m.PLUGIN.provides.get(kind, ()) for m in ev.modules.values()):
                continue
            k = self.kinds.get(kind)
            field_name = k.field if k is not None and k.field else kind
            providers = self.providers_of(kind, name)
            if providers:
                found, hint = (f"provided by plugin {providers[0]!r}, which is not requested",
                               f"add --plugins {providers[0]}")
            else:
                found = f"no installed plugin provides {kind} {name!r}"
                hint = "`nam plugins list` shows what each installed plugin provides"
                if k is not None and k.default:
                    hint += f"; or --set {field_name}={k.default}"
            ev.checks.append(Check("run", f"{field_name}{how}", FAIL, f"an active plugin providing {kind} {name!r}",
                                   found, hint))

    def _selection_rows(self, name: str, info: PluginInfo, spec: RunSpec) -> list[Check]:
        """The plugin's "selected" row (what of it the run uses, or "active but unused") and, when used, its
        ``train_device`` / ``train_dtypes`` against the run's."""
        fielded = [(self.kinds[k], list(names)) for k, names in info.provides.items()
                   if k in self.kinds and self.kinds[k].field and names]
        if not fielded:
            return []
        used = [f"{k.field}={n}" for k, names in fielded for n in names if spec.runs(k.name, n)]
        kind, names = fielded[0]
        current = spec.backends.get(kind.name, kind.default)
        if not used:
            return [Check(name, "selected", SKIP, f"{kind.field}={names[0]}", f"{kind.field}={current}: active but "
                          "unused", hint=f"--set {kind.field}={names[0]}")]
        rows = [Check(name, "selected", PASS, "a backend this run uses", ", ".join(used))]
        alt = f"or run without {name}: --set {kind.field}={kind.default}" if kind.default else f"or drop --plugins {name}"
        why = f" ({info.train_needs_reason})" if info.train_needs_reason else ""
        if info.train_device and spec.train.device != info.train_device:
            rows.append(Check(name, "train.device", FAIL, f"train.device={info.train_device}{why}",
                              f"train.device={spec.train.device}", f"--device {info.train_device}, {alt}"))
        if info.train_dtypes and spec.train.dtype not in info.train_dtypes:
            rows.append(Check(name, "train.dtype", FAIL, f"train.dtype {' or '.join(info.train_dtypes)}{why}",
                              f"train.dtype={spec.train.dtype}", f"--set train.dtype={info.train_dtypes[0]}, {alt}"))
        return rows

    def _run_check_hooks(self, ev: Evaluation, config: RunSpec | None) -> None:
        """Config rows (the plugin's hook, then its declared ``ShapeCheck`` rows), then launch rows (declared
        ``LaunchCheck`` rows, then the hook) on a real device, for a plugin none of whose rows failed."""
        for name, module in ev.modules.items():
            if config is None:
                break  # config rules need a run; `nam preflight` without one judges the device alone
            caller = _only(ev.pm, module, "nam_check_config")
            ev.checks.extend(_collect(name, "config", lambda: caller(config=config, device=ev.device)))
            ev.checks.extend(checks.config_rows(name, module.PLUGIN, config))
        for name, module in ev.modules.items():
            declared = any(isinstance(c, checks.LaunchCheck) for c in module.PLUGIN.checks)
            if not hasattr(module, "nam_preflight") and not declared:
                continue
            if ev.device.is_fake:
                ev.checks.append(Check(
                    name, "launch checks", SKIP, "a real device", f"profile {ev.device.profile_name}",
                ))
                continue
            if any(c.status == FAIL for c in ev.checks if c.plugin == name):
                continue  # never launch kernels on a device the declared requirements already refused
            ev.checks.extend(checks.launch_rows(name, module.PLUGIN, config))
            caller = _only(ev.pm, module, "nam_preflight")
            ev.checks.extend(_collect(name, "launch", lambda: caller(device=ev.device, config=config)))

    def _fill_registries(self, ev: Evaluation) -> dict[str, Registry]:
        registries = {kind: Registry(kind, providers=self.providers_of) for kind in self.kinds}
        for name, module in ev.modules.items():
            for kind, hook_name in ((k.name, k.hook) for k in self.kinds.values()):
                reg = registries[kind]
                reg._open(name, set(module.PLUGIN.provides.get(kind, ())))
                try:
                    for impl, path in module.PLUGIN.classes(kind).items():
                        reg(impl, checks.load(path))
                    _only(ev.pm, module, hook_name)(register=reg)
                except RegistrationError as e:
                    ev.checks.append(Check(name, f"register {kind}", FAIL, "consistent registration", str(e)))
                finally:
                    reg._close()
            missing = [
                f"{kind} {n!r}" for kind, ns in module.PLUGIN.provides.items() for n in ns if n not in registries[kind]
            ]
            if missing:
                ev.checks.append(Check(
                    name, "provides", FAIL, "every declared name registered", f"never registered: {', '.join(missing)}",
                ))
        return registries

    # --- access ---------------------------------------------------------------------------------------
    def registry(self, kind: str) -> Registry:
        return self.registries[kind]

    def info(self, name: str) -> PluginInfo | None:
        """The PluginInfo of an installed plugin (imports its module), or None if it cannot be loaded."""
        if name not in self._info_cache:
            ev = Evaluation(requested=[name], device=DeviceInfo.profile("cpu"))
            module = self._load_checked(name, ev)
            self._info_cache[name] = module.PLUGIN if module is not None else None
        return self._info_cache[name]

    def providers_of(self, kind: str, impl_name: str) -> list[str]:
        """Installed plugins whose declaration says they provide ``impl_name`` of ``kind``."""
        return [
            n for n in self.installed
            if (info := self.info(n)) is not None and impl_name in info.provides.get(kind, ())
        ]

    def declared_patches(self, name: str) -> list:
        """Registry entries of the patches plugin ``name`` registers, loaded without activating it.

        For listing (``nam patches``): a plugin whose device requirements fail here still shows its patches.
        """
        ev = Evaluation(requested=[name], device=DeviceInfo.profile("cpu"))
        if self._load_checked(name, ev) is None:
            raise PluginActivationError(ev.failures)
        info = self.info(name)
        pm = self._new_manager()
        module = self.installed[name].load()
        pm.register(module, name=name)
        reg = Registry("patches")
        reg._open(name, set(info.provides.get("patches", ())))
        try:
            pm.hook.nam_register_patches(register=reg)
        finally:
            reg._close()
        return list(reg)

    def transform_model(self, model, spec: RunSpec | None) -> list[str]:
        """Every active plugin's ``nam_transform_model`` on ``model``; the lines they return (what changed)."""
        if spec is None:
            raise TypeError("transform_model needs the activated run's RunSpec (nam56r.run builds it)")
        return [line for line in self.pm.hook.nam_transform_model(model=model, spec=spec) if line]

    def before_step(self, step: int, run: StepContext) -> None:
        self.pm.hook.nam_before_step(step=step, run=_context(run))

    def after_step(self, step: int, run: StepContext, metrics: dict) -> None:
        self.pm.hook.nam_after_step(step=step, run=_context(run), metrics=metrics)

    def run_report(self, run: StepContext) -> list[str]:
        """Every active plugin's ``nam_run_report`` line (what it did in the run that just ended)."""
        return [line for line in self.pm.hook.nam_run_report(run=_context(run)) if line]

    def _new_manager(self) -> pluggy.PluginManager:
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        static = {n for n in dir(hookspecs) if n.startswith("nam_")}
        pm.add_hookspecs(provider_hookspecs([k for k in self.kinds.values() if k.hook not in static], hookspecs.PROJECT))
        return pm


def _context(run: StepContext) -> StepContext:
    """Lifecycle hooks receive a ``StepContext``, which every engine builds (``LocalRun.context``,
    ``MegatronRun.context``); anything else is an engine bug, refused before a plugin reads it."""
    if not isinstance(run, StepContext):
        raise TypeError(f"lifecycle hooks need a nam_core.run.StepContext; the engine passed a {type(run).__name__}")
    return run


def _only(pm: pluggy.PluginManager, module, hook_name: str):
    """A caller of ``hook_name`` restricted to one plugin, so results are attributed to it."""
    others = [p for p in pm.get_plugins() if p is not module]
    return pm.subset_hook_caller(hook_name, remove_plugins=others)


def _collect(plugin: str, what: str, call) -> list[Check]:
    try:
        results = call()
    except Exception as e:  # a plugin's check that crashes has failed; activation must stop, not skip it
        return [Check(plugin, f"{what} check", FAIL, "the check to run", f"it raised {type(e).__name__}: {e}")]
    rows = []
    for result in results:
        for check in result or ():
            if not isinstance(check, Check):
                check = Check(plugin, f"{what} check", FAIL, "Check objects", repr(check))
            rows.append(check)
    return rows
