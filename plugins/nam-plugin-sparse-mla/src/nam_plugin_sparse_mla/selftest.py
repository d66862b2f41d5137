"""sparse-mla vs the reference on fresh random inputs: used by preflight, the tests and the benchmark.

Each call draws a fresh seed (returned, and printed with any failure) unless given one. Indices come the way
the model makes them: ``nam56r.blocks.indexer.causal_topk`` of random causal-masked scores, so row ``t < topk``
has ``topk - t - 1`` empty (-1) slots and every live index is distinct and <= t. The reference gets the
*same* low-precision values upcast to fp32, so the comparison measures the kernel's arithmetic, not the
inputs' rounding. Error per tensor: ``max |kernel - reference| / max |reference|``.
"""

from __future__ import annotations

import math
from functools import partial

import torch

from nam_core.checks import Measured
from nam_core.testing import max_rel_error, model_parity, new_seed, worst

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
"""Max relative-to-max error per tensor. The kernel's own arithmetic is ~fp32 (fp32 operands of the bf16 dots
carried to ~2^-17 by a high/low split; module docstring of kernel.py); what remains is the output's and the
gradients' final rounding to the input dtype (bf16: 8 mantissa bits, ~4e-3 per rounding; fp16: 11 bits, ~5e-4)
and fp32 summation order."""



def random_indices(b: int, s: int, topk: int, *, generator: torch.Generator, future_slots: bool = False,
                   empty_rows: int = 0) -> torch.Tensor:
    """``[b, s, topk]`` int64 on the CPU: causal top-k of random scores, -1 where a row has no more past keys.

    ``topk > s`` pads every row with -1 columns (a fixed top-k wider than a short sequence).
    ``future_slots``: every -1 that can be becomes a key *after* its query (``s - 1``), which must count as
    empty just the same (the kernel's ``index <= t`` test). ``empty_rows``: that many rows (every seventh
    from row 1) lose all their slots, the guard case of a query with nothing to attend to.
    """
    scores = torch.rand(b, s, s, generator=generator)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    from nam56r.blocks.indexer import causal_topk

    indices = causal_topk(scores, topk)  # [b, s, min(topk, s)]
    if topk > s:
        indices = torch.cat((indices, indices.new_full((b, s, topk - s), -1)), dim=-1)
    if future_slots:
        query_pos = torch.arange(s).view(1, s, 1)
        indices = torch.where((indices < 0) & (query_pos < s - 1), s - 1, indices)
    for n in range(empty_rows):
        indices[:, (1 + 7 * n) % s] = -1
    return indices


def random_inputs(b: int, s: int, h: int, dk: int, topk: int, *, dtype, device, seed: int,
                  future_slots: bool = False, empty_rows: int = 0):
    """``q [b, s, h, dk]``, ``kv [b, s, dk]`` (both ``dtype``), ``indices [b, s, topk]`` int64, on ``device``.

    q and kv are N(0, 1): with scale dk^-0.5 the logits are N(0, 1) too, a softmax neither flat nor one-hot.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, s, h, dk, generator=g).to(device=device, dtype=dtype)
    kv = torch.randn(b, s, dk, generator=g).to(device=device, dtype=dtype)
    indices = random_indices(b, s, topk, generator=g, future_slots=future_slots, empty_rows=empty_rows)
    return q, kv, indices.to(device)



def compare(b: int, s: int, h: int, dk: int, dv: int, topk: int, *, dtype=torch.bfloat16, device="cuda",
            seed: int | None = None, block_n: int | None = None, future_slots: bool = False,
            empty_rows: int = 0) -> dict[str, float]:
    """Relative errors of ``out``, ``dq``, ``dkv`` of the kernel vs ``ReferenceAttention().sparse``, plus
    ``seed``; with ``empty_rows``, also ``empty_row_out``: the largest |output| on those rows (must be 0)."""
    from nam56r.reference.attention import ReferenceAttention
    from nam_plugin_sparse_mla.kernel import sparse_mla

    seed = new_seed() if seed is None else seed
    q, kv, indices = random_inputs(b, s, h, dk, topk, dtype=dtype, device=device, seed=seed,
                                   future_slots=future_slots, empty_rows=empty_rows)
    scale = dk**-0.5
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    do = torch.randn(b, s, h, dv, generator=g).to(device)
    outputs = []

    def kernel(q, kv, indices):
        out, _lse = sparse_mla(q, kv, indices, scale=scale, d_v=dv, block_n=block_n)
        outputs.append(out)
        return out

    errors = model_parity(kernel, partial(ReferenceAttention().sparse, scale=scale, d_v=dv),
                          {"q": q, "kv": kv, "indices": indices}, activations=("q", "kv"), dtype=dtype,
                          dout=do, seed=seed)
    [out] = outputs
    if empty_rows:
        rows = sorted({(1 + 7 * n) % s for n in range(empty_rows)})
        errors["empty_row_out"] = out[:, rows].float().abs().max().item()
    return errors


def compare_dense(b: int, s: int, h: int, dk: int, dv: int, *, dtype=torch.bfloat16, device="cuda",
                  seed: int | None = None) -> dict[str, float]:
    """As ``compare`` for ``SparseMLA.dense`` (torch's fused SDPA) vs ``ReferenceAttention().dense``."""
    from nam56r.reference.attention import ReferenceAttention
    from nam_plugin_sparse_mla.attention import dense_attention

    seed = new_seed() if seed is None else seed
    q, kv, _ = random_inputs(b, s, h, dk, 1, dtype=dtype, device=device, seed=seed)
    scale = dk**-0.5
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    do = torch.randn(b, s, h, dv, generator=g).to(device)
    return model_parity(partial(dense_attention, scale=scale, d_v=dv),
                        partial(ReferenceAttention().dense, scale=scale, d_v=dv), {"q": q, "kv": kv},
                        activations=("q", "kv"), dtype=dtype, dout=do, seed=seed)


FP32_OUTPUT_TOLERANCE = 1e-4
"""Max relative-to-max error of the fp32 outputs of the indexer kernels (index scores, dw, the teacher): their
logits are exact products of the low-precision inputs summed in fp32, so only the summation order (and exp's
rounding) differs from the fp32 reference, ~1e-6; 1e-4 leaves room for long rows."""


def compare_index_scores(b: int, s: int, heads: int, d: int, *, dtype=torch.bfloat16, device="cuda",
                         seed: int | None = None, block: int | None = None) -> dict[str, float]:
    """Relative errors of ``scores``, ``dq``, ``dk``, ``dw`` of ``indexer.index_scores`` vs the reference
    ``nam56r.blocks.indexer.index_scores`` on the same values upcast to fp32, plus ``seed``. ``block``: one
    square tile for every kernel; None: the tuned ``SCORE_TILES``.

    q, k ~ N(0, 1) in ``dtype``; w ~ N(0, 1) * H^-0.5 d^-0.5 in fp32 (LightningIndexer's scale, both signs);
    the incoming gradient is N(0, 1) everywhere, above the diagonal too, where both sides must ignore it.
    ``scores`` is inf unless both put -inf exactly above the diagonal and nowhere else.
    """
    from nam56r.blocks.indexer import index_scores as reference
    from nam_plugin_sparse_mla.indexer import index_scores

    seed = new_seed() if seed is None else seed
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, s, heads, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(b, s, d, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(b, s, heads, generator=g) * (heads**-0.5 * d**-0.5)).to(device)
    grad = torch.randn(b, s, s, generator=g).to(device)

    qk, kk, wk = q.clone().requires_grad_(), k.clone().requires_grad_(), w.clone().requires_grad_()
    out = index_scores(qk, kk, wk, block=block)
    out.backward(grad)
    qr, kr, wr = q.float().requires_grad_(), k.float().requires_grad_(), w.clone().requires_grad_()
    ref = reference(qr, kr, wr)
    ref.backward(grad)

    future = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
    masked_right = bool(torch.isneginf(out[:, future]).all()) and bool(torch.isfinite(out[:, ~future]).all())
    scores = max_rel_error(out.masked_fill(future, 0.0), ref.masked_fill(future, 0.0))
    return {"scores": scores if masked_right else math.inf, "dq": max_rel_error(qk.grad, qr.grad),
            "dk": max_rel_error(kk.grad, kr.grad), "dw": max_rel_error(wk.grad, wr.grad), "seed": seed}


def compare_teacher(b: int, s: int, h: int, dk: int, topk: int, *, dtype=torch.bfloat16, device="cuda",
                    seed: int | None = None, block_n: int | None = None, future_slots: bool = False,
                    empty_rows: int = 0) -> dict[str, float]:
    """Relative error ``teacher`` of ``indexer.sparse_teacher`` vs the reference ``teacher_sparse`` (on the same
    values upcast to fp32), ``dead``: the largest value on a dead slot (must be 0), and ``seed``."""
    from nam56r.blocks.indexer import live_slots, teacher_sparse
    from nam_plugin_sparse_mla.indexer import TEACHER_BLOCK_N, sparse_teacher

    seed = new_seed() if seed is None else seed
    q, kv, indices = random_inputs(b, s, h, dk, topk, dtype=dtype, device=device, seed=seed,
                                   future_slots=future_slots, empty_rows=empty_rows)
    scale = dk**-0.5
    ours = sparse_teacher(q, kv, indices, scale=scale, block_n=block_n or TEACHER_BLOCK_N)
    ref = teacher_sparse(q.float(), kv.float(), indices, scale)
    dead = ours.masked_fill(live_slots(indices), 0.0).abs().max().item()
    return {"teacher": max_rel_error(ours, ref), "dead": dead, "seed": seed}


def parity(*, h: int = 32, dk: int = 128, dv: int = 64, index_heads: int = 32, index_dim: int = 64,
           device="cuda", dtype=torch.bfloat16) -> tuple[float, float, dict]:
    """Preflight's launch: ``(worst error, tolerance, details)`` over the sparse kernel, the dense path and
    the two indexer kernels (index scores, sparse teacher).

    b=2, s=160, topk=96: two top-k blocks (64 + a ragged 32), rows 0..94 with empty slots, one row with none;
    the index scores take 3 ragged 64-row blocks. The fp32 outputs of the indexer kernels are held to
    ``FP32_OUTPUT_TOLERANCE``; reported errors are scaled to the common tolerance (error * tol / own tol).
    """
    tol = TOLERANCE[dtype]
    sparse = compare(2, 160, h, dk, dv, 96, dtype=dtype, device=device, empty_rows=1)
    empty_out = sparse.pop("empty_row_out")
    dense = compare_dense(2, 160, h, dk, dv, dtype=dtype, device=device)
    scores = compare_index_scores(2, 160, index_heads, index_dim, dtype=dtype, device=device)
    teacher = compare_teacher(2, 160, h, dk, 96, dtype=dtype, device=device, empty_rows=1)
    fp32_scale = tol / FP32_OUTPUT_TOLERANCE
    indexer_worst = max(scores["dq"], scores["dk"],
                        fp32_scale * max(scores["scores"], scores["dw"], teacher["teacher"]),
                        math.inf if teacher["dead"] != 0 else 0.0)
    details = {"sparse": sparse, "dense": dense, "empty_row_out": empty_out, "index_scores": scores,
               "teacher": teacher}
    worst_all = max(worst(sparse), worst(dense), math.inf if empty_out != 0 else 0.0, indexer_worst)
    return worst_all, tol, details


def launch(spec) -> Measured:
    """Preflight's row on a real CUDA device (``PLUGIN.checks``): compile and launch the kernels once, forward and
    backward, against the reference, at the run's widths (NAM56R's without a run)."""
    from nam_plugin_sparse_mla.plugin import NAM56R_WIDTHS, widths

    w = widths(spec.model) if spec is not None else dict(NAM56R_WIDTHS)
    err, tol, details = parity(h=w["h"], dk=w["dk"], dv=w["dv"], index_heads=w["index_heads"],
                               index_dim=w["index_dim"], device="cuda")
    seeds = "seeds " + ", ".join(str(details[k]["seed"]) for k in ("sparse", "dense", "index_scores", "teacher"))
    needed = (f"kernel == reference within {tol:g} (out, dq, dkv; sparse and dense; index-score dq, dk; "
              "fp32 index scores, dw and sparse teacher within 1e-4)")
    return Measured(err <= tol, f"worst relative error {err:.2e} (b=2 s=160 h={w['h']} dk={w['dk']} dv={w['dv']} "
                    f"top-k 96, {w['index_heads']} index heads of {w['index_dim']}, bf16; {seeds})", needed)
