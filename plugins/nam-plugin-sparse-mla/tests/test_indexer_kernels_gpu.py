"""sparse-mla's indexer kernels on the GPU host: index scores (forward, dq, dk, dw) and the sparse KL teacher
against nam56r's pure-PyTorch reference in bf16 at NAM56R's shapes, their memory bound and no host syncs.
Marked gpu: skipped with a reason where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

INDEX = dict(heads=32, d=64)  # NAM56R: 32 index heads of 64 (nam56r.config index_heads, index_head_dim)
TEACHER = dict(h=32, dk=128)  # NAM56R: 32 query heads over a 64 + 64 latent key
TOPK = 256  # NAM56R's index_topk
BF16_TOLERANCE = 2e-2  # selftest.TOLERANCE[bf16]: dq and dk round to bf16 (~4e-3 each)
FP32_TOLERANCE = 1e-4  # selftest.FP32_OUTPUT_TOLERANCE: scores, dw and the teacher are fp32


@pytest.mark.parametrize("b, s", [(1, 4096), (2, 1000)])  # NAM56R's sequence; ragged (1000 = 15 x 64 + 40)
def test_index_scores_match_the_reference_in_bf16(b, s):
    from nam_plugin_sparse_mla.selftest import compare_index_scores

    errors = compare_index_scores(b, s, **INDEX, dtype=torch.bfloat16, device="cuda")
    seed = errors.pop("seed")
    print(f"b={b} s={s} seed={seed} " + " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert errors["scores"] <= FP32_TOLERANCE and errors["dw"] <= FP32_TOLERANCE, (seed, errors)
    assert errors["dq"] <= BF16_TOLERANCE and errors["dk"] <= BF16_TOLERANCE, (seed, errors)


@pytest.mark.parametrize("b, s", [(1, 4096), (2, 1000)])
def test_sparse_teacher_matches_the_reference_in_bf16(b, s):
    """Rows 0..254 have empty (-1) slots; at s=1000 they point at future keys instead, and 2 rows have none."""
    from nam_plugin_sparse_mla.selftest import compare_teacher

    ragged = s == 1000
    errors = compare_teacher(b, s, **TEACHER, topk=TOPK, dtype=torch.bfloat16, device="cuda",
                             future_slots=ragged, empty_rows=2 if ragged else 0)
    print(f"b={b} s={s} " + " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert errors["teacher"] <= FP32_TOLERANCE and errors["dead"] == 0.0, errors


def _score_inputs(s=4096, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, d = INDEX["heads"], INDEX["d"]
    q = torch.randn(1, s, h, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k = torch.randn(1, s, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(1, s, h, generator=g) * (h * d) ** -0.5).cuda().requires_grad_()
    return q, k, w


def test_index_scores_never_hold_heads_x_seq_x_seq():
    """s=4096: one [H, s, s] fp32 tensor is 2 GiB. Forward + backward may hold the [s, s] scores, their
    gradient and its fp32 copy (64 MiB each) and 8 partial dk buffers, nothing per head."""
    from nam_plugin_sparse_mla.indexer import index_scores

    s = 4096
    q, k, w = _score_inputs(s)
    grad = torch.randn(1, s, s, device="cuda")
    index_scores(q, k, w).backward(grad)  # compile outside the measurement
    q.grad = k.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    index_scores(q, k, w).backward(grad)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    heads_seq_seq = INDEX["heads"] * s * s * 4
    print(f"index scores peak extra {extra / 2**20:.0f} MiB; one [H, s, s] fp32 = {heads_seq_seq / 2**20:.0f} MiB")
    assert extra < heads_seq_seq / 8


def test_indexer_kernels_read_no_tensor_value_on_the_host():
    from nam_core.testing import no_host_sync
    from nam_plugin_sparse_mla.attention import SparseMLAIndexerKernels
    from nam_plugin_sparse_mla.selftest import random_inputs

    core = SparseMLAIndexerKernels()
    q, k, w = _score_inputs(512)
    tq, kv, indices = random_inputs(1, 512, TEACHER["h"], TEACHER["dk"], TOPK, dtype=torch.bfloat16,
                                    device="cuda", seed=2)
    core.index_scores(q, k, w).sum().backward()  # compile outside the check
    core.sparse_teacher(tq, kv, indices, scale=0.1)
    with no_host_sync():
        scores = core.index_scores(q, k, w)
        scores.masked_fill(scores.isinf(), 0.0).sum().backward()
        core.sparse_teacher(tq, kv, indices, scale=0.1)
