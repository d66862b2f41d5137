"""float8 on the CPU: which projections the conversion picks on the tiny model (and what it leaves alone), the
swap itself and a Float8Linear's error (torch 2.13's CPU runs ``torch._scaled_mm``), the options, the config
checks, the hook through the host and the local engine, and the FP8 experts' padding and routing logic.

torchao's FP8 grouped GEMM is a Triton + CUDA kernel, so the experts tests hand the backend a per-group loop
with the same contract that also checks the padding it is given (``aligned_loop_mm``); the product never takes
another GEMM than torchao's (GPU parity: test_float8_gpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from nam56r.model import build_model
from nam56r.recipes import get_recipe
from nam56r.run import spec_for
from nam56r.testing import expert_errors, idle_expert_inputs, random_expert_inputs, run_experts, sorted_entry_error
from nam_core.checks import config_rows
from nam_core.device import DeviceInfo
from nam_core.errors import ConfigError
from nam_core.testing import max_rel_error, new_seed
from nam_plugin_float8 import plugin
from nam_plugin_float8.experts import ALIGN, Float8GroupedExperts, pad_groups, torchao_rowwise_mm
from nam_plugin_float8.linears import convert, dense_projections, float8_modules, linear_error

ALIGNED = "mamba_rope_fraction=1.0"
"""The tiny recipe's Mamba in_proj is 540 wide (2*128 + 2*128 + 3*8 + 4 angles); rope 1.0 gives 8 angles: 544."""
CUDA_BF16 = ("train.dtype=bfloat16", "attention_backend=reference")  # the slow DSA path, by name


def _tiny(aligned: bool = True):
    model = get_recipe("nam56r-tiny").model
    return model.replace(mamba_rope_fraction=1.0) if aligned else model


def _expected_projections(model) -> set[str]:
    """The intended set, written out from the layer plan: what ``dense_projections`` must return."""
    mla = ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")
    names = set()
    for i, spec in enumerate(model.plan.layers):
        attrs = {"mamba": ("in_proj", "out_proj"), "moe": ("shared.w_gate_up", "shared.w_down")}.get(spec.kind, mla)
        names |= {f"layers.{i}.mixer.{a}" for a in attrs}
    for j in range(len(model.mtp)):
        names |= {f"mtp.{j}.{a}" for a in ("eh_proj", "mlp.w_gate_up", "mlp.w_down")}
        names |= {f"mtp.{j}.attn.mixer.{a}" for a in mla}
    return names


# --- the linears ----------------------------------------------------------------------------------------


def test_filter_picks_exactly_the_dense_projections_of_the_tiny_model():
    model = build_model(_tiny(), device="meta")
    picked = {p.name for p in dense_projections(model)}
    assert picked == _expected_projections(model)
    left = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)} - picked
    leaf = {n.rsplit(".", 1)[-1] for n in left}
    assert leaf == {"router", "wq_b", "wk", "weights_proj", "out_proj"}, leaf  # router, indexer, n-gram
    assert all(".router" in n or ".indexer." in n or n == "ngram.out_proj" for n in left), sorted(left)[:5]
    kinds = {s.kind for s in model.plan.layers}
    assert kinds == {"mamba", "moe", "mla", "dsa"}, kinds  # every block kind is exercised


def test_conversion_swaps_only_those_and_keeps_every_parameter():
    torch.manual_seed(0)
    model = build_model(_tiny()).to(torch.bfloat16)
    before = {n: (p, p.dtype, p.detach().clone()) for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    fp32 = [n for n, (p, dtype, _) in before.items() if dtype == torch.float32]
    assert any(n.endswith(".D") for n in fp32) and any(n.endswith(".dt_bias") for n in fp32), fp32[:4]

    line = convert(model, "rowwise")

    expected = _expected_projections(model)
    assert set(float8_modules(model)) == expected
    assert line.startswith(f"float8: {len(expected)} nn.Linear -> torchao Float8Linear (rowwise)"), line
    after = dict(model.named_parameters())
    assert list(after) == list(before)  # names and order: the optimizer and the checkpoint see the same
    for name, (p, dtype, value) in before.items():
        assert after[name] is p and p.dtype == dtype and torch.equal(p.detach(), value), name
    assert list(model.state_dict()) == keys
    for name in fp32:  # D, dt_bias, B/C biases: fp32 and untouched
        assert after[name].dtype == torch.float32, name
    assert convert(model, "rowwise").startswith("float8: 0 nn.Linear")  # a Float8Linear is not picked again


@pytest.mark.parametrize("recipe, other", [("rowwise", "tensorwise"), ("tensorwise", "rowwise")])
def test_the_recipe_reaches_every_float8_linear(recipe, other):
    """Each converted projection scales as the run asked (the error bounds above cannot tell the two recipes
    apart: rowwise's error fits inside tensorwise's bound)."""
    from torchao.float8 import Float8LinearConfig

    model = build_model(_tiny()).to(torch.bfloat16)
    convert(model, recipe)
    converted = set(float8_modules(model))
    configs = [m.config for n, m in model.named_modules() if n in converted]
    want = Float8LinearConfig.from_recipe_name(recipe)
    assert want != Float8LinearConfig.from_recipe_name(other)
    assert configs and all(c == want for c in configs)


def test_misaligned_projection_is_refused_by_the_conversion():
    model = build_model(_tiny(aligned=False), device="meta")  # in_proj 64 -> 540
    with pytest.raises(ValueError, match=r"in_proj \[64 -> 540\]"):
        convert(model, "rowwise")


@pytest.mark.parametrize("recipe, bound", [("rowwise", 0.06), ("tensorwise", 0.08)])
def test_float8_linear_error_on_the_cpu(recipe, bound):
    """e4m3 rounding: ~0.04 relative L2; tensorwise's e5m2 gradients ~0.06 (see plugin.LINEARS_TOLERANCE)."""
    r = linear_error(recipe, tokens=256, d_in=128, d_out=256, device="cpu", seed=new_seed())
    assert 0.01 < max(r.values()) <= min(bound, plugin.LINEARS_TOLERANCE), r  # FP8, and within tolerance


def test_tiny_model_trains_a_step_with_float8_linears_on_the_cpu():
    torch.manual_seed(0)
    cfg = _tiny()
    ref = build_model(cfg).to(torch.bfloat16)
    fp8 = build_model(cfg).to(torch.bfloat16)
    fp8.load_state_dict(ref.state_dict())
    convert(fp8, "rowwise")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    batch = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(2, cfg.seq_len)}
    from nam56r.state import ForwardState

    losses = []
    for model in (ref, fp8):
        out = model(**batch, state=ForwardState(micro_batch=0, seq_layout=tuple(tokens.shape)))
        out["loss"].backward()
        losses.append(out["loss"].item())
    assert abs(losses[0] - losses[1]) < 0.05 * losses[0], losses
    grads = [torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None]) for m in (ref, fp8)]
    assert 1e-4 < max_rel_error(grads[1], grads[0]) < 0.3


# --- options and config checks ----------------------------------------------------------------------------


def test_options_parse_and_refuse():
    values = plugin.PLUGIN.parse_options("float8", {"float8.linears": "rowwise"})
    assert (values.linears, values.experts) == ("rowwise", "off")
    assert plugin.enabled_parts(values) == {"linears": "rowwise"}
    with pytest.raises(ConfigError, match=r"float8.linears=mxfp8: expected one of none, tensorwise, rowwise"):
        plugin.PLUGIN.parse_options("float8", {"float8.linears": "mxfp8"})
    with pytest.raises(ConfigError, match=r"did you mean float8.experts"):
        plugin.PLUGIN.parse_options("float8", {"float8.expert": "rowwise"})


def _rows(*overrides, device="cuda", capability=None):
    spec = spec_for("nam56r-tiny", *overrides, plugins=["float8"], device=device)
    dev = spec.device if capability is None else dataclasses.replace(spec.device, capability=capability)
    rows = plugin.nam_check_config(config=spec, device=dev) + config_rows(plugin.NAME, plugin.PLUGIN, spec)
    return {r.name: r for r in rows}


def test_nothing_enabled_is_one_skip_row():
    rows = _rows()
    assert list(rows) == ["parts"] and rows["parts"].status == "skip", rows
    assert "changes nothing" in rows["parts"].found


def test_linears_on_the_cpu_in_fp32_with_a_misaligned_projection_are_refused():
    rows = _rows("float8.linears=rowwise", device="cpu")
    assert rows["train.device"].status == "fail" and rows["train.dtype"].status == "fail", rows
    shapes = rows["linear shapes"]
    assert shapes.status == "fail" and "in_proj [64 -> 540]" in shapes.found, shapes
    assert shapes.found.startswith("17 of 159 are not"), shapes.found  # the 17 Mamba in_proj


def test_aligned_linears_on_cuda_in_bf16_pass():
    rows = _rows("float8.linears=rowwise", ALIGNED, *CUDA_BF16)
    assert {n: r.status for n, r in rows.items()} == {"parts": "pass", "linear shapes": "pass"}, rows
    assert rows["linear shapes"].found == "159 projections"


def test_experts_option_and_moe_backend_must_agree():
    row = _rows("float8.experts=rowwise", *CUDA_BF16)["experts backend"]
    assert row.status == "fail" and row.found == "moe_backend=reference" and "float8-grouped" in row.hint, row
    row = _rows("moe_backend=float8-grouped", *CUDA_BF16)["experts backend"]
    assert row.status == "fail" and row.hint.startswith("--set float8.experts=rowwise"), row


def test_expert_shapes_and_capability_are_checked():
    on = ("float8.experts=rowwise", "moe_backend=float8-grouped", *CUDA_BF16)
    rows = _rows(*on)
    assert rows["expert GEMM shapes"].status == "pass" and rows["CUDA capability"].status == "pass", rows
    rows = _rows(*on, "moe_ffn_hidden=40", capability=(8, 9))
    assert rows["expert GEMM shapes"].status == "fail" and rows["expert GEMM shapes"].found == "moe_ffn_hidden=40"
    assert rows["CUDA capability"].status == "fail" and rows["CUDA capability"].found == "sm_89", rows


def test_speed_row_says_not_measured_slower_or_faster():
    assert plugin.MEASURED == {} or all({"speedup", "bench", "date", "gpu"} <= set(m) for m in plugin.MEASURED.values())
    row = plugin.speed_row("experts", {})
    assert row.status == "skip" and row.found == "not measured yet" and "bench/moe.py" in row.hint
    m = {"speedup": 0.9, "bench": "python bench/moe.py", "date": "2026-01-01", "gpu": "H100"}
    row = plugin.speed_row("experts", {"experts": m})
    assert row.status == "skip" and "0.90x of bf16: SLOWER" in row.found and "experts=off" in row.hint
    row = plugin.speed_row("linears", {"linears": {**m, "speedup": 1.2}})
    assert row.status == "pass" and row.found.startswith("1.20x of bf16")


# --- the hook -------------------------------------------------------------------------------------------


def test_host_activates_and_transforms_a_model():
    from nam_core.host import PluginHost

    spec = spec_for("nam56r-tiny", "float8.linears=tensorwise", ALIGNED, *CUDA_BF16, plugins=["float8"], device="cuda")
    host = PluginHost()
    host.activate(spec.plugins, DeviceInfo.profile("h100"), spec)
    model = build_model(spec.model, device="meta")
    [line] = host.transform_model(model, spec)
    assert line.startswith("float8: 159 nn.Linear -> torchao Float8Linear (tensorwise)"), line
    assert len(float8_modules(model)) == 159
    off = spec_for("nam56r-tiny", plugins=["float8"], device="cuda")
    assert PluginHost().transform_model(build_model(off.model, device="meta"), off) == []


def test_the_local_engine_transforms_before_it_builds_the_optimizer(tmp_path):
    """A transform that swaps a module for one with a new parameter: the optimizer must step the new one."""
    from nam_core.engine.contract import EngineRun
    from nam_core.engine.local import LocalModel, train

    model = nn.Sequential(nn.Linear(4, 4))

    class Host:
        def transform_model(self, m, spec):
            m[0] = nn.Linear(4, 4)
            self.new = m[0].weight
            self.start = self.new.detach().clone()
            return ["swapped layer 0"]

        def before_step(self, step, run):
            pass

        def after_step(self, step, run, metrics):
            pass

        def run_report(self, run):
            return []

    host = Host()
    spec = spec_for("nam56r-tiny", "train.dtype=float32", "train.micro_batch_size=1", "train.lr=1e-2",
                    "train.warmup_steps=1", "train.total_steps=1", "train.checkpoint_every=100",
                    "train.weight_decay=0.0", device="cpu")
    batch = {"tokens": torch.randn(1, 4)}
    train(EngineRun(run_dir=tmp_path, spec=spec, host=host, max_steps=1, flops_per_token=1.0, quiet=True,
                    model=LocalModel(model, lambda b, i: {"loss": model(b["tokens"]).square().mean()}),
                    batch_at=lambda i, b: batch))
    assert model[0].weight is host.new and not torch.equal(host.new.detach(), host.start)
    assert "swapped layer 0" in (tmp_path / "run.log").read_text()


# --- the experts ----------------------------------------------------------------------------------------


def aligned_loop_mm(a: torch.Tensor, b_t: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_grouped_mm``'s contract in a loop (tests only; reads ``offs`` on the host), checking what
    the FP8 kernel needs: every group starting at a multiple of 16, and zeros past the last group."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    assert all(s % ALIGN == 0 for s in starts + ends), ends
    assert a.shape[0] % ALIGN == 0 and not a[ends[-1]:].any(), "rows past the last group must be zeros"
    out = a.new_zeros(a.shape[0], b_t.shape[-1])
    for i, (s, e) in enumerate(zip(starts, ends)):
        out[s:e] = a[s:e] @ b_t[i]
    return out


def _inputs(seed, t=96, d=32, e=8, k=3, f=16, **kw):
    return random_expert_inputs(t, d, e, k, f, device="cpu", seed=seed, **kw)


def test_pad_groups_places_each_expert_at_a_multiple_of_16():
    counts = torch.tensor([3, 0, 17, 16])
    g = pad_groups(counts, 36)
    assert g.ends.tolist() == [16, 16, 48, 64] and g.ends.dtype == torch.int32
    assert g.rows.tolist() == [0, 1, 2, *range(16, 33), *range(48, 64)]
    assert g.size == 96  # 36 + 4 * 15 = 96: fixed by the shapes, never by the counts


@pytest.mark.parametrize("balanced", [False, True])
def test_experts_match_the_reference_in_output_and_every_gradient(balanced):
    seed = new_seed()
    errors = expert_errors(Float8GroupedExperts(aligned_loop_mm), _inputs(seed, balanced=balanced))
    assert max(errors.values()) < 1e-12, (errors, seed)


def test_an_expert_with_no_row_gets_an_empty_group_and_no_gradient():
    seed = new_seed()
    inputs = idle_expert_inputs(96, 32, 8, 2, 16, busy=4, seed=seed)
    errors = expert_errors(Float8GroupedExperts(aligned_loop_mm), inputs)
    assert max(errors.values()) < 1e-12, (errors, seed)
    _, grads = run_experts(Float8GroupedExperts(aligned_loop_mm), inputs, torch.float64)
    assert torch.equal(grads[2][4:], torch.zeros_like(grads[2][4:]))


def test_sorted_entry_matches_the_reference_sorted_entry():
    """Megatron's experts slot calls ``sorted`` with rows already sorted by expert and one gate per row."""
    seed = new_seed()
    assert sorted_entry_error(Float8GroupedExperts(aligned_loop_mm), _inputs(seed)) < 1e-12, seed


def test_the_product_configuration_is_torchaos_gemm():
    experts = Float8GroupedExperts()
    assert experts.grouped_mm is torchao_rowwise_mm and experts.layer_state(None) is None


def test_registered_backend_is_the_product_configuration():
    from nam_core.checks import load

    assert load(plugin.PLUGIN.classes("moe")["float8-grouped"]) is Float8GroupedExperts  # what the host registers


def test_split_in_proj_is_refused_with_fp8_linears_only():
    """float8.linears swaps Mamba's in_proj; mamba_split_in_proj would run slices of its weight around it. With
    the linears off (experts only) the split is the model's own business."""
    row = _rows("float8.linears=rowwise", "mamba_split_in_proj=true", ALIGNED, *CUDA_BF16)["mamba_split_in_proj"]
    assert row.status == "fail" and "float8.linears=none" in row.hint, row
    assert "mamba_split_in_proj" not in _rows("float8.experts=rowwise", "mamba_split_in_proj=true", *CUDA_BF16)
