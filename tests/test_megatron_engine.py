"""The megatron engine's CPU-checkable half (nam_core/engine/megatron/): fail-closed checks, the allocator
setting, the layout and schedule checks, checkpoint discovery, the optimizer's patch lane. The engine itself runs in
tests/test_megatron_engine_gpu.py and bench/megatron.py; NAM56R's Megatron modules are tested in
tests/test_megatron_model.py."""

import json
from pathlib import Path
import pickle
import subprocess
import sys
import types
import warnings

import pytest
import torch

from nam_core.data.dataset import file_sha256
from nam_core.engine import async_checkpoint
from nam_core.engine import megatron as engine
from nam_core.engine.config import TrainConfig
from nam_core.engine.megatron import checkpoint, optimizer, patches
from nam_core.engine.megatron.schedule import MegatronSchedule, PipelineSchedule
from nam_core.errors import ConfigError, NamError, RunFolderError

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
    assert engine.prepare_allocator(env, cuda_initialized=False, async_saves=True) == "expandable_segments:True"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_registered_pinned_blocks_refused_with_background_saves_only(name):
    """Round 8 on one H200: the setting got full NAM56R's first background save killed for host memory."""
    env = {name: "expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8"}
    with pytest.raises(NamError, match="pinned_use_cuda_host_register:True, Megatron's background") as e:
        engine.prepare_allocator(dict(env), cuda_initialized=False, async_saves=True)
    assert e.value.exit_code == 3 and "train.async_checkpoints=false" in e.value.hint
    assert engine.prepare_allocator(dict(env), cuda_initialized=False, async_saves=False) == env[name]


def test_allocator_keeps_a_setting_that_includes_expandable_segments():
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:256, expandable_segments:True"}
    assert engine.prepare_allocator(env, cuda_initialized=True, async_saves=True) == env["PYTORCH_ALLOC_CONF"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env


@pytest.mark.parametrize("name, value", [("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128"),
                                         ("PYTORCH_ALLOC_CONF", "expandable_segments:False"),
                                         ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")])
def test_allocator_override_stops_the_run(name, value):
    env = {name: value}
    with pytest.raises(NamError, match=f"the environment sets {name}={value!r}") as e:
        engine.prepare_allocator(env, cuda_initialized=False, async_saves=True)
    assert e.value.exit_code == 3 and f"export {name}={value},expandable_segments:True" in e.value.hint
    assert env == {name: value}  # nothing changed


def test_allocator_too_late_after_cuda_initialised():
    env = {}
    with pytest.raises(NamError, match="CUDA was initialised before") as e:
        engine.prepare_allocator(env, cuda_initialized=True, async_saves=True)
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in e.value.hint
    assert env == {}


# --- runtime ---------------------------------------------------------------------------------------------

READY = {"megatron": (0, 19, 2), "python": (3, 12), "cuda": True, "distributed": True, "world_size": 2,
         "psutil": True}


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


def _fake_megatron(root: Path, core_init: str) -> None:
    (root / "megatron" / "core").mkdir(parents=True, exist_ok=True)
    (root / "megatron" / "__init__.py").write_text("")
    (root / "megatron" / "core" / "__init__.py").write_text(core_init)
    (root / "megatron" / "core" / "package_info.py").write_text("VERSION = (0, 19, 2)\n")


@pytest.fixture
def no_megatron_modules():
    """sys.modules without any megatron module for the test, and exactly as it was after it (the stand-ins the
    test imports must not reach later tests)."""
    def ours():
        return {m: sys.modules[m] for m in list(sys.modules) if m == "megatron" or m.startswith("megatron.")}

    saved = ours()
    for name in saved:
        del sys.modules[name]
    try:
        yield lambda: [sys.modules.pop(name) for name in ours()]
    finally:
        for name in ours():
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.mark.parametrize("core_init, found", [
    ("import a_dependency_that_is_not_there\n", "ModuleNotFoundError: No module named 'a_dependency_that_is_not_there'"),
    ("from torch import a_name_this_torch_lacks\n", "ImportError: cannot import name 'a_name_this_torch_lacks'"),
])
def test_a_megatron_core_that_fails_to_import_is_not_called_absent(tmp_path, monkeypatch, no_megatron_modules,
                                                                   core_init, found):
    """Installed and broken (a dependency missing or mismatched) used to read as "not installed", whose hint is
    to install it: the import's own error is what the user needs."""
    from nam_core.engine.megatron.checks import megatron_version
    from nam_core.errors import CannotRunHere

    _fake_megatron(tmp_path, "")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert megatron_version() == (0, 19, 2)  # the stand-in imports: its version
    no_megatron_modules()
    _fake_megatron(tmp_path, core_init)
    with pytest.raises(CannotRunHere, match="megatron-core is installed but `import megatron.core` fails") as err:
        megatron_version()
    assert found in err.value.message and "pip install --force-reinstall 'megatron-core>=0.19'" in err.value.hint
    no_megatron_modules()
    monkeypatch.setitem(sys.modules, "megatron", None)  # not installed at all: None, as before
    assert megatron_version() is None


def test_flex_dispatcher_needs_the_deepep_plugin_which_owns_deepep_s_rows():
    from nam_core.engine.megatron.checks import check_dispatcher

    with pytest.raises(ConfigError, match="train.moe_dispatcher=flex runs Megatron's flex dispatcher on DeepEP, "
                                          "which plugin deepep brings; it is not requested") as e:
        check_dispatcher("flex", ("liger",))
    assert "--plugins deepep" in e.value.hint and "--set train.moe_dispatcher=alltoall" in e.value.hint
    check_dispatcher("flex", ("liger", "deepep"))
    check_dispatcher("alltoall", ())
    engine.check_runtime(READY, dispatcher="flex")  # DeepEP itself: the plugin's requirement, at activation
    rows = {c.name for c in engine.runtime_checks(READY, launched=False)}
    assert not any("DeepEP" in name for name in rows) and "torchrun launch" not in rows
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


# --- the launch: torchrun for several GPUs, this process for one ---------------------------------------------


def _start(monkeypatch, nproc: int):
    """``MegatronEngine.start`` with ``--nproc nproc`` outside torchrun, in an environment of its own; returns the
    relaunches asked for, the environment and the error it stopped with (on the CPU: the runtime's refusal)."""
    from nam_core.engine.megatron import parallel

    env = {k: v for k, v in __import__("os").environ.items() if k not in parallel.ONE_RANK}
    monkeypatch.setattr("os.environ", env)
    asked = []
    spec = types.SimpleNamespace(layout=types.SimpleNamespace(nproc=nproc, world_size=nproc), train=GPU_TRAIN)
    with pytest.raises(NamError) as e:
        engine.MegatronEngine().start(spec, dry_run=False, relaunch=asked.append)
    return asked, env, str(e.value)


def test_one_gpu_trains_in_this_process_as_torchrun_s_only_worker(monkeypatch):
    asked, env, refused = _start(monkeypatch, 1)
    assert asked == []  # no torchrun: no second and third Python start
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    assert 0 < int(env["MASTER_PORT"]) < 65536
    assert "torchrun launch" not in refused and "a CUDA device" in refused  # this CPU host's refusal, past the launch


def test_several_gpus_relaunch_under_torchrun(monkeypatch):
    from nam_core.engine.megatron import parallel

    class Relaunched(NamError):
        pass

    def relaunch(n):
        asked.append(n)
        raise Relaunched("exec'd")  # the real one does not return

    asked = []
    env = {k: v for k, v in __import__("os").environ.items() if k not in parallel.ONE_RANK}
    monkeypatch.setattr("os.environ", env)
    spec = types.SimpleNamespace(layout=types.SimpleNamespace(nproc=4, world_size=4), train=GPU_TRAIN)
    with pytest.raises(Relaunched):
        engine.MegatronEngine().start(spec, dry_run=False, relaunch=relaunch)
    assert asked == [4] and "WORLD_SIZE" not in env


def test_one_rank_env_rendezvous_and_refuses_a_launcher_s_environment():
    """The environment it makes is one ``init_process_group`` (env://) accepts as a world of one: checked in a
    fresh process with gloo, as the engine's NCCL group would read it. Under torchrun it changes nothing."""
    from nam_core.engine.megatron import parallel

    code = ("import os, torch, torch.distributed as dist; from nam_core.engine.megatron import parallel; "
            "parallel.one_rank_env(os.environ); dist.init_process_group('gloo'); t = torch.tensor([3.0]); "
            "dist.all_reduce(t); print(dist.get_rank(), dist.get_world_size(), t.item()); dist.destroy_process_group()")
    env = {k: v for k, v in __import__("os").environ.items() if k not in parallel.ONE_RANK}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "3.0"]
    launched = {"WORLD_SIZE": "8", "RANK": "3"}
    with pytest.raises(RuntimeError, match="under a launcher"):
        parallel.one_rank_env(launched)
    assert launched == {"WORLD_SIZE": "8", "RANK": "3"}


SHARED_CHECK = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
from nam_core.engine import checkpoint as files
from nam_core.engine.megatron import MegatronEngine
hashed = []
real = files.file_sha256
files.file_sha256 = lambda path, **kw: hashed.append(Path(path).name) or real(path, **kw)
dist.init_process_group("gloo")
root = Path(sys.argv[1])
engine = MegatronEngine()
engine.check_ahead(root)  # the background pass, run in the foreground here: rank 0's alone
ahead = len(hashed)
good = [p.name for p in engine.good_checkpoints(root)]
print(json.dumps({"rank": dist.get_rank(), "ahead": ahead, "hashed": len(hashed), "good": good}))
dist.destroy_process_group()
"""


def test_a_resume_s_checkpoints_are_hashed_by_rank_0_alone_and_judged_alike_by_every_rank(tmp_path):
    """Two gloo ranks check a folder with a good checkpoint and one whose file changed after its manifest: rank 0
    hashes every file once (most in ``check_ahead``), rank 1 none, and both find the same good one and skip the
    damaged one (the damaged file's digest is handed over too, so rank 1 refuses it on rank 0's bytes)."""
    import os
    import socket

    root = tmp_path / "checkpoints"
    for step, damaged in ((2, False), (4, True)):
        folder = root / f"step-{step:08d}"
        folder.mkdir(parents=True)
        for name in (".metadata", "__0_0.distcp", "__0_1.distcp"):
            (folder / name).write_bytes(os.urandom(4096))
        listed = {n: file_sha256(folder / n) for n in (".metadata", "__0_0.distcp", "__0_1.distcp")}
        (folder / "manifest.json").write_text(json.dumps({"format": checkpoint.CHECKPOINT_FORMAT, "sha256": listed}))
        if damaged:
            (folder / "__0_1.distcp").write_bytes(os.urandom(4096))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    ranks = [subprocess.Popen([sys.executable, "-c", SHARED_CHECK, str(root)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [r.communicate(timeout=180) for r in ranks]
    assert all(r.returncode == 0 for r in ranks), [err[-2000:] for _, err in outs]
    rows = sorted((json.loads(out.strip().splitlines()[-1]) for out, _ in outs), key=lambda row: row["rank"])
    assert rows[0]["ahead"] == rows[0]["hashed"] == 6 and rows[1]["hashed"] == 0
    assert rows[0]["good"] == rows[1]["good"] == ["step-00000002"]


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


def _megatron_checkpoint(folder, step, fmt=engine.CHECKPOINT_FORMAT):
    """A folder shaped like a megatron-engine save: dist-checkpointing files and rng/, a manifest with the
    sha256 of each (what save_checkpoint writes; the files' contents do not matter to discovery)."""
    (folder / "rng").mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "rng/rank-00000.pt"):
        (folder / name).write_bytes(f"{name} {step}".encode())
    digests = {name: file_sha256(folder / name) for name in (".metadata", "__0_0.distcp", "rng/rank-00000.pt")}
    (folder / "manifest.json").write_text(json.dumps({"format": fmt, "step": step, "sha256": digests}))


def test_good_checkpoints_need_a_manifest_of_this_format_and_matching_files(tmp_path):
    root = tmp_path / "checkpoints"
    _megatron_checkpoint(root / "step-00000002", 2)
    _megatron_checkpoint(root / "step-00000003", 3, fmt="megatron-dist-1")  # RNG unpickled unrestricted: refused
    (root / "step-00000004").mkdir()
    (root / "step-00000004" / "manifest.json").write_text(json.dumps({"format": 1, "step": 4}))  # local engine
    (root / "step-00000006").mkdir()
    _megatron_checkpoint(root / ".step-00000008.tmp", 8)
    for step, damage in ((10, "flip"), (12, "extra"), (14, "missing")):
        folder = root / f"step-{step:08d}"
        _megatron_checkpoint(folder, step)
        if damage == "flip":
            (folder / "__0_0.distcp").write_bytes(b"changed")
        elif damage == "extra":
            (folder / "rng" / "rank-00001.pt").write_bytes(b"not saved with it")
        else:
            (folder / "rng" / "rank-00000.pt").unlink()
    assert engine.good_checkpoints(root) == [root / "step-00000002"]
    assert engine.good_checkpoints(tmp_path / "none") == []
    why = {p.name: checkpoint.inspect(p)[1] for p in sorted(root.glob("step-*"))}
    assert why["step-00000003"] == "no megatron-dist-2 manifest (format 'megatron-dist-1')"
    assert why["step-00000010"] == "sha256 mismatch of __0_0.distcp (the file changed after it was saved)"
    assert "not listed ['rng/rank-00001.pt']" in why["step-00000012"]
    assert "missing ['rng/rank-00000.pt']" in why["step-00000014"]
    (root / "step-00000002" / ".metadata").write_bytes(b".metadata 9")  # after a good check, in this process
    assert engine.good_checkpoints(root) == []


def _unsaved(folder, step):
    """A finished save's hidden folder before ``_finish`` (its files, no manifest yet)."""
    _megatron_checkpoint(folder, step)
    (folder / "manifest.json").unlink()


@pytest.mark.parametrize("case", ["prune", "same step again"])
def test_a_kill_while_an_old_checkpoint_is_deleted_leaves_no_damaged_step_folder(tmp_path, monkeypatch, case):
    """Rank 0's ``_finish`` deletes the checkpoint it prunes (and, saving a step again, the one it replaces): a
    kill in the middle of that delete, here after its first file, must leave every ``step-*`` good (the old one
    renamed aside first, hidden), the new save in place."""
    import shutil

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        _unsaved(root / f".step-{step:08d}.tmp", step)
        checkpoint._finish(root / f".step-{step:08d}.tmp", root / f"step-{step:08d}", root, step, {}, keep=2)
    real = shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        inside = [p for p in sorted(Path(path).rglob("*")) if p.is_file()]
        if not inside:  # nothing there (no folder to replace): as shutil does
            return real(path, *args, **kwargs)
        inside[0].unlink()
        raise KeyboardInterrupt("killed")

    new = 6 if case == "prune" else 4
    _unsaved(root / f".step-{new:08d}.tmp", new)
    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint._finish(root / f".step-{new:08d}.tmp", root / f"step-{new:08d}", root, new, {"step": new}, keep=2)
    monkeypatch.setattr(shutil, "rmtree", real)
    steps = sorted(p.name for p in root.glob("step-*"))
    assert all(checkpoint.inspect(root / name)[0] is not None for name in steps), \
        {name: checkpoint.inspect(root / name)[1] for name in steps}
    assert steps == (["step-00000004", "step-00000006"] if case == "prune" else ["step-00000002", "step-00000004"])
    assert [p.name.split(".old-")[0] for p in root.glob(".step-*.old-*")] == \
        [".step-00000002" if case == "prune" else ".step-00000004"]  # the leftover, hidden
    _unsaved(root / ".step-00000008.tmp", 8)
    checkpoint._finish(root / ".step-00000008.tmp", root / "step-00000008", root, 8, {}, keep=2)
    assert not list(root.glob(".step-*"))  # the next save removed it


def test_resume_takes_megatron_checkpoints_only(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    with pytest.raises(NamError, match="no good megatron-engine checkpoint under"):
        engine.resolve_resume("auto", root)
    _megatron_checkpoint(root / "step-00000002", 2)
    (root / "step-00000004").mkdir()
    (root / "step-00000004" / "manifest.json").write_text(json.dumps({"format": 1, "step": 4}))
    assert engine.resolve_resume("auto", root) == root / "step-00000002"
    assert engine.resolve_resume(str(root / "step-00000002"), root) == root / "step-00000002"
    with pytest.raises(NamError, match=r"not a complete megatron-engine checkpoint \(no megatron-dist-2 manifest"):
        engine.resolve_resume(str(root / "step-00000004"), root)  # a local-engine checkpoint


def test_resume_auto_names_the_damaged_newer_checkpoint_it_skipped(tmp_path):
    """The engine's resolve passes its warnings on, as the local engine's does: a newer save whose file no
    longer matches its sha256 is skipped with a line that names it and the one resumed from."""
    root = tmp_path / "checkpoints"
    _megatron_checkpoint(root / "step-00000010", 10)
    _megatron_checkpoint(root / "step-00000020", 20)
    (root / "step-00000020" / "__0_0.distcp").write_bytes(b"changed")
    warned = []
    assert engine.MegatronEngine().resolve_resume("auto", root, warn=warned.append) == root / "step-00000010"
    assert len(warned) == 1 and "step-00000020" in warned[0] and "resuming from step-00000010" in warned[0], warned


def test_both_engines_refuse_an_unreadable_manifest_with_the_same_words(tmp_path):
    from nam_core.engine import checkpoint as local

    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / "manifest.json").write_text("{not json")
    _megatron_checkpoint(tmp_path / ".step-00000006.tmp", 6)
    (tmp_path / "step-00000008").mkdir()
    (tmp_path / "step-00000008" / "manifest.json").write_text("[8]")  # JSON, but no manifest (the local engine's
    expected = {"step-00000002": "no manifest.json (the save did not finish)",  # inspect used to crash on it)
                "step-00000004": "manifest.json is not valid JSON (",
                "step-00000008": "manifest.json holds a JSON list, not an object",
                ".step-00000006.tmp": "a save in progress or interrupted (hidden folder)"}
    for name, words in expected.items():
        for inspect in (local.inspect, checkpoint.inspect):
            manifest, why = inspect(tmp_path / name)
            assert manifest is None and why.startswith(words), (inspect.__module__, name, why)


class _RunsCode:
    """Unpickling this runs ``open(marker, "w")``: a stand-in for ``os.system``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _dcp_save(folder, state):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no_dist's "single process" notice
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def test_a_clean_dist_checkpoint_passes_the_pickle_check(tmp_path):
    """torch's checkpoint format, as Megatron writes it: a tensor and a byte item of tensors/plain values."""
    _dcp_save(tmp_path, {"w": torch.randn(3, 3), "obj": {"x": torch.ones(2), "n": 3, "betas": (0.9, 0.95)}})
    checkpoint.refuse_unsafe_pickles(tmp_path)


def test_a_crafted_metadata_pickle_is_refused_and_runs_nothing(tmp_path):
    _dcp_save(tmp_path, {"w": torch.randn(3, 3)})
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(RunFolderError, match=r"\.metadata: refused to load.*io\.open is not part") as info:
        checkpoint.refuse_unsafe_pickles(tmp_path)
    assert info.value.exit_code == 6 and not marker.exists()
    with open(tmp_path / ".metadata", "rb") as f:  # what torch's FileSystemReader.read_metadata does with it
        pickle.load(f)
    assert marker.exists()


def test_a_crafted_byte_item_is_refused_and_runs_nothing(tmp_path):
    """A byte item (Megatron's ShardedObjects, its common state) is unpickled with weights_only=False by torch's
    load planner: the check reads it first with weights_only=True."""
    marker = tmp_path / "pwned"
    _dcp_save(tmp_path / "ck", {"w": torch.randn(3, 3), "obj": _RunsCode(marker)})
    with pytest.raises(RunFolderError, match=r"__0_0\.distcp: refused to load.*byte item 'obj' names io\.open"):
        checkpoint.refuse_unsafe_pickles(tmp_path / "ck")
    assert not marker.exists()
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"w": torch.empty(3, 3), "obj": None}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert marker.exists()  # the file is a real threat: torch's own load runs it


def test_set_lr_applies_group_multipliers():
    class Opt:
        param_groups = [{"lr": 0.0, "wd_mult": 0.0}, {"lr": torch.tensor(0.0), "lr_mult": 0.5, "wd_mult": 1.0}]

    optimizer.set_lr(Opt, 2e-3, 0.1)
    assert Opt.param_groups[0]["lr"] == 2e-3 and Opt.param_groups[0]["weight_decay"] == 0.0
    assert Opt.param_groups[1]["lr"].item() == pytest.approx(1e-3) and Opt.param_groups[1]["weight_decay"] == 0.1


def _sharded(seed: int, rows: int = 6, empty: bool = False) -> dict:
    """A sharded state of the kinds the megatron engine saves: plain shards (fp32, bf16, nested in a list), a
    factory that makes two shards of one tensor, and a non-tensor value."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    g = torch.Generator().manual_seed(seed)
    halves = lambda key, t, replica_id, flat: {  # noqa: E731
        "lo": ShardedTensor.from_rank_offsets(f"{key}.lo", t[:3], replica_id=replica_id),
        "hi": ShardedTensor.from_rank_offsets(f"{key}.hi", t[3:], replica_id=replica_id)}
    return {"model": {"w": ShardedTensor.from_rank_offsets("w", torch.randn(rows, 4, generator=g)),
                      "blocks": [ShardedTensor.from_rank_offsets("b", torch.randn(8, generator=g).bfloat16())]},
            "optimizer": {"m": ShardedTensorFactory("m", torch.randn(7, generator=g), halves, lambda d: None),
                          "step": 3, **({"pad": ShardedTensor.from_rank_offsets("pad", torch.empty(0, 4))}
                                        if empty else {})}}


def test_host_shards_hold_every_shard_of_a_save_and_keep_their_buffers():
    """Each save's shards are copied into the same host buffers (made once, from the first state's shapes) and
    handed to Megatron in them, factories applied; another structure is refused; the originals are untouched."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    host = checkpoint.HostShards(_sharded(0), pinned=False)
    assert host.record.nbytes == (6 * 4 + 7) * 4 + 8 * 2 and host.record.how == "pageable"
    first = None
    for seed in (1, 2):
        state, want = _sharded(seed), _sharded(seed)
        host.copy_in(state)
        checkpoint._shards(want)
        shards = [v for v in nested_values(state) if isinstance(v, ShardedTensor)]
        assert [sh.key for sh in shards] == ["w", "b", "m.lo", "m.hi"]
        assert all(sh.data is buf for sh, buf in zip(shards, host.buffers))
        for sh, ref in zip(shards, checkpoint._shards(want)):
            assert sh.data.dtype == ref.data.dtype and torch.equal(sh.data, ref.data)
        ptrs = [b.data_ptr() for b in host.buffers]
        assert first is None or ptrs == first
        first = ptrs
    assert host.taken and host.record.built_s is not None and host.record.waited_s >= 0
    with pytest.raises(NamError, match="not the one its host buffers were made for .* at shard 0"):
        host.copy_in(_sharded(3, rows=5))


def test_page_locked_host_shards_register_whole_pages_of_a_shared_mapping(monkeypatch):
    """On CUDA: one registration per shard, page-aligned, no page in two of them (CUDA refuses a page registered
    twice), and the buffers in a shared mapping (/proc/self/maps ``s``), which a fork shares instead of copying."""
    registered = []
    monkeypatch.setattr(async_checkpoint, "_register", lambda ptr, size: registered.append((ptr, size)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    host = checkpoint.HostShards(_sharded(0, empty=True), pinned=True)
    state, want = _sharded(1, empty=True), _sharded(1, empty=True)
    host.copy_in(state)
    assert host.record.how == "register" and set(host.parts) == {"pages touched", "registered"}
    assert [b.numel() for b in host.buffers][-1] == 0  # an empty shard: a buffer, nothing registered
    assert [ptr for ptr, _ in registered] == [b.data_ptr() for b in host.buffers if b.numel()]
    for (ptr, size), b in zip(registered, [b for b in host.buffers if b.numel()]):
        page = async_checkpoint.PAGE
        assert ptr % page == 0 and size % page == 0 and size >= b.numel() * b.element_size()
    spans = sorted(registered)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    for buf, ref in zip(host.buffers, checkpoint._shards(want)):
        assert torch.equal(buf, ref.data)
        # each a storage of its own: Megatron's writer clones a host tensor that views a larger storage
        assert buf.untyped_storage().size() == buf.numel() * buf.element_size()
    ptr = host.buffers[0].data_ptr()
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= ptr < hi:
            assert line.split()[1].endswith("s"), line
            break
    else:
        raise AssertionError("the buffers' mapping is not in /proc/self/maps")


def test_host_shards_that_cannot_be_made_fail_the_save(monkeypatch):
    def refused(*args, **kwargs):
        raise RuntimeError("cudaHostAlloc: out of memory")

    monkeypatch.setattr(torch, "empty", refused)
    host = checkpoint.HostShards(_sharded(0), pinned=False)
    with pytest.raises(NamError, match=r"host buffers \(0.0 GB, pageable\) could not be built: RuntimeError") as e:
        host.copy_in(_sharded(1))
    assert "ulimit -l" in e.value.hint and "train.async_checkpoints=false" in e.value.hint


def test_a_save_that_cannot_fit_is_refused_before_it_starts(tmp_path, monkeypatch, one_process_group):
    """Round 11 on the GPU host: the second save of a full-size run filled a 64 GiB disk inside Megatron's forked
    writer, and the error named no disk. The next save's size is the newest finished checkpoint's."""
    from nam_core.engine import checkpoint as files

    root = tmp_path / "checkpoints"
    _megatron_checkpoint(root / "step-00000002", 2)
    (root / ".step-00000004.tmp").mkdir()  # a save in flight: not counted
    need = sum(p.stat().st_size for p in (root / "step-00000002").rglob("*") if p.is_file())
    assert checkpoint.save_bytes(root) == need
    monkeypatch.setattr(files.rundir, "free_mb", lambda path: (need - 1) / 2**20)
    with pytest.raises(RunFolderError, match="no space left .* the save was not started and the newest good "
                                             "checkpoint, step-00000002, is intact") as e:
        checkpoint.check_space(root, need)
    assert e.value.exit_code == 6 and "--resume auto" in e.value.hint
    monkeypatch.setattr(files.rundir, "free_mb", lambda path: need / 2**20)
    checkpoint.check_space(root, need)  # fits: nothing raised


def test_a_writer_error_with_the_disk_short_is_a_full_disk(tmp_path, monkeypatch, one_process_group):
    """Megatron's forked writer hands back "results_queue should not be empty" whatever went wrong; with less
    free space than the save needed once its folder is gone, it is reported as the full disk it was."""
    from nam_core.engine import checkpoint as files

    root = tmp_path / "checkpoints"
    _megatron_checkpoint(root / "step-00000002", 2)
    writer = RuntimeError("results_queue should not be empty")
    for free, raised in ((10.0, RunFolderError), (10.0 + 2**-20, RuntimeError)):
        tmp = root / ".step-00000004.tmp"
        tmp.mkdir()
        monkeypatch.setattr(files.rundir, "free_mb", lambda path, free=free: free)
        with pytest.raises(raised) as e:
            checkpoint._save_failed(root, tmp, writer, need=10 * 2**20 + 1)
        assert not tmp.exists()
        assert (raised is RuntimeError and e.value is writer) or "the half-written save was removed" in str(e.value)


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


def test_overlapped_grad_reduce_is_refused_where_chunks_share_weights():
    """Two chunks per rank (DualPipeV's V) sum their copies of one weight after the backward pass, when an
    overlapped reduce-scatter has already started: refused; one chunk per rank takes it."""
    class TwoChunks(PipelineSchedule):
        chunks_per_rank = 2

    train = GPU_TRAIN.replace(schedule="v", overlap_grad_reduce=True)
    with pytest.raises(ConfigError, match="overlap_grad_reduce with train.schedule='v'") as e:
        _layout(4, pp=2, train=train, schedules={"v": TwoChunks})
    assert e.value.hint == "--set train.overlap_grad_reduce=false"
    assert _layout(4, pp=2, train=train.replace(overlap_grad_reduce=False), schedules={"v": TwoChunks}) == 2
    assert _layout(4, pp=2, train=train.replace(schedule="1f1b")) == 2


def test_shared_expert_overlap_is_set_where_megatron_takes_it():
    """``train.moe_shared_expert_overlap`` reaches Megatron's TransformerConfig before the chunks are built, with
    Megatron's own dispatcher check (which TransformerConfig runs at construction only); a model without a
    shared expert is left alone."""
    from nam_core.engine.megatron.model import overlap_shared_experts

    def config(**changes):
        return types.SimpleNamespace(**{"num_moe_experts": 16, "moe_shared_expert_intermediate_size": 64,
                                        "moe_token_dispatcher_type": "alltoall", "moe_shared_expert_overlap": False,
                                        **changes})

    for dispatcher in ("alltoall", "flex"):
        c = config(moe_token_dispatcher_type=dispatcher)
        overlap_shared_experts(c)
        assert c.moe_shared_expert_overlap is True
    for c in (config(moe_shared_expert_intermediate_size=None), config(num_moe_experts=None)):
        overlap_shared_experts(c)
        assert c.moe_shared_expert_overlap is False
    with pytest.raises(ConfigError, match="needs the alltoall or flex MoE dispatcher"):
        overlap_shared_experts(config(moe_token_dispatcher_type="allgather"))


def test_the_engine_lane_lists_its_patches_with_revert_and_retirement():
    entries = patches.lane()
    assert [e.name for e in entries] == [patches.FP32_GROUPS, patches.STATE_BEFORE_STEP, patches.STEP_ON_LOAD,
                                         patches.FUSED, patches.GRAD_NORM, patches.GRAD_CLIP, patches.READS]
    for entry in entries:
        p = entry.impl
        assert entry.plugin == "megatron engine" and p.target == "megatron-core" and p.revert is not None
        assert p.retire_when and p.reproduce is not None
        if (engine.megatron_version() or (0,)) < engine.MIN_MEGATRON:
            assert p.state()[0] == "not-applicable"  # a release older than the range: nothing fixed upstream
            assert f"not applicable: needs >= {engine.MIN_MEGATRON[0]}.{engine.MIN_MEGATRON[1]}" in p.state()[1]


@needs_019
def test_the_engine_lane_applies_for_a_scope_and_reverts():
    """On 0.19 without TE or Apex each bug is detected, reproduced, fixed inside the scope, and upstream's code
    is back after it (also when the scope raises)."""
    import megatron.core.optimizer as mopt
    from megatron.core import utils
    from megatron.core.dist_checkpointing.strategies import torch as strategies
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from nam_core.patches import applied

    def current():
        return (mopt.get_standard_config_overrides, mopt.get_megatron_optimizer,
                DistributedOptimizer.sharded_state_dict, DistributedOptimizer.load_state_dict,
                clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, clip_grads.multi_tensor_scale_tensor_impl,
                strategies._get_filesystem_reader)

    upstream = current()
    assert upstream[4:7] == (utils.local_multi_tensor_l2_norm, utils.local_multi_tensor_scale, None)  # no TE, no Apex
    entries = patches.lane()
    assert all(e.impl.state()[0] == "needed" for e in entries)
    assert {e.name: e.impl.reproduce() for e in entries} == {e.name: "BUG_REPRODUCED" for e in entries}
    with pytest.raises(RuntimeError, match="inside"), applied(entries) as reports:
        assert [r.state for r in reports] == ["applied"] * 7
        assert {e.name: e.impl.reproduce() for e in entries} == {e.name: "FIX_VALIDATED" for e in entries}
        assert all(a is not b for a, b in zip(current(), upstream))
        raise RuntimeError("inside")
    assert current() == upstream
    assert all(e.impl.state()[0] == "needed" for e in entries)


def test_nam_patches_lists_the_megatron_lanes():
    """`nam patches` (no --plugins) lists the engine's and NAM56R's Megatron entries beside the plugins'."""
    from nam_cli.patches import _builtin

    rows = {e.name: e.plugin for e in _builtin()}
    assert rows == {patches.FP32_GROUPS: "megatron engine", patches.STATE_BEFORE_STEP: "megatron engine",
                    patches.STEP_ON_LOAD: "megatron engine", patches.FUSED: "megatron engine",
                    patches.GRAD_NORM: "megatron engine", patches.GRAD_CLIP: "megatron engine",
                    patches.READS: "megatron engine", "megatron-hybrid-stage-choice": "nam56r"}


def _dcp_folder(folder, files: int, seed: int) -> dict:
    """A checkpoint of fresh random tensors in ``files`` data files (torch's writer, one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    gen = torch.Generator().manual_seed(seed)
    state = {f"w{i}": torch.randn(128, 40 + i, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
             for i in range(9)}
    dcp.save(state, storage_writer=FileSystemWriter(str(folder), thread_count=files), no_dist=True)
    assert len(list(Path(folder).glob("*.distcp"))) == files
    return state


def _read(folder, state: dict, *, side_by_side: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(folder))
    back = {k: torch.full_like(v, float("nan")) for k, v in state.items()}
    dcp.load(back, storage_reader=patches.read_side_by_side(reader) if side_by_side else reader, no_dist=True)
    return back


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_files_read_side_by_side_come_back_as_read_in_turn(tmp_path, monkeypatch):
    """megatron-checkpoint-reads-in-turn's reader: every tensor of a 4-file checkpoint comes back bit for bit, the
    files are read on 4 threads at once (each thread waits at a barrier until all 4 are reading: in turn, the
    first would wait for ever, so the barrier times out), and a file cut short fails the load as reading in turn
    does."""
    import threading

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    state = _dcp_folder(tmp_path, 4, seed=21)
    meeting, threads = threading.Barrier(4, timeout=20), set()
    in_turn = FileSystemReader.read_data

    def read_data(self, plan, planner):
        if threading.current_thread().name.startswith("nam-ckpt-read"):
            threads.add(threading.get_ident())
            meeting.wait()
        return in_turn(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", read_data)
    back = _read(tmp_path, state, side_by_side=True)
    assert len(threads) == 4
    assert all(torch.equal(back[k], state[k]) and back[k].dtype == state[k].dtype for k in state)
    monkeypatch.setattr(FileSystemReader, "read_data", in_turn)
    cut = sorted(tmp_path.glob("*.distcp"))[2]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    errors = []
    for side_by_side in (False, True):
        with pytest.raises(CheckpointException) as failed:  # DCP's wrapper of the rank's error
            _read(tmp_path, state, side_by_side=side_by_side)
        errors.append([type(error) for error, _ in failed.value.failures.values()])  # (exception, trace)
    assert errors[0] == errors[1] == [EOFError], errors


# --- the gradient norm and clip without TE/Apex (megatron-grad-norm-foreach, megatron-grad-clip-foreach) -------


@pytest.fixture
def one_process_group():
    """A one-rank gloo group for ``get_grad_norm_fp32``'s all-reduce."""
    if torch.distributed.is_initialized():
        yield None
        return
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield None
    finally:
        torch.distributed.destroy_process_group()


GRAD_SHAPES = [(4096,), (64, 33), (3, 5, 7), (1,), (257, 129)]


def _grads(dtype, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(shape, generator=gen)).to(dtype) for shape in GRAD_SHAPES]


def _grad_norm(grads, patched: bool):
    """Megatron's ``get_grad_norm_fp32`` (its ``cuda`` tensors on the CPU), upstream or inside the two patches."""
    from megatron.core.optimizer import clip_grads

    from nam_core.patches import applied

    lane = [e for e in patches.lane() if e.name in (patches.GRAD_NORM, patches.GRAD_CLIP)]
    with applied(lane if patched else []), patches._CudaOnCpu():
        return clip_grads.get_grad_norm_fp32(grads, grad_stats_parallel_group=torch.distributed.group.WORLD)


@needs_019
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_norm_on_the_device_equals_megatron_s(dtype, one_process_group):
    """The patched norm is a [1] fp32 tensor (no host read) equal to Megatron's float: fp32 gradients (what the
    distributed optimizer passes) to 1e-6, and within 1e-5 of the fp64 norm (fp32 accumulation over ~50k
    elements). In bf16/fp16 Megatron rounds each tensor's norm to the gradient dtype and the patch accumulates in
    fp32: within that dtype's rounding of each other (8e-3 bf16, 1e-3 fp16), the patch still within 1e-5 of
    fp64."""
    for seed in range(3):
        grads = _grads(dtype, seed, scale=10.0 ** (seed - 1))
        exact = float(torch.cat([g.double().flatten() for g in grads]).norm())
        upstream, ours = _grad_norm(grads, patched=False), _grad_norm(grads, patched=True)
        assert isinstance(upstream, float)
        assert isinstance(ours, torch.Tensor) and ours.shape == (1,) and ours.dtype == torch.float32
        assert abs(float(ours) - exact) <= 1e-5 * exact
        rtol = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
        assert abs(float(ours) - upstream) <= rtol * exact, (seed, float(ours), upstream)


@needs_019
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_grad_clip_on_the_device_equals_megatron_s(max_norm, one_process_group, monkeypatch):
    """``clip_grad_by_total_norm_fp32`` on fresh fp32 gradients, with Megatron's Python-float norm and loop and
    with the patches' device norm and one foreach multiply: equal to 1e-6 when it clips (the coefficient is
    computed in fp32 on the device instead of in Python's float64), bit-equal when it does not (x 1.0)."""
    from megatron.core.optimizer import clip_grads

    from nam_core.patches import applied

    real_type = torch.Tensor.type
    monkeypatch.setattr(torch.Tensor, "type", lambda self, *a, **k: "torch.cuda.FloatTensor"  # Megatron's assert
                        if not a and not k and self.dtype == torch.float32 else real_type(self, *a, **k))
    lane = [e for e in patches.lane() if e.name in (patches.GRAD_NORM, patches.GRAD_CLIP)]
    clipped = []
    for patched in (False, True):
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in GRAD_SHAPES]
        for p, g in zip(params, _grads(torch.float32, seed=11)):
            p.grad = g
        with applied(lane if patched else []), patches._CudaOnCpu():
            norm = clip_grads.get_grad_norm_fp32([p.grad for p in params],
                                                 grad_stats_parallel_group=torch.distributed.group.WORLD)
            clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, norm)
        clipped.append([p.grad for p in params])
    upstream, ours = clipped
    for a, b in zip(ours, upstream):
        if max_norm > 1e3:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    total = float(torch.cat([g.flatten() for g in ours]).norm())
    assert total == pytest.approx(min(max_norm, total), rel=1e-5)


@needs_019
def test_the_grad_norm_reproducer_counts_one_host_read_per_tensor():
    """The reproducer's counter on this CPU machine: Megatron's fallback norm reads n + 1 values to the host for
    n tensors (each tensor's norm, then the total), the patch's none."""
    from megatron.core import utils

    def reads(fn, n):
        tensors = [torch.randn(5, 3) for _ in range(n)]
        return patches.host_syncs(lambda: fn(0, None, [tensors], False))

    assert [reads(utils.local_multi_tensor_l2_norm, n) for n in (2, 9)] == [3, 10]
    assert [reads(patches.foreach_l2_norm, n) for n in (2, 9)] == [0, 0]


def test_foreach_scale_writes_src_times_scale_into_dst():
    """The two call shapes Megatron uses: in place ([grads, grads]) and into other tensors, by a number or a
    one-element tensor."""
    src = [torch.randn(4, 3), torch.randn(7)]
    dst = [torch.empty(4, 3), torch.empty(7)]
    patches.foreach_scale(0, None, [src, dst], torch.tensor([0.5]))
    assert all(torch.equal(d, s * 0.5) for s, d in zip(src, dst))
    want = [s * 3.0 for s in src]
    patches.foreach_scale(0, None, [src, src], 3.0)
    assert all(torch.equal(s, w) for s, w in zip(src, want))


def test_overlapped_param_gather_is_refused_before_the_run():
    """Megatron-Core 0.19.2's param-gather prefetch asserted at NAM56R's full width on the GPU host: the engine
    refuses the option up front, with the way out; the other overlaps still pass."""
    with pytest.raises(ConfigError, match="train.overlap_param_gather is refused") as e:
        _layout(2, ep=2, train=GPU_TRAIN.replace(overlap_param_gather=True))
    assert e.value.hint.startswith("--set train.overlap_param_gather=false")
    assert _layout(2, ep=2, train=GPU_TRAIN.replace(overlap_grad_reduce=True, moe_shared_expert_overlap=True)) == 2


def test_numerics_through_megatrons_options_and_the_refused_ones_say_why():
    """fp32-master is Megatron's default; bf16-moments its precision-aware optimizer (bf16 exp_avg and
    exp_avg_sq over fp32 main params), which needs Transformer Engine; stochastic rounding and bf16-only have no
    Megatron optimizer and are refused before anything is built."""
    import torch

    from nam_core.engine.config import TrainConfig
    from nam_core.engine.megatron.optimizer import numerics_options
    from nam_core.errors import ConfigError

    bf16 = TrainConfig(dtype="bfloat16", device="cuda")
    assert numerics_options(bf16) == {}
    assert numerics_options(bf16.replace(optimizer_numerics="bf16-moments")) == {
        "use_precision_aware_optimizer": True, "main_params_dtype": torch.float32,
        "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16, "store_param_remainders": True}
    for name, why in (("stochastic-rounding", "none updates bf16 parameters with stochastic rounding"),
                      ("bf16", "always builds fp32 main params")):
        with pytest.raises(ConfigError, match=why):
            engine.check_layout(world_size=1, tp=1, pp=1, ep=1, train=bf16.replace(optimizer_numerics=name),
                                registered_schedules={"1f1b": None})
    with pytest.raises(NamError, match=r"Transformer Engine \(precision-aware optimizer\): needs transformer_engine"):
        engine.check_runtime(READY, precision_aware=True)
    engine.check_runtime({**READY, "fused_adam": "transformer_engine"}, precision_aware=True)
    assert "Transformer Engine (precision-aware optimizer)" not in {c.name for c in engine.runtime_checks(READY)}


def test_fused_master_weights_are_the_precision_aware_optimizer_at_fp32():
    """train.fused_master_weights: Megatron's precision-aware optimizer with fp32 masters (as remainders) and
    fp32 moments, which needs TE's FusedAdam; it belongs to fp32-master in bf16 (bf16-moments already is it, a
    float32 model has no bf16 weight to hold a remainder), and its log line says who holds the masters."""
    import torch

    from nam_core.engine.config import TrainConfig
    from nam_core.engine.megatron.optimizer import describe, numerics_options, precision_aware
    from nam_core.errors import ConfigError

    bf16 = TrainConfig(dtype="bfloat16", device="cuda")
    fused = bf16.replace(fused_master_weights=True)
    assert numerics_options(fused) == {"use_precision_aware_optimizer": True, "main_params_dtype": torch.float32,
                                       "exp_avg_dtype": torch.float32, "exp_avg_sq_dtype": torch.float32,
                                       "store_param_remainders": True}
    assert (precision_aware(bf16), precision_aware(fused)) == (False, True)
    assert precision_aware(bf16.replace(optimizer_numerics="bf16-moments"))
    assert "fp32 moments" in describe(fused) and "copied to fp32" in describe(bf16)
    for aware in (fused, bf16.replace(optimizer_numerics="bf16-moments")):
        with pytest.raises(ConfigError, match="non-finite with bf16 gradient buffers"):
            numerics_options(aware.replace(grad_reduce_in_fp32=False))
    assert numerics_options(bf16.replace(grad_reduce_in_fp32=False)) == {}
    with pytest.raises(ConfigError, match="bf16-moments already runs there"):
        numerics_options(fused.replace(optimizer_numerics="bf16-moments"))
    from nam_core.bounds import broken_rules

    problems = [p.line for p in broken_rules(TrainConfig(dtype="float32", fused_master_weights=True))]
    assert problems and "fused_master_weights with dtype=bfloat16 only" in problems[0]
    with pytest.raises(NamError, match=r"Transformer Engine \(precision-aware optimizer\)"):
        engine.check_runtime(READY, precision_aware=precision_aware(fused))


def test_load_targets_stay_on_an_h200_and_go_to_the_host_on_an_h100():
    """Full NAM56R at one GPU, bf16-moments (state 6 bytes x 4.73e9 parameters): after the targets are made and
    the state released, an H200 has ~95 GiB free (139 less weights 2 and targets 8 bytes per parameter) and the
    rebuild needs ~64 GiB: the targets stay; an 80 GB H100 has ~36 GiB: they go to host memory, said so."""
    from nam_core.engine.megatron import checkpoint

    state = 6 * 4_730_000_000
    stay, why = checkpoint.targets_stay(state, 95 << 30)
    assert stay and why.startswith("optimizer load targets on the GPU")
    stay, why = checkpoint.targets_stay(state, 36 << 30)
    assert not stay and "in host memory" in why and "36.0 GiB free" in why
    assert checkpoint.targets_stay(state, None) == (False, "optimizer load targets in host memory (no GPU)")
