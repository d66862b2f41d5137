"""A CPU stand-in for Transformer Engine's ``FusedAdam`` as Megatron-Core builds it on a host with TE (TE does not
install here), for the tests of nam's reading and filling of Megatron's optimizer state.

What it reproduces of TE 2.20.2's ``transformer_engine/pytorch/optimizers/fused_adam.py`` (read, not copied), the
properties nam's code depends on:

- the step count lives in each parameter group, ``group["step"]`` (a Python int; a [1] int tensor when
  capturable), advanced by one at the start of every ``step()`` for every group, empty ones too, before the update
  bias-corrects with it; no parameter's state holds a ``step``;
- each parameter's state is ``exp_avg`` and ``exp_avg_sq`` (fp32 here, as on Megatron's fp32-master path, where
  FusedAdam runs without ``master_weights``), created lazily by ``initialize_state`` at the parameter's first
  ``step()`` with a gradient, or by Megatron's ``init_state_fn`` (``opt.state[p][...] = zeros_like(p)``);
- the constructor's keywords Megatron passes (``adam_w_mode``, ``capturable``, ``bias_correction``, ...);
- the update, AdamW mode: ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``, fp32.

With ``master_weights`` (Megatron's precision-aware optimizer, ``install(precision_aware=True)``): the masters in
the state as ``master_param`` (a bf16 parameter's as its 16 low bits, int16, with ``store_param_remainders``; the
bf16 weight is the master rounded to nearest), the moments in ``exp_avg_dtype``/``exp_avg_sq_dtype`` (bf16 here),
the gradient read from ``p.decoupled_grad``, the update in fp32; and the copies TE's methods make, which is what
a load's memory is made of: ``get_unscaled_state`` returns a bf16 moment as a new fp32 tensor (the remainders and
fp32 states as they are), ``state_dict`` replaces every state by that, ``load_state_dict`` runs torch's (which
casts every state to the parameter's dtype) and then makes each state afresh through ``set_scaled_state``.
``LEDGER`` counts the bytes of every tensor of the optimizer's (its state, those copies, the states handed to its
``load_state_dict`` and torch's casts of them) while they are alive, and their peak: what they would hold on the
GPU. Not reproduced: fp16/fp8 moments and their scales, CUDA kernels, capturable. Without ``master_weights``,
``state_dict`` and ``load_state_dict`` are torch's, which is what FusedAdam's overrides reduce to for fp32 states.

``install()`` points Megatron-Core at it exactly where TE would be picked up: the ``Adam`` that
``megatron.core.optimizer`` builds (with ``USING_PYTORCH_OPTIMIZER`` false) and ``distrib_optimizer``'s ``Adam``,
``HAVE_APEX_OR_TE`` and ``USING_TE_OPTIMIZER`` (read by ``DistributedOptimizer.state_dict``/``load_state_dict``
and by nam's ``optimizer.inner_adam``). ``install(precision_aware=True)`` also lets ``OptimizerConfig`` accept the
precision-aware optimizer: its check imports ``transformer_engine.pytorch.optimizers.FusedAdam`` (given this class
for that call only) and reads TE's version (Megatron's cached one set to 2.20.2, so remainders are kept).
"""

import contextlib
import sys
import types
import weakref

import torch


class Ledger:
    """Bytes of the optimizer's tensors alive now (``live``) and the most at once since ``reset`` (``peak``), by
    storage (a view keeps its tensor's bytes alive)."""

    def __init__(self):
        self.live = self.peak = 0
        self._alive: dict[int, int] = {}  # id(storage) -> bytes, until the storage is freed

    def track(self, tensor):
        storage = tensor.untyped_storage() if isinstance(tensor, torch.Tensor) else None
        if storage is not None and id(storage) not in self._alive:
            self._alive[id(storage)] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, id(storage))
        return tensor

    def _free(self, key):
        self.live -= self._alive.pop(key)

    def reset(self):
        self.peak = self.live


LEDGER = Ledger()


def _split(master):
    """An fp32 master as TE keeps it beside a bf16 weight: the weight (the master rounded to nearest: its high 16
    bits, one up when the low half is >= 0x8000, which is negative as int16) and the low 16 bits (int16)."""
    bits = master.view(torch.int32)
    low = (bits & 0xFFFF).to(torch.int16)  # wraps: 0x8000.. -> negative
    high = (bits >> 16) + (low < 0).to(torch.int32)
    return high.to(torch.int16).view(torch.bfloat16), low


def _join(weight, low):
    """``_split``'s inverse: the fp32 master from the bf16 weight and its int16 remainder."""
    high = weight.view(torch.int16).to(torch.int32) - (low < 0).to(torch.int32)
    return ((high << 16) | (low.to(torch.int32) & 0xFFFF)).view(torch.float32)


class FusedAdam(torch.optim.Optimizer):
    """Transformer Engine's FusedAdam's state layout and update, on the CPU (module docstring)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False,
                 master_weight_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False, **ignored):
        if amsgrad or capturable:
            raise RuntimeError("the FusedAdam stand-in has no amsgrad or capturable mode")
        if master_weight_dtype != torch.float32 or {exp_avg_dtype, exp_avg_sq_dtype} - {torch.float32, torch.bfloat16}:
            raise RuntimeError("the FusedAdam stand-in keeps fp32 masters and fp32 or bf16 moments only")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable, self.master_weights, self.use_decoupled_grad = capturable, master_weights, use_decoupled_grad
        self.store_param_remainders = store_param_remainders and master_weights
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}

    def _remainders(self, param, name) -> bool:
        return self.store_param_remainders and name == "master_param" and param.dtype == torch.bfloat16

    def _initialize_state(self, param, name, zero: bool):
        dtype = torch.int16 if self._remainders(param, name) else self.name_to_dtype_map[name]
        self.state[param][name] = LEDGER.track((torch.zeros if zero else torch.empty)(param.shape, dtype=dtype))

    def initialize_state(self, param, store_param_remainders=False):
        if not self.master_weights:  # Megatron's fp32-master path: fp32 moments, no master
            self.state[param]["exp_avg"] = LEDGER.track(torch.zeros_like(param, dtype=torch.float32))
            self.state[param]["exp_avg_sq"] = LEDGER.track(torch.zeros_like(param, dtype=torch.float32))
            return
        self._initialize_state(param, "exp_avg", zero=True)
        self._initialize_state(param, "exp_avg_sq", zero=True)
        self.state[param]["master_param"] = LEDGER.track(
            torch.zeros_like(param, dtype=torch.int16) if self._remainders(param, "master_param")
            else param.detach().clone().float())

    def get_unscaled_state(self, param, state_name, skip_unscale=False):
        state = self.state[param][state_name]
        return LEDGER.track(state.float()) if state.dtype == torch.bfloat16 else state

    def set_scaled_state(self, param, state_name, unscaled_state):
        assert unscaled_state.dtype == (torch.int16 if self._remainders(param, state_name) else torch.float32)
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, zero=False)
        self.state[param][state_name].copy_(unscaled_state)  # fp32 -> bf16 rounds to nearest, as TE's copy

    def state_dict(self):
        state_dict = super().state_dict()
        if not self.master_weights:
            return state_dict
        params = [p for g in self.param_groups for p in g["params"]]
        for index, value in state_dict["state"].items():
            state_dict["state"][index] = {k: self.get_unscaled_state(params[index], k) for k in value}
        return state_dict

    def load_state_dict(self, state_dict):
        if not self.master_weights:
            return super().load_state_dict(state_dict)
        for value in state_dict["state"].values():  # Megatron's dummies (or our own state_dict's copies)
            for tensor in value.values():
                LEDGER.track(tensor)
        super().load_state_dict(state_dict)  # torch's: every state cast to its parameter's dtype (__setstate__)
        params = [p for g in self.param_groups for p in g["params"]]
        for index, value in state_dict["state"].items():
            param = params[index]
            self.state[param] = {}
            for name, tensor in value.items():
                self.set_scaled_state(param, name, tensor if self._remainders(param, name)
                                      else LEDGER.track(tensor.float()))

    def __setstate__(self, state):
        """torch's ``load_state_dict`` hands its casts of every state here, while the old state is still alive."""
        for value in state.get("state", {}).values():
            for tensor in value.values():
                LEDGER.track(tensor)
        super().__setstate__(state)

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            group["step"] = group["step"] + 1 if "step" in group else 1  # every group, before the update
            beta1, beta2 = group["betas"]
            t = group["step"]
            bc1, bc2 = (1 - beta1 ** t, 1 - beta2 ** t) if group["bias_correction"] else (1.0, 1.0)
            for p in group["params"]:
                grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    self.initialize_state(p, self._remainders(p, "master_param"))
                if not self.master_weights:
                    master = p
                elif self._remainders(p, "master_param"):
                    master = _join(p, state["master_param"])
                else:
                    master = state["master_param"]
                g, m, v = grad.float(), state["exp_avg"].float(), state["exp_avg_sq"].float()
                if not self.adam_w_mode:
                    g = g + group["weight_decay"] * master
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + group["weight_decay"] * master
                master = master - group["lr"] * update
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                if not self.master_weights:
                    p.copy_(master)
                elif self._remainders(p, "master_param"):
                    weight, low = _split(master)
                    p.copy_(weight)
                    state["master_param"].copy_(low)
                else:
                    state["master_param"].copy_(master)
                    p.copy_(master)
        return loss


def install(precision_aware: bool = False) -> None:
    """Megatron-Core builds and checkpoints this stand-in as it would TE's FusedAdam (module docstring). Call before
    the optimizer is built."""
    import megatron.core.optimizer as optimizer
    from megatron.core import utils
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    optimizer.Adam, optimizer.USING_PYTORCH_OPTIMIZER = FusedAdam, False
    distrib_optimizer.Adam, distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER = (
        FusedAdam, True, True)
    if precision_aware:
        from packaging.version import Version

        utils._te_version = Version("2.20.2")
        check = OptimizerConfig.__post_init__

        def post_init(self):
            with _te_fused_adam_importable():
                check(self)

        OptimizerConfig.__post_init__ = post_init


@contextlib.contextmanager
def _te_fused_adam_importable():
    """``from transformer_engine.pytorch.optimizers import FusedAdam`` gives this stand-in, inside the block only."""
    names = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.optimizers")
    if any(name in sys.modules for name in names):
        raise RuntimeError("transformer_engine is importable here: the FusedAdam stand-in is for hosts without it")
    modules = [types.ModuleType(name) for name in names]
    modules[0].__version__ = "2.20.2"
    modules[0].pytorch, modules[1].optimizers, modules[2].FusedAdam = modules[1], modules[2], FusedAdam
    sys.modules.update(zip(names, modules))
    try:
        yield
    finally:
        for name in names:
            del sys.modules[name]
