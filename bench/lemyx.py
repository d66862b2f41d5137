"""Benchmark: lemyx's fused warm-up kernel vs the unfused path, at NAM56R's DSA shapes on one GPU.

Rows (each: dense causal MLA attention output + the indexer's head-summed KL, forward and backward):

* ``lemyx fused``      the plugin's Triton kernel (one pass for o, scores and KL; no [h, s, s] anywhere);
* ``sdpa + KL``        the upstream baseline: torch's scaled_dot_product_attention (MQA via enable_gqa) for
                       the output, then the indexer scores and the KL as separate PyTorch ops
                       (nam56r.blocks.indexer, head by head, [b, s, s] fp32 tensors);
* ``reference``        the plugin's reference path (nam56r's reference attention core + the same KL).

Shapes: 32 heads over a 128-wide latent key (64 value), indexer 32 heads x 64, bf16, causal, sequence 4096.
Time: CUDA events, median of ``--iters`` after ``--warmup``; memory: peak allocated above the inputs.
Prints one table with ratios to the baseline and writes ``--json``.

    python bench/lemyx.py --batch 1 --seq 4096 --json bench/results/lemyx.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from timing import time_and_peak


def sdpa_plus_kl(q, kv, iq, ik, w, *, scale, d_v):
    from nam_plugin_lemyx.reference import kl_rows

    # [b, s, h, dk] -> [b, h, s, dk]; one KV head shared by all query heads.
    k = kv[:, None]  # [b, 1, s, dk]
    v = kv[:, None, :, :d_v]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=scale, enable_gqa=True)
    return o.transpose(1, 2), kl_rows(q, kv, iq, ik, w, scale=scale)


def measure(fn, inputs, *, warmup: int, iters: int) -> tuple[float, float]:
    """Median fwd+bwd milliseconds and peak extra GiB of ``fn(*inputs) -> (o, kl)``."""
    def clear():
        for t in inputs:
            t.grad = None

    def step():
        clear()
        o, kl = fn(*inputs)
        ((o.float() * 1e-3).sum() + kl.sum()).backward()

    return time_and_peak(step, clear, warmup=warmup, iters=iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--index-heads", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-reference", action="store_true", help="leave out the slow reference row")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from nam_plugin_lemyx.kernel import fused_warmup
    from nam_plugin_lemyx.reference import warmup_reference
    from nam_plugin_lemyx.selftest import random_inputs

    dk, dv, di = 128, 64, 64
    scale = dk**-0.5
    inputs = [t.requires_grad_() for t in random_inputs(args.batch, args.seq, args.heads, dk, args.index_heads, di,
                                                       dtype=torch.bfloat16, device="cuda", seed=0)]
    rows = [("lemyx fused", lambda *x: fused_warmup(*x, scale=scale, d_v=dv)),
            ("sdpa + KL (baseline)", lambda *x: sdpa_plus_kl(*x, scale=scale, d_v=dv))]
    if not args.skip_reference:
        rows.append(("reference", lambda *x: warmup_reference(*x, scale=scale, d_v=dv)))
    results = {}
    for name, fn in rows:
        ms, gib = measure(fn, inputs, warmup=args.warmup, iters=args.iters)
        results[name] = {"ms": ms, "peak_extra_gib": gib}
    base = results["sdpa + KL (baseline)"]
    print(f"lemyx warm-up, fwd+bwd, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"b={args.batch} s={args.seq} h={args.heads} dk={dk} dv={dv} index {args.index_heads}x{di}, bf16")
    print(f"| {'path':<22} | {'ms':>9} | {'speedup':>8} | {'peak extra GiB':>14} | {'memory ratio':>12} |")
    print(f"|{'-' * 24}|{'-' * 11}|{'-' * 10}|{'-' * 16}|{'-' * 14}|")
    for name, r in results.items():
        r["speedup_vs_baseline"] = base["ms"] / r["ms"]
        r["memory_vs_baseline"] = r["peak_extra_gib"] / base["peak_extra_gib"]
        print(f"| {name:<22} | {r['ms']:>9.2f} | {r['speedup_vs_baseline']:>7.2f}x | {r['peak_extra_gib']:>14.2f} "
              f"| {r['memory_vs_baseline']:>11.2f}x |")
    if args.json:
        import triton

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__,
            "shape": {"batch": args.batch, "seq": args.seq, "heads": args.heads, "dk": dk, "dv": dv,
                      "index_heads": args.index_heads, "index_dim": di, "dtype": "bfloat16"},
            "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
