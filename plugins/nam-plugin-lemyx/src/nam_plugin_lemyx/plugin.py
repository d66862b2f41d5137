"""Entry point of the lemyx plugin: what it declares and the hooks it implements.

Requesting the plugin selects the indexer strategy ``lemyx`` and *wraps* whatever strategy ``indexer_backend``
would otherwise hold (``full``, or ``index-cache`` when that plugin is requested too): lemyx runs the dense
warm-up, then hands the DSA layers to that strategy (``PluginInfo.wraps`` -> ``lemyx.sparse``). The host
parses the ``lemyx.*`` options (``PLUGIN.options``) and writes the selected row.

Backend choice is explicit and per device, never by what happens to be installed: on a CPU device the
reference path *is* the implementation (and preflight and the run log say so); on a CUDA device the fused
Triton kernel is required, needing sm_90 or newer and Triton, and activation fails with the reason unless
the user chose ``--set lemyx.backend=reference`` themselves.

This module stays light (no torch, no triton at import) so ``nam plugins list`` can read ``PLUGIN``.
"""

from __future__ import annotations

import dataclasses

from nam_core import Check, PluginInfo, Requirement, hookimpl
from nam_core.checks import LaunchCheck, ShapeCheck
from nam_core.requirements import FAIL, PASS
from nam_plugin_lemyx.options import NAME, OPTIONS, TRITON, option_problem, options_for, shape_problem

GPU_HINT = f"pip install 'nam-plugin-lemyx[gpu]' on a Hopper GPU, or choose the unfused path: --set {NAME}.backend=reference"
KERNEL_DTYPES = ("bfloat16", "float16")
"""The run dtypes the fused kernel takes (``kernel.fused_warmup`` refuses others)."""
KERNEL_NEEDS = (
    Requirement.cuda_capability((9, 0), reason="the fused kernel is built and tuned for Hopper (sm_90) and newer"),
    Requirement.package("triton>=3.3", install_hint=GPU_HINT),
)


def options_of(spec):
    """The run's ``lemyx.*`` options, the backend resolved for its device (``options.options_for``)."""
    return options_for(spec.options[NAME], spec.train.device)


def fused(spec) -> bool:
    """The run takes the fused Triton kernel (and its options can run at all)."""
    opts = options_of(spec)
    return opts.backend == TRITON and option_problem(opts) is None


def selected(spec) -> bool:
    """lemyx is the run's indexer strategy (not only requested), with options that can run."""
    return spec.runs("indexer", NAME) and option_problem(options_of(spec)) is None


def kernel_shapes(spec) -> tuple[bool, str]:
    model = spec.model
    problem = shape_problem(model.kv_lora_rank + model.qk_rope_dim, model.kv_lora_rank, model.index_head_dim)
    return problem is None, problem or (f"dk {model.kv_lora_rank + model.qk_rope_dim}, dv {model.kv_lora_rank}, "
                                        f"indexer {model.index_heads} x {model.index_head_dim}")


def schedule(spec) -> tuple[bool, str]:
    opts, total = options_of(spec), spec.train.total_steps
    never = (f"; warning: not before train.total_steps ({total}), so '{opts.sparse}' never runs"
             if opts.warmup_steps >= total else "")
    return True, f"{opts.warmup_steps} dense steps, then '{opts.sparse}'{never}"


def warmup_outlasts(strategy, max_steps: int | None) -> str | None:
    """The warning for a warm-up that does not end before the run stops (every DSA layer dense to the end, the
    wrapped strategy never runs), or None."""
    w = strategy.options.warmup_steps
    if max_steps is None or not strategy.warming_up() or w < max_steps:
        return None
    return (f"warning: {NAME}: the indexer warm-up ({w} steps) does not end before this run stops at step "
            f"{max_steps}: every DSA layer attends densely to the end and '{strategy.options.sparse}' never runs; "
            f"--set {NAME}.warmup_steps=N with N < {max_steps} hands over earlier")


PLUGIN = PluginInfo(
    summary="lemyx: DSA indexer warm-up, dense attention + indexer KL in one fused Triton pass "
            "(reference path on CPU), then hand-over to sparse",
    provides={"indexer": [NAME]},
    requires=(),  # per backend: the Triton kernel's needs are checked by nam_check_config (KERNEL_NEEDS)
    selects={"indexer_backend": NAME},
    wraps={"indexer_backend": f"{NAME}.sparse"},
    options=OPTIONS,
    checks=(
        ShapeCheck("kernel shapes", "head widths the kernel takes", kernel_shapes, f"--set {NAME}.backend=reference",
                   when=fused),
        ShapeCheck("schedule", "warm-up steps >= 0", schedule, "", when=selected),
        LaunchCheck("kernel launch", None, "nam_plugin_lemyx.selftest:launch",
                    f"report it; meanwhile --set {NAME}.backend=reference", when=fused),
    ),
)


@hookimpl
def nam_check_config(config, device):
    train_device = config.train.device
    opts = options_for(config.options[NAME], train_device)
    problem = option_problem(opts)
    if problem is not None:
        option, found, expected = problem
        return [Check(NAME, "options", FAIL, expected, f"{option}={found!r}", hint=f"--set {option}=... with {expected}")]
    checks = []
    if opts.backend == "reference":
        why = ("a CPU device: the pure-PyTorch path is the implementation" if train_device == "cpu"
               else "chosen by you: the unfused path, slower and with [b, s, s] fp32 scores")
        checks.append(Check(NAME, "backend", PASS, "triton on CUDA, reference on CPU or by name",
                            f"reference ({opts.backend_source}; {why})"))
    else:
        checks.append(Check(NAME, "backend", PASS, "triton on CUDA, reference on CPU or by name",
                            f"triton ({opts.backend_source}): fused kernel required"))
        for req in KERNEL_NEEDS:
            check = req.check(NAME, device)
            checks.append(check if check.ok else dataclasses.replace(check, hint=GPU_HINT))
        if config.train.dtype not in KERNEL_DTYPES:
            checks.append(Check(NAME, "train.dtype", FAIL, f"train.dtype {' or '.join(KERNEL_DTYPES)} (the fused "
                                "kernel's operands)", f"train.dtype={config.train.dtype}",
                                hint=f"--set train.dtype=bfloat16, or --set {NAME}.backend=reference"))
    model = config.model
    if opts.target == "per-head" and model.index_heads != model.attn_heads:
        checks.append(Check(NAME, "target", FAIL, "index heads == attention heads for the per-head target",
                            f"{model.index_heads} index heads, {model.attn_heads} attention heads",
                            hint=f"--set {NAME}.target=head-sum"))
    if opts.freeze_main and config.engine == "megatron":
        checks.append(Check(NAME, "freeze_main", FAIL,
                            "freeze_main=false on the megatron engine (its DDP buffers and distributed optimizer "
                            "keep updating parameters whose requires_grad is turned off)",
                            "freeze_main=true, engine=megatron", hint=f"--set {NAME}.freeze_main=false"))
    if model.dsa_dense_warmup:
        checks.append(Check(NAME, "dense warm-up", FAIL, "dsa_dense_warmup=false (lemyx runs the dense stage)",
                            "dsa_dense_warmup=true", hint="--set dsa_dense_warmup=false"))
    return checks


def _strategy(run):
    """The run's Lemyx strategy; None only when the run does not use lemyx (fail closed otherwise)."""
    from nam_core import NamError
    from nam_plugin_lemyx.strategy import Lemyx

    strategy = run.find("indexer", Lemyx)
    if strategy is None and run.spec.runs("indexer", NAME):
        raise NamError(f"{NAME} is selected but the run's indexer backend is {type(run.backend('indexer')).__name__}",
                       hint="report it")
    return strategy


@hookimpl
def nam_before_step(step, run):
    strategy = _strategy(run)
    if strategy is None:
        return
    if not strategy.announced:
        strategy.announced = True
        run.note(f"{NAME}: {strategy.describe()}")
        warning = warmup_outlasts(strategy, run.max_steps)
        if warning is not None:
            run.note(warning)
    if strategy.at_step(step):
        _unfreeze(dict(run.parameters()), strategy)
        run.note(f"{NAME}: step {step}: indexer warm-up over after {strategy.options.warmup_steps} steps; DSA layers "
                 f"now attend to their top-{run.spec.model.index_topk} keys chosen by '{strategy.options.sparse}'")
    elif strategy.warming_up() and strategy.options.freeze_main:
        _freeze(dict(run.parameters()), strategy)


@hookimpl
def nam_run_report(run):
    """The warm-up and the hand-over as they happened in this run."""
    strategy = _strategy(run)
    if strategy is None:
        return None
    o = strategy.options
    if strategy.handed_over_at is not None:
        return (f"{NAME}: dense warm-up until step {strategy.handed_over_at}, then '{o.sparse}' to step {run.step}")
    if strategy.warming_up():
        return (f"{NAME}: dense warm-up to the last step, {run.step} (warm-up {o.warmup_steps} steps): no "
                f"hand-over to '{o.sparse}' in this run")
    return f"{NAME}: no warm-up in this run ({NAME}.warmup_steps={o.warmup_steps}): '{o.sparse}' throughout"


def _freeze(params, strategy) -> None:
    """Everything but the DSA indexers stops training (requires_grad off) until the hand-over."""
    if getattr(strategy, "frozen", None):
        return
    strategy.frozen = [n for n, p in params.items() if p.requires_grad and ".indexer." not in n]
    for n in strategy.frozen:
        params[n].requires_grad_(False)


def _unfreeze(params, strategy) -> None:
    if not getattr(strategy, "frozen", None):  # nothing frozen (always so on the megatron engine)
        return
    for n in getattr(strategy, "frozen", None) or []:
        params[n].requires_grad_(True)
    strategy.frozen = []


@hookimpl
def nam_register_indexer_backends(register):
    from nam_plugin_lemyx.strategy import Lemyx

    register(NAME, Lemyx)
