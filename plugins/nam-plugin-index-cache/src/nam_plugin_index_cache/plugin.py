"""Entry point of the index-cache plugin: what it declares and the hooks it implements.

Requesting the plugin selects its strategy (``PluginInfo.selects``: ``indexer=index-cache``) unless the user
sets ``indexer`` themselves; with lemyx requested too, lemyx wraps it and runs it after its warm-up. The
config check validates ``index-cache.pattern``; the engine builds the strategy with ``IndexCache.build(ctx)``,
which reads the accepted option.

Keep this module light: torch and the model are imported inside hook bodies, so ``nam plugins list`` reads
``PLUGIN`` without them.
"""

from __future__ import annotations

from nam_core import Check, PluginInfo, hookimpl
from nam_core.requirements import FAIL, PASS, unused

NAME = "index-cache"
OPTION_PATTERN = f"{NAME}.pattern"  # same string as cache.OPTION_PATTERN
OPTIONS = (OPTION_PATTERN,)

PLUGIN = PluginInfo(
    summary="index-cache: Shared DSA layers reuse the nearest earlier Full layer's top-k "
            "(FSSFSSFSS: 67% of indexer work saved); pure PyTorch",
    provides={"indexers": [NAME]},
    requires=(),  # pure PyTorch: runs wherever the model runs, CPU or GPU
    selects={"indexer": NAME},
)


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
    checks.append(Check(NAME, "pattern", PASS, needed, describe(pattern)))
    # Used directly, or through a strategy that wraps it (lemyx: ``lemyx.sparse=index-cache``).
    if config.model.indexer != NAME and NAME not in options.values():
        checks.append(unused(NAME, "indexer", config.model.indexer))
    return checks


@hookimpl
def nam_register_indexers(register):
    from nam_plugin_index_cache.cache import IndexCache

    register(NAME, IndexCache)


def _strategy(run):
    from nam_plugin_index_cache.cache import IndexCache

    backends = getattr(run.model, "backends", None)
    indexer = getattr(backends, "indexer", None)
    indexer = getattr(indexer, "sparse", indexer)  # wrapped by another strategy (lemyx runs it after warm-up)
    return indexer if isinstance(indexer, IndexCache) else None


@hookimpl
def nam_before_step(step, run):
    strategy = _strategy(run)
    if strategy is None or strategy.announced or run.log is None:
        return
    strategy.announced = True
    from nam56r.pattern import resolve

    cfg = run.model.cfg  # the nam model (local engine) or NamMegatronModel (megatron engine): both carry it
    n_dsa = sum(1 for layer in resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks).layers
                if layer.symbol == "D")
    run.log.note(f"{NAME}: {describe(strategy.pattern_for(n_dsa))}")


@hookimpl
def nam_after_step(step, run, metrics):
    strategy = _strategy(run)
    if strategy is None or run.log is None:
        return
    while strategy.notes:
        run.log.note(strategy.notes.pop(0))
