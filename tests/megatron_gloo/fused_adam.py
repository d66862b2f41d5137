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

Not reproduced: the precision-aware path (``master_weights``, remainders, scaled bf16/fp8 moments,
``get_unscaled_state``/``set_scaled_state``), which nam refuses to carry, and CUDA kernels. ``state_dict`` and
``load_state_dict`` are torch's, which is what FusedAdam's overrides reduce to for fp32 states.

``install()`` points Megatron-Core at it exactly where TE would be picked up: the ``Adam`` that
``megatron.core.optimizer`` builds (with ``USING_PYTORCH_OPTIMIZER`` false) and ``distrib_optimizer``'s ``Adam``,
``HAVE_APEX_OR_TE`` and ``USING_TE_OPTIMIZER`` (read by ``DistributedOptimizer.state_dict``/``load_state_dict``
and by nam's ``optimizer.inner_adam``).
"""

import torch


class FusedAdam(torch.optim.Optimizer):
    """Transformer Engine's FusedAdam's state layout and update, on the CPU (module docstring)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 bias_correction=True, adam_w_mode=True, capturable=False, master_weights=False, **ignored):
        if amsgrad or capturable or master_weights:
            raise RuntimeError("the FusedAdam stand-in reproduces the fp32-master path only (no amsgrad, "
                               "capturable or master_weights)")
        super().__init__(params, {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay})
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable, self.master_weights = capturable, master_weights

    def initialize_state(self, param, store_param_remainders=False):
        self.state[param]["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
        self.state[param]["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            group["step"] = group["step"] + 1 if "step" in group else 1  # every group, before the update
            beta1, beta2 = group["betas"]
            t = group["step"]
            bc1, bc2 = (1 - beta1 ** t, 1 - beta2 ** t) if group["bias_correction"] else (1.0, 1.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    self.initialize_state(p)
                g, m, v = p.grad.float(), state["exp_avg"], state["exp_avg_sq"]
                if not self.adam_w_mode:
                    g = g + group["weight_decay"] * p
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + group["weight_decay"] * p
                p.sub_(group["lr"] * update)
        return loss


def install() -> None:
    """Megatron-Core builds and checkpoints this stand-in as it would TE's FusedAdam (module docstring). Call before
    the optimizer is built."""
    import megatron.core.optimizer as optimizer
    from megatron.core.optimizer import distrib_optimizer

    optimizer.Adam, optimizer.USING_PYTORCH_OPTIMIZER = FusedAdam, False
    distrib_optimizer.Adam, distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER = (
        FusedAdam, True, True)
