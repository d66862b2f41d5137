"""nam-plugin-sparse-mla on CPU: the Triton kernels under Triton's interpreter against the reference, the dense
path (torch's fused SDPA, which has a CPU kernel too) against the reference, registration, selection, and
activation refusals. GPU parity at NAM56R's widths, host syncs and CUDA-graph capture are in
test_sparse_mla_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import nam_plugin_sparse_mla.plugin as plugin
from nam56r.backends import AttentionCore
from nam_core.checks import config_rows
from nam_core.device import DeviceInfo
from nam_core.errors import PluginActivationError
from nam_core.host import PluginHost
from nam_core.requirements import FAIL, PASS, SKIP
from nam_core.testing import no_host_sync
from nam_plugin_sparse_mla.shape import head_block, shape_problem

CPU = DeviceInfo.profile("cpu")
H100 = DeviceInfo.profile("h100")
FP16_TOLERANCE = 5e-3  # selftest.TOLERANCE[torch.float16]: fp16 output/grad rounding (~5e-4) with 10x margin


# --- the Triton kernels under the interpreter -------------------------------------------------------
INTERPRETED = """
import json, torch
from nam_plugin_sparse_mla.kernel import sparse_mla
from nam_plugin_sparse_mla.selftest import compare, random_inputs
cases = {
    # the brief's shape; top-k 16 in one 64-slot block (48 masked lanes), rows 0..14 with -1 slots
    "s40_topk16": compare(2, 40, 4, 32, 16, 16, dtype=torch.float16, device="cpu"),
    # top-k 48 > s 20: every row has -1 columns; 16-slot blocks (3 of them); -1s rewritten to future keys
    # (index > t must count as empty too); 2 rows with no live slot at all (output must be exactly 0)
    "s20_topk48": compare(2, 20, 4, 32, 16, 48, dtype=torch.float16, device="cpu", block_n=16,
                          future_slots=True, empty_rows=2),
    # 20 heads padded to 32 rows, dk == dv, ragged last block (24 = 16 + 8)
    "h20_dk32_dv32": compare(1, 30, 20, 32, 32, 24, dtype=torch.float16, device="cpu", block_n=16),
}
from nam_plugin_sparse_mla import kernel
for tile in kernel.TILES.values():
    tile["value_from_key"] = False  # the value gathered as its own dv-wide tile
cases["s40_topk16_value_tile"] = compare(2, 40, 4, 32, 16, 16, dtype=torch.float16, device="cpu")
for tile in kernel.TILES.values():
    tile["value_from_key"] = True
q, kv, idx = random_inputs(1, 24, 4, 32, 8, dtype=torch.float16, device="cpu", seed=5)
a, _ = sparse_mla(q, kv, idx, scale=0.2, d_v=16)
b, _ = sparse_mla(q, kv, idx.int(), scale=0.2, d_v=16)
cases["int32_equals_int64"] = bool(torch.equal(a, b))
print(json.dumps(cases))
"""


@pytest.fixture(scope="module")
def interpreted(run_interpreted):
    return run_interpreted(INTERPRETED)


@pytest.mark.parametrize("case", ["s40_topk16", "s20_topk48", "h20_dk32_dv32", "s40_topk16_value_tile"])
def test_kernels_match_the_reference_under_the_interpreter(interpreted, case):
    """Forward and backward (dq, and dkv through the atomic scatter), fp16 inputs, fp32 reference."""
    errors = dict(interpreted[case])
    seed = errors.pop("seed")
    empty = errors.pop("empty_row_out", 0.0)
    print(case, seed, errors)
    assert set(errors) == {"out", "dq", "dkv"}
    assert all(v < FP16_TOLERANCE for v in errors.values()), (seed, errors)  # NaN fails here too
    assert empty == 0.0, (seed, empty)


def test_int32_indices_give_the_same_output(interpreted):
    assert interpreted["int32_equals_int64"] is True


INTERPRETED_BF16 = """
import json, torch, triton, triton.language as tl
from nam_plugin_sparse_mla import kernel
from nam_plugin_sparse_mla.kernel import dot_f32
from nam_plugin_sparse_mla.selftest import compare

@triton.jit
def product(A, B, C, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(A + m[:, None] * K + k[None, :])
    b = tl.load(B + k[:, None] * N + n[None, :])
    tl.store(C + m[:, None] * N + n[None, :], dot_f32(a, b, tl.zeros([M, N], tl.float32), True, "tf32x3"))

g = torch.Generator().manual_seed(torch.seed() % 2**31)
a = torch.randn(16, 32, generator=g) * 1e-6  # fp32, small like a gradient
b = torch.randn(32, 16, generator=g).bfloat16()
c = torch.empty(16, 16)
product[(1,)](a, b, c, M=16, K=32, N=16)
ref = a.double() @ b.double()
cases = {"split_dot": ((c.double() - ref).abs().max() / ref.abs().max()).item(),
         "hi_only_dot": ((a.bfloat16().double() @ b.double() - ref).abs().max() / ref.abs().max()).item(),
         "s40_topk16": compare(2, 40, 4, 32, 16, 16, dtype=torch.bfloat16, device="cpu"),
         "s20_topk48": compare(2, 20, 4, 32, 16, 48, dtype=torch.bfloat16, device="cpu", block_n=16,
                               future_slots=True, empty_rows=2)}
kernel.TILES["bwd"]["keys_as_rows"] = not kernel.TILES["bwd"]["keys_as_rows"]  # the other orientation
cases["s20_topk48_other_orientation"] = compare(2, 20, 4, 32, 16, 48, dtype=torch.bfloat16, device="cpu",
                                                block_n=16, future_slots=True, empty_rows=2)
for tile in kernel.TILES.values():
    tile["value_from_key"] = False  # the value gathered as its own dv-wide tile
cases["s40_topk16_value_tile"] = compare(2, 40, 4, 32, 16, 16, dtype=torch.bfloat16, device="cpu")
print(json.dumps(cases))
"""
BF16_TOLERANCE = 2e-2  # selftest.TOLERANCE[torch.bfloat16]; the reference gets dO in fp32, the kernel in bf16


@pytest.fixture(scope="module")
def interpreted_bf16(run_interpreted_bf16):
    return run_interpreted_bf16(INTERPRETED_BF16)


def test_the_split_dot_carries_fp32_operands_to_1e_5(interpreted_bf16):
    """``dot_f32``'s bf16 path (hi + lo parts of the fp32 side) against a float64 product: ~2^-17 of the
    operand, where rounding the fp32 side to bf16 alone is off by ~2^-9 (so this fails if lo is lost)."""
    print(interpreted_bf16["split_dot"], interpreted_bf16["hi_only_dot"])
    assert interpreted_bf16["split_dot"] < 3e-5 < interpreted_bf16["hi_only_dot"]


@pytest.mark.parametrize("case", ["s40_topk16", "s20_topk48", "s20_topk48_other_orientation",
                                  "s40_topk16_value_tile"])
def test_kernels_match_the_reference_in_bf16_under_the_interpreter(interpreted_bf16, case):
    """The bf16 path (split dots) of forward and backward: the default tiles, the backward's other score-tile
    orientation (``keys_as_rows``), then the value as its own tile in that orientation (fp16 covers the
    other); bf16 tolerance (inputs, dO and outputs rounded to bf16)."""
    errors = dict(interpreted_bf16[case])
    seed = errors.pop("seed")
    empty = errors.pop("empty_row_out", 0.0)
    print(case, seed, errors)
    assert set(errors) == {"out", "dq", "dkv"}
    assert all(v < BF16_TOLERANCE for v in errors.values()), (seed, errors)
    assert empty == 0.0, (seed, empty)


MODEL_STEP = """
import dataclasses, json, torch
from nam56r.model import Backends, build_model
from nam56r.recipes import get_recipe
from nam56r.reference.attention import ReferenceAttention
from nam56r.state import ForwardState
from nam_plugin_sparse_mla.attention import SparseMLA

cfg = get_recipe("nam56r-tiny").model.replace(seq_len=32)
results = []
for core in (SparseMLA(), ReferenceAttention()):
    torch.manual_seed(0)
    model = build_model(cfg, dataclasses.replace(Backends.reference(), attention=core)).to(torch.float16)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(5))
    out = model(tokens, tokens.roll(-1, 1), torch.ones(2, cfg.seq_len), state=ForwardState())
    out["loss"].backward()
    grads = [p.grad.float().flatten() for n, p in sorted(model.named_parameters())
             if p.grad is not None and (".wkv_a." in n or ".wq_b." in n) and ".indexer." not in n]
    results.append((out["lm_loss"].item(), torch.cat(grads), len(grads)))
(la, a, n), (lb, b, _) = results
print(json.dumps({"loss": abs(la - lb) / abs(lb), "grad": ((a - b).norm() / b.norm()).item(), "params": n,
                  "finite": bool(torch.isfinite(a).all())}))
"""


@pytest.mark.slow
def test_tiny_model_step_on_the_kernels_matches_the_reference_core():
    """nam56r-tiny (seq 32, fp16) with sparse-mla as the attention core: DSA layers on the interpreted kernels,
    MLA layers on the CPU flash kernel. Loss within 1e-2; the MLA/DSA projection gradients within 5e-2
    (norm of the difference over norm; measured 1.6e-2: fp16 through 52 layers)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", MODEL_STEP], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["params"] >= 26 and result["finite"], result
    assert result["loss"] < 1e-2 and result["grad"] < 5e-2, result


# --- shapes -----------------------------------------------------------------------------------------
def test_heads_are_padded_to_a_power_of_two_of_at_least_16():
    assert [head_block(h) for h in (1, 4, 16, 17, 32, 33, 128)] == [16, 16, 16, 32, 32, 64, 128]


@pytest.mark.parametrize("dk, dv, h, fragment", [
    (128, 64, 32, None),  # NAM56R
    (32, 16, 4, None),  # nam56r-tiny
    (112, 64, 32, "key width dk = kv_lora_rank + qk_rope_dim is 112"),
    (128, 24, 32, "value width dv = kv_lora_rank is 24"),
    (576, 512, 128, "key width dk = kv_lora_rank + qk_rope_dim is 576"),  # DeepSeek-V3's 512 + 64
    (512, 256, 32, "is 512; the kernels take powers of two from 16 to 256"),
    (64, 128, 32, "value width 128 is wider than key width 64"),
    (128, 64, 129, "129 attention heads"),
])
def test_shape_problem_names_what_is_unsupported(dk, dv, h, fragment):
    problem = shape_problem(dk, dv, h)
    if fragment is None:
        assert problem is None
    else:
        assert problem is not None and fragment in problem


def test_the_kernel_entry_refuses_what_it_cannot_run():
    from nam_plugin_sparse_mla.kernel import sparse_mla

    q, kv = torch.zeros(1, 4, 2, 32), torch.zeros(1, 4, 32)
    idx = torch.zeros(1, 4, 2, dtype=torch.long)
    with pytest.raises(TypeError, match="bf16 or both fp16; found torch.float32"):
        sparse_mla(q, kv, idx, scale=1.0, d_v=16)
    with pytest.raises(ValueError, match="value width dv = kv_lora_rank is 12"):
        sparse_mla(q.half(), kv.half(), idx, scale=1.0, d_v=12)
    with pytest.raises(ValueError, match="disagree"):
        sparse_mla(q.half(), kv[:, :3].half(), idx, scale=1.0, d_v=16)


# --- the dense path: torch's fused SDPA ----------------------------------------------------------------
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_dense_matches_the_reference_on_the_cpu_flash_kernel(dtype, tolerance):
    """Value = the full key row (so flash takes it), first d_v outputs kept; the math backend is off, so
    passing here means a fused kernel ran."""
    from nam_plugin_sparse_mla.selftest import compare_dense

    errors = compare_dense(2, 40, 4, 32, 16, dtype=dtype, device="cpu")
    seed = errors.pop("seed")
    assert all(v < tolerance for v in errors.values()), (seed, errors)


def test_dense_reads_no_tensor_value_on_the_host():
    from nam_plugin_sparse_mla.attention import SparseMLA

    q = torch.randn(1, 24, 4, 32, requires_grad=True)
    kv = torch.randn(1, 24, 32, requires_grad=True)
    with no_host_sync():
        SparseMLA().dense(q, kv, scale=0.2, d_v=16).sum().backward()
    assert q.grad.abs().sum() > 0 and kv.grad[:, :, 16:].abs().sum() > 0  # rope half: via the key only


# --- registration and selection ---------------------------------------------------------------------
PLUGINS = ["reference", "sparse-mla"]


def recipe(*overrides, device="cuda"):
    """The RunSpec of `--plugins sparse-mla` on the tiny recipe on an H100 (fake), in bf16 (the kernels' dtype)."""
    from nam56r.run import spec_for

    return spec_for("nam56r-tiny", "train.dtype=bfloat16", *overrides, plugins=PLUGINS, device=device)


def by_name(checks):
    return {c.name: c for c in checks}


def test_requesting_the_plugin_selects_and_registers_the_backend():
    from nam_plugin_sparse_mla.attention import SparseMLA

    from nam56r.backends import IndexerKernels
    from nam_plugin_sparse_mla.attention import SparseMLAIndexerKernels

    rec = recipe()
    assert rec.model.attention_backend == rec.model.indexer_kernels_backend == "sparse-mla"
    assert any("attention_backend=sparse-mla" in note for note in rec.notes), rec.notes
    host = PluginHost()
    host.activate(PLUGINS, H100, rec)  # a fake H100: declared needs are checked, launches are skipped
    assert host.registry("attention").get("sparse-mla") is SparseMLA
    assert host.registry("indexer_kernels").get("sparse-mla") is SparseMLAIndexerKernels
    assert isinstance(SparseMLA(), AttentionCore) and isinstance(SparseMLAIndexerKernels(), IndexerKernels)
    assert not isinstance(SparseMLAIndexerKernels(), AttentionCore)  # the kinds are apart


def test_an_explicit_choice_wins_and_the_check_says_the_plugin_is_unused():
    rec = recipe("attention_backend=reference", "indexer_kernels_backend=reference")
    assert rec.model.attention_backend == "reference"
    checks = by_name(c for c in PluginHost().evaluate(PLUGINS, H100, rec).checks if c.plugin == "sparse-mla")
    assert checks["selected"].status == SKIP and "active but unused" in checks["selected"].found
    checks = by_name(c for c in PluginHost().evaluate(PLUGINS, H100, recipe("attention_backend=reference")).checks
                     if c.plugin == "sparse-mla")
    assert checks["selected"].status == PASS and checks["selected"].found == "indexer_kernels_backend=sparse-mla"


def test_config_check_passes_nam56r_and_tiny_widths():
    checks = by_name(config_rows(plugin.NAME, plugin.PLUGIN, recipe()))
    assert checks["kernel shapes"].status == PASS
    assert checks["kernel shapes"].found == "dk 32 (kv_lora_rank 16 + qk_rope_dim 16), dv 16, 4 heads, top-k 16"
    from nam56r.run import spec_for

    found = by_name(config_rows(plugin.NAME, plugin.PLUGIN, spec_for("nam56r")))["kernel shapes"].found
    assert found == "dk 128 (kv_lora_rank 64 + qk_rope_dim 64), dv 64, 32 heads, top-k 256"


@pytest.mark.parametrize("overrides, fragment", [
    (("kv_lora_rank=24",), "dk 40 (kv_lora_rank 24 + qk_rope_dim 16), dv 24"),
    (("qk_rope_dim=8",), "dk 24 (kv_lora_rank 16 + qk_rope_dim 8)"),
    (("kv_lora_rank=256", "qk_rope_dim=64"), "key width dk = kv_lora_rank + qk_rope_dim is 320"),
    (("attn_heads=160",), "160 attention heads"),
])
def test_config_check_refuses_widths_the_kernels_cannot_take(overrides, fragment):
    rec = recipe(*overrides)
    bad = by_name(config_rows(plugin.NAME, plugin.PLUGIN, rec))["kernel shapes"]
    assert bad.status == FAIL and fragment in bad.found, bad
    assert "attention_backend=reference" in bad.hint
    with pytest.raises(PluginActivationError, match="sparse-mla: kernel shapes"):
        PluginHost().activate(PLUGINS, H100, rec)


# --- activation refusals ----------------------------------------------------------------------------
def failures(names, device, config=None):
    ev = PluginHost().evaluate(names, device, config)
    return {c.name: c for c in ev.failures if c.plugin == "sparse-mla"}


def test_a_float32_run_is_refused_at_activation_not_at_its_first_step():
    """The kernels take bf16 or fp16 operands only (``kernel.check_inputs``); the tiny recipe trains in fp32, and
    without the row a CUDA run of it passed activation and stopped at step 1 on a bare TypeError."""
    bad = failures(PLUGINS, H100, recipe("train.dtype=float32"))
    assert set(bad) == {"train.dtype"}
    assert bad["train.dtype"].found == "train.dtype=float32" and "bfloat16 or float16" in bad["train.dtype"].needed
    assert bad["train.dtype"].hint == "--set train.dtype=bfloat16, or run without sparse-mla: " \
                                      "--set attention_backend=reference"
    assert not failures(PLUGINS, H100, recipe("train.dtype=float32", "attention_backend=reference",
                                              "indexer_kernels_backend=reference"))  # unused: no dtype asked


def test_activation_is_refused_on_the_cpu_profile():
    bad = failures(["sparse-mla"], CPU)
    assert set(bad) == {"CUDA capability"}
    assert bad["CUDA capability"].needed == ">= sm_90" and bad["CUDA capability"].found.startswith("no CUDA device")
    with pytest.raises(PluginActivationError, match="sparse-mla: CUDA capability"):
        PluginHost().activate(["sparse-mla"], CPU)


def test_activation_is_refused_before_hopper(fake_a100):
    bad = failures(["sparse-mla"], fake_a100)
    assert set(bad) == {"CUDA capability"} and bad["CUDA capability"].found == "sm_80"


def test_activation_is_refused_without_triton(fake_versions):
    fake_versions(triton=None)
    bad = failures(["sparse-mla"], H100)
    assert set(bad) == {"package triton"}
    assert bad["package triton"].found == "not installed"
    assert bad["package triton"].hint == "pip install 'nam-plugin-sparse-mla[gpu]'"


def test_launch_checks_are_skipped_on_a_fake_device():
    ev = PluginHost().evaluate(["sparse-mla"], H100)
    assert ev.ok
    launch = [c for c in ev.checks if c.plugin == "sparse-mla" and c.name == "launch checks"]
    assert [c.status for c in launch] == [SKIP]
