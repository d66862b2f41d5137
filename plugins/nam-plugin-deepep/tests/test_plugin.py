"""The plugin's face on the CPU: what requesting it selects and lowers, its refusals (the CPU, no DeepEP, EP 1, a
group DeepEP has no kernels for, the local engine, too few GPUs or no peer access, an extension that does not
load against torch, a GPU the build has no code for), and the staging scripts' pack and restore steps."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

import nam_plugin_deepep.plugin as plugin
from nam56r.recipes import apply_overrides, get_recipe
from nam56r.run import RunRequest, activate, resolve, spec_for
from nam_core import PluginInfo, selection
from nam_core.checks import config_rows
from nam_core.device import DeviceInfo
from nam_core.errors import ConfigError, PluginActivationError
from nam_core.host import PluginHost
from nam_core.requirements import FAIL, PASS

CPU = DeviceInfo.profile("cpu")
H100 = DeviceInfo.profile("h100")
DEVICE = Path(plugin.__file__).resolve().parents[2] / "device"
MIRROR = Path("/work/.mirror/deepseek-ai+DeepEP/repo")


def megatron(ep=2, *overrides, plugins=("deepep",)):
    """nam56r-tiny resolved for the megatron engine on ``ep`` processes (lowered, not activated), in bf16 (the
    dtype DeepEP combines) unless ``overrides`` say otherwise."""
    return resolve(RunRequest(recipe="nam56r-tiny", plugins=list(plugins), engine="megatron", device="cuda",
                              ep=ep, nproc=ep, env_plugins=False,
                              overrides=["attention_backend=reference", "train.dtype=bfloat16", *overrides]))


def rows(spec):
    return {c.name: c for c in config_rows(plugin.NAME, plugin.PLUGIN, spec)}


# --- selection and lowering ---------------------------------------------------------------------------------


def test_requesting_the_plugin_lowers_megatron_s_flex_dispatcher_on_deepep():
    run = megatron(ep=2)
    assert run.spec.train.moe_dispatcher == "flex"
    assert "train.moe_dispatcher=flex (selected by plugin deepep)" in run.spec.notes
    assert (run.lowering.moe_dispatcher, run.lowering.config_args["moe_token_dispatcher_type"],
            run.lowering.config_args["moe_flex_dispatcher_backend"]) == ("flex", "flex", "deepep")
    assert {n: c.status for n, c in rows(run.spec).items()} == {"engine": PASS, "expert parallelism": PASS,
                                                                 "train.dtype": PASS}


def test_without_the_plugin_the_lowering_keeps_all_to_all_and_refuses_flex():
    plain = megatron(2, plugins=())
    assert plain.lowering.config_args["moe_token_dispatcher_type"] == "alltoall"
    assert "moe_flex_dispatcher_backend" not in plain.lowering.config_args
    with pytest.raises(ConfigError, match="flex dispatcher on DeepEP, which plugin deepep brings; it is not "
                                          "requested") as e:
        megatron(2, "train.moe_dispatcher=flex", plugins=())
    assert e.value.exit_code == 2 and "--plugins deepep" in e.value.hint


def test_an_explicit_set_wins_and_leaves_the_plugin_unused():
    run = megatron(2, "train.moe_dispatcher=alltoall")
    assert run.lowering.config_args["moe_token_dispatcher_type"] == "alltoall"
    assert ("train.moe_dispatcher=alltoall (your --set; plugin deepep would have selected flex)"
            in run.spec.notes)
    assert rows(run.spec) == {}  # nothing of the plugin runs, so none of its rows is asked


def test_train_selections_agree_or_are_refused():
    infos = {"deepep": plugin.PLUGIN, "other": PluginInfo(summary="x", selects={"train.moe_dispatcher": "alltoall"})}
    with pytest.raises(ConfigError, match=r"select different values for 'train.moe_dispatcher': deepep -> flex, "
                                          r"other -> alltoall"):
        apply_overrides(get_recipe("nam56r-tiny"), [], plugin_names=list(infos), plugin_infos=infos)
    bad = {"bad": PluginInfo(summary="x", selects={"train.no_such_field": "1"})}
    with pytest.raises(ConfigError, match="'train.no_such_field', which is not a train-config field"):
        selection.select_train(get_recipe("nam56r-tiny").train, bad)


# --- refusals ------------------------------------------------------------------------------------------------


def test_expert_parallelism_one_is_refused_there_is_nothing_to_dispatch_across():
    run = megatron(ep=1)
    row = rows(run.spec)["expert parallelism"]
    assert row.status == FAIL
    assert row.found == "ep=1: every rank holds all experts, so there is nothing to dispatch across"
    assert "--nproc N --ep N with N in (2, 4, 8)" in row.hint and "drop --plugins deepep" in row.hint


@pytest.mark.parametrize("ep, found", [(16, "ep=16: DeepEP v1.2.x (NVSHMEM off) runs intranode groups of (2, 4, 8)")])
def test_a_group_deepep_has_no_kernels_for_is_refused(ep, found):
    from nam_core.run import Layout

    spec = megatron(2).spec
    spec = spec.replace(layout=Layout(tp=1, pp=1, ep=ep, world_size=ep))
    row = rows(spec)["expert parallelism"]
    assert row.status == FAIL and found in row.found


def test_a_dtype_other_than_bf16_is_refused_deepep_combines_bf16_only():
    """On two H200s nam56r-tiny in fp32 with the flex dispatcher aborted both ranks at the first combine
    (DeepEP's ``Unsupported type`` assertion); the row refuses it before anything runs."""
    fp32 = rows(megatron(2, "train.dtype=float32").spec)["train.dtype"]
    assert fp32.status == FAIL and fp32.found == "train.dtype=float32", fp32
    assert "--set train.dtype=bfloat16" in fp32.hint and "drop --plugins deepep" in fp32.hint, fp32.hint
    assert rows(megatron(2, "train.dtype=bfloat16").spec)["train.dtype"].status != FAIL


def test_the_local_engine_is_refused():
    spec = spec_for("nam56r-tiny", "attention_backend=reference", plugins=["deepep"])
    assert spec.train.moe_dispatcher == "flex"
    checks = rows(spec)
    assert checks["engine"].status == FAIL and checks["engine"].found == "engine=local"
    assert "--engine megatron" in checks["engine"].hint and "expert parallelism" not in checks


def test_activation_refuses_the_cpu_and_a_host_without_deepep():
    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("DeepEP is installed here")
    for device, failed in ((CPU, 2), (H100, 1)):
        with pytest.raises(PluginActivationError) as e:
            PluginHost().activate(["deepep"], device)
        msg = str(e.value)
        assert msg.startswith(f"{failed} checks failed" if failed > 1 else "1 check failed")
        assert ("CUDA capability: needs >= sm_90, found no CUDA device" in msg) == (device is CPU)
        assert "package deep_ep: needs deep_ep>=1.2.1,<1.3" in msg and "found not installed" in msg
        assert "fetch-deepep.sh" in e.value.hint and e.value.exit_code == 3
    run = megatron(ep=1)
    with pytest.raises(PluginActivationError, match="deepep: expert parallelism: needs ep in"):
        activate(run, PluginHost(), H100)


# --- device rows, with torch's answers replaced --------------------------------------------------------------


def fake_cuda(monkeypatch, count, missing=(), capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) not in missing)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)


def test_peer_access_needs_ep_gpus_with_every_pair_connected(monkeypatch):
    spec = megatron(4).spec
    fake_cuda(monkeypatch, 2)
    m = plugin.peer_access(spec)
    assert m.ok is False and m.found == "2 GPU(s) visible for ep=4"
    fake_cuda(monkeypatch, 4, missing={(1, 3)})
    m = plugin.peer_access(spec)
    assert m.ok is False and m.found == "no peer access for [(1, 3)] of 4 GPUs" and "NVLink" in m.hint
    fake_cuda(monkeypatch, 4)
    assert plugin.peer_access(spec) == (True, "all 12 ordered pairs of 4 GPUs", None, None)
    fake_cuda(monkeypatch, 1)
    assert plugin.peer_access(None).ok is None  # `nam preflight` alone on one GPU: no pair to check


def fake_deep_ep(tmp_path, monkeypatch, body, version="1.2.1"):
    """A ``deep_ep`` on sys.path with its metadata, whose import runs ``body``."""
    (tmp_path / "deep_ep").mkdir(parents=True)
    (tmp_path / "deep_ep" / "__init__.py").write_text(body)
    info = tmp_path / f"deep_ep-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deep_ep\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)


def test_an_extension_built_for_another_torch_is_a_refusal_not_a_crash(tmp_path, monkeypatch):
    fake_deep_ep(tmp_path, monkeypatch, "raise ImportError('deep_ep_cpp.so: undefined symbol: _ZN3c104cuda')")
    m = plugin.extension(None)
    assert m.ok is False and "deep_ep 1.2.1: the extension does not load against torch" in m.found
    assert "undefined symbol" in m.found and "install-deepep.sh" in m.hint


def test_the_extension_row_names_version_torch_and_refuses_a_gpu_without_sm90_code(tmp_path, monkeypatch):
    fake_deep_ep(tmp_path, monkeypatch, "class Buffer:\n    is_sm90_compiled = staticmethod(lambda: True)\n")
    fake_cuda(monkeypatch, 1)
    m = plugin.extension(None)
    assert m.ok is True and m.found == (f"deep_ep 1.2.1, extension loads against torch {torch.__version__}, "
                                        "SM90 features on, GPU sm_90")
    fake_cuda(monkeypatch, 1, capability=(10, 0))
    m = plugin.extension(None)
    assert m.ok is False and m.found.endswith("GPU sm_100: the build holds sm_90 code only")


# --- staging -------------------------------------------------------------------------------------------------


def test_the_pack_step_stages_v1_2_1_intranode_sources(tmp_path):
    if not (MIRROR / "refs").exists() and not (MIRROR / "packed-refs").exists():
        pytest.skip(f"the DeepEP mirror {MIRROR} is absent (as in CI)")
    env = {**os.environ, "DEEPEP_OUT": str(tmp_path / "out"), "DEEPEP_NINJA": "0", "DEEPEP_SRC": str(MIRROR)}
    subprocess.run(["bash", str(DEVICE / "fetch-deepep.sh")], env=env, check=True, capture_output=True, text=True)
    with tarfile.open(tmp_path / "out" / "deepep-src.tar.xz") as t:
        names = set(t.getnames())
        setup = t.extractfile("src/setup.py").read().decode()
    for f in ("setup.py", "csrc/deep_ep.cpp", "csrc/kernels/intranode.cu", "csrc/kernels/layout.cu",
              "csrc/kernels/runtime.cu", "deep_ep/buffer.py", "deep_ep/__init__.py", "LICENSE"):
        assert f"src/{f}" in names, f
    assert "version='1.2.1'" in setup and not any(n.startswith("src/tests") for n in names)
    assert (tmp_path / "out" / "install-deepep.sh").read_bytes() == (DEVICE / "install-deepep.sh").read_bytes()
    assert (tmp_path / "out" / "deepep-src.tar.xz").stat().st_size < 1 << 20


def test_the_pack_step_refuses_a_missing_source(tmp_path):
    env = {**os.environ, "DEEPEP_OUT": str(tmp_path / "out"), "DEEPEP_NINJA": "0", "DEEPEP_SRC": str(tmp_path / "no")}
    done = subprocess.run(["bash", str(DEVICE / "fetch-deepep.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 1
    assert "DeepEP v1.2.1 source not found" in done.stderr and "next:     DEEPEP_SRC=" in done.stderr


def test_the_install_step_restores_a_cached_build_that_the_requirement_accepts(tmp_path):
    """The restore path of install-deepep.sh (the build path needs nvcc): the package, its metadata and the
    cached extension land in the site folder, under the name a build on this torch and Python is saved as."""
    if shutil.which("xz") is None:
        pytest.skip("xz is not installed")
    stage = tmp_path / "stage" / "src"
    (stage / "deep_ep").mkdir(parents=True)
    (stage / "deep_ep" / "__init__.py").write_text("")
    with tarfile.open(tmp_path / "deepep-src.tar.xz", "w:xz") as t:
        t.add(tmp_path / "stage" / "src", arcname="src")
    shutil.copy(DEVICE / "install-deepep.sh", tmp_path)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    key = f"deep_ep_cpp-1.2.1-nonvshmem-sm90-torch{torch.__version__.replace('+', '_')}{suffix[:-3]}.so.xz"
    cache = tmp_path / "cache"
    cache.mkdir()
    subprocess.run(["xz", "-z", "-c"], input=b"built extension", stdout=(cache / key).open("wb"), check=True)
    site = tmp_path / "site"
    env = {**os.environ, "DEEPEP_SITE": str(site), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(tmp_path / "install-deepep.sh"), str(cache)], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert f"restored deep_ep_cpp from {cache}/{key}" in done.stdout
    assert (site / f"deep_ep_cpp{suffix}").read_bytes() == b"built extension"
    [dist] = importlib.metadata.distributions(path=[str(site)])
    assert dist.metadata["Name"] == "deep_ep" and dist.version in SpecifierSet(plugin.DEEPEP.split("deep_ep")[1])


def test_activation_with_deepep_installed_registers_the_patch(tmp_path, monkeypatch):
    """The whole activation on a (fake) sm_90 device with a DeepEP 1.2.1 distribution visible: the requirements
    pass and the host registers the patch-lane entry the plugin declares."""
    fake_deep_ep(tmp_path, monkeypatch, "")
    host = PluginHost()
    host.activate(["deepep"], H100)
    assert host.registry("patches").names() == [plugin.PATCH]
    fake_deep_ep(tmp_path / "old", monkeypatch, "", version="1.0.0")  # PyPI's unrelated deep-ep
    with pytest.raises(PluginActivationError, match=r"needs deep_ep>=1.2.1,<1.3 .*found 1.0.0"):
        PluginHost().activate(["deepep"], H100)
