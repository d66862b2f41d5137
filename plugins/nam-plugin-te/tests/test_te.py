"""te on the CPU, where Transformer Engine is not installed: the plugin declares and refuses cleanly (the package
row, the CPU and GB10 capability rows, a broken TE install as a failed row with the exception's text), the
config rows, and the swap with a stand-in TE whose ``Linear`` is torch's own and whose ``autocast`` records
that it was entered: the swap keeps every parameter, name and output, and FP8 enters the recipe's autocast in
each swapped module, recompute replays included. GPU parity against real TE: test_te_gpu.py."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from nam56r import recompute
from nam56r.model import build_model
from nam56r.recipes import get_recipe
from nam56r.run import spec_for
from nam56r.state import ForwardState
from nam_core.checks import config_rows
from nam_core.device import DeviceInfo
from nam_core.errors import ConfigError
from nam_core.host import PluginHost
from nam_plugin_te import linears, parity, plugin, recipes, selftest
from nam_plugin_te.linears import convert, dense_projections, te_modules

ALIGNED = "mamba_rope_fraction=1.0"
"""The tiny recipe's Mamba in_proj is 540 wide (2*128 + 2*128 + 3*8 + 4 angles); rope 1.0 gives 8 angles: 544."""
CUDA_BF16 = ("train.dtype=bfloat16", "attention_backend=reference")
TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None


class FakeTE:
    """``transformer_engine.pytorch`` as the swap uses it: ``Linear`` is torch's (same math, so outputs can be
    compared bit for bit), ``autocast`` records each entry's recipe and whether a GEMM ran inside it."""

    def __init__(self, quantize: bool = False):
        self.entries: list = []
        self.active = False
        self.calls: list[bool] = []  # per Linear forward: inside an autocast?
        fake = self

        class Linear(nn.Linear):
            def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
                super().__init__(in_features, out_features, bias=bias, dtype=params_dtype, device=device)

            def forward(self, x):
                fake.calls.append(fake.active)
                if quantize and fake.active:
                    return nn.functional.linear(_e4m3(x), _e4m3(self.weight))
                return super().forward(x)

        Linear.fuse_wgrad_accumulation = False  # TE's attribute, read at every forward
        self.Linear = Linear
        self.module = types.SimpleNamespace(base=types.SimpleNamespace(TransformerEngineBaseModule=Linear))

    @contextlib.contextmanager
    def autocast(self, enabled, recipe):
        self.entries.append(recipe)
        self.active, before = True, self.active
        try:
            yield
        finally:
            self.active = before


def _e4m3(t: torch.Tensor) -> torch.Tensor:
    """Per-tensor e4m3 rounding with a straight-through gradient: what an FP8 GEMM's operands lose."""
    scale = 448.0 / t.detach().abs().amax().clamp(min=1e-12)
    q = (t.detach() * scale).to(torch.float8_e4m3fn).to(t.dtype) / scale
    return t + (q - t).detach()


def _tiny(aligned: bool = True):
    model = get_recipe("nam56r-tiny").model
    return model.replace(mamba_rope_fraction=1.0) if aligned else model


def _small():
    """The tiny model cut to 14 layers (every kind) and rows of 32, to stay cheap on 2 cores."""
    return _tiny().replace(seq_len=32, num_layers=14, mla_attention_ranks=(0,))


def _batch(cfg, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    return {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(2, cfg.seq_len)}


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, state=ForwardState(micro_batch=0, seq_layout=tuple(batch["tokens"].shape)))
    out["loss"].backward()
    return out["loss"].detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# --- the swap -------------------------------------------------------------------------------------------


def test_selection_is_every_dense_projection_and_nothing_else():
    model = build_model(_tiny(), device="meta")
    chosen = dense_projections(model)
    by_part = {}
    for p in chosen:
        by_part[p.part] = by_part.get(p.part, 0) + 1
    assert by_part == {"attention": 75, "shared expert": 44, "mamba": 34, "mtp": 6}, by_part
    picked = {p.name for p in chosen}
    left = {n.split(".", 2)[-1] if n.startswith(("layers", "mtp")) else n
            for n, m in model.named_modules() if type(m) is nn.Linear and n not in picked}
    kept = {"mixer.router", "mixer.indexer.wq_b", "mixer.indexer.wk", "mixer.indexer.weights_proj", "ngram.out_proj"}
    assert left == kept, left  # the router and the indexer pick by score, the n-gram projection is tiny


def test_swap_keeps_every_parameter_name_and_output():
    """The same model before and after the swap (stand-in TE = torch's Linear): the same Parameter objects under
    the same names, and loss and every gradient bit-identical."""
    cfg = _small()
    torch.manual_seed(0)
    model = build_model(cfg)
    batch = _batch(cfg)
    before = dict(model.named_parameters())
    loss0, grads0 = _loss_and_grads(model, batch)
    fake = FakeTE()
    line = convert(model, "off", te=fake)
    assert line.startswith("te: 56 nn.Linear -> Transformer Engine Linear (bf16): attention 30, shared expert 12, "
                           "mamba 8, mtp 6;"), line
    after = dict(model.named_parameters())
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    assert len(te_modules(model)) == 56 and not fake.entries  # bf16: no autocast
    loss1, grads1 = _loss_and_grads(model, batch)
    assert torch.equal(loss0, loss1)
    assert grads1.keys() == grads0.keys() and all(torch.equal(grads1[n], grads0[n]) for n in grads0)
    assert convert(model, "off", te=fake).startswith("te: 0 nn.Linear")  # a second swap finds nothing to swap


def test_fp8_runs_every_swapped_gemm_inside_the_recipes_autocast_recompute_replays_included():
    """Per-module autocast: each TE linear call, in forward and in the replay activation recompute runs inside
    backward, enters the autocast with the run's recipe once."""
    cfg = _small()
    counts = {}
    for kinds in ((), ("attention", "mamba")):
        torch.manual_seed(0)
        model = build_model(cfg)
        recompute.apply(model, kinds)
        fake, recipe = FakeTE(), object()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(recipes, "te_recipe", lambda name: recipe)
            convert(model, "current", te=fake)
        _loss_and_grads(model, _batch(cfg))
        assert fake.calls and all(fake.calls), "a TE GEMM ran outside its autocast"
        assert len(fake.entries) == len(fake.calls) and all(r is recipe for r in fake.entries)
        counts[kinds] = len(fake.calls)
    assert counts[("attention", "mamba")] > counts[()], counts  # the replays ran, and inside the autocast


def test_fp8_swap_refuses_a_projection_not_divisible_by_16():
    model = build_model(_tiny(aligned=False), device="meta")
    with pytest.raises(ValueError, match=r"te.fp8=current: dims not divisible by 16: .*in_proj \[64 -> 540\]"):
        convert(model, "current", te=FakeTE())
    assert te_modules(model) == []  # refused before anything was swapped


@pytest.mark.parametrize("engine", ["local", "megatron"])
def test_the_hook_swaps_and_fuses_wgrad_accumulation_on_the_megatron_engine_only(monkeypatch, engine):
    """Gradient-accumulation fusion writes into Megatron's ``main_grad``, which only the megatron engine has."""
    fake = FakeTE()
    monkeypatch.setattr(linears, "_te", lambda: fake)
    spec = spec_for("nam56r-tiny", ALIGNED, *CUDA_BF16, plugins=["te"], device="cuda", engine=engine)
    model = build_model(spec.model, device="meta")
    model.extra = fake.Linear(4, 4, bias=False, device="meta")  # stands for one of Megatron's TE modules
    line = plugin.nam_transform_model(model, spec)
    assert line.startswith("te: 159 nn.Linear -> Transformer Engine Linear (bf16)"), line
    assert len(te_modules(model)) == 159
    fused = [n for n, m in model.named_modules() if getattr(m, "fuse_wgrad_accumulation", False)]
    if engine == "megatron":
        assert len(fused) == 160 and "extra" in fused and line.endswith("in 160 TE modules"), line
    else:
        assert fused == [] and "fusion" not in line


# --- the megatron lowering ------------------------------------------------------------------------------


def test_the_megatron_lowering_takes_te_modules_and_fp8_from_the_plugins_options():
    from nam56r.megatron.lowering import TE_FP8_RECIPES
    from nam56r.run import lowering_for

    on = lowering_for(spec_for("nam56r-tiny", "te.fp8=current", "te.experts=grouped", plugins=["te"], device="cuda",
                               engine="megatron"))
    assert on.linears == "transformer_engine"
    args = on.config_args
    assert (args["fp8"], args["fp8_recipe"], args["moe_grouped_gemm"]) == ("hybrid", "tensorwise", True), args
    modules = {s.path: s.module for s in on.slots}
    assert modules["mamba_layer.submodules.norm"] == modules["final_norm"] == (
        "megatron.core.extensions.transformer_engine.TENorm")
    experts = modules["moe_layer.submodules.mlp.submodules.experts"]
    assert experts == "megatron.core.transformer.moe.experts.TEGroupedMLP", experts
    assert modules["output_layer"] == "megatron.core.tensor_parallel.layers.ColumnParallelLinear"  # the CE owns it
    bf16 = lowering_for(spec_for("nam56r-tiny", plugins=["te"], device="cuda", engine="megatron"))
    assert bf16.linears == "transformer_engine" and "fp8" not in bf16.config_args
    assert bf16.config_args["moe_grouped_gemm"] is False
    assert {s.path: s.module for s in bf16.slots}["moe_layer.submodules.mlp.submodules.experts"] == (
        "nam56r.backends.MoEExperts")
    off = lowering_for(spec_for("nam56r-tiny", device="cuda", engine="megatron"))
    assert off.linears == "local" and "fp8" not in off.config_args and off.config_args["moe_grouped_gemm"] is False
    gather = lowering_for(spec_for("nam56r-tiny", "te.fp8=delayed", "te.fp8_param_gather=true", plugins=["te"],
                                   device="cuda", engine="megatron"))
    assert gather.config_args["fp8_param"] is True and gather.config_args["fp8_recipe"] == "delayed"
    assert "fp8_param" not in args
    assert "moe_permute_fusion" not in args and "moe_router_fusion" not in bf16.config_args
    fused = lowering_for(spec_for("nam56r-tiny", "te.moe_fusion=true", plugins=["te"], device="cuda",
                                  engine="megatron")).config_args
    assert (fused["moe_permute_fusion"], fused["moe_router_fusion"]) == (True, True), fused
    # The plugin's recipe table and the lowering's agree on Megatron's name of each recipe.
    assert {n: r.megatron for n, r in recipes.RECIPES.items()} == TE_FP8_RECIPES


def test_fp8_param_gather_needs_the_megatron_engine_and_an_fp8_recipe():
    row = _rows("te.fp8=current", "te.fp8_param_gather=true", ALIGNED, *CUDA_BF16)["fp8_param_gather"]
    assert row.status == "fail" and row.found == "engine local, te.fp8=current", row
    with pytest.raises(ConfigError, match="te.fp8_param_gather keeps Megatron's TE weights in FP8"):
        spec_for("nam56r-tiny", "te.fp8_param_gather=true", plugins=["te"], device="cuda", engine="megatron")


def test_fp8_param_gather_is_refused_with_fused_master_weights():
    """TE's FusedAdam holding the masters of FP8 weights is not offered: the row names both settings."""
    meg = dict(engine="megatron")  # fused_master_weights is a megatron-engine field (the local engine refuses it)
    rows = _rows("te.fp8=current", "te.fp8_param_gather=true", "train.fused_master_weights=true", ALIGNED, *CUDA_BF16,
                 **meg)
    row = rows["fused_master_weights"]
    assert row.status == "fail" and "fused_master_weights=false" in row.hint, row
    assert "fused_master_weights" not in _rows("te.fp8=current", "train.fused_master_weights=true", ALIGNED, *CUDA_BF16,
                                               **meg)


def test_moe_fusion_is_refused_on_the_local_engine():
    row = _rows("te.moe_fusion=true", *CUDA_BF16)["moe_fusion"]
    assert row.status == "fail" and row.found == "engine local" and "moe_fusion=false" in row.hint, row
    assert "moe_fusion" not in _rows(*CUDA_BF16)


def test_fp8_param_gather_is_refused_with_bf16_gradient_buffers():
    """Measured on an H200: full NAM56R at MBS 2 with FP8 weights and bf16 gradient buffers went non-finite at
    step 1; the row refuses that pair before anything is built, and only that pair."""
    meg = dict(engine="megatron")
    spec = spec_for("nam56r-tiny", "te.fp8=current", "te.fp8_param_gather=true", "train.grad_reduce_in_fp32=false",
                    ALIGNED, *CUDA_BF16, plugins=["te"], device="cuda", profile="h200", **meg)
    rows = {r.name: r for r in plugin.nam_check_config(config=spec, device=spec.device)}
    row = rows["grad_reduce_in_fp32"]
    assert row.status == "fail" and row.found == "train.grad_reduce_in_fp32=false", row
    assert "grad_reduce_in_fp32=true" in row.hint and "fp8_param_gather=false" in row.hint
    fp32 = spec_for("nam56r-tiny", "te.fp8=current", "te.fp8_param_gather=true", ALIGNED, *CUDA_BF16, plugins=["te"],
                    device="cuda", profile="h200", **meg)
    assert "grad_reduce_in_fp32" not in {r.name for r in plugin.nam_check_config(config=fp32, device=fp32.device)}
    assert "grad_reduce_in_fp32" not in _rows("te.fp8=current", "train.grad_reduce_in_fp32=false", ALIGNED, *CUDA_BF16,
                                              **meg)


def test_grouped_experts_are_refused_on_the_local_engine():
    row = _rows("te.experts=grouped", *CUDA_BF16)["experts"]
    assert row.status == "fail" and row.hint.startswith("--engine megatron"), row


def test_grouped_fp8_experts_need_widths_divisible_by_16():
    def shapes(*overrides):
        spec = spec_for("nam56r-tiny", "te.fp8=current", "te.experts=grouped", ALIGNED, *overrides,
                        plugins=["te"], device="cuda", engine="megatron")
        return {r.name: r for r in config_rows(plugin.NAME, plugin.PLUGIN, spec)}["linear shapes"]

    assert shapes().status == "pass" and shapes().found == "159 projections and the grouped experts"
    row = shapes("moe_ffn_hidden=40")
    assert row.status == "fail" and row.found == "the grouped experts' moe_ffn_hidden=40", row


def test_stacked_experts_split_into_te_grouped_mlp_weights():
    from nam56r.megatron.lowering import lower
    from nam56r.megatron.weights import KIND, nam_state_to_megatron, per_expert

    cfg = _small()
    state = build_model(cfg).state_dict()
    kinds = tuple(KIND[layer["nam"]] for layer in lower(cfg).layers)
    stacked = nam_state_to_megatron(state, kinds)
    split = per_expert(stacked)
    moe = [k for k in stacked if k.endswith("mlp.experts.w_gate_up")]
    assert moe and not any(k.endswith(("experts.w_gate_up", "experts.w_down")) for k in split)
    for key in moe:
        prefix = key.removesuffix(".w_gate_up")
        gate_up, down = stacked[key], stacked[prefix + ".w_down"]
        for i in range(cfg.num_experts):
            assert torch.equal(split[f"{prefix}.linear_fc1.weight{i}"], gate_up[i])  # [2f, d]: [gate ; up]
            assert torch.equal(split[f"{prefix}.linear_fc2.weight{i}"], down[i])  # [d, f]
        assert f"{prefix}.linear_fc1.weight{cfg.num_experts}" not in split
    assert len(split) == len(stacked) + len(moe) * 2 * (cfg.num_experts - 1)


# --- the rows -------------------------------------------------------------------------------------------


def test_options_parse_and_refuse():
    assert plugin.PLUGIN.parse_options("te", {}).fp8 == "off"
    assert plugin.PLUGIN.parse_options("te", {"te.fp8": "delayed"}).fp8 == "delayed"
    with pytest.raises(ConfigError, match=r"te.fp8=e4m3: expected one of off, delayed, current, blockwise, mxfp8"):
        plugin.PLUGIN.parse_options("te", {"te.fp8": "e4m3"})


def _rows(*overrides, device="cuda", profile="h200", cuda_version=None, **run):
    spec = spec_for("nam56r-tiny", *overrides, plugins=["te"], device=device, profile=profile, **run)
    dev = spec.device if cuda_version is None else dataclasses.replace(spec.device, cuda_version=cuda_version)
    rows = plugin.nam_check_config(config=spec, device=dev) + config_rows(plugin.NAME, plugin.PLUGIN, spec)
    return {r.name: r for r in rows}


def test_bf16_te_on_cuda_has_no_config_rows_and_fp8_passes_where_it_runs():
    assert _rows(*CUDA_BF16) == {}
    rows = _rows("te.fp8=current", ALIGNED, *CUDA_BF16)
    assert {n: r.status for n, r in rows.items()} == {"fp8 recipe": "pass", "linear shapes": "pass"}, rows
    assert rows["linear shapes"].found == "159 projections"


def test_cpu_fp32_and_misaligned_fp8_are_refused():
    rows = _rows("te.fp8=delayed", device="cpu")
    assert rows["train.device"].status == "fail" and rows["train.dtype"].status == "fail", rows
    assert rows["linear shapes"].status == "fail" and rows["linear shapes"].found.startswith("17 of 159 are not")


def test_mxfp8_on_hopper_and_blockwise_before_cuda_12_9_are_refused_with_the_reason():
    row = _rows("te.fp8=mxfp8", ALIGNED, *CUDA_BF16)["fp8 recipe"]
    assert row.status == "fail" and "sm_90" in row.found and "sm_100 and newer only" in row.found, row
    assert row.hint.startswith("--set te.fp8=current"), row
    row = _rows("te.fp8=blockwise", ALIGNED, *CUDA_BF16, cuda_version="12.8")["fp8 recipe"]
    assert row.status == "fail" and "need CUDA 12.9" in row.found, row
    assert _rows("te.fp8=blockwise", ALIGNED, *CUDA_BF16, cuda_version="13.0")["fp8 recipe"].status == "pass"


@pytest.mark.parametrize("profile, found", [("cpu", "no CUDA device (cpu (profile cpu))"), ("gb10", "sm_121"),
                                            ("h200", "sm_90")])
def test_declared_rows_refuse_the_cpu_and_gb10(profile, found):
    ev = PluginHost().evaluate(["te"], DeviceInfo.profile(profile))
    rows = {c.name: c for c in ev.checks if c.plugin == "te"}
    cap = rows["CUDA capability"]
    assert cap.found == found and cap.status == ("pass" if profile == "h200" else "fail"), cap
    assert "below sm_120" in cap.needed
    if not TE_INSTALLED:
        pkg = rows["package transformer-engine"]
        assert pkg.status == "fail" and pkg.found == "not installed" and pkg.hint == plugin.GPU_HINT, pkg
    assert not ev.ok


def test_a_missing_or_broken_te_is_a_failed_row_with_the_exception_and_later_rows_skip(tmp_path, monkeypatch):
    if not TE_INSTALLED:
        row = selftest.extension(None)
        assert row.ok is False and "raised ModuleNotFoundError" in row.found, row
    # An extension built for another torch: the import raises what the dynamic loader says.
    (tmp_path / "pytorch.py").write_text("raise ImportError('transformer_engine_torch.so: undefined symbol: "
                                         "_ZN3c104cuda9SetDeviceEa')\n")
    broken = types.ModuleType("transformer_engine")
    broken.__path__ = [str(tmp_path)]
    monkeypatch.setitem(sys.modules, "transformer_engine", broken)
    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch", raising=False)
    row = selftest.extension(None)
    assert row.ok is False and "ImportError: transformer_engine_torch.so: undefined symbol" in row.found, row
    for later in (selftest.cudnn, selftest.fp8_support, selftest.bf16_parity, selftest.fp8_parity):
        skipped = later(None)
        assert skipped.ok is None and skipped.found == selftest.NOT_LOADED, (later, skipped)


@pytest.mark.parametrize("quantize, ok", [(True, True), (False, False)])
def test_fp8_parity_row_passes_an_fp8_rounding_and_fails_a_linear_that_did_not_quantize(monkeypatch, quantize, ok):
    """The row's bounds on the CPU, with a stand-in whose autocast either rounds the GEMM operands to e4m3 or
    does nothing: e4m3 lies within the tolerance and above the floor; a bf16 result under it is caught."""
    fake = FakeTE(quantize=quantize)
    monkeypatch.setattr(selftest, "_import_te", lambda: (fake, None))
    monkeypatch.setattr(recipes, "te_recipe", lambda name: object())
    monkeypatch.setattr(parity, "linear_errors", functools.partial(parity.linear_errors, tokens=256, d_in=128,
                                                                   d_out=256, device="cpu"))
    spec = spec_for("nam56r-tiny", "te.fp8=current", ALIGNED, *CUDA_BF16, plugins=["te"], device="cuda")
    row = selftest.fp8_parity(spec)
    assert row.ok is ok, row
    assert row.found.startswith("current: out ")


# --- cuDNN: TE must load torch's -------------------------------------------------------------------------


def test_te_is_pointed_at_torchs_bundled_cudnn_unless_the_user_chose(tmp_path, monkeypatch):
    from nam_core import cudnn

    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    for name in ("libcudnn_engines_precompiled.so.9", "libcudnn_adv.so.9", "libcudnn.so.9", "libcudnn_ops.so.9",
                 "libcudnn_graph.so.9", "libcudnn_heuristic.so.9", "libcudnn.so"):
        (lib / name).write_bytes(b"")
    monkeypatch.setattr(cudnn.importlib.util, "find_spec", lambda name: None)  # torch's own site: only tmp_path
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    for var in ("CUDNN_HOME", "CUDNN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/usr/local/nvidia/lib64:{lib}")
    loaded = []
    record = lambda path, mode: loaded.append((Path(path).name, mode))  # noqa: E731
    assert cudnn.prefer_torch_cudnn(record) == str(lib) and cudnn.os.environ["CUDNN_HOME"] == str(lib)
    assert cudnn.os.environ["LD_LIBRARY_PATH"] == f"{lib}:/usr/local/nvidia/lib64"  # the ranks it starts: first
    # every soname TE's core names is torch's before TE loads: the entry library and graph first, one file each
    assert loaded == [(n, ctypes.RTLD_GLOBAL) for n in ("libcudnn.so.9", "libcudnn_graph.so.9", "libcudnn_ops.so.9",
                      "libcudnn_heuristic.so.9", "libcudnn_adv.so.9", "libcudnn_engines_precompiled.so.9")], loaded
    loaded.clear()
    monkeypatch.setenv("CUDNN_HOME", "/opt/mine")
    assert cudnn.prefer_torch_cudnn(record) is None and cudnn.os.environ["CUDNN_HOME"] == "/opt/mine"
    monkeypatch.delenv("CUDNN_HOME")
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    assert cudnn.prefer_torch_cudnn(record) is None and "CUDNN_HOME" not in cudnn.os.environ  # too late: TE loaded
    assert loaded == []


def test_a_failed_preload_is_kept_for_the_preflight_row(tmp_path, monkeypatch):
    from nam_core import cudnn

    (tmp_path / "libcudnn.so.9").write_bytes(b"")  # not a library: the real loader refuses it
    monkeypatch.setattr(cudnn, "PRELOAD_ERROR", None)
    assert cudnn.preload(str(tmp_path)) == []
    assert cudnn.PRELOAD_ERROR.startswith(f"loading {tmp_path}/libcudnn.so.9 failed: "), cudnn.PRELOAD_ERROR


def test_the_cudnn_row_refuses_a_second_cudnn_with_the_fix(tmp_path, monkeypatch):
    """The GPU host's case (2026-11-25): TE loaded the toolkit's cuDNN 9.14, torch was built with 9.19 and its
    check raises; the row fails and names torch's folder. One cuDNN, torch's: the row passes."""
    from nam_core import cudnn

    bundled = "/site/nvidia/cu13/lib"
    fake = types.SimpleNamespace(get_cudnn_version=lambda: (9, 14, 0))
    monkeypatch.setattr(selftest, "_import_te", lambda: (fake, None))
    monkeypatch.setattr(torch._C, "_cudnn", types.SimpleNamespace(getCompileVersion=lambda: (9, 19, 0)),
                        raising=False)
    monkeypatch.setattr(cudnn, "torch_cudnn_dir", lambda: bundled)
    monkeypatch.setattr(cudnn, "loaded_cudnn_files",
                        lambda: [f"{bundled}/libcudnn.so.9", "/lib/x86_64-linux-gnu/libcudnn_graph.so.9.14.0"])

    def refuses():
        raise RuntimeError("cuDNN version incompatibility: PyTorch was compiled against (9, 19, 0) but found "
                           "runtime version (9, 14, 0).")

    monkeypatch.setattr(torch.backends.cudnn, "version", refuses)
    row = selftest.cudnn(None)
    assert row.ok is False and row.hint.startswith(f"export CUDNN_HOME={bundled} "), row
    assert ("TE loaded cuDNN 9.14.0 (1 cuDNN libraries from torch's folder, others: "
            "/lib/x86_64-linux-gnu/libcudnn_graph.so.9.14.0)") in row.found, row
    fake.get_cudnn_version = lambda: (9, 19, 0)
    monkeypatch.setattr(cudnn, "loaded_cudnn_files", lambda: [f"{bundled}/libcudnn.so.9"])
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    assert selftest.cudnn(None).ok is True


def test_loaded_cudnn_files_reads_the_process_maps(tmp_path):
    from nam_core.cudnn import loaded_cudnn_files

    maps = tmp_path / "maps"
    maps.write_text("7f0-7f1 r-xp 0 08:01 1 /site/nvidia/cu13/lib/libcudnn.so.9\n"
                    "7f2-7f3 r--p 0 08:01 1 /site/nvidia/cu13/lib/libcudnn.so.9\n"
                    "7f4-7f5 r-xp 0 08:01 2 /site/nvidia/cu13/lib/libcudnn_graph.so.9\n"
                    "7f6-7f7 r-xp 0 08:01 3 /usr/lib/libc.so.6\n")
    assert loaded_cudnn_files(str(maps)) == ["/site/nvidia/cu13/lib/libcudnn.so.9",
                                             "/site/nvidia/cu13/lib/libcudnn_graph.so.9"]
    assert loaded_cudnn_files(str(tmp_path / "absent")) == []


def test_nam_core_prefers_torchs_cudnn_only_where_te_is_installed(monkeypatch):
    """``import nam_core`` runs ``when_te_installed``: nothing on a host without Transformer Engine (CUDNN_HOME
    untouched, nothing loaded); with TE installed, the same preference as above."""
    from nam_core import cudnn

    calls = []
    monkeypatch.setattr(cudnn, "prefer_torch_cudnn", lambda: calls.append(1) or "/torch/cudnn")
    monkeypatch.setattr(cudnn.importlib.util, "find_spec", lambda name: None)
    assert cudnn.when_te_installed() is None and calls == []
    monkeypatch.setattr(cudnn.importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(origin="/x") if name == "transformer_engine" else None)
    assert cudnn.when_te_installed() == "/torch/cudnn" and calls == [1]


def test_split_in_proj_is_refused_at_config_time():
    """te swaps Mamba's in_proj; mamba_split_in_proj would run slices of its weight around the TE module."""
    row = _rows("mamba_split_in_proj=true", *CUDA_BF16)["mamba_split_in_proj"]
    assert row.status == "fail" and row.hint.startswith("--set mamba_split_in_proj=false"), row
    assert "mamba_split_in_proj" not in _rows(*CUDA_BF16)
