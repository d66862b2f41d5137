"""The megatron engine's CPU-checkable half (nam_core/engine/megatron/): fail-closed checks, the allocator
setting, the layout and schedule checks, checkpoint discovery, the optimizer's patch lane. The engine itself runs in
tests/test_megatron_engine_gpu.py and bench/megatron.py; NAM56R's Megatron modules are tested in
tests/test_megatron_model.py."""

import json
import subprocess
import sys
import types

import pytest
import torch

from nam_core.engine import megatron as engine
from nam_core.engine.config import TrainConfig
from nam_core.engine.megatron import optimizer, patches
from nam_core.engine.megatron.schedule import MegatronSchedule, PipelineSchedule
from nam_core.errors import ConfigError, NamError

GPU_TRAIN = TrainConfig(device="cuda", dtype="bfloat16")


# --- import ----------------------------------------------------------------------------------------------


def test_module_imports_without_megatron():
    """CI has megatron-core 0.16.1: neither the engine nor NAM56R's Megatron modules import megatron at import
    time; and the engine imports nothing of NAM56R (nam_core knows nothing of the model)."""
    code = ("import sys, nam_core.engine.megatron; print(sorted(m for m in sys.modules if m.startswith('nam56r'))); "
            "import nam56r.megatron; print(sorted(m for m in sys.modules if m.startswith('megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "[]"]


# --- allocator -------------------------------------------------------------------------------------------


def test_allocator_is_set_when_unset():
    env = {}
    assert engine.prepare_allocator(env, cuda_initialized=False) == "expandable_segments:True"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_allocator_keeps_a_setting_that_includes_expandable_segments():
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:256, expandable_segments:True"}
    assert engine.prepare_allocator(env, cuda_initialized=True) == env["PYTORCH_ALLOC_CONF"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env


@pytest.mark.parametrize("name, value", [("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128"),
                                         ("PYTORCH_ALLOC_CONF", "expandable_segments:False"),
                                         ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")])
def test_allocator_override_stops_the_run(name, value):
    env = {name: value}
    with pytest.raises(NamError, match=f"the environment sets {name}={value!r}") as e:
        engine.prepare_allocator(env, cuda_initialized=False)
    assert e.value.exit_code == 3 and f"export {name}={value},expandable_segments:True" in e.value.hint
    assert env == {name: value}  # nothing changed


def test_allocator_too_late_after_cuda_initialised():
    env = {}
    with pytest.raises(NamError, match="CUDA was initialised before") as e:
        engine.prepare_allocator(env, cuda_initialized=True)
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in e.value.hint
    assert env == {}


# --- runtime ---------------------------------------------------------------------------------------------

READY = {"megatron": (0, 19, 2), "python": (3, 12), "cuda": True, "distributed": True, "world_size": 2,
         "psutil": True, "deep_ep": False}


def test_runtime_ready_passes():
    engine.check_runtime(READY)


def test_runtime_lists_everything_missing_in_one_error():
    facts = {**READY, "megatron": (0, 16, 1), "python": (3, 11), "cuda": False, "world_size": None,
             "psutil": False}
    with pytest.raises(NamError) as e:
        engine.check_runtime(facts)
    msg = str(e.value)
    assert e.value.exit_code == 3
    for part in ("megatron-core: needs megatron-core>=0.19, found 0.16.1 (Python 3.11)", "a CUDA device",
                 "WORLD_SIZE set by torchrun, found not set", "psutil"):
        assert part in msg
    assert "torchrun --nproc-per-node N -m nam_cli train --engine megatron" in e.value.hint
    assert "pip install psutil" in e.value.hint


def test_runtime_missing_megatron_is_named():
    with pytest.raises(NamError, match=r"found not installed"):
        engine.check_runtime({**READY, "megatron": None})


def test_flex_dispatcher_needs_deepep_and_is_never_picked_for_being_installed():
    with pytest.raises(NamError, match=r"DeepEP \(flex dispatcher\): needs deep_ep \(for train.moe_dispatcher=flex\), found not installed"):
        engine.check_runtime(READY, dispatcher="flex")
    engine.check_runtime({**READY, "deep_ep": True}, dispatcher="flex")
    rows = {c.name: c for c in engine.runtime_checks({**READY, "deep_ep": True})}
    assert rows["DeepEP (flex dispatcher)"].ok  # reported as present; the dispatcher stays what the config says
    rows = {c.name: c for c in engine.runtime_checks(READY, launched=False)}
    assert rows["DeepEP (flex dispatcher)"].status == "skip" and "torchrun launch" not in rows
    with pytest.raises(NamError, match="MoE dispatcher: needs alltoall or flex, found deepep"):
        engine.check_runtime(READY, dispatcher="deepep")


def test_the_optimizer_megatron_falls_back_to_is_reported_not_hidden():
    """Without Transformer Engine or Apex, Megatron-Core switches to torch's AdamW with only a warning; the
    preflight row says which Adam runs (a skip row: our GPU hosts have neither, so it cannot refuse)."""
    rows = {c.name: c for c in engine.runtime_checks(READY)}
    assert rows["optimizer"].status == "skip" and "torch.optim.AdamW" in rows["optimizer"].found
    rows = {c.name: c for c in engine.runtime_checks({**READY, "fused_adam": "apex"})}
    assert rows["optimizer"].ok and rows["optimizer"].found == "apex's fused Adam"
    engine.check_runtime(READY)  # not a failure


def _chained(*optimizers):
    """The shape of Megatron's optimizer that the engine reads: ``chained_optimizers``, each with ``.optimizer``."""
    return types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=o) for o in optimizers])


def test_torch_adamw_runs_fused_and_computes_the_same_update():
    """Megatron's torch AdamW (no Transformer Engine or Apex) is switched to torch's fused implementation on
    every group; from the same weights and gradients both implementations take the same steps (fp32, to
    rounding), and an optimizer that is not torch's Adam is left alone."""
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(64, 32, generator=gen), torch.randn(32, generator=gen)]
    grads = [[torch.randn(w.shape, generator=gen) for w in weights] for _ in range(3)]

    def trained(fuse: bool):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2,
                                weight_decay=0.1)
        other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        notes = patches.use_fused_adamw(_chained(opt, other)) if fuse else []
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        return params, opt, other, notes

    fused, opt, other, notes = trained(True)
    plain, *_ = trained(False)
    assert notes == ["optimizer 0: torch.optim.AdamW(fused=True)"]
    assert all(g["fused"] is True and g["foreach"] is False for g in opt.param_groups)
    assert "fused" not in other.param_groups[0] or not other.param_groups[0]["fused"]
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert not torch.equal(a, torch.zeros_like(a))


def test_restored_adam_steps_are_one_tensor_each_where_the_group_keeps_them():
    """After a load, every parameter's ``step`` is its own tensor holding the checkpoint's step (Megatron hands
    one shared tensor to all); a fused group's steps are fp32 on the parameter's device, as torch's fused
    AdamW reads them."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    shared = torch.tensor(1.0)
    for p in params:
        opt.state[p]["step"] = shared
    patches.use_fused_adamw(_chained(opt))
    patches.own_adam_steps(_chained(opt), 7)
    steps = [opt.state[p]["step"] for p in params]
    assert [s.item() for s in steps] == [7.0, 7.0] and steps[0] is not steps[1]
    assert all(s.dtype == torch.float32 and s.device == p.device for s, p in zip(steps, params))
    opt.step()  # the fused path accepts them
    assert [opt.state[p]["step"].item() for p in params] == [8.0, 8.0]


def test_this_cpu_machine_is_refused():
    """The real facts of a CPU machine (whatever megatron it has) fail closed, naming the CUDA device."""
    facts = engine.runtime_facts()
    assert facts["cuda"] is torch.cuda.is_available()
    if facts["cuda"]:
        pytest.skip("a CUDA device is visible")
    with pytest.raises(NamError, match="a CUDA device"):
        engine.check_runtime(facts)


# --- layout, schedule ---------------------------------------------------------------------------------


def _layout(world_size, tp=1, pp=1, ep=1, train=GPU_TRAIN, schedules=None):
    return engine.check_layout(world_size=world_size, tp=tp, pp=pp, ep=ep, train=train,
                               registered_schedules=schedules or {})


def test_layout_gives_the_data_parallel_size():
    assert _layout(2, ep=2) == 2
    assert _layout(8, ep=4) == 8
    assert _layout(4, pp=2, ep=2, train=GPU_TRAIN.replace(schedule="1f1b")) == 2


def test_layout_refuses_gpus_that_do_not_split():
    with pytest.raises(ConfigError, match=r"3 GPUs do not split into tp=1 x pp=2"):
        _layout(3, pp=2, train=GPU_TRAIN.replace(schedule="1f1b"))


def test_layout_refuses_ep_larger_than_data_parallel():
    with pytest.raises(ConfigError, match=r"ep=4 must divide the data-parallel size 2"):
        _layout(2, ep=4)


def test_layout_refuses_sizes_below_one():
    with pytest.raises(ConfigError, match=r"--ep 0: parallel sizes start at 1"):
        _layout(2, ep=0)


def test_a_registered_schedule_is_instantiated():
    class DualPipeV(PipelineSchedule):
        def __call__(self, **kwargs):
            return []

    train = GPU_TRAIN.replace(schedule="dualpipev")
    assert _layout(2, pp=2, train=train, schedules={"dualpipev": DualPipeV}) == 1
    assert isinstance(engine.resolve_schedule("dualpipev", pp=2, registered={"dualpipev": DualPipeV}), DualPipeV)


def test_schedule_single_needs_pp1_and_unknown_names_fail():
    assert engine.resolve_schedule("single", pp=1, registered={}) is None
    assert engine.resolve_schedule("1f1b", pp=4, registered={}) is None
    with pytest.raises(ConfigError, match=r"pp=2 needs a pipeline schedule") as e:
        engine.resolve_schedule("single", pp=2, registered={})
    assert e.value.hint == "--set train.schedule=1f1b"
    with pytest.raises(ConfigError, match=r"'zb-v' is neither .* \(known here: single, 1f1b, gpipe\)"):
        engine.resolve_schedule("zb-v", pp=2, registered={"gpipe": object()})


@pytest.mark.parametrize("change, match", [({"dtype": "float16"}, "bfloat16 or float32"),
                                           ({"device": "cpu"}, "CUDA devices only")])
def test_layout_refuses_dtype_and_device(change, match):
    with pytest.raises(ConfigError, match=match):
        _layout(1, train=GPU_TRAIN.replace(**change))


# --- checkpoints and optimizer groups ---------------------------------------------------------------------


def test_good_checkpoints_need_a_manifest_of_this_format(tmp_path):
    root = tmp_path / "checkpoints"
    for name, manifest in [("step-00000002", {"format": engine.CHECKPOINT_FORMAT, "step": 2}),
                           ("step-00000004", {"format": 1, "step": 4}),  # a local-engine checkpoint
                           ("step-00000006", None), (".step-00000008.tmp", {"format": engine.CHECKPOINT_FORMAT})]:
        (root / name).mkdir(parents=True)
        if manifest is not None:
            (root / name / "manifest.json").write_text(json.dumps(manifest))
    assert engine.good_checkpoints(root) == [root / "step-00000002"]
    assert engine.good_checkpoints(tmp_path / "none") == []


def test_resume_takes_megatron_checkpoints_only(tmp_path):
    root = tmp_path / "checkpoints"
    with pytest.raises(NamError, match="no good megatron-engine checkpoint under"):
        engine.resolve_resume("auto", root)
    for name, fmt in (("step-00000002", engine.CHECKPOINT_FORMAT), ("step-00000004", 1)):
        (root / name).mkdir(parents=True)
        (root / name / "manifest.json").write_text(json.dumps({"format": fmt, "step": int(name[-1])}))
    assert engine.resolve_resume("auto", root) == root / "step-00000002"
    assert engine.resolve_resume(str(root / "step-00000002"), root) == root / "step-00000002"
    with pytest.raises(NamError, match=r"not a complete megatron-engine checkpoint \(no megatron-dist-1 manifest\)"):
        engine.resolve_resume(str(root / "step-00000004"), root)  # a local-engine checkpoint


def test_set_lr_applies_group_multipliers():
    class Opt:
        param_groups = [{"lr": 0.0, "wd_mult": 0.0}, {"lr": torch.tensor(0.0), "lr_mult": 0.5, "wd_mult": 1.0}]

    optimizer.set_lr(Opt, 2e-3, 0.1)
    assert Opt.param_groups[0]["lr"] == 2e-3 and Opt.param_groups[0]["weight_decay"] == 0.0
    assert Opt.param_groups[1]["lr"].item() == pytest.approx(1e-3) and Opt.param_groups[1]["weight_decay"] == 0.1


# --- with megatron-core >= 0.19 importable (e.g. PYTHONPATH=/tmp/site): config and spec, no GPU -------------


needs_019 = pytest.mark.skipif((engine.megatron_version() or (0,)) < engine.MIN_MEGATRON,
                               reason="needs megatron-core >= 0.19 importable (CI has 0.16.1)")


@needs_019
def test_fp32_parameters_get_optimizer_groups_of_their_own():
    """0.19.2's DistributedOptimizer mis-numbers groups that mix fp32 and bf16 parameters (the patch
    megatron-optimizer-fp32-groups): Mamba-3's fp32 parameters must land in groups no bf16 parameter shares."""
    from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides

    overrides = patches.fp32_group_overrides(get_standard_config_overrides)(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, bf16=True))
    fp32, bf16 = torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    matched = {name: [o for key, o in overrides.items() if key.matches(p, name)]
               for name, p in (("mixer.block.D", fp32), ("norm.weight", bf16))}
    assert {"start_wd": 0.1} in matched["mixer.block.D"] and {"start_wd": 0.1} not in matched["norm.weight"]
    assert {"wd_mult": 0.0} in matched["mixer.block.D"] and {"wd_mult": 0.0} in matched["norm.weight"]


def test_megatron_s_own_layout_is_one_chunk_per_rank_in_its_interleaved_order():
    """What a registered schedule inherits: Megatron's embedding group, its Float16Module, nothing to reduce."""
    own = MegatronSchedule("1f1b")
    assert own.chunks_per_rank == 1 and own.embedding_ranks() is None
    assert [own.stage_of(r, 0, 4) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="no stage for rank 0, chunk 1"):
        own.stage_of(0, 1, 4)
    own.reduce_shared_copies([torch.nn.Linear(2, 2)])  # a no-op


def test_a_registered_schedule_must_implement_the_protocol():
    with pytest.raises(ConfigError, match="does not implement .*PipelineSchedule"):
        engine.resolve_schedule("v", pp=2, registered={"v": object})
    with pytest.raises(ConfigError, match="not registered yet"):
        engine.schedule_for("v", pp=2, registered={"v": None})
    assert isinstance(engine.schedule_for("1f1b", pp=2, registered={}), MegatronSchedule)


def test_a_schedule_refuses_its_layouts_through_the_engine_check():
    class OneExpertGroup(PipelineSchedule):
        def check_layout(self, *, tp, pp, ep, num_microbatches):
            if ep != 1:
                raise ConfigError(f"found ep={ep}", hint="--ep 1")

    train = GPU_TRAIN.replace(schedule="v")
    with pytest.raises(ConfigError, match="found ep=2"):
        _layout(4, pp=2, ep=2, train=train, schedules={"v": OneExpertGroup})
    assert _layout(4, pp=2, train=train, schedules={"v": OneExpertGroup}) == 2
    assert _layout(4, pp=2, ep=2, train=train, schedules={"v": None}) == 2  # before activation: on trust


def test_the_engine_lane_lists_its_patches_with_revert_and_retirement():
    entries = patches.lane()
    assert [e.name for e in entries] == [patches.FP32_GROUPS, patches.STATE_BEFORE_STEP, patches.STEP_ON_LOAD,
                                         patches.FUSED]
    for entry in entries:
        p = entry.impl
        assert entry.plugin == "megatron engine" and p.target == "megatron-core" and p.revert is not None
        assert p.retire_when and p.reproduce is not None
        if (engine.megatron_version() or (0,)) < engine.MIN_MEGATRON:
            assert p.state()[0] == "retired"  # the engine refuses these versions anyway


@needs_019
def test_the_engine_lane_applies_for_a_scope_and_reverts():
    """On 0.19 without TE or Apex each bug is detected, reproduced, fixed inside the scope, and upstream's code
    is back after it (also when the scope raises)."""
    import megatron.core.optimizer as mopt
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from nam_core.patches import applied

    upstream = (mopt.get_standard_config_overrides, mopt.get_megatron_optimizer,
                DistributedOptimizer.sharded_state_dict, DistributedOptimizer.load_state_dict)
    entries = patches.lane()
    assert all(e.impl.state()[0] == "needed" for e in entries)
    assert all(e.impl.reproduce() == "BUG_REPRODUCED" for e in entries)
    with pytest.raises(RuntimeError, match="inside"), applied(entries) as reports:
        assert [r.state for r in reports] == ["applied"] * 4
        assert all(e.impl.reproduce() == "FIX_VALIDATED" for e in entries)
        assert mopt.get_megatron_optimizer is not upstream[1]
        raise RuntimeError("inside")
    assert (mopt.get_standard_config_overrides, mopt.get_megatron_optimizer,
            DistributedOptimizer.sharded_state_dict, DistributedOptimizer.load_state_dict) == upstream
    assert all(e.impl.state()[0] == "needed" for e in entries)


def test_nam_patches_lists_the_megatron_lanes():
    """`nam patches` (no --plugins) lists the engine's and NAM56R's Megatron entries beside the plugins'."""
    from nam_cli.patches import _builtin

    rows = {e.name: e.plugin for e in _builtin()}
    assert rows == {patches.FP32_GROUPS: "megatron engine", patches.STATE_BEFORE_STEP: "megatron engine",
                    patches.STEP_ON_LOAD: "megatron engine", patches.FUSED: "megatron engine",
                    "megatron-hybrid-stage-choice": "nam56r"}
