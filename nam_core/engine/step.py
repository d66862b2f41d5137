"""What every engine computes the same way around an optimizer step: the learning rate at a step, the step's
metrics record, and where a non-finite number first shows. Engines import these; no engine imports another."""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch

from nam_core.engine.config import TrainConfig


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warmup to the peak, cosine decay to ``min_lr_ratio`` at ``total_steps``, flat after."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def step_metrics(step: int, losses: Mapping[str, float], *, lr: float, grad_norm: float, tokens: int,
                 seconds: float, flops_per_token: float, mem_gib: float, devices: int = 1) -> dict:
    """One metrics record (a line of metrics.jsonl) for 0-based step ``step``: its loss terms (means over the
    step's micro-batches), lr, gradient norm, and speed per device (``tokens`` over all ``devices``)."""
    tokens_per_s = tokens / seconds / devices
    return {"step": step + 1, **{k: round(v, 6) for k, v in losses.items()}, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s, "tflops_per_device": tokens_per_s * flops_per_token / 1e12,
            "mem_gib": mem_gib, "step_time_s": seconds}


def first_non_finite(model: torch.nn.Module) -> str:
    """The first parameter, then gradient, that holds a NaN or Inf, by name."""
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            return f"parameter {name}"
        if p.grad is not None and not torch.isfinite(p.grad).all():
            return f"gradient of {name}"
    return "none (the loss itself is non-finite)"
