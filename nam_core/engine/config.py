"""TrainConfig: how a run trains (optimizer, schedule, batches, checkpoints), whatever the model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


MOE_DISPATCHERS = ("alltoall", "flex")
"""``train.moe_dispatcher``: Megatron's all-to-all token dispatcher, or its flex dispatcher on DeepEP's kernels."""
ENGINES = ("local", "megatron")


@dataclass(kw_only=True)
class TrainConfig:
    engine: str = "local"
    """``local`` (one process, CPU or one GPU) or ``megatron`` (torchrun, several GPUs)."""
    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    dtype: str = "float32"
    """Parameter/activation dtype: ``float32`` (CPU) or ``bfloat16`` (GPU; D and dt_bias stay fp32)."""
    schedule: str = "single"
    """Registry ``schedules``: how micro-batches run (``single`` = forward/backward each in turn)."""
    tp: int = 1
    """Tensor-parallel size (megatron engine; the local engine needs 1)."""
    pp: int = 1
    """Pipeline-parallel size (megatron engine; the local engine needs 1)."""
    ep: int = 1
    """Expert-parallel size (megatron engine; divides the data-parallel size and the expert count)."""
    moe_dispatcher: str = "alltoall"
    """Megatron engine, MoE layers: ``alltoall`` (Megatron's all-to-all dispatcher) or ``flex`` (its flex
    dispatcher on DeepEP's kernels; DeepEP must be installed, never chosen because it happens to be)."""
    seed: int = 1234
    """Seeds parameters, data order and dropout."""

    micro_batch_size: int = 2
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a share of the peak."""
    warmup_steps: int = 10
    """Linear warmup length, optimizer steps."""
    total_steps: int = 1000
    """LR schedule length. ``--max-steps`` only stops a run early; the schedule is fixed by this field, so a
    run stopped and resumed follows the same curve."""
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    """Global grad-norm clip; 0 disables."""

    log_every: int = 1
    """Write a metrics.jsonl line every N steps."""
    checkpoint_every: int = 50
    """Save a checkpoint every N steps and at the end; 0: never (benchmarks, whose state nobody resumes)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept; older ones are deleted after a successful save."""

    plugin_options: dict = field(default_factory=dict)
    """Options read by plugins, ``{"<plugin>.<option>": value, ...}`` (set with --set <plugin>.<option>=...)."""

    def __post_init__(self):
        from nam_core.errors import ConfigError

        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ConfigError(f"train.moe_dispatcher={self.moe_dispatcher!r}: expected one of "
                              f"{', '.join(MOE_DISPATCHERS)}", hint="--set train.moe_dispatcher=alltoall")
        if self.engine not in ENGINES:
            raise ConfigError(f"train.engine={self.engine!r}: expected local or megatron", hint="--engine local")
        if self.checkpoint_every < 0:
            raise ConfigError(f"train.checkpoint_every must be >= 0 (0: no checkpoints), found {self.checkpoint_every}",
                              hint="--set train.checkpoint_every=50")

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def saves_after(self, step: int, last: int) -> bool:
        """Whether a checkpoint is written after optimizer step ``step`` (counted from 1) of a run that ends
        after step ``last``."""
        return self.checkpoint_every > 0 and (step % self.checkpoint_every == 0 or step == last)
