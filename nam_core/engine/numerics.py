"""Optimizer numerics: which copy of each weight AdamW updates, and in which dtype it keeps its two moments.

``train.optimizer_numerics`` picks one of ``NUMERICS``; both engines honour it (the megatron engine through
Megatron's own optimizer options, ``nam_core.engine.megatron.optimizer``). In bf16 training the choice
decides whether small updates survive: a bf16 weight holds 8 significant bits, so an update below half a bf16
ulp of the weight (about 0.2% of its size) rounds back to the old value. Late in a cosine schedule that is
most updates of most weights, and ``bf16`` loses them; ``fp32-master`` keeps them in the fp32 copy, and
``stochastic-rounding`` keeps them on average (a weight moves one ulp with the probability the update
covers of it).

=======================  ================  =======  =============  =============  ===================
numerics                 updated weights   moments  bytes/param    local engine   megatron engine
=======================  ================  =======  =============  =============  ===================
``fp32-master``          fp32 master copy  fp32     2 + 2 + 4 + 8  torch AdamW    Megatron's default
``bf16-moments``         fp32 master copy  bf16     2 + 2 + 4 + 4  torchao AdamW  precision-aware, TE
``stochastic-rounding``  the bf16 params   bf16     2 + 2 + 4      torchao AdamW  refused
``bf16``                 the bf16 params   bf16     2 + 2 + 4      torch AdamW    refused
=======================  ================  =======  =============  =============  ===================

(bytes per parameter in the local engine: bf16 weights + bf16 gradients + optimizer states; the megatron
engine keeps fp32 gradient buffers and shards the optimizer states, ``nam56r.memory``.) The first three
compute each update in fp32 whatever the storage: torch's AdamW on fp32 masters; torchao's ``_AdamW`` upcasts
parameter, gradient and moments and writes them back (round-to-nearest, or stochastic rounding for bf16
parameters with ``bf16_stochastic_round=True``). ``bf16`` is torch's AdamW on the bf16 tensors themselves.

A float32 run's parameters are already fp32: they are their own masters, and only ``fp32-master`` means
anything there (``TrainConfig.RULES`` refuses the others). The fp32 parameters of a bf16 model (Mamba-3's D
and dt_bias) stay fp32 and are updated as fp32 in every choice.
"""

from __future__ import annotations

from typing import Iterable

import torch

from nam_core.engine.config import NUMERICS
from nam_core.errors import CannotRunHere

__all__ = ["NUMERICS", "MASTER", "STATE_BYTES", "describe", "make_optimizer", "set_group_lr"]
MASTER = {"fp32-master": True, "bf16-moments": True, "stochastic-rounding": False, "bf16": False}
"""Whether the optimizer updates an fp32 master copy of each bf16 parameter (then copied into it)."""
STATE_BYTES = {"fp32-master": 4 + 8, "bf16-moments": 4 + 4, "stochastic-rounding": 4, "bf16": 4}
"""Optimizer-state bytes per bf16 parameter: the fp32 master (4) when there is one, plus two moments."""
TORCHAO = "torchao==0.18.*"
"""What ``bf16-moments`` and ``stochastic-rounding`` run on in the local engine (its ``_AdamW``)."""
MASTER_KEY = "nam_master_weights"
"""The key of the fp32 masters in the optimizer's state dict (a checkpoint's optimizer.pt)."""


def describe(numerics: str, dtype: str) -> str:
    """One line for the plan and the summary: what the optimizer updates and keeps."""
    if dtype != "bfloat16":
        return f"{numerics}: {dtype} parameters are their own masters, {dtype} moments"
    return {"fp32-master": "fp32-master: fp32 master weights and fp32 moments, bf16 compute parameters",
            "bf16-moments": "bf16-moments: fp32 master weights, bf16 moments, bf16 compute parameters",
            "stochastic-rounding": "stochastic-rounding: bf16 parameters updated with stochastic rounding, "
                                   "bf16 moments",
            "bf16": "bf16: bf16 parameters and bf16 moments, round-to-nearest (small updates are lost)"}[numerics]


def _torchao_adamw():
    """torchao's AdamW (``torchao.optim._AdamW``), or CannotRunHere naming the package."""
    try:
        from torchao.optim import _AdamW
    except ImportError as exc:
        raise CannotRunHere(f"train.optimizer_numerics needs torchao's AdamW (torchao.optim._AdamW); torchao is not "
                            f"importable here ({exc})",
                            hint=f"pip install '{TORCHAO}', or --set train.optimizer_numerics=fp32-master") from exc
    return _AdamW


def _bf16_moments_adamw():
    """torchao's AdamW whose two moments are bf16 tensors whatever the parameter's dtype (its update upcasts
    them to fp32 and writes them back rounded to nearest, as Megatron's precision-aware optimizer does)."""
    base = _torchao_adamw()

    class Bf16MomentsAdamW(base):
        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            return torch.zeros_like(p, dtype=torch.bfloat16)

    return Bf16MomentsAdamW


def make_optimizer(params: Iterable[torch.nn.Parameter], *, numerics: str, weight_decay: float, lr: float,
                   betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """AdamW over ``params`` (the model's, in the order it holds them) under ``numerics``; no weight decay on
    vectors (norm weights, biases, per-head scalars).

    With fp32 masters the returned optimizer holds the masters, not ``params``: a step-pre hook moves the model
    gradients into their masters' (fp32, in runs of ``GRAD_CHUNK_BYTES``, each run's bf16 gradients freed
    before the next) and a step-post hook copies the masters back into the model parameters; its state dict carries the masters under ``MASTER_KEY``, so a
    checkpoint restores them exactly. On CUDA torch's AdamW runs fused (one kernel per group and dtype:
    NAM56R MBS 2, one H200, 64.6 ms of a 966 ms step on the multi-tensor path, bench/README.md)."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics {numerics!r}: expected one of {', '.join(NUMERICS)}")
    params = [p for p in params if p.requires_grad]
    pairs = [(p, _master_of(p) if MASTER[numerics] else p) for p in params]
    updated = [m for _, m in pairs]
    groups = [{"params": [m for p, m in pairs if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [m for p, m in pairs if p.ndim < 2], "weight_decay": 0.0}]
    if numerics in ("fp32-master", "bf16"):
        on_cuda = all(m.is_cuda for m in updated)
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True if on_cuda else None)
    elif numerics == "bf16-moments":
        opt = _bf16_moments_adamw()(groups, lr=lr, betas=betas, eps=eps)
        opt.register_load_state_dict_post_hook(_moments_back_to_bf16)
    else:
        opt = _torchao_adamw()(groups, lr=lr, betas=betas, eps=eps, bf16_stochastic_round=True)
    for group in opt.param_groups:
        # The LR schedule scales a Python float (torchao's AdamW holds lr as a float32 tensor, and a schedule
        # scaling that tensor would round differently from the one a resume rebuilds: not bit-exact).
        group["initial_lr"] = lr
    if MASTER[numerics]:
        _attach_masters(opt, [(p, m) for p, m in pairs if m is not p])
    return opt


def state_order(named: Iterable[tuple[str, torch.nn.Parameter]]) -> list[str]:
    """The parameter names in the order ``make_optimizer`` numbers them in its state dict (``named``: the model's
    ``named_parameters()``): its decayed group (matrices), then the rest, each in the model's order."""
    named = [(n, p) for n, p in named if p.requires_grad]
    return [n for n, p in named if p.ndim >= 2] + [n for n, p in named if p.ndim < 2]


def state_by_name(saved: dict, named: Iterable[tuple[str, torch.Tensor]], dtypes: dict,
                  numerics: str) -> tuple[dict, int]:
    """A ``make_optimizer`` optimizer's saved state dict (``checkpoint.optimizer_state``) by parameter name, as
    ``fill_state`` takes it, and AdamW's step count. ``named``: the model's ``named_parameters()`` (a meta build
    will do: shapes only); ``dtypes``: each parameter's trained dtype (the checkpoint's model state), which says
    which ones had an fp32 master under ``numerics``. ValueError when the saved state does not fit the parameters
    (a model a plugin's transform changed) or its step counts differ."""
    named = [(n, p) for n, p in named if p.requires_grad]
    order, shapes = state_order(named), {n: p.shape for n, p in named}
    moments = saved["state"]
    if len(moments) != len(order) or any(moments[i]["exp_avg"].shape != shapes[n] for i, n in enumerate(order)):
        raise ValueError(f"the optimizer holds {len(moments)} parameters' state in an order the model's "
                         f"{len(order)} parameters do not fill (a model changed by a plugin's transform?)")
    steps = {float(m["step"]) for m in moments.values()}
    if len(steps) != 1:
        raise ValueError(f"AdamW's step counts differ between parameters ({sorted(steps)[:4]})")
    out = {n: {k: moments[i][k] for k in ("exp_avg", "exp_avg_sq")} for i, n in enumerate(order)}
    mastered = [n for n, _ in named if MASTER[numerics] and dtypes[n] != torch.float32]  # make_optimizer's pairs
    masters = saved.get(MASTER_KEY) or []
    if len(masters) != len(mastered):
        raise ValueError(f"{len(masters)} fp32 masters for {len(mastered)} {numerics} parameters kept in bf16")
    for name, master in zip(mastered, masters):
        out[name]["master"] = master
    return out, int(steps.pop())


@torch.no_grad()
def fill_state(optimizer: torch.optim.Optimizer, named: Iterable[tuple[str, torch.nn.Parameter]], state: dict,
               step: int) -> None:
    """Give a fresh ``make_optimizer`` optimizer AdamW's state from elsewhere (``nam train --init-from`` an export
    with its optimizer): ``state[name]`` holds ``exp_avg``, ``exp_avg_sq`` and, where this optimizer updates an
    fp32 master, ``master``, for every parameter in ``named`` (the model's ``named_parameters()``); each parameter's
    ``step`` becomes ``step``. Copied, in each state tensor's own dtype (bf16 moments stay bf16); a missing or
    extra name or another shape is a ValueError before anything changes."""
    from nam_core.engine.async_checkpoint import _materialize

    named = list(named)
    names = state_order(named)
    if set(names) != set(state):
        raise ValueError(f"optimizer state for {len(state)} parameters, this model trains {len(names)} (missing "
                         f"{sorted(set(names) - set(state))[:4]}, extra {sorted(set(state) - set(names))[:4]})")
    masters = dict(getattr(optimizer, "nam_masters", []))  # parameter -> its fp32 master
    by_name = dict(named)
    for name in names:
        have = {"exp_avg", "exp_avg_sq", *(("master",) if by_name[name] in masters else ())}
        if set(state[name]) != have or state[name]["exp_avg"].shape != by_name[name].shape:
            raise ValueError(f"optimizer state of {name}: {sorted(state[name])} of shape "
                             f"{tuple(state[name]['exp_avg'].shape)}; this optimizer keeps {sorted(have)} of "
                             f"shape {tuple(by_name[name].shape)}")
    _materialize(optimizer)
    updated = [p for group in optimizer.param_groups for p in group["params"]]  # masters where there are
    for name, p in zip(names, updated):
        own = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            own[key].copy_(state[name][key])
        own["step"] = torch.full_like(own["step"], float(step))
        if "master" in state[name]:
            p.copy_(state[name]["master"])
            by_name[name].copy_(p)  # the model's bf16 weight: rounded to nearest, as after every step


@torch.no_grad()
def _moments_back_to_bf16(optimizer: torch.optim.Optimizer) -> None:
    """torch's ``Optimizer.load_state_dict`` casts every state tensor to its parameter's dtype (fp32 for a
    master): the moments go back to bf16 (exact: they were saved as bf16), or a resume would change numerics."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key] = state[key].to(torch.bfloat16)


def _master_of(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """The fp32 copy the optimizer updates in place of ``p``; an fp32 parameter is its own."""
    if p.dtype == torch.float32:
        return p
    return torch.nn.Parameter(p.detach().to(torch.float32, copy=True))


GRAD_CHUNK_BYTES = 1 << 30
"""How many bytes of bf16 gradients one fused upcast takes at a time (``_attach_masters``): one multi-tensor
kernel per chunk instead of one copy per parameter, and the chunk's bf16 gradients freed before the next, so
the step holds at most this much more than a parameter-by-parameter upcast did."""


def _chunks(pairs: list, nbytes) -> list[list]:
    """``pairs`` cut into runs of consecutive items of at most ``GRAD_CHUNK_BYTES`` (``nbytes`` of each; an item
    larger than that is a run of its own)."""
    runs, size = [[]], 0
    for item in pairs:
        if runs[-1] and size + nbytes(item) > GRAD_CHUNK_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += nbytes(item)
    return [run for run in runs if run]


def _attach_masters(opt: torch.optim.Optimizer, pairs: list[tuple[torch.Tensor, torch.nn.Parameter]]) -> None:
    """The hooks that tie the masters to the model parameters (``make_optimizer``'s docstring). Both copies run
    as torch's multi-tensor copy (``torch._foreach_copy_``, round-to-nearest like ``Tensor.copy_``: the same
    values as a loop of copies, in a few kernels instead of one per parameter; NAM56R has ~700)."""
    opt.nam_masters = pairs
    targets = [p for p, _ in pairs]
    masters = [m for _, m in pairs]

    @torch.no_grad()
    def grads_to_masters(optimizer, args, kwargs) -> None:
        live = [(p, m) for p, m in pairs if p.grad is not None]
        for run in _chunks(live, lambda pm: pm[0].grad.numel() * pm[0].grad.element_size()):
            upcast = [torch.empty_like(m) for _, m in run]  # fp32, the masters' shapes
            torch._foreach_copy_(upcast, [p.grad for p, _ in run])  # bf16 -> fp32, exact
            for (p, m), g in zip(run, upcast):
                m.grad = g
                p.grad = None

    @torch.no_grad()
    def masters_to_params(optimizer, args, kwargs) -> None:
        if targets:  # none in a float32 model: its parameters are their own masters
            torch._foreach_copy_(targets, masters)  # fp32 -> bf16, round-to-nearest

    def save_masters(optimizer, state: dict) -> dict:
        state[MASTER_KEY] = [m.detach().clone() for _, m in pairs]
        return state

    def load_masters(optimizer, state: dict) -> dict:
        state = dict(state)
        saved = state.pop(MASTER_KEY, None)
        if saved is None or len(saved) != len(pairs):
            found = "none" if saved is None else f"{len(saved)}"
            raise ValueError(f"optimizer state: expected {len(pairs)} fp32 master weights under {MASTER_KEY!r}, "
                             f"found {found} (a checkpoint of other numerics)")
        with torch.no_grad():
            for (p, m), value in zip(pairs, saved):
                m.copy_(value)
                p.copy_(m)
        return state

    opt.register_step_pre_hook(grads_to_masters)
    opt.register_step_post_hook(masters_to_params)
    opt.register_state_dict_post_hook(save_masters)
    opt.register_load_state_dict_pre_hook(load_masters)


def set_group_lr(group: dict, lr: float) -> None:
    """Set a param group's lr in place: torchao's AdamW keeps it as a tensor and refuses a float."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr
