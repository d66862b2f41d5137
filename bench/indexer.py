"""Benchmark: sparse-mla's indexer kernels vs nam56r's pure-PyTorch reference, at NAM56R's DSA shapes.

Rows:

* ``index_scores fwd+bwd``   the lightning indexer's causal scores ``[b, s, s]`` fp32 from q ``[b, s, 32, 64]``,
                             k ``[b, s, 64]`` (bf16) and w ``[b, s, 32]`` (fp32), then dq, dk, dw from a random
                             incoming gradient. Reference: ``nam56r.blocks.indexer.index_scores`` (fp32 bmm per
                             head, recomputing backward); Triton: ``SparseMLAIndexerKernels().index_scores``.
* ``sparse_teacher``         the KL teacher over the top-k keys ``[b, s, 256]`` from MLA's q ``[b, s, 32, 128]``
                             and kv ``[b, s, 128]`` (bf16), no gradient. Reference:
                             ``nam56r.blocks.indexer.teacher_sparse`` (gathers ``[b, s, 256, 128]`` keys, fp32
                             einsum per head); Triton: ``SparseMLAIndexerKernels().sparse_teacher`` (gathers in the kernel).

Shapes: b=1, s=4096, NAM56R's widths; indices are the causal top-k of random scores
(``selftest.random_inputs``), so rows before 255 have empty slots. Time: CUDA events, median of ``--iters``
after ``--warmup``; memory: peak allocated above the inputs. Prints one markdown table with the speed-up and
memory ratio of Triton over the reference, and writes ``--json``.

    python bench/indexer.py --json bench/results/indexer.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from timing import time_and_peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--index-heads", type=int, default=32)
    ap.add_argument("--index-dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from nam56r.reference.attention import ReferenceIndexerKernels
    from nam_plugin_sparse_mla.attention import SparseMLAIndexerKernels
    from nam_plugin_sparse_mla.selftest import random_inputs

    b, s, hi, d = args.batch, args.seq, args.index_heads, args.index_dim
    dk = 128  # NAM56R: key = kv_lora 64 + rope 64
    scale = dk**-0.5
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(b, s, hi, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    k = torch.randn(b, s, d, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(b, s, hi, generator=g) * (hi * d) ** -0.5).cuda().requires_grad_()
    grad = torch.randn(b, s, s, device="cuda")
    tq, kv, indices = random_inputs(b, s, args.heads, dk, args.topk, dtype=torch.bfloat16, device="cuda", seed=1)

    def clear():
        q.grad = k.grad = w.grad = None

    results = {}
    for op in ("index_scores fwd+bwd", "sparse_teacher"):
        for path, core in (("reference", ReferenceIndexerKernels()), ("triton", SparseMLAIndexerKernels())):
            if op == "sparse_teacher":
                def step(core=core):
                    core.sparse_teacher(tq, kv, indices, scale=scale)
            else:
                def step(core=core):
                    clear()
                    core.index_scores(q, k, w).backward(grad)
            ms, gib = time_and_peak(step, clear, warmup=args.warmup, iters=args.iters)
            results.setdefault(op, {})[path] = {"ms": ms, "peak_extra_gib": gib}

    print(f"DSA indexer kernels, {torch.cuda.get_device_name()}, torch {torch.__version__}, b={b} s={s}, "
          f"index {hi} heads x {d}, teacher {args.heads} heads x {dk} top-k {args.topk}, bf16 inputs")
    print(f"| {'op':<20} | {'path':<9} | {'ms':>8} | {'speedup vs ref':>14} | {'peak extra GiB':>14} "
          f"| {'memory vs ref':>13} |")
    print(f"|{'-' * 22}|{'-' * 11}|{'-' * 10}|{'-' * 16}|{'-' * 16}|{'-' * 15}|")
    for op, paths in results.items():
        ref = paths["reference"]
        for path, r in paths.items():
            r["speedup_vs_reference"] = ref["ms"] / r["ms"]
            r["memory_vs_reference"] = r["peak_extra_gib"] / ref["peak_extra_gib"] if ref["peak_extra_gib"] else None
            mem = f"{r['memory_vs_reference']:.2f}x" if r["memory_vs_reference"] is not None else "-"
            print(f"| {op:<20} | {path:<9} | {r['ms']:>8.2f} | {r['speedup_vs_reference']:>13.2f}x "
                  f"| {r['peak_extra_gib']:>14.3f} | {mem:>13} |")
    if args.json:
        import triton

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__,
            "shape": {"batch": b, "seq": s, "index_heads": hi, "index_dim": d, "heads": args.heads, "dk": dk,
                      "topk": args.topk, "dtype": "bfloat16"},
            "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
