"""The pipeline-schedule protocol: what a schedule provides the megatron engine and the model's lowering.

``train.schedule`` names Megatron's own (``single`` at pp = 1, ``1f1b``) or a class that the ``schedules``
registry holds. A registered schedule subclasses ``PipelineSchedule`` and overrides what differs from
Megatron's; the engine instantiates it with no arguments, and nothing in nam_core or nam56r knows its name.
What the class provides:

* ``chunks_per_rank`` and ``stage_of(rank, chunk, pp)``: how many model chunks each pipeline rank holds and
  which pipeline stage each is (stage 0 holds the embeddings, the last one the loss). The lowering reads
  both (``nam56r.megatron.lower(..., schedule=...)``) and the model builds exactly those chunks.
* ``check_layout``: the layouts it refuses (a ``ConfigError`` with the next command to try).
* ``embedding_ranks``, ``float16`` and ``reduce_shared_copies``: where the layout departs from Megatron's
  (which pipeline ranks hold a copy of the token embedding; how a bf16 chunk is wrapped; gradients of
  weights that one rank holds in several chunks).
* ``__call__``: one step's forward and backward passes, called exactly as Megatron's forward-backward
  functions are::

      losses = schedule(forward_step_func=..., data_iterator=..., model=[ddp_chunk, ...], num_microbatches=n,
                        seq_length=seq_len, micro_batch_size=mbs, forward_only=False)

  returning, on the rank that computes the loss, one dict of detached losses per micro-batch.

Megatron is imported inside methods only (CI has megatron-core 0.16.1).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from nam_core.errors import ConfigError

MEGATRON_SCHEDULES = ("single", "1f1b")
"""Schedule names Megatron's ``get_forward_backward_func`` serves (no pipelining at pp = 1, 1F1B at pp > 1)."""


class PipelineSchedule:
    """A pipeline schedule for the megatron engine. The defaults are Megatron's own layout: one chunk per
    pipeline rank, chunk ``c`` of rank ``r`` is stage ``c * pp + r`` (its interleaved order)."""

    name = "megatron"
    """How the lowering and the logs name it (a registered schedule: its ``train.schedule`` name)."""
    chunks_per_rank = 1
    """Model chunks the engine builds, wraps, optimises and checkpoints on each pipeline rank."""

    def stage_of(self, rank: int, chunk: int, pp: int) -> int:
        """The pipeline stage of pipeline rank ``rank``'s chunk ``chunk`` (0 = embeddings, last = the loss)."""
        if not (0 <= rank < pp and 0 <= chunk < self.chunks_per_rank):
            raise ValueError(f"no stage for rank {rank}, chunk {chunk} of pp={pp} x {self.chunks_per_rank} chunk(s)")
        return chunk * pp + rank

    def check_layout(self, *, tp: int, pp: int, ep: int, num_microbatches: int) -> None:
        """Raise ConfigError for a layout this schedule cannot run."""

    def embedding_ranks(self) -> Callable[[list], list] | None:
        """Megatron's ``get_embedding_ranks`` (which pipeline ranks hold a copy of the token embedding, whose
        gradients Megatron all-reduces); None: Megatron's default, the first and the last pipeline rank."""
        return None

    def float16(self, config: Any, module: Any, chunk: int) -> Any:
        """Chunk ``chunk`` of a bf16 model in Megatron's ``Float16Module``."""
        from megatron.core.transformer.module import Float16Module

        return Float16Module(config, module)

    def reduce_shared_copies(self, models: list) -> None:
        """Before Megatron's gradient finalisation: make the copies of one weight that this rank holds in
        several chunks agree (nothing to do with one chunk per rank)."""

    def __call__(self, *, forward_step_func, data_iterator, model: list, num_microbatches: int, seq_length: int,
                 micro_batch_size: int, forward_only: bool = False) -> list[dict]:
        raise NotImplementedError(f"{type(self).__name__} does not run a step")


class MegatronSchedule(PipelineSchedule):
    """Megatron's own schedules through ``get_forward_backward_func`` (which reads the pipeline groups, so it
    is looked up at the first step, after ``init_parallel``)."""

    def __init__(self, name: str = "1f1b"):
        self.train_schedule = name

    def __call__(self, **kwargs) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(**kwargs)


def resolve_schedule(name: str, *, pp: int, registered: Mapping[str, Any]) -> PipelineSchedule | None:
    """The schedule registered as ``name`` (instantiated if a class), or None for Megatron's own (``single`` at
    pp = 1, ``1f1b``). A registered value of None is taken on trust (before the plugins are active)."""
    if name in registered:
        impl = registered[name]
        schedule = impl() if isinstance(impl, type) else impl
        if schedule is not None and not isinstance(schedule, PipelineSchedule):
            raise ConfigError(f"train.schedule={name!r} is registered as {type(schedule).__name__}, which does not "
                              "implement nam_core.engine.megatron.schedule.PipelineSchedule",
                              hint="the plugin that registers it must subclass PipelineSchedule")
        return schedule
    if name == "single" and pp > 1:
        raise ConfigError(f"train.schedule='single' runs micro-batches one after the other; pp={pp} needs a "
                          "pipeline schedule", hint="--set train.schedule=1f1b")
    if name not in MEGATRON_SCHEDULES:
        known = ", ".join([*MEGATRON_SCHEDULES, *sorted(registered)])
        raise ConfigError(f"train.schedule={name!r} is neither Megatron's nor a registered schedules plugin "
                          f"(known here: {known})", hint="--set train.schedule=1f1b, or add the plugin that "
                                                         "provides it with --plugins")
    return None


def schedule_for(name: str, *, pp: int, registered: Mapping[str, Any]) -> PipelineSchedule:
    """``resolve_schedule`` once the plugins are active: Megatron's own as a ``MegatronSchedule``."""
    schedule = resolve_schedule(name, pp=pp, registered=registered)
    if schedule is None and name not in MEGATRON_SCHEDULES:
        raise ConfigError(f"train.schedule={name!r} is not registered yet (the plugins are not active)",
                          hint="activate the run's plugins first (nam56r.run.activate)")
    return schedule or MegatronSchedule(name)
