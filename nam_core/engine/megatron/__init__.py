"""The megatron engine: a model on several GPUs through Megatron-Core >= 0.19, one process per GPU (torchrun).

The model comes as a ``MegatronModel`` (for NAM56R: ``nam56r.megatron.NamMegatronModel``, built from its
lowering); the engine runs it and knows nothing of NAM56R. Its parts, one module each:

* ``checks``: what fails closed before anything starts (megatron-core version, CUDA, torch.distributed,
  psutil, the MoE dispatcher, the CUDA allocator setting, the parallel layout);
* ``schedule``: the pipeline-schedule protocol (``PipelineSchedule``) that Megatron's own schedules and
  registered ``schedules`` plugins implement: chunks per rank, their stages, the step's forward-backward;
* ``parallel``: process groups (TP, PP, EP, DP), seeds, this rank's device;
* ``model``: the ``MegatronModel`` protocol and the chunks in Megatron's DDP;
* ``optimizer``: the distributed optimizer and nam's learning-rate schedule on it;
* ``patches``: the patch-lane entries for what Megatron-Core's optimizer gets wrong here, applied for the run;
* ``checkpoint``: dist-checkpointing save and resume;
* ``loop``: ``train`` (an ``EngineRun`` whose model is a ``MegatronModel``);
* ``engine``: ``MegatronEngine``, the engine contract (``nam_core.engine.contract.Engine``).

Megatron is imported inside functions only, so the package imports, and its checks run, on a CPU machine with
any megatron-core (CI has 0.16.1 on Python 3.11). The rest runs on GPU hosts (tests/test_megatron_engine_gpu.py,
bench/megatron.py) and on CPU processes over gloo (tests/test_megatron_engine_gloo.py). Section numbers (§)
refer to ``shared/reference/megatron-core.md``.
"""

from nam_core.engine.megatron.checks import (
    ALLOC_CONF,
    MIN_MEGATRON,
    check_layout,
    check_runtime,
    megatron_version,
    prepare_allocator,
    runtime_checks,
    runtime_facts,
)
from nam_core.engine.megatron.checkpoint import (
    CHECKPOINT_FORMAT,
    good_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from nam_core.engine.megatron.engine import MegatronEngine
from nam_core.engine.megatron.loop import train
from nam_core.engine.megatron.model import MegatronModel, build_ddp, unwrap
from nam_core.engine.megatron.parallel import device, init_distributed, init_parallel, shutdown
from nam_core.engine.megatron.schedule import (
    MEGATRON_SCHEDULES,
    MegatronSchedule,
    PipelineSchedule,
    resolve_schedule,
    schedule_for,
)

__all__ = [
    "ALLOC_CONF", "CHECKPOINT_FORMAT", "MEGATRON_SCHEDULES", "MIN_MEGATRON", "MegatronModel",
    "MegatronEngine", "MegatronSchedule", "PipelineSchedule", "build_ddp", "check_layout", "check_runtime", "device",
    "good_checkpoints", "init_distributed", "init_parallel", "load_checkpoint", "megatron_version",
    "prepare_allocator", "resolve_resume", "resolve_schedule", "runtime_checks", "runtime_facts", "save_checkpoint",
    "schedule_for", "shutdown", "train", "unwrap",
]
