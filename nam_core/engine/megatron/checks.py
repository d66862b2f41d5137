"""Checks that fail closed before the megatron engine starts (all CPU-testable): the megatron-core version,
CUDA, torch.distributed, psutil, the MoE dispatcher, the CUDA allocator setting and the parallel layout.
``nam preflight --engine megatron`` prints ``runtime_checks``; ``check_runtime`` raises on the failed ones."""

from __future__ import annotations

import os
from typing import Any, Mapping, MutableMapping

import torch

from nam_core.engine.config import FLEX_PLUGIN, MOE_DISPATCHERS, TrainConfig
from nam_core.engine.megatron.optimizer import numerics_options
from nam_core.engine.megatron.schedule import resolve_schedule
from nam_core.errors import CannotRunHere, ConfigError
from nam_core.requirements import PASS, SKIP, Check, Requirement

MIN_MEGATRON = (0, 19)
"""`+` (MLA layer) and the hybrid MTP hand-over this engine builds on arrived in core_v0.19.0 (§1.2)."""

ALLOC_CONF = "expandable_segments:True"
"""NAM56R runs out of memory from fragmentation before capacity (issue 8): the allocator must grow segments."""
REGISTERED_PINNED = "pinned_use_cuda_host_register"
"""The allocator option that makes torch's page-locked host blocks malloc'd pages registered with CUDA. With
Megatron's async save it killed full NAM56R's first save on one H200 (2026-11-28, round 8: the process got SIGKILL,
the host's 128 GiB out of memory, where the same save without the option wrote its 53 GB). The cause is
inferred, not traced: the save forks its writer process, and Linux copies DMA-pinned anonymous pages into a child
at fork, so the host copies of the checkpoint are made twice; ``cudaHostAlloc``'s pages are not anonymous and are
not copied."""
ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""torch reads both names (the second is the newer, device-neutral one); either may override the other."""

def prepare_allocator(environ: MutableMapping[str, str], *, cuda_initialized: bool, async_saves: bool) -> str:
    """Make sure the CUDA caching allocator runs with expandable segments; return the setting in force.

    Sets ``PYTORCH_CUDA_ALLOC_CONF`` to ``ALLOC_CONF`` when neither allocator variable is set and CUDA has not
    initialised yet (the allocator reads it once, at initialisation). Raises when the environment sets either
    variable without ``expandable_segments:True``, or with ``REGISTERED_PINNED`` on while the run saves in the
    background (``async_saves``), or when it is unset and CUDA is already up.
    """
    found = {name: environ[name] for name in ALLOC_VARS if name in environ}
    for name, value in found.items():
        options = {}
        for part in value.split(","):
            key, _, setting = part.partition(":")
            options[key.strip()] = setting.strip()
        if options.get("expandable_segments", "").lower() != "true":
            raise CannotRunHere(
                f"the environment sets {name}={value!r}, which overrides what the megatron engine needs "
                f"({ALLOC_CONF}: NAM56R runs out of memory from fragmentation before capacity)",
                hint=f"unset {name}, or add the setting: export {name}={value},{ALLOC_CONF}")
        if async_saves and options.get(REGISTERED_PINNED, "").lower() == "true":
            raise CannotRunHere(
                f"the environment sets {name}={value!r}: with {REGISTERED_PINNED}:True, Megatron's background "
                "checkpoint save ran the host out of memory at NAM56R's size (its forked writer process got a "
                "copy of every registered page)",
                hint=f"drop {REGISTERED_PINNED} from {name}, or --set train.async_checkpoints=false")
    if found:
        return next(iter(found.values()))
    if cuda_initialized:
        raise CannotRunHere(
            f"CUDA was initialised before the megatron engine could set PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF}; "
            "the allocator reads it only once, at initialisation",
            hint=f"export PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF} before torchrun, or call prepare_allocator "
                 "before anything touches CUDA")
    environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    return environ["PYTORCH_CUDA_ALLOC_CONF"]


def megatron_version() -> tuple[int, ...] | None:
    """The (major, minor, patch) of the megatron-core that ``import megatron.core`` loads; None if absent. One that
    is there and fails to import (a missing or mismatched dependency) is an error that says so, not "absent"."""
    try:
        from megatron.core import package_info
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name in ("megatron", "megatron.core", "megatron.core.package_info"):
            return None  # not installed: check_runtime says so, with the install command
        raise CannotRunHere(f"megatron-core is installed but `import megatron.core` fails: {type(e).__name__}: {e}",
                            hint="python -c 'import megatron.core' shows where; install what it lacks, or reinstall "
                                 "it: pip install --force-reinstall "
                                 f"'megatron-core>={'.'.join(map(str, MIN_MEGATRON))}'") from e
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
        "fused_adam": next((name for name in ("transformer_engine", "apex")
                            if importlib.util.find_spec(name) is not None), None),
    }


WHO = "megatron engine"
"""The ``plugin`` column of the engine's rows."""
MEGATRON_CORE = Requirement.package(
    f"megatron-core>={'.'.join(map(str, MIN_MEGATRON))}", label="megatron-core",
    install_hint="pip install 'megatron-core>=0.19' on Python >= 3.12 (its wheels require 3.12)")
CUDA = Requirement.fact("CUDA", "a CUDA device",
                        hint="run on a GPU host; the local engine trains on the CPU: nam train --engine local")
DISTRIBUTED = Requirement.fact("torch.distributed", "available", hint="install a torch build with distributed support")
PSUTIL = Requirement.package("psutil", label="psutil", install_hint="pip install psutil",
                             reason="Megatron's checkpoint writer needs it; without it a save hangs, §9.2")
TORCHRUN = Requirement.fact(
    "torchrun launch", "WORLD_SIZE set by torchrun",
    hint="torchrun --nproc-per-node N -m nam_cli train --engine megatron ..., or nam train --nproc N")
DISPATCHER = Requirement.fact("MoE dispatcher", " or ".join(MOE_DISPATCHERS),
                              hint="--set train.moe_dispatcher=alltoall")


def check_dispatcher(dispatcher: str, plugins) -> None:
    """``train.moe_dispatcher=flex`` runs Megatron's flex dispatcher on DeepEP, whose requirement and rows the
    deepep plugin owns: flex without that plugin requested is a ConfigError here, not an ImportError in the
    first MoE layer."""
    if dispatcher == "flex" and FLEX_PLUGIN not in plugins:
        raise ConfigError(f"train.moe_dispatcher=flex runs Megatron's flex dispatcher on DeepEP, which plugin "
                          f"{FLEX_PLUGIN} brings; it is not requested (plugins: {', '.join(plugins) or 'none'})",
                          hint=f"--plugins {FLEX_PLUGIN} (pip install nam-plugin-{FLEX_PLUGIN}; it selects flex), "
                               "or --set train.moe_dispatcher=alltoall")


TE_FUSED_ADAM = Requirement.package(
    "transformer_engine", label="Transformer Engine (precision-aware optimizer)",
    install_hint="install transformer-engine, or --set train.optimizer_numerics=fp32-master "
                 "--set train.fused_master_weights=false",
    reason="for train.optimizer_numerics=bf16-moments or train.fused_master_weights: Megatron's precision-aware "
           "optimizer runs only in its FusedAdam")


def runtime_checks(facts: Mapping, *, dispatcher: str = "alltoall", launched: bool = True,
                   precision_aware: bool = False) -> list[Check]:
    """One ``Check`` per thing the megatron engine needs from this process: the requirements above evaluated
    against ``facts`` (``runtime_facts``: this process's, or a test's). ``nam preflight --engine megatron``
    prints them; ``check_runtime`` raises on the failed ones. ``launched=False`` skips the torchrun row
    (preflight runs outside torchrun). ``precision_aware``: the run's optimizer is Megatron's precision-aware one
    (``optimizer.precision_aware``), which needs Transformer Engine."""
    version = facts["megatron"]
    rows = [
        MEGATRON_CORE.check_installed(WHO, None if version is None else ".".join(map(str, version)),
                                      note=f"Python {'.'.join(map(str, facts['python']))}"),
        CUDA.check_fact(WHO, facts["cuda"], "available" if facts["cuda"] else "torch.cuda.is_available() is False"),
        DISTRIBUTED.check_fact(WHO, facts["distributed"], "yes" if facts["distributed"] else "no"),
        PSUTIL.check_installed(WHO, facts["psutil"]),
    ]
    if launched:
        world = facts["world_size"]
        rows.append(TORCHRUN.check_fact(WHO, world is not None, "not set" if world is None else f"WORLD_SIZE={world}"))
    if dispatcher not in MOE_DISPATCHERS:  # flex: DeepEP's rows are the deepep plugin's (check_dispatcher)
        rows.append(DISPATCHER.check_fact(WHO, False, dispatcher))
    if precision_aware:
        te = "installed" if facts.get("fused_adam") == "transformer_engine" else None
        rows.append(TE_FUSED_ADAM.check_installed(WHO, te))
    fused = facts.get("fused_adam")  # a report, not a requirement: Megatron falls back on its own
    rows.append(Check(WHO, "optimizer", PASS if fused else SKIP,
                      "Transformer Engine's or Apex's fused Adam, which Megatron uses when importable",
                      f"{fused}'s fused Adam" if fused else
                      "neither installed: Megatron builds torch.optim.AdamW, which the engine switches to torch's "
                      "fused implementation; Megatron's gradient norm and clip fall back to per-tensor loops with "
                      "host syncs, which the engine replaces with foreach kernels (`nam patches` lists both)"))
    return rows


def check_runtime(facts: Mapping, *, dispatcher: str = "alltoall", precision_aware: bool = False) -> None:
    """One ``CannotRunHere`` (exit 3) listing everything this process lacks for the megatron engine, or nothing."""
    failed = [c for c in runtime_checks(facts, dispatcher=dispatcher, precision_aware=precision_aware) if not c.ok]
    if failed:
        raise CannotRunHere("the megatron engine cannot run here; missing: "
                            + "; ".join(f"{c.name}: needs {c.needed}, found {c.found}" for c in failed),
                            hint="; ".join(dict.fromkeys(c.hint for c in failed if c.hint)))


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
    numerics_options(train)  # stochastic rounding and bf16-only: refused with Megatron's reason
    if train.overlap_param_gather:
        # On the full-width NAM56R (one H200, 2026-11-23, `bench/megatron.py throughput --overlap all`) Megatron-Core
        # 0.19.2 stopped at its second or third step in DDP's forward pre-hook of the MTP's eh_proj:
        # finish_param_sync -> the next bucket group's start_param_sync -> `assert self.param_gather_handle is
        # None`: a bucket's all-gather was dispatched and never waited for before the next dispatch. At the tiny
        # widths (one bucket) the gloo runs were bit-exact, so the cause is in the bucket order, not found yet.
        raise ConfigError("train.overlap_param_gather is refused: with NAM56R's buckets Megatron-Core 0.19.2 "
                          "dispatches a bucket's parameter all-gather twice without waiting for it (AssertionError "
                          "in start_param_sync at the MTP's eh_proj, full width, H200)",
                          hint="--set train.overlap_param_gather=false (train.overlap_grad_reduce and "
                               "train.moe_shared_expert_overlap are unaffected)")
    schedule = resolve_schedule(train.schedule, pp=pp, registered=registered_schedules)
    if schedule is not None:
        schedule.check_layout(tp=tp, pp=pp, ep=ep, num_microbatches=train.grad_accum)
        if train.overlap_grad_reduce and schedule.chunks_per_rank > 1:
            # the reduce-scatter starts during the backward pass, before reduce_shared_copies sums the chunks'
            # copies of one weight: the sum would miss the reduction
            raise ConfigError(f"train.overlap_grad_reduce with train.schedule={train.schedule!r}: its "
                              f"{schedule.chunks_per_rank} chunks per rank share weights whose gradients are summed "
                              "after the backward pass, when the overlapped reduction has already started",
                              hint="--set train.overlap_grad_reduce=false")
    return dp
