"""Entry point of the index-cache plugin: declarations and hooks (the host parses the option and writes the
selected row). Requesting it selects ``indexer_backend=index-cache``; with lemyx requested too, lemyx wraps it
and runs it after its warm-up. Torch and the model are imported inside hook bodies."""

from __future__ import annotations

from nam_core import NamError, PluginInfo, hookimpl
from nam_core.checks import Measured, ShapeCheck
from nam_core.options import Option

NAME = "index-cache"
PLUGIN = PluginInfo(
    summary="index-cache: Shared DSA layers reuse the nearest earlier Full layer's top-k "
            "(FSSFSSFSS: 67% of indexer work saved); pure PyTorch",
    provides={"indexer": [NAME]},
    selects={"indexer_backend": NAME},
    options=(Option("pattern", str, None, "F (computes its top-k) or S (reuses the nearest earlier F's) per DSA "
                    "layer, the first F; unset: Full every third DSA layer (FSSFSSFSS)"),),
    # Asked whether or not the run uses it: a requested plugin's option is checked as the user wrote it.
    checks=(ShapeCheck("pattern", "one F or S per DSA layer, the first F",
                       "nam_plugin_index_cache.plugin:pattern_check", "", when=lambda spec: True),),
)


def dsa_layers(model) -> int:
    from nam56r.pattern import resolve

    return resolve(model.pattern, model.num_layers, model.mla_attention_ranks).counts()["dsa"]


def describe(pattern: str) -> str:
    from nam_plugin_index_cache.cache import SHARED, saved_fraction

    return (f"{pattern}: {pattern.count(SHARED)} of {len(pattern)} DSA layers reuse a Full layer's top-k; "
            f"indexer work saved {saved_fraction(pattern):.0%}")


def pattern_check(spec) -> Measured:
    """The run's ``index-cache.pattern`` (or the default) against its DSA layers."""
    from nam_plugin_index_cache.cache import default_pattern, pattern_problem

    n, given = dsa_layers(spec.model), spec.options[NAME].pattern
    pattern = default_pattern(n) if given is None else given.strip()
    problem = pattern_problem(pattern, n)
    return Measured(problem is None, f"{NAME}.pattern={pattern!r}: {problem}" if problem else describe(pattern),
                    f"one F or S per DSA layer ({n}), the first F", f"--set {NAME}.pattern={default_pattern(n)}  "
                    "(the default)")


@hookimpl
def nam_register_indexer_backends(register):
    from nam_plugin_index_cache.cache import IndexCache

    register(NAME, IndexCache)


def _strategy(run):
    """The run's IndexCache (directly, or wrapped); None only when the run does not use index-cache."""
    from nam_plugin_index_cache.cache import IndexCache

    strategy = run.find("indexer", IndexCache)
    if strategy is None and run.spec.runs("indexer", NAME):
        raise NamError(f"{NAME} is selected but the run's indexer backends are "
                       f"{[type(b).__name__ for b in run.backends_of('indexer')]}", hint="report it")
    return strategy


@hookimpl
def nam_after_step(step, run, metrics):
    """Announce the pattern once the strategy has selected (not before: a warm-up that wraps it, lemyx's, keeps
    the DSA layers dense until its hand-over), then pass on its miss notes."""
    strategy = _strategy(run)
    if strategy is None:
        return
    if strategy.selections and not strategy.announced:
        strategy.announced, strategy.first_step = True, step
        run.note(f"{NAME}: {describe(strategy.pattern_for(dsa_layers(run.spec.model)))}")
    while strategy.notes:
        run.note(strategy.notes.pop(0))


@hookimpl
def nam_run_report(run):
    """What the strategy did, from its counts: the share of top-k selections that reused a Full layer's (MTP
    layers and misses compute their own), or that it never ran, and why when a warm-up held it off."""
    strategy = _strategy(run)
    if strategy is None:
        return None
    if not strategy.selections:
        outer = [b for b in run.backends_of("indexer") if callable(getattr(b, "warming_up", None))]
        why = (f": '{getattr(outer[0], 'name', type(outer[0]).__name__)}' warmed up (dense attention) to the last "
               f"step, {run.step}, so no DSA layer asked it for a top-k" if outer and outer[0].warming_up() else
               ": no DSA layer asked it for a top-k")
        return f"{NAME}: did nothing in this run{why}; no indexer work saved"
    share = strategy.reused / strategy.selections
    return (f"{NAME}: selected from step {strategy.first_step + 1} to {run.step}: {strategy.reused} of "
            f"{strategy.selections} top-k selections reused a Full layer's ({share:.0%} of indexer work saved)")
