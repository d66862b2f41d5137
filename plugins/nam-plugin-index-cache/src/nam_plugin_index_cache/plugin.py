"""Entry point of the index-cache plugin: what it declares and the hooks it implements.

How the configured pattern reaches the strategy. The model instantiates registry classes with no arguments
and provider hooks get no config, but the host calls ``nam_check_config`` before ``nam_register_indexers``
within one activation (``PluginHost.evaluate``). So the config check validates ``index-cache.pattern`` and
leaves it in ``_validated``; the provider hook takes it from there and registers ``IndexCache.bound_to(it)``,
a subclass whose no-argument instances use that pattern. Nothing is read at instantiation time, and the next
activation's check replaces the value before its own registration.

Keep this module light: torch and the model are imported inside hook bodies, so ``nam plugins list`` reads
``PLUGIN`` without them.
"""

from __future__ import annotations

from nam_core import Check, PluginInfo, hookimpl
from nam_core.requirements import FAIL, PASS, SKIP

NAME = "index-cache"
OPTION_PATTERN = f"{NAME}.pattern"
OPTIONS = (OPTION_PATTERN,)

PLUGIN = PluginInfo(
    summary="index-cache: Shared DSA layers reuse the nearest earlier Full layer's top-k "
            "(FSSFSSFSS: 67% of indexer work saved); pure PyTorch",
    provides={"indexers": [NAME]},
    requires=(),  # pure PyTorch: runs wherever the model runs, CPU or GPU
)

_validated: str | None = None
"""The pattern the last config check accepted (None: the default rule), for the provider hook."""


def dsa_layer_count(model_cfg) -> int:
    from nam56r.pattern import resolve

    return resolve(model_cfg.pattern, model_cfg.num_layers, model_cfg.mla_attention_ranks).counts()["dsa"]


def describe(pattern: str) -> str:
    """``FSSFSSFSS: 6 of 9 DSA layers reuse a Full layer's top-k; indexer work saved 67%``."""
    from nam_plugin_index_cache.cache import SHARED, saved_fraction

    return (f"{pattern}: {pattern.count(SHARED)} of {len(pattern)} DSA layers reuse a Full layer's top-k; "
            f"indexer work saved {saved_fraction(pattern):.0%}")


@hookimpl
def nam_check_config(config, device):
    from nam_plugin_index_cache.cache import default_pattern, pattern_problem

    global _validated
    _validated = None
    if config is None:
        return []
    checks = []
    options = config.train.plugin_options
    unknown = sorted(k for k in options if k.startswith(f"{NAME}.") and k not in OPTIONS)
    if unknown:
        checks.append(Check(NAME, "options", FAIL, f"options {', '.join(OPTIONS)}", f"{', '.join(unknown)}",
                            hint=f"--set {OPTION_PATTERN}=FSSFSSFSS"))
    n_dsa = dsa_layer_count(config.model)
    raw = options.get(OPTION_PATTERN)
    pattern = default_pattern(n_dsa) if raw is None else str(raw).strip()
    needed = f"one F or S per DSA layer ({n_dsa}), the first F"
    problem = pattern_problem(pattern, n_dsa)
    if problem is not None:
        checks.append(Check(NAME, "pattern", FAIL, needed, f"{OPTION_PATTERN}={pattern!r}: {problem}",
                            hint=f"--set {OPTION_PATTERN}={default_pattern(n_dsa)}  (the default)"))
        return checks
    _validated = None if raw is None else pattern
    checks.append(Check(NAME, "pattern", PASS, needed, describe(pattern)))
    if config.model.indexer != NAME:
        checks.append(Check(NAME, "selected", SKIP, f"indexer={NAME}", f"indexer={config.model.indexer}: "
                            "active but unused", hint=f"--set indexer={NAME}"))
    return checks


@hookimpl
def nam_register_indexers(register):
    from nam_plugin_index_cache.cache import IndexCache

    register(NAME, IndexCache.bound_to(_validated))


def _strategy(run):
    from nam_plugin_index_cache.cache import IndexCache

    backends = getattr(run.model, "backends", None)
    indexer = getattr(backends, "indexer", None)
    return indexer if isinstance(indexer, IndexCache) else None


@hookimpl
def nam_before_step(step, run):
    strategy = _strategy(run)
    if strategy is None or strategy.announced or run.log is None:
        return
    strategy.announced = True
    n_dsa = sum(1 for layer in run.model.layers if layer.spec.kind == "dsa")
    run.log.note(f"{NAME}: {describe(strategy.pattern_for(n_dsa))}")


@hookimpl
def nam_after_step(step, run, metrics):
    strategy = _strategy(run)
    if strategy is None or run.log is None:
        return
    while strategy.notes:
        run.log.note(strategy.notes.pop(0))
