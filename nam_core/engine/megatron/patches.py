"""The megatron engine's patch-lane entries: what Megatron-Core's optimizer gets wrong or leaves slow without
Transformer Engine or Apex (our GPU hosts have neither), each fixed for the run only (``train`` applies them
with ``nam_core.patches.applied`` and reverts them at the end), and listed by ``nam patches``.

* ``megatron-optimizer-fp32-groups``: DistributedOptimizer numbers a parameter group's parameters in
  grad-buffer order but hands them to the inner optimizer fp32-first (distrib_optimizer.py:328-337 against
  :486-490 in 0.19.2); in a group that mixes fp32 and bf16 parameters (Mamba-3's D, dt_bias, B_bias, C_bias
  next to bf16 vectors) checkpoint save and load read the wrong parameter's state, and the dp_reshardable save
  fails its shape assertion (:1958). Fix: Megatron's standard group overrides give fp32 parameters groups of
  their own (``start_wd`` only tells them apart; the engine sets the decay itself).
* ``megatron-distopt-adam-state-before-step``: with torch's AdamW, DistributedOptimizer.state_dict asserts one
  ``step`` across the inner optimizer's state (:839), which torch creates at the first step only, so a
  checkpoint cannot be loaded into a fresh optimizer. Fix: before a loading ``sharded_state_dict``, one step
  on zero gradients at lr 0 and no weight decay creates the state and moves no weight (the load overwrites it).
* ``megatron-distopt-adam-step-on-load``: DistributedOptimizer.load_state_dict hands one shared ``step`` tensor
  to every parameter's state (:1025-1032), which AdamW then increments once per parameter, and the
  dp_reshardable load writes back the step the load template held (a LocalNonpersistentObject, :1956). Fix:
  after the load, every parameter gets its own ``step`` holding the checkpoint's (every step of this engine
  steps every parameter), where torch's AdamW reads it (the parameter's device for fused or capturable groups).
* ``megatron-torch-adamw-fused``: Megatron builds ``torch.optim.AdamW`` with torch's default implementation
  (on CUDA the multi-tensor ``foreach`` one: 52 ms of a 1,485 ms step at 2x H200, MBS 2, bench/README.md).
  Fix: each inner torch Adam(W) runs torch's ``fused`` implementation (the same update in one kernel per
  device and dtype), also after a load replaces its parameter groups.
* ``megatron-grad-norm-foreach``: the gradient norm for clipping (``get_grad_norm_fp32``, clip_grads.py:116)
  runs Megatron's ``local_multi_tensor_l2_norm`` (utils.py:1325-1333): ``torch.tensor(l2)`` over one 0-dim
  device tensor per parameter reads each to the host: one device sync per parameter tensor, every step.
  Fix: ``foreach_l2_norm``, per-tensor norms by ``torch._foreach_norm`` in fp32 and their norm, on the
  device; the same number to fp32 rounding.
* ``megatron-grad-clip-foreach``: with no ``multi_tensor_scale_tensor`` (clip_grads.py:47) the norm is read to
  the host (clip_grads.py:137-138, one more sync a step) and the clip scales by a Python float through
  ``local_multi_tensor_scale`` (utils.py:1337-1340: a multiply and a copy per tensor, clip_grads.py:189-192).
  Fix: ``foreach_scale`` for both, so the norm stays a device tensor and the clip multiplies every gradient by
  ``min(max_norm / (norm + 1e-6), 1)`` in one ``torch._foreach_mul_`` (Transformer Engine's path,
  clip_grads.py:181-188). ``optimizer.step()`` then returns the norm as a [1] tensor, as it does with TE.
* ``megatron-checkpoint-reads-in-turn``: Megatron's torch_dist load (``TorchDistLoadShardedStrategy.load``,
  dist_checkpointing/strategies/torch.py) reads through torch's ``FileSystemReader`` (``_get_filesystem_reader``,
  :902-921), which reads a checkpoint's data files one after the other on the calling thread, each item through
  ``torch.load`` and a copy into its target. A checkpoint of full NAM56R at one H200 (53 GB in 8 files, the page
  cache warm) took 46.2 s to read that way, 10.6 s with one thread per file (bench/README.md, round 12). Fix:
  the readers it makes read their files side by side (``read_side_by_side``).

Each ``detect()`` reads what is installed (no Transformer Engine or Apex, the code line that carries the bug)
and whether the fix is in place, so an upstream that changes the line retires the patch by itself.
"""

from __future__ import annotations

import functools
import inspect
import pathlib
import warnings
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from nam_core.patches import BUG_REPRODUCED, FIX_VALIDATED, Patch
from nam_core.registry import Entry

OWNER = "megatron engine"
"""What ``nam patches`` and the run's reports name as these patches' owner (the ``plugin`` column)."""
TARGET, VERSIONS = "megatron-core", ">=0.19"
"""The engine runs on 0.19 and later; each ``detect`` decides by the installed code, not the number."""
FP32_GROUPS, STATE_BEFORE_STEP, STEP_ON_LOAD, FUSED, GRAD_NORM, GRAD_CLIP, READS = (
    "megatron-optimizer-fp32-groups", "megatron-distopt-adam-state-before-step",
    "megatron-distopt-adam-step-on-load", "megatron-torch-adamw-fused", "megatron-grad-norm-foreach",
    "megatron-grad-clip-foreach", "megatron-checkpoint-reads-in-turn")


# --- wrapping upstream attributes, revertibly --------------------------------------------------------------


def _wrap(owner, name: str, patch: str, make) -> None:
    """Replace ``owner.name`` by ``make(original)``, marked with the patch's name; idempotent."""
    original = getattr(owner, name)
    if getattr(original, "__nam_patch__", None) == patch:
        return
    wrapper = make(original)
    wrapper.__nam_patch__, wrapper.__wrapped__ = patch, original
    setattr(owner, name, wrapper)


def _unwrap(owner, name: str, patch: str) -> None:
    current = getattr(owner, name)
    if getattr(current, "__nam_patch__", None) == patch:
        setattr(owner, name, current.__wrapped__)


def _wrapping(owner: Callable, patch: str, make, *names: str) -> dict:
    """A patch's ``apply`` and ``revert``: ``_wrap`` each attribute ``names`` of ``owner()`` (a module, imported
    when the patch applies) with ``make``, and ``_unwrap`` the same ones in reverse order."""
    def apply() -> None:
        for name in names:
            _wrap(owner(), name, patch, make)

    def revert() -> None:
        for name in reversed(names):
            _unwrap(owner(), name, patch)

    return {"apply": apply, "revert": revert}


def _wrapped(owner, name: str, patch: str) -> bool:
    return getattr(getattr(owner, name), "__nam_patch__", None) == patch


def _source(function) -> str:
    """The function's source without whitespace (a feature check that survives reformatting)."""
    return "".join(inspect.getsource(inspect.unwrap(function)).split())


def _torch_optimizers() -> bool:
    """Megatron builds torch's optimizers: neither Transformer Engine nor Apex is importable."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _inner_adams(optimizer) -> list:
    """The torch Adam(W) inside each of Megatron's (chained) optimizers."""
    inners = [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [o for o in inners if type(o) in (torch.optim.AdamW, torch.optim.Adam)]


def _distopt():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer


# --- megatron-optimizer-fp32-groups -----------------------------------------------------------------------


def _optimizer_module():
    import megatron.core.optimizer as module

    return module


def fp32_group_overrides(original):
    """``get_standard_config_overrides`` with fp32 parameters (in a bf16 model) in groups of their own."""

    @functools.wraps(original)
    def overrides(config):
        from megatron.core.optimizer import ParamKey, ParamPredicate

        result = original(config)
        fp32 = ParamKey(predicate=ParamPredicate(name="fp32_in_bf16", fn=lambda p: p.dtype == torch.float32))
        result[fp32] = {"start_wd": config.weight_decay}
        return result

    return overrides


def _fp32_groups_detect() -> bool:
    lists_fp32_first = "[*shard_fp32_params_this_group,*shard_fp32_from_float16_params_this_group,]" in _source(
        _distopt()._build_model_and_main_param_groups)
    return lists_fp32_first and not _wrapped(_optimizer_module(), "get_standard_config_overrides", FP32_GROUPS)


def _fp32_groups_reproduce() -> str:
    """Whether a bf16 and an fp32 no-decay vector get the same overrides (one group: the bug's precondition)."""
    from megatron.core.optimizer import OptimizerConfig

    overrides = _optimizer_module().get_standard_config_overrides(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, bf16=True))
    fp32, bf16 = torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    groups = [sorted(str(o) for key, o in overrides.items() if key.matches(p, name))
              for name, p in (("mixer.block.D", fp32), ("norm.weight", bf16))]
    return BUG_REPRODUCED if groups[0] == groups[1] else FIX_VALIDATED


# --- megatron-distopt-adam-state-before-step --------------------------------------------------------------


def materialise_adam_state(optimizer) -> None:
    """Give each inner torch AdamW its per-parameter state (with ``step``): one step on zero gradients at lr 0
    and no weight decay, which moves no weight."""
    for inner in _inner_adams(optimizer):
        saved = [(group["lr"], group["weight_decay"]) for group in inner.param_groups]
        for group in inner.param_groups:
            group["lr"], group["weight_decay"] = 0.0, 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad(set_to_none=True)
        for group, (lr, wd) in zip(inner.param_groups, saved):
            group["lr"], group["weight_decay"] = lr, wd


def _state_before_step(original):
    @functools.wraps(original)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False, *args, **kwargs):
        if is_loading and any(len(inner.state) == 0 for inner in _inner_adams(self)):
            materialise_adam_state(self)
        model_sd = {} if model_sharded_state_dict is None else model_sharded_state_dict
        return original(self, model_sd, is_loading, *args, **kwargs)

    return sharded_state_dict


def _state_before_step_detect() -> bool:
    asserts_state = 'forsininner_state_dict["state"].values()' in _source(_distopt().state_dict)
    return (_torch_optimizers() and asserts_state
            and not _wrapped(_distopt(), "sharded_state_dict", STATE_BEFORE_STEP))


def _state_before_step_reproduce() -> str:
    """DistributedOptimizer.state_dict on a torch AdamW that has not stepped (CPU, no process group)."""
    from types import SimpleNamespace

    param = torch.nn.Parameter(torch.ones(4))
    holder = SimpleNamespace(optimizer=torch.optim.AdamW([param], lr=1e-3), grad_scaler=None)
    holder.chained_optimizers = [holder]
    if not _wrapped(_distopt(), "sharded_state_dict", STATE_BEFORE_STEP):
        try:
            _distopt().state_dict(holder)
        except AssertionError:
            return BUG_REPRODUCED
        return FIX_VALIDATED
    materialise_adam_state(holder)
    _distopt().state_dict(holder)
    return FIX_VALIDATED if torch.equal(param.detach(), torch.ones(4)) else BUG_REPRODUCED


# --- megatron-distopt-adam-step-on-load -------------------------------------------------------------------


def own_adam_steps(optimizer, step: float) -> None:
    """Every parameter's AdamW ``step`` its own tensor holding ``step``, where the group keeps it."""
    for inner in _inner_adams(optimizer):
        for group in inner.param_groups:
            on_param = group.get("fused") or group.get("capturable")  # where torch's AdamW keeps ``step`` then
            for p in group["params"]:
                state = inner.state.get(p, {})
                if "step" in state:
                    old = state["step"]
                    state["step"] = torch.full((), float(step), dtype=torch.float32 if on_param else old.dtype,
                                               device=p.device if on_param else old.device)


def _step_on_load(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        steps = {g["step"] for g in state_dict.get("optimizer", {}).get("param_groups", []) if "step" in g}
        original(self, state_dict)
        if len(steps) == 1:
            own_adam_steps(self, float(next(iter(steps))))

    return load_state_dict


def _step_on_load_detect() -> bool:
    source = _source(_distopt().load_state_dict)
    shares_one = "forsinstate_dict_state.values():" in source and 's["step"]=step' in source
    return _torch_optimizers() and shares_one and not _wrapped(_distopt(), "load_state_dict", STEP_ON_LOAD)


def _step_on_load_reproduce() -> str:
    """One ``step`` tensor shared by two parameters' states, as the load leaves it: a torch AdamW step then
    advances it once per parameter (2 instead of 1). With the fix each parameter advances by one."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    shared = torch.tensor(1.0)
    for p in params:
        opt.state[p]["step"] = shared
    if _wrapped(_distopt(), "load_state_dict", STEP_ON_LOAD):
        own_adam_steps(type("Chained", (), {"optimizer": opt})(), 1)
    opt.step()
    steps = [float(opt.state[p]["step"]) for p in params]
    return FIX_VALIDATED if steps == [2.0, 2.0] else BUG_REPRODUCED


# --- megatron-torch-adamw-fused ---------------------------------------------------------------------------


def use_fused_adamw(optimizer) -> list[str]:
    """Run each inner torch AdamW of Megatron's optimizer on torch's fused implementation; returns what it set.
    AdamW reads ``fused`` and ``foreach`` from each parameter group at every step, so they are set on the
    groups; ``fused`` also makes ``load_state_dict`` keep each ``step`` on its parameter's device."""
    changed = []
    for i, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = opt.optimizer
        if type(inner) not in (torch.optim.AdamW, torch.optim.Adam):
            continue
        for group in (inner.defaults, *inner.param_groups):
            group["fused"], group["foreach"] = True, False
        changed.append(f"optimizer {i}: torch.optim.{type(inner).__name__}(fused=True)")
    return changed


def _fused(original):
    @functools.wraps(original)
    def get_megatron_optimizer(*args, **kwargs):
        optimizer = original(*args, **kwargs)
        use_fused_adamw(optimizer)
        for inner in _inner_adams(optimizer):  # a load replaces the groups with the checkpoint's
            inner.register_load_state_dict_post_hook(lambda opt: use_fused_adamw(type("Chained", (), {
                "optimizer": opt})()))
        return optimizer

    return get_megatron_optimizer


def _fused_detect() -> bool:
    from megatron.core.optimizer import _get_megatron_optimizer_based_on_param_groups as build

    builds_unfused = "adam_cls=torch.optim.AdamW" in _source(build) and '"fused"' not in _source(build)
    return (_torch_optimizers() and builds_unfused
            and not _wrapped(_optimizer_module(), "get_megatron_optimizer", FUSED))


def _fused_reproduce() -> str:
    """The same three AdamW steps fused and not (fp32, CPU): equal to rounding when the switch is sound."""
    gen = torch.Generator().manual_seed(5)
    weight, grads = torch.randn(16, 8, generator=gen), [torch.randn(16, 8, generator=gen) for _ in range(3)]
    results = []
    for fused in (False, True):
        p = torch.nn.Parameter(weight.clone())
        opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1)
        if fused:
            use_fused_adamw(type("Chained", (), {"optimizer": opt})())
        for g in grads:
            p.grad = g.clone()
            opt.step()
        results.append(p.detach())
    if not torch.allclose(*results, rtol=1e-6, atol=1e-7):
        return BUG_REPRODUCED
    return BUG_REPRODUCED if _fused_detect() else FIX_VALIDATED


# --- counting host syncs and launches (the reproducers of the grad-norm and grad-clip entries) ---------------


class _CudaOnCpu(TorchFunctionMode):
    """For a reproducer on a machine without CUDA only: tensors Megatron's fallbacks create on ``cuda`` (their
    results, their dummy overflow buffers) are created on the CPU, so the fallback runs to its end."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "cuda" in str(kwargs.get("device", "")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def host_syncs(fn: Callable[[], Any]) -> int:
    """How many times ``fn()`` makes the host wait for a tensor's value. On CUDA: the synchronising calls that
    torch's sync debug mode reports. On the CPU, where there is no device to wait for: the reads of a tensor's
    value into Python (``aten::_local_scalar_dense``, what each of those calls is on CUDA), by the profiler."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        return sum("synchroniz" in str(w.message) for w in caught)
    from torch.profiler import ProfilerActivity, profile

    with _CudaOnCpu(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name == "aten::_local_scalar_dense" for e in prof.events())


def top_level_ops(fn: Callable[[], Any]) -> int:
    """How many operators ``fn()`` calls from Python (the profiler's top-level ``aten::`` events): on CUDA each
    one launches its own kernel(s), so a count that grows with the tensor count is a per-tensor loop."""
    from torch.profiler import ProfilerActivity, profile

    with _CudaOnCpu(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name.startswith("aten::") and e.cpu_parent is None for e in prof.events())


def _replacing(function: Callable) -> Callable:
    """``_wrap``'s ``make`` for a replacement that does not call upstream's code: a fresh function per apply
    (it carries the patch's mark; ``__wrapped__`` keeps upstream's for the revert) running ``function``."""

    def make(original):
        @functools.wraps(function)
        def replacement(*args, **kwargs):
            return function(*args, **kwargs)

        return replacement

    return make


def _clip_grads():
    from megatron.core.optimizer import clip_grads

    return clip_grads


def _fallbacks():
    """Megatron's own multi-tensor fallbacks (megatron/core/utils.py), which clip_grads uses without TE/Apex."""
    from megatron.core import utils

    return utils


def _tensors(device: str, count: int, seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(7 + i, 5, generator=gen).to(device) for i in range(count)]


# --- megatron-grad-norm-foreach ---------------------------------------------------------------------------


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for ``amp_C.multi_tensor_l2norm`` (Megatron calls it through ``multi_tensor_applier``): the L2 norm
    of all of ``tensor_lists[0]`` as one vector, a [1] fp32 tensor on their device, and the per-tensor norms
    if ``per_tensor``. Per-tensor norms by ``torch._foreach_norm`` accumulated in fp32, then the norm of those;
    nothing is read to the host."""
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)  # [] fp32 each
    device = norms[0].device
    per = torch.stack([n.to(device) for n in norms])  # [n_tensors]
    return torch.linalg.vector_norm(per).reshape(1), (per if per_tensor else None)


def _grad_norm_detect() -> bool:
    utils, clip = _fallbacks(), _clip_grads()
    reads_each = "torch.norm(torch.tensor(l2))" in _source(utils.local_multi_tensor_l2_norm)
    return clip.l2_norm_impl is utils.local_multi_tensor_l2_norm and reads_each


def _grad_norm_reproduce() -> str:
    """clip_grads' L2 norm (as ``get_grad_norm_fp32`` calls it, clip_grads.py:116) over 2 and over 16 tensors:
    the bug is a host sync count that grows with the tensor count; the fix makes none and matches the norm of
    the concatenated tensors (fp64) to 1e-6."""
    clip = _clip_grads()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def norm(tensors):
        return clip.multi_tensor_applier(clip.l2_norm_impl, torch.zeros(1, dtype=torch.int, device=device),
                                         [tensors], False)[0]

    few, many = _tensors(device, 2), _tensors(device, 16)
    syncs = [host_syncs(lambda: norm(few)), host_syncs(lambda: norm(many))]
    if syncs[1] > syncs[0]:
        return BUG_REPRODUCED
    with _CudaOnCpu():
        got = float(norm(many)[0])
    want = float(torch.cat([t.flatten().double() for t in many]).norm())
    return FIX_VALIDATED if syncs == [0, 0] and abs(got - want) <= 1e-6 * want else BUG_REPRODUCED


# --- megatron-grad-clip-foreach ---------------------------------------------------------------------------


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for ``amp_C.multi_tensor_scale`` and TE's ``multi_tensor_scale_tensor``: ``dst = src * scale`` for
    every pair of ``tensor_lists = [src, dst]``, in one ``torch._foreach_mul``; ``scale`` a number or a
    one-element tensor on the tensors' device (not read to the host)."""
    src, dst = tensor_lists
    if isinstance(scale, torch.Tensor):
        scale = scale.reshape(())  # torch._foreach_mul takes a 0-dim tensor
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _grad_clip_detect() -> bool:
    utils, clip = _fallbacks(), _clip_grads()
    loops = "forsrc,dstinzip(tensor_lists[0],tensor_lists[1]):" in _source(utils.local_multi_tensor_scale)
    return clip.multi_tensor_scale_impl is utils.local_multi_tensor_scale and (
        loops or clip.multi_tensor_scale_tensor_impl is None)


def _grad_clip_reproduce() -> str:
    """clip_grads' scale (as ``clip_grad_by_total_norm_fp32`` calls it, clip_grads.py:190) over 2 and over 16
    tensors, and whether a device-side scale exists: the bug is operator calls that grow with the tensor count
    (one multiply and one copy each), or no tensor scale, which makes ``get_grad_norm_fp32`` read the norm to
    the host (clip_grads.py:135-138). The fix scales in one call, by a device tensor, to the same numbers."""
    clip = _clip_grads()
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def scale(tensors, by):
        clip.multi_tensor_applier(clip.multi_tensor_scale_impl, torch.zeros(1, dtype=torch.int, device=device),
                                  [tensors, tensors], by)

    few, many = _tensors(device, 2), _tensors(device, 16)
    calls = [top_level_ops(lambda: scale(few, 0.5)), top_level_ops(lambda: scale(many, 0.5))]
    if calls[1] > calls[0] or clip.multi_tensor_scale_tensor_impl is None:
        return BUG_REPRODUCED
    want = [t * 0.25 for t in many]
    clip.multi_tensor_applier(clip.multi_tensor_scale_tensor_impl, None, [many, many],
                              torch.full((1,), 0.25, device=device))
    return FIX_VALIDATED if all(torch.equal(a, b) for a, b in zip(many, want)) else BUG_REPRODUCED


# --- the lane ---------------------------------------------------------------------------------------------


# --- megatron-checkpoint-reads-in-turn ----------------------------------------------------------------------


READ_THREADS = 8
"""Data files read at once by a patched reader: a rank's checkpoint is ``checkpoint.writer_threads()`` files."""


def _torch_strategy():
    from megatron.core.dist_checkpointing.strategies import torch as module

    return module


def read_side_by_side(reader):
    """``reader`` (torch's ``FileSystemReader`` or a subclass) with its ``read_data`` reading each data file of the
    plan on a thread of its own, up to ``READ_THREADS`` at once (``async_checkpoint.read_per_file``, the local
    engine's reader's way): the same items into the same targets through the reader's own ``read_data``, so what
    is read and how it is placed are upstream's. Megatron's load planner keys what it keeps per item."""
    from nam_core.engine.async_checkpoint import read_per_file

    in_turn = reader.read_data
    reader.read_data = lambda plan, planner: read_per_file(in_turn, reader.storage_data, plan, planner,
                                                           threads=READ_THREADS)
    return reader


def _reads(original):
    @functools.wraps(original)
    def get_filesystem_reader(*args, **kwargs):
        return read_side_by_side(original(*args, **kwargs))

    return get_filesystem_reader


def _reads_detect() -> bool:
    """Megatron's reader factory is there and the reader it makes is torch's, whose ``read_data`` reads the files
    in turn (no thread in its code)."""
    import tempfile

    from torch.distributed.checkpoint import FileSystemReader

    module = _torch_strategy()
    if not hasattr(module, "_get_filesystem_reader") or _wrapped(module, "_get_filesystem_reader", READS):
        return False
    with tempfile.TemporaryDirectory() as folder:
        reader = module._get_filesystem_reader(folder)
    reads = getattr(type(reader), "read_data", None)
    return reads is FileSystemReader.read_data and "Thread" not in _source(FileSystemReader.read_data)


def _reads_reproduce() -> str:
    """A two-file checkpoint (fresh random tensors, CPU) read back through Megatron's reader factory: the values
    must come back equal, and a fixed reader has both files open at once, each on a worker thread. Workers that
    open a file wait at a barrier for the other file's worker (a thread pool may hand a finished worker the next
    file, so distinct thread ids alone would not show it); a read on the calling thread does not wait, so
    upstream's reader (the calling thread, one file after the other) costs no time here."""
    import tempfile
    import threading

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    gen = torch.Generator().manual_seed(11)
    state = {f"t{i}": torch.randn(64, 33 + i, generator=gen) for i in range(6)}
    caller, opened = threading.get_ident(), set()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=FileSystemWriter(folder, thread_count=2), no_dist=True)
        data_files = len(list(pathlib.Path(folder).glob("*.distcp")))
        together = threading.Barrier(max(data_files, 1), timeout=30)
        reader = _torch_strategy()._get_filesystem_reader(folder)
        opens = reader.fs.create_stream

        def create_stream(path, mode):
            if "r" in mode and not str(path).endswith(".metadata"):
                worker = threading.get_ident()
                met = False
                if worker != caller:
                    try:
                        together.wait()
                        met = True
                    except threading.BrokenBarrierError:
                        pass
                opened.add((worker, str(path), met))
            return opens(path, mode)

        reader.fs.create_stream = create_stream
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(back, storage_reader=reader, no_dist=True)
    files = {path for _, path, _ in opened}
    if data_files < 2 or len(files) < 2 or any(not torch.equal(back[k], state[k]) for k in state):
        return BUG_REPRODUCED
    return FIX_VALIDATED if all(met for _, _, met in opened) else BUG_REPRODUCED


def make_patches() -> list[Patch]:
    """The engine's entries, in the order they apply."""
    opt, distopt = _optimizer_module, _distopt
    return [
        Patch(FP32_GROUPS, TARGET, VERSIONS,
              summary="DistributedOptimizer mis-orders groups that mix fp32 and bf16 parameters (checkpoint state "
                      "read for the wrong parameter); fp32 parameters get optimizer groups of their own",
              retire_when="a megatron-core release whose DistributedOptimizer lists a group's parameters in the "
                          "order it numbers them (detection reads _build_model_and_main_param_groups)",
              detect=_fp32_groups_detect, reproduce=_fp32_groups_reproduce,
              **_wrapping(opt, FP32_GROUPS, fp32_group_overrides, "get_standard_config_overrides")),
        Patch(STATE_BEFORE_STEP, TARGET, VERSIONS,
              summary="without TE/Apex, loading a checkpoint into a fresh optimizer asserts on torch AdamW's "
                      "missing state; one zero-gradient, lr-0 step creates it first",
              retire_when="a megatron-core release whose DistributedOptimizer.state_dict accepts an optimizer "
                          "that has not stepped (detection reads state_dict)",
              detect=_state_before_step_detect, reproduce=_state_before_step_reproduce,
              **_wrapping(distopt, STATE_BEFORE_STEP, _state_before_step, "sharded_state_dict")),
        Patch(STEP_ON_LOAD, TARGET, VERSIONS,
              summary="without TE/Apex, a load gives every parameter one shared AdamW step (advanced once per "
                      "parameter) or the template's; each parameter gets its own, the checkpoint's",
              retire_when="a megatron-core release whose load_state_dict gives each state its own step "
                          "(detection reads load_state_dict)",
              detect=_step_on_load_detect, reproduce=_step_on_load_reproduce,
              **_wrapping(distopt, STEP_ON_LOAD, _step_on_load, "load_state_dict")),
        Patch(FUSED, TARGET, VERSIONS,
              summary="without TE/Apex, Megatron builds torch AdamW on its foreach implementation (52 of 1,485 ms "
                      "a step at 2x H200); the inner AdamW runs fused",
              retire_when="a megatron-core release that asks torch for fused=True (detection reads "
                          "_get_megatron_optimizer_based_on_param_groups), or TE/Apex on the GPU hosts",
              detect=_fused_detect, reproduce=_fused_reproduce,
              **_wrapping(opt, FUSED, _fused, "get_megatron_optimizer")),
        Patch(GRAD_NORM, TARGET, VERSIONS,
              summary="without TE/Apex, the gradient norm for clipping reads every parameter tensor's norm to the "
                      "host (one device sync each); torch._foreach_norm keeps them on the device",
              retire_when="a megatron-core release whose local_multi_tensor_l2_norm does not read each tensor's "
                          "norm to the host (detection reads megatron/core/utils.py), or TE/Apex on the GPU hosts",
              detect=_grad_norm_detect, reproduce=_grad_norm_reproduce,
              **_wrapping(_clip_grads, GRAD_NORM, _replacing(foreach_l2_norm), "l2_norm_impl")),
        Patch(GRAD_CLIP, TARGET, VERSIONS,
              summary="without TE/Apex, the clip scales each gradient in a Python loop (two kernels a tensor) by a "
                      "coefficient read to the host (one more sync); one torch._foreach_mul_ by a device tensor",
              retire_when="a megatron-core release with a local multi_tensor_scale_tensor and a multi_tensor_scale "
                          "without a per-tensor loop (detection reads clip_grads and megatron/core/utils.py), or "
                          "TE/Apex on the GPU hosts",
              detect=_grad_clip_detect, reproduce=_grad_clip_reproduce,
              **_wrapping(_clip_grads, GRAD_CLIP, _replacing(foreach_scale), "multi_tensor_scale_impl",
                          "multi_tensor_scale_tensor_impl")),
        Patch(READS, TARGET, VERSIONS,
              summary="Megatron's checkpoint load reads the data files one after the other on one thread (46.2 s "
                      "for 53 GB at one H200); the readers it makes read a thread per file (10.6 s)",
              retire_when="a megatron-core release whose torch_dist load reads files in parallel, or a torch whose "
                          "FileSystemReader does (detection reads the reader _get_filesystem_reader makes)",
              detect=_reads_detect, reproduce=_reads_reproduce,
              **_wrapping(_torch_strategy, READS, _reads, "_get_filesystem_reader")),
    ]


def lane() -> list[Entry]:
    """The entries as the patch lane takes them (``nam_core.patches.applied``, ``nam patches``)."""
    return [Entry(p.name, p, OWNER) for p in make_patches()]
