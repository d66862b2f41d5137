"""Benchmark: sparse-mla's Triton kernels vs the reference gather path and dense SDPA, at NAM56R's DSA shapes.

Rows (each: the attention core's output and its gradients with respect to q and kv, forward + backward):

* ``sparse-mla``           the plugin's Triton kernels over the top-k keys (``SparseMLA.sparse``);
* ``reference gather``     ``ReferenceAttention().sparse``: gathers ``[b, s, topk, dk]`` keys, fp32 scores;
* ``sdpa dense``           the upstream baseline: torch's fused scaled_dot_product_attention, causal, over
                           every past key (MQA via enable_gqa; the plugin's ``dense``, math backend off).

Shapes: b=2, s=4096, 32 heads over a 128-wide latent key (value 64), top-k 256 (NAM56R), bf16. Indices are
the causal top-k of random scores (``selftest.random_inputs``), so rows before 255 have empty slots.
Time: CUDA events, median of ``--iters`` after ``--warmup``; memory: peak allocated above the inputs.
Prints one markdown table with ratios to the SDPA row and writes ``--json``.

    python bench/sparse_mla.py --json bench/results/sparse_mla.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from timing import time_and_peak


def measure(fn, q, kv, do, *, warmup: int, iters: int) -> tuple[float, float]:
    """Median fwd+bwd milliseconds and peak extra GiB of ``fn(q, kv) -> o`` with ``o.backward(do)``."""
    def clear():
        q.grad = kv.grad = None

    def step():
        clear()
        fn(q, kv).backward(do)

    return time_and_peak(step, clear, warmup=warmup, iters=iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip-reference", action="store_true", help="leave out the reference gather row")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from nam56r.reference.attention import ReferenceAttention
    from nam_plugin_sparse_mla.attention import SparseMLA
    from nam_plugin_sparse_mla.selftest import random_inputs

    dk, dv = 128, 64  # NAM56R: key = kv_lora 64 + rope 64, value = kv_lora 64
    scale = dk**-0.5
    q, kv, indices = random_inputs(args.batch, args.seq, args.heads, dk, args.topk, dtype=torch.bfloat16,
                                   device="cuda", seed=0)
    q.requires_grad_(), kv.requires_grad_()
    do = torch.randn(args.batch, args.seq, args.heads, dv, device="cuda", dtype=torch.bfloat16)
    core, ref = SparseMLA(), ReferenceAttention()
    baseline = "sdpa dense (baseline)"
    rows = [("sparse-mla", lambda q, kv: core.sparse(q, kv, indices, scale=scale, d_v=dv))]
    if not args.skip_reference:
        rows.append(("reference gather", lambda q, kv: ref.sparse(q, kv, indices, scale=scale, d_v=dv)))
    rows.append((baseline, lambda q, kv: core.dense(q, kv, scale=scale, d_v=dv)))
    results = {}
    for name, fn in rows:
        ms, gib = measure(fn, q, kv, do, warmup=args.warmup, iters=args.iters)
        results[name] = {"ms": ms, "peak_extra_gib": gib}
    base = results[baseline]
    print(f"sparse MLA, fwd+bwd, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"b={args.batch} s={args.seq} h={args.heads} dk={dk} dv={dv} top-k {args.topk}, bf16")
    print(f"| {'path':<22} | {'ms':>9} | {'speedup vs SDPA':>15} | {'peak extra GiB':>14} | {'memory vs SDPA':>14} |")
    print(f"|{'-' * 24}|{'-' * 11}|{'-' * 17}|{'-' * 16}|{'-' * 16}|")
    for name, r in results.items():
        r["speedup_vs_sdpa"] = base["ms"] / r["ms"]
        r["memory_vs_sdpa"] = r["peak_extra_gib"] / base["peak_extra_gib"]
        print(f"| {name:<22} | {r['ms']:>9.2f} | {r['speedup_vs_sdpa']:>14.2f}x | {r['peak_extra_gib']:>14.2f} "
              f"| {r['memory_vs_sdpa']:>13.2f}x |")
    if args.json:
        import triton

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__,
            "shape": {"batch": args.batch, "seq": args.seq, "heads": args.heads, "dk": dk, "dv": dv,
                      "topk": args.topk, "dtype": "bfloat16"},
            "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
