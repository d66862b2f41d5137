"""Activation is all-or-nothing and every failure is reported at once, with what was needed and found."""

import pytest

from nam_core.device import DeviceInfo
from nam_core.errors import PluginActivationError, UnknownBackendError
from nam_core.host import PluginHost, requested_plugins
from nam_core.testing import fake_installed

HEADER = "from nam_core import PluginInfo, Requirement, hookimpl, Check\n"

GOOD = HEADER + '''
PLUGIN = PluginInfo(summary="cpu-only indexer", provides={"indexer": ["good-idx"]})

class GoodIndexer: ...

@hookimpl
def nam_register_indexer_backends(register):
    register("good-idx", GoodIndexer)
'''

BIG_SMEM = HEADER + '''
PLUGIN = PluginInfo(
    summary="needs 160 KiB of shared memory per block",
    provides={"attention": ["big"]},
    requires=(Requirement.cuda_capability(at_least=(9, 0)),
              Requirement.shared_memory_per_block(at_least=160 * 1024)),
)

@hookimpl
def nam_register_attention_backends(register):
    register("big", object)
'''

NEEDS_PACKAGE = HEADER + '''
PLUGIN = PluginInfo(summary="needs a package", provides={},
                    requires=(Requirement.package("surely-not-installed-pkg>=1.0"),))
'''

BROKEN_IMPORT = "import surely_not_a_module_xyz\n"

CONFLICTS = HEADER + '''
PLUGIN = PluginInfo(summary="conflicts with good", provides={}, conflicts=("good",),
                    conflict_reason="both rewrite the same schedule")
'''

TYPO_HOOK = HEADER + '''
PLUGIN = PluginInfo(summary="misspelled hook", provides={})

@hookimpl
def nam_register_indexer(register):  # missing the final s
    pass
'''

UNDECLARED = HEADER + '''
PLUGIN = PluginInfo(summary="registers what it did not declare", provides={})

@hookimpl
def nam_register_ce_backends(register):
    register("sneaky", object)
'''

CLASH = HEADER + '''
PLUGIN = PluginInfo(summary="clashes with good", provides={"indexer": ["good-idx"]})

@hookimpl
def nam_register_indexer_backends(register):
    register("good-idx", object)
'''

CONFIG_CHECK = HEADER + '''
PLUGIN = PluginInfo(summary="refuses ep > 1", provides={})

@hookimpl
def nam_check_config(config, device):
    ep = config.train.ep
    status = "pass" if ep == 1 else "fail"
    return [Check("cfgcheck", "expert parallelism", status, "ep == 1", f"ep == {ep}", "set ep=1")]
'''

LAUNCH = HEADER + '''
PLUGIN = PluginInfo(summary="has a launch check", provides={})
CALLS = []

@hookimpl
def nam_preflight(device, config):
    CALLS.append(device)
    return [Check("launch", "kernel smoke test", "pass", "runs", "ran")]
'''

NO_PLUGIN_OBJECT = "x = 1\n"

WITH_PATCH = HEADER + '''
from nam_core import Patch
PLUGIN = PluginInfo(summary="carries a patch", provides={"patches": ["demo-fix"]},
                    requires=(Requirement.cuda_device(),))
BUG = {"present": True}

def _apply():
    BUG["present"] = False

@hookimpl
def nam_register_patches(register):
    register("demo-fix", Patch(name="demo-fix", target="pluggy", versions=">=1", summary="demo",
                               retire_when="pluggy 99", detect=lambda: BUG["present"], apply=_apply))
'''

ALL = {
    "good": GOOD, "big": BIG_SMEM, "needs-pkg": NEEDS_PACKAGE, "broken": BROKEN_IMPORT,
    "conflicts": CONFLICTS, "typo": TYPO_HOOK, "undeclared": UNDECLARED, "clash": CLASH,
    "cfgcheck": CONFIG_CHECK, "launch": LAUNCH, "noplugin": NO_PLUGIN_OBJECT, "patched": WITH_PATCH,
}

CPU = DeviceInfo.profile("cpu")
H100 = DeviceInfo.profile("h100")
GB10 = DeviceInfo.profile("gb10")


@pytest.fixture
def host(tmp_path, monkeypatch):
    installed = fake_installed(tmp_path, monkeypatch, ALL)
    return lambda: PluginHost(installed=installed)


def failures(ev):
    return {(c.plugin, c.name): c for c in ev.failures}


def test_passing_plugin_registers_its_backend(host):
    h = host()
    h.activate(["good"], CPU)
    assert h.registry("indexer").names() == ["good-idx"]
    assert h.registry("indexer").get("good-idx").__name__ == "GoodIndexer"
    assert h.registry("indexer").plugin_of("good-idx") == "good"


def test_smem_requirement_fails_on_gb10_with_numbers_and_passes_on_h100(host):
    ev = host().evaluate(["big"], GB10)
    [fail] = ev.failures
    assert fail.name == "shared memory per block"
    assert "101,376" in fail.found and "163,840" in fail.needed
    assert host().evaluate(["big"], H100).ok


def test_unknown_name_lists_installed_plugins(host):
    with pytest.raises(PluginActivationError) as e:
        host().activate(["nope"], CPU)
    [fail] = e.value.failures
    assert fail.name == "installed" and "good" in fail.found and "big" in fail.found
    assert e.value.exit_code == 3


def test_import_error_is_an_activation_failure_with_its_message(host):
    with pytest.raises(PluginActivationError) as e:
        host().activate(["broken"], CPU)
    [fail] = e.value.failures
    assert fail.name == "import" and "surely_not_a_module_xyz" in fail.found


def test_module_without_plugin_object_fails(host):
    [fail] = host().evaluate(["noplugin"], CPU).failures
    assert fail.name == "declaration"


def test_conflict_is_reported_once_with_reason(host):
    ev = host().evaluate(["good", "conflicts"], CPU)
    [fail] = ev.failures
    assert fail.name == "conflicts with good" and "same schedule" in fail.found


def test_several_failures_are_reported_at_once_and_nothing_is_registered(host):
    h = host()
    with pytest.raises(PluginActivationError) as e:
        h.activate(["good", "big", "needs-pkg", "broken", "nope"], CPU)
    got = {(c.plugin, c.name) for c in e.value.failures}
    assert got == {
        ("big", "CUDA capability"), ("big", "shared memory per block"),
        ("needs-pkg", "package surely-not-installed-pkg"), ("broken", "import"), ("nope", "installed"),
    }
    assert h.registry("indexer").names() == []  # all or nothing: "good" was not registered either
    assert h.active == {}
    assert "5 checks failed" in e.value.message


def test_misspelled_hookimpl_is_an_error(host):
    [fail] = host().evaluate(["typo"], CPU).failures
    assert fail.name == "hooks" and "nam_register_indexer" in fail.found


def test_registering_an_undeclared_name_fails(host):
    [fail] = host().evaluate(["undeclared"], CPU).failures
    assert fail.name == "register ce" and "sneaky" in fail.found


def test_two_plugins_registering_one_name_fail(host):
    ev = host().evaluate(["good", "clash"], CPU)
    assert [(c.plugin, c.name) for c in ev.failures] == [("clash", "register indexer")]


def spec(**train):
    """A RunSpec of the tiny recipe (what the composition root hands the hooks)."""
    from nam56r.run import spec_for

    s = spec_for("nam56r-tiny")
    return s.replace(train=s.train.replace(**train), plugins=(), backends={})


def test_config_check_hook_sees_the_typed_run_and_only_with_a_run(host):
    assert host().evaluate(["cfgcheck"], CPU, spec(ep=1)).ok
    [fail] = host().evaluate(["cfgcheck"], CPU, spec(ep=8)).failures
    assert fail.found == "ep == 8" and fail.hint == "set ep=1"
    assert host().evaluate(["cfgcheck"], CPU).ok  # no run: config rules are not asked
    with pytest.raises(TypeError, match="RunSpec"):
        host().evaluate(["cfgcheck"], CPU, {"ep": 8})


def test_launch_checks_are_skipped_on_fake_devices_and_run_on_real_ones(host):
    import dataclasses
    import sys

    ev = host().evaluate(["launch"], H100)
    [row] = [c for c in ev.checks if c.name == "launch checks"]
    assert row.status == "skip" and ev.ok
    assert sys.modules["nam_fake_launch"].CALLS == []
    real = dataclasses.replace(H100, profile_name=None)
    ev = host().evaluate(["launch"], real)
    assert [c.name for c in ev.checks if c.plugin == "launch"] == ["import", "kernel smoke test"]
    assert len(sys.modules["nam_fake_launch"].CALLS) == 1


def test_unknown_backend_names_the_installed_provider(host):
    h = host()
    h.activate([], CPU)
    with pytest.raises(UnknownBackendError) as e:
        h.registry("indexer").get("good-idx")
    assert "provided by plugin 'good'" in e.value.message and "--plugins good" in e.value.hint
    with pytest.raises(UnknownBackendError) as e:
        h.registry("indexer").get("made-up")
    assert "no installed plugin provides" in e.value.message


def test_requested_plugins_merges_sources_and_env(monkeypatch):
    monkeypatch.setenv("NAM_PLUGINS", "c, a")
    assert requested_plugins(["a", "b"], "b,d") == ["a", "b", "d", "c"]
    monkeypatch.delenv("NAM_PLUGINS")
    assert requested_plugins(None, "") == []


def test_a_host_activates_once(host):
    h = host()
    h.activate(["good"], CPU)
    with pytest.raises(RuntimeError, match="already activated plugins; use a fresh host per run"):
        h.activate(["good"], CPU)


def test_patches_are_listed_without_activation_and_applied_after_it(host):
    from nam_core.patches import APPLIED, NEEDED, apply_all

    [entry] = host().declared_patches("patched")  # listed even though this CPU fails its requirement
    assert entry.impl.state()[0] == NEEDED and entry.plugin == "patched"
    h = host()
    h.activate(["patched"], H100)
    [report] = apply_all(h.registry("patches"))
    assert report.state == APPLIED and report.name == "demo-fix"


def test_declared_patches_of_an_unknown_plugin_lists_the_installed_ones(host):
    with pytest.raises(PluginActivationError) as e:
        host().declared_patches("nope")
    assert "installed" in e.value.message and "patched" in e.value.message


def test_evaluate_points_the_kernel_caches_at_nams_folder_before_a_plugin_loads(host, monkeypatch, tmp_path):
    """Every compiler cache a user left unset lands under ``$NAM_CACHE_DIR`` before the first plugin module is
    imported (TileLang reads its variable at import); one the user set stays where it is."""
    import os

    from nam_core.cache import KERNEL_CACHES

    monkeypatch.setenv("NAM_CACHE_DIR", str(tmp_path / "nam"))
    for var in (*KERNEL_CACHES, "TRITON_CACHE_AUTOTUNING"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    h, seen = host(), {}
    real = h._load_checked

    def load(name, ev):
        seen.update({var: os.environ.get(var) for var in (*KERNEL_CACHES, "TRITON_CACHE_AUTOTUNING")})
        return real(name, ev)

    monkeypatch.setattr(h, "_load_checked", load)
    assert h.evaluate(["good"], CPU).ok
    assert seen == {"TILELANG_CACHE_DIR": str(tmp_path / "nam" / "tilelang"),
                    "TRITON_CACHE_DIR": str(tmp_path / "mine"),
                    "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "nam" / "inductor"), "TRITON_CACHE_AUTOTUNING": "1"}


def _dist(root, name: str, version: str, plugin: str, target: str) -> None:
    """An installed distribution ``name`` (a .dist-info folder under ``root``) registering nam plugin ``plugin``."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[nam.plugins]\n{plugin} = {target}\n")


def test_two_distributions_registering_one_plugin_name_are_refused(tmp_path, monkeypatch):
    """Which of two same-named plugins ran followed the order of sys.path, silently: now neither runs and the
    error names both distributions and what to uninstall."""
    from nam_core.errors import CannotRunHere
    from nam_core.host import discover

    _dist(tmp_path, "nam-plugin-toy", "1.0", "toy", "toy_one:PLUGIN")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert discover()["toy"].distribution == "nam-plugin-toy"  # one is fine
    other = tmp_path / "elsewhere"
    other.mkdir()
    _dist(other, "toy-fork", "2.0", "toy", "toy_two:PLUGIN")
    monkeypatch.syspath_prepend(str(other))
    with pytest.raises(CannotRunHere, match=r"plugin 'toy' is registered by two installed distributions: "
                                            r"toy-fork 2.0 \(toy_two:PLUGIN\) and nam-plugin-toy 1.0") as err:
        discover()
    assert err.value.exit_code == 3 and err.value.hint.startswith("pip uninstall the one you do not want")
