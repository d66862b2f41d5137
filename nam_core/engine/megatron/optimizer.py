"""Megatron's distributed optimizer for the run, and nam's learning-rate schedule on it.

What Megatron-Core's optimizer gets wrong or leaves slow without Transformer Engine or Apex (fp32 parameters in
mixed groups, torch AdamW's state on load, the unfused AdamW, the gradient norm's and clip's per-tensor host
syncs) is fixed in the patch lane (``nam_core.engine.megatron.patches``), applied around the run by
``loop.train``."""

from __future__ import annotations

import torch

from nam_core.engine.config import TrainConfig
from nam_core.engine.megatron.schedule import PipelineSchedule


def build_optimizer(models: list, train: TrainConfig, config):
    """Adam over the DDP chunks (Megatron's standard groups: no decay on vectors, as the local engine), with
    the loss scale and the gradient hooks wired into the model ``config`` as Megatron's training loop does."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_config = OptimizerConfig(
        optimizer="adam", lr=train.lr, min_lr=train.lr * train.min_lr_ratio, weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps,
        clip_grad=train.grad_clip, bf16=train.dtype == "bfloat16", params_dtype=config.params_dtype,
        use_distributed_optimizer=True, overlap_param_gather=train.overlap_param_gather)  # as DDP's, Megatron asks
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
