"""What the engine needs from a model (``MegatronModel``), and the model's chunks in Megatron's DDP."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import torch
from torch import nn

from nam_core.engine.config import TrainConfig
from nam_core.engine.megatron import parallel
from nam_core.engine.megatron.schedule import MegatronSchedule, PipelineSchedule
from nam_core.errors import ConfigError


class MegatronModel(Protocol):
    """What the engine needs from a model (NAM56R's: ``nam56r.megatron.NamMegatronModel``)."""

    parallel: Mapping[str, int]
    """``tp``, ``pp``, ``ep``: the layout the model was lowered for."""
    chunks: int
    """Model chunks per pipeline rank the model was lowered for (the schedule's ``chunks_per_rank``)."""
    seq_len: int
    moe_aux_loss_coeff: float

    def check(self, *, registered_schedules: Mapping[str, Any]) -> None:
        """Raise ConfigError for anything the model cannot be built with (CPU-checkable)."""

    def transformer_config(self) -> Any:
        """Megatron's TransformerConfig (``params_dtype`` must be the train dtype)."""

    def build(self, config: Any, pg_collection: Any, device: torch.device, chunk: int = 0) -> nn.Module:
        """This rank's model chunk ``chunk`` on ``device``, weights filled (the same on every data-parallel rank)."""

    def forward_step(self, data_iterator, model) -> tuple[Any, Callable]:
        """Megatron's ``forward_step_func``; the iterator yields ``(micro-batch index, batch dict)``. The last
        stage's output reaches ``loss_func`` as the model returns it (a schedule's ``float16`` may keep it in
        bf16): a bf16 model returns its losses in fp32."""

    def end_step(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
        """This step's extra loss sums (logged, already in the loss) and log lines, from the unwrapped model."""


def build_ddp(provider: MegatronModel, train: TrainConfig, pg_collection, *, distributed_optimizer: bool,
              schedule: PipelineSchedule | None = None):
    """This rank's model chunks, each in Megatron's DDP (bf16 through the schedule's ``float16`` wrapper;
    parameters the model keeps fp32 stay fp32, §8), gradients reduced in fp32; returns
    ``(transformer config, [DDP chunk, ...])``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    schedule = schedule or MegatronSchedule()
    device = parallel.device()
    config = provider.transformer_config()
    if config.params_dtype != getattr(torch, train.dtype):
        raise ConfigError(f"the model was lowered for {config.params_dtype}, train.dtype is {train.dtype}",
                          hint="lower the model with the run's dtype (nam56r.megatron.lower(..., bf16=...))")
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    chunks = []
    for chunk in range(provider.chunks):
        module = provider.build(config, pg_collection, device, chunk=chunk)
        if train.dtype == "bfloat16":
            module = schedule.float16(config, module, chunk)
        chunks.append(DistributedDataParallel(config, ddp_config, module))
    return config, chunks


def unwrap(model):
    """The model inside DDP and Float16Module."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)
