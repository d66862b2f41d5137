"""``DualPipeV``: the schedule the megatron engine calls when ``train.schedule=dualpipev``.

It implements the engine's schedule protocol (``nam_core.engine.megatron.schedule.PipelineSchedule``):

* the V's layout: ``chunks_per_rank = 2`` and ``stage_of`` (rank ``r`` holds stage ``r`` and stage
  ``2P-1-r``), which the lowering reads (``nam56r.megatron.lower(..., schedule=DualPipeV())``), so the engine
  builds both chunks; ``check_layout`` refuses what the V cannot run (expert parallelism, pp < 2, too few
  micro-batches);
* what the V changes in Megatron's machinery: the embedding group (``embedding_ranks``: rank 0 alone holds
  both copies of the token embedding), their gradients (``reduce_shared_copies``), and the bf16 wrapper
  (``float16``: no fp32 upcast of a middle stage's output);
* the step, called as Megatron's forward-backward functions are::

    losses = schedule(forward_step_func=..., data_iterator=..., model=[chunk 0, chunk 1], num_microbatches=n,
                      seq_length=seq_len, micro_batch_size=mbs, forward_only=False)

This class refuses (CannotRunHere, exit 3) anything but a pair of chunks: no fallback to another schedule.

Given two chunks it drives the executor with Megatron's contract, kept to what nam's forward step uses:

* ``forward_step_func(data_iterator, chunk) -> (output, loss_func)``: it is called once per chunk and
  micro-batch with an iterator over that one micro-batch (each rank draws the step's ``num_microbatches``
  batches from ``data_iterator`` once, because rank 0 needs micro-batch i twice: tokens on chunk 0, labels on
  chunk 1). Before the call the chunk's ``set_input_tensor`` receives the previous stage's output, ``[s, b, h]``
  (None on the first stage), as Megatron's schedules do.
* ``loss_func(output) -> (loss, logs)`` on the last stage (rank 0's chunk 1). The backward starts from
  ``loss / num_microbatches`` through ``config.grad_scale_func`` when the config has one; ``logs`` (a dict of
  detached tensors) is returned per micro-batch on pipeline rank 0, ``[]`` on the others.
* After the last backward ``config.finalize_model_grads_func(model)`` runs when set (data-parallel gradient
  reduction).

* Auxiliary losses that Megatron layers attach to activations (MoE load balancing, MTP, the DSA indexer's)
  are scaled in backward by a process-wide factor that Megatron's schedules set on every forward step; this
  adapter sets the same factors once per step, before the first forward: ``loss_scale / num_microbatches``
  with ``loss_scale = config.grad_scale_func(1)`` (1 without it), for ``MoEAuxLossAutoScaler`` when the
  config has ``num_moe_experts``, ``MTPLossAutoScaler`` when it has ``mtp_num_layers``, and
  ``DSAIndexerLossAutoScaler`` when ``experimental_attention_variant == "dsa"``. The factor is the same for
  every micro-batch of a step, so setting it once equals setting it per forward.

Refused rather than half-done: ``loss_func`` returning ``(loss, num_tokens, logs)`` and configs with
``calculate_per_token_loss`` (per-token normalisation), and context parallelism.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch

from nam_core.engine.megatron.schedule import PipelineSchedule
from nam_core.errors import CannotRunHere, ConfigError

NOT_BUILT = ("dualpipev runs two model chunks per pipeline rank (the V: stage r and stage 2P-1-r); the engine "
             "builds them when the model is lowered for this schedule "
             "(nam56r.megatron.lower(..., schedule=DualPipeV()))")
NOT_BUILT_HINT = ("run through `nam train --engine megatron --set train.schedule=dualpipev`, which lowers the model "
                  "for the V, or train with Megatron's 1F1B: --set train.schedule=1f1b")


def _unwrapped(chunk: Any, attribute: str) -> Any:
    """``attribute`` of the module inside DDP / Float16Module wrappers (each keeps it in ``.module``)."""
    while not hasattr(chunk, attribute) and hasattr(chunk, "module"):
        chunk = chunk.module
    return getattr(chunk, attribute, None)


class DualPipeV(PipelineSchedule):
    """Registered as ``schedules: dualpipev``; the engine instantiates it with no arguments.

    ``group``: the pipeline process group (default: Megatron's, from ``parallel_state``). ``hidden_size`` /
    ``dtype``: of the ``[s, b, h]`` tensors the stages hand on (default: the chunk's Megatron config,
    ``hidden_size`` and ``pipeline_dtype``). Tests pass all three to run without Megatron.
    """

    name = "dualpipev"
    chunks_per_rank = 2
    """Model chunks the engine must build on each pipeline rank."""

    def __init__(self, *, group=None, hidden_size: int | None = None, dtype: torch.dtype | None = None):
        self.group, self.hidden_size, self.dtype = group, hidden_size, dtype

    # --- the layout (PipelineSchedule) ------------------------------------------------------------------

    def stage_of(self, rank: int, chunk: int, pp: int) -> int:
        """Chunk 0 is stage ``rank`` on the way down, chunk 1 stage ``2 pp - 1 - rank`` on the way back, so rank
        0 holds the first and the last stage."""
        if not (0 <= rank < pp and chunk in (0, 1)):
            raise ValueError(f"no stage for rank {rank}, chunk {chunk} of pp={pp} x 2 chunks")
        return rank if chunk == 0 else 2 * pp - 1 - rank

    def check_layout(self, *, tp: int, pp: int, ep: int, num_microbatches: int) -> None:
        from nam_plugin_dualpipev.schedule import min_microbatches

        if ep != 1:  # an expert all-to-all desynchronises across the V's rank pairs
            raise ConfigError(f"schedule dualpipev runs only with expert parallelism 1, found ep={ep}",
                              hint="use --ep 1, or --set train.schedule=1f1b")
        if pp < 2:
            raise ConfigError(f"schedule dualpipev needs pipeline parallelism > 1, found pp={pp}",
                              hint="use --pp 2 (or more), or --set train.schedule=single")
        if num_microbatches < min_microbatches(pp):
            raise ConfigError(f"schedule dualpipev needs train.grad_accum >= 2 x pp = {min_microbatches(pp)}, found "
                              f"{num_microbatches}", hint=f"--set train.grad_accum={min_microbatches(pp)}")

    def embedding_ranks(self):
        """The first pipeline rank alone: it holds the token embedding (stage 0, chunk 0) and its copy for MTP
        (the last stage, chunk 1); ``reduce_shared_copies`` sums the two copies' gradients there."""
        return lambda ranks, *_: list(ranks[:1])

    def float16(self, config, module, chunk: int):
        """Float16Module for one chunk of the V, whose outputs stay as the chunk returns them.

        Float16Module upcasts the outputs of the last virtual stage of the last pipeline rank to fp32: the last
        stage in Megatron's interleaved order. In a V that chunk (chunk 1 on rank pp - 1) is a middle stage,
        whose bf16 activations the schedule sends on, and the last stage (chunk 1 on rank 0) returns the
        model's losses, which a bf16 model computes in fp32 itself. The inputs' downcast on stage 0 (chunk 0
        on rank 0) is the same in both orders and stays."""
        from megatron.core.transformer.module import Float16Module

        class VChunkFloat16Module(Float16Module):
            def forward(self, *inputs, fp32_output=True, **kwargs):
                return super().forward(*inputs, fp32_output=False, **kwargs)

        return VChunkFloat16Module(config, module)

    def reduce_shared_copies(self, models: list) -> None:
        """Give the copies of one weight that this rank holds in both chunks the sum of their gradients.

        Megatron flags the token embedding of the first stage and its copy on the MTP stage ``shared_embedding``
        and all-reduces their gradients over the embedding group. In the V both are chunks of pipeline rank 0,
        whose embedding group is itself alone (``embedding_ranks``): the sum is taken here, before the
        data-parallel reduction, so both copies take the same update."""
        if len(models) < 2:  # one chunk holds at most one copy; Megatron's embedding group does the rest
            return
        copies = [p for m in models for p in m.parameters() if getattr(p, "shared_embedding", False)]
        if len(copies) < 2:
            return
        total = torch.stack([p.main_grad for p in copies]).sum(0)
        for p in copies:
            p.main_grad.copy_(total)

    # --- the step ---------------------------------------------------------------------------------------

    def __call__(self, *, forward_step_func: Callable, data_iterator: Iterator | None, model: Sequence,
                 num_microbatches: int, seq_length: int, micro_batch_size: int,
                 forward_only: bool = False) -> list[dict]:
        from nam_plugin_dualpipev.executor import PipelineRank, device_of, plan_for

        if len(model) != 2:
            raise CannotRunHere(f"{NOT_BUILT}; found {len(model)} chunk(s) on this rank", hint=NOT_BUILT_HINT)
        config = _unwrapped(model[0], "config")
        self._refuse_unwired(config)
        setters = [_unwrapped(chunk, "set_input_tensor") for chunk in model]
        if None in setters:
            raise CannotRunHere(f"model chunk {setters.index(None)} has no set_input_tensor: dualpipev hands each "
                                "chunk the previous stage's output through it, as Megatron's schedules do",
                                hint="pass Megatron model chunks (or modules with set_input_tensor)")
        group = self.group if self.group is not None else self._pipeline_group()
        pp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        hidden = self.hidden_size or getattr(config, "hidden_size", None)
        dtype = self.dtype or getattr(config, "pipeline_dtype", None) or getattr(config, "params_dtype", None)
        if hidden is None or dtype is None:
            raise CannotRunHere("dualpipev needs the hidden size and dtype of the [s, b, h] tensors between stages; "
                                f"the chunk has no Megatron config that gives them (found {type(config).__name__})",
                                hint="DualPipeV(hidden_size=..., dtype=...)")
        device = device_of(model[0])
        self._set_aux_loss_scales(config, device, num_microbatches)
        batches = [next(data_iterator) for _ in range(num_microbatches)] if data_iterator is not None else None
        loss_funcs: dict[int, Callable] = {}
        logs: dict[int, dict] = {}

        def forward(chunk: int, microbatch: int, x: torch.Tensor | None) -> torch.Tensor:
            setters[chunk](x)
            one = iter([batches[microbatch]]) if batches is not None else None
            output, loss_func = forward_step_func(one, model[chunk])
            if rank == 0 and chunk == 1:  # the last stage
                loss_funcs[microbatch] = loss_func
            return output

        def loss(microbatch: int, output: torch.Tensor) -> torch.Tensor:
            result = loss_funcs.pop(microbatch)(output)
            if len(result) != 2:
                raise CannotRunHere(f"loss_func returned {len(result)} values; dualpipev takes (loss, logs) and does "
                                    "not wire Megatron's per-token form (loss, num_tokens, logs)",
                                    hint="return (loss, logs) from loss_func")
            value, logs[microbatch] = result
            value = value / num_microbatches
            scale = getattr(config, "grad_scale_func", None)
            return scale(value) if scale is not None and not forward_only else value

        runner = PipelineRank(pp=pp, rank=rank, forward=forward, loss=loss, dtype=dtype, device=device,
                              shape=(seq_length, micro_batch_size, hidden), group=group)
        runner.run(plan_for(pp, num_microbatches, not forward_only)[rank], train=not forward_only)
        finalize = getattr(config, "finalize_model_grads_func", None)
        if finalize is not None and not forward_only:
            finalize(list(model))
        return [logs[i] for i in range(num_microbatches)] if rank == 0 else []

    @staticmethod
    def _refuse_unwired(config: Any) -> None:
        unwired = [name for name in ("calculate_per_token_loss",) if getattr(config, name, False)]
        if (getattr(config, "context_parallel_size", 1) or 1) > 1:
            unwired.append(f"context_parallel_size={config.context_parallel_size}")
        if unwired:
            raise CannotRunHere(f"the model config sets {', '.join(unwired)}, which dualpipev does not wire (per-token "
                                "loss normalisation and context parallelism change how Megatron's schedules scale the "
                                "loss)",
                                hint=NOT_BUILT_HINT)

    @staticmethod
    def _set_aux_loss_scales(config: Any, device: torch.device, num_microbatches: int) -> None:
        """What Megatron's ``forward_step_calc_loss`` sets per forward (module docstring)."""
        scale_func = getattr(config, "grad_scale_func", None)
        one = torch.ones(1, device=device)
        scale = (scale_func(one) if scale_func is not None else one) / num_microbatches
        if getattr(config, "num_moe_experts", None) is not None:
            from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler

            MoEAuxLossAutoScaler.set_loss_scale(scale)
        if getattr(config, "mtp_num_layers", None) is not None:
            from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

            MTPLossAutoScaler.set_loss_scale(scale)
        if getattr(config, "experimental_attention_variant", None) == "dsa":
            from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

            DSAIndexerLossAutoScaler.set_loss_scale(scale)

    @staticmethod
    def _pipeline_group():
        from megatron.core import parallel_state

        return parallel_state.get_pipeline_model_parallel_group()
