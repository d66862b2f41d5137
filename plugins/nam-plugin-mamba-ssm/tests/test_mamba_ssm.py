"""nam-plugin-mamba-ssm on CPU: activation and config refusals, the patch lane on fake mamba-ssm
trees (2.3.2.post1-like and fixed), the grouped reduction against autograd, the drivers' kernel calls against
the kernels' declared signatures, the scan's argument mapping against upstream's entry points, and the parity
harness against nam's two pure-PyTorch scans. Kernel parity on the GPU is in test_mamba_ssm_gpu.py."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

import nam_plugin_mamba_ssm.plugin as plugin
from nam56r.recipes import apply_overrides, get_recipe
from nam_cli.main import run
from nam_core.checks import config_rows
from nam_core.device import DeviceInfo
from nam_core.errors import NamError, PluginActivationError
from nam_core.host import PluginHost
from nam_core.patches import APPLIED, BUG_REPRODUCED, FIX_VALIDATED, NEEDED, RETIRED, apply_all
from nam_core.requirements import FAIL, PASS, SKIP
from nam_plugin_mamba_ssm import mimo, patches, selftest, upstream
from nam_plugin_mamba_ssm.scan import mimo_args, rotary_divisor, siso_args

CPU = DeviceInfo.profile("cpu")
H100 = DeviceInfo.profile("h100")
GB10 = DeviceInfo.profile("gb10")
HINT = plugin.GPU_HINT
RELEASES = {"mamba-ssm": "2.3.2.post1", "tilelang": "0.1.8", "triton": "3.6.0"}


# --- fixtures: installed releases, a fake mamba-ssm tree ------------------------------------------------
@pytest.fixture
def releases(fake_versions):
    """``releases(**{"mamba-ssm": None})``: the distributions the plugin needs look installed at RELEASES, with
    overrides (``None``: not installed)."""

    def fake(**overrides):
        fake_versions(**{**RELEASES, **overrides})

    fake()
    return fake


DRIVERS = """
def mamba_mimo_forward(*args, **kwargs):
    if kwargs.get("build"):  # the source line detection reads; never run here
        kernel = mamba_mimo_fwd(T.dynamic("B"), T.dynamic("S"), T.dynamic("H"), T.dynamic("G"))
    return "upstream forward"

def mamba_mimo_bwd_combined(*args, **kwargs):
    raise ValueError("G value of 8 is not currently supported!")
"""


@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    """``fake_tree(fixed=False)`` writes a mamba_ssm package shaped like 2.3.2.post1 (``fixed``: like main after
    PRs #967, #968 and #977), puts it first on sys.path, and removes every module it imported afterwards (and
    restores the drivers' build mode, which the lane sets)."""
    before = set(sys.modules)
    monkeypatch.setattr(mimo, "STATIC", mimo.STATIC)

    def make(fixed: bool = False):
        root = tmp_path / ("fixed" if fixed else "release")
        pkg = root / "mamba_ssm"
        files = {
            "__init__.py": '__version__ = "2.3.2.post1"\nfrom mamba_ssm.ops import selective_scan_interface\n',
            "ops/__init__.py": "",
            "ops/selective_scan_interface.py": (
                "try:\n    import selective_scan_cuda\nexcept ImportError:\n    selective_scan_cuda = None\n"
                if fixed else "import torch\nimport selective_scan_cuda\n"),
            "ops/triton/__init__.py": "", "ops/triton/mamba3/__init__.py": "",
            "ops/triton/mamba3/mamba3_siso_combined.py": "def mamba3_siso_combined(*a, **k):\n    return 'siso'\n",
            "ops/tilelang/__init__.py": "", "ops/tilelang/mamba3/__init__.py": "",
            "ops/tilelang/mamba3/mamba3_mimo_fwd.py": DRIVERS.replace('T.dynamic("B"), ', "B, ") if fixed else DRIVERS,
            "ops/tilelang/mamba3/mamba3_mimo_bwd.py": DRIVERS,
            "ops/tilelang/mamba3/mamba3_mimo.py": (
                "from mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_fwd import mamba_mimo_forward\n"
                "from mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_bwd import mamba_mimo_bwd_combined\n"
                "def mamba3_mimo(*a, **k):\n    return mamba_mimo_forward(*a, **k)\n"
                "class _Mamba3Function:\n    @staticmethod\n    def backward(ctx, dout):\n"
                + ("        (q,) = ctx.saved_tensors\n" if fixed else
                   "        if len(ctx.saved_tensors) == 0:\n            raise RuntimeError\n"
                   "        (q,) = ctx.saved_tensors\n")
                + "        return dout\n"),
        }
        if fixed:
            files["ops/triton/mamba3/grouped_head_reduction.py"] = "def reduce_grouped_qk_grads(*a):\n    pass\n"
        for rel, text in files.items():
            (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
            (pkg / rel).write_text(text)
        monkeypatch.syspath_prepend(str(root))
        return root

    yield make
    for name in set(sys.modules) - before:
        if name.startswith("mamba_ssm") or name == upstream.EXTENSION:
            del sys.modules[name]


# --- activation and config: fail closed ----------------------------------------------------------------
def recipe(*overrides, base="nam56r", device="cuda"):
    """The RunSpec of `--plugins mamba-ssm` on ``base``, every other kind on the reference (a fake H100)."""
    from nam56r.run import spec_for

    others = ("attention_backend=reference", "indexer_kernels_backend=reference", "ce_backend=reference",
              "moe_backend=reference")
    return spec_for(base, *others, *overrides, plugins=["mamba-ssm"], device=device).replace(
        plugins=("reference", "mamba-ssm"))


def failures(device, config=None, names=("mamba-ssm",)):
    ev = PluginHost().evaluate(list(names), device, config)
    return {c.name: c for c in ev.failures if c.plugin == "mamba-ssm"}


def test_activates_on_an_h100_profile_and_registers_the_scan(releases):
    from nam_plugin_mamba_ssm.scan import MambaSSMScan

    host = PluginHost()
    ev = host.activate(recipe().plugins, H100, recipe())
    assert host.registry("ssm").get("mamba-ssm") is MambaSSMScan
    assert [c.status for c in ev.checks if c.plugin == "mamba-ssm" and c.name == "launch checks"] == [SKIP]
    assert [e.name for e in host.registry("patches")] == list(patches.NAMES)  # the order they must apply in


def test_activation_is_refused_on_the_cpu_profile(releases):
    bad = failures(CPU)
    assert set(bad) == {"CUDA capability", "shared memory per block"}
    assert bad["CUDA capability"].found.startswith("no CUDA device")
    with pytest.raises(PluginActivationError, match="mamba-ssm: CUDA capability"):
        PluginHost().activate(["mamba-ssm"], CPU)


def test_activation_is_refused_before_hopper(releases, fake_a100):
    bad = failures(fake_a100)  # sm_80, and 163 KiB per block: short of the MIMO kernels' shared memory too
    assert set(bad) == {"CUDA capability", "shared memory per block"}
    assert bad["CUDA capability"].found == "sm_80" and bad["shared memory per block"].found == "166,912 B (163 KiB)"


def test_activation_is_refused_where_shared_memory_is_short_with_the_number(releases):
    bad = failures(GB10)  # sm_121, 99 KiB per block
    assert set(bad) == {"shared memory per block"}
    assert bad["shared memory per block"].found == "101,376 B (99 KiB)"
    assert bad["shared memory per block"].needed == f">= {plugin.MIMO_SMEM_BYTES:,} B ({plugin.MIMO_SMEM_BYTES / 1024:.0f} KiB)"


@pytest.mark.parametrize("missing", ["mamba-ssm", "tilelang", "triton"])
def test_activation_without_a_kernel_package_names_the_gpu_extra(releases, missing):
    releases(**{missing: None})
    bad = failures(H100)
    assert set(bad) == {f"package {missing}"}
    assert bad[f"package {missing}"].found == "not installed" and bad[f"package {missing}"].hint == HINT


@pytest.mark.parametrize("package, below", [("mamba-ssm", "2.3.1"), ("tilelang", "0.1.7"), ("triton", "3.4.0")])
def test_activation_refuses_a_kernel_package_below_its_floor(releases, package, below):
    releases(**{package: below})
    bad = failures(H100)
    assert set(bad) == {f"package {package}"} and bad[f"package {package}"].found == below
    assert bad[f"package {package}"].hint == HINT


def test_activation_refuses_tilelang_0_1_15_which_cannot_build_the_mimo_forward(releases):
    releases(tilelang="0.1.15")
    bad = failures(H100)
    assert set(bad) == {"package tilelang"}
    assert bad["package tilelang"].found.startswith("0.1.15 (known bad: cannot build mamba-ssm 2.3.2.post1's MIMO")
    releases(tilelang="0.1.14")  # only the measured release is refused
    assert failures(H100) == {}


def test_requesting_the_plugin_selects_the_scan_and_an_explicit_choice_wins():
    assert recipe(base="nam56r-tiny").model.ssm_backend == "mamba-ssm"
    rec = recipe("ssm_backend=reference")
    assert rec.model.ssm_backend == "reference"
    [check] = [c for c in PluginHost().evaluate(rec.plugins, H100, rec).checks
               if c.plugin == "mamba-ssm" and c.name == "selected"]
    assert check.status == SKIP and "active but unused" in check.found


def test_config_check_passes_nam56r():
    checks = {c.name: c for c in config_rows(plugin.NAME, plugin.PLUGIN, recipe())}
    assert checks["kernel shapes"].status == PASS
    assert checks["kernel shapes"].found == "d_state 128, headdim 64, rank 4, chunk 16, ngroups 8"
    assert set(checks) == {"kernel shapes"}


@pytest.mark.parametrize("overrides, fragment", [
    (("mamba_headdim=16",), "MIMO headdim 16 is not one of (32, 64, 128)"),
    (("mamba_mimo_rank=3",), "MIMO rank 3 is not one of (2, 4, 8)"),
    (("mamba_chunk=32",), "chunk 32 x rank 4"),
    (("mamba_mimo_rank=1", "d_state=96"), "SISO d_state 96 is not a power of two"),
])
def test_config_check_refuses_widths_the_kernels_cannot_take(overrides, fragment):
    bad = {c.name: c for c in config_rows(plugin.NAME, plugin.PLUGIN, recipe(*overrides))}["kernel shapes"]
    assert bad.status == FAIL and fragment in bad.found, bad
    assert "ssm_backend=reference" in bad.hint


def test_the_host_wants_cuda_and_bf16_from_the_declaration():
    rec = recipe("train.dtype=float32", device="cpu")
    checks = {c.name: c for c in PluginHost().evaluate(rec.plugins, H100, rec).checks if c.plugin == "mamba-ssm"}
    assert checks["train.device"].status == FAIL and checks["train.device"].found == "train.device=cpu"
    assert checks["train.dtype"].status == FAIL and checks["train.dtype"].found == "train.dtype=float32"
    assert "ssm_backend=reference" in checks["train.dtype"].hint


def test_preflight_launch_is_not_attempted_on_a_fake_device():
    ev = PluginHost().evaluate(["mamba-ssm"], H100)
    assert [c.status for c in ev.checks if c.plugin == "mamba-ssm" and c.name == "launch checks"] == [SKIP]


# --- the patch lane on fake trees ----------------------------------------------------------------------
def states():
    return {name: p.state()[0] for name, p in patches.make_patches().items()}


def test_on_a_release_tree_every_patch_is_needed_and_mamba3_does_not_import(releases, fake_tree):
    fake_tree()
    assert states() == dict.fromkeys(patches.NAMES, NEEDED)
    with pytest.raises(NamError, match="import shim is not applied") as e:
        upstream.load(upstream.SISO_MODULE)
    assert "apply_needed()" in e.value.hint
    with pytest.raises(NamError, match="mamba3-mimo-grouped-bwd, mamba3-mimo-host-overhead, mamba3-mimo-static"):
        patches.require_mimo_fixes()


def test_the_lane_applies_in_order_and_binds_nam_drivers(releases, fake_tree):
    fake_tree()
    host = PluginHost()
    host.activate(recipe().plugins, H100, recipe())
    reports = apply_all(host.registry("patches"))
    assert [(r.name, r.state) for r in reports] == [(n, APPLIED) for n in patches.NAMES]
    mimo_module = sys.modules[upstream.MIMO_MODULE]
    assert mimo_module.mamba_mimo_forward is mimo.forward
    assert mimo_module.mamba_mimo_bwd_combined is mimo.backward
    assert sys.modules[upstream.MIMO_BWD_MODULE].mamba_mimo_bwd_combined is mimo.backward
    assert sys.modules[upstream.MIMO_FWD_MODULE].mamba_mimo_forward is mimo.forward
    assert upstream.load(upstream.SISO_MODULE).mamba3_siso_combined() == "siso"
    assert upstream.package_deferred() and INIT_IMPORT not in sys.modules  # the package's own import never ran
    assert mimo.STATIC  # the static-shapes entry: nam's drivers build for exact sizes
    patches.require_mimo_fixes()  # no longer raises
    assert patches.apply_needed() == []  # idempotent: nothing left to do


def test_the_lane_applied_for_a_scope_is_taken_back_on_the_way_out(releases, fake_tree):
    """Every entry has a revert: inside the block nam's drivers build static kernels; after it, upstream's own
    drivers are bound again, the stand-in extension is gone and every entry is needed again."""
    from nam_core.patches import applied

    fake_tree()
    host = PluginHost()
    host.activate(recipe().plugins, H100, recipe())
    with applied(host.registry("patches")):
        assert upstream.load(upstream.MIMO_MODULE).mamba_mimo_forward is mimo.forward and mimo.STATIC
        assert upstream.shim_installed()
    mimo_module = sys.modules[upstream.MIMO_MODULE]
    assert mimo_module.mamba_mimo_forward() == "upstream forward"
    with pytest.raises(ValueError, match="G value of 8"):
        sys.modules[upstream.MIMO_BWD_MODULE].mamba_mimo_bwd_combined()
    assert not mimo.STATIC and not upstream.shim_installed()
    assert not upstream.package_deferred() and INIT_IMPORT in sys.modules  # the revert ran the package's import
    assert states() == {**dict.fromkeys(patches.NAMES, NEEDED), patches.LAZY: RETIRED}  # imported: nothing to defer


def test_the_stand_in_extension_refuses_mamba1_use_by_name(releases, fake_tree):
    fake_tree()
    patches.apply_needed()
    stub = sys.modules[upstream.EXTENSION]
    with pytest.raises(upstream.Mamba1Unavailable, match=r"selective_scan_cuda\.fwd: Mamba-1's CUDA"):
        stub.fwd
    assert not hasattr(stub, "__path__")  # import machinery sees a plain module


def test_on_a_fixed_tree_the_shim_grouped_and_static_patches_retire(releases, fake_tree):
    fake_tree(fixed=True)
    assert states() == {patches.SHIM: RETIRED, patches.LAZY: NEEDED, patches.GROUPED: RETIRED, patches.HOST: NEEDED,
                        patches.STATIC: RETIRED, patches.SAVED_ONCE: RETIRED}


def test_the_shim_reproducer_tells_the_bug_from_the_fix(releases, fake_tree):
    fake_tree()
    assert patches.reproduce_shim() == BUG_REPRODUCED
    upstream.install_shim()
    assert patches.reproduce_shim() == FIX_VALIDATED


def test_the_shim_reproducer_passes_a_fixed_tree(releases, fake_tree):
    fake_tree(fixed=True)
    assert patches.reproduce_shim() == FIX_VALIDATED


INIT_IMPORT = "mamba_ssm.ops.selective_scan_interface"
"""What the fake trees' package ``__init__`` imports (2.3.2.post1's imports Mamba-1's scan first too)."""


def test_the_deferred_package_imports_mamba3_alone_and_runs_its_init_for_any_other_name(releases, fake_tree):
    fake_tree()
    patches.apply_needed()
    mimo_module = upstream.load(upstream.MIMO_MODULE)
    package = sys.modules["mamba_ssm"]
    assert upstream.package_deferred() and INIT_IMPORT not in sys.modules
    assert package.ops is sys.modules["mamba_ssm.ops"]  # a submodule asked for by name: imported alone
    assert INIT_IMPORT not in sys.modules
    from mamba_ssm import selective_scan_interface  # a name the __init__ binds: the __init__ runs, in place

    assert selective_scan_interface is sys.modules[INIT_IMPORT] and package.__version__ == "2.3.2.post1"
    assert sys.modules["mamba_ssm"] is package and type(package) is types.ModuleType
    assert sys.modules[upstream.MIMO_MODULE] is mimo_module and package.ops.tilelang.mamba3.mamba3_mimo is mimo_module


def test_an_error_of_the_deferred_init_reaches_the_caller_as_from_an_import(releases, fake_tree):
    fake_tree()
    upstream.defer_package_init()  # without the stand-in extension: the __init__'s Mamba-1 import fails
    with pytest.raises(ModuleNotFoundError, match="selective_scan_cuda"):
        sys.modules["mamba_ssm"].Mamba2


def test_the_package_import_reproducer_tells_the_bug_from_the_fix(releases, fake_tree):
    fake_tree()
    assert patches.reproduce_lazy() == BUG_REPRODUCED
    upstream.defer_package_init()
    assert patches.reproduce_lazy() == FIX_VALIDATED


def test_a_package_init_that_imports_nothing_retires_the_deferral(tmp_path):
    pkg = tmp_path / "mamba_ssm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('__version__ = "9"\ndef __getattr__(name):\n    import importlib\n'
                                     '    return importlib.import_module("mamba_ssm.modules")\n')
    assert upstream.package_init_imports(pkg) == []
    (pkg / "__init__.py").write_text("try:\n    from .models import X\nexcept ImportError:\n    import os\n"
                                     "if True:\n    import mamba_ssm.ops.a, json\nclass C:\n    import sys\n")
    assert upstream.package_init_imports(pkg) == ["mamba_ssm.models", "mamba_ssm.models.X", "os", "mamba_ssm.ops.a",
                                                  "json"]


def test_patches_declare_reproducers_and_retirement():
    for p in patches.make_patches().values():
        assert p.reproduce is not None and p.retire_when and p.target == "mamba-ssm"
    assert [p.needs_gpu for p in patches.make_patches().values()] == [False, False, True, True, True, True]


# --- the grouped reduction -----------------------------------------------------------------------------
@pytest.mark.parametrize("h, g", [(8, 2), (8, 1), (8, 8), (6, 3)])
def test_reduce_groups_equals_autograd_through_expand_and_bias(h, g):
    """The kernel's per-head gradient of (input expanded to heads + bias), reduced, must equal what autograd
    gives the [b, l, r, g, n] input and the [h, r, n] bias."""
    torch.manual_seed(h * 10 + g)
    b, l, r, n = 2, 5, 3, 4
    x = torch.randn(b, l, r, g, n, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(h, r, n, dtype=torch.float64, requires_grad=True)
    per_head = x.unsqueeze(4).expand(b, l, r, g, h // g, n).reshape(b, l, r, h, n) + bias.transpose(0, 1)
    upstream_grad = torch.randn(b, l, r, h, n, dtype=torch.float64)  # what the kernel would write per head
    (per_head * upstream_grad).sum().backward()
    d_bias, d_x = mimo.reduce_groups(upstream_grad, g)
    torch.testing.assert_close(d_bias.double(), bias.grad, rtol=1e-6, atol=1e-6)  # fp32 accumulation
    torch.testing.assert_close(d_x, x.grad, rtol=1e-12, atol=1e-12)
    assert d_bias.dtype == torch.float32 and d_x.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_reduce_groups_equals_the_eager_one(dtype):
    """``mamba-ssm.group_sums=compiled``: the group and bias sums under inductor against the eager function on fresh
    random inputs at NAM56R's ratio of 16 heads per group: the fp32 bias gradient within 1e-5 (max error over max value: fp32
    additions in another order), the group gradient within 1e-5 in fp32 and one bf16 rounding (2**-7 relative
    L2) in bf16."""
    from nam56r.regions import Region
    from nam_core.testing import max_rel_error, new_seed, rel_norm_error

    assert isinstance(mimo.COMPILED_REDUCE, Region) and mimo.COMPILED_REDUCE.fn is mimo.reduce_groups  # compiled
    seed = new_seed()
    d = torch.randn(2, 24, 2, 32, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)  # [b, l, r, h, n]
    (bias, grouped), (want_bias, want_grouped) = mimo.COMPILED_REDUCE(d, 2), mimo.reduce_groups(d, 2)
    assert bias.dtype == torch.float32 and grouped.dtype == dtype and grouped.shape == (2, 24, 2, 2, 8)
    assert max_rel_error(bias, want_bias) < 1e-5, seed
    err = max_rel_error(grouped, want_grouped) if dtype == torch.float32 else rel_norm_error(grouped, want_grouped)
    assert err < (1e-5 if dtype == torch.float32 else 2**-7), (err, seed)


def test_the_run_chooses_the_backward_group_sums_from_the_option_or_the_model():
    from nam56r.backends import BackendContext
    from nam_core.options import OptionValues
    from nam_plugin_mamba_ssm.group_sums import fused_reduce_groups
    from nam_plugin_mamba_ssm.scan import MambaSSMScan

    cfg = get_recipe("nam56r").model
    glue = cfg.replace(compile_glue=True)
    try:
        for model, option, want in ((cfg, None, fused_reduce_groups), (glue, None, fused_reduce_groups),
                                    (glue, "eager", mimo.reduce_groups), (cfg, "fused", fused_reduce_groups),
                                    (cfg, "compiled", mimo.COMPILED_REDUCE)):
            options = {} if option is None else {"mamba-ssm": OptionValues("mamba-ssm", {"group_sums": option})}
            MambaSSMScan.build(BackendContext(model=model, options=options))
            assert mimo._reduce is want, (model.compile_glue, option)
        with pytest.raises(ValueError, match="expected one of eager, compiled, fused"):
            mimo.use_group_sums("atomic")
    finally:
        mimo.use_group_sums("eager")


FUSED_SUMS = """
import json, torch
from nam_core.testing import max_rel_error, rel_norm_error
from nam_plugin_mamba_ssm import mimo
from nam_plugin_mamba_ssm.group_sums import fused_reduce_groups
seed = int(__import__("sys").argv[1])
out = {}
# 600 tokens: a whole chunk of TILE's 512 and a ragged one; 6 heads in 3 groups and n 5: padded, masked tiles
# (the second tile: 5 chunks of 128 tokens in 2-token steps, 2 warps, 2 stages; the sweep's other end)
for dtype, shape, g in ((torch.float32, (2, 300, 2, 32, 8), 2), (torch.bfloat16, (1, 7, 3, 6, 5), 3)):
    d = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    want_bias, want_grouped = mimo.reduce_groups(d, g)
    for tile in (None, (128, 2, 2, 2)):
        bias, grouped = fused_reduce_groups(d, g, tile=tile)
        assert bias.shape == want_bias.shape and bias.dtype == torch.float32
        assert grouped.shape == want_grouped.shape and grouped.dtype == dtype
        key = f"{dtype} {tile}"
        out[key] = [max_rel_error(bias, want_bias), rel_norm_error(grouped, want_grouped)]
print(json.dumps(out))
"""


def test_fused_group_sums_kernel_equals_reduce_groups_in_the_interpreter():
    """``group_sums.fused_reduce_groups`` (one read of the per-head gradient, Triton) under ``TRITON_INTERPRET=1``
    against the eager ``reduce_groups`` on fresh random inputs: the fp32 bias within 1e-5 (max error over max
    value) and the group sums within 1e-6 in fp32, 2**-7 relative L2 in bf16 (one rounding, fp32 additions in
    another order)."""
    import os
    import subprocess

    from nam_core.testing import new_seed

    pytest.importorskip("triton")
    seed = new_seed()
    done = subprocess.run([sys.executable, "-c", FUSED_SUMS, str(seed)], env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(errors) == 4, errors
    for key, (bias_err, grouped_err) in errors.items():
        assert bias_err < 1e-5 and grouped_err < (1e-6 if "float32" in key else 2**-7), (key, errors, seed)


@pytest.mark.parametrize("tile", [(100, 4, 4, 1), (256, 3, 4, 1), (128, 256, 4, 1)])
def test_fused_group_sums_refuse_a_tile_the_kernel_cannot_step_through(tile):
    """``fused_reduce_groups(tile=)``: CHUNK and BT powers of two, BT dividing CHUNK, or a ValueError before any
    launch (a ragged step would skip tokens of every chunk)."""
    from nam_plugin_mamba_ssm.group_sums import fused_reduce_groups

    with pytest.raises(ValueError, match="powers of two with BT dividing CHUNK"):
        fused_reduce_groups(torch.randn(1, 8, 2, 4, 8), 2, tile=tile)


def test_reduce_groups_refuses_a_ragged_split():
    with pytest.raises(ValueError, match="6 heads do not split into 4 groups"):
        mimo.reduce_groups(torch.zeros(1, 1, 1, 6, 2), 4)


# --- the drivers' kernel calls against the kernels' declared signatures --------------------------------
B, S, R, G, H, N, P, CH, DIV = 2, 40, 4, 2, 4, 16, 8, 8, 4
NC = -(-S // CH)
BF, F32 = torch.bfloat16, torch.float32
# Shapes and dtypes of every argument the TileLang prim_funcs declare, in order (mamba-ssm 2.3.2.post1,
# mamba3_mimo_fwd.py and mamba3_mimo_bwd.py), at the sizes above; None = optional output passed as None.
FWD_SIGNATURE = [
    ((B, S, R, G, N), BF), ((B, S, R, G, N), BF), ((B, S, H, P), BF), ((B, S, H, P), BF),  # Q K V O
    ((H, R, N), F32), ((H, R, N), F32), ((H, R, P), F32), ((H, R, P), F32),  # Q_BIAS K_BIAS MIMO_V MIMO_O
    ((B, S, H, P), BF), ((H,), F32), ((H, R, P), F32), ((B, S, H, N // DIV), F32),  # Z D MIMO_Z ANGLES
    ((B, H, S), F32), ((B, H, S), F32), ((B, H, S), F32), ((B, H, S), BF),  # DA_CS DA_CS_REV DT TRAP
    ((B, H, NC, CH, CH), F32), None, None,  # SEGSUM FINAL_STATE FINAL_K
]
BWD_FWD_SIGNATURE = [
    ((B, S, H, P), BF), ((B, S, R, G, N), BF), ((B, S, R, G, N), BF), ((B, S, H, P), BF),  # DOUT Q K V
    ((H, R, N), F32), ((H, R, N), F32), ((H, R, P), F32), ((H, R, P), F32),  # biases, MIMO_V MIMO_O
    ((B, H, R, P), F32), ((B, H, NC, N, P), BF),  # DMIMO_O STATES
    ((B, S, H, P), BF), ((H, R, P), F32), ((B, S, H, P), BF), ((B, H, R, P), F32),  # Z MIMO_Z DZ DMIMO_Z
    ((B, S, H, N // DIV), F32), ((B, H, S), F32), ((B, H, S), F32), ((B, H, S), F32),  # ANGLES DA_CS(_REV) DT
    ((B, H, S), BF), ((H,), F32), ((B, H, S, R, R), BF), ((B, H, NC, CH, CH), F32),  # TRAP D QK_DOT SEGSUM
]
BWD_BWD_SIGNATURE = [
    ((B, S, H, P), BF), ((B, S, R, G, N), BF), ((B, S, R, G, N), BF), ((B, S, H, P), BF),  # DOUT Q K V
    ((H, R, N), F32), ((H, R, N), F32), ((H, R, P), F32), ((H, R, P), F32),  # biases, MIMO_V MIMO_O
    ((B, S * R, H, N), BF), ((B, S, H, P), BF), ((B, H, R, P), F32), ((B, H, NC, N, P), BF),  # DK DV DMIMO_V STATES
    ((B, S * R, H, N), BF), ((B, S, H, P), BF), ((H, R, P), F32), ((B, S, H, N // DIV), F32),  # DQ Z MIMO_Z ANGLES
    ((B, H, S), F32), ((B, H, S), F32), ((B, H, S), F32), ((B, H, S), BF),  # DA_CS DA_CS_REV DT TRAP
    ((B, H, S), F32), ((B, H, S), F32), ((B, S, H, N // DIV), F32), ((H,), F32), ((B, H), F32),  # DFACTOR DGAMMA DANGLES D DD
    ((B, H, S, R, R), BF), ((B, H, S), F32), ((B, H, NC, CH, CH), F32), ((B, H, S), F32), ((B, H, S), F32),
    ((B, H, NC, CH, CH), F32),  # QK_DOT DDA DSSDA DDA_CS_REV DDA_CS SEGSUM
]


class SignatureKernel:
    """Stands in for a compiled TileLang kernel: checks each argument against the declared signature, and fills
    the per-head dQ / dK it is given with known values (bwd_bwd)."""

    def __init__(self, signature, name):
        self.signature, self.name, self.calls = signature, name, 0

    def __call__(self, *args):
        assert len(args) == len(self.signature), (self.name, len(args))
        for i, (arg, want) in enumerate(zip(args, self.signature)):
            if want is None:
                assert arg is None, (self.name, i)
                continue
            assert (tuple(arg.shape), arg.dtype) == want, (self.name, i, tuple(arg.shape), arg.dtype, want)
        if self.name == "bwd_bwd":
            args[8].copy_(torch.arange(args[8].numel()).view_as(args[8]) % 7)  # DK per head
            args[12].fill_(1.0)  # DQ per head
        self.calls += 1


@pytest.fixture
def signature_kernels(monkeypatch):
    kernels = mimo.Kernels(SignatureKernel(FWD_SIGNATURE, "fwd"), SignatureKernel(BWD_FWD_SIGNATURE, "bwd_fwd"),
                           SignatureKernel(BWD_BWD_SIGNATURE, "bwd_bwd"))
    keys = []
    monkeypatch.setattr(mimo, "compiled", lambda *key: keys.append(key) or kernels)
    utils = types.SimpleNamespace(
        bwd_dtrap_ddt_triton=lambda trap, dt, dfactor, dgamma, chunk: (torch.zeros_like(dt), torch.zeros_like(dt)),
        bwd_dadt_fused_triton=lambda *a: torch.ones(B, H, S))
    monkeypatch.setattr(upstream, "load", lambda name: utils)
    return kernels, keys


def driver_inputs():
    g = torch.Generator().manual_seed(3)
    t = lambda *shape, dtype=F32: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    return dict(q=t(B, S, R, G, N, dtype=BF), k=t(B, S, R, G, N, dtype=BF), v=t(B, S, H, P, dtype=BF),
                q_bias=t(H, R, N), k_bias=t(H, R, N), mimo_v=t(H, R, P), mimo_o=t(H, R, P), z=t(B, S, H, P, dtype=BF),
                D=t(H), mimo_z=t(H, R, P), angles=t(B, S, H, N // DIV), dA_cs=t(B, H, S), dA_cs_rev=t(B, H, S),
                dt=t(B, H, S), trap=t(B, H, S, dtype=BF), segsum=t(B, H, NC, CH, CH))


def test_forward_driver_calls_the_kernel_with_its_declared_signature(signature_kernels):
    kernels, keys = signature_kernels
    x = driver_inputs()
    out, state, final_k = mimo.forward(x["q"], x["k"], x["v"], x["q_bias"], x["k_bias"], x["mimo_v"], x["mimo_o"],
                                       x["z"], x["D"], x["mimo_z"], x["angles"], x["dA_cs"], x["dA_cs_rev"], x["dt"],
                                       x["trap"], x["segsum"], chunk_size=CH, rotary_dim_divisor=DIV, dtype=BF)
    assert (tuple(out.shape), out.dtype, state, final_k) == ((B, S, H, P), BF, None, None)
    assert kernels.fwd.calls == 1 and keys == [(mimo.Dims(B, S, H, G), N, P, R, True, True, True, CH, DIV,
                                                "bfloat16", False, mimo.Stages(0, 0, 0))]


def test_backward_driver_signatures_and_grouped_reduction(signature_kernels):
    kernels, keys = signature_kernels
    x = driver_inputs()
    dout = torch.randn(B, S, H, P).to(BF)
    grads = mimo.backward(dout, x["q"], x["k"], x["v"], x["q_bias"], x["k_bias"], x["mimo_v"], x["mimo_o"], x["z"],
                          x["mimo_z"], x["angles"], x["dA_cs"], x["dA_cs_rev"], x["dt"], x["trap"], x["D"],
                          x["segsum"], CH, DIV, BF)
    assert (kernels.bwd_fwd.calls, kernels.bwd_bwd.calls) == (1, 1)
    dq, dk, dv, d_adt, d_dt, d_trap, dq_bias, dk_bias, dmimo_v, dmimo_z, dmimo_o, d_angles, dD, dz = grads
    # Upstream's autograd function returns these as the gradients of its inputs: shapes must be the inputs'.
    for grad, like in ((dq, x["q"]), (dk, x["k"]), (dv, x["v"]), (dq_bias, x["q_bias"]), (dk_bias, x["k_bias"]),
                       (dmimo_v, x["mimo_v"]), (dmimo_z, x["mimo_z"]), (dmimo_o, x["mimo_o"]), (dD, x["D"]),
                       (dz, x["z"]), (d_angles, x["angles"]), (d_dt, x["dt"]), (d_adt, x["dt"])):
        assert grad.shape == like.shape
    heads_per_group = H // G
    assert torch.equal(dq, torch.full_like(dq, heads_per_group))  # each group sums its heads' ones
    assert torch.equal(dq_bias, torch.full((H, R, N), float(B * S)))  # per head: summed over batch and time
    dk_heads = (torch.arange(B * S * R * H * N) % 7).view(B, S, R, H, N).to(BF)
    assert torch.equal(dk, dk_heads.view(B, S, R, G, heads_per_group, N).float().sum(4).to(BF))
    assert torch.equal(d_adt, torch.ones(B, H, S))  # the Triton post-pass is added to the kernel's dA


def test_both_drivers_build_at_the_modules_pipelining_depths(signature_kernels, monkeypatch):
    """``mimo.STAGES`` is read at call time and is part of the build key, so a depth set by bench/mimo_stages.py
    (or a future default) reaches the forward and the backward kernels alike, never a kernel of another depth."""
    _kernels, keys = signature_kernels
    monkeypatch.setattr(mimo, "STAGES", mimo.Stages(fwd=2, bwd_fwd=1, bwd_bwd=0))
    x = driver_inputs()
    mimo.forward(x["q"], x["k"], x["v"], x["q_bias"], x["k_bias"], x["mimo_v"], x["mimo_o"], x["z"], x["D"],
                 x["mimo_z"], x["angles"], x["dA_cs"], x["dA_cs_rev"], x["dt"], x["trap"], x["segsum"], chunk_size=CH,
                 rotary_dim_divisor=DIV, dtype=BF)
    mimo.backward(torch.randn(B, S, H, P).to(BF), x["q"], x["k"], x["v"], x["q_bias"], x["k_bias"], x["mimo_v"],
                  x["mimo_o"], x["z"], x["mimo_z"], x["angles"], x["dA_cs"], x["dA_cs_rev"], x["dt"], x["trap"],
                  x["D"], x["segsum"], CH, DIV, BF)
    assert [key[-1] for key in keys] == [mimo.Stages(2, 1, 0)] * 2
    assert [key[0] for key in keys] == [mimo.Dims(B, S, H, G)] * 2  # both passes build for the call's sizes
    with pytest.raises(ValueError, match="num_stages=1"):  # a caller's own request is refused, not obeyed
        mimo.forward(x["q"], x["k"], x["v"], x["q_bias"], x["k_bias"], x["mimo_v"], x["mimo_o"], x["z"], x["D"],
                     x["mimo_z"], x["angles"], x["dA_cs"], x["dA_cs_rev"], x["dt"], x["trap"], x["segsum"],
                     chunk_size=CH, rotary_dim_divisor=DIV, dtype=BF, num_stages=1)


class FakeTileLang:
    """Upstream's three kernel factories and ``tilelang.language.dynamic``, recording what they are built with."""

    def __init__(self):
        self.builds = []
        self.dynamic = lambda name: f"dynamic {name}"
        self.mamba_mimo_fwd = lambda *a, **kw: self.builds.append(("fwd", a[:4])) or "fwd"
        self.mamba_mimo_bwd_fwd = lambda *a: self.builds.append(("bwd_fwd", a[:4])) or "bwd_fwd"
        self.mamba_mimo_bwd_bwd = lambda *a: self.builds.append(("bwd_bwd", a[:4])) or "bwd_bwd"


@pytest.fixture
def fake_tilelang(monkeypatch):
    fake = FakeTileLang()
    monkeypatch.setattr(upstream, "load", lambda name: fake)
    monkeypatch.setattr(mimo, "STATIC", True)
    mimo._build.cache_clear()
    yield fake
    mimo._build.cache_clear()


def build(dims, chunk=CH):
    return mimo.compiled(dims, N, P, R, True, True, True, chunk, DIV, "bfloat16", False, mimo.Stages())


def test_kernels_build_once_per_exact_shape_and_say_so_once(fake_tilelang, capsys):
    build(mimo.Dims(2, 4096, 128, 8))
    build(mimo.Dims(2, 4096, 128, 8))  # the same shape: the kept kernels, no build, no second line
    assert fake_tilelang.builds == [(k, (2, 4096, 128, 8)) for k in ("fwd", "bwd_fwd", "bwd_bwd")]
    log = capsys.readouterr().err
    assert log.count("building the Mamba-3 MIMO kernels for batch 2 x 4096 tokens, 128 heads in 8 groups") == 1
    assert "about 3 minutes" in log and log.count("built the Mamba-3 MIMO kernels") == 1
    build(mimo.Dims(1, 4096, 128, 8))  # another batch is another build: the sizes are compiled in
    assert fake_tilelang.builds[-1] == ("bwd_bwd", (1, 4096, 128, 8))


def test_kept_kernel_sets_are_bounded(fake_tilelang):
    for b in range(mimo.KEEP + 1):
        build(mimo.Dims(b + 1, 64, 4, 2))
    build(mimo.Dims(1, 64, 4, 2))  # the oldest was dropped to keep KEEP sets: built again
    assert len(fake_tilelang.builds) == 3 * (mimo.KEEP + 2)
    assert mimo._build.cache_info().currsize == mimo.KEEP


def test_unpatched_drivers_build_as_upstream_does(fake_tilelang, monkeypatch):
    """Before the static-shapes patch, on a 2.3.2.post1-like upstream: its dynamic kernels, once for every shape
    (the baseline of bench/mimo_scan.py); on an upstream that builds exact sizes itself, exact sizes."""
    monkeypatch.setattr(mimo, "STATIC", False)
    monkeypatch.setattr(mimo, "upstream_builds_dynamic", lambda: True)
    build(mimo.Dims(2, 4096, 128, 8))
    build(mimo.Dims(1, 1024, 16, 2))
    assert fake_tilelang.builds == [(k, ("dynamic B", "dynamic S", "dynamic H", "dynamic G"))
                                    for k in ("fwd", "bwd_fwd", "bwd_bwd")]
    monkeypatch.setattr(mimo, "upstream_builds_dynamic", lambda: False)
    build(mimo.Dims(1, 1024, 16, 2))
    assert fake_tilelang.builds[-1] == ("bwd_bwd", (1, 1024, 16, 2))


# --- the scan's argument mapping against upstream's entry points ----------------------------------------
def scan_inputs(r, h=8, g=2, n=16, p=8, l=24, b=2, angles=4):
    x = selftest.random_inputs(b, l, h, g, n, p, r, device="cpu", seed=11)
    x["angles"] = x["angles"][..., :1].expand(b, l, h, angles)  # the mixer's broadcast view
    x["adt"], x["dt"], x["trap"] = (x[k].transpose(1, 2).contiguous().transpose(1, 2) for k in ("adt", "dt", "trap"))
    for k in ("q", "k", "v", "z", "trap"):
        x[k] = x[k].to(BF)
    return x


def test_siso_arguments_follow_mamba3_siso_combined():
    x = scan_inputs(1)
    args = siso_args(**{k: x[k] for k in selftest.INPUT_NAMES if not k.startswith("mimo")})
    q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z = args
    assert (q.shape, k.shape, q_bias.shape, k_bias.shape) == ((2, 24, 2, 16), (2, 24, 2, 16), (8, 16), (8, 16))
    assert (v.shape, z.shape, adt.shape, trap.shape, angles.shape) == ((2, 24, 8, 8), (2, 24, 8, 8), (2, 8, 24),
                                                                       (2, 8, 24), (2, 24, 8, 4))
    assert [t.dtype for t in args] == [BF, BF, BF, F32, F32, BF, F32, F32, BF, F32, BF]
    assert all(t.is_contiguous() for t in args)
    # each slot holds its own input's values (the same-shaped pairs q/k, adt/dt/trap, the biases, v/z are
    # distinct random draws, so a swap shows here)
    sources = [x["q"][:, :, 0], x["k"][:, :, 0], x["v"], x["adt"], x["dt"], x["trap"], x["q_bias"][:, 0],
               x["k_bias"][:, 0], x["angles"], x["d"], x["z"]]
    assert [torch.equal(t, s.to(t.dtype)) for t, s in zip(args, sources)] == [True] * 11


def test_mimo_arguments_follow_mamba3_mimo():
    x = scan_inputs(4, n=16, angles=4)
    args = mimo_args(**{k: x[k] for k in selftest.INPUT_NAMES}, chunk_size=8)
    (q, k, v, adt, dt, trap, q_bias, k_bias, mimo_x, mimo_z, mimo_o, angles, d, z, chunk, divisor, dtype) = args
    assert (q.shape, q_bias.shape, mimo_x.shape, angles.shape) == ((2, 24, 4, 2, 16), (8, 4, 16), (8, 4, 8),
                                                                   (2, 24, 8, 4))
    assert (chunk, divisor, dtype) == (8, 4, BF)
    tensors = args[:14]
    assert [t.dtype for t in tensors] == [BF, BF, BF, F32, F32, BF, F32, F32, F32, F32, F32, F32, F32, BF]
    assert all(t.is_contiguous() for t in tensors)
    names = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "mimo_x", "mimo_z", "mimo_o", "angles", "d", "z")
    assert [torch.equal(t, x[n].to(t.dtype)) for t, n in zip(tensors, names)] == [True] * 14  # each in its slot


@pytest.mark.parametrize("l", [37, 48])
def test_zero_padding_to_whole_chunks_leaves_the_real_positions_exact(l):
    """MIMO's ragged lengths: the scan pads at the end (upstream's backward needs whole chunks). On the
    reference scan, the padded run sliced back must equal the unpadded run, output and every gradient."""
    from nam56r.reference.mamba3 import ReferenceSSMScan
    from nam_plugin_mamba_ssm.scan import pad_to_chunks

    x = selftest.random_inputs(2, l, 4, 2, 16, 8, 4, device="cpu", seed=selftest.new_seed())
    x = {k: None if t is None else t.double() for k, t in x.items()}
    dout = torch.randn(2, l, 4, 8, dtype=torch.float64)
    per_token = ("q", "k", "v", "adt", "dt", "trap", "angles", "z")
    results = []
    for padded in (False, True):
        leaves = {k: None if t is None else t.clone().requires_grad_() for k, t in x.items()}
        args = dict(leaves)
        if padded:
            args.update(zip(per_token, pad_to_chunks(*(leaves[k] for k in per_token), chunk_size=16)))
            assert args["v"].shape[1] == -(-l // 16) * 16 and args["adt"].shape[2] == args["v"].shape[1]
        y = ReferenceSSMScan()(*(args[k] for k in selftest.INPUT_NAMES), chunk_size=16)[:, :l]
        y.backward(dout)
        results.append((y.detach(), {k: t.grad for k, t in leaves.items() if t is not None}))
    (y0, g0), (y1, g1) = results
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-10, atol=1e-12, msg=k)


def test_rotary_divisor_follows_the_rope_fraction():
    assert (rotary_divisor(128, 32), rotary_divisor(128, 64)) == (4, 2)
    with pytest.raises(NamError, match="got 16 angles"):
        rotary_divisor(128, 16)


def test_the_scan_refuses_cpu_tensors():
    from nam_plugin_mamba_ssm.scan import MambaSSMScan

    x = scan_inputs(4)
    with pytest.raises(NamError, match="CUDA tensors only"):
        MambaSSMScan()(*(x[k] for k in selftest.INPUT_NAMES), chunk_size=8)


# --- the parity harness --------------------------------------------------------------------------------
def test_harness_finds_the_step_oracle_equal_to_the_chunked_reference():
    from nam56r.reference.mamba3 import mamba3_step_scan

    errors = selftest.compare(mamba3_step_scan, 1, 37, 4, 2, 16, 8, 4, chunk_size=8, device="cpu",
                              dtype=torch.float32)
    assert set(errors) == {"out", "seed"} | {f"d{k}" for k in selftest.INPUT_NAMES}
    assert selftest.worst(errors) < 1e-4, errors


def test_harness_catches_a_scan_that_drops_the_skip_term():
    from nam56r.reference.mamba3 import ReferenceSSMScan

    ref = ReferenceSSMScan()

    def no_skip(*args, chunk_size):
        args = list(args)
        args[9] = args[9] * 0  # D
        return ref(*args, chunk_size=chunk_size)

    errors = selftest.compare(no_skip, 1, 32, 4, 2, 16, 8, 4, chunk_size=8, device="cpu", dtype=torch.float32)
    assert errors["dd"] > 0.5 and selftest.worst(errors) > selftest.TOLERANCE


def test_one_group_harness_checks_a_full_size_launch_on_group_0():
    """The launch at a run's size compares on group 0 only: a scan that is right there (the step oracle, run on
    all three groups) passes, so groups are independent as ``first_group`` says; one that is wrong in a head
    of group 0 is caught, and one wrong only outside group 0 is not (what the view cannot see, by design)."""
    from nam56r.reference.mamba3 import mamba3_step_scan

    h, g = 6, 3

    def bumped(heads):
        def scan(*args, chunk_size):
            out = mamba3_step_scan(*args, chunk_size=chunk_size)
            return out + 1e-1 * out.detach().abs().amax() * (torch.arange(h) == heads).float()[:, None]
        return scan

    def errors(scan):
        return selftest.compare(scan, 2, 19, h, g, 16, 8, 4, chunk_size=8, device="cpu", dtype=torch.float32,
                                one_group=True)

    right = errors(mamba3_step_scan)
    assert set(right) == {"out", "seed"} | {f"d{k}" for k in selftest.INPUT_NAMES}
    assert selftest.worst(right) < 1e-4, right
    assert errors(bumped(1))["out"] > 5e-2
    assert errors(bumped(h - 1))["out"] < 1e-4


def test_preflight_launches_at_the_runs_own_kernel_size():
    from nam_plugin_mamba_ssm import preflight

    spec = apply_overrides(get_recipe("nam56r"), ["train.micro_batch_size=4"])
    assert preflight._run_dims(spec) == (4, 4096, 128, 8)


def test_harness_inputs_are_fresh_and_rounded_like_the_kernels_read_them():
    a = selftest.random_inputs(1, 8, 4, 2, 16, 8, 4, device="cpu", seed=selftest.new_seed())
    b = selftest.random_inputs(1, 8, 4, 2, 16, 8, 4, device="cpu", seed=selftest.new_seed())
    assert not torch.equal(a["q"], b["q"])
    for k in ("q", "k", "v", "z", "trap", "angles"):
        assert torch.equal(a[k], a[k].to(BF).float()), k
    assert (a["dt"] >= 1e-3).all() and (a["dt"] <= 1e-1).all() and (a["adt"] < 0).all()


def test_nam_patches_lists_the_three_entries_with_their_state(releases, fake_tree, capsys):
    fake_tree()
    assert run(["patches", "--plugins", "mamba-ssm", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["patches"]}
    assert {name: row["state"] for name, row in rows.items()} == dict.fromkeys(patches.NAMES, NEEDED)
    assert "PR #967" in rows[patches.GROUPED]["retire_when"]


@pytest.mark.parametrize("fixed", [False, True])
def test_detection_reads_the_installed_source_not_the_version(fake_tree, fixed):
    root = fake_tree(fixed=fixed)
    assert upstream.imports_extension_unguarded(root / "mamba_ssm") is (not fixed)
    assert upstream.has_grouped_backward(root / "mamba_ssm") is fixed


class _UnpacksTwice(torch.autograd.Function):
    """The shape of upstream's MIMO autograd function's flaw: its backward reads ``ctx.saved_tensors`` twice."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return (x * w).tanh()

    @staticmethod
    def backward(ctx, dout):
        if len(ctx.saved_tensors) == 0:
            raise RuntimeError("forward ran without grad")
        x, w = ctx.saved_tensors
        d = dout * (1 - (x * w).tanh() ** 2)
        return d * w, (d * x).sum(0)


def test_saved_once_lets_non_reentrant_checkpointing_run_a_backward_that_unpacks_twice():
    """train.recompute=mamba wraps the mixer in torch.utils.checkpoint (non-reentrant), which refuses a second
    unpack of a saved tensor; the patch runs the backward on a context that unpacks once: same gradients."""
    from torch.utils.checkpoint import CheckpointError, checkpoint

    from nam_plugin_mamba_ssm import patches

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 5, generator=g, requires_grad=True), torch.randn(5, generator=g, requires_grad=True)
    want = torch.autograd.grad(_UnpacksTwice.apply(x, w).square().sum(), (x, w))

    def checkpointed():
        out = checkpoint(_UnpacksTwice.apply, x, w, use_reentrant=False)
        return torch.autograd.grad(out.square().sum(), (x, w))

    assert patches.unpacks_twice(_UnpacksTwice)
    with pytest.raises(CheckpointError, match="already unpacked once"):
        checkpointed()
    patches.apply_saved_once(_UnpacksTwice)
    try:
        assert not patches.unpacks_twice(_UnpacksTwice)
        got = checkpointed()
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        patches.apply_saved_once(_UnpacksTwice)  # idempotent
    finally:
        patches.revert_saved_once(_UnpacksTwice)
    assert patches.unpacks_twice(_UnpacksTwice)


def test_forward_driver_skips_the_kernel_when_its_output_is_unused(signature_kernels):
    """``output_unused`` (the mamba-scan replay): the output is allocated with its shape and dtype, the forward
    kernel is not launched, a forward asking for its final state is refused, and the flag ends with the block."""
    kernels, _ = signature_kernels
    x = driver_inputs()
    args = (x["q"], x["k"], x["v"], x["q_bias"], x["k_bias"], x["mimo_v"], x["mimo_o"], x["z"], x["D"], x["mimo_z"],
            x["angles"], x["dA_cs"], x["dA_cs_rev"], x["dt"], x["trap"], x["segsum"])
    with mimo.output_unused():
        out, state, final_k = mimo.forward(*args, chunk_size=CH, rotary_dim_divisor=DIV, dtype=BF)
        with pytest.raises(ValueError, match="final state"):
            mimo.forward(*args, chunk_size=CH, rotary_dim_divisor=DIV, dtype=BF, return_state=True)
    assert (tuple(out.shape), out.dtype, state, final_k, kernels.fwd.calls) == ((B, S, H, P), BF, None, None, 0)
    mimo.forward(*args, chunk_size=CH, rotary_dim_divisor=DIV, dtype=BF)
    assert kernels.fwd.calls == 1
