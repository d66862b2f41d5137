"""sparse-mla vs the reference on fresh random inputs: used by preflight, the tests and the benchmark.

Each call draws a fresh seed (returned, and printed with any failure) unless given one. Indices come the way
the model makes them: ``nam56r.blocks.indexer.causal_topk`` of random causal-masked scores, so row ``t < topk``
has ``topk - t - 1`` empty (-1) slots and every live index is distinct and <= t. The reference gets the
*same* low-precision values upcast to fp32, so the comparison measures the kernel's arithmetic, not the
inputs' rounding. Error per tensor: ``max |kernel - reference| / max |reference|``.
"""

from __future__ import annotations

import math

import torch

from nam_core.testing import max_rel_error, new_seed

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
"""Max relative-to-max error per tensor. The kernel's own arithmetic is ~fp32 (module docstring of kernel.py);
what remains is the output's and the gradients' final rounding to the input dtype (bf16: 8 mantissa bits,
~4e-3 per rounding; fp16: 11 bits, ~5e-4) and fp32 summation order."""



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
    from nam_plugin_sparse_mla.kernel import BLOCK_N, sparse_mla

    seed = new_seed() if seed is None else seed
    q, kv, indices = random_inputs(b, s, h, dk, topk, dtype=dtype, device=device, seed=seed,
                                   future_slots=future_slots, empty_rows=empty_rows)
    scale = dk**-0.5
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    do = torch.randn(b, s, h, dv, generator=g).to(device=device, dtype=dtype)

    qk, kvk = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, _lse = sparse_mla(qk, kvk, indices, scale=scale, d_v=dv, block_n=block_n or BLOCK_N)
    out.backward(do)

    qr, kvr = q.float().requires_grad_(), kv.float().requires_grad_()
    ref = ReferenceAttention().sparse(qr, kvr, indices, scale=scale, d_v=dv)
    ref.backward(do.float())

    errors = _errors(out, ref, (qk, kvk), (qr, kvr))
    if empty_rows:
        rows = sorted({(1 + 7 * n) % s for n in range(empty_rows)})
        errors["empty_row_out"] = out[:, rows].float().abs().max().item()
    errors["seed"] = seed
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
    do = torch.randn(b, s, h, dv, generator=g).to(device=device, dtype=dtype)

    qk, kvk = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = dense_attention(qk, kvk, scale=scale, d_v=dv)
    out.backward(do)
    qr, kvr = q.float().requires_grad_(), kv.float().requires_grad_()
    ref = ReferenceAttention().dense(qr, kvr, scale=scale, d_v=dv)
    ref.backward(do.float())
    return {**_errors(out, ref, (qk, kvk), (qr, kvr)), "seed": seed}


def _errors(out, ref, ours: tuple, theirs: tuple) -> dict[str, float]:
    """``out``, ``dq``, ``dkv`` errors; ``ours`` / ``theirs`` are the (q, kv) leaves of each side."""
    (q, kv), (q_ref, kv_ref) = ours, theirs
    return {"out": max_rel_error(out, ref), "dq": max_rel_error(q.grad, q_ref.grad),
            "dkv": max_rel_error(kv.grad, kv_ref.grad)}


def worst(errors: dict[str, float]) -> float:
    """The largest error of a ``compare`` result; NaN counts as infinitely bad."""
    return max((v if not math.isnan(v) else math.inf) for k, v in errors.items() if k != "seed")


def parity(*, h: int = 32, dk: int = 128, dv: int = 64, device="cuda",
           dtype=torch.bfloat16) -> tuple[float, float, dict]:
    """Preflight's launch: ``(worst error, tolerance, details)`` over the sparse kernel and the dense path.

    b=2, s=160, topk=96: two top-k blocks (64 + a ragged 32), rows 0..94 with empty slots, one row with none.
    """
    sparse = compare(2, 160, h, dk, dv, 96, dtype=dtype, device=device, empty_rows=1)
    empty_out = sparse.pop("empty_row_out")
    dense = compare_dense(2, 160, h, dk, dv, dtype=dtype, device=device)
    details = {"sparse": sparse, "dense": dense, "empty_row_out": empty_out}
    return max(worst(sparse), worst(dense), math.inf if empty_out != 0 else 0.0), TOLERANCE[dtype], details
