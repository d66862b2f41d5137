"""A stand-in for Transformer Engine's FusedAdam as Megatron builds it on our GPU host (TE does not install on the
CPU), for the gloo runs of the conversion between engines (``worker.py --group-step-adam``).

What it shares with FusedAdam, and what nam's conversion depends on (``nam_core.engine.megatron.optimizer``
``fill_state`` and ``checkpoint._write_optimizer_map``): AdamW's step kept once per parameter group, an int
(``group["step"]``, counted for every group, empty ones too); ``exp_avg`` and ``exp_avg_sq`` made at the first
update (or by Megatron's ``init_state_fn`` before a load) and no per-parameter ``step``; the constructor Megatron
calls (``adam_w_mode``, ``capturable``). The update is AdamW's (decoupled weight decay, bias corrections from the
group's step), written out here, so a run with it trains as one with torch's AdamW to rounding.
"""

from __future__ import annotations

import torch


class GroupStepAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, capturable=False,
                 adam_w_mode=True, **unused):
        if capturable or not adam_w_mode or unused:
            raise ValueError(f"the stand-in runs AdamW only, not capturable (got capturable={capturable}, "
                             f"adam_w_mode={adam_w_mode}, {sorted(unused)})")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            t, (b1, b2) = group["step"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m.lerp_(p.grad, 1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1 ** t))


def install() -> None:
    """Make Megatron build it where it would build TE's FusedAdam, and let nam's conversion treat it as one."""
    import megatron.core.optimizer as optimizer
    from megatron.core.optimizer import distrib_optimizer

    from nam_core.engine.megatron import optimizer as nam_optimizer

    optimizer.Adam, optimizer.USING_PYTORCH_OPTIMIZER = GroupStepAdam, False
    distrib_optimizer.HAVE_APEX_OR_TE, distrib_optimizer.USING_TE_OPTIMIZER = True, True
    nam_optimizer.GROUP_STEP_ADAMS.add(f"{GroupStepAdam.__module__}.{GroupStepAdam.__qualname__}")
