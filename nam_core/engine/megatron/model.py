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

    def rank_tensors(self, model: nn.Module, tensors: Mapping[str, torch.Tensor], pg_collection) -> dict:
        """``tensors`` keyed by the model's own parameter names (an export's optimizer state) renamed and sliced
        for one unwrapped chunk of this rank (``EngineRun.optimizer_from``)."""


def build_ddp(provider: MegatronModel, train: TrainConfig, pg_collection, *, distributed_optimizer: bool,
              schedule: PipelineSchedule | None = None, transform: Callable[[nn.Module], None] | None = None):
    """This rank's model chunks, each in Megatron's DDP (bf16 through the schedule's ``float16`` wrapper;
    parameters the model keeps fp32 stay fp32, §8), gradients in fp32 buffers unless ``train.grad_reduce_in_fp32``
    is off; returns
    ``(transformer config, [DDP chunk, ...])``. ``transform(chunk)`` (the plugins' ``nam_transform_model``)
    runs on each chunk after its ``float16`` wrapper and before DDP builds its grad buffers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    schedule = schedule or MegatronSchedule()
    device = parallel.device()
    config = provider.transformer_config()
    if config.params_dtype != getattr(torch, train.dtype):
        raise ConfigError(f"the model was lowered for {config.params_dtype}, train.dtype is {train.dtype}",
                          hint="lower the model with the run's dtype (nam56r.megatron.lower(..., bf16=...))")
    if train.overlap_param_gather and not distributed_optimizer:
        raise ConfigError("train.overlap_param_gather all-gathers the distributed optimizer's parameter shards; "
                          "this build has no distributed optimizer", hint="--set train.overlap_param_gather=false")
    if train.moe_shared_expert_overlap:
        overlap_shared_experts(config)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=train.grad_reduce_in_fp32,
                                               overlap_grad_reduce=train.overlap_grad_reduce,
                                               overlap_param_gather=train.overlap_param_gather,
                                               use_distributed_optimizer=distributed_optimizer,
                                               fp8_param_gather=bool(getattr(config, "fp8_param", False)))
    chunks = []
    for chunk in range(provider.chunks):
        module = provider.build(config, pg_collection, device, chunk=chunk)
        if train.dtype == "bfloat16":
            module = schedule.float16(config, module, chunk)
        if transform is not None:
            transform(module)
        chunks.append(DistributedDataParallel(config, ddp_config, module))
    return config, chunks


def overlap_shared_experts(config) -> None:
    """Megatron's ``moe_shared_expert_overlap`` on the model's TransformerConfig, before the chunks are built
    (MoELayer and SharedExpertMLP read it then). TransformerConfig checks the dispatcher at construction only, so
    the check is repeated here; a model without shared experts is left as it is (Megatron ignores the flag)."""
    if not getattr(config, "num_moe_experts", None) or not config.moe_shared_expert_intermediate_size:
        return
    if config.moe_token_dispatcher_type not in ("alltoall", "flex"):
        raise ConfigError(f"train.moe_shared_expert_overlap needs the alltoall or flex MoE dispatcher, the model "
                          f"was lowered for {config.moe_token_dispatcher_type!r}",
                          hint="--set train.moe_shared_expert_overlap=false")
    config.moe_shared_expert_overlap = True


def unwrap(model):
    """The model inside DDP and Float16Module."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)
