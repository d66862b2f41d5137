"""The megatron engine: a model on several GPUs through Megatron-Core >= 0.19, one process per GPU (torchrun).

The model comes as a ``MegatronModel`` (for NAM56R: ``nam56r.megatron_model.NamMegatronModel``, built from
the lowering in ``nam56r.megatron``); this module runs it, and knows nothing of NAM56R:

1. checks that fail closed before anything starts (megatron-core version, CUDA, torch.distributed, psutil,
   the parallel layout, the CUDA allocator setting);
2. process groups (TP, PP, EP, DP) and seeds;
3. DDP with the distributed optimizer (bf16 models through ``Float16Module``; parameters the model keeps in
   fp32 stay fp32), Megatron's forward-backward schedules (or a registered ``schedules`` plugin),
   dist-checkpointing save and resume, and the local engine's metrics.jsonl lines;
4. the learning rate of the local engine's schedule (``nam_core.engine.local.lr_lambda``), set on the
   optimizer's parameter groups each step.

Megatron is imported inside functions only, so this module imports, and its checks run, on a CPU machine
with any megatron-core (CI has 0.16.1 on Python 3.11). The rest runs on GPU hosts: tests/test_megatron_engine_gpu.py
and bench/megatron.py. Section numbers (§) refer to ``shared/reference/megatron-core.md``.

The schedule hook: ``train.schedule`` names a registered ``schedules`` implementation (a class is
instantiated with no arguments) or one of Megatron's own: ``single`` (pp = 1) and ``1f1b``. The engine calls
it exactly as Megatron's forward-backward functions are called::

    losses = schedule(forward_step_func=..., data_iterator=..., model=[ddp_chunk, ...], num_microbatches=n,
                      seq_length=seq_len, micro_batch_size=mbs, forward_only=False)

and expects back, on the rank that computes the loss, one dict of detached losses per micro-batch. A
schedule that needs more than one model chunk per pipeline rank says so in ``chunks_per_rank`` (DualPipeV's V:
2); the model must have been lowered for the same number (``MegatronModel.chunks``), and the engine builds,
wraps, optimises and checkpoints every chunk.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, MutableMapping, Protocol

import torch
from torch import nn

from nam_core.engine import checkpoint
from nam_core.engine.config import TrainConfig
from nam_core.engine.local import first_non_finite, lr_lambda
from nam_core.engine.metrics import MetricsLog, truncate_metrics
from nam_core.errors import ConfigError, NamError, TrainingGuardError

MIN_MEGATRON = (0, 19)
"""`+` (MLA layer) and the hybrid MTP hand-over this engine builds on arrived in core_v0.19.0 (§1.2)."""

ALLOC_CONF = "expandable_segments:True"
"""NAM56R runs out of memory from fragmentation before capacity (issue 8): the allocator must grow segments."""
ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""torch reads both names (the second is the newer, device-neutral one); either may override the other."""

MEGATRON_SCHEDULES = ("single", "1f1b")
"""Schedule names Megatron's ``get_forward_backward_func`` serves (no pipelining at pp = 1, 1F1B at pp > 1)."""

CHECKPOINT_FORMAT = "megatron-dist-1"


# --- checks that fail closed (CPU-testable) ------------------------------------------------------------


def prepare_allocator(environ: MutableMapping[str, str], *, cuda_initialized: bool) -> str:
    """Make sure the CUDA caching allocator runs with expandable segments; return the setting in force.

    Sets ``PYTORCH_CUDA_ALLOC_CONF`` when neither allocator variable is set and CUDA has not initialised
    yet (the allocator reads it once, at initialisation). Raises when the environment sets either variable
    without ``expandable_segments:True``, or when it is unset and CUDA is already up.
    """
    found = {name: environ[name] for name in ALLOC_VARS if name in environ}
    for name, value in found.items():
        options = {}
        for part in value.split(","):
            key, _, setting = part.partition(":")
            options[key.strip()] = setting.strip()
        if options.get("expandable_segments", "").lower() != "true":
            raise NamError(
                f"the environment sets {name}={value!r}, which overrides what the megatron engine needs "
                f"({ALLOC_CONF}: NAM56R runs out of memory from fragmentation before capacity)",
                hint=f"unset {name}, or add the setting: export {name}={value},{ALLOC_CONF}", exit_code=3)
    if found:
        return next(iter(found.values()))
    if cuda_initialized:
        raise NamError(
            f"CUDA was initialised before the megatron engine could set PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF}; "
            "the allocator reads it only once, at initialisation",
            hint=f"export PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF} before torchrun, or call prepare_allocator "
                 "before anything touches CUDA", exit_code=3)
    environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    return ALLOC_CONF


def megatron_version() -> tuple[int, ...] | None:
    """The (major, minor, patch) of the megatron-core that ``import megatron.core`` loads; None if absent."""
    try:
        from megatron.core import package_info
    except ImportError:
        return None
    return tuple(int(v) for v in package_info.VERSION[:3])


def runtime_facts() -> dict:
    """What ``runtime_checks`` needs to know about this process (imports megatron-core if installed)."""
    import importlib.util
    import sys

    return {
        "megatron": megatron_version(),
        "python": sys.version_info[:2],
        "cuda": torch.cuda.is_available(),
        "distributed": torch.distributed.is_available(),
        "world_size": int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None,
        "psutil": importlib.util.find_spec("psutil") is not None,
        "deep_ep": importlib.util.find_spec("deep_ep") is not None,
        "fused_adam": next((name for name in ("transformer_engine", "apex")
                            if importlib.util.find_spec(name) is not None), None),
    }


DISPATCHERS = ("alltoall", "flex")
"""``train.moe_dispatcher``: Megatron's all-to-all token dispatcher, or its flex dispatcher on DeepEP's kernels."""


def runtime_checks(facts: Mapping, *, dispatcher: str = "alltoall", launched: bool = True) -> list:
    """One ``Check`` row per thing the megatron engine needs from this process (``nam preflight --engine
    megatron`` prints them; ``check_runtime`` raises on the failed ones). ``launched=False`` skips the
    torchrun row (preflight runs outside torchrun)."""
    from nam_core.requirements import FAIL, PASS, SKIP, Check

    def row(name, ok, needed, found, hint):
        return Check("megatron engine", name, PASS if ok else FAIL, needed, found, None if ok else hint)

    version = facts["megatron"]
    found = "not installed" if version is None else ".".join(map(str, version))
    want = ".".join(map(str, MIN_MEGATRON))
    py = ".".join(map(str, facts["python"]))
    rows = [
        row("megatron-core", version is not None and tuple(version[:2]) >= MIN_MEGATRON, f">= {want}",
            f"{found} (Python {py})", "pip install 'megatron-core>=0.19' on Python >= 3.12 (its wheels require 3.12)"),
        row("CUDA", facts["cuda"], "a CUDA device", "available" if facts["cuda"] else "torch.cuda.is_available() is False",
            "run on a GPU host; the local engine trains on the CPU: nam train --engine local"),
        row("torch.distributed", facts["distributed"], "available", "yes" if facts["distributed"] else "no",
            "install a torch build with distributed support"),
        row("psutil", facts["psutil"], "installed (Megatron's checkpoint writer needs it; without it a save hangs, §9.2)",
            "yes" if facts["psutil"] else "no", "pip install psutil"),
    ]
    if launched:
        rows.append(row("torchrun launch", facts["world_size"] is not None, "WORLD_SIZE set by torchrun",
                        "not set" if facts["world_size"] is None else f"WORLD_SIZE={facts['world_size']}",
                        "torchrun --nproc-per-node N -m nam_cli train --engine megatron ..., or nam train --nproc N"))
    if dispatcher not in DISPATCHERS:
        rows.append(row("MoE dispatcher", False, " or ".join(DISPATCHERS), dispatcher, "--set train.moe_dispatcher=alltoall"))
    elif dispatcher == "flex" or facts["deep_ep"]:
        rows.append(row("DeepEP (flex dispatcher)", facts["deep_ep"], f"installed for train.moe_dispatcher={dispatcher}"
                        if dispatcher == "flex" else "installed", "yes" if facts["deep_ep"] else "not installed",
                        "install DeepEP, or --set train.moe_dispatcher=alltoall"))
    else:
        rows.append(Check("megatron engine", "DeepEP (flex dispatcher)", SKIP, "only for train.moe_dispatcher=flex",
                          "not installed: MoE tokens move through Megatron's all-to-all dispatcher"))
    fused = facts.get("fused_adam")
    rows.append(Check("megatron engine", "optimizer", PASS if fused else SKIP,
                      "Transformer Engine's or Apex's fused Adam, which Megatron uses when importable",
                      f"{fused}'s fused Adam" if fused else
                      "neither installed: Megatron builds torch.optim.AdamW, which the engine switches to torch's "
                      "fused implementation; Megatron's gradient norm and scaling run as per-tensor Python loops "
                      "(slower; bench/README.md, the megatron engine's profile)"))
    return rows


def check_runtime(facts: Mapping, *, dispatcher: str = "alltoall") -> None:
    """One NamError (exit 3) listing everything this process lacks for the megatron engine, or nothing."""
    failed = [c for c in runtime_checks(facts, dispatcher=dispatcher) if not c.ok]
    if failed:
        raise NamError("the megatron engine cannot run here; missing: "
                       + "; ".join(f"{c.name}: needs {c.needed}, found {c.found}" for c in failed),
                       hint="; ".join(dict.fromkeys(c.hint for c in failed if c.hint)), exit_code=3)


def resolve_schedule(name: str, *, pp: int, registered: Mapping[str, Any]) -> Callable | None:
    """The schedule plugin registered as ``name``, or None for Megatron's own (``single`` at pp = 1, ``1f1b``)."""
    if name in registered:
        impl = registered[name]
        return impl() if isinstance(impl, type) else impl
    if name == "single" and pp > 1:
        raise ConfigError(f"train.schedule='single' runs micro-batches one after the other; pp={pp} needs a "
                          "pipeline schedule", hint="--set train.schedule=1f1b")
    if name not in MEGATRON_SCHEDULES:
        known = ", ".join([*MEGATRON_SCHEDULES, *sorted(registered)])
        raise ConfigError(f"train.schedule={name!r} is neither Megatron's nor a registered schedules plugin "
                          f"(known here: {known})", hint="--set train.schedule=1f1b, or add the plugin that "
                                                         "provides it with --plugins")
    return None


def check_layout(*, world_size: int, tp: int, pp: int, ep: int, train: TrainConfig,
                 registered_schedules: Mapping[str, Any]) -> int:
    """Refuse a parallel layout or a train config this engine cannot run; return the data-parallel size."""
    for name, size in (("tp", tp), ("pp", pp), ("ep", ep)):
        if size < 1:
            raise ConfigError(f"--{name} {size}: parallel sizes start at 1", hint=f"--{name} 1")
    if world_size % (tp * pp):
        raise ConfigError(f"{world_size} GPUs do not split into tp={tp} x pp={pp} groups",
                          hint=f"launch a multiple of {tp * pp} processes: torchrun --nproc-per-node {tp * pp} ...")
    dp = world_size // (tp * pp)
    if dp % ep:
        raise ConfigError(f"ep={ep} must divide the data-parallel size {dp} (= {world_size} GPUs / (tp={tp} x pp={pp}))",
                          hint=f"choose --ep among the divisors of {dp}, or launch {ep * tp * pp} GPUs")
    if train.dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"train.dtype={train.dtype!r}: the megatron engine trains in bfloat16 or float32",
                          hint="--set train.dtype=bfloat16")
    if train.device != "cuda":
        raise ConfigError(f"train.device={train.device!r}: the megatron engine runs on CUDA devices only",
                          hint="--device cuda, or --engine local on the CPU")
    resolve_schedule(train.schedule, pp=pp, registered=registered_schedules)
    return dp


class MegatronModel(Protocol):
    """What the engine needs from a model (NAM56R's: ``nam56r.megatron_model.NamMegatronModel``)."""

    parallel: Mapping[str, int]
    """``tp``, ``pp``, ``ep``: the layout the model was lowered for."""
    chunks: int
    """Model chunks per pipeline rank the model was lowered for (1; 2 for a V-shaped schedule)."""
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
        stage's output reaches ``loss_func`` as the model returns it (under a V, not upcast by Float16Module):
        a bf16 model returns its losses in fp32."""

    def end_step(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
        """This step's extra loss sums (logged, already in the loss) and log lines, from the unwrapped model."""


# --- process groups, seeds, optimizer -------------------------------------------------------------------


def init_distributed() -> None:
    """This rank's GPU (from LOCAL_RANK) and the NCCL default group; idempotent. ``nam train`` calls it early
    (rank 0 prepares data and writes the run folder while the others wait)."""
    if torch.distributed.is_initialized():
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))


def embedding_ranks(chunks: int) -> Callable[[list], list] | None:
    """Megatron's ``get_embedding_ranks`` for ``chunks`` model chunks per pipeline rank: None (its default, the
    first and last pipeline rank, which hold the token embedding and its copy for MTP) for one chunk; for a V,
    the first pipeline rank alone, which holds both (its chunk 0 and its chunk 1): ``finalize`` sums those
    two copies' gradients on the rank instead."""
    return None if chunks == 1 else (lambda ranks, *_: list(ranks[:1]))


def init_parallel(*, tp: int, pp: int, ep: int, seed: int, chunks: int = 1):
    """NCCL process groups for tp x pp x ep (the rest is data parallel); Megatron's RNG trackers."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    init_distributed()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, get_embedding_ranks=embedding_ranks(chunks))
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def _param_groups(opt_config) -> dict:
    """Megatron's standard groups (no decay on vectors, as the local engine), with the fp32 parameters of a bf16
    model (Mamba-3's D, dt_bias, B_bias, C_bias) in groups of their own.

    0.19.2's DistributedOptimizer numbers a group's parameters in grad-buffer order
    (distrib_optimizer.py:328-337) but lists them fp32-first to the inner optimizer (:486-490); in a group
    that mixes fp32 and bf16 parameters the two orders differ, and checkpoint save and load read the wrong
    parameter's state (the dp_reshardable save then fails its shape assertion, :1958). ``start_wd`` only
    tells the groups apart: nothing here reads it (``_set_lr`` sets the decay itself).
    """
    from megatron.core.optimizer import ParamKey, ParamPredicate, get_standard_config_overrides

    overrides = get_standard_config_overrides(opt_config)
    fp32 = ParamKey(predicate=ParamPredicate(name="fp32_in_bf16", fn=lambda p: p.dtype == torch.float32))
    overrides[fp32] = {"start_wd": opt_config.weight_decay}
    return overrides


def _set_lr(optimizer, lr: float, weight_decay: float) -> None:
    """What Megatron's OptimizerParamScheduler writes, with nam's schedule: lr and decay per group."""
    for group in optimizer.param_groups:
        group_lr = lr * group.get("lr_mult", 1.0)
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"].fill_(group_lr)
        else:
            group["lr"] = group_lr
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)


# --- checkpoints -----------------------------------------------------------------------------------------


def _model_state(models: list) -> dict:
    """The chunks' sharded state dicts: one chunk's as is, several under ``model0``, ``model1``, ... as
    Megatron's own checkpoints keep virtual-pipeline chunks. Unwrapped: no DDP "module." prefixes (§9.3)."""
    states = [unwrap(m).sharded_state_dict() for m in models]
    return states[0] if len(states) == 1 else {f"model{i}": state for i, state in enumerate(states)}


def _sharded_state(models: list, optimizer, *, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model_sd = _model_state(models)
    # dp_reshardable: each rank writes its own optimizer shards (resume needs the same layout, which
    # load_checkpoint enforces). 0.19.2's default, fully_sharded_model_space, raises "ShardedTensor.flattened_range
    # is not supported" (dist_checkpointing/mapping.py:134).
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata),
            "rng": ShardedObject("rng", checkpoint.rng_state(), (world,), (rank,), replica_id=0)}


def good_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete megatron-engine checkpoints under ``ckpt_root``, oldest first (a manifest is written last)."""
    if not ckpt_root.is_dir():
        return []
    good = []
    for folder in sorted(p for p in ckpt_root.glob("step-*") if p.is_dir()):
        manifest = folder / "manifest.json"
        if manifest.is_file() and json.loads(manifest.read_text()).get("format") == CHECKPOINT_FORMAT:
            good.append(folder)
    return good


def save_checkpoint(ckpt_root: Path, step: int, models: list, optimizer, *, manifest: dict, keep: int) -> Path:
    """Collective: every rank writes its shards into a hidden folder, rank 0 adds the manifest and renames
    it into place (atomic on POSIX), then prunes old checkpoints. A crash leaves the last good one intact."""
    from megatron.core import dist_checkpointing

    rank0 = torch.distributed.get_rank() == 0
    final = ckpt_root / f"step-{step:08d}"
    tmp = ckpt_root / f".{final.name}.tmp"
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save(_sharded_state(models, optimizer, is_loading=False), str(tmp), verify_integrity=True)
    torch.distributed.barrier()
    if rank0:
        (tmp / "manifest.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": step, **manifest},
                                                      indent=2))
        for path in tmp.iterdir():  # on disk before the rename makes the folder count as good
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        checkpoint.fsync_dir(tmp)
        if final.exists():  # the same step saved again (end of a resumed run)
            shutil.rmtree(final)
        os.rename(tmp, final)
        checkpoint.fsync_dir(ckpt_root)
        for old in good_checkpoints(ckpt_root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    torch.distributed.barrier()
    return final


def use_fused_adamw(optimizer) -> list[str]:
    """Run each inner torch AdamW of Megatron's optimizer on torch's fused implementation; returns what it set.

    Without Transformer Engine or Apex, Megatron-Core 0.19 builds ``torch.optim.AdamW`` with torch's default
    implementation (on CUDA the multi-tensor ``foreach`` one), which took 52 ms of a 1,485 ms step at 2x H200,
    MBS 2 (bench/README.md). torch's ``fused`` implementation computes the same AdamW update in one kernel per
    device and dtype. AdamW reads ``fused`` and ``foreach`` from each parameter group at every step, so they
    are set on the groups; ``fused`` also makes ``load_state_dict`` keep each ``step`` on its parameter's
    device. Transformer Engine's or Apex's FusedAdam, where Megatron built one, is left as it is.
    """
    changed = []
    for i, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = opt.optimizer
        if type(inner) not in (torch.optim.AdamW, torch.optim.Adam):
            continue
        for group in (inner.defaults, *inner.param_groups):
            group["fused"], group["foreach"] = True, False
        changed.append(f"optimizer {i}: torch.optim.{type(inner).__name__}(fused=True)")
    return changed


def _materialise_optimizer_state(optimizer) -> None:
    """Give torch's AdamW its per-parameter state (with ``step``) before a load describes it.

    Without Apex or Transformer Engine, DistributedOptimizer.state_dict asserts one ``step`` across the inner
    optimizer's state (distrib_optimizer.py:839), which torch creates on the first step only. One step on
    zero gradients at lr 0 and no weight decay creates it and moves no weight; the load overwrites it.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        saved = [(group["lr"], group["weight_decay"]) for group in inner.param_groups]
        for group in inner.param_groups:
            group["lr"], group["weight_decay"] = 0.0, 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad(set_to_none=True)
        for group, (lr, wd) in zip(inner.param_groups, saved):
            group["lr"], group["weight_decay"] = lr, wd


def _restore_adam_steps(optimizer, step: int) -> None:
    """Set every parameter's AdamW ``step`` to the checkpoint's step, each its own tensor.

    Without Apex or Transformer Engine, 0.19.2's DistributedOptimizer gets torch AdamW's per-parameter
    ``step`` wrong on load twice over: load_state_dict hands one shared tensor to every state
    (distrib_optimizer.py:1025-1032), which AdamW then increments once per parameter, and the dp_reshardable
    load writes back the step the load template held (a LocalNonpersistentObject, distrib_optimizer.py:1956).
    Every optimizer step of this engine steps every parameter, so the right value is the checkpoint's step.
    (A patch-lane candidate: detect = states sharing one ``step`` after a load; retire when upstream fixes it.)
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            on_param = group.get("fused") or group.get("capturable")  # where torch's AdamW keeps ``step`` then
            for p in group["params"]:
                state = inner.state.get(p, {})
                if "step" in state:
                    old = state["step"]
                    state["step"] = torch.full((), float(step), dtype=torch.float32 if on_param else old.dtype,
                                               device=p.device if on_param else old.device)


def resolve_resume(spec: str, ckpt_root: Path) -> Path:
    """``auto`` -> the newest good megatron-engine checkpoint under ``ckpt_root``; a path -> that folder, if
    it is one (the layout is checked when it loads)."""
    return checkpoint.resolve_resume(
        spec, ckpt_root, good=good_checkpoints, what="megatron-engine checkpoint",
        is_good=lambda folder: folder.resolve() in [g.resolve() for g in good_checkpoints(folder.parent)],
        why_not=f"no {CHECKPOINT_FORMAT} manifest")


def load_checkpoint(folder: Path, models: list, optimizer, *, layout: dict) -> dict:
    """Restore the model chunks, optimizer and per-rank RNG from ``folder``; refuse another parallel layout."""
    from megatron.core import dist_checkpointing

    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise NamError(f"{folder} is not a complete megatron-engine checkpoint (no {CHECKPOINT_FORMAT} manifest)",
                       hint="resume from a folder listed by good_checkpoints, or start without --resume")
    if manifest.get("layout") != layout:
        raise NamError(f"{folder} was written with layout {manifest.get('layout')}, this run is {layout}",
                       hint="resume with the same GPUs, tp, pp and ep")
    _materialise_optimizer_state(optimizer)
    state = dist_checkpointing.load(_sharded_state(models, optimizer, is_loading=True), str(folder),
                                    verify_integrity=True)
    with torch.no_grad():  # the optimizer copies into its main params, leaves that require grad
        for i, model in enumerate(models):
            unwrap(model).load_state_dict(state["model"] if len(models) == 1 else state["model"][f"model{i}"])
        optimizer.load_state_dict(state["optimizer"])
    use_fused_adamw(optimizer)  # the load replaced the parameter groups with the checkpoint's
    _restore_adam_steps(optimizer, manifest["step"])
    checkpoint.set_rng_state(state["rng"])
    return manifest


# --- the run ---------------------------------------------------------------------------------------------


@dataclass
class MegatronRun:
    """Everything one megatron-engine run needs; the counterpart of ``nam_core.engine.local.LocalRun``.

    ``batch_at(index, batch_size)`` returns micro-batch ``index`` (a dict of [b, s] CPU tensors, what
    ``model.forward_step`` reads) as a pure function of the index. Data-parallel rank ``r`` runs micro-batches
    ``step * dp * grad_accum + r * grad_accum + j``, so the local engine with ``grad_accum * dp`` micro-batches
    sees the same rows in the same steps.
    """

    run_dir: Path
    train: TrainConfig
    model: MegatronModel
    batch_at: Callable[[int, int], dict]
    host: Any
    max_steps: int
    flops_per_token: float
    schedules: Mapping[str, Any] = field(default_factory=dict)
    """The ``schedules`` registry (name -> implementation)."""
    record: dict = field(default_factory=dict)
    resume_from: Path | None = None
    quiet: bool = False
    notes: list[str] = field(default_factory=list)
    checkpoints: bool = True
    """False: write none, not even at the end (throughput benchmarks, whose state nobody resumes)."""
    step: int = 0
    log: MetricsLog | None = None
    """Rank 0's metrics log while training (None on the other ranks): plugins' step hooks write notes to it,
    as with ``LocalRun.log``."""


def _device() -> torch.device:
    """This rank's GPU (``init_distributed`` selects it from LOCAL_RANK)."""
    return torch.device("cuda", torch.cuda.current_device())


def _batches(run: MegatronRun, step: int, dp_rank: int, dp: int):
    n, mbs = run.train.grad_accum, run.train.micro_batch_size
    device = _device()
    for j in range(n):
        index = (step * dp + dp_rank) * n + j
        yield index, {k: v.to(device, non_blocking=True) for k, v in run.batch_at(index, mbs).items()}


def _step_means(losses: list[dict], aux: dict, moe_coeff: float, n_micro: int, dp: int) -> dict[str, float]:
    """Per-step means over micro-batches and data-parallel replicas, summed over pipeline stages: the same
    numbers the local engine logs. Collective (every rank)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    sums: dict[str, torch.Tensor] = {}
    for micro in losses:
        for key, value in micro.items():
            sums[key] = sums.get(key, 0) + value.float()
    sums.update(aux)
    tracker = get_moe_metrics_tracker()
    entry = tracker.metrics.get("load_balancing_loss")  # per layer: aux / coeff, summed over micro-batches
    if entry is not None:
        sums["moe_aux"] = entry.values.float().sum() * moe_coeff
    tracker.clear()
    names: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(names, sorted(sums))
    keys = sorted(set().union(*names))
    device = _device()
    vector = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float32, device=device).reshape(())
                          for k in keys])
    torch.distributed.all_reduce(vector)
    means = dict(zip(keys, (vector / (n_micro * dp)).tolist()))
    means["loss"] = sum(means.values())
    return means


def build_ddp(provider: MegatronModel, train: TrainConfig, pg_collection, *, distributed_optimizer: bool):
    """This rank's model chunks, each in Megatron's DDP (bf16 through Float16Module; parameters the model keeps
    fp32 stay fp32, §8), gradients reduced in fp32; returns ``(transformer config, [DDP chunk, ...])``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = provider.transformer_config()
    if config.params_dtype != getattr(torch, train.dtype):
        raise ConfigError(f"the model was lowered for {config.params_dtype}, train.dtype is {train.dtype}",
                          hint="lower the model with the run's dtype (nam56r.megatron.lower(..., bf16=...))")
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed_optimizer)
    chunks = []
    for chunk in range(provider.chunks):
        module = provider.build(config, pg_collection, _device(), chunk=chunk)
        if train.dtype == "bfloat16":
            module = Float16Module(config, module) if provider.chunks == 1 else _v_chunk_float16(config, module)
        chunks.append(DistributedDataParallel(config, ddp_config, module))
    return config, chunks


def _v_chunk_float16(config, module):
    """Float16Module for one chunk of a V, whose outputs stay as the chunk returns them.

    Float16Module upcasts the outputs of the last virtual stage of the last pipeline rank to fp32: the last
    stage in Megatron's interleaved order. In a V that chunk (vp 1 on rank pp - 1) is a middle stage, whose
    bf16 activations the schedule sends on, and the last stage (vp 1 on rank 0) returns the model's losses,
    which a bf16 model computes in fp32 itself (``MegatronModel.forward_step``). The inputs' downcast on
    stage 0 (vp 0 on rank 0) is the same in both orders and stays."""
    from megatron.core.transformer.module import Float16Module

    class VChunkFloat16Module(Float16Module):
        def forward(self, *inputs, fp32_output=True, **kwargs):
            return super().forward(*inputs, fp32_output=False, **kwargs)

    return VChunkFloat16Module(config, module)


def sum_chunk_copies(models: list) -> None:
    """Give every copy of one weight that this rank holds in several chunks the sum of their gradients.

    Megatron flags the token embedding of the first stage and its copy on the MTP stage ``shared_embedding``
    and all-reduces their gradients over the embedding group (first and last pipeline rank). In a V both
    stages are chunks of pipeline rank 0, whose embedding group is itself alone (``embedding_ranks``): the sum
    is taken here, before the data-parallel reduction, so both copies take the same update.
    """
    if len(models) < 2:  # one chunk holds at most one copy; Megatron's embedding group does the rest
        return
    copies = [p for m in models for p in m.parameters() if getattr(p, "shared_embedding", False)]
    if len(copies) < 2:
        return
    total = torch.stack([p.main_grad for p in copies]).sum(0)
    for p in copies:
        p.main_grad.copy_(total)


def finalize_grads(models: list, *args, **kwargs) -> None:
    """``config.finalize_model_grads_func``: copies summed (``sum_chunk_copies``), then Megatron's
    ``finalize_model_grads`` with what the schedule passed (data-parallel reduction, embedding group, MoE
    router state)."""
    from megatron.core.distributed import finalize_model_grads

    sum_chunk_copies(models)
    finalize_model_grads(models, *args, **kwargs)


def train(run: MegatronRun) -> dict:
    """Train ``run`` on this process's GPU as one rank of the torchrun job; return the summary (all ranks)."""
    prepare_allocator(os.environ, cuda_initialized=torch.cuda.is_initialized())
    check_runtime(runtime_facts(), dispatcher=run.train.moe_dispatcher)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    provider, tc = run.model, run.train
    bf16 = tc.dtype == "bfloat16"
    par = dict(provider.parallel)
    if par != {"tp": tc.tp, "pp": tc.pp, "ep": tc.ep}:
        raise ConfigError(f"the model was lowered for {par}, the train config says tp={tc.tp} pp={tc.pp} ep={tc.ep}",
                          hint="lower the model with the run's train.tp/pp/ep")
    world = int(os.environ["WORLD_SIZE"])
    dp = check_layout(world_size=world, **par, train=tc, registered_schedules=run.schedules)
    provider.check(registered_schedules=run.schedules)
    plugin_schedule = resolve_schedule(tc.schedule, pp=par["pp"], registered=run.schedules)
    chunks = getattr(plugin_schedule, "chunks_per_rank", 1)
    if chunks != provider.chunks:
        raise ConfigError(f"train.schedule={tc.schedule!r} runs {chunks} model chunk(s) per pipeline rank, the model "
                          f"was lowered for {provider.chunks}", hint=f"lower the model with schedule={tc.schedule!r}")
    pg = init_parallel(**par, seed=tc.seed, chunks=chunks)
    schedule = plugin_schedule or get_forward_backward_func()  # reads the pipeline groups: after init
    rank0 = torch.distributed.get_rank() == 0
    layout = {"world_size": world, **par, **({"chunks": chunks} if chunks > 1 else {})}

    config, models = build_ddp(provider, tc, pg, distributed_optimizer=True)
    for model in models:
        model.broadcast_params()
    opt_config = OptimizerConfig(
        optimizer="adam", lr=tc.lr, min_lr=tc.lr * tc.min_lr_ratio, weight_decay=tc.weight_decay,
        adam_beta1=tc.adam_beta1, adam_beta2=tc.adam_beta2, adam_eps=tc.adam_eps, clip_grad=tc.grad_clip,
        bf16=bf16, params_dtype=config.params_dtype, use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(opt_config, models, config_overrides=_param_groups(opt_config))
    fused_notes = use_fused_adamw(optimizer)
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = models[0].no_sync if len(models) == 1 else [m.no_sync for m in models]
    config.finalize_model_grads_func = finalize_grads

    ckpt_root = run.run_dir / "checkpoints"
    start = 0
    if run.resume_from is not None:
        start = load_checkpoint(run.resume_from, models, optimizer, layout=layout)["step"]
        if rank0:
            truncate_metrics(run.run_dir, start)
    if rank0:
        run.run_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(run.run_dir, start_step=start, total_steps=run.max_steps, quiet=run.quiet) if rank0 else None
    run.log = log
    noted: set[str] = set()
    if log is not None:
        if run.resume_from is not None:
            log.note(f"resumed from {run.resume_from} at step {start}")
        for line in run.notes:
            log.note(line)
        for line in fused_notes:
            log.note(line)
    lr_at = lr_lambda(tc)
    dp_rank = pg.dp.rank()
    good = good_checkpoints(ckpt_root)
    last_good = good[-1] if good else None
    tokens_per_step = dp * tc.grad_accum * tc.micro_batch_size * provider.seq_len
    try:
        for step in range(start, run.max_steps):
            run.step = step
            run.host.before_step(step, run)
            t0 = time.perf_counter()
            for model in models:
                model.zero_grad_buffer()
            optimizer.zero_grad()
            losses = schedule(forward_step_func=provider.forward_step, data_iterator=_batches(run, step, dp_rank, dp),
                              model=models, num_microbatches=tc.grad_accum, seq_length=provider.seq_len,
                              micro_batch_size=tc.micro_batch_size, forward_only=False)
            lr = tc.lr * lr_at(step)
            _set_lr(optimizer, lr, tc.weight_decay)
            update_ok, grad_norm, _ = optimizer.step()
            aux, notes = {}, []
            for model in models:
                chunk_aux, chunk_notes = provider.end_step(unwrap(model))
                notes += chunk_notes
                for name, value in chunk_aux.items():
                    aux[name] = aux.get(name, 0) + value
            means = _step_means(losses, aux, provider.moe_aux_loss_coeff, tc.grad_accum, dp)
            torch.cuda.synchronize()
            peaks = torch.tensor([time.perf_counter() - t0, torch.cuda.max_memory_allocated() / 2**30],
                                 device=_device())
            torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
            dt, mem = peaks.tolist()
            grad_norm = float("nan") if grad_norm is None else float(grad_norm)
            if not (update_ok and math.isfinite(means["loss"]) and math.isfinite(grad_norm)):
                what = "loss" if not math.isfinite(means["loss"]) else "gradient norm"
                raise TrainingGuardError(
                    f"non-finite {what} at step {step} (rank {torch.distributed.get_rank()}: first non-finite is "
                    f"{_first_non_finite(models)}); the optimizer already applied this step, so nothing "
                    f"after the last good checkpoint is kept: {last_good or 'none'}",
                    hint=f"resume from it with a lower lr: --resume {last_good or 'auto'} --set train.lr=...")
            tokens_per_s = tokens_per_step / dt / world  # per GPU, as the local engine's is per device
            metrics = {"step": step + 1, **{k: round(v, 6) for k, v in means.items()}, "lr": lr,
                       "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                       "tflops_per_device": tokens_per_s * run.flops_per_token / 1e12, "mem_gib": mem,
                       "step_time_s": dt}
            run.host.after_step(step, run, metrics)
            if log is not None:
                for line in dict.fromkeys(notes):
                    if line not in noted:  # each distinct block message once per run, as the local engine
                        noted.add(line)
                        log.note(line)
                if (step + 1) % tc.log_every == 0 or step + 1 == run.max_steps:
                    log.log(metrics)
                log.advance()
            if run.checkpoints and tc.saves_after(step + 1, run.max_steps):
                last_good = save_checkpoint(ckpt_root, step + 1, models, optimizer, keep=tc.keep_checkpoints,
                                            manifest={"record": run.record, "layout": layout})
    finally:
        if log is not None:
            log.close()
    return {"steps": run.max_steps, "started_at_step": start, "last_checkpoint": str(last_good),
            "tokens_per_step": tokens_per_step, "layout": layout}


def _first_non_finite(models: list) -> str:
    for i, model in enumerate(models):
        found = first_non_finite(unwrap(model))
        if not found.startswith("none"):
            return found if len(models) == 1 else f"{found} in model chunk {i}"
    return found  # every chunk finite: the "none (the loss itself is non-finite)" answer, without a rescan


def shutdown() -> None:
    """Tear the process groups down at the end of a successful run (NCCL warns at exit otherwise). Never on
    an error path: its barrier would wait for ranks that are stuck in a collective."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def unwrap(model):
    """The NamHybridModel inside DDP and Float16Module."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)
