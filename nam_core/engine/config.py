"""TrainConfig: how a run trains (optimizer, schedule, batches, checkpoints), whatever the model.

Each field declares what it allows where it is declared (``bounded``, nam_core/bounds.py); the composition
root checks them all before anything is written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from nam_core.bounds import Rule, bounded

MOE_DISPATCHERS = ("alltoall", "flex")
"""``train.moe_dispatcher``: Megatron's all-to-all token dispatcher, or its flex dispatcher on DeepEP's kernels."""
FLEX_PLUGIN = "deepep"
"""The plugin that brings DeepEP and owns its requirement and rows (nam-plugin-deepep); requesting it selects
``flex``, and ``flex`` without it is refused (``nam_core.engine.megatron.checks.check_dispatcher``)."""
ENGINES = ("local", "megatron")
MEGATRON_ONLY = ("moe_dispatcher", "overlap_grad_reduce", "grad_reduce_in_fp32", "fused_master_weights",
                 "overlap_param_gather", "moe_shared_expert_overlap")
"""``TrainConfig`` fields only the megatron engine reads (Megatron's dispatcher, DDP and optimizer settings): a
local run with one of them off its default is refused (nam56r/run.py), not run without it."""
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16")
"""What the engines train in: the local engine casts the model to it, the megatron engine lowers to it
(nam_core/engine/megatron/checks.py); nothing here runs float16 or float8 as the parameter dtype."""


NUMERICS = ("fp32-master", "bf16-moments", "stochastic-rounding", "bf16")
"""``train.optimizer_numerics``: what AdamW updates and keeps (nam_core/engine/numerics.py has the table)."""
RECOMPUTE_KINDS = ("mamba", "mamba-scan", "moe", "attention", "layer")
"""``train.recompute``: the blocks whose activations are recomputed in backward instead of kept (Mamba-3
mixers; Mamba-3 mixers past their in_proj, whose output is kept; MoE blocks, router and experts; DSA and MLA
attention; whole layers, norm and mixer)."""
RECOMPUTE_PRESETS = {"none": (), "mixers": ("mamba", "moe", "attention"), "full": ("layer",)}
"""Names for common sets of ``RECOMPUTE_KINDS``."""


def recompute_kinds(train: "TrainConfig") -> tuple[str, ...]:
    """``train.recompute`` with its presets expanded, in ``RECOMPUTE_KINDS`` order."""
    named = {k for item in train.recompute for k in RECOMPUTE_PRESETS.get(item, (item,))}
    return tuple(k for k in RECOMPUTE_KINDS if k in named)


@dataclass(kw_only=True)
class TrainConfig:
    engine: str = bounded("local", choices=ENGINES, flag="--engine")
    """``local`` (one process, CPU or one GPU) or ``megatron`` (torchrun, several GPUs)."""
    device: str = bounded("cpu", choices=DEVICES, flag="--device")
    """``cpu`` or ``cuda``."""
    dtype: str = bounded("float32", choices=DTYPES, aka=("precision", "param_dtype"))
    """Parameter/activation dtype: ``float32`` (CPU) or ``bfloat16`` (GPU; D and dt_bias stay fp32)."""
    schedule: str = "single"
    """Registry ``schedules``: how micro-batches run (``single`` = forward/backward each in turn)."""
    tp: int = bounded(1, ge=1, flag="--tp", aka=("tensor_parallel", "tensor_model_parallel_size"))
    """Tensor-parallel size (megatron engine; the local engine needs 1)."""
    pp: int = bounded(1, ge=1, flag="--pp", aka=("pipeline_parallel", "pipeline_model_parallel_size"))
    """Pipeline-parallel size (megatron engine; the local engine needs 1)."""
    ep: int = bounded(1, ge=1, flag="--ep", aka=("expert_parallel", "expert_model_parallel_size"))
    """Expert-parallel size (megatron engine; divides the data-parallel size and the expert count)."""
    moe_dispatcher: str = bounded("alltoall", choices=MOE_DISPATCHERS)
    """Megatron engine, MoE layers: ``alltoall`` (Megatron's all-to-all dispatcher) or ``flex`` (its flex
    dispatcher on DeepEP's kernels: the deepep plugin selects it when requested, and it is refused without
    that plugin; never chosen because DeepEP happens to be installed)."""
    seed: int = bounded(1234, ge=0, le=2**32 - 1, flag="--seed", note="numpy and torch seed range")
    """Seeds parameters, data order and dropout."""

    micro_batch_size: int = bounded(2, ge=1, aka=("batch_size", "micro_batch", "mbs"))
    """Sequences per micro-batch."""
    grad_accum: int = bounded(1, ge=1, aka=("gradient_accumulation_steps", "grad_accumulation", "accum_steps"))
    """Micro-batches per optimizer step."""

    lr: float = bounded(3e-4, gt=0, aka=("learning_rate", "peak_lr", "max_lr"))
    """Peak learning rate."""
    min_lr_ratio: float = bounded(0.1, ge=0, le=1, aka=("min_lr",))
    """Cosine decay floor as a share of the peak."""
    warmup_steps: int = bounded(10, ge=0, aka=("warmup", "lr_warmup_steps"))
    """Linear warmup length, optimizer steps."""
    total_steps: int = bounded(1000, ge=1, aka=("max_steps", "steps", "train_iters", "num_steps"))
    """LR schedule length. ``--max-steps`` only stops a run early; the schedule is fixed by this field, so a
    run stopped and resumed follows the same curve."""
    weight_decay: float = bounded(0.1, ge=0, aka=("wd",))
    adam_beta1: float = bounded(0.9, ge=0, lt=1, aka=("beta1",))
    adam_beta2: float = bounded(0.95, ge=0, lt=1, aka=("beta2",))
    adam_eps: float = bounded(1e-8, gt=0, aka=("eps", "epsilon"))
    grad_clip: float = bounded(1.0, ge=0, note="0 disables", aka=("clip_grad", "max_grad_norm", "gradient_clipping"))
    """Global grad-norm clip; 0 disables."""
    optimizer_numerics: str = bounded("fp32-master", choices=NUMERICS,
                                      aka=("master_weights", "main_params_dtype", "exp_avg_dtype",
                                           "use_precision_aware_optimizer", "bf16_stochastic_round"))
    """Which copy of each weight AdamW updates and in which dtype it keeps its moments
    (nam_core/engine/numerics.py): ``fp32-master`` (fp32 master weights and moments, bf16 compute parameters:
    the published record's numerics and both engines' default), ``bf16-moments`` (fp32 masters, bf16 moments),
    ``stochastic-rounding`` (bf16 parameters updated with stochastic rounding, torchao; local engine only) or
    ``bf16`` (bf16 parameters and moments, round-to-nearest: updates under half a bf16 ulp are lost; local
    engine only). A float32 run takes ``fp32-master`` only. A resume keeps the checkpoint's numerics."""

    recompute: tuple[str, ...] = bounded((), choices=(*RECOMPUTE_KINDS, *RECOMPUTE_PRESETS),
                                         aka=("recompute_granularity", "recompute_modules", "activation_checkpointing",
                                              "gradient_checkpointing"))
    """Activation recompute, a comma list of kinds or one preset (``--set train.recompute=mamba,moe``):
    ``mamba``, ``mamba-scan`` (the Mamba-3 mixer past its in_proj: the in_proj output is kept, so the mixer's
    largest GEMM is not rerun; more memory than ``mamba``, less time), ``moe``, ``attention`` (DSA and MLA),
    ``layer`` (each layer whole); presets ``none``,
    ``mixers`` (the three mixers) and ``full`` (= ``layer``). A recomputed block keeps its input and runs its
    forward again in backward: less memory (nam56r/memory.py), one more forward of it per step. Bit-exact
    against no recompute where nam checkpoints (the local engine; Mamba and attention in the megatron engine),
    within 2e-7 where Megatron does (nam56r/recompute.py says how each engine runs it). Default: none."""

    log_every: int = bounded(1, ge=1, aka=("log_interval", "logging_steps"))
    """Write a metrics.jsonl line every N steps, and for the first and last step of each invocation (the
    summary reports the first step's time apart from the steady state, nam_core/engine/summary.py)."""
    checkpoint_every: int = bounded(50, ge=0, note="0: no checkpoints",
                                    aka=("save_every", "save_interval", "save_steps"))
    """Save a checkpoint every N steps and at the end; 0: never (benchmarks, whose state nobody resumes)."""
    keep_checkpoints: int = bounded(2, ge=1, aka=("save_total_limit", "keep_last"))
    """Checkpoints kept: after a successful save, it and the ``N - 1`` before it; older ones are deleted. One of a
    later step (another branch's, after a resume from an earlier checkpoint) is never deleted by a save."""
    async_checkpoints: bool = True
    """Write checkpoints in the background: training pays the copy of the state to host memory, not the write.
    Local engine: torch.distributed.checkpoint, format 3 (nam_core/engine/async_checkpoint.py); megatron engine:
    Megatron's dist-checkpointing async save (``BackgroundSaves`` in nam_core/engine/megatron/checkpoint.py).
    False: on the training thread (local: one torch.save file per part, format 2)."""

    eval_every: int = bounded(0, ge=0, note="0: no validation",
                              aka=("eval_interval", "eval_steps", "val_every", "val_check_interval"))
    """Evaluate the LM loss on held-out rows every N steps and after the last (nam_core/engine/validation.py);
    0: never. Needs held-out data: ``nam data prepare --val-fraction F`` or ``nam train --eval-data DIR`` (the
    default stdlib corpus holds out 3% of its files)."""
    eval_tokens: int = bounded(65_536, ge=1, aka=("eval_iters", "val_tokens", "eval_samples"))
    """Tokens one evaluation reads over all data-parallel ranks, rounded up to whole micro-batches, at most one
    pass over the held-out rows. 65,536: 8 micro-batches of 2 x 4096 (NAM56R), 256 of nam56r-tiny's 4 x 64."""

    plugin_options: dict = field(default_factory=dict)
    """Options read by plugins, ``{"<plugin>.<option>": value, ...}`` (set with --set <plugin>.<option>=...)."""

    overlap_grad_reduce: bool = False
    """Megatron engine: start each gradient bucket's reduce-scatter during the backward pass, as soon as the bucket
    is complete, instead of all of them after it (Megatron DDP's ``overlap_grad_reduce``). Off: ``bench/megatron.py
    throughput --overlap`` measured no gain (NAM56R MBS 2, H200, 2026-11-23: 1 GPU 8,393 -> 8,362 tokens/s, 2 GPUs
    at EP 2 with the shared-expert overlap too 7,477 -> 7,468). Refused with two model chunks per rank (DualPipeV
    sums the chunks' shared weights after the backward pass)."""
    grad_reduce_in_fp32: bool = True
    """Megatron engine: gradients accumulate and reduce in fp32 buffers (Megatron DDP's ``grad_reduce_in_fp32``; 4
    bytes per parameter). ``false`` keeps them in the parameters' dtype (bf16: 2 bytes, as the local engine's
    gradients, which its fp32-master AdamW reads in fp32), saving 2 bytes per parameter (8.8 GiB for NAM56R on one
    GPU); bf16 sums are rounded at each micro-batch and each reduction. A resume may not change it: Megatron keys
    the saved optimizer state by the (parameter, gradient) dtypes, so a checkpoint would not load with the other
    setting (the claim refuses the difference before anything loads)."""
    fused_master_weights: bool = False
    """Megatron engine, ``optimizer_numerics=fp32-master``, bf16: Megatron's precision-aware optimizer at fp32
    (``use_precision_aware_optimizer`` with fp32 main params and moments, ``store_param_remainders``). Transformer
    Engine's FusedAdam keeps each bf16 weight's fp32 master as the 16 low bits the weight lacks (weight + remainder
    = the fp32 master, exactly), reads the gradient buffers where they lie and writes the bf16 weights itself: the
    same numerics as Megatron's default path, 2 bytes per parameter fewer (8.8 GiB for NAM56R on one GPU), and no
    per-step fp32 gradient copy or master-to-weight copy. Needs Transformer Engine (``nam preflight --engine
    megatron`` has the row); ``bf16-moments`` always runs this way. Refused with ``grad_reduce_in_fp32=false``
    (the first update of full NAM56R came out non-finite, nam_core/engine/megatron/optimizer.py). A resume with
    the other value is refused (the saved optimizer state is of the other layout)."""
    overlap_param_gather: bool = False
    """Megatron engine: all-gather the updated parameters bucket by bucket inside the next forward pass instead
    of right after the optimizer step (Megatron DDP's ``overlap_param_gather``, distributed optimizer). Refused by
    the megatron engine (``checks.check_layout``): at NAM56R's full width Megatron-Core 0.19.2 asserts in its
    param-gather prefetch at the MTP's ``eh_proj`` (H200, 2026-11-23)."""
    moe_shared_expert_overlap: bool = False
    """Megatron engine, MoE layers: run the shared expert on a side CUDA stream while the routed tokens are
    dispatched (Megatron's ``moe_shared_expert_overlap``; alltoall or flex dispatcher). Off: measured no gain, as
    above (1 GPU: 8,350 tokens/s against 8,393)."""

    RULES = (
        Rule(("recompute",), "layer (or full) and none alone: a whole layer already covers its mixer",
             lambda c: len(c.recompute) <= 1 or not {"layer", "full", "none"} & set(c.recompute)),
        Rule(("recompute",), "mamba or mamba-scan, not both: mamba-scan is the part of the Mamba mixer past its "
             "in_proj", lambda c: not {"mamba", "mamba-scan"} <= set(c.recompute)),
        Rule(("fused_master_weights", "dtype"), "fused_master_weights with dtype=bfloat16 only (the master is the "
             "bf16 weight plus its 16 low bits; float32 parameters are their own masters)",
             lambda c: not c.fused_master_weights or c.dtype == "bfloat16"),
        Rule(("optimizer_numerics", "dtype"), "optimizer_numerics=fp32-master unless dtype=bfloat16 (float32 "
             "parameters are their own masters)", lambda c: c.optimizer_numerics == "fp32-master"
             or c.dtype == "bfloat16"),
    )

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def evaluates_after(self, step: int, last: int) -> bool:
        """Whether an evaluation follows optimizer step ``step`` (counted from 1) of a run ending after ``last``."""
        return self.eval_every > 0 and (step % self.eval_every == 0 or step == last)

    def saves_after(self, step: int, last: int) -> bool:
        """Whether a checkpoint is written after optimizer step ``step`` (counted from 1) of a run that ends
        after step ``last``."""
        return self.checkpoint_every > 0 and (step % self.checkpoint_every == 0 or step == last)
