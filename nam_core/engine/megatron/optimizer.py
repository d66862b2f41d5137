"""Megatron's distributed optimizer for the run, and nam's learning-rate schedule on it.

What Megatron-Core's optimizer gets wrong or leaves slow without Transformer Engine or Apex (fp32 parameters in
mixed groups, torch AdamW's state on load, the unfused AdamW, the gradient norm's and clip's per-tensor host
syncs) is fixed in the patch lane (``nam_core.engine.megatron.patches``), applied around the run by
``loop.train``. With Transformer Engine installed Megatron's inner Adam is TE's FusedAdam instead (its step count
per parameter group, not per parameter): ``inner_adam`` tells them apart where nam reads or fills their state
(``fill_state`` here, the optimizer map in ``checkpoint``)."""

from __future__ import annotations

import torch

from nam_core.engine.config import TrainConfig
from nam_core.engine.megatron.schedule import PipelineSchedule
from nam_core.errors import ConfigError

NUMERICS_OPTIONS = {
    "fp32-master": {},  # Megatron's default: fp32 main params and fp32 moments, sharded by the distributed optimizer
    "bf16-moments": {"use_precision_aware_optimizer": True, "main_params_dtype": "float32",
                     "exp_avg_dtype": "bfloat16", "exp_avg_sq_dtype": "bfloat16", "store_param_remainders": True},
}
"""``train.optimizer_numerics`` -> Megatron's ``OptimizerConfig`` fields (megatron-core 0.19). bf16 moments are
its precision-aware optimizer, which only Transformer Engine's FusedAdam runs (``OptimizerConfig.__post_init__``
raises without it; ``checks.runtime_checks`` refuses it first). ``store_param_remainders`` is Megatron's default,
written out because the memory plan counts on it: a bf16 weight's fp32 master is kept as its 16 low bits."""
FUSED_FP32_MASTER = {"use_precision_aware_optimizer": True, "main_params_dtype": "float32",
                     "exp_avg_dtype": "float32", "exp_avg_sq_dtype": "float32", "store_param_remainders": True}
"""``train.fused_master_weights`` with ``fp32-master``: the same fp32 masters and moments, kept and updated by
Transformer Engine's FusedAdam (Megatron's precision-aware optimizer) instead of Megatron's own fp32 copies."""
NUMERICS_REFUSED = {
    "stochastic-rounding": "Megatron-Core 0.19's optimizers update fp32 main params (fp16 ones with the "
                           "precision-aware optimizer) and copy them into the bf16 model; none updates bf16 "
                           "parameters with stochastic rounding",
    "bf16": "Megatron-Core 0.19 always builds fp32 main params for a bf16 model (its mixed-precision and distributed "
            "optimizers have no bf16-only mode)",
}
"""Numerics Megatron cannot train with, and why (``checks.check_layout`` refuses them before anything is built)."""


def numerics_options(train: TrainConfig) -> dict:
    """The ``OptimizerConfig`` fields for ``train.optimizer_numerics`` (dtypes as torch dtypes)."""
    if train.optimizer_numerics in NUMERICS_REFUSED:
        raise ConfigError(f"train.optimizer_numerics={train.optimizer_numerics}: the megatron engine cannot train "
                          f"with it: {NUMERICS_REFUSED[train.optimizer_numerics]}",
                          hint="--set train.optimizer_numerics=fp32-master (or bf16-moments, with Transformer "
                               "Engine), or --engine local")
    if precision_aware(train) and not train.grad_reduce_in_fp32:
        # one H200, full NAM56R, MBS 4, TE 2.20.2 (gpu/mbs4.sh, 2026-11-28): with bf16 gradient buffers the first
        # update left Mamba's fp32 dt_bias non-finite; the same run with fp32 buffers, and Megatron's own masters
        # with bf16 buffers, trained (8,549 and 8,573 tokens/s)
        raise ConfigError("Megatron's precision-aware optimizer (train.fused_master_weights or bf16-moments) with "
                          "train.grad_reduce_in_fp32=false: Transformer Engine 2.20's FusedAdam made NAM56R's first "
                          "update non-finite with bf16 gradient buffers (H200, full size, MBS 4)",
                          hint="--set train.grad_reduce_in_fp32=true, or --set train.fused_master_weights=false")
    if train.fused_master_weights and train.optimizer_numerics != "fp32-master":
        raise ConfigError(f"train.fused_master_weights with train.optimizer_numerics={train.optimizer_numerics}: it is "
                          "the fp32-master path on Transformer Engine's FusedAdam (bf16-moments already runs there)",
                          hint="--set train.fused_master_weights=false")
    fields = FUSED_FP32_MASTER if train.fused_master_weights else NUMERICS_OPTIONS[train.optimizer_numerics]
    return {k: getattr(torch, v) if k.endswith("dtype") else v for k, v in fields.items()}


def precision_aware(train: TrainConfig) -> bool:
    """Whether the run's optimizer is Megatron's precision-aware one (Transformer Engine's FusedAdam holding the
    masters): ``bf16-moments``, or ``fp32-master`` with ``train.fused_master_weights``."""
    return train.optimizer_numerics == "bf16-moments" or train.fused_master_weights


def describe(train: TrainConfig) -> str:
    """The run log's line on who keeps the master weights and where the update runs."""
    if not precision_aware(train):
        return ("optimizer: Megatron's distributed optimizer, fp32 main weights and moments in its own buffers, "
                "gradients copied to fp32 and weights copied back each step (train.fused_master_weights=false)")
    moments = "bf16" if train.optimizer_numerics == "bf16-moments" else "fp32"
    return (f"optimizer: Megatron's precision-aware optimizer on Transformer Engine's FusedAdam: fp32 masters as the "
            f"bf16 weights plus their 16 low bits, {moments} moments, gradients read in place, weights written by "
            "the update")


def build_optimizer(models: list, train: TrainConfig, config):
    """Adam over the DDP chunks (Megatron's standard groups: no decay on vectors, as the local engine), with
    the loss scale and the gradient hooks wired into the model ``config`` as Megatron's training loop does."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_config = OptimizerConfig(
        optimizer="adam", lr=train.lr, min_lr=train.lr * train.min_lr_ratio, weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps,
        clip_grad=train.grad_clip, bf16=train.dtype == "bfloat16", params_dtype=config.params_dtype,
        use_distributed_optimizer=True, overlap_param_gather=train.overlap_param_gather,  # as DDP's, Megatron asks
        **numerics_options(train))
    return get_megatron_optimizer(opt_config, models)


def wire(config, models: list, optimizer, schedule: PipelineSchedule) -> None:
    """The model config's hooks that Megatron's schedules call: loss scale, no-sync, gradient finalisation
    (the schedule's shared copies first, then Megatron's data-parallel and embedding-group reduction)."""
    from megatron.core.distributed import finalize_model_grads

    def finalize(chunks: list, *args, **kwargs) -> None:
        schedule.reduce_shared_copies(chunks)
        finalize_model_grads(chunks, *args, **kwargs)

    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = models[0].no_sync if len(models) == 1 else [m.no_sync for m in models]
    config.finalize_model_grads_func = finalize


def set_lr(optimizer, lr: float, weight_decay: float) -> None:
    """What Megatron's OptimizerParamScheduler writes, with nam's schedule: lr and decay per group."""
    for group in optimizer.param_groups:
        group_lr = lr * group.get("lr_mult", 1.0)
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"].fill_(group_lr)
        else:
            group["lr"] = group_lr
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


def _te_fused_adam():
    """The class Megatron-Core builds as its Adam when Transformer Engine imports (``distrib_optimizer.Adam`` with
    ``USING_TE_OPTIMIZER``: TE's ``FusedAdam``), else None. Read from Megatron's module, so nam never imports TE."""
    from megatron.core.optimizer import distrib_optimizer

    return distrib_optimizer.Adam if getattr(distrib_optimizer, "USING_TE_OPTIMIZER", False) else None


def inner_adam(inner) -> str | None:
    """Which Adam an inner optimizer of Megatron's is, as nam reads and fills its state: ``"torch"`` (torch's
    Adam(W): ``exp_avg``/``exp_avg_sq`` and a ``step`` tensor per parameter, all made at its first step),
    ``"te-fused"`` (Transformer Engine's FusedAdam: ``exp_avg``/``exp_avg_sq`` per parameter, made at its first
    step, and one ``step`` per parameter group, ``group["step"]``, an int or a [1] tensor when capturable), or None."""
    if type(inner) in (torch.optim.AdamW, torch.optim.Adam):
        return "torch"
    fused = _te_fused_adam()
    return "te-fused" if fused is not None and isinstance(inner, fused) else None


def group_steps(inner) -> set[float]:
    """A TE FusedAdam's step counts: ``group["step"]`` of every group with parameters (as Megatron's
    ``DistributedOptimizer.state_dict`` reads them); empty before its first step."""
    return {float(g["step"]) for g in inner.param_groups if g["params"] and "step" in g}


def set_group_steps(inner, step: int) -> None:
    """Every group of a TE FusedAdam at ``step`` (empty groups too: FusedAdam advances them as well), where its
    next ``step()`` adds one and bias-corrects with the sum; a capturable group's [1] tensor is filled in place."""
    for group in inner.param_groups:
        if isinstance(group.get("step"), torch.Tensor):
            group["step"].fill_(step)
        else:
            group["step"] = int(step)


def precision_aware_refusal() -> str:
    """Why nam does not carry the state of Megatron's precision-aware optimizer (for errors and the map)."""
    return ("Megatron's precision-aware optimizer (train.fused_master_weights or "
            "train.optimizer_numerics=bf16-moments) keeps the fp32 masters inside Transformer Engine's FusedAdam as "
            "the bf16 weights plus 16-bit remainders, which nam does not read or write per parameter; nam carries "
            "FusedAdam's state on the fp32-master path (Megatron's own fp32 main params) only")


@torch.no_grad()
def materialise_state(opt) -> None:
    """Every inner Adam's per-parameter state made, as for a fresh load: torch's AdamW by one step that moves no
    weight (``patches.materialise_adam_state``: its ``step`` tensors come with it), TE's FusedAdam by Megatron's
    own ``init_state_fn`` (zero ``exp_avg``/``exp_avg_sq`` shaped as each fp32 main param; its step is the
    groups')."""
    from nam_core.engine.megatron import patches

    patches.materialise_adam_state(opt)
    for o in getattr(opt, "chained_optimizers", [opt]):
        if inner_adam(o.optimizer) == "te-fused":
            o.init_state_fn(o.optimizer, o.config)


def set_steps(opt, step: int) -> None:
    """Every inner Adam at ``step``, where it reads it: each parameter's own ``step`` (torch's AdamW,
    ``patches.own_adam_steps``), each group's (TE's FusedAdam)."""
    from nam_core.engine.megatron import patches

    patches.own_adam_steps(opt, step)
    for o in getattr(opt, "chained_optimizers", [opt]):
        if inner_adam(o.optimizer) == "te-fused":
            set_group_steps(o.optimizer, step)


@torch.no_grad()
def fill_state(opt, models: list, rank_tensors, exported) -> int:
    """Give Megatron's fresh distributed optimizer Adam's state from elsewhere (``nam train --init-from`` an
    export with its optimizer, ``EngineRun.optimizer_from``): every rank copies, for each parameter range it
    owns, that range of the full ``exp_avg``/``exp_avg_sq`` (and of the fp32 ``master`` into its main param, for
    a bf16 model) into its shards, one parameter's tensors at a time (``exported.state`` reads them when asked);
    every ``step`` becomes the export's. ``rank_tensors(chunk, tensors)`` renames and slices tensors keyed by the
    model's parameter names for one unwrapped chunk of this rank (its stage, its experts). Returns the step the
    run goes on at. The inner optimizer is torch's AdamW (Megatron without Transformer Engine or Apex) or TE's
    FusedAdam on Megatron's fp32 main params (``inner_adam``); another one, Megatron's precision-aware optimizer,
    and a range the export has no state for are refused."""
    from nam_core.engine.megatron.model import unwrap

    inners = getattr(opt, "chained_optimizers", [opt])
    unknown = [type(o.optimizer).__name__ for o in inners if inner_adam(o.optimizer) is None]
    if unknown:
        raise ConfigError("--init-from an export with optimizer state: nam fills torch's AdamW or Transformer "
                          "Engine's FusedAdam inside Megatron's optimizer, this run's is " + ", ".join(unknown),
                          hint="start from the weights alone (an export without --with-optimizer)")
    if any(getattr(o.config, "use_precision_aware_optimizer", False) for o in inners):
        raise ConfigError("--init-from an export with optimizer state: " + precision_aware_refusal(),
                          hint="--set train.fused_master_weights=false --set train.optimizer_numerics=fp32-master, "
                               "or start from the weights alone (an export without --with-optimizer)")
    materialise_state(opt)
    for chunk in models:
        module = unwrap(chunk)
        owned = {}  # Megatron name -> (its distributed optimizer, the parameter): the ranges this rank updates
        for name, param in module.named_parameters():
            owner = next((o for o in inners if param in o.model_param_group_index_map), None)
            if owner is not None:  # else another data-parallel rank owns all of it
                owned[name] = (owner, param)
        filled = set()
        for nam_name in exported.state:
            for kind, value in exported.state[nam_name].items():
                for name, local in rank_tensors(module, {nam_name: value}).items():
                    if name not in owned:
                        continue
                    owner, param = owned[name]
                    span = owner._get_model_param_range_map(param)["param"]
                    states = owner._get_main_param_and_optimizer_states(param)
                    states["param" if kind == "master" else kind].copy_(local.reshape(-1)[span.start:span.end])
                    filled.add((name, kind))
        needed = {n: ("exp_avg", "exp_avg_sq") + (("master",) if p.dtype != torch.float32 else ())
                  for n, (_, p) in owned.items()}  # a bf16 parameter's fp32 main weights are its master
        missing = [n for n, kinds in needed.items() if any((n, k) not in filled for k in kinds)]
        if missing:
            raise ConfigError(f"--init-from: the export's optimizer state has nothing for Megatron's {missing[:4]}",
                              hint="start from the weights alone (an export without --with-optimizer)")
    set_steps(opt, exported.step)
    return exported.step
